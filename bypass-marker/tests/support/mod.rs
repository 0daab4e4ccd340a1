//! What the tests of the `bypass-marker` binary share: the binary as a child process, started
//! with a clean environment, the addresses it announces on stdout, its stderr lines and SIGTERM;
//! in process, upstreams on 127.0.0.1, the proxy's flags, a client and raw TCP exchanges; and the
//! process's limit on open files, for the tests that run it out of descriptors.
#![allow(dead_code)] // each test target uses a part

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use bypass_marker::ProxyArgs;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::net::TcpStream;
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The binary cargo built for these tests.
pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_bypass-marker");
/// How long a step may take on a loaded machine before the test fails.
pub(crate) const PATIENCE: Duration = Duration::from_secs(30);

/// A `bypass-marker` command with none of the test process's `BYPASS_MARKER_*` variables and no
/// `RUST_LOG`, stdout piped (for [`Announced`]), stderr discarded and the child killed on drop.
pub(crate) fn command() -> Command {
    let mut command = Command::from(std_command());
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    command
}

/// The blocking [`std::process::Command`] under [`command`]: the binary with none of the test
/// process's `BYPASS_MARKER_*` variables and no `RUST_LOG`, its standard streams as they are.
pub(crate) fn std_command() -> std::process::Command {
    let mut command = std::process::Command::new(BIN);
    for (name, _) in std::env::vars() {
        if name.starts_with("BYPASS_MARKER_") {
            command.env_remove(name);
        }
    }
    command.env_remove("RUST_LOG");
    command
}

/// The lines a started child writes on stdout, read until the ones that announce its addresses.
pub(crate) struct Announced(Lines<BufReader<ChildStdout>>);

impl Announced {
    /// Takes the child's stdout (it must be piped).
    pub(crate) fn of(child: &mut Child) -> Self {
        Self(BufReader::new(child.stdout.take().expect("a piped stdout")).lines())
    }

    /// The first word after `prefix` in the next line that starts with it: `"listening on
    /// http://"` gives the proxy's address, `"ext_proc listening on "` the processor's, `"metrics
    /// on "` the metrics URL. Fails the test when the child exits or stays silent for
    /// [`PATIENCE`].
    pub(crate) async fn next(&mut self, prefix: &str) -> String {
        let line = tokio::time::timeout(PATIENCE, async {
            while let Some(line) = self.0.next_line().await.expect("stdout") {
                if let Some(rest) = line.strip_prefix(prefix) {
                    return rest.split(' ').next().unwrap_or_default().to_owned();
                }
            }
            panic!("the child exited without a line starting with {prefix:?}");
        });
        line.await
            .unwrap_or_else(|_| panic!("no line starting with {prefix:?} in time"))
    }
}

/// Starts `command` and waits for the proxy's `listening on http://ADDR` line: the child and ADDR.
pub(crate) async fn start_proxy(command: &mut Command) -> (Child, String) {
    let mut child = command.spawn().expect("the binary starts");
    let addr = Announced::of(&mut child).next("listening on http://").await;
    (child, addr)
}

// ---- In process: upstreams, the proxy's flags, a client, raw TCP -------------------------------

/// What a client exchange fails with, and the plain HTTP/1.1 client: the library's tests' own.
pub(crate) use test_support::serve::{h1_client as client, BoxError};

