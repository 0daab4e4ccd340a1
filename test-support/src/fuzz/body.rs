//! Drives the real `BypassMarkerBody` for a case: a `tower::service_fn` answers with a scripted
//! inner body, the layer wraps it, and the body is polled by hand with a no-op waker.

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Request, Response};
use http_body::Body;
use tower::{service_fn, Layer, Service};
use tower_bypass_marker::{BoxError, FrameTooLarge};

use super::case::{Case, CONTENT_TYPES, TRANSFER_CODINGS};
use super::oracle::{self, esc};
use crate::body::{Item, Items};

/// The message of the inner body's error.
pub const INNER_ERROR: &str = "inner body failed";

/// What the wrapped body yields, poll by poll.
#[derive(Debug)]
pub enum Event {
    /// A data frame.
    Data(Bytes),
    /// `Poll::Pending`.
    Pending,
    /// A trailers frame.
    Trailers(HeaderMap),
    /// An error, and the body is done.
    Error(BoxError),
    /// The end of the body.
    End,
}

fn trailers() -> HeaderMap {
    let mut map = HeaderMap::new();
    map.insert("x-fuzz-trailer", HeaderValue::from_static("1"));
    map
}

/// The inner body's script for `case`.
pub fn script(case: &Case) -> Vec<Item> {
    let plan = &case.body;
    let mut items = Vec::new();
    for (i, chunk) in case.chunks().into_iter().enumerate() {
        if plan.error_after == Some(i) {
            items.push(Item::Error(INNER_ERROR));
            return items;
        }
        if plan.empty_chunks {
            items.push(Item::Data(Bytes::new()));
        }
        items.push(Item::Data(Bytes::copy_from_slice(chunk)));
        if plan.pending {
            items.push(Item::Pending);
        }
    }
    if plan.error_after.is_some() {
        items.push(Item::Error(INNER_ERROR));
    } else if plan.trailers {
        items.push(Item::Trailers(trailers()));
    }
    items
}

/// A waker that does nothing: every poll here is by hand. (`Waker::noop` is newer than the crate's
/// MSRV.)
struct Noop;

impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

/// A waker that does nothing: the drivers poll again at once.
pub fn noop_waker() -> Waker {
    Waker::from(Arc::new(Noop))
}

/// Polls `f` once; it must be ready (a service or body that never waits).
pub fn ready<F: Future>(f: F) -> F::Output {
    let waker = noop_waker();
    let mut cx = Context::from_waker(&waker);
    match pin!(f).poll(&mut cx) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("a future over ready services was pending"),
    }
}

