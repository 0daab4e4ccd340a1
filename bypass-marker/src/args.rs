//! The command line of `bypass-marker`, with clap: every flag also from an environment variable
//! `BYPASS_MARKER_<FLAG>` (`--upstream` from `BYPASS_MARKER_UPSTREAM`, `--opt-in` from
//! `BYPASS_MARKER_OPT_IN`, ...). A flag given on the command line wins over its variable.
//!
//! Repeatable flags (`--opt-in`, `--router-owned`, `--never-forward`) take a comma-separated list
//! too, which is how their variables hold several names (`BYPASS_MARKER_OPT_IN=a,b`). The
//! variables of the switches (`BYPASS_MARKER_SDK_SAFE`, `BYPASS_MARKER_NO_LAYER`) take `true`,
//! `false`, `1`, `0`, `yes`, `no`, `on`, `off` (also `y`, `n`, `t`, `f`), in any case.
//!
//! An invalid value is a usage error (exit code 2) that names what the operator wrote: the
//! variable when the value came from the environment, the flag when it came from the command line.

use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{Args, CommandFactory as _, FromArgMatches as _, Parser, Subcommand, ValueEnum};
use http::uri::Authority;
use http::{HeaderValue, Uri};

use tower_bypass_marker::json::DEFAULT_MAX_BODY_BYTES;
use tower_bypass_marker::{BypassMarkerLayer, InvalidName, NonJsonBodies, Role};

/// `bypass-marker`: removes router-internal annotation frames (such as Dynamo's
/// `event: x-bypass-remote-prefill`) from event streams unless the client opted in.
#[derive(Debug, Clone, Parser)]
#[command(name = "bypass-marker", version)]
#[command(propagate_version = true)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
    /// The format of the log lines on stderr (RUST_LOG sets the levels; default info).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value_t = LogFormat::Text,
        env = "BYPASS_MARKER_LOG_FORMAT"
    )]
    pub log_format: LogFormat,
}

impl Cli {
    /// Parses the process's command line; prints the help, the version or a usage error and
    /// exits (code 2 for a usage error) as clap does. An invalid annotation name is a usage error
    /// too (see [`Cli::try_from_args`]).
    pub fn from_env() -> Self {
        Self::try_from_args(std::env::args_os()).unwrap_or_else(|err| err.exit())
    }

    /// Parses `args` (the program's name first) as the binary does: clap's errors, and an invalid
    /// annotation name as a usage error of its subcommand (with that subcommand's usage), naming
    /// the environment variable it came from, if it came from one.
    pub fn try_from_args<I, S>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let mut command = Self::command();
        let argv: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
        let matches = command
            .try_get_matches_from_mut(argv.iter().cloned())
            .map_err(|err| name_the_variable(&command, &argv, err))?;
        let cli = Self::from_arg_matches(&matches).map_err(|err| err.format(&mut command))?;
        let checked = match &cli.command {
            Command::Proxy(args) => args.layer().map(drop),
            Command::ExtProc(args) => args.naming.layer().map(drop),
        };
        let Err(err) = checked else {
            return Ok(cli);
        };
        let (name, sub) = matches.subcommand().expect("a subcommand is required");
        let message = match sub.value_source(err.id) {
            Some(clap::parser::ValueSource::EnvVariable) => format!(
                "{} {:?} (for {}): {}",
                err.variable(),
                err.source.name(),
                err.flag,
                err.source
            ),
            _ => err.to_string(),
        };
        // Built, so that the subcommand's usage reads `bypass-marker proxy ...`.
        command.build();
        let sub = command
            .find_subcommand_mut(name)
            .expect("the subcommand that was parsed");
        Err(sub.error(clap::error::ErrorKind::ValueValidation, message))
    }
}

