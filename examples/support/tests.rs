//! The simulated Dynamo-like router of `examples/support` (the `router` test: a test target whose
//! root sits beside the modules it tests, so it declares them as the examples do), served on
//! 127.0.0.1 and called with a real HTTP client: what clients receive on a prefix-cache hit with and without the layer, and
//! what the simulated worker is handed. The router prepends a `request_id` frame to every stream
//! and the marker to cache hits; the layer forwards each only to the clients that asked for it.

// Each example and test that declares these modules uses a different part of them.
#[allow(dead_code)]
mod client;
#[allow(dead_code)]
mod router;

use client::Reply;
use router::{Endpoint, Running, WorkerRequest, BYPASS_FRAME, DONE_FRAME};
use serde_json::Value;

const ENDPOINTS: [Endpoint; 2] = [Endpoint::Chat, Endpoint::Completions];

async fn send(server: &Running, endpoint: Endpoint, request: &Value) -> Reply {
    server
        .post_json(client::path(endpoint), request)
        .await
        .expect("the router answers")
}

/// Sends a streamed request and checks it is a well-formed 200 event stream.
async fn stream(server: &Running, endpoint: Endpoint, request: &Value) -> Vec<u8> {
    let reply = send(server, endpoint, request).await;
    assert_eq!(reply.status, 200, "body: {:?}", reply.body);
    assert_eq!(reply.content_type(), "text/event-stream");
    assert!(reply.body.ends_with(DONE_FRAME.as_bytes()));
    reply.body.to_vec()
}

fn last_worker_request(server: &Running) -> WorkerRequest {
    server
        .router
        .worker_log()
        .pop()
        .expect("the worker was called")
}

/// The `request_id` frame the router must have sent with `body`, written out here rather than
/// taken from the router: `event: request_id` and the stream's completion id as a JSON string.
fn request_id_frame_of(body: &[u8]) -> String {
    let id = client::stream_id(body).expect("a stream with an id");
    assert!(!id.is_empty() && !id.contains(['"', '\\', '\n']), "{id:?}");
    format!("event: request_id\n: \"{id}\"\n\n")
}

fn event_frames(body: &[u8]) -> Vec<String> {
    client::frames(body)
        .into_iter()
        .filter(|f| f.starts_with(b"event:") || f.starts_with(b":"))
        .map(client::escape)
        .collect()
}

#[tokio::test]
async fn no_layer_router_prepends_request_id_to_every_stream_and_the_marker_to_cache_hits() {
    let server = router::spawn(false).await.unwrap();
    for endpoint in ENDPOINTS {
        let request = client::request(endpoint, "no layer here", true, 4);
        let cold = stream(&server, endpoint, &request).await;
        assert!(!last_worker_request(&server).bypass_remote_prefill);
        assert_eq!(
            client::escape(client::frames(&cold)[0]),
            client::escape(request_id_frame_of(&cold).as_bytes())
        );
        assert_eq!(event_frames(&cold).len(), 1, "{:?}", client::escape(&cold));

        // The marker comes first, then request_id, whatever the client asked for.
        for annotations in [&[][..], &["request_id"], &["x-bypass-remote-prefill"]] {
            let request = client::with_annotations(request.clone(), annotations);
            let hit = stream(&server, endpoint, &request).await;
            assert!(last_worker_request(&server).bypass_remote_prefill);
            assert_eq!(
                event_frames(&hit),
                [
                    client::escape(BYPASS_FRAME.as_bytes()),
                    client::escape(request_id_frame_of(&hit).as_bytes()),
                ],
                "{annotations:?}"
            );
            assert!(
                hit.starts_with(BYPASS_FRAME.as_bytes()),
                "{:?}",
                client::escape(&hit)
            );
        }
    }
}

