//! Issue 48 at the sidecar's front door: an upstream that answers an event stream with a transfer
//! coding other than `chunked`, or a `204`/`304` (or the response to `HEAD`) with bytes after its
//! head, and a client's `TE: gzip`. Real servers on 127.0.0.1: the proxy (`bypass_marker::serve`,
//! the code the binary runs), a raw-TCP upstream that writes every byte itself and records the
//! request heads it reads, and raw-TCP or h2 clients.
//!
//! The sidecar serves HTTP/1.1 only (`hyper::server::conn::http1`): an h2c client with prior
//! knowledge gets no response at all, which the last test pins, so every marker check here is over
//! HTTP/1.1. The tower layer's own h2 path (the `emptied` body of a 204/304, which hyper's h2
//! server would otherwise send as DATA frames) is the library's, covered by its tests.

use bypass_marker as proxy;

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use support::{proxy_args, raw_exchange, split_head, stopped, PATIENCE};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

const MARKER: &str = "event: x-bypass-remote-prefill\n: true\n\n";

/// A proxy served in the background, stopped when dropped.
struct Proxy {
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
}

async fn start_proxy(upstream: SocketAddr, args: &[&str]) -> Proxy {
    let config = proxy_args(&format!("http://{upstream}"), args);
    let listener = proxy::bind(config.listen, config.backlog).unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, rx) = oneshot::channel::<()>();
    tokio::spawn(proxy::serve(listener, config, stopped(rx)));
    Proxy { addr, _stop: stop }
}

/// The request heads a [`raw_upstream`] has read, in order.
type Heads = Arc<Mutex<Vec<String>>>;

/// An upstream on raw TCP that serves any number of requests on each connection it accepts: for
/// each request head it reads (byte by byte, nothing after it), it records the head and writes
/// `answer(head)` in one write, then reads the next head; it closes when `answer` says so.
async fn raw_upstream<F>(answer: F) -> (SocketAddr, Heads)
where
    F: Fn(&str) -> (Vec<u8>, bool) + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Heads::default();
    let seen = heads.clone();
    let answer = Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let (seen, answer) = (seen.clone(), answer.clone());
            tokio::spawn(async move {
                while let Some(head) = read_head(&mut conn).await {
                    seen.lock().unwrap().push(head.clone());
                    let (reply, close) = answer(&head);
                    if conn.write_all(&reply).await.is_err() || close {
                        return;
                    }
                }
            });
        }
    });
    (addr, heads)
}

/// A request head, read byte by byte; `None` when the connection ends first.
async fn read_head(conn: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        if conn.read(&mut byte).await.unwrap_or(0) == 0 {
            return None;
        }
        head.push(byte[0]);
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// The path of a request head's request line.
fn path(head: &str) -> &str {
    head.split(' ').nth(1).unwrap_or("")
}

/// `data` gzip-compressed.
fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(data).unwrap();
    gz.finish().unwrap()
}

/// `data` in one chunk, then the last chunk.
fn chunked(data: &[u8]) -> Vec<u8> {
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n0\r\n\r\n");
    out
}

