//! What filtering costs inside Envoy and in the sidecar, against Envoy as a plain pass-through,
//! on the same upstream and the same client, in one run:
//!
//! ```text
//! bash tests/envoy/install.sh                          # Envoy (tests/versions.sh) from PyPI, into a cache
//! cargo build --release -p bypass-marker
//! cargo build --release -p bypass-marker-envoy-module   # target/release/libbypass_marker_envoy_module.so
//! bash bypass-marker-wasm/build.sh                 # target/wasm32-wasip1/release/bypass_marker.wasm
//! cargo run --release --example envoy_bench
//! ```
//!
//! Envoy is taken from `$ENVOY`, else from where `tests/envoy/install.sh` puts it (`--envoy PATH`
//! to choose); the sidecar and the processor from the `bypass-marker` binary of the same build
//! (`--proxy PATH`, `--ext-proc PATH`; `--no-ext-proc` leaves the processor row out, as does a
//! binary without the `ext-proc` subcommand). `--proxy` also takes `examples/proxy.rs`'s binary.
//! `--baseline PATH` adds a row for another build of the sidecar (layer and guard on), to compare
//! two builds in one run.
//!
//! The targets, each a process (or two) of its own on 127.0.0.1:
//!
//! - **Envoy pass-through**: `examples/envoy/pass-through.yaml`, no filter at all: the yardstick;
//! - **Envoy + processor** (with `--ext-proc BIN`): `examples/envoy/ext-proc.yaml` and
//!   `BIN ext-proc`; its CPU is Envoy's and the processor's together;
//! - **Envoy + module** (with `--module DIR`, default the `libbypass_marker_envoy_module.so` of the same
//!   build, `--no-module` to leave it out): `examples/envoy/dynamic-module.yaml`, the dynamic
//!   module loaded from DIR;
//! - **Envoy + wasm** (with `--wasm FILE`, default the `bypass_marker.wasm` of the same target
//!   directory, `--no-wasm` to leave it out): `examples/envoy/wasm.yaml`, the proxy-wasm plugin
//!   in Envoy's V8; `--wasm-variant FILE` (repeatable) adds a row for another build, named by
//!   its target directory (`bash bypass-marker-wasm/build.sh --features floor-read --target-dir
//!   target/floor-read`: the floor of a body filter in proxy-wasm);
//! - **proxy --no-layer** and **proxy**: the sidecar (`--proxy BIN`; `BIN proxy ...` when BIN is
//!   the `bypass-marker` binary, `BIN ...` for `examples/proxy.rs`), forwarding untouched and with
//!   the layer and the guard on.
//!
//! The upstream (OpenAI `chat.completion.chunk` events, one per body chunk) and the clients run in
//! this process, on threads of their own. A target's CPU time (every process of the target, every
//! thread) is read from `/proc/PID/task/*/schedstat` (nanoseconds; `/proc/PID/stat`'s
//! `utime + stime` counts 10 ms ticks, too coarse for short runs) before and after each run.
//!
//! - **bulk**: 16 connections, each streaming `--bulk-streams` streams (default 20) one after the
//!   other of 1,000 events written back to back; events per second and CPU per event. Every byte
//!   is checked. The upstream writes each event with a `write` of its own (`--bulk-writes
//!   per-event`, the default: a server that flushes every token), or packs them in writes of up to
//!   64 KiB (`--bulk-writes coalesced`). The difference matters: Envoy forwards what one read
//!   gives as one buffer, so its cost is per read, while the sidecar's is per event.
//! - **paced**: 32 connections, each streaming `--paced-streams` streams (default 3) of 200 events
//!   5 ms apart, each its own chunk, as an LLM emits tokens; CPU per event, and the latency each
//!   event gets (from the upstream writing it to the client having all of it), also straight to
//!   the upstream, so that each target's added latency is the difference of the percentiles.
//!
//! Every round runs each target once, in an order that rotates; CPU per event is the total over
//! the rounds, and the ratio to
//! Envoy pass-through is printed with the range of the per-round ratios. The goals of the issues
//! are printed beside them: Envoy + processor at most 1.5x Envoy's CPU per event in bulk and 2.0x
//! paced; the proxy (layer and guard on) at most 0.70x with per-event writes, 0.90x with
//! coalesced writes and 0.50x paced (issue 28); Envoy + module at
//! most 1.10x per event and paced, 1.25x with coalesced writes; Envoy + wasm at most 1.10x per
//! event and paced, 1.50x with coalesced writes (issue 35).
//!
//! Other flags: `--rounds N` (default 3), `--only bulk|paced`, `--envoy-concurrency N` (Envoy's
//! worker threads; default: Envoy's own default, one per CPU), `--ext-proc-variant FLAGS`
//! (repeatable: one more Envoy + processor row whose processor gets these flags, such as
//! `--ext-proc-variant "--threads 2"`, measured in the same rounds; a word `bootstrap=PATH` runs
//! that Envoy with PATH, templated as the shipped bootstrap, instead of
//! `examples/envoy/ext-proc.yaml`; a word `bin=PATH` runs PATH as that row's processor, such as
//! `examples/ext_proc_floor.rs`'s), `--no-proxy` (no proxy rows).
//! The Envoy + processor rows also show the processor's own part of the CPU per event.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// One streamed chat token, as an OpenAI-compatible server sends it (the bulk workload).
const EVENT: &[u8] = b"data: {\"id\":\"chatcmpl-8b1e2f\",\"object\":\"chat.completion.chunk\",\"created\":1764500000,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" token\"},\"finish_reason\":null}]}\n\n";

