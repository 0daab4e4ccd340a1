//! The upstream connection a response body reads: whole, or its read half while the request
//! body is still being sent on the write half (an upstream that answered early and reads on).

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use super::SendError;

/// The rest of a request body being sent, in a task of its own, which gives back the write half
/// and how the sending ended. Dropped, it stops the task (and so closes the write half).
#[derive(Debug)]
pub(super) struct Upload(pub(super) JoinHandle<(OwnedWriteHalf, Result<(), SendError>)>);

impl Drop for Upload {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An upstream connection, as a response body reads it.
#[derive(Debug)]
pub(super) enum Connection {
    Whole(TcpStream),
    /// The read half; the write half is still sending the request body (`Some`), or was dropped
    /// (the upstream said it would not read the rest).
    Half(OwnedReadHalf, Option<Upload>),
}

impl Connection {
    /// The whole connection, if the request went out whole on it: for the pool. An upload that
    /// failed leaves the connection out of step: `None` (it is closed). An upload still in
    /// progress: `Err`, the connection to wait for ([`Sending::sent`]).
    pub(super) fn into_reusable(self) -> Result<Option<TcpStream>, Sending> {
        match self {
            Self::Whole(io) => Ok(Some(io)),
            Self::Half(_, None) => Ok(None),
            Self::Half(read, Some(mut upload)) => {
                if !upload.0.is_finished() {
                    return Err(Sending(read, upload));
                }
                let mut cx = Context::from_waker(std::task::Waker::noop());
                match Pin::new(&mut upload.0).poll(&mut cx) {
                    Poll::Ready(Ok((write, Ok(())))) => Ok(read.reunite(write).ok()),
                    _ => Ok(None),
                }
            }
        }
    }
}

/// A connection whose response is complete while its request body is still being sent.
#[derive(Debug)]
pub(super) struct Sending(OwnedReadHalf, Upload);

impl Sending {
    /// The whole connection once the request body is sent, if it went well.
    pub(super) async fn sent(self) -> Option<TcpStream> {
        let Self(read, mut upload) = self;
        match (&mut upload.0).await {
            Ok((write, Ok(()))) => read.reunite(write).ok(),
            _ => None,
        }
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Whole(io) => Pin::new(io).poll_read(cx, buf),
            Self::Half(read, _) => Pin::new(read).poll_read(cx, buf),
        }
    }
}
