//! `BypassMarkerLayer::dynamo()`: a stream with every annotation Dynamo emits, through the preset,
//! for clients with different opt-ins, compared byte for byte; and the guard on Dynamo's
//! router-owned markers.

use test_support::body::{collect, data, response, through, Items};
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};

// The frames as Dynamo 1.6.1 writes them: annotations are `event: NAME` and one comment line,
// whose value for `request_id`, `formatted_prompt` and `token_ids` is a JSON string.
const BYPASS: &str = "event: x-bypass-remote-prefill\n: true\n\n";
const CONTINUE: &str = "event: x-prefill-continue\n: true\n\n";
const REQUEST_ID: &str = "event: request_id\n: \"8c1f5e0a-3b7d-4c1e-9f2a-1d2e3f4a5b6c\"\n\n";
const FORMATTED_PROMPT: &str =
    "event: formatted_prompt\n: \"<|im_start|>user\\nSay hi<|im_end|>\\n<|im_start|>assistant\\n\"\n\n";
const TOKEN_IDS: &str = "event: token_ids\n: \"[151644, 872, 198, 25586, 15588, 151645]\"\n\n";
const CHUNK_1: &str = "data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hi\"}}]}\n\n";
const LLM_METRICS: &str =
    "event: llm_metrics\n: {\"input_tokens\":6,\"output_tokens\":1,\"chunk_tokens\":1}\n\n";
const CHUNK_2: &str = "data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"!\"},\"finish_reason\":\"stop\"}]}\n\n";
const PAYLOAD_USAGE: &str =
    "event: payload_usage\n: {\"prompt_tokens\":6,\"completion_tokens\":2}\n\n";
const ERROR: &str = "event: error\n: worker stopped\n\n";
const DONE: &str = "data: [DONE]\n\n";

/// Every frame, in the order Dynamo sends them (`request_id` first of the opt-ins).
const STREAM: [&str; 11] = [
    BYPASS,
    CONTINUE,
    REQUEST_ID,
    FORMATTED_PROMPT,
    TOKEN_IDS,
    CHUNK_1,
    LLM_METRICS,
    CHUNK_2,
    PAYLOAD_USAGE,
    ERROR,
    DONE,
];

/// The stream without the frames not in `kept` (the data frames, the error and `[DONE]` are
/// always kept).
fn expected(kept: &[&str]) -> String {
    let always = [CHUNK_1, CHUNK_2, ERROR, DONE];
    STREAM
        .iter()
        .filter(|f| always.contains(f) || kept.contains(f))
        .copied()
        .collect()
}

async fn filter_in_chunks(requested: &[&str], chunks: Vec<Vec<u8>>) -> Vec<u8> {
    let requested: RequestedAnnotations = requested.iter().copied().collect();
    let items = chunks.into_iter().map(data);
    let res = through(
        &BypassMarkerLayer::dynamo(),
        Some(requested),
        response("text/event-stream", Items::new(items)),
    )
    .await;
    let out = collect(res.into_body()).await;
    assert!(out.error.is_none(), "{:?}", out.error);
    out.data
}

async fn filter(requested: &[&str]) -> String {
    let chunks = STREAM.iter().map(|f| f.as_bytes().to_vec()).collect();
    String::from_utf8(filter_in_chunks(requested, chunks).await).unwrap()
}

#[tokio::test]
async fn a_client_that_asked_for_nothing_gets_only_data_and_the_error() {
    assert_eq!(filter(&[]).await, expected(&[]));
    assert_eq!(
        filter(&[]).await,
        format!("{CHUNK_1}{CHUNK_2}{ERROR}{DONE}")
    );
}

#[tokio::test]
async fn a_client_that_asked_for_request_id_gets_that_frame_and_not_the_marker() {
    assert_eq!(filter(&["request_id"]).await, expected(&[REQUEST_ID]));
}

#[tokio::test]
async fn a_client_that_asked_for_every_opt_in_gets_them_in_dynamos_order() {
    let all = ["token_ids", "request_id", "formatted_prompt"];
    assert_eq!(
        filter(&all).await,
        expected(&[REQUEST_ID, FORMATTED_PROMPT, TOKEN_IDS])
    );
}

#[tokio::test]
async fn the_routing_markers_reach_only_clients_granted_them() {
    assert_eq!(
        filter(&["x-bypass-remote-prefill"]).await,
        expected(&[BYPASS])
    );
    assert_eq!(
        filter(&[
            "x-bypass-remote-prefill",
            "x-prefill-continue",
            "formatted_prompt"
        ])
        .await,
        expected(&[BYPASS, CONTINUE, FORMATTED_PROMPT])
    );
}

#[tokio::test]
async fn internal_metrics_are_never_forwarded_even_when_asked_for() {
    let preset = BypassMarkerLayer::dynamo();
    let everything: Vec<&str> = preset.names().collect();
    assert_eq!(everything.len(), 7, "{everything:?}");
    assert_eq!(
        filter(&everything).await,
        expected(&[BYPASS, CONTINUE, REQUEST_ID, FORMATTED_PROMPT, TOKEN_IDS])
    );
}

/// The whole stream as one body split in two at every byte, for a client that asked for
/// `request_id` only.
#[tokio::test]
async fn every_split_gives_the_same_bytes() {
    let whole: String = STREAM.concat();
    let want = expected(&[REQUEST_ID]);
    for at in 0..=whole.len() {
        let (a, b) = whole.as_bytes().split_at(at);
        let got = filter_in_chunks(&["request_id"], vec![a.to_vec(), b.to_vec()]).await;
        assert_eq!(String::from_utf8(got).unwrap(), want, "split at {at}");
    }
}

#[test]
fn the_guard_strips_both_router_owned_markers_in_every_form_and_grants_the_rest() {
    let layer = BypassMarkerLayer::dynamo();
    let mut annotations: Vec<String> = [
        "x-bypass-remote-prefill",
        "X-Bypass-Remote-Prefill:true",
        "x-prefill-continue",
        " x-prefill-continue:1 ",
        "X-PREFILL-CONTINUE",
        "request_id",
        "token_ids",
        "llm_metrics",
        "payload_usage",
        "output_replay_id:abc",
    ]
    .map(String::from)
    .to_vec();
    let granted = layer.guard_annotations(&mut annotations);
    // The router still sees what it serves and what it does not know; never the markers.
    assert_eq!(
        annotations,
        [
            "request_id",
            "token_ids",
            "llm_metrics",
            "payload_usage",
            "output_replay_id:abc"
        ]
    );
    // Granted: the opt-ins asked for by name, never the internal metrics.
    assert_eq!(
        granted,
        [
            "request_id",
            "token_ids",
            "x-bypass-remote-prefill",
            "x-prefill-continue"
        ]
        .into_iter()
        .collect::<RequestedAnnotations>()
    );
}

#[test]
fn the_preset_is_the_documented_configuration() {
    let s = format!("{:?}", BypassMarkerLayer::dynamo());
    for part in [
        r#"router_owned: ["x-bypass-remote-prefill", "x-prefill-continue"]"#,
        r#"opt_in: ["x-bypass-remote-prefill", "x-prefill-continue", "request_id", "formatted_prompt", "token_ids"]"#,
        r#"never_forward: ["llm_metrics", "payload_usage"]"#,
        "sdk_safe: false",
    ] {
        assert!(s.contains(part), "{s}");
    }
}
