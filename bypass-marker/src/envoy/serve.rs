use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use futures_core::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;
use tonic::transport::server::Connected;
use tonic::transport::Server;

use super::connection::Origin;
use super::{ExtProc, ExtProcService};
use crate::conn::is_connection_error;

/// The most concurrent gRPC streams (HTTP requests in Envoy) [`serve`] allows on one HTTP/2
/// connection, advertised in its `SETTINGS_MAX_CONCURRENT_STREAMS`: Envoy opens another
/// connection for the streams past it (its HTTP/2 pool establishes as many as it needs). Without a
/// limit, one client could open streams on a connection until memory runs out; with it, 1,000
/// concurrent streams from one Envoy worker still share one connection.
pub const MAX_CONCURRENT_STREAMS: u32 = 1024;

/// Serves `processor` and gRPC health (`grpc.health.v1`) on `listener` until `shutdown`
/// completes, then stops gracefully.
///
/// Health reports `SERVING` for the empty service name and for
/// `envoy.service.ext_proc.v3.ExternalProcessor` while the server runs. When `shutdown` completes
/// both turn `NOT_SERVING`, the listener stops accepting, open connections are told to go away
/// (HTTP/2 GOAWAY) and the function returns once the streams in flight have ended: requests that
/// Envoy already sent through the processor finish normally.
///
/// When the process runs out of file descriptors (or memory), accepting backs off (10 ms,
/// doubling to 1 s) instead of retrying at once, and serves again once they are free; the
/// connections wait in the listen queue meanwhile.
///
/// A stream that arrives in Envoy's `observability_mode` fails, as every such stream does (see the
/// [module docs](super)); with the `tracing` feature (or `cli`) one `error` line says why, once
/// per connection.
pub async fn serve(
    listener: TcpListener,
    processor: ExtProc,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    reporter.set_serving::<ExtProcService>().await;
    let signal = async move {
        shutdown.await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        reporter.set_not_serving::<ExtProcService>().await;
    };
    Server::builder()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .add_service(health)
        .add_service(processor.into_service())
        .serve_with_incoming_shutdown(Accepting::new(listener), signal)
        .await
}

/// The listener's connections, with `TCP_NODELAY` (answers are small and must not wait), and a
/// back-off when accepting fails for want of resources. tonic's own loop retries such a failure
/// at once, which spins a core for as long as the descriptors are gone.
struct Accepting {
    listener: TcpListener,
    backoff: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Accepting {
    fn new(listener: TcpListener) -> Self {
        Self {
            listener,
            backoff: Duration::ZERO,
            sleep: None,
        }
    }
}

impl Stream for Accepting {
    type Item = io::Result<Connection>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(sleep) = self.sleep.as_mut() {
                ready!(sleep.as_mut().poll(cx));
                self.sleep = None;
            }
            match ready!(self.listener.poll_accept(cx)) {
                Ok((stream, _)) => {
                    self.backoff = Duration::ZERO;
                    // Only a socket option: a connection that cannot take it is served anyway.
                    let _ = stream.set_nodelay(true);
                    return Poll::Ready(Some(Ok(Connection::new(stream))));
                }
                // That one connection went away before it was accepted: take the next.
                Err(err) if is_connection_error(&err) => {}
                // Out of file descriptors (EMFILE, ENFILE) or memory: wait before trying again.
                Err(_) => {
                    self.backoff =
                        (self.backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                    self.sleep = Some(Box::pin(tokio::time::sleep(self.backoff)));
                }
            }
        }
    }
}

/// An accepted connection and its [`Origin`], which tonic puts into every request on it
/// (`Connected::connect_info`): what the processor logs once per connection is tracked there.
struct Connection {
    stream: TcpStream,
    origin: Origin,
}

impl Connection {
    fn new(stream: TcpStream) -> Self {
        let origin = Origin::connection(stream.peer_addr().ok());
        Self { stream, origin }
    }
}

impl Connected for Connection {
    type ConnectInfo = Origin;

    fn connect_info(&self) -> Origin {
        self.origin.clone()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