/// `err`, a clap error about a value, naming the environment variable that value came from when
/// it came from one (the flag is not on `argv` and its variable is set): clap's own message names
/// the flag, which the operator may never have written.
fn name_the_variable(
    command: &clap::Command,
    argv: &[std::ffi::OsString],
    err: clap::Error,
) -> clap::Error {
    use clap::error::ErrorKind;
    if !matches!(
        err.kind(),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue
    ) {
        return err;
    }
    let rendered = err.render().to_string();
    // The subcommand's flags (the first word that names one) and the global ones.
    let sub = argv
        .iter()
        .skip(1)
        .filter_map(|word| word.to_str())
        .find_map(|word| command.find_subcommand(word));
    let args = command
        .get_arguments()
        .chain(sub.into_iter().flat_map(clap::Command::get_arguments));
    for arg in args {
        let (Some(long), Some(variable)) = (arg.get_long(), arg.get_env()) else {
            continue;
        };
        let shown = format!("'{arg}'");
        if !rendered.contains(&shown) {
            continue;
        }
        let flag = format!("--{long}");
        let on_the_command_line = argv.iter().skip(1).any(|word| {
            word.to_str().is_some_and(|word| {
                word == flag
                    || word
                        .strip_prefix(flag.as_str())
                        .is_some_and(|r| r.starts_with('='))
            })
        });
        if on_the_command_line || std::env::var_os(variable).is_none() {
            return err;
        }
        let variable = variable.to_string_lossy();
        let message = rendered.replacen(&shown, &format!("{variable} ({arg})"), 1);
        let message = message.strip_prefix("error: ").unwrap_or(&message);
        return clap::Error::raw(err.kind(), message);
    }
    err
}

/// The subcommands. Each is a variant holding its own `#[derive(Args)]` struct; the naming flags
/// they share are [`NamingArgs`], flattened into each.
#[derive(Debug, Clone, Subcommand)]
// Made once per process; boxing `ProxyArgs` would only make every match on it longer.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// A streaming reverse proxy for OpenAI-compatible servers (Dynamo, vLLM, SGLang, ...): the
    /// layer on the responses, the request guard on the requests.
    Proxy(ProxyArgs),
    /// An Envoy external processor (`envoy.service.ext_proc.v3`, plain gRPC over HTTP/2): the
    /// request guard on request bodies and the filter on response bodies, for the Envoy-based
    /// gateways (examples/envoy/ext-proc.yaml is a bootstrap to start from).
    ExtProc(ExtProcArgs),
}

impl Command {
    /// Parses `args`, the flags of `subcommand` (without the program and subcommand names), as
    /// the binary would (environment variables included), and checks the names: the error is the
    /// message the binary would print.
    fn from_args<I, S>(subcommand: &str, args: I) -> Result<Self, String>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let argv = ["bypass-marker".into(), subcommand.into()]
            .into_iter()
            .chain(args.into_iter().map(Into::into));
        let cli = Cli::try_from_args(argv).map_err(|err| err.to_string())?;
        Ok(cli.command)
    }
}

/// The preset a layer starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[non_exhaustive]
pub enum Preset {
    /// Dynamo 1.6.1's names: router-owned `x-bypass-remote-prefill` and `x-prefill-continue`,
    /// opt-in `request_id`, `formatted_prompt` and `token_ids`, never `llm_metrics` and
    /// `payload_usage`.
    Dynamo,
    /// The layer's default: `x-bypass-remote-prefill` only.
    None,
}

/// What the guard does with a request body whose content type is not JSON
/// ([`NonJsonBodies`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[non_exhaustive]
pub enum NonJson {
    /// Forward it unread (an upstream that parses only JSON content types, as Dynamo, never
    /// reads it).
    Forward,
    /// Read it; judge one that looks like JSON as a JSON body.
    Judge,
    /// Read it; refuse one that looks like JSON with 415.
    Refuse,
}

impl NonJson {
    fn bodies(self) -> NonJsonBodies {
        match self {
            Self::Forward => NonJsonBodies::Forward,
            Self::Judge => NonJsonBodies::Judge,
            Self::Refuse => NonJsonBodies::Refuse,
        }
    }
}