#[tokio::test]
async fn default_client_cache_hit_stream_has_no_marker_and_no_request_id() {
    let without = router::spawn(false).await.unwrap();
    let with = router::spawn(true).await.unwrap();
    for endpoint in ENDPOINTS {
        let request = client::request(endpoint, "the same prompt twice", true, 5);
        // The cold request: only request_id to remove.
        let filtered = stream(&with, endpoint, &request).await;
        assert!(
            event_frames(&filtered).is_empty(),
            "{:?}",
            client::escape(&filtered)
        );
        let bare = stream(&without, endpoint, &request).await;
        assert_eq!(
            bare.strip_prefix(request_id_frame_of(&bare).as_bytes()),
            Some(&filtered[..])
        );

        let filtered = stream(&with, endpoint, &request).await;
        let worker = last_worker_request(&with);
        assert!(worker.bypass_remote_prefill, "not a cache hit: {worker:?}");
        assert!(
            event_frames(&filtered).is_empty(),
            "{:?}",
            client::escape(&filtered)
        );
        assert!(filtered.starts_with(b"data: {"));

        // The layer removed exactly the marker and request_id: the same request to the router
        // without it gets the same bytes after those two frames.
        let bare = stream(&without, endpoint, &request).await;
        let prefix = format!("{BYPASS_FRAME}{}", request_id_frame_of(&bare));
        assert_eq!(bare.strip_prefix(prefix.as_bytes()), Some(&filtered[..]));
        assert_eq!(
            client::streamed_text(&filtered).unwrap(),
            "the same prompt twice the"
        );
    }
}

#[tokio::test]
async fn opted_in_client_gets_the_marker_as_first_frame() {
    let server = router::spawn(true).await.unwrap();
    for endpoint in ENDPOINTS {
        let request = client::request(endpoint, "opt in to the marker", true, 3);
        let opted_in = client::with_annotations(request.clone(), &["x-bypass-remote-prefill"]);

        // A cold request: nothing was bypassed, so there is no marker to forward, and request_id
        // was not asked for.
        let cold = stream(&server, endpoint, &opted_in).await;
        assert!(
            event_frames(&cold).is_empty(),
            "{:?}",
            client::escape(&cold)
        );

        let hit = stream(&server, endpoint, &opted_in).await;
        assert!(last_worker_request(&server).bypass_remote_prefill);
        assert_eq!(
            client::frames(&hit)[0],
            BYPASS_FRAME.as_bytes(),
            "{:?}",
            client::escape(&hit)
        );
        // The marker only: request_id was removed, this client did not ask for it.
        assert_eq!(event_frames(&hit).len(), 1, "{:?}", client::escape(&hit));
        assert_eq!(client::streamed_text(&hit).unwrap(), "opt in to");

        // The opt-in is per request: the next default request gets no marker.
        let default = stream(&server, endpoint, &request).await;
        assert!(last_worker_request(&server).bypass_remote_prefill);
        assert!(event_frames(&default).is_empty());
    }
}

#[tokio::test]
async fn client_sent_marker_annotations_never_reach_the_worker() {
    let sent = [
        "x-bypass-remote-prefill",
        "x-bypass-remote-prefill:true",
        " X-Bypass-Remote-Prefill : TRUE",
        "request_id",
        "some-other-annotation",
    ];
    for endpoint in ENDPOINTS {
        for stream in [true, false] {
            let request = client::with_annotations(
                client::request(endpoint, "forcing the bypass", stream, 2),
                &sent,
            );

            let with = router::spawn(true).await.unwrap();
            send(&with, endpoint, &request).await;
            let worker = last_worker_request(&with);
            assert_eq!(
                worker.annotations,
                ["request_id", "some-other-annotation"],
                "{endpoint:?}, stream: {stream}"
            );
            assert!(!worker.bypass_remote_prefill, "a cold request is not a hit");

            // Without the guard the worker is handed everything the client sent.
            let without = router::spawn(false).await.unwrap();
            send(&without, endpoint, &request).await;
            assert_eq!(last_worker_request(&without).annotations, sent);
        }
    }
}