/// Serves `app` on 127.0.0.1 as an upstream; it stops with the test's runtime. Its listen backlog
/// is large, so that a burst of new connections from the proxy is not held up by the upstream's
/// accept queue.
pub(crate) async fn serve_upstream(app: axum::Router) -> SocketAddr {
    let listener = bypass_marker::bind("127.0.0.1:0".parse().unwrap(), 4096).unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The flags of `bypass-marker proxy --listen 127.0.0.1:0 --upstream UPSTREAM`, then `args`,
/// parsed as the binary parses them (environment variables included).
pub(crate) fn proxy_args(upstream: &str, args: &[&str]) -> ProxyArgs {
    let mut all = vec!["--listen", "127.0.0.1:0", "--upstream", upstream];
    all.extend_from_slice(args);
    ProxyArgs::from_args(all).expect("valid flags")
}

/// Completes once `stop`'s sender has sent or been dropped: a shutdown future for a server that
/// stops with the test's handle on it.
pub(crate) async fn stopped(stop: oneshot::Receiver<()>) {
    let _ = stop.await;
}

/// A response as the client received it.
pub(crate) struct Reply {
    /// The status code.
    pub(crate) status: http::StatusCode,
    /// The header fields.
    pub(crate) headers: http::HeaderMap,
    /// The whole body.
    pub(crate) body: Bytes,
}

/// Sends `req` with a new [`client`] and reads the whole response, however long it takes.
pub(crate) async fn fetch(req: http::Request<Full<Bytes>>) -> Result<Reply, BoxError> {
    let res = client().request(req).await?;
    let (parts, body) = res.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// [`fetch`] within [`PATIENCE`]: an error, too, when the response is not complete by then.
pub(crate) async fn send(req: http::Request<Full<Bytes>>) -> Result<Reply, BoxError> {
    tokio::time::timeout(PATIENCE, fetch(req))
        .await
        .map_err(|_| "no complete response in time")?
}

/// A GET of `url`, with no body, through [`send`]; an error fails the test.
pub(crate) async fn get(url: String) -> Reply {
    let req = http::Request::get(url).body(Full::default()).unwrap();
    send(req).await.unwrap()
}

/// A POST of `json` to `url` as `application/json`, through [`send`]; an error fails the test.
pub(crate) async fn post_json(url: String, json: &serde_json::Value) -> Reply {
    let req = http::Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(json.to_string())))
        .unwrap();
    send(req).await.unwrap()
}

/// A new connection to `addr`, on which `request` has been written.
pub(crate) async fn raw_request(addr: SocketAddr, request: &[u8]) -> TcpStream {
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(request).await.unwrap();
    conn
}

/// Writes `request` on a new connection and reads until the server closes it.
pub(crate) async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> Vec<u8> {
    let mut conn = raw_request(addr, request).await;
    let mut out = Vec::new();
    tokio::time::timeout(PATIENCE, conn.read_to_end(&mut out))
        .await
        .expect("the proxy closes the connection")
        .unwrap();
    out
}

/// A raw response cut after its head: the head as text (without the blank line) and the rest.
pub(crate) fn split_head(response: &[u8]) -> (String, &[u8]) {
    let end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete response head");
    (
        String::from_utf8(response[..end].to_vec()).unwrap(),
        &response[end + 4..],
    )
}

// ---- The limit on open files, for the tests that run the process out of descriptors -----------

/// How many file descriptors this process has open.
#[cfg(target_os = "linux")]
pub(crate) fn open_files() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// This process's limits on open files (`RLIMIT_NOFILE`).
#[cfg(unix)]
fn open_files_limits() -> libc::rlimit {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass, nothing else.
    #[allow(unsafe_code)]
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    assert_eq!(got, 0);
    limit
}

/// Asks for `limit` as this process's limits on open files; whether the kernel agreed.
#[cfg(unix)]
fn try_set_open_files_limits(limit: &libc::rlimit) -> bool {
    // SAFETY: setrlimit reads the struct we pass, nothing else.
    #[allow(unsafe_code)]
    let set = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, limit) };
    set == 0
}

/// Sets this process's soft limit on open files to `soft`; returns the soft limit it replaces.
#[cfg(unix)]
pub(crate) fn set_open_files_limit(soft: u64) -> u64 {
    let mut limit = open_files_limits();
    let old = limit.rlim_cur;
    limit.rlim_cur = soft;
    assert!(try_set_open_files_limits(&limit), "setrlimit({soft})");
    old
}

/// Raises this process's soft limit on open files to the hard limit, as far as the kernel lets
/// it; returns the soft limit then in force.
#[cfg(unix)]
pub(crate) fn raise_open_files_limit() -> u64 {
    let mut limit = open_files_limits();
    limit.rlim_cur = limit.rlim_max;
    try_set_open_files_limits(&limit);
    open_files_limits().rlim_cur
}