/// Runs `case` through the layer and checks everything the body yields against the oracle.
pub fn check_body(case: &Case) {
    let items = script(case);
    let (content_type, encoding, _) = CONTENT_TYPES[case.body.content_type];
    let head = case.body.head;
    let transfer = TRANSFER_CODINGS[case.body.transfer];
    let event_stream = case.body.event_stream();
    // An event-stream head without content (204, 304, HEAD): no body byte, whatever the codings.
    let emptied = event_stream && head.no_content();
    let encoded = case.body.encoded();
    let filtering =
        event_stream && !emptied && !encoded && (case.sdk_safe || !case.removed_names().is_empty());

    // The opt-in, put where the plan says.
    let requested = case.requested();
    let (mut on_request, mut on_response) = (None, None);
    match case.body.opt_in_at {
        0 => on_request = Some(requested),
        1 => on_response = Some(requested),
        2 => {
            let (a, b): (Vec<_>, Vec<_>) = case
                .requested
                .iter()
                .enumerate()
                .partition(|(i, _)| i % 2 == 0);
            on_request = Some(a.into_iter().map(|(_, n)| n.as_str()).collect());
            on_response = Some(b.into_iter().map(|(_, n)| n.as_str()).collect());
        }
        _ => {
            on_request = Some(requested.clone());
            on_response = Some(requested);
        }
    }

    let mut res = Response::builder()
        .status(head.status())
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CONTENT_LENGTH, case.input.len())
        .body(Items::new(items.iter().cloned()))
        .unwrap();
    if let Some(encoding) = encoding {
        res.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static(encoding));
    }
    if let Some(transfer) = transfer {
        res.headers_mut().insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static(transfer),
        );
    }
    if let Some(r) = on_response {
        res.extensions_mut().insert(r);
    }
    let mut res = Some(res);
    let mut svc = case.layer().layer(service_fn(move |_req: Request<()>| {
        std::future::ready(Ok::<_, Infallible>(res.take().expect("called once")))
    }));
    let mut req = Request::new(());
    *req.method_mut() = head.method();
    if let Some(r) = on_request {
        req.extensions_mut().insert(r);
    }
    ready(std::future::poll_fn(|cx| svc.poll_ready(cx))).unwrap();
    let res = ready(svc.call(req)).unwrap();
    // An encoded event stream the layer would have to filter is refused: a 502 in place of the
    // stream, whose body is never polled (the `Items` body's items are left unread).
    // A transfer coding other than `chunked` is refused the same way.
    let refused = event_stream && !emptied && encoded && !case.removed_names().is_empty();
    assert_eq!(res.body().is_refused(), refused, "encoded stream refused");
    if refused {
        assert_eq!(res.status(), http::StatusCode::BAD_GATEWAY);
        assert_eq!(
            res.headers().get(header::CONTENT_TYPE).unwrap(),
            "application/json"
        );
        assert!(!res.headers().contains_key(header::CONTENT_ENCODING));
        assert!(!res.headers().contains_key(header::TRANSFER_ENCODING));
        let json = collect(res.into_body());
        let json: serde_json::Value = serde_json::from_slice(&json).expect("a JSON error");
        assert_eq!(json["error"]["code"], "encoded_event_stream", "{json}");
        let named = if case.body.transfer == 2 {
            "transfer-encoding gzip,"
        } else {
            "content-encoding gzip,"
        };
        let message = json["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with(&format!("the event stream has {named}")),
            "{message}"
        );
        return;
    }
    assert_eq!(res.status(), head.status(), "the status passes");
    if emptied {
        // Headers kept (`content-length` too: it states another representation's length), no
        // body: the inner one is never polled.
        assert_eq!(
            res.headers().get(header::CONTENT_TYPE).unwrap(),
            content_type
        );
        assert!(res.headers().contains_key(header::CONTENT_LENGTH));
        let body = res.into_body();
        assert!(!body.is_filtering() && !body.is_refused());
        assert!(body.is_end_stream(), "an emptied body is at its end");
        assert_eq!(body.size_hint().exact(), Some(0));
        let mut body = pin!(body);
        let waker = noop_waker();
        let mut cx = Context::from_waker(&waker);
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Ready(None) => {}
            Poll::Ready(Some(Ok(frame))) => panic!(
                "a body byte or trailers of a response without content: {:?}",
                frame.data_ref().map(|d| esc(d))
            ),
            other => panic!(
                "an emptied body failed or waited (pending: {})",
                other.is_pending()
            ),
        }
        return;
    }
    assert_eq!(
        res.headers().get(header::CONTENT_TYPE).unwrap(),
        content_type
    );
    assert_eq!(
        res.headers().contains_key(header::CONTENT_LENGTH),
        !filtering,
        "content-length is removed exactly when the body is filtered"
    );
    let body = res.into_body();
    assert_eq!(body.is_filtering(), filtering, "filtering decision");

    // Poll to the end, checking size_hint and is_end_stream before every poll.
    let mut body = pin!(body);
    let waker = noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut events = Vec::new();
    // Every poll yields a frame of data (at most one per input byte and chunk), an item or the end.
    let budget = 2 * (items.len() + case.input.len()) + 4;
    let expected_data: Option<Vec<u8>> = if filtering {
        let exp = expected_data(case);
        Some(match exp.all {
            Ok(all) | Err(all) => all,
        })
    } else {
        None
    };
    let mut data = Vec::new();
    loop {
        assert!(
            events.len() <= budget,
            "more polls than the script and its data allow"
        );
        let end_stream = body.is_end_stream();
        let hint = body.size_hint();
        if let Some(expected) = &expected_data {
            // Wrong data is reported as such, before the size hint it makes wrong.
            assert!(
                expected.starts_with(&data),
                "output so far {:?} is not a prefix of the expected {:?}",
                esc(&data),
                esc(expected)
            );
            let remaining = (expected.len() - data.len()) as u64;
            assert!(
                hint.lower() <= remaining,
                "size_hint lower {} > {remaining} bytes the oracle still expects",
                hint.lower()
            );
            if let Some(upper) = hint.upper() {
                assert!(
                    upper >= remaining,
                    "size_hint upper {upper} < {remaining} bytes the oracle still expects \
                     (output so far {:?}, expected {:?})",
                    esc(&data),
                    esc(expected)
                );
            }
        } else {
            let inner = body.get_ref();
            assert_eq!(
                end_stream,
                inner.is_end_stream(),
                "passthrough is_end_stream"
            );
            let inner_hint = inner.size_hint();
            assert_eq!(
                (hint.lower(), hint.upper()),
                (inner_hint.lower(), inner_hint.upper())
            );
        }
        let event = match body.as_mut().poll_frame(&mut cx) {
            Poll::Pending => Event::Pending,
            Poll::Ready(None) => Event::End,
            Poll::Ready(Some(Err(e))) => Event::Error(e),
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(d) => Event::Data(d),
                Err(frame) => Event::Trailers(frame.into_trailers().expect("data or trailers")),
            },
        };
        if end_stream {
            assert!(matches!(event, Event::End), "is_end_stream, then {event:?}");
        }
        if let Event::Data(d) = &event {
            data.extend_from_slice(d);
        }
        let done = matches!(event, Event::End);
        events.push(event);
        if done {
            break;
        }
    }
    assert!(body.is_end_stream(), "is_end_stream after the end");

    if filtering {
        check_filtered(case, &events);
    } else {
        check_passthrough(&items, &events);
    }
}

