//! The layer's response body: what is filtered, what passes through, trailers, errors, hints.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue};
use http_body::Body;
use test_support::body::Chunks;
use test_support::body::{collect, data, response, through, Gated, Item, Items};
use tower_bypass_marker::{
    BypassMarkerLayer, FrameTooLarge, Overflow, RequestedAnnotations, BYPASS_REMOTE_PREFILL,
};

const MARKER: &str = "event: x-bypass-remote-prefill\n: true\n\n";
const CHUNK: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
const DONE: &str = "data: [DONE]\n\n";
const SSE: &str = "text/event-stream";

/// Runs an event stream made of `items` through `layer` and collects what comes out.
async fn filter(
    layer: &BypassMarkerLayer,
    requested: Option<RequestedAnnotations>,
    items: impl IntoIterator<Item = Item>,
) -> test_support::body::Collected {
    let res = through(layer, requested, response(SSE, Items::new(items))).await;
    collect(res.into_body()).await
}

fn marked() -> Vec<Item> {
    vec![data(MARKER), data(CHUNK), data(DONE)]
}

fn opted(names: &[&str]) -> Option<RequestedAnnotations> {
    Some(names.iter().copied().collect())
}

#[tokio::test]
async fn default_client_never_sees_the_marker() {
    let res = through(
        &BypassMarkerLayer::new(),
        None,
        response(SSE, Items::new(marked())),
    )
    .await;
    assert!(res.body().is_filtering());
    let out = collect(res.into_body()).await;
    assert_eq!(out.data, format!("{CHUNK}{DONE}").as_bytes());
}

#[tokio::test]
async fn opt_in_through_the_request_extensions_forwards_the_marker() {
    let layer = BypassMarkerLayer::new();
    let res = through(
        &layer,
        opted(&[BYPASS_REMOTE_PREFILL]),
        response(SSE, Items::new(marked())),
    )
    .await;
    assert!(!res.body().is_filtering(), "nothing to remove: passthrough");
    let out = collect(res.into_body()).await;
    assert_eq!(out.data, format!("{MARKER}{CHUNK}{DONE}").as_bytes());
}

#[tokio::test]
async fn opt_in_through_the_response_extensions_forwards_the_marker() {
    let layer = BypassMarkerLayer::new();
    let mut res = response(SSE, Items::new(marked()));
    res.extensions_mut().insert(
        [BYPASS_REMOTE_PREFILL]
            .into_iter()
            .collect::<RequestedAnnotations>(),
    );
    let out = collect(through(&layer, None, res).await.into_body()).await;
    assert_eq!(out.data, format!("{MARKER}{CHUNK}{DONE}").as_bytes());
}

#[tokio::test]
async fn request_and_response_opt_ins_are_united() {
    let layer = BypassMarkerLayer::new().opt_in("request_id");
    let body =
        "event: request_id\n: \"r1\"\n\nevent: x-bypass-remote-prefill\n: true\n\ndata: 1\n\n";
    let mut res = response(SSE, Items::new([data(body)]));
    res.extensions_mut()
        .insert(["request_id"].into_iter().collect::<RequestedAnnotations>());
    let out = collect(
        through(&layer, opted(&[BYPASS_REMOTE_PREFILL]), res)
            .await
            .into_body(),
    )
    .await;
    assert_eq!(out.data, body.as_bytes());

    // Only one of them: the other frame goes.
    let res = response(SSE, Items::new([data(body)]));
    let out = collect(
        through(&layer, opted(&["request_id"]), res)
            .await
            .into_body(),
    )
    .await;
    assert_eq!(out.data, b"event: request_id\n: \"r1\"\n\ndata: 1\n\n");
}

#[tokio::test]
async fn never_forwarded_names_are_removed_even_when_requested() {
    let layer = BypassMarkerLayer::new().never_forward("llm_metrics");
    let body = "event: llm_metrics\ndata: {\"ttft\":3}\n\ndata: 1\n\n";
    let res = response(SSE, Items::new([data(body)]));
    let out = collect(
        through(&layer, opted(&["llm_metrics", BYPASS_REMOTE_PREFILL]), res)
            .await
            .into_body(),
    )
    .await;
    assert_eq!(out.data, b"data: 1\n\n");
}

