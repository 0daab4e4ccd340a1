//! The JSON request guard (`json` feature) on a 1 MiB chat request (long messages with escapes and
//! non-ASCII text, a base64 image), against a bare `serde_json::from_slice::<IgnoredAny>` of the
//! same bytes, in the same run.
//!
//! `cargo bench --features json --bench json_guard`. Figures and method: BENCHMARKS.md.

use std::time::Duration;

use bytes::Bytes;
use criterion::{black_box, criterion_main, Criterion, Throughput};
use futures_util::FutureExt;
use http::{header, Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower::{service_fn, Layer, Service};
use tower_bypass_marker::json::JsonGuardBody;
use tower_bypass_marker::BypassMarkerLayer;

/// A chat request of 1 MiB: 40 long messages (escapes, non-ASCII text) and a base64 PNG that makes
/// up the rest (about 600 KiB), with `nvext.annotations` at the end (`annotations` as given).
fn chat_request(annotations: &str) -> Bytes {
    let mut messages = Vec::new();
    let text = "The sky looks blue because air scatters short wavelengths more than long ones \
                (Rayleigh scattering), so \\\"blue\\\" light reaches you from every direction.\\n\
                Températures, naïve café, 東京 and emoji 🙂 appear too.\\t";
    for i in 0..40 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(format!(
            r#"{{"role":"{role}","content":"{}"}}"#,
            text.repeat(30)
        ));
    }
    let doc = |image: &str| {
        let mut messages = messages.clone();
        messages.push(format!(
            r#"{{"role":"user","content":[{{"type":"text","text":"What is in this image?"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{image}","detail":"high"}}}}]}}"#
        ));
        format!(
            r#"{{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{}],"stream":true,"max_tokens":512,"temperature":0.7,"nvext":{{"annotations":{annotations}}}}}"#,
            messages.join(",")
        )
    };
    let image_len = (1 << 20) - doc("").len();
    let image: String = (0..image_len)
        .map(|i| {
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
                [(i * 7 + i / 64) % 64] as char
        })
        .collect();
    let doc = doc(&image);
    assert_eq!(doc.len(), 1 << 20);
    Bytes::from(doc)
}

/// A chat request of 1 MiB with no image: messages in Chinese and Russian, so that most bytes are
/// in multi-byte UTF-8 sequences (the guard checks each; `IgnoredAny` does not).
fn non_ascii_request() -> Bytes {
    let text =
        "大型语言模型的路由器在预填充之后把请求交给解码工作者，\\\"缓存\\\"命中时跳过远程预填充。\\n\
                Маршрутизатор передаёт запрос декодеру, если кэш уже содержит префикс. ";
    let mut messages = Vec::new();
    let mut len = 0;
    while len < (1 << 20) - 16 * 1024 {
        let message = format!(r#"{{"role":"user","content":"{}"}}"#, text.repeat(20));
        len += message.len() + 1;
        messages.push(message);
    }
    let doc = |pad: &str| {
        format!(
            r#"{{"model":"m","messages":[{}],"user":"{pad}","nvext":{{"annotations":["request_id"]}}}}"#,
            messages.join(",")
        )
    };
    let pad = "x".repeat((1 << 20) - doc("").len());
    let doc = doc(&pad);
    assert_eq!(doc.len(), 1 << 20);
    Bytes::from(doc)
}

fn guard(c: &mut Criterion) {
    let bypass = BypassMarkerLayer::new().opt_in("request_id");
    let upstream = service_fn(|req: Request<JsonGuardBody<Full<Bytes>>>| async move {
        // Take the forwarded body's frames as they are (no copy).
        let mut body = std::pin::pin!(req.into_body());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut len = 0;
        while let std::task::Poll::Ready(Some(Ok(frame))) = body.as_mut().poll_frame(&mut cx) {
            len += frame.into_data().map_or(0, |d| d.len());
        }
        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(len.to_string()))))
    });
    let mut svc = bypass.json_guard().layer(upstream);

    for (name, body) in [
        ("kept", chat_request(r#"["request_id"]"#)),
        (
            "stripped",
            chat_request(r#"["request_id","x-bypass-remote-prefill:true"]"#),
        ),
        ("non_ascii", non_ascii_request()),
    ] {
        serde_json::from_slice::<serde_json::Value>(&body).expect("valid JSON");
        eprintln!("json_guard/{name}: {} bytes", body.len());
        interleaved(name, &body, &mut svc);
        let mut group = c.benchmark_group(format!("json_guard_{name}"));
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.sample_size(50);
        group.warm_up_time(Duration::from_millis(500));
        group.measurement_time(Duration::from_secs(3));
        group.bench_function("ignored_any", |b| {
            b.iter(|| {
                serde_json::from_slice::<serde::de::IgnoredAny>(black_box(&body)).unwrap();
            })
        });
        group.bench_function("guard", |b| {
            b.iter(|| {
                let req = Request::post("/v1/chat/completions")
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Full::new(black_box(body.clone())))
                    .unwrap();
                let res = svc.call(req).now_or_never().unwrap().unwrap();
                assert_eq!(res.status(), 200);
                black_box(res);
            })
        });
        group.finish();
    }
}

/// The two variants alternated run by run (so that load on a shared machine hits both alike),
/// 201 runs each; prints the medians and their ratio.
fn interleaved<S>(name: &str, body: &Bytes, svc: &mut S)
where
    S: Service<
        Request<Full<Bytes>>,
        Response = Response<tower_bypass_marker::json::ResponseBody<Full<Bytes>>>,
    >,
    S::Error: std::fmt::Debug,
{
    let mut bare = Vec::new();
    let mut guarded = Vec::new();
    let mut utf8 = Vec::new();
    for _ in 0..201 {
        let start = std::time::Instant::now();
        std::str::from_utf8(black_box(body)).unwrap();
        utf8.push(start.elapsed());
        let start = std::time::Instant::now();
        serde_json::from_slice::<serde::de::IgnoredAny>(black_box(body)).unwrap();
        bare.push(start.elapsed());
        let req = Request::post("/v1/chat/completions")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(black_box(body.clone())))
            .unwrap();
        let start = std::time::Instant::now();
        let res = svc.call(req).now_or_never().unwrap().unwrap();
        guarded.push(start.elapsed());
        assert_eq!(res.status(), 200);
    }
    bare.sort();
    guarded.sort();
    utf8.sort();
    let (bare, guarded, utf8) = (bare[100], guarded[100], utf8[100]);
    let mib = body.len() as f64 / (1 << 20) as f64;
    eprintln!(
        "json_guard/{name} interleaved medians: ignored_any {:.1} us ({:.0} MiB/s), guard {:.1} us ({:.0} MiB/s), guard/ignored_any throughput {:.2}",
        bare.as_secs_f64() * 1e6,
        mib / bare.as_secs_f64(),
        guarded.as_secs_f64() * 1e6,
        mib / guarded.as_secs_f64(),
        bare.as_secs_f64() / guarded.as_secs_f64()
    );
    eprintln!(
        "json_guard/{name} interleaved medians: std::str::from_utf8 of the whole body {:.1} us ({:.0} MiB/s)",
        utf8.as_secs_f64() * 1e6,
        mib / utf8.as_secs_f64(),
    );
}

// criterion_group! writes an undocumented `pub fn benches`.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::guard);
}
use group::benches;
criterion_main!(benches);
