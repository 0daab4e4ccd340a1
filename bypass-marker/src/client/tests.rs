//! The client against scripted upstreams on 127.0.0.1.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::StatusCode;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt as _, Empty, Full, StreamBody};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

use super::head::{HeadRefusal, MAX_HEAD};
use super::reading::READ_MIN;
use super::{Client, SendError, UpstreamResponseBody};
use crate::args::Upstream;

/// An upstream on 127.0.0.1 that runs `script` on each connection it accepts (with the
/// connection's number, from 0), and counts them.
async fn upstream<F, Fut>(script: F) -> (Client, Arc<AtomicUsize>)
where
    F: Fn(usize, TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((io, _)) = listener.accept().await {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(script(n, io));
        }
    });
    let upstream = Upstream::parse(&format!("http://{addr}")).unwrap();
    (Client::new(upstream, Duration::from_secs(5), 16), accepted)
}

/// Reads one request, head and body (by its `content-length`, or up to the last chunk).
async fn read_request(io: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0; 4096];
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .map(|n| n.trim().parse::<usize>().unwrap());
            let complete = match len {
                Some(len) => got.len() >= end + 4 + len,
                None if head.contains("transfer-encoding: chunked") => got.ends_with(b"0\r\n\r\n"),
                None => true,
            };
            if complete {
                return got;
            }
        }
        let n = io.read(&mut buf).await.unwrap();
        if n == 0 {
            return got;
        }
        got.extend_from_slice(&buf[..n]);
    }
}

fn get(path: &str) -> http::request::Parts {
    http::Request::get(path).body(()).unwrap().into_parts().0
}

fn post(path: &str) -> http::request::Parts {
    http::Request::post(path).body(()).unwrap().into_parts().0
}

fn chunks(events: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for event in events {
        out.extend_from_slice(format!("{:x}\r\n", event.len()).as_bytes());
        out.extend_from_slice(event);
        out.extend_from_slice(b"\r\n");
    }
    out
}

const SSE_HEAD: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

/// Every frame of a body, or its error.
async fn frames(body: UpstreamResponseBody) -> Result<Vec<Bytes>, io::Error> {
    let mut body = std::pin::pin!(body);
    let mut frames = Vec::new();
    while let Some(frame) = body.frame().await {
        frames.push(frame?.into_data().unwrap());
    }
    Ok(frames)
}

#[tokio::test]
async fn a_read_that_carried_many_chunks_is_one_frame() {
    let event: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\" token\"}}]}\n\n";
    let (client, _) = upstream(move |_, mut io| async move {
        read_request(&mut io).await;
        let mut response = SSE_HEAD.to_vec();
        response.extend(chunks(&[event; 200]));
        response.extend_from_slice(b"0\r\n\r\n");
        io.write_all(&response).await.unwrap();
        let _ = io.read(&mut [0; 1]).await;
    })
    .await;
    let res = client
        .send(&get("/v1/stream"), Empty::<Bytes>::new())
        .await
        .unwrap();
    let frames = frames(res.into_body()).await.unwrap();
    // One write of 12 KiB arrives in one read on loopback: hyper's client made 200 frames.
    assert!(frames.len() <= 2, "{} frames", frames.len());
    assert_eq!(frames.concat(), event.repeat(200));
}

/// Counts its wake-ups.
#[derive(Default)]
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn after_a_frame_the_body_yields_once_before_reading_again() {
    let (more, wait) = tokio::sync::oneshot::channel::<()>();
    let wait = Mutex::new(Some(wait));
    let (client, _) = upstream(move |_, mut io| {
        let wait = wait.lock().unwrap().take().unwrap();
        async move {
            read_request(&mut io).await;
            let mut first = SSE_HEAD.to_vec();
            first.extend(chunks(&[b"data: 1\n\n"]));
            io.write_all(&first).await.unwrap();
            wait.await.unwrap();
            io.write_all(&chunks(&[b"data: 2\n\n"])).await.unwrap();
            let _ = io.read(&mut [0; 1]).await;
        }
    })
    .await;
    let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
    let mut body = std::pin::pin!(res.into_body());
    let count = Arc::new(Count::default());
    let waker = std::task::Waker::from(count.clone());
    let mut cx = Context::from_waker(&waker);
    let first = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await;
    assert_eq!(first.unwrap().unwrap().into_data().unwrap(), "data: 1\n\n");
    more.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The second event is in the socket; the body lets the first be written first.
    assert!(body.as_mut().poll_frame(&mut cx).is_pending());
    assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken at once");
    let second = body.as_mut().poll_frame(&mut cx);
    let Poll::Ready(Some(Ok(frame))) = second else {
        panic!("the next poll reads: {second:?}");
    };
    assert_eq!(frame.into_data().unwrap(), "data: 2\n\n");
}

