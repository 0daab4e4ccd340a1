//! Property test of the JSON request guard (`json` feature): random documents with annotations
//! in random forms, escapes and whitespace, through the public layer.
//!
//! For every document: the guard forwards it; no entry of the forwarded `nvext.annotations` is
//! router-owned; the forwarded document parses to the input's with exactly the router-owned
//! entries removed; the bytes before and after the array are the client's; when nothing was
//! stripped the upstream gets the very same `Bytes`; the opt-in is what `guard_annotations` grants
//! for the same entries. `PROPTEST_CASES=100000 cargo test --release --features json --test
//! json_properties` runs a long campaign.
#![cfg(feature = "json")]

use std::ops::Range;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use serde_json::Value;
use test_support::fuzz::json::annotation_strings;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_bypass_marker::json::JsonGuardBody;
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};

fn layer() -> BypassMarkerLayer {
    BypassMarkerLayer::new()
        .router_owned("x-prefill-continue")
        .opt_in("request_id")
        .never_forward("llm_metrics")
}

/// JSON whitespace, often none.
fn ws() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(vec![" ", "\n", "\t", "\r\n", "  "]),
        0..3,
    )
    .prop_map(|v| v.concat())
}

/// `text` as a JSON string literal, each character written plainly or escaped at random.
fn literal(text: String) -> impl Strategy<Value = String> {
    let n = text.chars().count();
    prop::collection::vec((0u8..6, any::<bool>()), n).prop_map(move |choices| {
        let mut out = String::from("\"");
        for (c, (how, upper)) in text.chars().zip(choices) {
            let hex = |u: u16| {
                let s = format!("\\u{u:04x}");
                if upper {
                    s.to_uppercase().replace("\\U", "\\u")
                } else {
                    s
                }
            };
            let short = match c {
                '"' => Some("\\\""),
                '\\' => Some("\\\\"),
                '/' => Some("\\/"),
                '\n' => Some("\\n"),
                '\t' => Some("\\t"),
                '\r' => Some("\\r"),
                '\u{8}' => Some("\\b"),
                '\u{c}' => Some("\\f"),
                _ => None,
            };
            let must_escape = c == '"' || c == '\\' || (c as u32) < 0x20;
            match how {
                0 | 1 if short.is_some() => out.push_str(short.unwrap()),
                0..=2 if !must_escape => out.push(c),
                _ => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&hex(*u));
                    }
                }
            }
        }
        out.push('"');
        out
    })
}

/// The text of an annotation entry: router-owned in some form, a near miss, an opt-in, a
/// never-forwarded name, or anything.
fn entry_text() -> impl Strategy<Value = String> {
    let owned = prop::sample::select(vec!["x-bypass-remote-prefill", "x-prefill-continue"]);
    let cased = (owned, prop::collection::vec(any::<bool>(), 32)).prop_map(|(name, up)| {
        name.chars()
            .zip(up)
            .map(|(c, u)| if u { c.to_ascii_uppercase() } else { c })
            .collect::<String>()
    });
    let pad = prop::sample::select(vec!["", "", " ", "\t", "  ", "\u{a0}", "\n"]);
    let value = prop::sample::select(vec!["", ":", ":true", ": 1", ":x-bypass-remote-prefill"]);
    let router_owned = (pad.clone(), cased.clone(), pad, value)
        .prop_map(|(a, name, b, v)| format!("{a}{name}{b}{v}"));
    let near_miss = (
        cased,
        prop::sample::select(vec!["-", "x", "_1", "\u{e9}", "/"]),
        any::<bool>(),
    )
        .prop_map(|(name, extra, before)| {
            if before {
                format!("{extra}{name}")
            } else {
                format!("{name}{extra}")
            }
        });
    prop_oneof![
        3 => router_owned,
        2 => near_miss,
        2 => prop::sample::select(vec!["request_id", "llm_metrics", "Request_Id", "x-bypass", "query_instance_id"])
            .prop_map(str::to_owned),
        1 => "[ -~\u{e9}\u{1F600}\n\"\\\\]{0,12}",
    ]
}

