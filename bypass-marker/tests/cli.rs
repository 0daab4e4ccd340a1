//! The `bypass-marker` binary itself, run as a process (`CARGO_BIN_EXE_bypass-marker`): help,
//! version, usage errors and their exit code, configuration from environment variables, the log
//! line per request, and a graceful stop on SIGTERM. `tests/proxy.rs` tests the proxy's behaviour
//! in process.
#![cfg(unix)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::IntoResponse;
use bytes::Bytes;
use http_body_util::Full;
use tokio::net::TcpListener;

mod support;
use support::{
    fetch, serve_upstream, sigterm, sigterm_and_output, sigterm_and_wait, start_proxy,
    stderr_lines, Announced, BoxError, PATIENCE,
};

/// Runs the binary with `args` and no `BYPASS_MARKER_*` variables but those in `env`.
fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = support::std_command();
    command.args(args).envs(env.iter().copied());
    command.output().expect("the binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn help_and_version() {
    let out = run(&["--version"], &[]);
    assert!(out.status.success());
    assert_eq!(
        text(&out.stdout).trim(),
        format!("bypass-marker {}", env!("CARGO_PKG_VERSION"))
    );
    let out = run(&["--help"], &[]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    assert!(help.contains("proxy"), "{help}");
    assert!(help.contains("--log-format"), "{help}");
    let out = run(&["proxy", "--help"], &[]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for needle in [
        "--upstream <URL>",
        "BYPASS_MARKER_UPSTREAM",
        "--metrics-listen <ADDR>",
        "BYPASS_MARKER_METRICS_LISTEN",
        "[default: 127.0.0.1:3000]",
        "[default: dynamo]",
        "[default: 1024]",
        "[default: 600]",
        "--threads <N>",
        "BYPASS_MARKER_THREADS",
    ] {
        assert!(help.contains(needle), "no {needle:?} in:\n{help}");
    }
}

#[test]
fn usage_errors_exit_with_code_2_and_say_what_is_wrong() {
    for (args, env, says) in [
        (&["proxy"][..], &[][..], "--upstream <URL>"),
        (
            &["proxy", "--upstream", "http://127.0.0.1:1", "--frobnicate"],
            &[],
            "--frobnicate",
        ),
        (
            &["proxy", "--upstream", "https://x"],
            &[],
            "https is not supported",
        ),
        (
            &["proxy", "--upstream", "http://x", "--idle-timeout", "0"],
            &[],
            "--idle-timeout <SECS>': a positive number of seconds",
        ),
        (
            &["proxy", "--upstream", "http://x", "--opt-in", "a:b"],
            &[],
            "--opt-in \"a:b\": annotation name \"a:b\" contains ':'",
        ),
        // An invalid name is a usage error of its subcommand, with that subcommand's usage
        // (issue 28) ...
        (
            &["proxy", "--upstream", "http://x", "--opt-in", "a:b"],
            &[],
            "\n\nUsage: bypass-marker proxy [OPTIONS] --upstream <URL>\n",
        ),
        (
            &["ext-proc", "--never-forward", " x"],
            &[],
            "\n\nUsage: bypass-marker ext-proc [OPTIONS]\n",
        ),
        // ... naming the variable it came from.
        (
            &["proxy", "--upstream", "http://x"],
            &[("BYPASS_MARKER_OPT_IN", "fine,a:b")],
            "BYPASS_MARKER_OPT_IN \"a:b\" (for --opt-in): annotation name \"a:b\" contains ':'",
        ),
        // From the environment, the same checks.
        (
            &["proxy"],
            &[("BYPASS_MARKER_UPSTREAM", "ftp://x")],
            "http://",
        ),
        (
            &["proxy", "--upstream", "http://x"],
            &[("BYPASS_MARKER_PRESET", "vllm")],
            "vllm",
        ),
        (
            &["proxy", "--upstream", "http://x"],
            &[("BYPASS_MARKER_NEVER_FORWARD", "ok,bad\tname")],
            "--never-forward",
        ),
        (
            &["proxy", "--upstream", "http://x", "--threads", "0"],
            &[],
            "--threads <N>",
        ),
        (
            &["proxy", "--upstream", "http://x"],
            &[("BYPASS_MARKER_THREADS", "many")],
            "--threads <N>",
        ),
        // Credentials in the upstream's URL are refused.
        (
            &[
                "proxy",
                "--upstream",
                "http://svc-user:s3cret@127.0.0.1:8000",
            ],
            &[],
            "must not carry credentials",
        ),
        (
            &["proxy"],
            &[("BYPASS_MARKER_UPSTREAM", "http://svc-user:s3cret@x/v1")],
            "must not carry credentials",
        ),
        (&["frobnicate"], &[], "frobnicate"),
        // Issue 42: an upstream no connection can reach is refused at start.
        (
            &["proxy", "--upstream", "http://[::1]:70000"],
            &[],
            "port \"70000\" is not a TCP port (1 to 65535)",
        ),
        (
            &["proxy", "--upstream", "http://127.0.0.1:0/v1"],
            &[],
            "port \"0\" is not a TCP port",
        ),
        (
            &["proxy", "--upstream", "http://:8000"],
            &[],
            "the upstream has no host",
        ),
        (
            &["proxy"],
            &[("BYPASS_MARKER_UPSTREAM", "http://[::1]:70000")],
            "for BYPASS_MARKER_UPSTREAM (--upstream <URL>): port \"70000\"",
        ),
        (
            &["proxy", "--upstream", "http://x"],
            &[("BYPASS_MARKER_SDK_SAFE", "maybe")],
            "invalid value 'maybe' for BYPASS_MARKER_SDK_SAFE (--sdk-safe)",
        ),
    ] {
        let out = run(args, env);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: {stderr}");
        assert!(
            stderr.contains(says),
            "{args:?} {env:?}: {says:?} not in {stderr}"
        );
        assert!(stderr.starts_with("error:"), "{stderr}");
        // Nor is the secret repeated.
        assert!(!stderr.contains("s3cret"), "{stderr}");
    }
}

/// A 502 tells the client only that the upstream is unavailable; the log says which upstream and
/// why (the OS error), for the operator.
#[tokio::test]
async fn an_unreachable_upstream_is_detailed_in_the_log_not_to_the_client() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = free.local_addr().unwrap();
    drop(free);
    let mut command = support::command();
    let mut child = command
        .args(["proxy", "--listen", "127.0.0.1:0", "--upstream"])
        .arg(format!("http://{upstream}"))
        .env("RUST_LOG", "warn")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = Announced::of(&mut child).next("listening on http://").await;
    let body = get(format!("http://{addr}/v1/models")).await.unwrap();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["code"], "upstream_unreachable", "{json}");
    let message = json["error"]["message"].as_str().unwrap();
    assert!(!message.contains(&upstream.port().to_string()), "{json}");
    assert!(!message.contains("os error"), "{json}");
    let out = sigterm_and_output(child).await;
    let stderr = text(&out.stderr);
    let line = stderr
        .lines()
        .find(|l| l.contains("cannot reach the upstream"))
        .unwrap_or_else(|| panic!("no log line for the 502 in:\n{stderr}"));
    assert!(line.contains(" WARN "), "{line}");
    assert!(line.contains(&format!("http://{upstream}")), "{line}");
    assert!(line.contains("os error"), "{line}");
}