/// The log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[non_exhaustive]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// The flags that name annotations, shared by every subcommand that filters: they build the
/// [`BypassMarkerLayer`] (see [`NamingArgs::layer`]).
#[derive(Debug, Clone, Args)]
pub struct NamingArgs {
    /// The names the layer starts from.
    #[arg(long, value_enum, default_value_t = Preset::Dynamo, env = "BYPASS_MARKER_PRESET")]
    pub preset: Preset,
    /// Also remove NAME frames unless the client lists NAME in `nvext.annotations` (repeatable).
    #[arg(
        long = "opt-in",
        value_name = "NAME",
        value_delimiter = ',',
        env = "BYPASS_MARKER_OPT_IN"
    )]
    pub opt_in: Vec<String>,
    /// Another router-owned marker: removed unless the client opted in, stripped from requests in
    /// every form (repeatable).
    #[arg(
        long = "router-owned",
        value_name = "NAME",
        value_delimiter = ',',
        env = "BYPASS_MARKER_ROUTER_OWNED"
    )]
    pub router_owned: Vec<String>,
    /// Always remove NAME frames, even when asked for (repeatable).
    #[arg(
        long = "never-forward",
        value_name = "NAME",
        value_delimiter = ',',
        env = "BYPASS_MARKER_NEVER_FORWARD"
    )]
    pub never_forward: Vec<String>,
    /// Also remove every frame with fields but no `data` line. Its variable takes true/false,
    /// 1/0, yes/no, on/off, in any case.
    #[arg(long, env = "BYPASS_MARKER_SDK_SAFE", value_parser = BoolishValueParser::new())]
    pub sdk_safe: bool,
    /// What the guard does with a request body whose content type is not JSON: forward it unread,
    /// or read it and judge (`judge`) or refuse with 415 (`refuse`) one that looks like JSON.
    #[arg(long, value_enum, value_name = "WHAT", default_value_t = NonJson::Forward, env = "BYPASS_MARKER_NON_JSON_BODIES")]
    pub non_json_bodies: NonJson,
    /// Largest JSON request body the guard reads; larger ones get a 413 (default 32 MiB: a chat
    /// request with a 20 MB image, base64-encoded, fits).
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES, env = "BYPASS_MARKER_MAX_BODY")]
    pub max_body: usize,
    /// Most request body bytes the guard holds at once, summed over every request of the
    /// process; a request whose body would take the total past it gets a 503 with `Retry-After`
    /// (the processor's is Envoy's local reply) before more of it is read. Default: half the memory
    /// limit of the process's cgroup (memory.max, or memory.limit_in_bytes on cgroup v1), else
    /// 1 GiB.
    #[arg(long, value_name = "BYTES", env = "BYPASS_MARKER_MAX_BUFFERED_BYTES")]
    pub max_buffered_bytes: Option<u64>,
}

/// A name given to a naming flag that the layer refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameError {
    flag: &'static str,
    /// The flag's argument id (its field's name).
    id: &'static str,
    source: InvalidName,
}

impl NameError {
    /// The flag that gave the name (`--opt-in`, `--router-owned`, `--never-forward`).
    pub fn flag(&self) -> &str {
        self.flag
    }

    /// The environment variable of that flag (`BYPASS_MARKER_OPT_IN`, ...).
    pub fn variable(&self) -> String {
        format!(
            "BYPASS_MARKER_{}",
            self.flag
                .trim_start_matches('-')
                .replace('-', "_")
                .to_ascii_uppercase()
        )
    }
}

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}: {}", self.flag, self.source.name(), self.source)
    }
}

impl std::error::Error for NameError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

impl NamingArgs {
    /// The response layer these flags describe: the preset, then every added name in order, then
    /// `--sdk-safe`. An invalid name is an error naming its flag (never a panic).
    pub fn layer(&self) -> Result<BypassMarkerLayer, NameError> {
        let mut layer = match self.preset {
            Preset::Dynamo => BypassMarkerLayer::dynamo(),
            Preset::None => BypassMarkerLayer::new(),
        };
        let err = |flag, id| move |source| NameError { flag, id, source };
        for name in &self.opt_in {
            layer = layer.try_opt_in(name).map_err(err("--opt-in", "opt_in"))?;
        }
        for name in &self.router_owned {
            layer = layer
                .try_router_owned(name)
                .map_err(err("--router-owned", "router_owned"))?;
        }
        for name in &self.never_forward {
            layer = layer
                .try_never_forward(name)
                .map_err(err("--never-forward", "never_forward"))?;
        }
        Ok(layer
            .sdk_safe(self.sdk_safe)
            .non_json_bodies(self.non_json_bodies.bodies()))
    }