#[tokio::test]
async fn request_id_is_forwarded_only_to_clients_that_asked_for_it() {
    let server = router::spawn(true).await.unwrap();
    for endpoint in ENDPOINTS {
        let request = client::request(endpoint, "which request is this", true, 2);
        let asked = client::with_annotations(request.clone(), &["request_id"]);

        // Cold, then a cache hit: request_id first, as a frame of its own, and no marker.
        for round in 0..2 {
            let body = stream(&server, endpoint, &asked).await;
            assert_eq!(
                last_worker_request(&server).bypass_remote_prefill,
                round == 1
            );
            assert_eq!(
                client::escape(client::frames(&body)[0]),
                client::escape(request_id_frame_of(&body).as_bytes()),
                "round {round}"
            );
            assert_eq!(event_frames(&body).len(), 1, "{:?}", client::escape(&body));
            assert!(client::frames(&body)[1].starts_with(b"data: {"));
        }

        // Both opt-ins: the marker first, then request_id, each once.
        let both =
            client::with_annotations(request.clone(), &["x-bypass-remote-prefill", "request_id"]);
        let body = stream(&server, endpoint, &both).await;
        assert!(last_worker_request(&server).bypass_remote_prefill);
        assert_eq!(
            event_frames(&body),
            [
                client::escape(BYPASS_FRAME.as_bytes()),
                client::escape(request_id_frame_of(&body).as_bytes()),
            ]
        );
        assert!(body.starts_with(BYPASS_FRAME.as_bytes()));

        // A client that did not ask: removed, though the router sent it.
        let body = stream(&server, endpoint, &request).await;
        assert!(last_worker_request(&server).bypass_remote_prefill);
        assert!(
            event_frames(&body).is_empty(),
            "{:?}",
            client::escape(&body)
        );
        assert!(body.starts_with(b"data: {"));
    }
}

#[tokio::test]
async fn non_streamed_json_is_byte_identical_with_and_without_the_layer() {
    let without = router::spawn(false).await.unwrap();
    let with = router::spawn(true).await.unwrap();
    for endpoint in ENDPOINTS {
        let request = client::request(endpoint, "plain json please", false, 6);
        // The cold request and the cache hit.
        for round in 0..2 {
            let a = send(&without, endpoint, &request).await;
            let b = send(&with, endpoint, &request).await;
            assert_eq!(a.status, 200);
            assert_eq!(a.content_type(), "application/json");
            assert_eq!(b.status, a.status);
            assert_eq!(b.body, a.body, "round {round}");
            for name in ["content-type", "content-length"] {
                assert_eq!(b.headers.get(name), a.headers.get(name), "{name}");
            }
            assert_eq!(last_worker_request(&with).bypass_remote_prefill, round == 1);
            let json: Value = serde_json::from_slice(&b.body).unwrap();
            let text = match endpoint {
                Endpoint::Chat => &json["choices"][0]["message"]["content"],
                Endpoint::Completions => &json["choices"][0]["text"],
            };
            assert_eq!(text, "plain json please plain json please");
            assert_eq!(json["usage"]["completion_tokens"], 6);
        }
    }
}

#[tokio::test]
async fn streamed_chunks_are_openai_shaped_and_honour_max_tokens() {
    let server = router::spawn(true).await.unwrap();
    for (endpoint, object) in [
        (Endpoint::Chat, "chat.completion.chunk"),
        (Endpoint::Completions, "text_completion"),
    ] {
        let request = client::request(endpoint, "one two three", true, 7);
        let body = stream(&server, endpoint, &request).await;
        let frames = client::frames(&body);
        let mut content_chunks = 0;
        for frame in &frames[..frames.len() - 1] {
            let data = frame.strip_prefix(b"data: ").expect("only data frames");
            let data = data
                .strip_suffix(b"\n\n")
                .expect("frames end in an empty line");
            let chunk: Value = serde_json::from_slice(data).unwrap();
            assert_eq!(chunk["object"], object);
            let choice = &chunk["choices"][0];
            let piece = choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())
                .unwrap_or("");
            content_chunks += usize::from(!piece.is_empty());
        }
        assert_eq!(content_chunks, 7);
        assert_eq!(
            client::streamed_text(&body).unwrap(),
            "one two three one two three one"
        );

        let mut with_usage = request.clone();
        with_usage["stream_options"] = serde_json::json!({"include_usage": true});
        let body = stream(&server, endpoint, &with_usage).await;
        let frames = client::frames(&body);
        let last = frames[frames.len() - 2].strip_prefix(b"data: ").unwrap();
        let last: Value = serde_json::from_slice(last).unwrap();
        assert_eq!(last["choices"], serde_json::json!([]));
        assert_eq!(last["usage"]["completion_tokens"], 7);
        assert_eq!(last["usage"]["prompt_tokens"], 3);
    }
}