#[test]
fn a_port_in_use_exits_with_code_1() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = run(
        &[
            "proxy",
            "--upstream",
            "http://127.0.0.1:1",
            "--listen",
            &addr,
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("cannot listen"));
}

/// 20 events 50 ms apart, each after an annotation frame named `x-custom`.
async fn slow_stream() -> impl IntoResponse {
    let stream = futures_util::stream::unfold(0u32, |i| async move {
        if i == 20 {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let frame = format!("event: x-custom\ndata: hidden\n\ndata: {i}\n\n");
        Some((Ok::<_, Infallible>(Bytes::from(frame)), i + 1))
    });
    (
        [(http::header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(stream),
    )
}

/// An upstream that serves [`slow_stream`] at `/stream`.
async fn spawn_upstream() -> SocketAddr {
    serve_upstream(axum::Router::new().route("/stream", axum::routing::get(slow_stream))).await
}

/// The naming flags under which a proxy removes exactly the `x-custom` frames of
/// [`slow_stream`] (`expected_stream` is what is left).
const X_CUSTOM: [&str; 4] = ["--preset", "none", "--opt-in", "x-custom"];

/// What a client of [`slow_stream`] gets once its `x-custom` frames have been removed.
fn expected_stream() -> String {
    (0..20).map(|i| format!("data: {i}\n\n")).collect()
}

/// The body of a GET of `url` (whatever the status), however long it takes.
async fn get(url: String) -> Result<Bytes, BoxError> {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    Ok(fetch(req).await?.body)
}

/// The body of the first `/stream` the proxy at `listen` serves, asked for until it is up; a panic
/// if `child` exits first, or after [`PATIENCE`].
async fn first_stream(listen: &str, child: &mut tokio::process::Child) -> Bytes {
    tokio::time::timeout(PATIENCE, async {
        loop {
            if let Ok(body) = get(format!("http://{listen}/stream")).await {
                return body;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the proxy exited: {status}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the proxy serves")
}

/// The bodies of `/stream` from the proxy at `addr`, asked by `clients` clients at once, each on
/// a connection of its own (a fresh hyper client per request); each must come within `patience`.
async fn streams_at_once(addr: &str, clients: usize, patience: Duration) -> Vec<Bytes> {
    let streams: Vec<_> = (0..clients)
        .map(|_| tokio::spawn(get(format!("http://{addr}/stream"))))
        .collect();
    let mut bodies = Vec::new();
    for stream in streams {
        let body = tokio::time::timeout(patience, stream)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        bodies.push(body);
    }
    bodies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_from_the_environment_it_filters_logs_and_stops_gracefully_on_sigterm() {
    let upstream = spawn_upstream().await;
    let upstream_url = format!("http://{upstream}");
    let mut command = support::command();
    // Every setting from the environment: the command line only names the subcommand.
    let mut child = command
        .arg("proxy")
        .env("BYPASS_MARKER_UPSTREAM", &upstream_url)
        .env("BYPASS_MARKER_LISTEN", "127.0.0.1:0")
        .env("BYPASS_MARKER_PRESET", "none")
        .env("BYPASS_MARKER_OPT_IN", "x-other,x-custom")
        .env("BYPASS_MARKER_SHUTDOWN_GRACE", "20")
        .env("BYPASS_MARKER_LOG_FORMAT", "json")
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = Announced::of(&mut child).next("listening on http://").await;
    let logs = stderr_lines(&mut child);

    // The opt-in name from BYPASS_MARKER_OPT_IN is removed.
    let body = tokio::time::timeout(PATIENCE, get(format!("http://{addr}/stream")))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(body, expected_stream());

    // A stream in flight when SIGTERM comes is finished; the process then exits with 0, and no
    // longer accepts.
    let in_flight = tokio::spawn(get(format!("http://{addr}/stream")));
    tokio::time::sleep(Duration::from_millis(200)).await;
    sigterm(&child);
    let stopping = Instant::now();
    let body = tokio::time::timeout(PATIENCE, in_flight)
        .await
        .unwrap()
        .unwrap()
        .expect("the stream in flight completes");
    assert_eq!(body, expected_stream());
    let status = tokio::time::timeout(PATIENCE, child.wait())
        .await
        .expect("the proxy exits after its streams end")
        .unwrap();
    assert!(status.success(), "{status}");
    assert!(
        stopping.elapsed() < Duration::from_secs(20),
        "it waited for the grace"
    );
    assert!(std::net::TcpStream::connect(&addr).is_err());

    // One JSON line per request, at info, with the fields of the docs.
    let logs = logs.await.unwrap();
    let access: Vec<serde_json::Value> = logs
        .iter()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|json| json["target"] == "bypass_marker::access")
        .collect();
    assert_eq!(access.len(), 2, "{logs:#?}");
    for line in &access {
        assert_eq!(line["level"], "INFO");
        assert_eq!(line["method"], "GET");
        assert_eq!(line["path"], "/stream");
        assert_eq!(line["status"], 200);
        assert_eq!(line["bytes"], expected_stream().len());
        assert_eq!(line["frames_removed"], 20, "{line}");
        assert_eq!(line["complete"], true);
        assert!(line["duration_ms"].as_f64().unwrap() >= 1000.0, "{line}");
        // Issue 42: the client's address and a request id the proxy made (none was sent).
        let client = line["client"].as_str().unwrap();
        assert!(client.starts_with("127.0.0.1:"), "{line}");
        let id = line["request_id"].as_str().unwrap();
        assert!(
            id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "{line}"
        );
    }
    assert!(
        logs.iter().any(|l| l.contains("SIGTERM")),
        "no line about the signal: {logs:#?}"
    );
}

#[tokio::test]
async fn text_logs_and_rust_log_filtering() {
    let upstream = spawn_upstream().await;
    for (rust_log, logged) in [
        (None, true),
        (Some("warn"), false),
        (Some("bypass_marker=info"), true),
    ] {
        let mut command = support::command();
        command
            .args(["proxy", "--listen", "127.0.0.1:0", "--upstream"])
            .arg(format!("http://{upstream}"))
            .args(["--shutdown-grace", "5", "--log-format", "text"])
            .stderr(Stdio::piped());
        if let Some(filter) = rust_log {
            command.env("RUST_LOG", filter);
        }
        let mut child = command.spawn().unwrap();
        let addr = Announced::of(&mut child).next("listening on http://").await;
        let body = get(format!("http://{addr}/nowhere?secret=1"))
            .await
            .unwrap();
        assert!(body.is_empty());
        let out = sigterm_and_output(child).await;
        assert!(out.status.success());
        let stderr = text(&out.stderr);
        let line = stderr.lines().find(|l| l.contains("bypass_marker::access"));
        assert_eq!(line.is_some(), logged, "RUST_LOG={rust_log:?}: {stderr}");
        if let Some(line) = line {
            assert!(line.contains(" INFO "), "{line}");
            for field in [
                "method=GET",
                "path=/nowhere ",
                "status=404",
                "bytes=0",
                "frames_removed=0",
                "complete=true",
                "duration_ms=",
            ] {
                assert!(line.contains(field), "{field} not in {line}");
            }
            assert!(!line.contains("secret"), "the query is not logged: {line}");
            // Whole microseconds, not `0.5594600000000001` (issue 28).
            let duration = line.split("duration_ms=").nth(1).unwrap();
            let duration = duration.split(' ').next().unwrap();
            let decimals = duration.split_once('.').map_or(0, |(_, d)| d.len());
            assert!(decimals <= 3, "{duration}");
            // The startup lines: the names in force, the threads in good grammar.
            let names = stderr
                .lines()
                .find(|l| l.contains("names in force: "))
                .unwrap_or_else(|| panic!("no names line: {stderr}"));
            assert!(
                names.contains(
                    "router-owned (removed unless the client opts in, stripped from requests): \
                     x-bypass-remote-prefill, x-prefill-continue; removed unless the client opts \
                     in: request_id, formatted_prompt, token_ids; never forwarded: llm_metrics, \
                     payload_usage"
                ),
                "{names}"
            );
            assert!(
                stderr.lines().any(|l| l.ends_with("serving on 1 thread")),
                "{stderr}"
            );
        }
    }
}

/// `bypass-marker ext-proc`, configured from the environment: gRPC health says SERVING for the
/// processor, `/metrics` has a series per configured name, and SIGTERM stops it with exit code 0
/// after health has turned NOT_SERVING. (tests/envoy/run.sh drives it through a real Envoy.)
#[tokio::test]
async fn ext_proc_serves_health_and_metrics_and_stops_on_sigterm() {
    let mut command = support::command();
    let mut child = command
        .arg("ext-proc")
        .env("BYPASS_MARKER_LISTEN", "127.0.0.1:0")
        .env("BYPASS_MARKER_METRICS_LISTEN", "127.0.0.1:0")
        .env("BYPASS_MARKER_NEVER_FORWARD", "x-internal")
        .spawn()
        .unwrap();
    // The metrics server announces itself first, then the processor.
    let mut announced = Announced::of(&mut child);
    let metrics = announced.next("metrics on ").await;
    let grpc = announced.next("ext_proc listening on ").await;

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    support::assert_ext_proc_serving(channel).await;
    let text = String::from_utf8(get(metrics).await.unwrap().to_vec()).unwrap();
    for name in ["x-bypass-remote-prefill", "request_id", "x-internal"] {
        let series = format!(
            "bypass_marker_frames_removed_total{{front_door=\"ext-proc\",annotation=\"{name}\"}} 0"
        );
        assert!(text.contains(&series), "no {series} in:\n{text}");
    }
    // The request body budget's gauges, which the soak (tests/soak/) reads back to 0.
    assert!(
        text.contains("bypass_marker_request_bytes_held{front_door=\"ext-proc\"} 0\n"),
        "no bytes-held gauge in:\n{text}"
    );
    assert!(
        text.contains("bypass_marker_request_bytes_budget{front_door=\"ext-proc\"} "),
        "no budget gauge in:\n{text}"
    );

    let status = sigterm_and_wait(&mut child, "the processor exits").await;
    assert!(status.success(), "{status}");
    assert!(std::net::TcpStream::connect(&grpc).is_err());
}

/// `bypass-marker proxy --threads`: one thread by default (the least CPU per event), any
/// positive number, never 0.
#[test]
fn proxy_threads_default_to_one() {
    use bypass_marker::ProxyArgs;

    if std::env::var_os("BYPASS_MARKER_THREADS").is_none() {
        let args = ProxyArgs::from_args(["--upstream", "http://x"]).unwrap();
        assert_eq!(args.threads.get(), 1);
    }
    let args = ProxyArgs::from_args(["--upstream", "http://x", "--threads", "4"]).unwrap();
    assert_eq!(args.threads.get(), 4);
    let err = ProxyArgs::from_args(["--upstream", "http://x", "--threads", "0"]).unwrap_err();
    assert!(err.contains("--threads"), "{err}");
}

/// `--read-coalesce MICROS`: 50 us by default, 0 (never) to 1000, whole microseconds only.
#[test]
fn read_coalesce_takes_whole_microseconds_up_to_a_millisecond() {
    use bypass_marker::ProxyArgs;

    let parse =
        |value: &str| ProxyArgs::from_args(["--upstream", "http://x", "--read-coalesce", value]);
    if std::env::var_os("BYPASS_MARKER_READ_COALESCE").is_none() {
        let args = ProxyArgs::from_args(["--upstream", "http://x"]).unwrap();
        assert_eq!(args.read_coalesce, Duration::from_micros(50));
    }
    assert_eq!(parse("0").unwrap().read_coalesce, Duration::ZERO);
    assert_eq!(
        parse("1000").unwrap().read_coalesce,
        Duration::from_millis(1)
    );
    for bad in ["1001", "2.5", "50us", ""] {
        let err = parse(bad).unwrap_err();
        assert!(err.contains("--read-coalesce"), "{bad}: {err}");
    }
}

/// `bypass-marker ext-proc --threads`: one thread by default (the least CPU per message), any
/// positive number, never 0.
#[test]
fn ext_proc_threads_default_to_one() {
    use bypass_marker::ExtProcArgs;

    if std::env::var_os("BYPASS_MARKER_THREADS").is_none() {
        let args = ExtProcArgs::from_args(std::iter::empty::<&str>()).unwrap();
        assert_eq!(args.threads, 1);
    }
    let args = ExtProcArgs::from_args(["--threads", "4"]).unwrap();
    assert_eq!(args.threads, 4);
    let err = ExtProcArgs::from_args(["--threads", "0"]).unwrap_err();
    assert!(err.contains("--threads"), "{err}");
}

/// Starts `bypass-marker proxy` with `args` and `env` (and no other `BYPASS_MARKER_*`), on a port
/// of its own; returns the child and the address it listens on.
async fn spawn_proxy(args: &[&str], env: &[(&str, &str)]) -> (tokio::process::Child, String) {
    start_proxy(
        support::command()
            .arg("proxy")
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "warn"),
    )
    .await
}

/// `--threads N` (or `BYPASS_MARKER_THREADS`): N threads accepting from one listener, each
/// filtering what it accepts; SIGTERM stops every thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threads_share_one_port_and_each_filters_and_stops() {
    let upstream = format!("http://{}", spawn_upstream().await);
    for (args, env, threads) in [
        (&["--threads", "3"][..], &[][..], 3),
        (&[][..], &[("BYPASS_MARKER_THREADS", "2")][..], 2),
        (&["--threads", "1"][..], &[][..], 1),
    ] {
        let mut all = vec!["--upstream", &upstream, "--listen", "127.0.0.1:0"];
        all.extend_from_slice(&X_CUSTOM);
        all.extend_from_slice(args);
        let (mut child, addr) = spawn_proxy(&all, env).await;
        // Enough connections at once that more than one thread accepts some.
        for body in streams_at_once(&addr, 12, PATIENCE).await {
            assert_eq!(body, expected_stream(), "{args:?} {env:?}");
        }
        let pid = child.id().unwrap() as libc::pid_t;
        // The serving threads, by name (`bypass-marker-N`, 15 bytes: not truncated).
        let serving = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .filter(|name| name.starts_with("bypass-marker-"))
            .count();
        assert_eq!(serving, threads, "{args:?} {env:?}");
        let status = sigterm_and_wait(&mut child, "every thread stops").await;
        assert!(status.success(), "{args:?} {env:?}: {status}");
        assert!(std::net::TcpStream::connect(&addr).is_err());
    }
}

/// Runs the binary with `args` (no `BYPASS_MARKER_*` variables) and expects it to exit within
/// `PATIENCE` (it is killed otherwise, and the test fails).
async fn exits(args: &[&str]) -> Output {
    let mut command = support::command();
    let child = command
        .args(args)
        .env("RUST_LOG", "warn")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::timeout(PATIENCE, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{args:?} started on an address in use"))
        .unwrap()
}

/// A second proxy on an address in use fails to start, whatever `--threads` the first and the
/// second were given: with `SO_REUSEPORT` on every listener, a second `--threads 2` instance (here
/// one with `--no-layer`) joined the first one's port and served a share of its clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_proxy_on_an_address_in_use_fails_to_start_whatever_the_threads() {
    let upstream = format!("http://{}", spawn_upstream().await);
    for (first, second) in [("2", "2"), ("1", "2"), ("2", "1"), ("3", "3")] {
        let base = [&["--upstream", &upstream][..], &X_CUSTOM].concat();
        let mut args = base.clone();
        args.extend_from_slice(&["--listen", "127.0.0.1:0", "--threads", first]);
        let (_child, addr) = spawn_proxy(&args, &[]).await;
        let mut args = vec!["proxy"];
        args.extend_from_slice(&base);
        args.extend_from_slice(&["--listen", &addr, "--threads", second, "--no-layer"]);
        let out = exits(&args).await;
        let stderr = text(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{first} then {second}: {stderr}"
        );
        assert!(
            stderr.contains("cannot listen") && stderr.contains("in use"),
            "{first} then {second}: {stderr}"
        );
        // Every client still reaches the first proxy, which filters.
        for body in streams_at_once(&addr, 12, PATIENCE).await {
            assert_eq!(body, expected_stream(), "{first} then {second}");
        }
    }
}

/// The same for `ext-proc`: a second processor on an address in use fails to start.
#[tokio::test]
async fn a_second_ext_proc_on_an_address_in_use_fails_to_start() {
    let mut command = support::command();
    let mut child = command
        .args(["ext-proc", "--listen", "127.0.0.1:0", "--threads", "2"])
        .spawn()
        .unwrap();
    let addr = Announced::of(&mut child)
        .next("ext_proc listening on ")
        .await;
    for threads in ["1", "2"] {
        let out = exits(&["ext-proc", "--listen", &addr, "--threads", threads]).await;
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "--threads {threads}: {stderr}");
        assert!(
            stderr.contains("cannot listen") && stderr.contains("in use"),
            "--threads {threads}: {stderr}"
        );
    }
}

/// Out of file descriptors, no accepted request is refused its upstream connection: under an
/// open-file limit of 48, 40 clients streaming at once are all served whole, a few at a time
/// (the default `--max-connections` is 7 there; the others wait in the backlog). Without the
/// cap, the proxy accepted clients until the descriptors ran out, and their requests got 502s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_descriptors_every_accepted_request_reaches_the_upstream() {
    let upstream = format!("http://{}", spawn_upstream().await);
    let mut command = support::command();
    command
        .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", &upstream])
        .args(X_CUSTOM)
        .env("RUST_LOG", "warn");
    // SAFETY: setrlimit is async-signal-safe, and only changes the child's own limit.
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 48,
                rlim_max: 48,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut child = command.spawn().unwrap();
    let addr = Announced::of(&mut child).next("listening on http://").await;
    for body in streams_at_once(&addr, 40, PATIENCE * 2).await {
        assert_eq!(
            String::from_utf8_lossy(&body),
            expected_stream(),
            "a request was refused"
        );
    }
    drop(child);
}

/// A hyper POST of `body` as JSON to `url`: the status and the body.
async fn post_json(url: String, body: &'static str) -> Result<(http::StatusCode, Bytes), BoxError> {
    let req = http::Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    let reply = fetch(req).await?;
    Ok((reply.status, reply.body))
}

/// The peak resident set of process `pid` (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kb * 1024
}

/// Issue 28, item 11: forty clients that each send all but the last 10 bytes of a 30 MiB JSON
/// body took the proxy to 1.2 GB (the guard holds each body whole, and nothing bounded their
/// sum). Under `--max-buffered-bytes 256 MiB` the proxy's peak resident set stays under the
/// budget plus 64 MiB: the requests that do not fit get a 503 with `Retry-After` before their
/// body is read, counted in `requests_refused_total{status="503"}`; a stream in flight is
/// served whole, and a small request still gets its answer while the budget is full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_large_bodies_keep_the_peak_rss_within_the_buffered_bytes_budget() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    const BUDGET: u64 = 256 << 20;
    const BODY: usize = 30 << 20;
    let app = axum::Router::new()
        .route("/stream", axum::routing::get(slow_stream))
        .route(
            "/v1/chat/completions",
            axum::routing::post(|| async { "{\"ok\":true}" }),
        );
    let upstream = format!("http://{}", serve_upstream(app).await);
    let metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_addr = metrics.local_addr().unwrap().to_string();
    drop(metrics);
    let budget = BUDGET.to_string();
    let args = [
        &["--upstream", &upstream, "--listen", "127.0.0.1:0"][..],
        &X_CUSTOM,
        &[
            "--metrics-listen",
            &metrics_addr,
            "--max-buffered-bytes",
            &budget,
        ],
    ]
    .concat();
    let (child, addr) = spawn_proxy(&args, &[]).await;
    let pid = child.id().unwrap();
    let stream = tokio::spawn(get(format!("http://{addr}/stream")));

    // One body for every client: a JSON object whose string runs to 30 MiB.
    let mut body = b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"".to_vec();
    body.resize(BODY - 4, b'a');
    body.extend_from_slice(b"\"}]}");
    let body = Bytes::from(body);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {BODY}\r\n\r\n"
    );
    let clients: Vec<_> = (0..40)
        .map(|_| {
            let (addr, head, body) = (addr.clone(), head.clone(), body.clone());
            tokio::spawn(async move {
                let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
                socket.write_all(head.as_bytes()).await.unwrap();
                for piece in body[..BODY - 10].chunks(256 << 10) {
                    // A refused client's connection is closed under it.
                    if socket.write_all(piece).await.is_err() {
                        break;
                    }
                }
                // Held open: the accepted bodies stay in the proxy, incomplete.
                socket
            })
        })
        .collect();
    let mut sockets = Vec::new();
    for client in clients {
        sockets.push(
            tokio::time::timeout(PATIENCE * 4, client)
                .await
                .unwrap()
                .unwrap(),
        );
    }

    // The budget is full: a small request is still answered.
    let small = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let (status, answer) = tokio::time::timeout(
        PATIENCE,
        post_json(format!("http://{addr}/v1/chat/completions"), small),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(status, 200, "{answer:?}");
    assert_eq!(&answer[..], b"{\"ok\":true}");

    let scraped = tokio::time::timeout(PATIENCE, get(format!("http://{metrics_addr}/metrics")))
        .await
        .unwrap()
        .unwrap();
    let scraped = String::from_utf8_lossy(&scraped).into_owned();
    let series = |name: &str| -> u64 {
        scraped
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} in {scraped}")) as u64
    };
    let held = series("bypass_marker_request_bytes_held{front_door=\"sidecar\"} ");
    let refused =
        series("bypass_marker_requests_refused_total{front_door=\"sidecar\",status=\"503\"} ");
    assert!(held <= BUDGET, "{held} bytes held");
    // Seven bodies of 30 MiB fit in seven eighths of 256 MiB; the others were refused.
    assert!(refused >= 40 - 8, "{refused} refused:\n{scraped}");
    assert_eq!(
        series("bypass_marker_request_bytes_budget{front_door=\"sidecar\"} "),
        BUDGET
    );

    // A refused client got the 503 and its Retry-After (when its socket kept the answer).
    let mut answered = 0;
    for socket in &mut sockets {
        let mut buf = vec![0; 4096];
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(50), socket.read(&mut buf)).await
        {
            let text = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
            if text.starts_with("http/1.1 503") {
                assert!(text.contains("retry-after: 1\r\n"), "{text}");
                answered += 1;
            }
        }
    }
    let peak = peak_rss(pid);
    assert!(
        peak < BUDGET + (64 << 20),
        "peak RSS {} MiB with a budget of {} MiB",
        peak >> 20,
        BUDGET >> 20
    );
    let streamed = tokio::time::timeout(PATIENCE, stream)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(streamed, expected_stream(), "the stream in flight was cut");
    eprintln!(
        "peak RSS {} MiB; {refused} refused, {answered} 503s read",
        peak >> 20
    );
    drop(sockets);
    drop(child);
}