    /// The names in force, by what happens to their frames: the line the binary logs at start,
    /// so that a misspelled (but valid) name shows.
    pub fn names_in_force(&self) -> Result<String, NameError> {
        let layer = self.layer()?;
        let list = |role: Role| {
            let names: Vec<&str> = layer
                .names()
                .filter(|n| layer.role(n) == Some(role))
                .collect();
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        };
        Ok(format!(
            "router-owned (removed unless the client opts in, stripped from requests): {}; \
             removed unless the client opts in: {}; never forwarded: {}; frames with no data \
             line (--sdk-safe): {}",
            list(Role::RouterOwned),
            list(Role::OptIn),
            list(Role::NeverForward),
            if self.sdk_safe { "removed" } else { "kept" },
        ))
    }

    /// `--max-buffered-bytes`, or its default for this process ([`default_max_buffered_bytes`]
    /// of its cgroup's memory limit).
    pub fn buffered_budget(&self) -> u64 {
        self.max_buffered_bytes
            .unwrap_or_else(|| default_max_buffered_bytes(cgroup_memory_limit()))
    }
}

/// The budget when the process has no cgroup memory limit: 32 bodies of the default
/// `--max-body`.
pub const FIXED_MAX_BUFFERED_BYTES: u64 = 1 << 30;

/// The default of `--max-buffered-bytes` under a cgroup memory limit of `limit` bytes (`None`:
/// no limit): half of it. The guard copies a body once more when it has all of it (into one
/// buffer, for the decision), for a moment, on the thread that serves it; the other half is for
/// that copy and for everything else the process holds (connection buffers, response frames,
/// the runtime), so that a full budget does not get the process OOM-killed.
pub fn default_max_buffered_bytes(limit: Option<u64>) -> u64 {
    limit.map_or(FIXED_MAX_BUFFERED_BYTES, |limit| limit / 2)
}

/// The memory limit of the cgroup this process runs in, or of the nearest ancestor that has one
/// (cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`); `None` when there is none (or no
/// cgroup file system).
pub fn cgroup_memory_limit() -> Option<u64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_limit_in(std::path::Path::new("/sys/fs/cgroup"), &cgroups)
}

/// [`cgroup_memory_limit`] for the cgroup file system mounted at `root` and the process's
/// `/proc/self/cgroup` text.
pub fn cgroup_limit_in(root: &std::path::Path, proc_cgroup: &str) -> Option<u64> {
    // v2: "0::/path"; v1: "N:memory:/path" (the memory controller, perhaps with others).
    let (dir, file, path) = proc_cgroup.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.is_empty() {
            Some((root.to_path_buf(), "memory.max", path))
        } else if controllers.split(',').any(|c| c == "memory") {
            Some((root.join("memory"), "memory.limit_in_bytes", path))
        } else {
            None
        }
    })?;
    // The cgroup and its ancestors, as far as they are visible (in a container with its own
    // cgroup namespace, the path is "/" and the container's cgroup is the root).
    let mut limit: Option<u64> = None;
    let mut at = std::path::PathBuf::from(path.trim().trim_start_matches('/'));
    loop {
        let read = std::fs::read_to_string(dir.join(&at).join(file)).ok();
        // "max" (v2), or a v1 figure near 2^63 for none.
        if let Some(n) = read.and_then(|v| v.trim().parse::<u64>().ok()) {
            if n < 1 << 60 {
                limit = Some(limit.map_or(n, |l| l.min(n)));
            }
        }
        if !at.pop() {
            break;
        }
    }
    limit
}