/// This process out of file descriptors (see [`starve`]) until [`Starved::free`].
#[cfg(target_os = "linux")]
pub(crate) struct Starved {
    /// `/dev/null`, open until no descriptor is left.
    files: Vec<std::fs::File>,
    /// The soft limit on open files before.
    limit: u64,
}

/// Runs this process out of file descriptors while `n` connections to `addr` wait in its accept
/// queue: the sockets are made while descriptors are free and connected once they are gone (the
/// soft limit lowered to 64 above what is open, then `/dev/null` opened until `EMFILE`), so that
/// every `accept` of the server fails with `EMFILE`. Returns the state and the connections.
#[cfg(target_os = "linux")]
pub(crate) async fn starve(addr: SocketAddr, n: usize) -> (Starved, Vec<TcpStream>) {
    let sockets: Vec<tokio::net::TcpSocket> = (0..n)
        .map(|_| tokio::net::TcpSocket::new_v4().unwrap())
        .collect();
    let limit = set_open_files_limit(open_files() as u64 + 64);
    let mut files = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(file) => files.push(file),
            Err(err) if err.raw_os_error() == Some(libc::EMFILE) => break,
            Err(err) => panic!("open failed: {err}"),
        }
        assert!(files.len() < 1000, "the limit on open files had no effect");
    }
    let mut waiting = Vec::new();
    for socket in sockets {
        waiting.push(socket.connect(addr).await.unwrap());
    }
    (Starved { files, limit }, waiting)
}

#[cfg(target_os = "linux")]
impl Starved {
    /// Frees the descriptors: closes the files and restores the soft limit.
    pub(crate) fn free(self) {
        drop(self.files);
        set_open_files_limit(self.limit);
    }
}

// ---- The child process's stderr, and its stop ------------------------------------------------

/// Sends SIGTERM to the child and waits for it to exit, within [`PATIENCE`]: its status. `exits`
/// says what the test waits for, when it does not come.
#[cfg(unix)]
pub(crate) async fn sigterm_and_wait(child: &mut Child, exits: &str) -> std::process::ExitStatus {
    sigterm(child);
    tokio::time::timeout(PATIENCE, child.wait())
        .await
        .expect(exits)
        .unwrap()
}

/// Sends SIGTERM to the child and waits for it to exit, within [`PATIENCE`]: its status and what
/// it wrote on the streams that are piped.
#[cfg(unix)]
pub(crate) async fn sigterm_and_output(child: Child) -> std::process::Output {
    sigterm(&child);
    tokio::time::timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("the child exits after SIGTERM")
        .unwrap()
}

/// Every line the child writes on stderr (it must be piped), once it closes stderr.
pub(crate) fn stderr_lines(child: &mut Child) -> JoinHandle<Vec<String>> {
    let stderr = child.stderr.take().expect("a piped stderr");
    tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        let mut all = Vec::new();
        while let Ok(Some(line)) = lines.next_line().await {
            all.push(line);
        }
        all
    })
}

/// Sends SIGTERM to the child, which must still run.
#[cfg(unix)]
pub(crate) fn sigterm(child: &Child) {
    let pid = child.id().expect("a running child") as libc::pid_t;
    // SAFETY: kill only sends a signal to the process this test spawned.
    #[allow(unsafe_code)]
    let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(sent, 0, "SIGTERM to {pid}");
}

/// Asks the gRPC health service on `channel` about the external processor and about the server
/// as a whole (the empty name), and checks that both are `SERVING`.
pub(crate) async fn assert_ext_proc_serving(channel: tonic::transport::Channel) {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let mut health = HealthClient::new(channel);
    for service in ["", "envoy.service.ext_proc.v3.ExternalProcessor"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .unwrap()
            .into_inner()
            .status();
        assert_eq!(status, ServingStatus::Serving, "{service:?}");
    }
}
