//! `bypass-marker ext-proc`: the Envoy external processor with the binary's metrics.

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::budget;
use crate::envoy::{self, ExtProc};
use crate::{ExtProcArgs, Metrics, NameError};

/// The metrics `args` count in: a frame series per configured name.
pub fn metrics_for(args: &ExtProcArgs) -> Result<Arc<Metrics>, NameError> {
    let layer = args.naming.layer()?;
    Ok(Arc::new(Metrics::frames_only(
        layer.names(),
        args.naming.sdk_safe,
    )))
}

/// Serves the processor that `args` describe on `listener`, counting removed and forwarded frames
/// in `metrics` (and timing its answers there, with `--metrics-listen`), until `shutdown` completes; then stops gracefully (see [`envoy::serve`]), giving
/// the streams in flight up to `args.shutdown_grace` before it cuts them and returns.
pub async fn serve<F>(
    listener: TcpListener,
    args: &ExtProcArgs,
    metrics: Arc<Metrics>,
    shutdown: F,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    F: Future<Output = ()> + Send,
{
    let budget = budget::BodyBudget::new(args.naming.buffered_budget());
    metrics.watch_budget(&budget);
    let layer = args.naming.layer()?.observe(metrics.clone());
    tracing::info!(
        "at most {} bytes of request bodies held at once (--max-buffered-bytes)",
        budget.limit()
    );
    let mut processor = ExtProc::new(layer)
        .max_body_bytes(args.naming.max_body)
        .body_budget(budget);
    // Timing costs a clock read and a lock per wake: only for metrics someone reads.
    if args.metrics_listen.is_some() {
        processor = processor.answer_times(metrics);
    }
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown.await;
        let _ = stopping.send(());
    };
    let grace = args.shutdown_grace;
    let cut = async move {
        if stopped.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        served = envoy::serve(listener, processor, shutdown) => served?,
        () = cut => tracing::warn!(
            "streams still in flight after the shutdown grace of {grace:?}: cut"
        ),
    }
    Ok(())
}