/// The flags of `bypass-marker proxy`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "\
SECS may have a fraction (0.5). Errors are JSON in OpenAI's shape:
{\"error\":{\"message\":...,\"type\":...,\"code\":...}}, 502 when the upstream is unreachable or fails
before its response head, 504 when the head is late, 503 (with Retry-After) when a JSON body would
take the bodies held past --max-buffered-bytes.")]
pub struct ProxyArgs {
    /// The server to forward to, http://HOST:PORT[/PREFIX].
    #[arg(long, value_name = "URL", value_parser = UpstreamParser, env = "BYPASS_MARKER_UPSTREAM")]
    pub upstream: Upstream,
    /// Address to listen on (port 0 picks a free one).
    #[arg(
        long,
        value_name = "ADDR",
        default_value = "127.0.0.1:3000",
        env = "BYPASS_MARKER_LISTEN"
    )]
    pub listen: SocketAddr,
    /// The names to filter.
    #[command(flatten)]
    pub naming: NamingArgs,
    /// Forward everything untouched (no guard, no filter): the control. Its variable takes
    /// true/false, 1/0, yes/no, on/off, in any case.
    #[arg(long, env = "BYPASS_MARKER_NO_LAYER", value_parser = BoolishValueParser::new())]
    pub no_layer: bool,
    /// Serve Prometheus metrics at GET /metrics, and the probes /livez and /readyz, on this
    /// address (off by default); it answers until the process exits, through the drain.
    #[arg(long, value_name = "ADDR", env = "BYPASS_MARKER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Listen backlog (the kernel caps it at somaxconn).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1024,
        env = "BYPASS_MARKER_BACKLOG"
    )]
    pub backlog: u32,
    /// Time from a request head's first byte to its end.
    #[arg(long, value_name = "SECS", value_parser = secs, default_value = "10", env = "BYPASS_MARKER_HEADER_READ_TIMEOUT")]
    pub header_read_timeout: Duration,
    /// How long a keep-alive connection may wait for its next request.
    #[arg(long, value_name = "SECS", value_parser = secs, default_value = "60", env = "BYPASS_MARKER_IDLE_TIMEOUT")]
    pub idle_timeout: Duration,
    /// Longest pause within a request body before a 408.
    #[arg(long, value_name = "SECS", value_parser = secs, default_value = "30", env = "BYPASS_MARKER_BODY_TIMEOUT")]
    pub body_timeout: Duration,
    /// Longest a write to a client may make no progress (the client stopped reading) before its
    /// connection is reset (its unread bytes dropped) and its upstream request cancelled.
    #[arg(long, value_name = "SECS", value_parser = secs, default_value = "30", env = "BYPASS_MARKER_WRITE_TIMEOUT")]
    pub write_timeout: Duration,
    /// Most client connections held at once; more wait in the listen backlog. Each may hold an
    /// upstream connection too, so the default is half of what the open-file limit
    /// (RLIMIT_NOFILE) leaves once 32 descriptors and 2 per thread are kept for the process
    /// itself, (limit - 32 - 2 x threads) / 2: 9983 for 20000 and one thread. Running out of
    /// descriptors cannot then refuse an accepted request its upstream connection.
    #[arg(long, value_name = "N", env = "BYPASS_MARKER_MAX_CONNECTIONS")]
    pub max_connections: Option<NonZeroUsize>,
    /// Time to connect to the upstream.
    #[arg(long, value_name = "SECS", value_parser = secs, default_value = "5", env = "BYPASS_MARKER_CONNECT_TIMEOUT")]
    pub connect_timeout: Duration,
    /// Time from the request's last byte sent to the upstream's response head, 504 after it (a
    /// non-streamed completion sends its head only when it is done); also the longest the
    /// upstream may take no byte of a request being sent. A slow upload that keeps moving is
    /// never cut by it.
    #[arg(long, value_name = "SECS", value_parser = secs, default_value = "600", env = "BYPASS_MARKER_RESPONSE_TIMEOUT")]
    pub response_timeout: Duration,
    /// Longest pause between two reads of an upstream's response body (0: none): past it the
    /// client's response ends as a cut stream and the upstream connection is closed.
    #[arg(long, value_name = "SECS", value_parser = secs_or_none, default_value = "300", env = "BYPASS_MARKER_UPSTREAM_IDLE_TIMEOUT")]
    pub upstream_idle_timeout: Duration,
    /// After Ctrl-C or SIGTERM, how long requests in flight may finish; those still in flight
    /// then are cut, counted, and the exit code is 3.
    #[arg(long, value_name = "SECS", value_parser = secs, default_value = "30", env = "BYPASS_MARKER_SHUTDOWN_GRACE")]
    pub shutdown_grace: Duration,
    /// Threads that serve connections, each accepting from the one listener on `--listen` (the
    /// address is this process's alone: a second proxy on it fails to start) with its own
    /// upstream connections, so a stream stays on one thread. 1 (the default) costs the least
    /// CPU per event: on a 2-core machine shared with the upstream, a fifth less in bulk and a
    /// third less paced than two threads, at the same throughput (BENCHMARKS.md as of 57eacbb);
    /// one thread forwards several hundred thousand events a second. Give more to a proxy that
    /// needs more than one core.
    #[arg(
        long,
        value_name = "N",
        default_value = "1",
        env = "BYPASS_MARKER_THREADS"
    )]
    pub threads: NonZeroUsize,
    /// Microseconds a serving thread waits before it sleeps on its sockets once a read found an
    /// upstream writing events faster than the thread reads them (several chunks in a read that
    /// emptied the socket); 0: never, at most 1000. The reads after the wait bring many events
    /// each, for less CPU per event. Events that each arrive alone never make it wait.
    #[arg(long, value_name = "MICROS", value_parser = micros, default_value = "50", env = "BYPASS_MARKER_READ_COALESCE")]
    pub read_coalesce: Duration,
}

