//! Instructions per message of an external processor, counted by callgrind: a client that plays
//! Envoy's paced streams (each body chunk sent alone, its answer awaited before the next, as
//! Envoy does in STREAMED mode) against a processor on 127.0.0.1, so that two builds of the
//! processor can be compared exactly, whatever else the machine is doing.
//!
//! ```sh
//! cargo build --release -p bypass-marker --bin bypass-marker --example ext_proc_count
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p \
//!     target/release/bypass-marker ext-proc --listen 127.0.0.1:50051 &
//! target/release/examples/ext_proc_count 127.0.0.1:50051 16 0     # warm-up: 48 messages
//! target/release/examples/ext_proc_count 127.0.0.1:50051 16 500   # 8,048 messages
//! kill -TERM %1; wait; callgrind_annotate /tmp/cg.* | head   # total Ir
//! ```
//!
//! Run it twice, with and without the second client, and divide the difference of the totals by
//! the difference of the messages (8,000 body chunks): the instructions that one more streamed
//! chunk costs the processor in user space. System calls are not counted (callgrind sees user
//! space only); `strace -c -f -p PID` counts them.
//!
//! `ext_proc_count ADDR STREAMS CHUNKS`: STREAMS gRPC streams at once, each a GET whose response
//! is an event stream of the marker and then CHUNKS chat events, one body message each. Prints
//! the number of messages sent.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_client::ExternalProcessorClient, processing_request::Request as Msg,
    HttpBody, HttpHeaders, ProcessingRequest,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const EVENT: &[u8] = b"data: {\"id\":\"chatcmpl-8b1e2f\",\"object\":\"chat.completion.chunk\",\"created\":1764500000,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" token\"},\"finish_reason\":null}]}\n\n";
const MARKER: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\n";

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).into(),
                    raw_value: v.as_bytes().to_vec(),
                    ..HeaderValue::default()
                })
                .collect(),
        }),
        end_of_stream,
        ..HttpHeaders::default()
    }
}

async fn stream(
    mut client: ExternalProcessorClient<tonic::transport::Channel>,
    chunks: usize,
) -> usize {
    let (tx, rx) = mpsc::channel(1);
    let mut answers = client
        .process(ReceiverStream::new(rx))
        .await
        .expect("Process")
        .into_inner();
    let mut parts = vec![
        Msg::RequestHeaders(headers(
            &[(":method", "GET"), (":path", "/v1/models")],
            true,
        )),
        Msg::ResponseHeaders(headers(
            &[(":status", "200"), ("content-type", "text/event-stream")],
            false,
        )),
        Msg::ResponseBody(HttpBody {
            body: MARKER.to_vec(),
            end_of_stream: false,
            ..HttpBody::default()
        }),
    ];
    for i in 0..chunks {
        parts.push(Msg::ResponseBody(HttpBody {
            body: EVENT.to_vec(),
            end_of_stream: i + 1 == chunks,
            ..HttpBody::default()
        }));
    }
    let sent = parts.len();
    for part in parts {
        let msg = ProcessingRequest {
            request: Some(part),
            ..ProcessingRequest::default()
        };
        tx.send(msg).await.expect("send");
        answers
            .message()
            .await
            .expect("an answer")
            .expect("not the end");
    }
    drop(tx);
    sent
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(addr), Some(streams), Some(chunks)) = (args.next(), args.next(), args.next()) else {
        eprintln!("usage: ext_proc_count ADDR STREAMS CHUNKS");
        std::process::exit(2);
    };
    let streams: usize = streams.parse().expect("STREAMS");
    let chunks: usize = chunks.parse().expect("CHUNKS");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("address")
        .connect_timeout(Duration::from_secs(30))
        .connect()
        .await
        .expect("connect");
    let client = ExternalProcessorClient::new(channel);
    let mut tasks = Vec::new();
    for _ in 0..streams {
        tasks.push(tokio::spawn(stream(client.clone(), chunks)));
    }
    let mut sent = 0;
    for task in tasks {
        sent += task.await.expect("stream");
    }
    println!("{sent}");
}