/// Issue 28, a newcomer's point: `bypass-marker proxy ... | head -1` closes the proxy's stdout
/// after the first line, and printing the next one made the proxy panic (exit code 101). With
/// its stdout closed from the start, the proxy serves, and stops cleanly on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_never_stops_a_serving_proxy() {
    use std::os::fd::{FromRawFd as _, OwnedFd};
    let upstream = format!("http://{}", spawn_upstream().await);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let mut fds = [0; 2];
    // SAFETY: pipe fills the two descriptors, which are then owned here.
    #[allow(unsafe_code)]
    let (read, write) = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    // Nobody will read what the proxy prints.
    drop(read);
    let mut command = support::command();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut child = command
        .args(["proxy", "--listen", &listen, "--upstream", &upstream])
        .args(X_CUSTOM)
        .args(["--metrics-listen", &metrics])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::from(write))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Served: the proxy is up once a request through it succeeds.
    let body = first_stream(&listen, &mut child).await;
    assert_eq!(body, expected_stream());
    let out = sigterm_and_output(child).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

/// Issue 42: an invalid value names what the operator wrote: the variable when it came from the
/// environment (not the flag, which was never passed), the flag when it came from the command
/// line (even with the variable set too: the command line wins).
#[test]
fn an_invalid_value_names_its_variable_or_its_flag() {
    // (arguments, environment, what the error says, what it must not say)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: [Case<'_>; 6] = [
        (
            &["proxy", "--upstream", "http://x"],
            &[("BYPASS_MARKER_MAX_BODY", "32MiB")],
            "invalid value '32MiB' for BYPASS_MARKER_MAX_BODY (--max-body <BYTES>)",
            "for '--max-body",
        ),
        (
            &["proxy", "--upstream", "http://x", "--max-body", "32MiB"],
            &[],
            "invalid value '32MiB' for '--max-body <BYTES>'",
            "BYPASS_MARKER_MAX_BODY",
        ),
        (
            &["proxy", "--upstream", "http://x", "--max-body=32MiB"],
            &[("BYPASS_MARKER_MAX_BODY", "1")],
            "invalid value '32MiB' for '--max-body <BYTES>'",
            "BYPASS_MARKER_MAX_BODY",
        ),
        (
            &["proxy", "--upstream", "http://x"],
            &[("BYPASS_MARKER_LISTEN", "everywhere")],
            "for BYPASS_MARKER_LISTEN (--listen <ADDR>)",
            "for '--listen",
        ),
        (
            &["ext-proc"],
            &[("BYPASS_MARKER_SHUTDOWN_GRACE", "-1")],
            "for BYPASS_MARKER_SHUTDOWN_GRACE (--shutdown-grace <SECS>)",
            "for '--shutdown-grace",
        ),
        (
            &["proxy", "--upstream", "http://x"],
            &[("BYPASS_MARKER_LOG_FORMAT", "xml")],
            "for BYPASS_MARKER_LOG_FORMAT (--log-format <LOG_FORMAT>)",
            "for '--log-format",
        ),
    ];
    for (args, env, says, not) in cases {
        let out = run(args, env);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert!(
            stderr.contains(says),
            "{args:?} {env:?}: {says:?} not in {stderr}"
        );
        assert!(
            !stderr.contains(not),
            "{args:?} {env:?}: {not:?} in {stderr}"
        );
    }
}

