//! The floor under `bypass-marker ext-proc` in `envoy_bench`: external processors that decode
//! every message Envoy sends and answer each with "continue, unchanged", with no guard, no filter
//! and no state. They are not processors to deploy (they protect nothing); they measure what the
//! gRPC stack alone costs per message, so that the processor's own part can be told apart from it.
//!
//! ```sh
//! cargo build --release -p bypass-marker --bin bypass-marker --examples
//! target/release/examples/envoy_bench --no-proxy --only paced \
//!     --ext-proc-variant "bin=target/release/examples/ext_proc_floor --stack tonic" \
//!     --ext-proc-variant "bin=target/release/examples/ext_proc_floor --stack h2"
//! ```
//!
//! - `--stack tonic`: tonic 0.14's server with gRPC health, as `bypass-marker ext-proc` serves
//!   (one single-threaded runtime, `TCP_NODELAY`), with a `Process` stream that maps each request
//!   to its canned answer.
//! - `--stack tonic-raw`: tonic's server with gRPC health, the `Process` method a plain tower
//!   service that reads and writes the gRPC messages itself (5-byte prefix, `prost`), with no
//!   `Streaming` and no `EncodeBody`: the stack `bypass-marker ext-proc` serves on
//!   (`ExtProcService`).
//! - `--stack hyper`: hyper's HTTP/2 server alone, the same body as `tonic-raw`.
//! - `--stack h2`: the `h2` crate alone, one task per HTTP/2 stream, gRPC's 5-byte message
//!   prefix read and written here, the messages decoded with `prost` (so the decoding is paid as
//!   in any processor) and the answers encoded once at start-up. No hyper, no tonic.
//!
//! Arguments as `envoy_bench` passes them: `ext-proc --listen ADDR`, then
//! `--stack tonic|tonic-raw|hyper|h2`;
//! other flags are ignored.

use std::net::SocketAddr;
use std::pin::Pin;

use bytes::{Buf, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_server::{ExternalProcessor, ExternalProcessorServer},
    processing_request::Request as Part,
    processing_response::Response as Answer,
    BodyResponse, HeadersResponse, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use futures_util::{Stream, StreamExt};
use prost::Message;
use tokio::net::{TcpListener, TcpStream};

/// The answer that leaves each kind of message as it is.
fn answer(part: &Part) -> ProcessingResponse {
    let response = match part {
        Part::RequestHeaders(_) => Answer::RequestHeaders(HeadersResponse::default()),
        Part::RequestBody(_) => Answer::RequestBody(BodyResponse::default()),
        Part::RequestTrailers(_) => Answer::RequestTrailers(TrailersResponse::default()),
        Part::ResponseHeaders(_) => Answer::ResponseHeaders(HeadersResponse::default()),
        Part::ResponseBody(_) => Answer::ResponseBody(BodyResponse::default()),
        Part::ResponseTrailers(_) => Answer::ResponseTrailers(TrailersResponse::default()),
    };
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

// ---- tonic --------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct Floor;

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Floor {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Answers>, tonic::Status> {
        let answers = request.into_inner().filter_map(|msg| async move {
            match msg {
                Ok(msg) => msg.request.as_ref().map(|part| Ok(answer(part))),
                Err(status) => Some(Err(status)),
            }
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }
}

/// The listener's connections for tonic, with `TCP_NODELAY` as `bypass-marker ext-proc` sets it.
fn incoming(
    listener: TcpListener,
) -> impl Stream<Item = std::io::Result<TcpStream>> + Send + 'static {
    futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| {
            let _ = stream.set_nodelay(true);
            stream
        });
        Some((accepted, listener))
    })
}

async fn serve_tonic(listener: TcpListener) {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<ExternalProcessorServer<Floor>>()
        .await;
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(ExternalProcessorServer::new(Floor).max_decoding_message_size(64 << 20))
        .serve_with_incoming(incoming(listener))
        .await
        .expect("tonic server");
}