/// An upstream that answers every request on a connection with `reply`.
fn answering(
    reply: &'static [u8],
) -> impl Fn(usize, TcpStream) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send {
    move |_, mut io| {
        Box::pin(async move {
            loop {
                if read_request(&mut io).await.is_empty() {
                    return;
                }
                if io.write_all(reply).await.is_err() {
                    return;
                }
            }
        })
    }
}

#[tokio::test]
async fn a_connection_is_reused_only_after_a_complete_response_that_does_not_close_it() {
    let cases: [(&'static [u8], usize); 6] = [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", 1),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            1,
        ),
        (
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
            3,
        ),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", 3),
        // Bytes after the body: they would be read as the next request's response.
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokXX", 3),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",
            3,
        ),
    ];
    for (reply, connections) in cases {
        let (client, accepted) = upstream(answering(reply)).await;
        for _ in 0..3 {
            let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
            assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"ok");
        }
        let what = String::from_utf8_lossy(reply);
        assert_eq!(accepted.load(Ordering::SeqCst), connections, "{what}");
    }
}

#[tokio::test]
async fn a_body_dropped_before_its_end_closes_its_connection() {
    let (closed, saw_close) = tokio::sync::oneshot::channel();
    let closed = Mutex::new(Some(closed));
    let (client, accepted) = upstream(move |n, mut io| {
        let closed = closed.lock().unwrap().take();
        async move {
            read_request(&mut io).await;
            if n == 0 {
                let mut reply = SSE_HEAD.to_vec();
                reply.extend(chunks(&[b"data: 1\n\n"]));
                io.write_all(&reply).await.unwrap();
                // The proxy cancels: the upstream sees its connection end.
                assert_eq!(io.read(&mut [0; 1]).await.unwrap(), 0);
                closed.unwrap().send(()).unwrap();
            } else {
                io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    .await
                    .unwrap();
            }
        }
    })
    .await;
    let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
    let mut body = Box::pin(res.into_body());
    body.frame().await.unwrap().unwrap();
    drop(body);
    tokio::time::timeout(Duration::from_secs(5), saw_close)
        .await
        .expect("the upstream connection was closed")
        .unwrap();
    client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_pooled_connection_the_upstream_closed_is_not_used() {
    let (client, accepted) = upstream(|_, mut io| async move {
        read_request(&mut io).await;
        io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await
            .unwrap();
        // Closed right after, without saying so: an upstream's keep-alive timeout.
    })
    .await;
    for _ in 0..3 {
        let res = client
            .send(&post("/"), Full::new(Bytes::from("{}")))
            .await
            .unwrap();
        assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"ok");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_request_cut_off_by_a_pooled_connection_closing_is_retried_only_if_idempotent() {
    for (parts, answered) in [(get("/"), true), (post("/"), false)] {
        let (client, accepted) = upstream(|n, mut io| async move {
            read_request(&mut io).await;
            io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            if n == 0 {
                // The next request is read, then the connection closes unanswered.
                read_request(&mut io).await;
            }
        })
        .await;
        let res = client.send(&parts, Empty::<Bytes>::new()).await.unwrap();
        frames(res.into_body()).await.unwrap();
        let second = client.send(&parts, Empty::<Bytes>::new()).await;
        assert_eq!(second.is_ok(), answered, "{}: {second:?}", parts.method);
        assert_eq!(accepted.load(Ordering::SeqCst), 1 + usize::from(answered));
    }
}

#[tokio::test]
async fn a_body_the_upstream_ends_early_is_an_error_and_one_that_closes_is_complete() {
    let cases: [(&'static [u8], Option<&str>); 3] = [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", None),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nshort\r\n",
            None,
        ),
        (
            b"HTTP/1.1 200 OK\r\n\r\nuntil the close",
            Some("until the close"),
        ),
    ];
    for (reply, complete) in cases {
        let (client, _) = upstream(move |_, mut io| async move {
            read_request(&mut io).await;
            io.write_all(reply).await.unwrap();
        })
        .await;
        let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
        let got = frames(res.into_body()).await;
        let what = String::from_utf8_lossy(reply);
        match complete {
            Some(data) => assert_eq!(got.unwrap().concat(), data.as_bytes(), "{what}"),
            None => assert_eq!(
                got.unwrap_err().kind(),
                io::ErrorKind::UnexpectedEof,
                "{what}"
            ),
        }
    }
}

#[tokio::test]
async fn interim_responses_are_skipped_and_bodiless_responses_end_at_their_head() {
    for (parts, reply) in [
        (
            get("/"),
            &b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"[..],
        ),
        (
            http::Request::head("/").body(()).unwrap().into_parts().0,
            b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n",
        ),
    ] {
        let (client, accepted) = upstream(answering(reply)).await;
        for _ in 0..2 {
            let res = client.send(&parts, Empty::<Bytes>::new()).await.unwrap();
            assert!(res.body().is_end_stream());
            assert!(frames(res.into_body()).await.unwrap().is_empty());
        }
        // Not reused: a body the upstream sent all the same would answer the next request.
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }
}

#[tokio::test]
async fn a_head_that_arrives_a_byte_at_a_time_is_read_whole() {
    let reply: &[u8] =
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nx-a: b\r\ncontent-length: 2\r\n\r\nok";
    let (client, _) = upstream(move |_, mut io| async move {
        read_request(&mut io).await;
        io.set_nodelay(true).unwrap();
        for byte in reply {
            io.write_all(&[*byte]).await.unwrap();
            tokio::task::yield_now().await;
        }
        let _ = io.read(&mut [0; 1]).await;
    })
    .await;
    let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
    assert_eq!(res.headers()["x-a"], "b");
    assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"ok");
}

#[tokio::test]
async fn a_head_that_is_not_http_or_is_ambiguous_fails_before_the_head() {
    let mut huge = b"HTTP/1.1 200 OK\r\n".to_vec();
    while huge.len() < MAX_HEAD + 10 {
        huge.extend_from_slice(b"x-filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    let huge: &'static [u8] = huge.leak();
    let interim: &'static [u8] = b"HTTP/1.1 100 Continue\r\n\r\n".repeat(17).leak();
    for reply in [
        &b"SSH-2.0-OpenSSH\r\n\r\n"[..],
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
        // Response splitting: which framing is the upstream's?
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nxx",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        // An empty coding after `chunked`: hyper reads such a body to the close, as no chunked.
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding:\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked,\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        interim,
        huge,
    ] {
        let (client, _) = upstream(answering(reply)).await;
        let parts = get("/");
        let sent = client.send(&parts, Empty::<Bytes>::new());
        let err = tokio::time::timeout(Duration::from_secs(5), sent)
            .await
            .expect("an answer")
            .unwrap_err();
        let what = String::from_utf8_lossy(&reply[..reply.len().min(80)]);
        assert!(matches!(err, SendError::BeforeHead(_)), "{what}: {err:?}");
    }
}

/// The refusal a response head gets, or `None` when it reaches the client.
async fn refusal(parts: &http::request::Parts, reply: &'static [u8]) -> Option<HeadRefusal> {
    let (client, _) = upstream(answering(reply)).await;
    let sent = client.send(parts, Empty::<Bytes>::new());
    match tokio::time::timeout(Duration::from_secs(5), sent)
        .await
        .expect("an answer")
    {
        Ok(_) => None,
        Err(SendError::BeforeHead(err)) => Some(
            *err.get_ref()
                .and_then(|e| e.downcast_ref::<HeadRefusal>())
                .unwrap_or_else(|| panic!("a refusal: {err:?}")),
        ),
        Err(err) => panic!("{err:?}"),
    }
}

/// hyper's limits (issue 34), each refused for its own reason: a `Content-Length` of 2^64 - 2 or
/// more framing a body (hyper keeps those two values for itself), and a head over 64 KiB however
/// it arrives, complete in one read included.
#[tokio::test]
async fn a_length_past_hypers_and_a_head_over_64_kib_are_refused_for_that_reason() {
    for (len, refused) in [
        (u64::MAX, true),
        (u64::MAX - 1, true),
        (u64::MAX - 2, false),
    ] {
        let reply = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\nok");
        let reply: &'static [u8] = reply.into_bytes().leak();
        let expected = refused.then_some(HeadRefusal::ContentLengthTooLarge);
        assert_eq!(refusal(&get("/"), reply).await, expected, "{len}");
        // A bodiless response's length frames nothing: hyper ignores it, and so does this client.
        let head = http::Request::head("/").body(()).unwrap().into_parts().0;
        assert_eq!(refusal(&head, reply).await, None, "HEAD, {len}");
    }
    // A head of 64 KiB and one byte, in one write: a read may bring it whole.
    for extra in [0, 1] {
        let mut head = b"HTTP/1.1 200 OK\r\nx-filler: ".to_vec();
        head.resize(MAX_HEAD + extra - 4, b'a');
        head.extend_from_slice(b"\r\n\r\n");
        assert_eq!(head.len(), MAX_HEAD + extra);
        let expected = (extra == 1).then_some(HeadRefusal::HeadTooLarge);
        assert_eq!(refusal(&get("/"), head.leak()).await, expected, "{extra}");
    }
    // The limit is each head's (with the empty lines before it), interim ones included, not the
    // sum of them.
    let mut heads = Vec::new();
    for _ in 0..3 {
        heads.extend_from_slice(&b"\r\n".repeat(15_000));
        heads.extend_from_slice(b"HTTP/1.1 103 Early Hints\r\nx-filler: ");
        heads.resize(heads.len() + 30_000, b'a');
        heads.extend_from_slice(b"\r\n\r\n");
    }
    heads.extend_from_slice(b"\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n");
    assert_eq!(refusal(&get("/"), heads.leak()).await, None);
}

/// Both framings are refused as such, whatever the length says (the differential test excuses
/// the refusal for that reason only).
#[tokio::test]
async fn transfer_encoding_with_any_content_length_is_refused_for_both_framings() {
    for reply in [
        &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n"[..],
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\ncontent-length: abc\r\n\r\n",
    ] {
        assert_eq!(
            refusal(&get("/"), reply).await,
            Some(HeadRefusal::TransferEncodingAndContentLength)
        );
    }
}

#[tokio::test]
async fn request_bodies_are_framed_by_length_or_chunked() {
    let (seen, mut requests) = tokio::sync::mpsc::unbounded_channel();
    let (client, _) = upstream(move |_, mut io| {
        let seen = seen.clone();
        async move {
            loop {
                let request = read_request(&mut io).await;
                if request.is_empty() {
                    return;
                }
                seen.send(request).unwrap();
                io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    .await
                    .unwrap();
            }
        }
    })
    .await;
    let mut parts = post("/v1/chat/completions");
    parts
        .headers
        .insert(header::HOST, HeaderValue::from_static("up"));
    // A stale length from the client is never sent: the body's own is.
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from_static("99"));
    client
        .send(&parts, Full::new(Bytes::from("{\"a\":1}")))
        .await
        .unwrap();
    assert_eq!(
        requests.recv().await.unwrap(),
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: up\r\ncontent-length: 7\r\n\r\n{\"a\":1}"
    );
    let pieces = futures_util::stream::iter(
        ["ab", "cde"].map(|s| Ok::<_, io::Error>(Frame::data(Bytes::from(s)))),
    );
    client.send(&parts, StreamBody::new(pieces)).await.unwrap();
    assert_eq!(
        requests.recv().await.unwrap(),
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: up\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"
    );
    client
        .send(&get("/v1/models"), Empty::<Bytes>::new())
        .await
        .unwrap();
    assert_eq!(
        requests.recv().await.unwrap(),
        b"GET /v1/models HTTP/1.1\r\n\r\n"
    );
}

/// A streamed request body of `len` bytes, of unknown length.
fn upload(len: usize) -> impl Body<Data = Bytes, Error = io::Error> {
    let piece = Bytes::from(vec![b'x'; 16 * 1024]);
    let pieces = (0..len / piece.len()).map(move |_| Ok(Frame::data(piece.clone())));
    StreamBody::new(futures_util::stream::iter(pieces))
}

#[tokio::test]
async fn an_answer_before_the_request_body_is_sent_is_the_response() {
    for close in [true, false] {
        let (client, _) = upstream(move |_, mut io| async move {
            // The head only, then the refusal; then close, or stop reading and wait.
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                let mut byte = [0];
                io.read_exact(&mut byte).await.unwrap();
                head.push(byte[0]);
            }
            io.write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nbig")
                .await
                .unwrap();
            if !close {
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
        })
        .await;
        let parts = post("/upload");
        let sent = client.send(&parts, upload(16 << 20));
        let res = tokio::time::timeout(Duration::from_secs(10), sent)
            .await
            .unwrap_or_else(|_| panic!("no answer (close: {close})"))
            .unwrap();
        assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"big");
    }
}

/// A body whose length is not the one it declared.
struct Lying(Option<Bytes>, u64);

impl Body for Lying {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        Poll::Ready(self.0.take().map(|data| Ok(Frame::data(data))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.1)
    }
}

#[tokio::test]
async fn a_request_body_that_is_not_its_declared_length_fails() {
    let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
    let (client, _) = upstream(answering(reply)).await;
    for (len, declared) in [(10, 100_000), (100_010, 100_000), (10, 5), (3, 5)] {
        let body = Lying(Some(Bytes::from(vec![b'x'; len])), declared);
        let err = client.send(&post("/"), body).await.unwrap_err();
        assert!(
            matches!(err, SendError::RequestBody(_)),
            "{len}/{declared}: {err:?}"
        );
    }
}

#[tokio::test]
async fn a_failed_body_stays_failed() {
    let reply = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n";
    let (client, _) = upstream(answering(reply)).await;
    let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
    let mut body = Box::pin(res.into_body());
    assert!(body.frame().await.unwrap().is_err());
    assert!(body.frame().await.unwrap().is_err(), "never a clean end");
}

#[tokio::test]
async fn a_quiet_stream_holds_a_small_buffer_and_a_busy_one_reads_more_at_once() {
    let (go, wait) = tokio::sync::oneshot::channel::<()>();
    let wait = Mutex::new(Some(wait));
    let (client, _) = upstream(move |_, mut io| {
        let wait = wait.lock().unwrap().take().unwrap();
        async move {
            read_request(&mut io).await;
            io.write_all(SSE_HEAD).await.unwrap();
            for _ in 0..20 {
                io.write_all(&chunks(&[b"data: 1\n\n"])).await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            wait.await.unwrap();
            let big = vec![b'y'; 1 << 20];
            io.write_all(&chunks(&[&big])).await.unwrap();
            io.write_all(b"0\r\n\r\n").await.unwrap();
        }
    })
    .await;
    let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
    let mut body = Box::pin(res.into_body());
    let mut got = 0;
    while got < 20 * 9 {
        got += body
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_data()
            .unwrap()
            .len();
    }
    let held = body.read.buf.capacity();
    assert!(held <= 2 * READ_MIN, "a quiet stream holds {held} bytes");
    go.send(()).unwrap();
    let mut largest = 0;
    while let Some(frame) = body.frame().await {
        largest = largest.max(frame.unwrap().into_data().unwrap().len());
    }
    assert!(largest > READ_MIN, "reads grew: {largest}");
}

#[tokio::test]
async fn empty_lines_before_the_status_line_are_skipped_even_when_they_arrive_alone() {
    let (client, _) = upstream(move |_, mut io| async move {
        read_request(&mut io).await;
        io.set_nodelay(true).unwrap();
        for piece in [
            &b"\r\n\r\n"[..],
            b"\n\r",
            b"\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        ] {
            io.write_all(piece).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = io.read(&mut [0; 1]).await;
    })
    .await;
    let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"ok");
}

#[tokio::test]
async fn content_length_is_checked_on_every_response_and_a_repeated_value_goes_on_once() {
    let head = || http::Request::head("/").body(()).unwrap().into_parts().0;
    let cases: [(http::request::Parts, &'static [u8], Option<&str>); 7] = [
        (
            get("/"),
            b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\nok",
            Some("2"),
        ),
        (
            get("/"),
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\nok",
            Some("2"),
        ),
        (
            head(),
            b"HTTP/1.1 200 OK\r\ncontent-length: 7, 7\r\n\r\n",
            Some("7"),
        ),
        (
            head(),
            b"HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\n",
            None,
        ),
        (
            head(),
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\n",
            None,
        ),
        (
            get("/"),
            b"HTTP/1.1 204 No Content\r\ncontent-length: -1\r\n\r\n",
            None,
        ),
        (
            get("/"),
            b"HTTP/1.1 304 Not Modified\r\ncontent-length: 5, 7\r\n\r\n",
            None,
        ),
    ];
    for (parts, reply, len) in cases {
        let (client, _) = upstream(answering(reply)).await;
        let sent = client.send(&parts, Empty::<Bytes>::new()).await;
        let what = String::from_utf8_lossy(reply);
        match len {
            Some(len) => {
                let res = sent.unwrap();
                let values: Vec<_> = res
                    .headers()
                    .get_all(header::CONTENT_LENGTH)
                    .iter()
                    .collect();
                assert_eq!(values, [len], "{what}");
            }
            None => assert!(
                matches!(sent, Err(SendError::BeforeHead(_))),
                "{what}: {sent:?}"
            ),
        }
    }
}

/// The idle pool's promise: no idle connection outlives `IDLE_FOR` (the sweep once ran every
/// `IDLE_FOR`, so a connection could wait up to twice that).
#[tokio::test]
async fn an_idle_connection_is_closed_when_its_time_is_up_not_at_the_next_sweep() {
    use super::pool::{Pool, IDLE_FOR};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut sockets = Vec::new();
    for _ in 0..2 {
        sockets.push(TcpStream::connect(addr).await.unwrap());
        listener.accept().await.unwrap();
    }
    tokio::time::pause();
    let pool = Arc::new(Pool {
        idle: Mutex::new(Vec::new()),
        max_idle: 16,
    });
    tokio::spawn(Pool::sweep(Arc::downgrade(&pool)));
    tokio::task::yield_now().await;
    tokio::time::advance(IDLE_FOR / 3).await;
    pool.checkin(sockets.pop().unwrap());
    tokio::time::advance(IDLE_FOR / 3).await;
    pool.checkin(sockets.pop().unwrap());
    // The first one's time is up: it is closed, the second waits on.
    tokio::time::advance(IDLE_FOR * 2 / 3 + Duration::from_millis(5)).await;
    tokio::task::yield_now().await;
    assert_eq!(pool.lock().len(), 1);
    tokio::time::advance(IDLE_FOR / 3).await;
    tokio::task::yield_now().await;
    assert_eq!(pool.lock().len(), 0);
}

/// A streamed request body of `len` bytes of unknown length, in pieces of 16 KiB.
fn streamed(len: usize) -> impl Body<Data = Bytes, Error = io::Error> + Send + 'static {
    let piece = Bytes::from(vec![b'x'; 16 * 1024]);
    let pieces = (0..len.div_ceil(piece.len())).map(move |i| {
        let size = piece.len().min(len - i * piece.len());
        Ok(Frame::data(piece.slice(..size)))
    });
    StreamBody::new(futures_util::stream::iter(pieces))
}

/// RFC 9112 section 9.6, hyper's behaviour: an upstream that answers at once and then reads the
/// body (a streaming server) gets all of it; the upload once stopped at the head and hung.
#[tokio::test]
async fn an_upstream_that_answers_at_once_and_reads_on_gets_the_whole_body() {
    for len in [200_000, 4 << 20] {
        let (client, _) = upstream(move |_, mut io| async move {
            let mut got = Vec::new();
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let mut buf = [0; 1024];
                let n = io.read(&mut buf).await.unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            io.write_all(SSE_HEAD).await.unwrap();
            io.write_all(&chunks(&[b"data: started\n\n"]))
                .await
                .unwrap();
            // The rest of the request, up to its last chunk.
            while !got.ends_with(b"\r\n0\r\n\r\n") {
                let mut buf = [0; 64 * 1024];
                let n = io.read(&mut buf).await.unwrap();
                assert!(n > 0, "the upload stopped at {} bytes", got.len());
                got.extend_from_slice(&buf[..n]);
            }
            let received = got.len();
            let done = format!("data: read {received} bytes\n\n");
            io.write_all(&chunks(&[done.as_bytes()])).await.unwrap();
            io.write_all(b"0\r\n\r\n").await.unwrap();
            let _ = io.read(&mut [0; 1]).await;
        })
        .await;
        let exchange = async {
            let res = client.send(&post("/"), streamed(len)).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
            frames(res.into_body()).await.unwrap().concat()
        };
        let body = tokio::time::timeout(Duration::from_secs(20), exchange)
            .await
            .unwrap_or_else(|_| panic!("{len} bytes: the exchange hung"));
        let body = String::from_utf8(body).unwrap();
        assert!(body.starts_with("data: started\n\ndata: read "), "{body}");
    }
}

/// hyper's behaviour (issue 34): a response complete while its request body is still being sent
/// leaves the connection for the pool once the upload ends well; it was closed.
#[tokio::test]
async fn a_connection_whose_upload_ends_after_its_response_goes_back_to_the_pool() {
    let (client, accepted) = upstream(|_, mut io| async move {
        let mut got = Vec::new();
        let mut buf = [0; 4096];
        loop {
            // Each request's head, answered at once; a POST's chunked body read after that.
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                match io.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            if got.starts_with(b"POST") {
                while !got.ends_with(b"\r\n0\r\n\r\n") {
                    match io.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
            }
            got.clear();
        }
    })
    .await;
    let (open, gate) = tokio::sync::oneshot::channel::<()>();
    let first = futures_util::stream::iter([Ok::<_, io::Error>(Frame::data(Bytes::from_static(
        b"first",
    )))]);
    let last = futures_util::stream::once(async move {
        let _ = gate.await;
        Ok(Frame::data(Bytes::from_static(b"last")))
    });
    let body = StreamBody::new(futures_util::StreamExt::chain(first, last));
    let res = client.send(&post("/"), body).await.unwrap();
    assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"ok");
    // The response is complete, the upload is not: it ends now.
    open.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
    assert_eq!(frames(res.into_body()).await.unwrap().concat(), b"ok");
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one connection for both"
    );
}

/// A response body from an upstream that goes silent is cut after the idle timeout: an error
/// (never a clean end), its connection closed, the expiry reported.
#[tokio::test]
async fn an_upstream_silent_after_its_head_is_cut_after_the_idle_timeout() {
    let (closed, saw_close) = tokio::sync::oneshot::channel();
    let closed = Mutex::new(Some(closed));
    let (client, _) = upstream(move |_, mut io| {
        let closed = closed.lock().unwrap().take();
        async move {
            read_request(&mut io).await;
            let mut reply = SSE_HEAD.to_vec();
            reply.extend(chunks(&[b"data: 1\n\n"]));
            io.write_all(&reply).await.unwrap();
            // Silent from now on; the proxy closes.
            assert_eq!(io.read(&mut [0; 1]).await.unwrap(), 0);
            closed.unwrap().send(()).unwrap();
        }
    })
    .await;
    let expired = Arc::new(AtomicUsize::new(0));
    let counted = expired.clone();
    let client = client.idle_timeout(Duration::from_millis(300), move || {
        counted.fetch_add(1, Ordering::SeqCst);
    });
    let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
    let mut body = Box::pin(res.into_body());
    let first = body.frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "data: 1\n\n");
    let next = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("the idle timeout ends the body");
    assert_eq!(next.unwrap().unwrap_err().kind(), io::ErrorKind::TimedOut);
    assert!(body.frame().await.unwrap().is_err(), "never a clean end");
    assert_eq!(expired.load(Ordering::SeqCst), 1);
    tokio::time::timeout(Duration::from_secs(10), saw_close)
        .await
        .expect("the upstream connection was closed")
        .unwrap();
}

/// A steady stream slower than the idle timeout in total, but never pausing that long, is whole.
#[tokio::test]
async fn a_stream_that_never_pauses_for_the_idle_timeout_is_not_cut() {
    let (client, _) = upstream(move |_, mut io| async move {
        read_request(&mut io).await;
        io.write_all(SSE_HEAD).await.unwrap();
        for _ in 0..10 {
            io.write_all(&chunks(&[b"data: 1\n\n"])).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        io.write_all(b"0\r\n\r\n").await.unwrap();
        let _ = io.read(&mut [0; 1]).await;
    })
    .await;
    let client = client.idle_timeout(Duration::from_millis(300), || {});
    let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
    let body = frames(res.into_body()).await.unwrap().concat();
    assert_eq!(body, b"data: 1\n\n".repeat(10));
}

/// A final error that closes the connection says the upstream will not read the rest: the
/// upload stops there, while the response is still streaming (the upstream sees the request end,
/// far short of its length).
#[tokio::test]
async fn a_final_error_with_connection_close_stops_the_upload() {
    let (read_all, got) = tokio::sync::oneshot::channel();
    let read_all = Mutex::new(Some(read_all));
    let (client, _) = upstream(move |_, mut io| {
        let read_all = read_all.lock().unwrap().take();
        async move {
            let mut total = 0;
            let mut buf = vec![0; 64 * 1024];
            total += io.read(&mut buf).await.unwrap();
            let mut reply = b"HTTP/1.1 413 Payload Too Large\r\nconnection: close\r\n\
                              transfer-encoding: chunked\r\n\r\n"
                .to_vec();
            reply.extend(chunks(&[b"big"]));
            io.write_all(&reply).await.unwrap();
            // Reads on until the proxy stops sending; then the end of the response.
            loop {
                match io.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => total += n,
                }
            }
            read_all.unwrap().send(total).unwrap();
            let _ = io.write_all(b"0\r\n\r\n").await;
        }
    })
    .await;
    let len = 64 << 20;
    let res = client.send(&post("/upload"), streamed(len)).await.unwrap();
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let mut body = Box::pin(res.into_body());
    let first = body.frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "big");
    let total = tokio::time::timeout(Duration::from_secs(20), got)
        .await
        .expect("the upload stopped")
        .unwrap();
    assert!(total < len, "{total} bytes sent");
}

/// hyper's verdict: a trailer section that does not parse as header fields fails the body, which
/// the client then sees cut, not complete; the connection is not reused.
#[tokio::test]
async fn a_malformed_trailer_section_cuts_the_body_and_a_sound_one_completes_it() {
    for (reply, complete) in [
        (&b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nbad trailer\r\n\r\n"[..], false),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx bad: 1\r\n\r\n", false),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-a: 1\r\n x-fold\r\n\r\n", false),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-sum: 1\r\n\r\n", true),
    ] {
        let (client, accepted) = upstream(answering(reply)).await;
        for _ in 0..2 {
            let res = client.send(&get("/"), Empty::<Bytes>::new()).await.unwrap();
            let got = frames(res.into_body()).await;
            let what = String::from_utf8_lossy(reply);
            if complete {
                assert_eq!(got.unwrap().concat(), b"ok", "{what}");
            } else {
                let err = got.unwrap_err();
                assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{what}");
                assert!(err.to_string().contains("trailer"), "{what}: {err}");
            }
        }
        let connections = if complete { 1 } else { 2 };
        assert_eq!(accepted.load(Ordering::SeqCst), connections);
    }
}
