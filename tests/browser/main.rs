//! A real browser as a second reference: headless Chromium's `EventSource` against the layer.
//!
//! Thousands of hostile streams (`streams.rs`, fixed seed) are served from an axum server
//! on 127.0.0.1, each raw and through the real [`BypassMarkerLayer`] in several configurations, in
//! the stream's own random chunks. A page (`page.html`) opens an `EventSource` per
//! response, records every event it dispatches (type, data, lastEventId), closes it on the
//! `error` event that follows the end of the response (so it never reconnects), and POSTs the
//! records back. Every stream is also served in a variant with a `data: +` line at the end of
//! every frame, so that frames without `data`, which a browser never dispatches, become visible.
//!
//! Two checks per stream (`events.rs` computes the expected events):
//! - **The reference itself.** The raw stream's events are those of the stream's lines read as
//!   WHATWG says, with Chromium's one known deviation: a CR or LF right after a leading BOM is
//!   taken as content of the next line, so that line has no effect (it is modelled, not skipped).
//!   This shows the page listens for every type and the reading of lines below is Chromium's.
//! - **The layer.** The filtered stream's events are those of the raw stream's lines minus the
//!   frames the configuration removes (by event type; in SDK-safe mode also frames with fields and
//!   no `data`, unless their type is opted in): the raw events minus the removed types, where the
//!   lastEventId after a removed frame that carried an `id:` is computed from the kept `id` fields
//!   only, and where the BOM deviation hits whatever line follows the BOM in the filtered stream.
//!
//! Running it: `cargo test --test browser -- --nocapture`. Without a `chromium` (or
//! `chromium-browser`) on `PATH` (or at `BYPASS_MARKER_CHROMIUM`), the test prints a notice and
//! passes, unless `BYPASS_MARKER_BROWSER=1` is set, as `.ci/run` does after installing Debian's
//! `chromium`: then it fails. `BYPASS_MARKER_BROWSER_STREAMS` sets the number of streams.
//!
//! # Disagreements found
//!
//! Each is pinned as a stream in `streams.rs` (`PINNED`), served in every setup.
//! - **A BOM that was not at the start became the start** (issue 9, defect 2). Default layer,
//!   `event: x-bypass-remote-prefill\n: true\n\n\xEF\xBB\xBFdata: 2\n\n`: the raw stream
//!   dispatches nothing (the field name is `\u{FEFF}data`), the filtered one began with the BOM,
//!   which the decoder strips, and dispatched `message` "2". The same with SDK-safe removing a
//!   data-less frame in front of the BOM. Fixed by the LF the layer now forwards before such a BOM.
//! - **SDK-safe mode removed data-less frames the client opted in to** (issue 9, defect 3).
//!   `.sdk_safe(true)`, client opted in to the marker,
//!   `event: x-bypass-remote-prefill\nid: 7\n: true\n\ndata: 1\n\n`: the raw `message` "1" has
//!   lastEventId "7", the filtered one had "". With `.opt_in("request_id").sdk_safe(true)` and
//!   `request_id` granted, `\xEF\xBB\xBF\nevent: request_id\n\ndata: 1\n\n`: the raw stream
//!   dispatches "1" (Chromium folds the LF into the `event` line), the filtered one, without the
//!   `request_id` frame, dispatched nothing (the LF went into `data: 1`). Fixed: SDK-safe mode
//!   keeps a frame whose event type the client opted in to.
//!
//! With both fixes, every case agrees (also in a run of 4,000 streams,
//! `BYPASS_MARKER_BROWSER_STREAMS=4000`). No other kind of disagreement was found.
//!
//! Not a disagreement but worth knowing: Chromium's BOM deviation makes a correct filter visible.
//! Default layer, `\xEF\xBB\xBF\nevent: x-bypass-remote-prefill\n\ndata: 1\n\n`: raw, Chromium
//! folds the LF into the marker's `event` line and dispatches "1"; filtered (the marker removed
//! as WHATWG says), it folds the LF into `data: 1` and dispatches nothing. A WHATWG parser
//! dispatches "1" for both. The expected events above model this.

mod events;
mod streams;

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use events::{chromium_events, kept, lines, possible_types, Event, Removal};
use http::header;
use serde::Deserialize;
use tokio::sync::mpsc;
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations, BYPASS_REMOTE_PREFILL};

/// How many generated streams (each served in two versions) by default.
const STREAMS: usize = 1000;