const BULK_CONNECTIONS: usize = 16;
const BULK_EVENTS: usize = 1_000;
const PACED_CONNECTIONS: usize = 32;
const PACED_EVENTS: usize = 200;
const PACE: Duration = Duration::from_millis(5);

/// The instant the benchmark started: paced events carry their time since it.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

// ---- the upstream -----------------------------------------------------------------------------

/// How the upstream writes a bulk stream's events to its socket.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Writes {
    /// One `write` per event (an HTTP/1.1 chunk each), as a server that flushes every token;
    /// `TCP_NODELAY`, so each leaves as it is written unless the peer falls behind.
    PerEvent,
    /// The events in writes of up to 64 KiB, as a server that buffers what it has ready.
    Coalesced,
}

/// The upstream's answer to `GET /stream?events=N&pace_us=P&writes=per-event|coalesced`:
/// N chat events in chunked encoding; paced ones (P > 0) carry the microsecond they were written at
/// and go one per write, P microseconds apart.
async fn serve_stream(mut socket: tokio::net::TcpStream) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    socket.set_nodelay(true)?;
    let mut buf = Vec::with_capacity(4096);
    loop {
        // One request head (GET, no body) per iteration: keep-alive.
        let end = loop {
            if let Some(end) = memchr::memmem::find(&buf, b"\r\n\r\n") {
                break end + 4;
            }
            let mut chunk = [0u8; 4096];
            let n = socket.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end);
        let target = head.split(' ').nth(1).unwrap_or("");
        let param = |name: &str| -> u64 {
            target
                .split(['?', '&'])
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let (events, pace_us) = (param("events") as usize, param("pace_us"));
        let writes = if target.contains("writes=coalesced") {
            Writes::Coalesced
        } else {
            Writes::PerEvent
        };
        socket
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            .await?;
        let chunk = |event: &[u8], out: &mut Vec<u8>| {
            out.extend_from_slice(format!("{:x}\r\n", event.len()).as_bytes());
            out.extend_from_slice(event);
            out.extend_from_slice(b"\r\n");
        };
        let mut out = Vec::with_capacity(64 << 10);
        if pace_us == 0 {
            for _ in 0..events {
                chunk(EVENT, &mut out);
                if writes == Writes::PerEvent || out.len() + EVENT.len() + 16 > 64 << 10 {
                    socket.write_all(&out).await?;
                    out.clear();
                }
            }
        } else {
            let mut interval = tokio::time::interval(Duration::from_micros(pace_us));
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for _ in 0..events {
                interval.tick().await;
                let at = epoch().elapsed().as_micros();
                let event = format!(
                    "data: {{\"t\":{at},\"object\":\"chat.completion.chunk\",\"created\":1764500000,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" token\"}},\"finish_reason\":null}}]}}\n\n"
                );
                chunk(event.as_bytes(), &mut out);
                socket.write_all(&out).await?;
                out.clear();
            }
        }
        out.extend_from_slice(b"0\r\n\r\n");
        socket.write_all(&out).await?;
    }
}

/// Serves the upstream on its own thread and single-threaded runtime; returns its address.
fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the upstream");
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::Builder::new()
        .name("upstream".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let (socket, _) = listener.accept().await.expect("accept");
                    tokio::spawn(async move {
                        let _ = serve_stream(socket).await;
                    });
                }
            });
        })
        .unwrap();
    addr
}

// ---- the targets ------------------------------------------------------------------------------

/// A free port on 127.0.0.1 (bound, then released for the target to take).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A target: the processes that carry the traffic, killed on drop.
struct Target {
    name: String,
    addr: SocketAddr,
    children: Vec<Child>,
}

impl Drop for Target {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Target {
    /// CPU time of all the target's processes so far, every thread.
    fn cpu(&self) -> Duration {
        self.children.iter().map(|c| process_cpu(c.id())).sum()
    }

    /// CPU time so far of the target's processes after the first (Envoy's processor).
    fn helper_cpu(&self) -> Duration {
        self.children
            .iter()
            .skip(1)
            .map(|c| process_cpu(c.id()))
            .sum()
    }

