//! A simulated disaggregated LLM router with an OpenAI-compatible API, served with
//! `BypassMarkerLayer` (or, with `--no-layer`, as Dynamo behaves without it).
//!
//! ```text
//! cargo run --release --example router -- --addr 127.0.0.1:3000
//! ```
//!
//! Point an OpenAI SDK at `http://127.0.0.1:3000/v1` and send the same streamed request twice:
//! the second is a prefix-cache hit, for which the router bypasses remote prefill and prepends
//! `event: x-bypass-remote-prefill\n: true\n\n` to the stream. Like Dynamo, the router also
//! prepends `event: request_id\n: "<id>"\n\n` (after the marker) to every stream. With the layer
//! a client receives each of these frames only if it lists its name (`x-bypass-remote-prefill`,
//! `request_id`) in `nvext.annotations`; without it (`--no-layer`) every streamed request breaks
//! the SDKs.

mod support;

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use tokio::net::TcpListener;

const USAGE: &str = "\
usage: router [--addr HOST:PORT] [--no-layer] [--compress inside|outside] [--shutdown-after SECS]

  --addr HOST:PORT       address to listen on (default 127.0.0.1:3000; port 0 picks a free port)
  --no-layer             serve the router without BypassMarkerLayer, as Dynamo behaves today
  --compress WHERE       add tower-http's CompressionLayer, event streams included, outside the
                         layer (after it, the documented order) or inside it (before it)
  --shutdown-after SECS  stop by itself after SECS seconds (default: run until Ctrl-C or SIGTERM)
  -h, --help             print this help";

struct Args {
    addr: SocketAddr,
    with_layer: bool,
    compression: support::router::Compression,
    shutdown_after: Option<Duration>,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut parsed = Args {
        addr: SocketAddr::from(([127, 0, 0, 1], 3000)),
        with_layer: true,
        compression: support::router::Compression::None,
        shutdown_after: None,
    };
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--no-layer" => parsed.with_layer = false,
            "--compress" => {
                parsed.compression = match value("--compress")?.as_str() {
                    "inside" => support::router::Compression::Inside,
                    "outside" => support::router::Compression::Outside,
                    other => {
                        return Err(format!("invalid --compress {other:?}: inside or outside"))
                    }
                }
            }
            "--addr" => {
                let addr = value("--addr")?;
                parsed.addr = addr
                    .parse()
                    .map_err(|err| format!("invalid --addr {addr:?}: {err}"))?;
            }
            "--shutdown-after" => {
                let secs = value("--shutdown-after")?;
                let secs: u64 = secs
                    .parse()
                    .map_err(|err| format!("invalid --shutdown-after {secs:?}: {err}"))?;
                parsed.shutdown_after = Some(Duration::from_secs(secs));
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Some(parsed))
}

/// Completes on Ctrl-C, on SIGTERM, or once `limit` has passed.
async fn shutdown_signal(limit: Option<Duration>) {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    let deadline = async {
        match limit {
            Some(limit) => tokio::time::sleep(limit).await,
            None => std::future::pending().await,
        }
    };
    let why = tokio::select! {
        () = ctrl_c => "Ctrl-C",
        () = terminate => "SIGTERM",
        () = deadline => "--shutdown-after elapsed",
    };
    eprintln!("{why}: shutting down");
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            // Ignore a closed stdout (`router --help | head -1`).
            let _ = writeln!(std::io::stdout(), "{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(err) => {
            eprintln!("router: {err}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let listener = match TcpListener::bind(args.addr).await {
        Ok(listener) => listener,
        Err(err) => {
            eprintln!("router: cannot listen on {}: {err}", args.addr);
            return ExitCode::FAILURE;
        }
    };
    let addr = match listener.local_addr() {
        Ok(addr) => addr,
        Err(err) => {
            eprintln!("router: {err}");
            return ExitCode::FAILURE;
        }
    };
    let router = support::router::SimRouter::with_compression(args.with_layer, args.compression);
    if args.with_layer {
        println!("simulated router with BypassMarkerLayer (opt in: nvext.annotations)");
    } else {
        println!("simulated router without BypassMarkerLayer (--no-layer): Dynamo as it is");
    }
    // The listener is bound, so connections are accepted from here on.
    println!("listening on http://{addr}");
    match support::router::serve(listener, router, shutdown_signal(args.shutdown_after)).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("router: {err}");
            ExitCode::FAILURE
        }
    }
}