impl ProxyArgs {
    /// Parses the flags of `bypass-marker proxy` (without the program and subcommand names), as
    /// the binary would (environment variables included), and checks the names.
    pub fn from_args<I, S>(args: I) -> Result<Self, String>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let Command::Proxy(args) = Command::from_args("proxy", args)? else {
            unreachable!("parsed as the proxy subcommand")
        };
        Ok(args)
    }

    /// The response layer, or `None` with `--no-layer`.
    pub fn layer(&self) -> Result<Option<BypassMarkerLayer>, NameError> {
        if self.no_layer {
            return Ok(None);
        }
        self.naming.layer().map(Some)
    }
}

/// The flags of `bypass-marker ext-proc`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Envoy's ext_proc filter must send request headers and the buffered request body, and response
headers and the streamed response body, with allow_mode_override: true and failure_mode_allow:
false (see examples/envoy/ext-proc.yaml). gRPC health (grpc.health.v1) is served on the same
address.")]
pub struct ExtProcArgs {
    /// Address to listen on for Envoy's gRPC connections (port 0 picks a free one).
    #[arg(
        long,
        value_name = "ADDR",
        default_value = "127.0.0.1:50051",
        env = "BYPASS_MARKER_LISTEN"
    )]
    pub listen: SocketAddr,
    /// The names to filter.
    #[command(flatten)]
    pub naming: NamingArgs,
    /// Serve Prometheus metrics at GET /metrics on this address (off by default).
    #[arg(long, value_name = "ADDR", env = "BYPASS_MARKER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// After Ctrl-C or SIGTERM, how long the streams in flight may finish before they are cut.
    #[arg(long, value_name = "SECS", value_parser = secs, default_value = "30", env = "BYPASS_MARKER_SHUTDOWN_GRACE")]
    pub shutdown_grace: Duration,
    /// Threads that serve Envoy's streams. 1 (the default) runs everything on one thread: a
    /// message is read, processed and answered with no cross-thread wake-up, which costs the
    /// least CPU per message (about a third less per paced event than two worker threads:
    /// BENCHMARKS.md as of 57eacbb). More threads spread the work over more cores, for a processor that needs
    /// more than one, or so that a large request body under the guard (a 32 MiB one takes 10 to
    /// 50 ms) delays fewer of the other streams.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        env = "BYPASS_MARKER_THREADS",
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    pub threads: u16,
}

impl ExtProcArgs {
    /// Parses the flags of `bypass-marker ext-proc` (without the program and subcommand names),
    /// as the binary would (environment variables included), and checks the names.
    pub fn from_args<I, S>(args: I) -> Result<Self, String>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let Command::ExtProc(args) = Command::from_args("ext-proc", args)? else {
            unreachable!("parsed as the ext-proc subcommand")
        };
        Ok(args)
    }
}

/// Where requests go: `http://authority` plus an optional path prefix.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub(crate) authority: Authority,
    pub(crate) host: HeaderValue,
    pub(crate) prefix: String,
}

