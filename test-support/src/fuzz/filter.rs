//! The public sans-IO `EventStreamFilter`, driven as a host would drive it, and compared with the
//! tower body it is the engine of.

use std::convert::Infallible;
use std::pin::pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Request, Response};
use http_body::Body;
use tower::{service_fn, Layer, Service};
use tower_bypass_marker::sans_io::{EventStreamFilter, FilterOutput};
use tower_bypass_marker::{BypassMarkerLayer, FrameTooLarge};

use super::body::{noop_waker, ready};
use super::case::{Case, CONTENT_TYPES, TRANSFER_CODINGS};
use super::oracle::esc;
use crate::body::{Item, Items};

/// Pushes `chunk` into `filter` and polls it until it needs more input, appending what it outputs
/// to `out`; its error if it fails. Panics if it ends (it was not finished), gives an empty
/// piece, or polls more often than it holds and was given bytes (each piece of data is at least
/// a byte, so a filter that makes progress never needs more).
pub fn push_chunk(
    filter: &mut EventStreamFilter,
    chunk: Bytes,
    out: &mut Vec<u8>,
) -> Result<(), FrameTooLarge> {
    let most = filter.held_bytes() + chunk.len() + 1;
    filter.push(chunk);
    match drain(filter, out, most)? {
        FilterOutput::NeedInput => Ok(()),
        output => panic!("{output:?} before finish"),
    }
}

/// Finishes `filter` and polls it to its end, appending what it outputs to `out`; its error if it
/// fails. Panics if it asks for input, gives an empty piece, or polls more often than it holds
/// bytes, and checks that `End` is final and nothing is left held.
pub fn finish(filter: &mut EventStreamFilter, out: &mut Vec<u8>) -> Result<(), FrameTooLarge> {
    let most = filter.held_bytes() + 1;
    filter.finish();
    match drain(filter, out, most)? {
        FilterOutput::End => {}
        output => panic!("{output:?} after finish"),
    }
    assert_eq!(filter.poll_output(), Ok(FilterOutput::End), "End is final");
    assert_eq!(filter.held_bytes(), 0, "bytes left in the filter");
    Ok(())
}

/// Polls `filter` until an output that is not data (at most `most` pieces of data), appending the
/// data to `out`.
fn drain(
    filter: &mut EventStreamFilter,
    out: &mut Vec<u8>,
    most: usize,
) -> Result<FilterOutput, FrameTooLarge> {
    for _ in 0..=most {
        match filter.poll_output()? {
            FilterOutput::Data(data) => {
                assert!(!data.is_empty(), "empty output");
                out.extend_from_slice(&data);
            }
            FilterOutput::NeedInput => return Ok(FilterOutput::NeedInput),
            FilterOutput::End => return Ok(FilterOutput::End),
            // FilterOutput is #[non_exhaustive].
            output => panic!("an output this harness does not know: {output:?}"),
        }
    }
    panic!("the filter makes no progress: more than {most} pieces of data");
}

/// The output of the public filter for `case`'s chunks (`None` when it failed with
/// `FrameTooLarge`), and the output's length after each chunk. The filter is made for an event
/// stream; with nothing to remove there is none, and the body is its own output. Asserts that the
/// bytes held between chunks never pass the cap.
pub fn filter_chunks(case: &Case) -> Option<(Vec<u8>, Vec<usize>)> {
    let chunks = case.chunks();
    let layer = case.layer();
    let Some(mut filter) = layer.event_stream_filter(&case.requested()) else {
        let mut after = Vec::new();
        let mut len = 0;
        for chunk in &chunks {
            len += chunk.len();
            after.push(len);
        }
        return Some((case.input.clone(), after));
    };
    // A BOM's first two bytes may be held whatever the cap.
    let cap = case.max_frame_bytes().max(2);
    let mut out = Vec::new();
    let mut after = Vec::new();
    for chunk in chunks {
        push_chunk(&mut filter, Bytes::copy_from_slice(chunk), &mut out).ok()?;
        assert!(
            filter.held_bytes() <= cap,
            "held {} bytes past the cap of {cap}",
            filter.held_bytes()
        );
        after.push(out.len());
    }
    finish(&mut filter, &mut out).ok()?;
    Some((out, after))
}

/// What a driver saw: the output after each chunk, the whole output, and whether it failed.
#[derive(Debug, PartialEq, Eq)]
pub struct Seen {
    /// The output's length after each chunk.
    pub after: Vec<usize>,
    /// The whole output, escaped.
    pub out: String,
    /// The limit of a `FrameTooLarge`, if the body failed with one.
    pub too_large: Option<usize>,
}