/// How many ports the server listens on (5 concurrent EventSources each).
const PORTS: usize = 4;

/// How long the page may take for all of them.
const PATIENCE: Duration = Duration::from_secs(180);

/// One layer configuration and the client that talks to it.
struct Setup {
    name: &'static str,
    layer: BypassMarkerLayer,
    requested: &'static [&'static str],
    removal: Removal,
}

fn setups() -> Vec<Setup> {
    let names = || {
        BypassMarkerLayer::new()
            .opt_in("request_id")
            .never_forward("llm_metrics")
            .router_owned("x-route-hint")
    };
    let removal = |types: &[&'static str], sdk_safe, opted_in: &[&'static str]| Removal {
        types: types.to_vec(),
        sdk_safe,
        opted_in: opted_in.to_vec(),
    };
    const MARKER: &str = BYPASS_REMOTE_PREFILL;
    vec![
        Setup {
            name: "default",
            layer: BypassMarkerLayer::new(),
            requested: &[],
            removal: removal(&[MARKER], false, &[]),
        },
        Setup {
            name: "opt-ins, none granted",
            layer: names(),
            requested: &[],
            removal: removal(
                &[MARKER, "request_id", "llm_metrics", "x-route-hint"],
                false,
                &[],
            ),
        },
        Setup {
            name: "opt-ins, granted",
            layer: names(),
            requested: &[MARKER, "request_id", "llm_metrics"],
            removal: removal(&["llm_metrics", "x-route-hint"], false, &[]),
        },
        Setup {
            name: "sdk_safe",
            layer: BypassMarkerLayer::new().sdk_safe(true),
            requested: &[],
            removal: removal(&[MARKER], true, &[]),
        },
        Setup {
            name: "sdk_safe, opt-ins granted",
            layer: names().sdk_safe(true),
            requested: &[MARKER, "request_id"],
            removal: removal(
                &["llm_metrics", "x-route-hint"],
                true,
                &[MARKER, "request_id"],
            ),
        },
        Setup {
            name: "sdk_safe, request_id granted",
            layer: BypassMarkerLayer::new().opt_in("request_id").sdk_safe(true),
            requested: &["request_id"],
            removal: removal(&[MARKER], true, &["request_id"]),
        },
    ]
}

/// A response body as served: its bytes and the end offset of each chunk.
struct Served {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

struct AppState {
    served: Vec<Served>,
    plan: String,
    page_reports: mpsc::UnboundedSender<String>,
}

async fn serve_stream(State(state): State<Arc<AppState>>, UrlPath(i): UrlPath<usize>) -> Response {
    let served = &state.served[i];
    let mut start = 0;
    let chunks: Vec<Result<Bytes, Infallible>> = served
        .ends
        .iter()
        .map(|&end| {
            let chunk = Bytes::copy_from_slice(&served.bytes[start..end]);
            start = end;
            Ok(chunk)
        })
        .collect();
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-store"),
            // The page is served from the first port and opens streams on all of them.
            (header::ACCESS_CONTROL_ALLOW_ORIGIN, "*"),
        ],
        Body::from_stream(futures_util::stream::iter(chunks)),
    )
        .into_response()
}

fn app(state: Arc<AppState>, setups: &[Setup]) -> Router {
    let mut router = Router::new()
        .route("/", get(|| async { Html(include_str!("page.html")) }))
        .route(
            "/plan",
            get(|State(s): State<Arc<AppState>>| async move {
                ([(header::CONTENT_TYPE, "application/json")], s.plan.clone())
            }),
        )
        .route(
            "/results",
            post(|State(s): State<Arc<AppState>>, body: String| async move {
                let _ = s.page_reports.send(body);
            }),
        )
        .route("/raw/{i}", get(serve_stream));
    for (k, setup) in setups.iter().enumerate() {
        let requested: RequestedAnnotations = setup.requested.iter().copied().collect();
        let filtered = Router::new()
            .route("/{i}", get(serve_stream))
            .layer(setup.layer.clone())
            .layer(Extension(requested));
        router = router.nest(&format!("/setup{k}"), filtered);
    }
    router.with_state(state)
}

/// A headless Chromium in a process group of its own, killed with the group on drop, and its
/// profile directory removed.
struct Chromium {
    child: Child,
    profile: PathBuf,
}