impl Upstream {
    /// Parses `http://HOST:PORT[/PREFIX]`.
    pub fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url.parse().map_err(|err| format!("{err}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(
                    "https is not supported; run the proxy next to the server and \
                            forward over http"
                        .to_owned(),
                )
            }
            _ => return Err("the upstream must start with http://".to_owned()),
        }
        let authority = uri.authority().cloned().ok_or("the upstream has no host")?;
        if authority.as_str().contains('@') {
            // Not echoed: the value holds a secret.
            return Err(
                "the upstream must not carry credentials (user:password@): they would \
                        be sent upstream in the Host header and shown in logs; give the proxy a \
                        network path to the upstream that needs none"
                    .to_owned(),
            );
        }
        if uri.query().is_some() {
            return Err("the upstream must not have a query".to_owned());
        }
        if authority.host().is_empty() {
            return Err("the upstream has no host".to_owned());
        }
        // The `http` crate takes any digits after the host; a connection needs 1 to 65535.
        if let Some(port) = authority.as_str()[authority.host().len()..].strip_prefix(':') {
            if !matches!(port.parse::<u16>(), Ok(1..)) {
                return Err(format!("port {port:?} is not a TCP port (1 to 65535)"));
            }
        }
        let host = HeaderValue::from_str(authority.as_str()).map_err(|err| format!("{err}"))?;
        let prefix = uri.path().trim_end_matches('/').to_owned();
        Ok(Self {
            authority,
            host,
            prefix,
        })
    }

    pub(crate) fn uri(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme("http")
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.prefix, path_and_query))
            .build()
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.prefix)
    }
}

/// Parses `--upstream` with [`Upstream::parse`], as clap's own parsers would, except that a
/// value with credentials in it is not repeated in the error.
#[derive(Debug, Clone, Copy)]
struct UpstreamParser;

impl clap::builder::TypedValueParser for UpstreamParser {
    type Value = Upstream;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Upstream, clap::Error> {
        let arg = arg.map_or_else(|| "--upstream <URL>".to_owned(), ToString::to_string);
        let value = value.to_string_lossy();
        Upstream::parse(&value).map_err(|why| {
            let message = if value.contains('@') {
                format!("invalid value for '{arg}': {why}")
            } else {
                format!("invalid value '{value}' for '{arg}': {why}")
            };
            clap::Error::raw(clap::error::ErrorKind::ValueValidation, message + "\n").with_cmd(cmd)
        })
    }
}

/// A positive number of seconds, with a fraction allowed.
fn secs(value: &str) -> Result<Duration, String> {
    let secs: f64 = value.parse().map_err(|err| format!("{err}"))?;
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err("a positive number of seconds".to_owned()),
    }
}

/// A whole number of microseconds up to 1000 (`--read-coalesce`).
fn micros(value: &str) -> Result<Duration, String> {
    match value.parse::<u64>() {
        Ok(n) if n <= 1000 => Ok(Duration::from_micros(n)),
        _ => Err("a whole number of microseconds from 0 to 1000".to_owned()),
    }
}

/// [`secs`], or `0` for no limit (`Duration::ZERO`).
fn secs_or_none(value: &str) -> Result<Duration, String> {
    match value.parse::<f64>() {
        Ok(0.0) => Ok(Duration::ZERO),
        _ => secs(value).map_err(|_| "a positive number of seconds, or 0 for none".to_owned()),
    }
}

/// The most permits a semaphore takes: the cap when the open-file limit is unlimited.
const UNLIMITED: usize = tokio::sync::Semaphore::MAX_PERMITS;

/// The default of `--max-connections` for `threads` serving threads under a soft open-file limit
/// of `open_files` (`None`: unlimited): each client connection may hold an upstream connection
/// too, so half of what is left once 32 descriptors, and 2 per thread, are kept for the process
/// itself (standard streams, runtimes, listeners, metrics). At least 1.
pub fn default_max_connections(open_files: Option<u64>, threads: usize) -> usize {
    let Some(open_files) = open_files else {
        return UNLIMITED;
    };
    let own = 32 + 2 * threads as u64;
    usize::try_from(open_files.saturating_sub(own) / 2)
        .unwrap_or(UNLIMITED)
        .clamp(1, UNLIMITED)
}

/// The process's soft open-file limit (`RLIMIT_NOFILE`); `None` when unlimited or unknown.
fn open_file_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        rustix::process::getrlimit(rustix::process::Resource::Nofile).current
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// `--max-connections`, or its default for `threads` threads and this process's open-file limit.
pub(crate) fn max_connections(config: &ProxyArgs, threads: usize) -> usize {
    config.max_connections.map_or_else(
        || default_max_connections(open_file_limit(), threads),
        |n| n.get().min(UNLIMITED),
    )
}