/// The response head of `case` (its content type, content coding and transfer coding).
pub fn response_head(case: &Case) -> HeaderMap {
    let (content_type, encoding, _) = CONTENT_TYPES[case.body.content_type];
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Some(encoding) = encoding {
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static(encoding));
    }
    if let Some(transfer) = TRANSFER_CODINGS[case.body.transfer] {
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static(transfer),
        );
    }
    headers
}

/// The tower body for `case`'s head, opt-in and chunks (a `Pending` after each chunk): the output
/// after every chunk, the whole output, and its `FrameTooLarge`.
pub fn body_seen(case: &Case, layer: &BypassMarkerLayer) -> Seen {
    let headers = response_head(case);
    let mut items = Vec::new();
    for chunk in case.chunks() {
        items.push(Item::Data(Bytes::copy_from_slice(chunk)));
        items.push(Item::Pending);
    }
    let mut res = Response::new(Items::new(items));
    *res.headers_mut() = headers;
    *res.status_mut() = case.body.head.status();
    let mut res = Some(res);
    let mut svc = layer.layer(service_fn(move |_req: Request<()>| {
        std::future::ready(Ok::<_, Infallible>(res.take().expect("called once")))
    }));
    let mut req = Request::new(());
    *req.method_mut() = case.body.head.method();
    req.extensions_mut().insert(case.requested());
    let body = ready(svc.call(req)).unwrap().into_body();
    let mut body = pin!(body);
    let waker = noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut from_body = Seen {
        after: Vec::new(),
        out: String::new(),
        too_large: None,
    };
    let mut out = Vec::new();
    loop {
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => out.extend_from_slice(&frame.into_data().unwrap()),
            Poll::Ready(Some(Err(err))) => {
                let err = err.downcast::<FrameTooLarge>().expect("only FrameTooLarge");
                from_body.too_large = Some(err.limit());
                break;
            }
            Poll::Ready(None) => break,
            Poll::Pending => from_body.after.push(out.len()),
        }
    }
    from_body.out = esc(&out);
    from_body
}

/// The tower body and the public filter, given the same response head, opt-in and chunks, output
/// the same bytes after every chunk and at the end, and fail with the same `FrameTooLarge`.
pub fn check_filter(case: &Case) {
    let headers = response_head(case);
    let chunks = case.chunks();
    let from_body = body_seen(case, &case.layer());
    let (method, status) = (case.body.head.method(), case.body.head.status());
    // An event-stream head without content (a 204, a 304, the response to HEAD): the tower body
    // is empty whatever the inner one holds; the public filter gives `None` (nothing to filter),
    // and no refusal, so a host of it must drop such a body itself (as `GatewayExchange` does).
    if case.body.event_stream() && case.body.head.no_content() {
        assert_eq!(
            from_body,
            Seen {
                after: Vec::new(),
                out: String::new(),
                too_large: None,
            },
            "a body without content is empty"
        );
        let layer = case.layer();
        let requested = case.requested();
        assert!(layer
            .response_filter(&method, status, &headers, &requested)
            .is_none());
        assert!(layer
            .refuses_encoded(&method, status, &headers, &requested)
            .is_none());
        return;
    }
    // An encoded event stream with something to remove (a content coding, or a transfer coding
    // other than `chunked`): a host of the public filter asks `refuses_encoded` first and answers
    // the 502 the tower body carries, never the stream.
    if case
        .layer()
        .refuses_encoded(&method, status, &headers, &case.requested())
        .is_some()
    {
        assert!(
            from_body.out.contains("encoded_event_stream") && from_body.too_large.is_none(),
            "an encoded stream is refused: {from_body:?}"
        );
        return;
    }

    // The public filter, for the same head.
    let mut from_filter = Seen {
        after: Vec::new(),
        out: String::new(),
        too_large: None,
    };
    let mut out = Vec::new();
    match case
        .layer()
        .response_filter(&method, status, &headers, &case.requested())
    {
        None => {
            for chunk in &chunks {
                out.extend_from_slice(chunk);
                from_filter.after.push(out.len());
            }
        }
        Some(mut filter) => {
            let mut pushed = Ok(());
            for chunk in &chunks {
                pushed = push_chunk(&mut filter, Bytes::copy_from_slice(chunk), &mut out);
                if pushed.is_err() {
                    break;
                }
                from_filter.after.push(out.len());
            }
            if let Err(err) = pushed.and_then(|()| finish(&mut filter, &mut out)) {
                from_filter.too_large = Some(err.limit());
            }
        }
    }
    from_filter.out = esc(&out);
    assert_eq!(from_body, from_filter, "the body and the filter differ");
}