#[tokio::test]
async fn unknown_requested_names_do_not_change_the_filtering() {
    let layer = BypassMarkerLayer::new();
    let res = response(SSE, Items::new(marked()));
    let out = collect(
        through(
            &layer,
            // Names the layer does not know (another ASCII case of a configured name is the
            // configured name: tests/names.rs).
            opted(&[
                "request_id",
                "x-bypass-remote-prefil",
                "x_bypass_remote_prefill",
            ]),
            res,
        )
        .await
        .into_body(),
    )
    .await;
    assert_eq!(out.data, format!("{CHUNK}{DONE}").as_bytes());
}

#[tokio::test]
async fn non_event_stream_responses_pass_through_untouched() {
    let layer = BypassMarkerLayer::new();
    for content_type in [
        "application/json",
        "application/grpc",
        "text/plain",
        "text/event-streams",
    ] {
        let res = response(content_type, Items::new(marked()));
        let res = through(&layer, None, res).await;
        assert!(!res.body().is_filtering(), "{content_type}");
        assert_eq!(
            res.body().size_hint().exact(),
            Some((MARKER.len() + CHUNK.len() + DONE.len()) as u64)
        );
        let out = collect(res.into_body()).await;
        assert_eq!(
            out.data,
            format!("{MARKER}{CHUNK}{DONE}").as_bytes(),
            "{content_type}"
        );
        assert_eq!(out.chunks.len(), 3, "same frames");
    }
}

/// A compressed event stream cannot be read: it passes untouched only to a client with nothing
/// to remove; any other gets the layer's 502 and no byte of it.
#[tokio::test]
async fn compressed_event_streams_pass_untouched_only_when_nothing_is_removed() {
    let layer = BypassMarkerLayer::new();
    let gz = Bytes::from_static(
        b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03event: x-bypass-remote-prefill\n\n",
    );
    let compressed = || {
        let mut res = response(SSE, Items::new([Item::Data(gz.clone())]));
        res.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        res
    };
    let all: RequestedAnnotations = [BYPASS_REMOTE_PREFILL].into_iter().collect();
    let res = through(&layer, Some(all), compressed()).await;
    assert!(!res.body().is_filtering() && !res.body().is_refused());
    assert_eq!(collect(res.into_body()).await.data, gz);

    let res = through(&layer, None, compressed()).await;
    assert_eq!(res.status(), http::StatusCode::BAD_GATEWAY);
    assert!(res.body().is_refused());
    let out = collect(res.into_body()).await.data;
    assert!(out.starts_with(br#"{"error":{"code":"encoded_event_stream""#));
}

#[tokio::test]
async fn content_length_is_removed_only_from_filtered_responses() {
    let layer = BypassMarkerLayer::new();
    let len = (MARKER.len() + CHUNK.len() + DONE.len()).to_string();
    let mut res = response(SSE, Items::new(marked()));
    res.headers_mut()
        .insert(header::CONTENT_LENGTH, len.parse().unwrap());
    let res = through(&layer, None, res).await;
    assert!(res.headers().get(header::CONTENT_LENGTH).is_none());

    let mut res = response("application/json", Items::new(marked()));
    res.headers_mut()
        .insert(header::CONTENT_LENGTH, len.parse().unwrap());
    let res = through(&layer, None, res).await;
    assert_eq!(res.headers()[header::CONTENT_LENGTH], len.as_str());
}

#[tokio::test]
async fn filtered_body_reports_only_an_upper_bound_and_ends_truthfully() {
    let layer = BypassMarkerLayer::new();
    let total = (MARKER.len() + CHUNK.len() + DONE.len()) as u64;
    let res = through(&layer, None, response(SSE, Items::new(marked()))).await;
    let body = res.into_body();
    assert_eq!(body.size_hint().lower(), 0);
    // Plus the LF that goes before a BOM that would begin the output, until something is out.
    assert_eq!(body.size_hint().upper(), Some(total + 1));
    assert!(!body.is_end_stream());
    let mut body = std::pin::pin!(body);
    let mut frames = 0;
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        frame.unwrap();
        frames += 1;
    }
    assert_eq!(frames, 2);
    assert!(body.is_end_stream());
}

/// An inner body whose upper bound is `u64::MAX` (a body of unknown length that still reports a
/// bound): the filtered body adds what it holds, and saturates instead of overflowing.
#[tokio::test]
async fn filtered_size_hint_saturates_an_inner_upper_bound_of_u64_max() {
    let inner = Hinted(Items::new(marked()), {
        let mut hint = http_body::SizeHint::new();
        hint.set_upper(u64::MAX);
        hint
    });
    let res = through(&BypassMarkerLayer::new(), None, response(SSE, inner)).await;
    let body = res.into_body();
    assert!(body.is_filtering());
    // Before any byte is out, the LF owed before a leading BOM counts too: u64::MAX + 1.
    assert_eq!(body.size_hint().lower(), 0);
    assert_eq!(body.size_hint().upper(), Some(u64::MAX));
    let out = collect(body).await;
    assert_eq!(out.data, format!("{CHUNK}{DONE}").as_bytes());
}

/// `B` with the size hint `hint`.
struct Hinted<B>(B, http_body::SizeHint);

impl<B: Body + Unpin> Body for Hinted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        std::pin::Pin::new(&mut self.0).poll_frame(cx)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.1
    }
}