#[tokio::test]
async fn bad_requests_get_a_400_with_a_json_error() {
    let server = router::spawn(true).await.unwrap();
    let cases: [(Endpoint, &str, &str); 5] = [
        (Endpoint::Chat, "{\"model\":", "invalid JSON body"),
        (Endpoint::Completions, "not json", "invalid JSON body"),
        (
            Endpoint::Chat,
            r#"{"model":"m","prompt":"p"}"#,
            "`messages` is required",
        ),
        (
            Endpoint::Completions,
            r#"{"model":"m","messages":[]}"#,
            "`prompt` is required",
        ),
        (
            Endpoint::Completions,
            r#"{"model":"m","prompt":"p","max_tokens":0}"#,
            "max_tokens must be between 1",
        ),
    ];
    for (endpoint, body, message) in cases {
        let reply = server
            .post(client::path(endpoint), body.to_owned())
            .await
            .unwrap();
        assert_eq!(reply.status, 400, "{body}");
        assert_eq!(reply.content_type(), "application/json");
        let json: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(json["error"]["type"], "invalid_request_error");
        let got = json["error"]["message"].as_str().unwrap();
        assert!(got.starts_with(message), "{body}: {got}");
    }
    assert!(
        server.router.worker_log().is_empty(),
        "bad requests never reach the worker"
    );
}

#[tokio::test]
async fn the_worker_log_is_bounded_in_bytes_whatever_the_requests_carry() {
    let server = router::spawn(true).await.unwrap();
    let post = |prompt: String, annotations: Vec<String>| {
        let annotations: Vec<&str> = annotations.iter().map(String::as_str).collect();
        client::with_annotations(
            client::request(Endpoint::Chat, &prompt, false, 1),
            &annotations,
        )
    };
    // Many tiny annotations in one request: each entry keeps at most 64 KiB of them.
    let many: Vec<String> = (0..200_000).map(|i| format!("a{}", i % 10)).collect();
    for i in 0..2 {
        let reply = send(
            &server,
            Endpoint::Chat,
            &post(format!("tiny {i}"), many.clone()),
        )
        .await;
        assert_eq!(reply.status, 200);
    }
    let last = server.router.worker_log().pop().unwrap();
    assert!(last.annotations_dropped > 0);
    assert_eq!(
        last.annotations.len() + last.annotations_dropped,
        many.len()
    );
    assert_eq!(last.annotations[..3], ["a0", "a1", "a2"]);
    assert!(last.bytes() <= router::WORKER_LOG_ANNOTATION_BYTES + 1024);
    // Fewer than 1024 requests of 60 KB each: the oldest make room by bytes, not by count.
    let big: Vec<String> = (0..15)
        .map(|i| format!("{i}{}", "b".repeat(4000)))
        .collect();
    for i in 0..80 {
        let reply = send(
            &server,
            Endpoint::Chat,
            &post(format!("big {i}"), big.clone()),
        )
        .await;
        assert_eq!(reply.status, 200);
    }
    let log = server.router.worker_log();
    let bytes = server.router.worker_log_bytes();
    assert!(
        bytes <= router::WORKER_LOG_BYTES,
        "the log holds {bytes} bytes"
    );
    assert_eq!(bytes, log.iter().map(WorkerRequest::bytes).sum::<usize>());
    assert!(log.len() < 80, "{} entries", log.len());
    assert_eq!(log.last().unwrap().annotations, big);
}