impl Chromium {
    fn launch(binary: &Path, url: &str) -> Chromium {
        use std::os::unix::process::CommandExt;
        let profile = std::env::temp_dir().join(format!(
            "tower-bypass-marker-chromium-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&profile).unwrap();
        let log = std::fs::File::create(profile.join("stderr.log")).unwrap();
        let child = Command::new(binary)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--disable-dev-shm-usage",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        Chromium { child, profile }
    }

    /// The last lines Chromium wrote to stderr.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.profile.join("stderr.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        // The launcher script execs the browser, which starts its helpers in the same group.
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// `chromium` from `BYPASS_MARKER_CHROMIUM` or `PATH`.
fn find_chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("BYPASS_MARKER_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| ["chromium", "chromium-browser"].map(|name| dir.join(name)))
        .find(|p| p.is_file())
}

#[derive(Deserialize)]
struct PageReport {
    #[serde(default)]
    results: Vec<PageResult>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct PageResult {
    index: usize,
    events: Vec<(String, String, String)>,
}

/// What the page is asked to do.
#[derive(serde::Serialize)]
struct Plan {
    /// How many EventSources it keeps open at once.
    concurrent: usize,
    entries: Vec<Entry>,
}

/// One EventSource the page opens: the URL and every event type it must listen for.
#[derive(serde::Serialize)]
struct Entry {
    url: String,
    types: Vec<String>,
}

/// A disagreement between what the browser dispatched and what it had to.
struct Mismatch {
    class: String,
    detail: String,
}

fn show(events: &[Event]) -> String {
    let mut out = String::new();
    for e in events {
        let _ = write!(
            out,
            "\n      type={:?} data={:?} lastEventId={:?}",
            e.kind, e.data, e.last_event_id
        );
    }
    if out.is_empty() {
        out.push_str(" (none)");
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_dispatches_the_raw_events_minus_the_removed_types() {
    let Some(chromium) = find_chromium() else {
        if std::env::var("BYPASS_MARKER_BROWSER").as_deref() == Ok("1") {
            panic!(
                "BYPASS_MARKER_BROWSER=1 but no chromium on PATH: install Debian's `chromium` \
                 (apt-get install -y chromium) or set BYPASS_MARKER_CHROMIUM to its path"
            );
        }
        eprintln!(
            "notice: skipping the browser differential: no chromium on PATH \
             (set BYPASS_MARKER_BROWSER=1 to make this a failure)"
        );
        return;
    };
    let count = std::env::var("BYPASS_MARKER_BROWSER_STREAMS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(STREAMS);
    let started = Instant::now();
    let pinned = streams::pinned();
    let pinned_count = pinned.len();
    let mut generated = pinned;
    generated.extend(streams::generate(count));
    let setups = setups();
    // The pinned streams go through every setup, a generated one through every other setup.
    let setups_for = |stream: usize| {
        (0..setups.len()).filter(move |k| stream < pinned_count || k % 2 == stream % 2)
    };

    // Every stream in two versions; each version served raw and through its setups.
    let mut served = Vec::new();
    for stream in &generated {
        for bytes in [&stream.bytes, &stream.with_data] {
            served.push(Served {
                ends: stream.ends(bytes),
                bytes: bytes.clone(),
            });
        }
    }
    // Entry n of the plan is served version `opened[n].0`, raw or through setup `opened[n].1`.
    let mut plan = Vec::new();
    let mut opened = Vec::new();
    for (v, s) in served.iter().enumerate() {
        let types = possible_types(&s.bytes);
        plan.push(Entry {
            url: format!("/raw/{v}"),
            types: types.clone(),
        });
        opened.push((v, None));
        for k in setups_for(v / 2) {
            plan.push(Entry {
                url: format!("/setup{k}/{v}"),
                types: types.clone(),
            });
            opened.push((v, Some(k)));
        }
    }
    let entries = plan.len();

    // Chromium opens at most 6 connections to one host and port, so the same app listens on
    // several ports and the page spreads the streams over them.
    let mut listeners = Vec::new();
    for _ in 0..PORTS {
        listeners.push(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    for (n, entry) in plan.iter_mut().enumerate() {
        entry.url = format!("http://{}{}", addrs[n % PORTS], entry.url);
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    let state = Arc::new(AppState {
        served,
        plan: serde_json::to_string(&Plan {
            concurrent: 5 * PORTS,
            entries: plan,
        })
        .unwrap(),
        page_reports: tx,
    });
    let router = app(state.clone(), &setups);
    let servers: Vec<_> = listeners
        .into_iter()
        .map(|listener| {
            let router = router.clone();
            tokio::spawn(async move { axum::serve(listener, router).await.unwrap() })
        })
        .collect();

    let mut browser = Chromium::launch(&chromium, &format!("http://{}/", addrs[0]));
    let mut results: Vec<Option<Vec<Event>>> = vec![None; entries];
    let mut received = 0;
    let deadline = Instant::now() + PATIENCE;
    while received < entries {
        let report = match tokio::time::timeout(Duration::from_secs(1), rx.recv()).await {
            Ok(Some(report)) => report,
            _ => {
                let exited = browser.child.try_wait().unwrap();
                if exited.is_some() || Instant::now() > deadline {
                    panic!(
                        "the page reported {received} of {entries} results ({}); chromium's \
                         stderr ends with:\n{}",
                        match exited {
                            Some(status) => format!("chromium exited: {status}"),
                            None => format!("not within {PATIENCE:?}"),
                        },
                        browser.log_tail()
                    );
                }
                continue;
            }
        };
        let report: PageReport = serde_json::from_str(&report).expect("a page report");
        if let Some(error) = report.error {
            panic!("the page failed: {error}");
        }
        for r in report.results {
            if results[r.index].is_none() {
                received += 1;
            }
            results[r.index] = Some(r.events.into_iter().map(Event::from).collect());
        }
    }
    let browsing = started.elapsed();
    drop(browser);
    for server in servers {
        server.abort();
    }

    let mut dispatched: HashMap<(usize, Option<usize>), Vec<Event>> = opened
        .into_iter()
        .zip(results)
        .map(|(key, events)| (key, events.unwrap()))
        .collect();
    let mut mismatches = Vec::new();
    let mut adjusted = 0;
    for (v, s) in state.served.iter().enumerate() {
        let mut at = |setup: Option<usize>| dispatched.remove(&(v, setup)).unwrap();
        let stream = lines(&s.bytes);
        let raw = chromium_events(&stream);
        let context = || {
            format!(
                "stream {} ({}): \"{}\"\n    chunk ends: {:?}",
                v / 2,
                if v % 2 == 0 {
                    "as generated"
                } else {
                    "data added"
                },
                s.bytes.escape_ascii(),
                s.ends
            )
        };
        let raw_chromium = at(None);
        if raw_chromium != raw {
            mismatches.push(Mismatch {
                class: "raw stream: Chromium differs from the WHATWG reading".to_owned(),
                detail: format!(
                    "{}\n    expected:{}\n    chromium:{}",
                    context(),
                    show(&raw),
                    show(&raw_chromium)
                ),
            });
            continue;
        }
        for k in setups_for(v / 2) {
            let setup = &setups[k];
            let expected = chromium_events(&kept(&stream, &setup.removal));
            let minus_types: Vec<Event> = raw
                .iter()
                .filter(|e| !setup.removal.types.contains(&e.kind.as_str()))
                .cloned()
                .collect();
            if expected != minus_types {
                adjusted += 1;
            }
            let got = at(Some(k));
            if got != expected {
                mismatches.push(Mismatch {
                    class: format!("filtered ({})", setup.name),
                    detail: format!(
                        "{}\n    raw events:{}\n    expected filtered:{}\n    chromium filtered:{}",
                        context(),
                        show(&raw),
                        show(&expected),
                        show(&got)
                    ),
                });
            }
        }
    }
    eprintln!(
        "browser differential: {} streams in 2 versions ({pinned_count} pinned), {entries} \
         EventSources over {} setups, browsing took {browsing:?}; {adjusted} filtered \
         expectations differ from the raw events minus the removed types (lastEventId after a \
         removed id, or the BOM deviation)",
        generated.len(),
        setups.len(),
    );
    if !mismatches.is_empty() {
        let mut classes: BTreeMap<&str, Vec<&Mismatch>> = BTreeMap::new();
        for m in &mismatches {
            classes.entry(&m.class).or_default().push(m);
        }
        let mut report = format!("{} disagreements:\n", mismatches.len());
        for (class, ms) in &classes {
            let _ = writeln!(report, "\n== {class}: {} cases; the shortest:", ms.len());
            let mut ms = ms.clone();
            ms.sort_by_key(|m| m.detail.len());
            for m in ms.iter().take(3) {
                let _ = writeln!(report, "  {}", m.detail);
            }
        }
        panic!("{report}");
    }
}
