//! `bypass-marker ext-proc`: the Envoy external processor with the binary's metrics.

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::cli::{ExtProcArgs, Metrics, NameError};
use crate::envoy::{self, ExtProc};

/// The metrics `args` count in: a frame series per configured name.
pub fn metrics_for(args: &ExtProcArgs) -> Result<Arc<Metrics>, NameError> {
    let layer = args.naming.layer()?;
    Ok(Arc::new(Metrics::new(layer.names(), args.naming.sdk_safe)))
}

/// Serves the processor that `args` describe on `listener`, counting removed and forwarded frames
/// in `metrics`, until `shutdown` completes; then stops gracefully (see [`envoy::serve`]).
pub async fn serve<F>(
    listener: TcpListener,
    args: &ExtProcArgs,
    metrics: Arc<Metrics>,
    shutdown: F,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    F: Future<Output = ()> + Send,
{
    let layer = args.naming.layer()?.observe(metrics);
    let processor = ExtProc::new(layer).max_body_bytes(args.naming.max_body);
    envoy::serve(listener, processor, shutdown).await?;
    Ok(())
}