    /// Per process of the target (Envoy, then its processor): the voluntary context switches
    /// of every thread so far (each one a wait for I/O or for another thread: a wake-up).
    fn switches(&self) -> [u64; 2] {
        let mut out = [0; 2];
        for (slot, child) in out.iter_mut().zip(&self.children) {
            *slot = process_switches(child.id());
        }
        out
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// CPU time of process `pid` so far: the sum over its threads of the time they ran, in
/// nanoseconds, from `/proc/PID/task/TID/schedstat`. (`utime + stime` in `/proc/PID/stat` is the
/// same time in clock ticks of 10 ms, too coarse for runs of a fraction of a second; it is used
/// when schedstat is not there. Threads that exited during a run are missing from the sum: the
/// targets here keep theirs.)
fn process_cpu(pid: u32) -> Duration {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap_or_else(|err| panic!("/proc/{pid}/task: {err} (did the target exit?)"));
    let mut ns = 0u64;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) else {
            return process_ticks(pid);
        };
        ns += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Duration::from_nanos(ns)
}

/// The voluntary context switches of the threads of process `pid` (`/proc/PID/task/*/status`).
fn process_switches(pid: u32) -> u64 {
    let mut switches = 0;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
            switches += status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    switches
}

/// utime + stime of process `pid` (every thread, exited ones included), from `/proc/PID/stat`.
fn process_ticks(pid: u32) -> Duration {
    // SAFETY: sysconf reads a constant of the system.
    #[allow(unsafe_code)]
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|err| panic!("/proc/{pid}/stat: {err} (did the target exit?)"));
    // The fields after the command name, which is in parentheses and may hold spaces: the 3rd
    // field of the line is the first here, so utime (14th) and stime (15th) are the 12th and 13th.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_nanos(ticks * 1_000_000_000 / per_second)
}

/// Starts `program args`, its output in `log`. The child is killed when this process ends, even
/// by a panic (`PR_SET_PDEATHSIG`; the main thread, which spawns every target, lives to the end).
fn spawn(program: &Path, args: &[String], log: &Path) -> Child {
    use std::os::unix::process::CommandExt as _;
    let out = std::fs::File::create(log).unwrap();
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    // SAFETY: prctl is async-signal-safe and touches only the child's own process attributes.
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command
        .spawn()
        .unwrap_or_else(|err| panic!("cannot start {}: {err}", program.display()))
}

/// Waits until `addr` accepts connections (and, for Envoy, its admin says LIVE).
fn wait_ready(children: &mut [Child], addr: SocketAddr, admin: Option<u16>, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for child in children.iter_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "a target exited ({status}) before it was ready: {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
        }
        let live = admin.is_none_or(|port| {
            let mut out = String::new();
            TcpStream::connect(("127.0.0.1", port))
                .and_then(|mut s| {
                    s.write_all(
                        b"GET /ready HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n",
                    )?;
                    s.read_to_string(&mut out)
                })
                .is_ok()
                && out.starts_with("HTTP/1.1 200")
                && out.contains("LIVE")
        });
        if live && TcpStream::connect(addr).is_ok() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not ready after 30 s: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A shipped bootstrap with other values: each line ending in `# template: NAME` gets the value
/// for NAME before that comment (what tests/envoy/render.sh does).
fn render(bootstrap: &str, values: &[(&str, String)]) -> String {
    let mut out = String::new();
    for line in bootstrap.lines() {
        let mut line = line.to_owned();
        for (name, value) in values {
            let tag = format!("# template: {name}");
            if line.trim_end().ends_with(&tag) {
                let comment = line.rfind(&tag).unwrap();
                let head = line[..comment].trim_end().trim_end_matches('}').trim_end();
                let value_start = head.rfind(": ").expect("a `key: value` line") + 2;
                line = format!("{}{value}{}", &line[..value_start], &line[head.len()..]);
            }
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

struct Setup {
    envoy: PathBuf,
    envoy_concurrency: Option<String>,
    dir: PathBuf,
    upstream: SocketAddr,
}

impl Setup {
    fn envoy(&self, name: &str, file: &str, ext_proc: Option<u16>) -> (Child, SocketAddr) {
        self.envoy_with(name, file, ext_proc, &[])
    }

    fn envoy_with(
        &self,
        name: &str,
        file: &str,
        ext_proc: Option<u16>,
        extra: &[(&str, String)],
    ) -> (Child, SocketAddr) {
        let listen = free_port();
        let admin = free_port();
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("examples/envoy")
            .join(file);
        let shipped = std::fs::read_to_string(&shipped)
            .unwrap_or_else(|err| panic!("{}: {err}", shipped.display()));
        let mut values = vec![
            ("LISTEN_PORT", listen.to_string()),
            ("ADMIN_PORT", admin.to_string()),
            ("UPSTREAM_PORT", self.upstream.port().to_string()),
        ];
        values.extend(
            extra
                .iter()
                .filter(|(k, _)| *k != "WASM_BUILD")
                .map(|(k, v)| (*k, v.clone())),
        );
        let mut shipped = shipped;
        if let Some((_, build)) = extra.iter().find(|(k, _)| *k == "WASM_BUILD") {
            // A test or benchmark build of the plugin starts only where its configuration names
            // it (docs/envoy.md, "The plugin: configuration").
            let plain = r#"value: '{"preset": "dynamo"}'"#;
            assert!(
                shipped.contains(plain),
                "{file}: no plugin configuration to name the build in"
            );
            shipped = shipped.replace(
                plain,
                &format!(r#"value: '{{"preset": "dynamo", "build": "{build}"}}'"#),
            );
        }
        if let Some(port) = ext_proc {
            values.push(("EXT_PROC_PORT", port.to_string()));
            // A bootstrap of one's own may also name the port inside a value (a `google_grpc`
            // `target_uri: "127.0.0.1:@EXT_PROC_PORT@"`).
            shipped = shipped.replace("@EXT_PROC_PORT@", &port.to_string());
        }
        let config = self.dir.join(format!("{name}.yaml"));
        std::fs::write(&config, render(&shipped, &values)).unwrap();
        let mut args = vec![
            "--disable-hot-restart".to_owned(),
            "--log-level".to_owned(),
            "warning".to_owned(),
            "-c".to_owned(),
            config.display().to_string(),
        ];
        if let Some(n) = &self.envoy_concurrency {
            args.extend(["--concurrency".to_owned(), n.clone()]);
        }
        let log = self.dir.join(format!("{name}.log"));
        let mut child = [spawn(&self.envoy, &args, &log)];
        let addr = SocketAddr::from(([127, 0, 0, 1], listen));
        wait_ready(&mut child, addr, Some(admin), &log);
        let [child] = child;
        (child, addr)
    }

    /// Envoy with the dynamic module from `dir`.
    fn envoy_module(&self, dir: &Path) -> Target {
        // Every Envoy started from here on finds the module there; the others do not load one.
        std::env::set_var("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", dir);
        let (child, addr) = self.envoy("envoy-module", "dynamic-module.yaml", None);
        Target {
            name: "Envoy + module".to_owned(),
            addr,
            children: vec![child],
        }
    }

    /// Envoy with the proxy-wasm plugin `file`; the first one is "Envoy + wasm", the others are
    /// named by their file's directory (floor builds, other builds).
    fn envoy_wasm(&self, file: &Path, k: usize) -> Target {
        let name = if k == 0 {
            "Envoy + wasm".to_owned()
        } else {
            let dir = file
                .parent()
                .and_then(|d| d.parent())
                .and_then(|d| d.parent());
            let label = dir
                .and_then(|d| d.file_name())
                .map_or(String::new(), |n| n.to_string_lossy().into_owned());
            format!("Envoy + wasm {label}")
        };
        // `bash bypass-marker-wasm/build.sh --features floor-read` writes bypass_marker-floor-read.wasm.
        let mut values = vec![("WASM_FILE", file.display().to_string())];
        if let Some(build) = file
            .file_stem()
            .and_then(|stem| stem.to_str())
            .and_then(|stem| stem.strip_prefix("bypass_marker-"))
        {
            values.push(("WASM_BUILD", build.to_owned()));
        }
        let (child, addr) = self.envoy_with(&format!("envoy-wasm-{k}"), "wasm.yaml", None, &values);
        Target {
            name,
            addr,
            children: vec![child],
        }
    }

    fn envoy_pass_through(&self) -> Target {
        let (child, addr) = self.envoy("envoy", "pass-through.yaml", None);
        Target {
            name: "Envoy pass-through".to_owned(),
            addr,
            children: vec![child],
        }
    }

    /// Envoy with `bin ext-proc` and `extra` flags (a variant when `extra` is not empty).
    fn envoy_ext_proc(&self, bin: &Path, extra: &str, k: usize) -> Target {
        let port = free_port();
        let log = self.dir.join(format!("processor{k}.log"));
        let mut args = vec![
            "ext-proc".to_owned(),
            "--listen".to_owned(),
            format!("127.0.0.1:{port}"),
        ];
        // `bootstrap=PATH`: Envoy's bootstrap (templated as the shipped one) instead of
        // examples/envoy/ext-proc.yaml; every other word is a flag of the processor.
        // `bin=PATH`: another processor binary (such as examples/ext_proc_floor.rs).
        let mut file = "ext-proc.yaml".to_owned();
        let mut bin = bin.to_owned();
        for word in extra.split_whitespace() {
            if let Some(path) = word.strip_prefix("bootstrap=") {
                file = path.to_owned();
            } else if let Some(path) = word.strip_prefix("bin=") {
                bin = PathBuf::from(path);
            } else {
                args.push(word.to_owned());
            }
        }
        let mut processor = [spawn(&bin, &args, &log)];
        wait_ready(&mut processor, ([127, 0, 0, 1], port).into(), None, &log);
        let [processor] = processor;
        let (envoy, addr) = self.envoy(&format!("envoy-ext-proc{k}"), &file, Some(port));
        let name = if extra.is_empty() {
            "Envoy + processor".to_owned()
        } else {
            format!("Envoy + processor {extra}")
        };
        Target {
            name,
            addr,
            children: vec![envoy, processor],
        }
    }

    fn proxy(&self, bin: &Path, layer: bool) -> Target {
        let name = if layer { "proxy" } else { "proxy --no-layer" };
        self.proxy_named(bin, layer, name)
    }

    fn proxy_named(&self, bin: &Path, layer: bool, name: &'static str) -> Target {
        let port = free_port();
        let mut args = Vec::new();
        if bin.file_name().is_some_and(|n| n == "bypass-marker") {
            args.push("proxy".to_owned());
        }
        args.extend([
            "--listen".to_owned(),
            format!("127.0.0.1:{port}"),
            "--upstream".to_owned(),
            format!("http://{}", self.upstream),
        ]);
        if !layer {
            args.push("--no-layer".to_owned());
        }
        let log = self
            .dir
            .join(format!("{}.log", name.replace([' ', '(', ')'], "")));
        let mut child = [spawn(bin, &args, &log)];
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        wait_ready(&mut child, addr, None, &log);
        let [child] = child;
        Target {
            name: name.to_owned(),
            addr,
            children: vec![child],
        }
    }
}

// ---- the client -------------------------------------------------------------------------------

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

/// One run of a workload through a target.
#[derive(Default, Clone, Copy)]
struct Run {
    events: u64,
    wall: Duration,
    cpu: Duration,
    /// The part of `cpu` spent by the processor (Envoy + processor only).
    helper: Duration,
    /// What [`Target::switches`] grew by during the run.
    switches: [u64; 2],
}

/// `connections` tasks, each streaming `streams` streams of `events` one after the other; returns
/// what every stream read, in (body bytes, latencies in microseconds of paced events).
async fn drive(
    client: &HttpClient,
    base: &str,
    connections: usize,
    streams: usize,
    events: usize,
    pace_us: u64,
    writes: Writes,
) -> (u64, Vec<u64>) {
    let writes = match writes {
        Writes::PerEvent => "per-event",
        Writes::Coalesced => "coalesced",
    };
    let url: hyper::Uri =
        format!("{base}/stream?events={events}&pace_us={pace_us}&writes={writes}")
            .parse()
            .unwrap();
    let tasks = (0..connections).map(|_| {
        let client = client.clone();
        let url = url.clone();
        async move {
            let (mut bytes, mut latencies) = (0u64, Vec::new());
            for _ in 0..streams {
                let res = client.get(url.clone()).await.expect("a response");
                assert_eq!(res.status(), 200, "status through {url}");
                let mut body = res.into_body();
                let mut held: Vec<u8> = Vec::new();
                let mut got = 0;
                while let Some(frame) = body.frame().await {
                    let Ok(data) = frame.expect("a body frame").into_data() else {
                        continue;
                    };
                    bytes += data.len() as u64;
                    if pace_us == 0 {
                        continue;
                    }
                    let now = epoch().elapsed().as_micros() as u64;
                    held.extend_from_slice(&data);
                    while let Some(end) = memchr::memmem::find(&held, b"\n\n") {
                        let t = held
                            .strip_prefix(b"data: {\"t\":")
                            .and_then(|rest| {
                                let comma = rest.iter().position(|&b| b == b',')?;
                                std::str::from_utf8(&rest[..comma])
                                    .ok()?
                                    .parse::<u64>()
                                    .ok()
                            })
                            .expect("a timed event");
                        latencies.push(now.saturating_sub(t));
                        got += 1;
                        held.drain(..end + 2);
                    }
                }
                if pace_us != 0 {
                    assert_eq!(got, events, "every paced event arrived through {url}");
                }
            }
            (bytes, latencies)
        }
    });
    let mut bytes = 0;
    let mut latencies = Vec::new();
    for (b, l) in futures_util::future::join_all(tasks).await {
        bytes += b;
        latencies.extend(l);
    }
    (bytes, latencies)
}

async fn bulk(client: &HttpClient, target: &Target, streams: usize, writes: Writes) -> Run {
    let cpu = target.cpu();
    let helper = target.helper_cpu();
    let switches = target.switches();
    let started = Instant::now();
    let (bytes, _) = drive(
        client,
        &target.url(""),
        BULK_CONNECTIONS,
        streams,
        BULK_EVENTS,
        0,
        writes,
    )
    .await;
    let wall = started.elapsed();
    let events = (BULK_CONNECTIONS * streams * BULK_EVENTS) as u64;
    assert_eq!(
        bytes,
        events * EVENT.len() as u64,
        "every byte arrived through {}",
        target.name
    );
    Run {
        events,
        wall,
        cpu: target.cpu() - cpu,
        helper: target.helper_cpu() - helper,
        switches: since(target.switches(), switches),
    }
}

async fn paced(
    client: &HttpClient,
    base: &str,
    target: Option<&Target>,
    streams: usize,
) -> (Run, Vec<u64>) {
    let cpu = target.map(|t| (t.cpu(), t.helper_cpu()));
    let switches = target.map(Target::switches);
    let started = Instant::now();
    let (_, latencies) = drive(
        client,
        base,
        PACED_CONNECTIONS,
        streams,
        PACED_EVENTS,
        PACE.as_micros() as u64,
        Writes::PerEvent,
    )
    .await;
    let run = Run {
        events: latencies.len() as u64,
        wall: started.elapsed(),
        cpu: match (target, cpu) {
            (Some(t), Some((c, _))) => t.cpu() - c,
            _ => Duration::ZERO,
        },
        helper: match (target, cpu) {
            (Some(t), Some((_, h))) => t.helper_cpu() - h,
            _ => Duration::ZERO,
        },
        switches: match (target, switches) {
            (Some(t), Some(c)) => since(t.switches(), c),
            _ => [0; 2],
        },
    };
    (run, latencies)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn ns_per_event(runs: &[Run]) -> f64 {
    let cpu: Duration = runs.iter().map(|r| r.cpu).sum();
    let events: u64 = runs.iter().map(|r| r.events).sum();
    cpu.as_nanos() as f64 / events as f64
}

fn since(now: [u64; 2], then: [u64; 2]) -> [u64; 2] {
    [
        now[0].saturating_sub(then[0]),
        now[1].saturating_sub(then[1]),
    ]
}

/// Voluntary context switches per event, of Envoy and (if any) the processor.
fn switches_per_event(runs: &[Run]) -> String {
    let events: u64 = runs.iter().map(|r| r.events).sum();
    let per = |p: usize| runs.iter().map(|r| r.switches[p]).sum::<u64>() as f64 / events as f64;
    if runs.iter().all(|r| r.switches[1] == 0) {
        return format!("Envoy {:.3}", per(0));
    }
    format!("Envoy {:.3}, processor {:.3}", per(0), per(1))
}

/// The processor's part of the CPU per event, in the same unit, or blank for a single process.
fn helper_per_event(runs: &[Run]) -> String {
    let helper: Duration = runs.iter().map(|r| r.helper).sum();
    let events: u64 = runs.iter().map(|r| r.events).sum();
    if helper.is_zero() {
        return String::new();
    }
    format!(
        "(processor {:.2} us)",
        helper.as_nanos() as f64 / events as f64 / 1000.0
    )
}

fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, 0.0), |(lo, hi), v| (lo.min(v), hi.max(v)))
}

/// The lowest and highest round-by-round ratio of CPU per event, `runs` to `base` (Envoy alone):
/// the spread behind the table's ratio.
fn cpu_ratio_range(runs: &[Run], base: &[Run]) -> (f64, f64) {
    range(
        runs.iter()
            .zip(base)
            .map(|(r, e)| ns_per_event(&[*r]) / ns_per_event(&[*e])),
    )
}

/// The issues' goals for a target, as (bulk, paced) CPU per event relative to Envoy pass-through.
fn goals(name: &str, writes: Writes) -> Option<(f64, f64)> {
    match name {
        n if n.starts_with("Envoy + processor") => Some((1.5, 2.0)),
        "Envoy + module" if writes == Writes::Coalesced => Some((1.25, 1.10)),
        "Envoy + module" => Some((1.10, 1.10)),
        // Issue 35: 1.10x per event and paced, 1.50x coalesced.
        "Envoy + wasm" if writes == Writes::Coalesced => Some((1.50, 1.10)),
        "Envoy + wasm" => Some((1.10, 1.10)),
        // Issue 28: per-event writes 0.70x, coalesced 0.90x, paced 0.50x.
        "proxy" if writes == Writes::Coalesced => Some((0.90, 0.50)),
        "proxy" => Some((0.70, 0.50)),
        _ => None,
    }
}

fn verdict(ratio: f64, goal: Option<f64>) -> String {
    match goal {
        Some(goal) if ratio <= goal => format!("goal <= {goal:.2}x: met"),
        Some(goal) => format!("goal <= {goal:.2}x: NOT met"),
        None => String::new(),
    }
}

struct Args {
    envoy: PathBuf,
    proxy: Option<PathBuf>,
    baseline: Option<PathBuf>,
    ext_proc: Option<PathBuf>,
    /// The directory of `libbypass_marker_envoy_module.so`, for the Envoy + module row.
    module: Option<PathBuf>,
    /// The proxy-wasm plugin, for the Envoy + wasm row.
    wasm: Option<PathBuf>,
    /// More plugin builds, one row each (`--wasm-variant FILE`).
    wasm_variants: Vec<PathBuf>,
    /// Flags of further processor rows (`--ext-proc-variant "--threads 1"`), beside the default.
    variants: Vec<String>,
    rounds: usize,
    bulk_streams: usize,
    paced_streams: usize,
    only: Option<String>,
    envoy_concurrency: Option<String>,
    writes: Writes,
}

const USAGE: &str =
    "usage: envoy_bench [--envoy PATH] [--proxy PATH] [--baseline PATH] [--ext-proc PATH | --no-ext-proc] [--ext-proc-variant FLAGS]... [--module DIR | --no-module] [--wasm FILE | --no-wasm] [--wasm-variant FILE]... [--no-proxy] [--rounds N] \
[--bulk-streams N] [--paced-streams N] [--bulk-writes per-event|coalesced] [--only bulk|paced] \
[--envoy-concurrency N]";

/// Whether `bin ext-proc --help` runs.
fn has_ext_proc(bin: &Path) -> bool {
    bin.exists()
        && Command::new(bin)
            .args(["ext-proc", "--help"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

/// The Envoy release tests/envoy/install.sh installs by default: `ENVOY_LATEST` in
/// tests/versions.sh, read by bash sourcing it, as every suite does.
fn envoy_latest() -> String {
    let versions = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/versions.sh");
    let out = Command::new("bash")
        .arg("-c")
        .arg(r#"source "$1" && printf '%s' "$ENVOY_LATEST""#)
        .arg("bash")
        .arg(&versions)
        .output();
    match out {
        Ok(out) if out.status.success() && !out.stdout.is_empty() => {
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
        _ => {
            eprintln!(
                "cannot read ENVOY_LATEST from {}: set ENVOY or pass --envoy",
                versions.display()
            );
            std::process::exit(2)
        }
    }
}

fn parse_args() -> Args {
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf));
    let mut args = Args {
        envoy: std::env::var_os("ENVOY").map_or_else(
            || {
                let home = std::env::var_os("HOME").unwrap_or_default();
                let cache = std::env::var_os("ENVOY_CACHE").map_or_else(
                    || Path::new(&home).join(".cache/tower-bypass-marker-envoy"),
                    PathBuf::from,
                );
                cache.join(format!("venv-{}/bin/envoy", envoy_latest()))
            },
            PathBuf::from,
        ),
        // The bypass-marker binary of the same build (target/release/), else examples/proxy.rs
        // built beside this example.
        proxy: exe_dir.as_ref().and_then(|d| {
            [d.join("../bypass-marker"), d.join("proxy")]
                .into_iter()
                .find(|p| p.exists())
        }),
        baseline: None,
        // The same bypass-marker, if it has the ext-proc subcommand.
        ext_proc: exe_dir
            .as_ref()
            .map(|d| d.join("../bypass-marker"))
            .filter(|p| has_ext_proc(p)),
        // The module of the same build (target/release/libbypass_marker_envoy_module.so).
        module: exe_dir
            .as_ref()
            .map(|d| d.join(".."))
            .filter(|d| d.join("libbypass_marker_envoy_module.so").exists()),
        // The plugin of the same target directory (target/wasm32-wasip1/release/).
        wasm: exe_dir
            .map(|d| d.join("../../wasm32-wasip1/release/bypass_marker.wasm"))
            .filter(|f| f.exists()),
        wasm_variants: Vec::new(),
        variants: Vec::new(),
        rounds: 3,
        bulk_streams: 20,
        paced_streams: 3,
        only: None,
        envoy_concurrency: None,
        writes: Writes::PerEvent,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || {
            it.next().unwrap_or_else(|| {
                eprintln!("{arg} needs a value\n{USAGE}");
                std::process::exit(2)
            })
        };
        let number = |v: String| -> usize {
            v.parse().unwrap_or_else(|_| {
                eprintln!("not a number: {v:?}\n{USAGE}");
                std::process::exit(2)
            })
        };
        match arg.as_str() {
            "--envoy" => args.envoy = value().into(),
            "--proxy" => args.proxy = Some(value().into()),
            "--baseline" => args.baseline = Some(value().into()),
            "--ext-proc" => args.ext_proc = Some(value().into()),
            "--no-ext-proc" => args.ext_proc = None,
            "--module" => args.module = Some(value().into()),
            "--no-module" => args.module = None,
            "--wasm" => args.wasm = Some(value().into()),
            "--no-wasm" => args.wasm = None,
            "--wasm-variant" => args.wasm_variants.push(value().into()),
            "--ext-proc-variant" => args.variants.push(value()),
            "--no-proxy" => args.proxy = None,
            "--rounds" => args.rounds = number(value()).max(1),
            "--bulk-streams" => args.bulk_streams = number(value()).max(1),
            "--paced-streams" => args.paced_streams = number(value()).max(1),
            "--only" => args.only = Some(value()),
            "--envoy-concurrency" => args.envoy_concurrency = Some(value()),
            "--bulk-writes" => {
                args.writes = match value().as_str() {
                    "per-event" => Writes::PerEvent,
                    "coalesced" => Writes::Coalesced,
                    other => {
                        eprintln!("--bulk-writes per-event|coalesced, not {other:?}\n{USAGE}");
                        std::process::exit(2)
                    }
                }
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0)
            }
            other => {
                eprintln!("unknown argument {other:?}\n{USAGE}");
                std::process::exit(2)
            }
        }
    }
    args
}

fn main() {
    let args = parse_args();
    epoch();
    let dir = ScratchDir(std::env::temp_dir().join(format!("envoy-bench-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let setup = Setup {
        envoy: args.envoy.clone(),
        envoy_concurrency: args.envoy_concurrency.clone(),
        dir: dir.0.clone(),
        upstream: upstream(),
    };
    let version = Command::new(&setup.envoy)
        .arg("--version")
        .output()
        .unwrap_or_else(|err| {
            panic!(
                "cannot run Envoy at {} ({err}); install it with `bash tests/envoy/install.sh` or pass --envoy",
                setup.envoy.display()
            )
        });
    println!(
        "{}",
        String::from_utf8_lossy(&version.stdout)
            .trim()
            .replace('\n', " ")
    );

    let mut targets = vec![setup.envoy_pass_through()];
    match &args.ext_proc {
        Some(bin) => {
            targets.push(setup.envoy_ext_proc(bin, "", 0));
            for (k, extra) in args.variants.iter().enumerate() {
                targets.push(setup.envoy_ext_proc(bin, extra, k + 1));
            }
        }
        None => println!("(no --ext-proc BIN: the Envoy + processor row is left out)"),
    }
    match &args.module {
        Some(dir) => {
            println!(
                "module: {}",
                dir.join("libbypass_marker_envoy_module.so").display()
            );
            targets.push(setup.envoy_module(dir));
        }
        None => println!("(no --module DIR: the Envoy + module row is left out)"),
    }
    match &args.wasm {
        Some(file) => {
            println!("wasm: {}", file.display());
            targets.push(setup.envoy_wasm(file, 0));
        }
        None => println!("(no --wasm FILE: the Envoy + wasm row is left out)"),
    }
    for (k, file) in args.wasm_variants.iter().enumerate() {
        println!("wasm variant: {}", file.display());
        targets.push(setup.envoy_wasm(file, k + 1));
    }
    match &args.proxy {
        Some(bin) => {
            println!("proxy: {}", bin.display());
            targets.push(setup.proxy(bin, false));
            targets.push(setup.proxy(bin, true));
        }
        None => println!("(no --proxy BIN: the proxy rows are left out)"),
    }
    if let Some(bin) = &args.baseline {
        println!("baseline: {}", bin.display());
        targets.push(setup.proxy_named(bin, true, "proxy (baseline)"));
    }
    let n = targets.len();
    let run_bulk = args.only.as_deref() != Some("paced");
    let run_paced = args.only.as_deref() != Some("bulk");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client: HttpClient = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(64)
            .build_http();
        // Warm-up: every target, its upstream connections and its processor stream.
        for target in &targets {
            bulk(&client, target, 1, args.writes).await;
        }

        if run_bulk {
            println!(
                "\nbulk: {BULK_CONNECTIONS} connections x {} streams x {BULK_EVENTS} events of {} bytes written back to back ({}); {} rounds",
                args.bulk_streams,
                EVENT.len(),
                match args.writes {
                    Writes::PerEvent => "one write per event",
                    Writes::Coalesced => "in writes of up to 64 KiB",
                },
                args.rounds
            );
            let mut runs = vec![Vec::new(); n];
            for round in 0..args.rounds {
                for k in 0..n {
                    let i = (k + round) % n;
                    runs[i].push(bulk(&client, &targets[i], args.bulk_streams, args.writes).await);
                }
            }
            let base = ns_per_event(&runs[0]);
            println!(
                "  {:<34} {:>12} {:>12} {:>10} {:>16}",
                "target", "events/s", "CPU/event", "vs Envoy", "rounds"
            );
            for i in 0..n {
                let rate: f64 = runs[i].iter().map(|r| r.events as f64 / r.wall.as_secs_f64()).sum::<f64>()
                    / runs[i].len() as f64;
                let cpu = ns_per_event(&runs[i]);
                let (lo, hi) = cpu_ratio_range(&runs[i], &runs[0]);
                println!(
                    "  {:<34} {:>12.0} {:>9.2} us {:>9.2}x {:>7.2}-{:<7.2} {} {}",
                    targets[i].name,
                    rate,
                    cpu / 1000.0,
                    cpu / base,
                    lo,
                    hi,
                    verdict(cpu / base, goals(&targets[i].name, args.writes).map(|g| g.0)),
                    helper_per_event(&runs[i])
                );
            }
            println!("  voluntary context switches (wake-ups) per event:");
            for i in 0..n {
                println!("  {:<34} {}", targets[i].name, switches_per_event(&runs[i]));
            }
        }

        if run_paced {
            println!(
                "\npaced: {PACED_CONNECTIONS} connections x {} streams x {PACED_EVENTS} events, {} ms apart, each its own chunk; {} rounds",
                args.paced_streams,
                PACE.as_millis(),
                args.rounds
            );
            let mut runs = vec![Vec::new(); n];
            let mut latencies = vec![Vec::new(); n];
            let mut direct = Vec::new();
            let upstream = format!("http://{}", setup.upstream);
            for round in 0..args.rounds {
                for k in 0..=n {
                    let i = (k + round) % (n + 1);
                    if i == n {
                        direct.extend(paced(&client, &upstream, None, args.paced_streams).await.1);
                    } else {
                        let (run, l) =
                            paced(&client, &targets[i].url(""), Some(&targets[i]), args.paced_streams).await;
                        runs[i].push(run);
                        latencies[i].extend(l);
                    }
                }
            }
            direct.sort_unstable();
            let (d50, d99) = (percentile(&direct, 0.5), percentile(&direct, 0.99));
            println!(
                "  straight to the upstream: latency p50 {d50} us, p99 {d99} us (the baseline)"
            );
            println!(
                "  {:<34} {:>12} {:>10} {:>16} {:>24}",
                "target", "CPU/event", "vs Envoy", "rounds", "latency added p50/p99"
            );
            let base = ns_per_event(&runs[0]);
            for i in 0..n {
                latencies[i].sort_unstable();
                let (p50, p99) = (
                    percentile(&latencies[i], 0.5),
                    percentile(&latencies[i], 0.99),
                );
                let cpu = ns_per_event(&runs[i]);
                let (lo, hi) = cpu_ratio_range(&runs[i], &runs[0]);
                println!(
                    "  {:<34} {:>9.2} us {:>9.2}x {:>7.2}-{:<7.2} {:>+9} us / {:>+6} us  {} {}",
                    targets[i].name,
                    cpu / 1000.0,
                    cpu / base,
                    lo,
                    hi,
                    p50 as i64 - d50 as i64,
                    p99 as i64 - d99 as i64,
                    verdict(cpu / base, goals(&targets[i].name, args.writes).map(|g| g.1)),
                    helper_per_event(&runs[i])
                );
            }
            println!("  voluntary context switches (wake-ups) per event:");
            for i in 0..n {
                println!("  {:<34} {}", targets[i].name, switches_per_event(&runs[i]));
            }
        }
    });
    drop(targets);
    drop(dir);
}

/// The rendered bootstraps and the targets' logs; removed at the end, a panic included.
struct ScratchDir(PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
