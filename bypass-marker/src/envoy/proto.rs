//! Conversions between Envoy's ext_proc messages and `http` types, and the few responses the
//! processor sends. No state: [`ExtProcExchange`](super::exchange::ExtProcExchange) decides, this file spells
//! the decisions in protobuf.

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderMap as ProtoHeaderMap, HeaderValue,
    HeaderValueOption,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::{
    processing_mode::{BodySendMode, HeaderSendMode},
    ProcessingMode,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, StreamedBodyResponse,
};
use http::header::{HeaderMap, HeaderName, HeaderValue as HttpHeaderValue};

use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, ProcessingRequest,
};
use tonic::Status;

use tower_bypass_marker::sans_io::Refusal;

/// The most header entries (pseudo-headers included) one headers message may carry: far more
/// than Envoy forwards by default (`max_headers_count`, 100), and well under what one
/// `http::HeaderMap` holds (reserving room for about 24,576 entries or more at once panics).
pub(crate) const MAX_HEADERS: usize = 16 * 1024;

/// Refuses, with `RESOURCE_EXHAUSTED`, a message whose headers are more than [`MAX_HEADERS`]:
/// every front door calls it before the message reaches the exchange, so that
/// [`to_header_map`] never meets one.
pub(crate) fn admit(msg: &ProcessingRequest) -> Result<(), Status> {
    let headers = match &msg.request {
        Some(Request::RequestHeaders(h) | Request::ResponseHeaders(h)) => h.headers.as_ref(),
        _ => None,
    };
    let n = headers.map_or(0, |h| h.headers.len());
    if n > MAX_HEADERS {
        return Err(Status::resource_exhausted(format!(
            "{n} headers in one message, more than {MAX_HEADERS}"
        )));
    }
    Ok(())
}

/// The headers of a proto `HeaderMap` as an `http::HeaderMap`, and the pseudo-headers the
/// processor needs (`:method` or `:status`), as bytes.
///
/// Envoy sends each value in `raw_value` (bytes; the default since Envoy 1.28) or in `value`
/// (a string, with older runtime flags); both are read. Pseudo-headers (`:path`, ...) are not
/// HTTP header names and are left out of the map. An entry that is not a valid header (Envoy
/// validates headers before it sends them, so this does not happen) is left out too.
pub(crate) fn to_header_map(
    proto: Option<&ProtoHeaderMap>,
    pseudo: &str,
) -> (HeaderMap, Option<Vec<u8>>) {
    let mut map = HeaderMap::new();
    let mut wanted = None;
    let Some(proto) = proto else {
        return (map, wanted);
    };
    // At most `MAX_HEADERS` (see `admit`).
    map.reserve(proto.headers.len());
    for entry in &proto.headers {
        let value = raw_value(entry);
        if entry.key.starts_with(':') {
            if entry.key == pseudo {
                wanted = Some(value.to_vec());
            }
            continue;
        }
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(entry.key.as_bytes()),
            HttpHeaderValue::from_bytes(value),
        ) else {
            continue;
        };
        map.append(name, value);
    }
    (map, wanted)
}

fn raw_value(entry: &HeaderValue) -> &[u8] {
    if entry.raw_value.is_empty() {
        entry.value.as_bytes()
    } else {
        &entry.raw_value
    }
}

/// A header set to one value, replacing any it had (`raw_value`, which Envoy reads by default).
pub(crate) fn set_header(name: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_owned(),
            value: String::new(),
            raw_value: value.to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// A headers or body response that changes nothing.
pub(crate) fn unchanged_headers() -> HeadersResponse {
    HeadersResponse { response: None }
}

/// A body response that forwards the chunk as Envoy holds it: no copy of it goes back.
pub(crate) fn unchanged_body() -> BodyResponse {
    BodyResponse { response: None }
}

/// A body response that replaces the chunk (or the buffered body) with `body`, and applies
/// `headers` (Envoy applies header changes from a body response only in BUFFERED mode).
pub(crate) fn replace_body(body: Vec<u8>, headers: Option<HeaderMutation>) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            header_mutation: headers,
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::Body(body)),
            }),
            ..CommonResponse::default()
        }),
    }
}

