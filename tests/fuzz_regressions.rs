//! Inputs the fuzz targets (see FUZZING.md) found, kept as tests that plain `cargo test` runs.
//!
//! Every file under `fuzz/regressions/<target>/` (and the seed inputs, `fuzz/seeds/`) is replayed
//! through the real body with the targets' own decoding and oracle (`test_support::fuzz`), the `scanner`
//! target's inputs with a plain inner body; and every one of them through the public sans-IO
//! filter, against the model and against the body (the `scanner` and `filter` targets).
//! The findings in the crate also have a test of their own below, written out by hand.

use std::convert::Infallible;
use std::path::Path;

use http::{header, Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use test_support::body::Chunks;
use test_support::fuzz::case::Case;
use test_support::fuzz::{body, filter, oracle};
use tower::{service_fn, Layer, ServiceExt};
use tower_bypass_marker::{BoxError, BypassMarkerLayer, FrameTooLarge, Overflow};

/// Replays every input under `fuzz/<dir>/` through the body; `plain` drops the body plan
/// (trailers, errors, `Pending`), as the `scanner` target ignores it. Returns how many ran.
fn replay(dir: &str, plain: bool) -> usize {
    replay_with(dir, |case| {
        if plain {
            body::check_body(&case.plain());
        } else {
            body::check_body(case);
        }
    })
}

/// Replays every input under `fuzz/<dir>/` through `check`. Returns how many ran.
fn replay_with(dir: &str, check: impl Fn(&Case)) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz").join(dir);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| !path.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect();
    files.sort();
    for file in &files {
        let data = std::fs::read(file).unwrap();
        let case = Case::decode(&data);
        if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&case))) {
            eprintln!("{}: {case:#?}", file.display());
            std::panic::resume_unwind(e);
        }
    }
    files.len()
}

#[test]
fn fuzz_findings_replay_through_the_body() {
    let ran = replay("regressions/scanner", true) + replay("regressions/body", false);
    assert!(ran > 0, "no regression inputs found");
}

#[test]
fn fuzz_inputs_replay_through_the_sans_io_filter() {
    for dir in ["regressions/scanner", "regressions/body", "seeds"] {
        let ran = replay_with(dir, |case| {
            oracle::check_scanner(case, filter::filter_chunks(case));
            filter::check_filter(case);
        });
        assert!(ran > 0, "no inputs in {dir}");
    }
}

#[test]
fn fuzz_seeds_replay_through_the_body() {
    assert!(replay("seeds", true) > 0);
    assert!(replay("seeds", false) > 0);
}

// The findings, written out.

async fn filter(layer: BypassMarkerLayer, chunks: &[&'static [u8]]) -> (Vec<u8>, Option<BoxError>) {
    let body = Chunks::from_static(chunks);
    let mut body = Some(body);
    let svc = layer.layer(service_fn(move |_req: Request<()>| {
        let body = body.take().expect("called once");
        async move {
            Ok::<_, Infallible>(
                Response::builder()
                    .header(header::CONTENT_TYPE, "text/event-stream")
                    .body(body)
                    .unwrap(),
            )
        }
    }));
    let mut body = svc.oneshot(Request::new(())).await.unwrap().into_body();
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => out.extend_from_slice(&frame.into_data().unwrap()),
            Err(e) => {
                assert!(
                    body.frame().await.is_none(),
                    "the body ends after its error"
                );
                assert!(body.is_end_stream(), "is_end_stream once ended");
                return (out, Some(e));
            }
        }
    }
    assert!(body.is_end_stream(), "is_end_stream once ended");
    (out, None)
}

/// `scanner` target, first minute: a body that is nothing but the first one or two bytes of a
/// UTF-8 BOM is an unterminated field line (`\xEF` is the field name) with no `data`, judged as it
/// stands at the end of the body, so SDK-safe mode removes it, as it does once the line is
/// terminated. The scanner released such bytes without looking at `sdk_safe` (fixed in f6e4766).
#[tokio::test]
async fn sdk_safe_removes_a_body_that_is_only_the_first_bytes_of_a_bom() {
    let sdk_safe = || BypassMarkerLayer::new().sdk_safe(true);
    assert_eq!(filter(sdk_safe(), &[b"\xEF"]).await.0, b"");
    assert_eq!(filter(sdk_safe(), &[b"\xEF", b"\xBB"]).await.0, b"");
}

#[tokio::test]
async fn sdk_safe_removes_a_terminated_line_of_bom_bytes_and_keeps_a_whole_bom() {
    let sdk_safe = || BypassMarkerLayer::new().sdk_safe(true);
    assert_eq!(filter(sdk_safe(), &[b"\xEF\n\n"]).await.0, b"");
    assert_eq!(filter(sdk_safe(), &[b"\xEF", b"\xBB\n"]).await.0, b"");
    assert_eq!(filter(sdk_safe(), &[b"\xEF\xBB", b"x"]).await.0, b"");
    assert_eq!(
        filter(sdk_safe(), &[b"\xEF", b"\xBB\xBF"]).await.0,
        b"\xEF\xBB\xBF"
    );
    // Without SDK-safe mode nothing names a removed event: the bytes stay.
    assert_eq!(
        filter(BypassMarkerLayer::new(), &[b"\xEF"]).await.0,
        b"\xEF"
    );
}

/// `body` target: with a cap of 0 and `Overflow::Error`, one byte of an open frame at the end of a
/// chunk already fails the body, after the data before that frame, and the body then ends, with
/// `is_end_stream` true (it stayed false after `FrameTooLarge` before 6cd6bb7).
#[tokio::test]
async fn frame_too_large_with_a_zero_cap_fails_after_the_data_before_the_frame() {
    let layer = || {
        BypassMarkerLayer::new()
            .sdk_safe(true)
            .max_frame_bytes(0)
            .on_overflow(Overflow::Error)
    };
    let (out, err) = filter(layer(), &[b"\0"]).await;
    assert_eq!(out, b"");
    let err = err.expect("an error");
    assert_eq!(err.downcast_ref::<FrameTooLarge>().unwrap().limit(), 0);

    let (out, err) = filter(layer(), &[b"data: 1\n\nevent: x\n\nd"]).await;
    assert_eq!(out, b"data: 1\n\n");
    assert!(err.unwrap().is::<FrameTooLarge>());

    // A frame that closes within its chunk is never held, so it never outgrows the cap.
    let (out, err) = filter(layer(), &[b"data: 1\n\n", b"event: x\n\n"]).await;
    assert_eq!(out, b"data: 1\n\n");
    assert!(err.is_none());
}

/// The `json` target's inputs (`fuzz/seeds-json/`, and `fuzz/regressions/json/` once it has any),
/// replayed with its own driver and oracle.
#[cfg(feature = "json")]
mod json {
    use std::path::Path;
    use test_support::fuzz::json as target;

    #[test]
    fn json_fuzz_inputs_replay_through_the_guard() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
        let mut ran = 0;
        for dir in ["seeds-json", "regressions/json"] {
            let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
                continue;
            };
            let mut files: Vec<_> = entries.map(|e| e.unwrap().path()).collect();
            files.sort();
            for file in files {
                let data = std::fs::read(&file).unwrap();
                if let Err(e) = std::panic::catch_unwind(|| target::check(&data)) {
                    eprintln!("{}", file.display());
                    std::panic::resume_unwind(e);
                }
                ran += 1;
            }
        }
        assert!(ran > 0, "no json fuzz inputs found");
    }
}