/// The `names in force` line of a proxy started with `env`, read from its stderr; the proxy is
/// then killed.
async fn names_in_force(env: &[(&str, &str)]) -> String {
    use tokio::io::AsyncBufReadExt as _;
    let mut child = support::command()
        .args([
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
        ])
        .envs(env.iter().copied())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(PATIENCE, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("names in force") || line.contains("--no-layer") {
                return line;
            }
        }
        panic!("no names in force line ({env:?})");
    })
    .await
    .unwrap();
    child.kill().await.unwrap();
    line
}

/// Issue 42: the switches' variables take the usual spellings of true and false, in any case,
/// as docs/sidecar.md lists them.
#[tokio::test]
async fn switches_take_the_usual_spellings_of_true_and_false() {
    for yes in ["true", "1", "yes", "on", "TRUE", "Yes", "On", "y", "t"] {
        let line = names_in_force(&[("BYPASS_MARKER_SDK_SAFE", yes)]).await;
        assert!(line.contains("(--sdk-safe): removed"), "{yes}: {line}");
        let line = names_in_force(&[("BYPASS_MARKER_NO_LAYER", yes)]).await;
        assert!(
            line.contains("--no-layer: forwarding untouched"),
            "{yes}: {line}"
        );
    }
    for no in ["false", "0", "no", "off", "FALSE", "Off", "n", "f"] {
        let line = names_in_force(&[("BYPASS_MARKER_SDK_SAFE", no)]).await;
        assert!(line.contains("(--sdk-safe): kept"), "{no}: {line}");
        let line = names_in_force(&[("BYPASS_MARKER_NO_LAYER", no)]).await;
        assert!(line.contains("names in force"), "{no}: {line}");
    }
}