/// The stream of issue 9: the raw body dispatches nothing in a browser (its third line is a field
/// named `\u{FEFF}data`); without the LF, the filtered body began with a BOM, which the client's
/// UTF-8 decoder strips, and dispatched a `message` with data "2".
#[tokio::test]
async fn a_bom_after_removed_frames_gets_a_lf_before_it_at_any_split() {
    let layer = BypassMarkerLayer::new();
    let input = format!("{MARKER}\u{FEFF}data: 2\n\n{DONE}");
    let expected = format!("\n\u{FEFF}data: 2\n\n{DONE}");
    let input = input.as_bytes();
    for at in 0..=input.len() {
        for at2 in at..=input.len() {
            let parts = [&input[..at], &input[at..at2], &input[at2..]];
            let items = parts.iter().map(|p| data(Bytes::copy_from_slice(p)));
            let out = filter(&layer, None, items).await;
            assert_eq!(
                out.data.escape_ascii().to_string(),
                expected.as_bytes().escape_ascii().to_string(),
                "split at {at}, {at2}"
            );
            // The LF is a frame of its own; the bytes after it are the inner body's.
            assert_eq!(out.chunks[0], "\n");
        }
    }
    // A body that began with a BOM keeps it; a BOM after it stays content.
    let input = format!("\u{FEFF}{MARKER}\u{FEFF}data: 2\n\n");
    let out = filter(&layer, None, [data(input)]).await;
    assert_eq!(out.data, "\u{FEFF}\u{FEFF}data: 2\n\n".as_bytes());
    // Released from the held buffer at the end, before trailers.
    let items = [
        data(MARKER),
        data("\u{FEFF}da"),
        data("ta: 2"),
        Item::Trailers(trailers()),
    ];
    let out = filter(&layer, None, items).await;
    assert_eq!(out.data, "\n\u{FEFF}data: 2".as_bytes());
    assert!(out.trailers.is_some());
}

#[tokio::test]
async fn passthrough_forwards_is_end_stream_and_size_hint_exactly() {
    let layer = BypassMarkerLayer::new();
    let res = through(&layer, None, response("application/json", Items::new([]))).await;
    assert!(res.body().is_end_stream());
    assert_eq!(res.body().size_hint().exact(), Some(0));
}