// ---- h2 -----------------------------------------------------------------------------------------

/// Each answer with its gRPC prefix (uncompressed, length), encoded once.
struct Canned {
    request_headers: Bytes,
    request_body: Bytes,
    request_trailers: Bytes,
    response_headers: Bytes,
    response_body: Bytes,
    response_trailers: Bytes,
    /// `grpc.health.v1.HealthCheckResponse { status: SERVING }`.
    serving: Bytes,
}

fn framed(message: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out.into()
}

impl Canned {
    fn new() -> Self {
        use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, HttpTrailers};
        let of = |part: Part| framed(&answer(&part).encode_to_vec());
        Self {
            request_headers: of(Part::RequestHeaders(HttpHeaders::default())),
            request_body: of(Part::RequestBody(HttpBody::default())),
            request_trailers: of(Part::RequestTrailers(HttpTrailers::default())),
            response_headers: of(Part::ResponseHeaders(HttpHeaders::default())),
            response_body: of(Part::ResponseBody(HttpBody::default())),
            response_trailers: of(Part::ResponseTrailers(HttpTrailers::default())),
            serving: framed(&[0x08, 0x01]),
        }
    }

    fn for_part(&self, part: &Part) -> Bytes {
        match part {
            Part::RequestHeaders(_) => &self.request_headers,
            Part::RequestBody(_) => &self.request_body,
            Part::RequestTrailers(_) => &self.request_trailers,
            Part::ResponseHeaders(_) => &self.response_headers,
            Part::ResponseBody(_) => &self.response_body,
            Part::ResponseTrailers(_) => &self.response_trailers,
        }
        .clone()
    }
}

async fn serve_h2(listener: TcpListener) {
    let canned: &'static Canned = Box::leak(Box::new(Canned::new()));
    loop {
        let Ok((socket, _)) = listener.accept().await else {
            continue;
        };
        let _ = socket.set_nodelay(true);
        tokio::spawn(connection(socket, canned));
    }
}

async fn connection(socket: TcpStream, canned: &'static Canned) {
    let Ok(mut conn) = h2::server::handshake(socket).await else {
        return;
    };
    while let Some(Ok((request, respond))) = conn.accept().await {
        tokio::spawn(async move {
            let _ = stream(request, respond, canned).await;
        });
    }
}

async fn stream(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    canned: &'static Canned,
) -> Result<(), h2::Error> {
    let health = request.uri().path().starts_with("/grpc.health.v1.Health/");
    let mut body = request.into_body();
    let head = http::Response::builder()
        .header("content-type", "application/grpc")
        .body(())
        .expect("static head");
    let mut send = respond.send_response(head, false)?;
    let mut pending = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        pending.extend_from_slice(&chunk);
        while pending.len() >= 5 {
            let len = u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]) as usize;
            if pending.len() < 5 + len {
                break;
            }
            pending.advance(5);
            let message = pending.split_to(len);
            let out = if health {
                canned.serving.clone()
            } else {
                match ProcessingRequest::decode(&message[..]) {
                    Ok(ProcessingRequest {
                        request: Some(part),
                        ..
                    }) => canned.for_part(&part),
                    _ => continue,
                }
            };
            send.send_data(out, false)?;
        }
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    send.send_trailers(trailers)
}

// ---- hyper --------------------------------------------------------------------------------------

/// The answers to one `Process` call as a response body: each complete gRPC message of the
/// request body gets its canned answer as one data frame; trailers `grpc-status: 0` at the end.
struct HyperAnswers<B = hyper::body::Incoming> {
    inbound: B,
    pending: BytesMut,
    canned: &'static Canned,
    health: bool,
    done: bool,
}