/// A pipe whose reading end is already closed: what a process writes to the other end fails
/// with EPIPE (the Rust runtime ignores SIGPIPE).
fn broken_pipe() -> std::os::fd::OwnedFd {
    use std::os::fd::{FromRawFd as _, OwnedFd};
    let mut fds = [0; 2];
    // SAFETY: pipe fills the two descriptors, which are then owned here.
    #[allow(unsafe_code)]
    let (read, write) = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    drop(read);
    write
}

/// Issue 42: a stderr (and stdout) whose reader has gone is never a panic (exit code 101), at any
/// point: a usage error still exits with 2, `--version` with 0, and a proxy logging every request
/// at `info` starts, serves, logs into the broken pipe, and stops with 0 on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_stdout_and_stderr_are_never_a_panic() {
    let status = support::std_command()
        .args(["proxy", "--upstream", "http://[::1]:70000"])
        .stdout(Stdio::from(broken_pipe()))
        .stderr(Stdio::from(broken_pipe()))
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(2));
    let status = support::std_command()
        .arg("--version")
        .stdout(Stdio::from(broken_pipe()))
        .stderr(Stdio::from(broken_pipe()))
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0));

    let upstream = format!("http://{}", spawn_upstream().await);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let mut child = support::command()
        .args(["proxy", "--listen", &listen, "--upstream", &upstream])
        .args(X_CUSTOM)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::from(broken_pipe()))
        .stderr(Stdio::from(broken_pipe()))
        .spawn()
        .unwrap();
    let body = first_stream(&listen, &mut child).await;
    assert_eq!(body, expected_stream());
    // More traffic, each request another access line into the broken pipe.
    for body in streams_at_once(&listen, 4, PATIENCE).await {
        assert_eq!(body, expected_stream());
    }
    let status = sigterm_and_wait(&mut child, "the proxy exits after SIGTERM").await;
    assert_eq!(status.code(), Some(0), "{status}");
}