/// Every data byte of a body that never waits nor fails (the layer's own 502).
fn collect<B: Body<Data = Bytes>>(body: B) -> Vec<u8>
where
    B::Error: std::fmt::Debug,
{
    let mut body = pin!(body);
    let waker = noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut out = Vec::new();
    loop {
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Ready(None) => return out,
            Poll::Ready(Some(frame)) => {
                if let Ok(data) = frame.expect("the refusal never fails").into_data() {
                    out.extend_from_slice(&data);
                }
            }
            Poll::Pending => panic!("the refusal body waited"),
        }
    }
}

/// The data the script yields before any error, and its chunk ends.
fn data_before_error(case: &Case) -> (&[u8], &[usize]) {
    match case.body.error_after {
        Some(k) if k < case.ends.len() => {
            let end = if k == 0 { 0 } else { case.ends[k - 1] };
            (&case.input[..end], &case.ends[..k])
        }
        _ => (&case.input[..], &case.ends[..]),
    }
}

/// The oracle for the data the script yields before any error.
fn expected_data(case: &Case) -> oracle::Expected {
    let (input, ends) = data_before_error(case);
    oracle::expected(
        input,
        ends,
        &oracle::rules(case),
        case.max_frame_bytes(),
        case.overflow,
    )
}

fn check_passthrough(items: &[Item], events: &[Event]) {
    let mut events = events.iter();
    for item in items {
        let event = events.next().expect("an event for every item");
        match (item, event) {
            (Item::Data(a), Event::Data(b)) => assert_eq!(esc(a), esc(b), "passthrough data"),
            (Item::Pending, Event::Pending) => {}
            (Item::Trailers(a), Event::Trailers(b)) => assert_eq!(a, b),
            (Item::Error(_), Event::Error(e)) => assert_eq!(e.to_string(), INNER_ERROR),
            (item, event) => panic!("passthrough gave {event:?} for {item:?}"),
        }
    }
    assert!(matches!(events.next(), Some(Event::End)));
    assert!(events.next().is_none());
}

fn check_filtered(case: &Case, events: &[Event]) {
    let exp = expected_data(case);
    let mut data = Vec::new();
    let mut pendings = 0;
    let mut tail = Vec::new();
    for event in events {
        match event {
            Event::Data(d) => {
                assert!(tail.is_empty(), "data after {tail:?}");
                data.extend_from_slice(d);
            }
            Event::Pending => {
                assert!(tail.is_empty(), "pending after {tail:?}");
                // The script is pending once after each chunk: all it allows is out by now.
                let n = *exp
                    .after
                    .get(pendings)
                    .expect("a pending for each chunk handled");
                assert_eq!(
                    esc(&data),
                    esc(exp_prefix(&exp, n)),
                    "yielded before the inner body's pending #{pendings}"
                );
                pendings += 1;
            }
            other => tail.push(other),
        }
    }
    if case.body.pending {
        assert_eq!(pendings, exp.after.len(), "pendings seen");
    }
    let error_expected = case.body.error_after.is_some();
    match &exp.all {
        Ok(all) => {
            assert_eq!(esc(&data), esc(all), "output");
            match tail.as_slice() {
                [Event::Error(e), Event::End] if error_expected => {
                    assert_eq!(e.to_string(), INNER_ERROR)
                }
                [Event::Trailers(t), Event::End] if !error_expected && case.body.trailers => {
                    assert_eq!(t, &trailers())
                }
                [Event::End] if !error_expected && !case.body.trailers => {}
                other => panic!("after the data: {other:?}"),
            }
        }
        Err(before) => {
            assert_eq!(esc(&data), esc(before), "output before FrameTooLarge");
            match tail.as_slice() {
                [Event::Error(e), Event::End] => {
                    let e = e
                        .downcast_ref::<FrameTooLarge>()
                        .unwrap_or_else(|| panic!("expected FrameTooLarge, got {e}"));
                    assert_eq!(e.limit(), case.max_frame_bytes());
                }
                other => panic!("expected FrameTooLarge, got {other:?}"),
            }
        }
    }
}

/// The first `n` bytes of the expected output.
fn exp_prefix(exp: &oracle::Expected, n: usize) -> &[u8] {
    match &exp.all {
        Ok(all) | Err(all) => &all[..n],
    }
}
