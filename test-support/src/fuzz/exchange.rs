//! Drives the sans-IO `GatewayExchange` (the driver of the Envoy hosts, feature `json`) for a case,
//! as a host does: the client's opt-in in a JSON request body read through the guard, then the
//! case's response head (status, method, content type and codings) and its chunks, each as one
//! slice or two, the last with `end_of_stream` (or an empty last chunk, where the body has
//! trailers). The inner body's error is not a host's event: the whole input is sent.
//!
//! The oracle is the same as the tower body's ([`super::oracle`]): no body byte for an event-stream
//! head without content, the 502 `encoded_event_stream` and no stream byte for an unreadable coding
//! with something to remove, and otherwise the reference model's output, after every chunk but the
//! last and at the end, or a prefix of it and `FrameTooLarge` where the body fails.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue};
use tower_bypass_marker::sans_io::{
    BodyStep, ChunkEdit, ExchangeError, GatewayExchange, RequestStep, ResponseStep, UnseenRequest,
};

use super::case::{Case, CONTENT_TYPES, TRANSFER_CODINGS};
use super::oracle::{self, esc};

/// Runs `case` through a `GatewayExchange` and checks it against the oracle.
pub fn check_exchange(case: &Case) {
    // The guard strips from the opt-in an entry with a non-ASCII character (a lenient upstream
    // could fold it into a router-owned name), so the client asks for the printable ASCII names
    // only, and the oracle knows it.
    let mut case = case.clone();
    case.requested
        .retain(|name| name.bytes().all(|b| b.is_ascii_graphic() || b == b' '));
    let case = &case;
    let layer = case.layer();
    let head = case.body.head;
    let mut exchange = GatewayExchange::new(&layer, layer.request_guard(), UnseenRequest::Fail);
    let mut json = HeaderMap::new();
    json.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let step = exchange
        .request_headers(head.method(), &json, false)
        .unwrap();
    assert!(matches!(step, RequestStep::ReadBody), "{step:?}");
    let body = serde_json::json!({"model": "m", "nvext": {"annotations": case.requested}});
    let step = exchange
        .request_body(Bytes::from(body.to_string()), true)
        .unwrap();
    assert!(!matches!(step, BodyStep::Refuse(_)), "{step:?}");

    let (content_type, encoding, _) = CONTENT_TYPES[case.body.content_type];
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(case.input.len()));
    if let Some(encoding) = encoding {
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static(encoding));
    }
    if let Some(transfer) = TRANSFER_CODINGS[case.body.transfer] {
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static(transfer),
        );
    }
    let step = exchange
        .response_headers(head.status(), &headers, false)
        .unwrap();

    let event_stream = case.body.event_stream();
    let emptied = event_stream && head.no_content();
    let refused =
        event_stream && !emptied && case.body.encoded() && !case.removed_names().is_empty();
    let filtering = event_stream
        && !emptied
        && !case.body.encoded()
        && (case.sdk_safe || !case.removed_names().is_empty());

    if refused {
        let ResponseStep::Refuse(refusal) = step else {
            panic!("an unreadable coding with something to remove: {step:?}");
        };
        assert_eq!(refusal.status(), 502);
        assert_eq!(refusal.code(), "encoded_event_stream");
        let named = if case.body.transfer == 2 {
            "transfer-encoding gzip,"
        } else {
            "content-encoding gzip,"
        };
        assert!(
            refusal
                .message()
                .starts_with(&format!("the event stream has {named}")),
            "{}",
            refusal.message()
        );
        assert!(!exchange.filters_response());
        return;
    }
    // `Filter` removes `content-length` when the body is filtered, keeps it when every byte of a
    // body without content goes (it states another representation's length).
    match step {
        ResponseStep::Filter {
            remove_content_length,
            ..
        } => {
            assert!(emptied || filtering, "filtered: {step:?}");
            assert_eq!(remove_content_length, !emptied, "{step:?}");
        }
        ResponseStep::Pass => assert!(!emptied && !filtering, "passed through"),
        other => panic!("{other:?}"),
    }

    // The chunks as a host gives them: each as one slice, or (odd chunks) two.
    let chunks = case.chunks();
    let mut sent: Vec<(Vec<&[u8]>, bool)> = chunks
        .iter()
        .enumerate()
        .map(|(i, chunk)| {
            let slices = if i % 2 == 1 {
                let (a, b) = chunk.split_at(chunk.len() / 2);
                vec![a, b]
            } else {
                vec![*chunk]
            };
            (slices, false)
        })
        .collect();
    if case.body.trailers {
        sent.push((vec![&[][..]], true));
    } else if let Some(last) = sent.last_mut() {
        last.1 = true;
    }
    // The filter scans each slice where it lies, so a frame that spans two slices is held and
    // counts against the frame cap as across chunks: the oracle cuts the input at every slice's
    // end, and `last[i]` is the index of chunk `i`'s end among those.
    let mut slice_ends = Vec::new();
    let mut last = Vec::new();
    let mut at = 0;
    for (slices, _) in &sent {
        for slice in slices {
            at += slice.len();
            slice_ends.push(at);
        }
        last.push(slice_ends.len() - 1);
    }
    if slice_ends.is_empty() {
        slice_ends.push(0);
    }
    let exp = (filtering && !emptied).then(|| {
        oracle::expected(
            &case.input,
            &slice_ends,
            &oracle::rules(case),
            case.max_frame_bytes(),
            case.overflow,
        )
    });
    let mut out = Vec::new();
    let mut edit = ChunkEdit::new();
    for (i, (slices, end)) in sent.iter().enumerate() {
        let step = exchange.response_body(slices, *end, &mut edit);
        if emptied {
            step.unwrap();
            assert_eq!(
                edit.output_len(),
                0,
                "a body byte of a response without content"
            );
            continue;
        }
        let Some(exp) = &exp else {
            step.unwrap();
            assert!(
                edit.is_unchanged(),
                "a response passed through is not edited"
            );
            continue;
        };
        match step {
            Ok(()) => edit.write_to(slices, &mut out),
            Err(ExchangeError::FrameTooLarge(err)) => {
                let Err(before) = &exp.all else {
                    panic!("FrameTooLarge where the body completes: {err}");
                };
                assert_eq!(err.limit(), case.max_frame_bytes());
                assert!(
                    before.starts_with(&out),
                    "output {:?} before the reset is not a prefix of {:?}",
                    esc(&out),
                    esc(before)
                );
                return;
            }
            Err(err) => panic!("{err}"),
        }
        let all = match &exp.all {
            Ok(all) | Err(all) => all,
        };
        if *end {
            let Ok(all) = &exp.all else {
                panic!("the exchange completed where the body fails with FrameTooLarge");
            };
            assert_eq!(esc(&out), esc(all), "output");
        } else if let Some(&n) = exp.after.get(last[i]) {
            assert_eq!(
                esc(&out),
                esc(&all[..n]),
                "output after chunk {i} of {}",
                chunks.len()
            );
        }
    }
    if emptied || exp.is_some() {
        assert!(!exchange.filters_response(), "the exchange ended");
    }
}