#[tokio::test]
async fn empty_data_frames_do_not_end_the_body() {
    let layer = BypassMarkerLayer::new();
    let items = [
        data(""),
        data(MARKER),
        data(""),
        data(CHUNK),
        data(""),
        data(DONE),
        data(""),
    ];
    let out = filter(&layer, None, items).await;
    assert_eq!(out.data, format!("{CHUNK}{DONE}").as_bytes());
}

#[tokio::test]
async fn empty_body_yields_nothing() {
    let out = filter(&BypassMarkerLayer::new(), None, []).await;
    assert_eq!(out, Default::default());
}

fn trailers() -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from_static("0"));
    t
}

#[tokio::test]
async fn trailers_come_after_all_data_including_a_held_frame() {
    let layer = BypassMarkerLayer::new();
    let items = [data(MARKER), data("data: par"), Item::Trailers(trailers())];
    let out = filter(&layer, None, items).await;
    assert_eq!(out.data, b"data: par");
    assert_eq!(out.trailers, Some(trailers()));

    // A removed frame held when the trailers arrive is not yielded.
    let items = [
        data(CHUNK),
        data("event: x-bypass-remote-prefill\n: tr"),
        Item::Trailers(trailers()),
    ];
    let out = filter(&layer, None, items).await;
    assert_eq!(out.data, CHUNK.as_bytes());
    assert_eq!(out.trailers, Some(trailers()));
}

#[tokio::test]
async fn inner_errors_pass_through_after_the_held_data() {
    let layer = BypassMarkerLayer::new();
    let items = [
        data(CHUNK),
        data("data: part"),
        Item::Error("upstream reset"),
        data(CHUNK),
    ];
    let out = filter(&layer, None, items).await;
    assert_eq!(out.data, format!("{CHUNK}data: part").as_bytes());
    assert_eq!(out.error.as_deref(), Some("upstream reset"));

    let items = [
        data("event: x-bypass-remote-prefill\n"),
        Item::Error("upstream reset"),
    ];
    let out = filter(&layer, None, items).await;
    assert_eq!(out.data, b"");
    assert_eq!(out.error.as_deref(), Some("upstream reset"));
}

#[tokio::test]
async fn overflow_error_fails_the_body_with_frame_too_large() {
    let layer = BypassMarkerLayer::new()
        .max_frame_bytes(16)
        .on_overflow(Overflow::Error);
    let items = [
        data(CHUNK),
        data("data: 0123456789a"),
        data("bcdefghij\n\n"),
    ];
    let res = through(&layer, None, response(SSE, Items::new(items))).await;
    let mut body = std::pin::pin!(res.into_body());
    let first = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), CHUNK);
    let err = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx))
        .await
        .unwrap()
        .unwrap_err();
    let too_large = err
        .downcast_ref::<FrameTooLarge>()
        .expect("a FrameTooLarge error");
    assert_eq!(too_large.limit(), 16);
    assert_eq!(
        err.to_string(),
        "event-stream frame exceeds the limit of 16 held bytes"
    );
    assert!(std::future::poll_fn(|cx| body.as_mut().poll_frame(cx))
        .await
        .is_none());
    assert!(body.is_end_stream(), "ended, and says so");
}

#[tokio::test]
async fn overflow_forward_streams_an_oversized_frame_unfiltered() {
    let layer = BypassMarkerLayer::new().max_frame_bytes(16);
    let big = format!(
        "event: x-bypass-remote-prefill\ndata: {}\n\n",
        "x".repeat(64)
    );
    let items = [
        data(big[..20].to_owned()),
        data(big[20..].to_owned()),
        data(MARKER),
        data(CHUNK),
    ];
    let out = filter(&layer, None, items).await;
    assert_eq!(out.data, format!("{big}{CHUNK}").as_bytes());
}