/// A JSON value that is not an annotation, written with random whitespace and spellings.
fn filler() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        prop::sample::select(vec![
            "0",
            "-0",
            "1.0",
            "-12.5e+3",
            "1E-7",
            "12345678901234567890123",
            "true",
            "false",
            "null",
            "3.14159265358979323846264338327950288",
        ])
        .prop_map(str::to_owned),
        prop_oneof![
            entry_text(),
            Just("nvext".to_owned()),
            Just("annotations".to_owned()),
            "[A-Za-z0-9+/=]{0,40}",
            // Longer text in any script, so that strings are also crossed a word at a time.
            "\\PC{16,60}",
        ]
        .prop_flat_map(literal),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec((ws(), inner.clone(), ws()), 0..4).prop_map(|items| {
                let items: Vec<String> = items
                    .into_iter()
                    .map(|(a, v, b)| format!("{a}{v}{b}"))
                    .collect();
                format!("[{}]", items.join(","))
            }),
            prop::collection::vec((ws(), inner, ws()), 0..4).prop_map(|items| {
                let members: Vec<String> = items
                    .into_iter()
                    .enumerate()
                    .map(|(i, (a, v, b))| format!("{a}\"m{i}\"{b}:{a}{v}{b}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    })
}

/// An entry of the annotations array: a string (most of the time) or another value.
fn entry() -> impl Strategy<Value = String> {
    prop_oneof![4 => entry_text().prop_flat_map(literal), 1 => filler()]
}

/// The annotations array, `null`, or nothing.
fn annotations() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        1 => Just(None),
        1 => Just(Some("null".to_owned())),
        8 => (prop::collection::vec((ws(), entry(), ws()), 0..8), ws()).prop_map(|(items, inner)| {
            let items: Vec<String> = items.into_iter().map(|(a, v, b)| format!("{a}{v}{b}")).collect();
            Some(if items.is_empty() { format!("[{inner}]") } else { format!("[{}]", items.join(",")) })
        }),
    ]
}

/// A key literal (with random escapes) for `name`.
fn key(name: &'static str) -> impl Strategy<Value = String> {
    literal(name.to_owned())
}

/// Members `k0..kn` with filler values, and where among them another member goes.
fn members(n: Range<usize>) -> impl Strategy<Value = (Vec<(String, String)>, usize)> {
    prop::collection::vec((ws(), filler(), ws()), n)
        .prop_flat_map(|values| {
            let len = values.len();
            let keys: Vec<_> = (0..len).map(|i| literal(format!("k{i}")).boxed()).collect();
            (Just(values), keys, 0..=len)
        })
        .prop_map(|(values, keys, at)| {
            let members = keys
                .into_iter()
                .zip(values)
                .map(|(k, (a, v, b))| (format!("{a}{k}{b}"), format!("{a}{v}{b}")))
                .collect();
            (members, at)
        })
}

/// A document and the byte span of its `nvext.annotations` array, if it has one.
fn document() -> impl Strategy<Value = (String, Option<Range<usize>>)> {
    let nvext = prop_oneof![
        1 => Just(None),
        1 => Just(Some((None, "null".to_owned(), None))),
        6 => (members(0..3), annotations(), key("nvext"), key("annotations"), ws()).prop_map(
            |((members, at), annotations, nvext_key, annotations_key, space)| {
                // The nvext object's text, with the array's span inside it.
                let prefix = format!("{space}{annotations_key}{space}:{space}");
                let entry = annotations.as_ref().map(|a| (prefix, a.as_str(), Some(0..a.len())));
                let (text, span) = object("", &members, at, entry);
                Some((Some(nvext_key), text, span))
            }
        ),
    ];
    (members(0..5), nvext, key("nvext"), ws(), ws()).prop_map(
        |((members, at), nvext, nvext_key, lead, trail)| {
            let entry = nvext.as_ref().map(|(k, text, inner)| {
                let key = k.as_ref().unwrap_or(&nvext_key);
                (format!("{key}:"), text.as_str(), inner.clone())
            });
            let (mut doc, span) = object(&lead, &members, at, entry);
            doc.push_str(&trail);
            (doc, span)
        },
    )
}

/// The text of a JSON object (after `lead`) of `members`, with `entry` (the text before its
/// value, key and colon, then the value's text, and a span within the value) put before the
/// member at `at`, or after the last one: the text, and where the entry's span lies in it.
fn object(
    lead: &str,
    members: &[(String, String)],
    at: usize,
    entry: Option<(String, &str, Option<Range<usize>>)>,
) -> (String, Option<Range<usize>>) {
    let mut entries: Vec<String> = members.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    let mut span = None;
    if let Some((prefix, value, inner)) = entry {
        // `{`, the entries before it and their commas, then its key and colon.
        let start = lead.len() + 1 + entries[..at].iter().map(|e| e.len() + 1).sum::<usize>();
        span = inner.map(|r| start + prefix.len() + r.start..start + prefix.len() + r.end);
        entries.insert(at, format!("{prefix}{value}"));
    }
    (format!("{lead}{{{}}}", entries.join(",")), span)
}

/// Whether `guard_annotations` strips `entry`.
fn is_stripped(layer: &BypassMarkerLayer, entry: &str) -> bool {
    let mut one = vec![entry.to_owned()];
    layer.guard_annotations(&mut one);
    one.is_empty()
}

/// The forwarded frames and opt-in, through the public layer (everything is ready at once).
fn guard(body: Bytes) -> (StatusCode, Vec<Bytes>, Option<RequestedAnnotations>) {
    type Seen = (Vec<Bytes>, Option<RequestedAnnotations>);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Seen::default()));
    let record = seen.clone();
    let upstream = service_fn(move |req: Request<JsonGuardBody<Full<Bytes>>>| {
        let record = record.clone();
        async move {
            let granted = req.extensions().get::<RequestedAnnotations>().cloned();
            let mut body = req.into_body();
            let mut frames = Vec::new();
            while let Some(frame) = body.frame().await {
                frames.push(frame.unwrap().into_data().unwrap());
            }
            *record.lock().unwrap() = (frames, granted);
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
        }
    });
    let svc = ServiceBuilder::new()
        .layer(layer().json_guard())
        .service(upstream);
    let req = Request::post("/")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .unwrap();
    let res = svc
        .oneshot(req)
        .now_or_never()
        .expect("ready at once")
        .unwrap();
    let (frames, granted) = std::mem::take(&mut *seen.lock().unwrap());
    (res.status(), frames, granted)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_guard_strips_exactly_the_router_owned_entries((doc, span) in document()) {
        let layer = layer();
        let input: Value = serde_json::from_str(&doc).unwrap_or_else(|e| panic!("the generator wrote {doc:?}: {e}"));
        let body = Bytes::from(doc.clone());
        let (status, frames, granted) = guard(body.clone());
        prop_assert_eq!(status, StatusCode::OK);
        let out = frames.concat();
        let output: Value = serde_json::from_slice(&out).expect("the guard forwards JSON");

        // No router-owned entry survives.
        for entry in annotation_strings(&output) {
            prop_assert!(!is_stripped(&layer, &entry), "{:?} survived", entry);
        }
        // The output is the input with exactly the router-owned entries removed.
        let mut expected = input.clone();
        let mut stripped_any = false;
        if let Some(a) = expected.get_mut("nvext").and_then(|n| n.get_mut("annotations")).and_then(Value::as_array_mut) {
            a.retain(|e| {
                let strip = e.as_str().is_some_and(|s| is_stripped(&layer, s));
                stripped_any |= strip;
                !strip
            });
        }
        prop_assert_eq!(&output, &expected);
        if stripped_any {
            // Every byte outside the array is the client's.
            let span = span.expect("stripped from an array");
            prop_assert_eq!(&out[..span.start], &doc.as_bytes()[..span.start]);
            prop_assert_eq!(&out[out.len() - (doc.len() - span.end)..], &doc.as_bytes()[span.end..]);
        } else {
            prop_assert_eq!(frames.len(), 1);
            prop_assert_eq!(frames[0].as_ptr(), body.as_ptr(), "the same Bytes");
            prop_assert_eq!(&frames[0], &body);
        }
        // The opt-in is what guard_annotations grants for the same entries.
        let mut entries = annotation_strings(&input);
        let expected_granted = layer.guard_annotations(&mut entries);
        prop_assert_eq!(granted.unwrap_or_default(), expected_granted);
    }
}

