//! `bypass-marker`: the sidecar proxy and the Envoy external processor of `tower-bypass-marker`.
//!
//! Parses the command line, sets up logs, binds, waits for Ctrl-C or SIGTERM and picks the exit
//! code: 0 after a clean stop, 2 for a usage error (clap's, or an invalid annotation name), 1 when
//! it cannot serve, 3 when `--shutdown-grace` ran out and requests in flight were cut. Everything
//! it serves is in `bypass_marker`.
//!
//! Nothing here panics on a closed or broken stdout or stderr: every line is written with its
//! error ignored (no `println!` or `eprintln!`), and the log subscriber drops lines it cannot
//! write.

use std::process::ExitCode;
use std::sync::Arc;

use bypass_marker::{self as cli, Cli, Command, ExtProcArgs, Metrics, NameError, ProxyArgs};
use clap::CommandFactory as _;
use tokio::sync::watch;

/// Writes a line on stderr, ignoring a stderr that is closed or whose reader has gone
/// (`eprintln!` would panic there).
macro_rules! complain {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// The exit code after a stop whose `--shutdown-grace` ran out with requests still in flight.
const CUT: u8 = 3;

fn main() -> ExitCode {
    // Invalid annotation names are usage errors here too (exit code 2).
    let cli = Cli::from_env();
    if let Err(err) = cli::logs::init(cli.log_format) {
        complain!("bypass-marker: cannot set up logs (RUST_LOG?): {err}");
        return ExitCode::from(2);
    }
    // The proxy serves on threads of its own (`--threads`), each with a single-threaded runtime;
    // this thread's runs the signals and the metrics. The processor serves on this runtime, with
    // `--threads` workers (one by default: each message is answered on the thread that read it,
    // with no cross-thread wake-up).
    let runtime = match &cli.command {
        Command::Proxy(_) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        Command::ExtProc(args) if args.threads == 1 => {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        }
        Command::ExtProc(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(usize::from(args.threads))
            .enable_all()
            .build(),
    };
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(err) => {
            complain!("bypass-marker: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::Proxy(args) => runtime.block_on(proxy(args)),
        Command::ExtProc(args) => runtime.block_on(ext_proc(args)),
    }
}

async fn ext_proc(args: ExtProcArgs) -> ExitCode {
    let metrics = cli::ext_proc::metrics_for(&args).unwrap_or_else(|err| usage_error(err));
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(listener) => listener,
        Err(err) => {
            complain!("bypass-marker: cannot listen on {}: {err}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let addr = listener.local_addr().unwrap_or(args.listen);
    let (stop, stopped) = watch::channel(false);
    let metrics_server = match serve_metrics(args.metrics_listen, &metrics) {
        Ok(server) => server,
        Err(code) => return code,
    };
    if let Ok(names) = args.naming.names_in_force() {
        tracing::info!("names in force: {names}");
    }
    if let Err(code) = stop_on_signal(stop, metrics.clone()) {
        return code;
    }
    say(format_args!("ext_proc listening on {addr} (gRPC)"));
    let served =
        cli::ext_proc::serve(listener, &args, metrics.clone(), until_stopped(stopped)).await;
    stopped_with(served, &metrics, metrics_server).await
}

/// The exit code once serving has returned (the drain included), after the metrics server, which
/// answers the probes through the drain, has stopped too.
async fn stopped_with<E: std::fmt::Display>(
    served: Result<(), E>,
    metrics: &Metrics,
    metrics_server: Option<(watch::Sender<bool>, tokio::task::JoinHandle<()>)>,
) -> ExitCode {
    if let Some((stop, server)) = metrics_server {
        let _ = stop.send(true);
        let _ = server.await;
    }
    let cut = metrics.shutdown_streams_cut();
    match served {
        Ok(()) if cut > 0 => {
            tracing::warn!(
                streams_cut = cut,
                "stopped: {cut} request(s) cut when --shutdown-grace ran out (exit code {CUT})"
            );
            ExitCode::from(CUT)
        }
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(err) => {
            complain!("bypass-marker: {err}");
            ExitCode::FAILURE
        }
    }
}

/// An invalid annotation name, reported as clap reports its own usage errors: the message and
/// the usage on stderr, then exit code 2.
fn usage_error(err: NameError) -> ! {
    Cli::command()
        .error(clap::error::ErrorKind::ValueValidation, err)
        .exit()
}

/// Sends `true` on `stop` at Ctrl-C or SIGTERM, and marks `metrics` as draining (`/readyz` then
/// answers 503), with the handlers installed before it returns; the exit code when they cannot be.
fn stop_on_signal(stop: watch::Sender<bool>, metrics: Arc<Metrics>) -> Result<(), ExitCode> {
    let signalled = match shutdown_signal() {
        Ok(signalled) => signalled,
        Err(err) => {
            complain!("bypass-marker: cannot handle signals: {err}");
            return Err(ExitCode::FAILURE);
        }
    };
    tokio::spawn(async move {
        signalled.await;
        metrics.drain();
        let _ = stop.send(true);
    });
    Ok(())
}

/// Completes once `stop` has been sent `true`.
async fn until_stopped(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

/// Starts the metrics server (with the probes) on `addr`, if one was asked for: it runs until
/// `true` is sent on the sender returned with it, after the drain.
#[allow(clippy::type_complexity)]
fn serve_metrics(
    addr: Option<std::net::SocketAddr>,
    metrics: &Arc<Metrics>,
) -> Result<Option<(watch::Sender<bool>, tokio::task::JoinHandle<()>)>, ExitCode> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    match cli::bind(addr, 128) {
        Ok(listener) => {
            let local = listener.local_addr().unwrap_or(addr);
            say(format_args!("metrics on http://{local}/metrics"));
            let (stop, stopped) = watch::channel(false);
            let server = tokio::spawn(cli::metrics::serve_metrics(
                listener,
                Arc::clone(metrics),
                until_stopped(stopped),
            ));
            Ok(Some((stop, server)))
        }
        Err(err) => {
            complain!("bypass-marker: cannot listen on {addr} for metrics: {err}");
            Err(ExitCode::FAILURE)
        }
    }
}

async fn proxy(args: ProxyArgs) -> ExitCode {
    let metrics = cli::proxy::metrics_for(&args).unwrap_or_else(|err| usage_error(err));
    let threads = args.threads.get();
    let listeners = match cli::bind_each(args.listen, args.backlog, threads) {
        Ok(listeners) => listeners,
        Err(err) => {
            complain!("bypass-marker: cannot listen on {}: {err}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let addr = match listeners[0].local_addr() {
        Ok(addr) => addr,
        Err(err) => {
            complain!("bypass-marker: {err}");
            return ExitCode::FAILURE;
        }
    };
    let (stop, stopped) = watch::channel(false);
    let metrics_server = match serve_metrics(args.metrics_listen, &metrics) {
        Ok(server) => server,
        Err(code) => return code,
    };
    match args.naming.names_in_force() {
        Ok(names) if !args.no_layer => {
            tracing::info!(upstream = %args.upstream, "names in force: {names}");
        }
        _ => tracing::info!(upstream = %args.upstream, "--no-layer: forwarding untouched"),
    }
    if let Err(code) = stop_on_signal(stop, metrics.clone()) {
        return code;
    }
    let plural = if threads == 1 { "" } else { "s" };
    tracing::info!("serving on {threads} thread{plural}");
    say(format_args!("listening on http://{addr}"));
    let served = cli::serve_threads(listeners, args, metrics.clone(), || {
        until_stopped(stopped.clone())
    })
    .await;
    stopped_with(served, &metrics, metrics_server).await
}

/// Prints `line` on stdout, where scripts read the addresses; a stdout that is closed or full
/// (`bypass-marker proxy ... | head -1`) is not an error: a serving process never stops for it
/// (`println!` would panic).
fn say(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}").and_then(|()| stdout.flush());
}

/// A future that completes on Ctrl-C or SIGTERM. The handlers are installed before it returns,
/// so a signal that comes right after "listening on" is not lost (nor fatal).
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        Ok(async move {
            let why = tokio::select! {
                _ = interrupt.recv() => "Ctrl-C",
                _ = terminate.recv() => "SIGTERM",
            };
            tracing::info!("{why}: stopping; requests in flight may finish");
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("Ctrl-C: stopping; requests in flight may finish");
        })
    }
}
