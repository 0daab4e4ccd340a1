use std::future::Future;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

use super::ExtProc;

/// Serves `processor` and gRPC health (`grpc.health.v1`) on `listener` until `shutdown`
/// completes, then stops gracefully.
///
/// Health reports `SERVING` for the empty service name and for
/// `envoy.service.ext_proc.v3.ExternalProcessor` while the server runs. When `shutdown` completes
/// both turn `NOT_SERVING`, the listener stops accepting, open connections are told to go away
/// (HTTP/2 GOAWAY) and the function returns once the streams in flight have ended: requests that
/// Envoy already sent through the processor finish normally.
pub async fn serve(
    listener: TcpListener,
    processor: ExtProc,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    reporter
        .set_serving::<ExternalProcessorServer<ExtProc>>()
        .await;
    let signal = async move {
        shutdown.await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        reporter
            .set_not_serving::<ExternalProcessorServer<ExtProc>>()
            .await;
    };
    Server::builder()
        .add_service(health)
        .add_service(processor.into_service())
        .serve_with_incoming_shutdown(TcpIncoming::from(listener).with_nodelay(Some(true)), signal)
        .await
}