impl<B> http_body::Body for HyperAnswers<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if this.pending.len() >= 5 {
                let p = &this.pending;
                let len = u32::from_be_bytes([p[1], p[2], p[3], p[4]]) as usize;
                if this.pending.len() >= 5 + len {
                    this.pending.advance(5);
                    let message = this.pending.split_to(len);
                    let out = if this.health {
                        this.canned.serving.clone()
                    } else {
                        match ProcessingRequest::decode(&message[..]) {
                            Ok(ProcessingRequest {
                                request: Some(part),
                                ..
                            }) => this.canned.for_part(&part),
                            _ => continue,
                        }
                    };
                    return Poll::Ready(Some(Ok(http_body::Frame::data(out))));
                }
            }
            match std::task::ready!(Pin::new(&mut this.inbound).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        this.pending.extend_from_slice(&data);
                    }
                }
                Some(Err(err)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(err)));
                }
                None => {
                    this.done = true;
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                    return Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))));
                }
            }
        }
    }
}

async fn serve_hyper(listener: TcpListener) {
    let canned: &'static Canned = Box::leak(Box::new(Canned::new()));
    loop {
        let Ok((socket, _)) = listener.accept().await else {
            continue;
        };
        let _ = socket.set_nodelay(true);
        let service =
            hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                let health = request.uri().path().starts_with("/grpc.health.v1.Health/");
                let body = HyperAnswers {
                    inbound: request.into_body(),
                    pending: BytesMut::new(),
                    canned,
                    health,
                    done: false,
                };
                let response = http::Response::builder()
                    .header("content-type", "application/grpc")
                    .body(body)
                    .expect("static head");
                async move { Ok::<_, std::convert::Infallible>(response) }
            });
        tokio::spawn(async move {
            let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .serve_connection(hyper_util::rt::TokioIo::new(socket), service)
                .await;
        });
    }
}

// ---- tonic, raw service ---------------------------------------------------------------------------

/// The `Process` method as a plain tower service under tonic's server: tonic serves the
/// connection, this service frames the gRPC messages itself (no `Streaming`, no `EncodeBody`).
#[derive(Clone, Copy)]
struct RawFloor(&'static Canned);

impl tonic::server::NamedService for RawFloor {
    const NAME: &'static str = "envoy.service.ext_proc.v3.ExternalProcessor";
}

impl tower_service::Service<http::Request<tonic::body::Body>> for RawFloor {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let body = HyperAnswers {
            inbound: request.into_body(),
            pending: BytesMut::new(),
            canned: self.0,
            health: false,
            done: false,
        };
        let response = http::Response::builder()
            .header("content-type", "application/grpc")
            .body(tonic::body::Body::new(body))
            .expect("static head");
        std::future::ready(Ok(response))
    }
}

async fn serve_tonic_raw(listener: TcpListener) {
    let canned: &'static Canned = Box::leak(Box::new(Canned::new()));
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(RawFloor(canned))
        .serve_with_incoming(incoming(listener))
        .await
        .expect("tonic server");
}

// ---- main ---------------------------------------------------------------------------------------

fn main() {
    let mut listen: Option<SocketAddr> = None;
    let mut stack = "tonic".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => listen = args.next().and_then(|a| a.parse().ok()),
            "--stack" => stack = args.next().unwrap_or_default(),
            _ => {}
        }
    }
    let listen = listen.unwrap_or_else(|| {
        eprintln!(
            "usage: ext_proc_floor [ext-proc] --listen ADDR [--stack tonic|tonic-raw|hyper|h2]"
        );
        std::process::exit(2);
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let listener = TcpListener::bind(listen).await.expect("bind");
        println!("ext_proc floor ({stack}) listening on {listen}");
        match stack.as_str() {
            "tonic" => serve_tonic(listener).await,
            "h2" => serve_h2(listener).await,
            "hyper" => serve_hyper(listener).await,
            "tonic-raw" => serve_tonic_raw(listener).await,
            other => {
                eprintln!("--stack tonic|tonic-raw|hyper|h2, not {other:?}");
                std::process::exit(2);
            }
        }
    });
}