/// One `content-type` header value: a media type (JSON or not, or empty) and parameters, some
/// with quoted strings that hold commas, some with a quote left open. No non-JSON media type ends
/// in `json` or `+json`, so the merged value never reads as JSON as a whole unless one header
/// does.
fn content_type() -> impl Strategy<Value = Vec<u8>> {
    let essence = prop::sample::select(vec![
        &b"application/json"[..],
        b"APPLICATION/JSON",
        b" application/json ",
        b"\xA0application/json",
        b"application/vnd.api+json",
        b"application/+json",
        b"text/plain",
        b"text/html",
        b"application/xml",
        b"multipart/form-data",
        b"application/jsonl",
        b"text/json",
        b"",
        b" ",
    ]);
    let param = prop::sample::select(vec![
        &b"charset=utf-8"[..],
        b"q=\"a,b\"",
        b"x=\"",
        b"y=\"\\\",application/json\"",
        b"z=\"text/plain, application/json\"",
        b"boundary=a,b",
        b"w=\"\\\\\"",
        b"",
    ]);
    (essence, prop::collection::vec(param, 0..3)).prop_map(|(essence, params)| {
        let mut value = essence.to_vec();
        for p in params {
            value.push(b';');
            value.extend_from_slice(p);
        }
        value
    })
}

fn reads(guard: &tower_bypass_marker::sans_io::RequestGuard, values: &[&[u8]]) -> bool {
    let mut headers = http::HeaderMap::new();
    for v in values {
        headers.append(
            header::CONTENT_TYPE,
            http::HeaderValue::from_bytes(v).unwrap(),
        );
    }
    match guard.check_head(&headers, false) {
        tower_bypass_marker::sans_io::HeadDecision::Read => true,
        tower_bypass_marker::sans_io::HeadDecision::Skip => false,
        other => panic!("{other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Envoy merges repeated `content-type` headers into one value joined by `,`: the guard reads
    /// the merged value exactly when it reads the headers apart ("any one counts").
    #[test]
    fn several_content_types_and_their_comma_joined_value_get_the_same_verdict(
        values in prop::collection::vec(content_type(), 1..5),
    ) {
        let guard = layer().request_guard();
        let apart: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
        let joined = values.join(&b","[..]);
        prop_assert_eq!(
            reads(&guard, &apart),
            reads(&guard, &[&joined[..]]),
            "{:?}",
            String::from_utf8_lossy(&joined)
        );
    }
}