/// Issue 42: what an orchestrator sees of a drain. The metrics address answers the probes through
/// it: `/readyz` 503 from SIGTERM on, `/livez` 200 until the process exits; the stream in flight
/// finishes and the exit code is 0. When `--shutdown-grace` runs out first, the stream is cut, the
/// log says how many were, and the exit code is 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_through_a_sigterm_and_exit_code_3_when_the_grace_runs_out() {
    let upstream = format!("http://{}", spawn_upstream().await);
    for (grace, code) in [("20", 0), ("0.2", 3)] {
        let mut child = support::command()
            .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", &upstream])
            .args(["--metrics-listen", "127.0.0.1:0", "--shutdown-grace", grace])
            .args(X_CUSTOM)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut announced = Announced::of(&mut child);
        let metrics = announced.next("metrics on http://").await;
        let metrics = metrics.trim_end_matches("/metrics").to_owned();
        let addr = announced.next("listening on http://").await;
        let logs = stderr_lines(&mut child);
        let status_of = |url: String| async move {
            let req = http::Request::get(url)
                .body(Full::<Bytes>::default())
                .unwrap();
            fetch(req).await.map(|reply| reply.status.as_u16())
        };
        for base in [&metrics, &addr] {
            assert_eq!(
                status_of(format!("http://{base}/livez")).await.unwrap(),
                200
            );
            assert_eq!(
                status_of(format!("http://{base}/readyz")).await.unwrap(),
                200
            );
        }
        let in_flight = tokio::spawn(get(format!("http://{addr}/stream")));
        tokio::time::sleep(Duration::from_millis(200)).await;
        sigterm(&child);
        if code == 0 {
            let mut ready = 200;
            let deadline = Instant::now() + PATIENCE;
            while ready == 200 && Instant::now() < deadline {
                ready = status_of(format!("http://{metrics}/readyz")).await.unwrap();
            }
            assert_eq!(ready, 503, "not ready at SIGTERM");
            assert_eq!(
                status_of(format!("http://{metrics}/livez")).await.unwrap(),
                200
            );
            assert!(
                status_of(format!("http://{addr}/livez")).await.is_err(),
                "still accepting"
            );
            let body = tokio::time::timeout(PATIENCE, in_flight)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(body.unwrap(), expected_stream());
        } else {
            let cut = tokio::time::timeout(PATIENCE, in_flight)
                .await
                .unwrap()
                .unwrap();
            assert!(cut.is_err(), "a cut stream read as complete");
        }
        let status = tokio::time::timeout(PATIENCE, child.wait())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(status.code(), Some(code), "--shutdown-grace {grace}");
        let logs = logs.await.unwrap();
        let said = |needle: &str| logs.iter().any(|l| l.contains(needle));
        if code == 3 {
            assert!(
                said("1 request(s) still in flight after --shutdown-grace"),
                "{logs:#?}"
            );
            assert!(said("streams_cut=1"), "{logs:#?}");
            assert!(said("exit code 3"), "{logs:#?}");
        } else {
            assert!(!said("streams_cut"), "{logs:#?}");
        }
    }
}
