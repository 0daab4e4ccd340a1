//! What the tests of the `bypass-marker` binary share: the binary as a child process, started
//! with a clean environment, the addresses it announces on stdout, its stderr lines and SIGTERM.
#![allow(dead_code)] // each test target uses a part

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use tokio::task::JoinHandle;

/// The binary cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_bypass-marker");
/// How long a step may take on a loaded machine before the test fails.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// A `bypass-marker` command with none of the test process's `BYPASS_MARKER_*` variables and no
/// `RUST_LOG`, stdout piped (for [`Announced`]), stderr discarded and the child killed on drop.
pub fn command() -> Command {
    let mut command = Command::new(BIN);
    for (name, _) in std::env::vars() {
        if name.starts_with("BYPASS_MARKER_") {
            command.env_remove(name);
        }
    }
    command
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    command
}

/// The lines a started child writes on stdout, read until the ones that announce its addresses.
pub struct Announced(Lines<BufReader<ChildStdout>>);

impl Announced {
    /// Takes the child's stdout (it must be piped).
    pub fn of(child: &mut Child) -> Self {
        Self(BufReader::new(child.stdout.take().expect("a piped stdout")).lines())
    }

    /// The first word after `prefix` in the next line that starts with it: `"listening on
    /// http://"` gives the proxy's address, `"ext_proc listening on "` the processor's, `"metrics
    /// on "` the metrics URL. Fails the test when the child exits or stays silent for
    /// [`PATIENCE`].
    pub async fn next(&mut self, prefix: &str) -> String {
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
pub async fn start_proxy(command: &mut Command) -> (Child, String) {
    let mut child = command.spawn().expect("the binary starts");
    let addr = Announced::of(&mut child).next("listening on http://").await;
    (child, addr)
}

/// Every line the child writes on stderr (it must be piped), once it closes stderr.
pub fn stderr_lines(child: &mut Child) -> JoinHandle<Vec<String>> {
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
pub fn sigterm(child: &Child) {
    let pid = child.id().expect("a running child") as libc::pid_t;
    // SAFETY: kill only sends a signal to the process this test spawned.
    #[allow(unsafe_code)]
    let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(sent, 0, "SIGTERM to {pid}");
}