/// A body response in `FULL_DUPLEX_STREAMED` mode: `body` is what Envoy forwards (it forwards
/// nothing of the chunks it sent), `end_of_stream` on the last one when the body ended without
/// trailers.
pub(crate) fn streamed(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..StreamedBodyResponse::default()
                })),
            }),
            ..CommonResponse::default()
        }),
    }
}

/// A request headers response that asks the upstream for an unencoded response
/// (`accept-encoding: identity`): an encoded event stream cannot be filtered, and the layer passes
/// it through untouched, so a compressing upstream would carry annotations past the processor.
pub(crate) fn identity_encoding() -> HeadersResponse {
    HeadersResponse {
        response: Some(CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: vec![set_header("accept-encoding", b"identity")],
                remove_headers: Vec::new(),
            }),
            ..CommonResponse::default()
        }),
    }
}

/// A headers response that removes these headers.
pub(crate) fn remove_headers(names: &[&str]) -> HeadersResponse {
    HeadersResponse {
        response: Some(CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: Vec::new(),
                remove_headers: names.iter().map(|n| (*n).to_owned()).collect(),
            }),
            ..CommonResponse::default()
        }),
    }
}

/// The guard's refusal as Envoy's local reply: its status, `content-type: application/json`
/// and its OpenAI-shaped body, as the `JsonGuard` layer answers.
pub(crate) fn immediate(refusal: &Refusal) -> ImmediateResponse {
    ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(refusal.status().as_u16()),
        }),
        headers: Some(HeaderMutation {
            set_headers: vec![set_header("content-type", b"application/json")],
            remove_headers: Vec::new(),
        }),
        body: refusal.body().to_vec(),
        grpc_status: None,
        details: format!("bypass_marker_{}", refusal.code()),
    }
}

/// The 503 for a request body that would take the bodies the processor holds past its budget
/// (`--max-buffered-bytes`), as Envoy's local reply: `retry-after: 1` and an OpenAI-shaped error
/// (`type: server_error`, code `request_bodies_over_budget`), as the sidecar answers.
pub(crate) fn over_budget() -> ImmediateResponse {
    let body = serde_json::json!({
        "error": {
            "message": "the processor holds as many request bodies as it may; retry shortly",
            "type": "server_error",
            "param": null,
            "code": OVER_BUDGET,
        }
    });
    ImmediateResponse {
        status: Some(HttpStatus { code: 503 }),
        headers: Some(HeaderMutation {
            set_headers: vec![
                set_header("content-type", b"application/json"),
                set_header("retry-after", b"1"),
            ],
            remove_headers: Vec::new(),
        }),
        body: body.to_string().into_bytes(),
        grpc_status: None,
        details: format!("bypass_marker_{OVER_BUDGET}"),
    }
}

/// The error code of [`over_budget`].
const OVER_BUDGET: &str = "request_bodies_over_budget";

/// Envoy's `BodySendMode` values, as the protocol carries them.
pub(crate) const BODY_NONE: i32 = BodySendMode::None as i32;
pub(crate) const BODY_STREAMED: i32 = BodySendMode::Streamed as i32;
pub(crate) const BODY_BUFFERED: i32 = BodySendMode::Buffered as i32;
pub(crate) const BODY_FULL_DUPLEX: i32 = BodySendMode::FullDuplexStreamed as i32;

/// A body mode's name, as Envoy's configuration spells it (the number, for one this build does
/// not know).
pub(crate) fn mode_name(mode: i32) -> String {
    BodySendMode::try_from(mode).map_or_else(
        |_| format!("{mode} (unknown)"),
        |m| m.as_str_name().to_owned(),
    )
}

/// The processing mode to put in `mode_override`: Envoy replaces the whole mode of the stream
/// with it, so it restates the documented configuration (headers sent, trailers skipped) with
/// these two body modes.
pub(crate) fn mode(request_body: i32, response_body: i32) -> ProcessingMode {
    ProcessingMode {
        request_header_mode: HeaderSendMode::Send as i32,
        response_header_mode: HeaderSendMode::Send as i32,
        request_body_mode: request_body,
        response_body_mode: response_body,
        request_trailer_mode: HeaderSendMode::Skip as i32,
        response_trailer_mode: HeaderSendMode::Skip as i32,
    }
}