#[tokio::test]
async fn chunks_of_whole_kept_frames_are_forwarded_as_the_same_bytes() {
    let layer = BypassMarkerLayer::new();
    let whole = Bytes::from(format!("{CHUNK}{CHUNK}"));
    let mixed = Bytes::from(format!("{CHUNK}{MARKER}{DONE}"));
    let items = [Item::Data(whole.clone()), Item::Data(mixed.clone())];
    let out = filter(&layer, None, items).await;
    assert_eq!(out.chunks.len(), 3);
    assert_eq!(
        out.chunks[0].as_ptr(),
        whole.as_ptr(),
        "same buffer, not a copy"
    );
    assert_eq!(out.chunks[0].len(), whole.len());
    // Around a removed frame, the kept parts are slices of the input chunk.
    assert_eq!(out.chunks[1].as_ptr(), mixed.as_ptr());
    assert_eq!(out.chunks[1], CHUNK);
    assert_eq!(
        out.chunks[2].as_ptr(),
        mixed[CHUNK.len() + MARKER.len()..].as_ptr()
    );
    assert_eq!(out.chunks[2], DONE);
}

#[tokio::test]
async fn complete_frames_are_yielded_before_the_inner_body_is_polled_again() {
    let layer = BypassMarkerLayer::new();
    let gated = Gated::default();
    let res = through(&layer, None, response(SSE, gated.clone())).await;
    let mut body = std::pin::pin!(res.into_body());
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut poll = |body: &mut std::pin::Pin<&mut tower_bypass_marker::BypassMarkerBody<Gated>>| {
        let mut got = Vec::new();
        while let std::task::Poll::Ready(Some(frame)) = body.as_mut().poll_frame(&mut cx) {
            got.extend_from_slice(&frame.unwrap().into_data().unwrap());
        }
        got
    };
    gated.push(data(
        "event: x-bypass-remote-prefill\n: true\n\ndata: 1\n\nda",
    ));
    assert_eq!(poll(&mut body), b"data: 1\n\n");
    assert!(gated.has_waker(), "pending only on the inner body's waker");
    gated.push(data("ta: 2\n"));
    assert_eq!(poll(&mut body), b"");
    gated.push(data("\n"));
    assert_eq!(poll(&mut body), b"data: 2\n\n");
    gated.close();
    assert_eq!(poll(&mut body), b"");
    assert!(body.is_end_stream());
}

#[tokio::test]
async fn sdk_safe_mode_removes_frames_the_sdks_cannot_parse() {
    let layer = BypassMarkerLayer::new().sdk_safe(true);
    let body = "id: 4\n\n: keep-alive\n\nevent: ping\n\ndata: 1\n\n";
    let res = through(
        &layer,
        opted(&[BYPASS_REMOTE_PREFILL]),
        response(SSE, Items::new([data(body)])),
    )
    .await;
    assert!(
        res.body().is_filtering(),
        "SDK-safe mode filters even with nothing named to remove"
    );
    assert_eq!(
        collect(res.into_body()).await.data,
        b": keep-alive\n\ndata: 1\n\n"
    );
}

#[tokio::test]
async fn data_of_other_buf_types_is_filtered_like_bytes() {
    use bytes::Buf;
    let stream: &'static str = "event: x-bypass-remote-prefill\n: true\n\ndata: 1\n\nevent: x-bypass-remote-prefill\n\ndata: 2\n\n";
    let input = stream.as_bytes();
    // Chunks of 7 bytes, each split in two halves that the body chains together: its data is not
    // `Bytes` but a `bytes::buf::Chain` of two slices, so the layer must gather each chunk with
    // `copy_to_bytes`.
    let chunks = input
        .chunks(7)
        .map(|c| c.split_at(c.len() / 2))
        .map(|(a, b)| a.chain(b));
    let res = through(
        &BypassMarkerLayer::new(),
        None,
        response(SSE, Chunks::new(chunks)),
    )
    .await;
    assert!(res.body().is_filtering());
    let out = collect(res.into_body()).await;
    assert_eq!(out.data, b"data: 1\n\ndata: 2\n\n");
}