/// A streaming chat request for the proxy with `annotations` (a JSON array) as its opt-in, on a
/// connection the proxy closes after the response.
fn chat(annotations: &str) -> Vec<u8> {
    let body = format!(r#"{{"model":"m","stream":true,"nvext":{{"annotations":{annotations}}}}}"#);
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The content of a response body as the proxy framed it: decoded when its head says `chunked`
/// (the proxy re-chunks what it streams), as it is otherwise.
fn content(head: &str, body: &[u8]) -> Vec<u8> {
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return body.to_vec();
    }
    let (mut rest, mut out) = (body, Vec::new());
    loop {
        let line = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("a chunk size");
        let size = std::str::from_utf8(&rest[..line]).unwrap();
        let size = usize::from_str_radix(size.split(';').next().unwrap().trim(), 16).unwrap();
        rest = &rest[line + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// Whether `hay` holds `needle` anywhere.
fn holds(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Asserts that a raw response is the sidecar's 502 for an upstream response head its client
/// refuses (`upstream_failed`: `Transfer-Encoding` other than one `chunked` is such a head), in
/// OpenAI's shape, with no byte of the upstream's stream, plain or encoded.
fn assert_refused(response: &[u8], what: &str, encoded: &[u8]) {
    let (head, body) = split_head(response);
    assert!(head.starts_with("HTTP/1.1 502 "), "{what}: {head}");
    let lower = head.to_ascii_lowercase();
    assert!(
        lower.contains("content-type: application/json"),
        "{what}: {head}"
    );
    assert!(!lower.contains("transfer-encoding: gzip"), "{what}: {head}");
    assert!(!lower.contains("event-stream"), "{what}: {head}");
    let json: serde_json::Value = serde_json::from_slice(body).expect("a JSON error body");
    assert_eq!(json["error"]["code"], "upstream_failed", "{what}: {json}");
    assert_eq!(json["error"]["type"], "upstream_error", "{what}: {json}");
    assert!(!holds(response, b"x-bypass-remote-prefill"), "{what}");
    assert!(!holds(response, b"data: {"), "{what}");
    // No piece of the gzip stream (its magic and the deflate data after its 10-byte header).
    assert!(!holds(response, &encoded[..2]), "{what}: the gzip magic");
    assert!(!holds(response, &encoded[10..20]), "{what}: gzip data");
}

/// (a) An event stream whose transfer coding is not `chunked` alone (`gzip, chunked`: the content
/// gzip-compressed, then chunked) is never read or forwarded: the sidecar's own client refuses the
/// head (`HeadRefusal::NotChunked`), so every client gets the 502 `upstream_failed`, whether or not
/// it has something to remove, with or without the layer, and no byte of the stream. The upstream
/// connection is not reused.
#[tokio::test]
async fn an_event_stream_with_a_transfer_coding_other_than_chunked_is_a_502_and_no_byte() {
    let events = format!("{MARKER}data: {{\"x\":1}}\n\n{MARKER}data: [DONE]\n\n");
    let encoded = gzip(events.as_bytes());
    for coding in [
        "gzip, chunked",
        "deflate,chunked",
        "x-custom, Chunked",
        "gzip\r\nTransfer-Encoding: chunked",
        "chunked, gzip",
    ] {
        let body = chunked(&encoded);
        let (upstream, heads) = raw_upstream(move |_| {
            let mut reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                 transfer-encoding: {coding}\r\n\r\n"
            )
            .into_bytes();
            reply.extend_from_slice(&body);
            (reply, false)
        })
        .await;
        for args in [&[][..], &["--no-layer"][..]] {
            let proxy = start_proxy(upstream, args).await;
            for annotations in ["[]", r#"["x-bypass-remote-prefill"]"#] {
                let response = raw_exchange(proxy.addr, &chat(annotations)).await;
                assert_refused(
                    &response,
                    &format!("{coding} {args:?} {annotations}"),
                    &encoded,
                );
            }
        }
        // Each request reached the upstream, on a connection of its own: none was reused after
        // the refused head.
        assert_eq!(heads.lock().unwrap().len(), 4, "{coding}");
    }
}

/// The control: the same stream framed by `chunked` alone is read, and the marker removed.
#[tokio::test]
async fn the_same_stream_chunked_alone_is_filtered() {
    let events = format!("{MARKER}data: {{\"x\":1}}\n\n{MARKER}data: [DONE]\n\n");
    let (upstream, _) = raw_upstream(move |_| {
        let mut reply = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                          transfer-encoding: chunked\r\n\r\n"
            .to_vec();
        reply.extend_from_slice(&chunked(events.as_bytes()));
        (reply, false)
    })
    .await;
    let proxy = start_proxy(upstream, &[]).await;
    let response = raw_exchange(proxy.addr, &chat("[]")).await;
    let (head, body) = split_head(&response);
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    assert!(!holds(body, b"x-bypass-remote-prefill"));
    assert_eq!(content(&head, body), b"data: {\"x\":1}\n\ndata: [DONE]\n\n");
}

/// The heads without content the test sends: the request's method, the upstream's status line, and
/// a `content-length` it adds (a HEAD's says what a GET would get).
const NO_CONTENT: [(&str, &str, bool); 4] = [
    ("POST", "204 No Content", false),
    ("POST", "304 Not Modified", false),
    ("GET", "304 Not Modified", true),
    ("HEAD", "200 OK", true),
];

/// (b) An upstream's 204 or 304 with `content-type: text/event-stream`, or its answer to `HEAD`,
/// followed by bytes (a marker frame and an event, as if it were a body): the client gets the
/// status and no body byte, with the layer and without (`--no-layer`: its HTTP/1.1 client reads
/// no body for such a head either). The bytes after the head are never read as a body, and the
/// upstream connection they sit on is not reused for the next request: that one is answered by
/// its own response.
#[tokio::test]
async fn a_204_or_304_event_stream_with_bytes_after_its_head_gets_no_body_byte() {
    let events = format!("{MARKER}data: {{\"x\":1}}\n\n");
    for (method, status, with_length) in NO_CONTENT {
        let trailing = events.clone();
        let (upstream, heads) = raw_upstream(move |head| {
            if path(head) == "/next" {
                let reply = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                             content-length: 12\r\n\r\ndata: next\n\n";
                return (reply.as_bytes().to_vec(), false);
            }
            let length = if with_length {
                format!("content-length: {}\r\n", trailing.len())
            } else {
                String::new()
            };
            let reply = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/event-stream\r\n{length}\r\n{trailing}"
            );
            (reply.into_bytes(), false)
        })
        .await;
        for args in [&[][..], &["--no-layer"][..]] {
            let proxy = start_proxy(upstream, args).await;
            let what = format!("{method} {status} {args:?}");
            let body = if method == "POST" { "[]" } else { "" };
            let request = format!(
                "{method} /v1/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
                 Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            let response = raw_exchange(proxy.addr, request.as_bytes()).await;
            let (head, rest) = split_head(&response);
            let code = &status[..3];
            assert!(
                head.starts_with(&format!("HTTP/1.1 {code} ")),
                "{what}: {head}"
            );
            assert!(
                head.to_ascii_lowercase()
                    .contains("content-type: text/event-stream"),
                "{what}: {head}"
            );
            assert_eq!(rest, b"", "{what}: a body byte");
            assert!(!holds(&response, b"x-bypass-remote-prefill"), "{what}");
            // The next request, through the same proxy (whose pool holds the connection if it
            // kept it), gets its own response.
            let next = b"GET /next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
            let response = raw_exchange(proxy.addr, next).await;
            let (head, rest) = split_head(&response);
            assert!(head.starts_with("HTTP/1.1 200 "), "{what}: next: {head}");
            assert_eq!(content(&head, rest), b"data: next\n\n", "{what}: next");
            assert!(!holds(&response, b"x-bypass-remote-prefill"), "{what}");
        }
        assert_eq!(heads.lock().unwrap().len(), 4, "{method} {status}");
    }
}

/// (c) A client's `TE: gzip, trailers` (listed in its `Connection`, as RFC 9110 asks, or not)
/// never reaches the upstream as `gzip`: `TE` is hop-by-hop and the sidecar forwards none, so the
/// upstream has no reason to answer `transfer-encoding: gzip, chunked`; its `accept-encoding` is
/// `identity`. With the layer and without.
#[tokio::test]
async fn a_clients_te_gzip_never_reaches_the_upstream() {
    let (upstream, heads) = raw_upstream(|_| {
        let reply = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                     content-length: 9\r\n\r\ndata: 1\n\n";
        (reply.as_bytes().to_vec(), false)
    })
    .await;
    let requests = [
        "GET /v1/x HTTP/1.1\r\nHost: x\r\nConnection: close, TE\r\nTE: gzip, trailers\r\n\
         Accept-Encoding: gzip\r\n\r\n",
        "GET /v1/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTE: gzip, trailers\r\n\
         TE: deflate;q=0.5\r\n\r\n",
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTE: gzip\r\n\
         Content-Type: application/json\r\nContent-Length: 54\r\n\r\n\
         {\"model\":\"m\",\"stream\":true,\"nvext\":{\"annotations\":[]}}",
    ];
    for args in [&[][..], &["--no-layer"][..]] {
        let proxy = start_proxy(upstream, args).await;
        for request in requests {
            heads.lock().unwrap().clear();
            let response = raw_exchange(proxy.addr, request.as_bytes()).await;
            let (head, body) = split_head(&response);
            assert!(head.starts_with("HTTP/1.1 200 "), "{args:?}: {head}");
            assert_eq!(content(&head, body), b"data: 1\n\n", "{args:?}");
            let seen = heads.lock().unwrap().clone();
            assert_eq!(seen.len(), 1, "{args:?}: {seen:?}");
            let lower = seen[0].to_ascii_lowercase();
            for line in lower.lines() {
                assert!(!line.starts_with("te:"), "{args:?}: {}", seen[0]);
                if line.starts_with("accept-encoding:") {
                    assert_eq!(line, "accept-encoding: identity", "{args:?}");
                }
            }
            assert!(!lower.contains("gzip"), "{args:?}: {}", seen[0]);
            assert!(!lower.contains("deflate"), "{args:?}: {}", seen[0]);
            assert!(lower.contains("accept-encoding: identity"), "{}", seen[0]);
        }
    }
}

/// The sidecar serves HTTP/1.1 only: an h2c client with prior knowledge gets no response (hyper's
/// HTTP/1.1 server refuses the preface), so no stream reaches it, and nothing reaches the
/// upstream.
#[tokio::test]
async fn an_h2c_client_gets_no_response_and_nothing_is_forwarded() {
    let (upstream, heads) = raw_upstream(|_| {
        let reply =
            format!("HTTP/1.1 204 No Content\r\ncontent-type: text/event-stream\r\n\r\n{MARKER}");
        (reply.into_bytes(), true)
    })
    .await;
    let proxy = start_proxy(upstream, &[]).await;
    let outcome = tokio::time::timeout(PATIENCE, async {
        let io = TcpStream::connect(proxy.addr).await.unwrap();
        let (mut client, conn) = h2::client::handshake(io).await?;
        tokio::spawn(conn);
        let req = http::Request::post(format!("http://{}/v1/x", proxy.addr))
            .body(())
            .unwrap();
        let (res, _) = client.send_request(req, true)?;
        res.await
    })
    .await
    .expect("the h2c exchange ends in time");
    assert!(outcome.is_err(), "{outcome:?}");
    assert!(heads.lock().unwrap().is_empty());
}
