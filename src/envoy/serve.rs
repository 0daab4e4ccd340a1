use std::future::Future;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::net::TcpListener;
use tonic::transport::server::{Connected, TcpIncoming};
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
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    serve_incoming(incoming, processor, shutdown).await
}

/// [`serve`] on a Unix domain socket: for a processor beside Envoy (the same host or pod), whose
/// cluster then has a `pipe` address. Each message costs less there than over loopback TCP.
///
/// The socket file is the caller's: this function neither creates nor removes it.
#[cfg(unix)]
pub async fn serve_unix(
    listener: tokio::net::UnixListener,
    processor: ExtProc,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_incoming(UnixIncoming(listener), processor, shutdown).await
}

async fn serve_incoming<I, IO, IE>(
    incoming: I,
    processor: ExtProc,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error>
where
    I: futures_core::Stream<Item = Result<IO, IE>>,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Connected + Unpin + Send + 'static,
    IO::ConnectInfo: Clone + Send + Sync + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
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
        .serve_with_incoming_shutdown(incoming, signal)
        .await
}

/// The connections a Unix listener accepts, as the stream tonic serves.
#[cfg(unix)]
struct UnixIncoming(tokio::net::UnixListener);

#[cfg(unix)]
impl futures_core::Stream for UnixIncoming {
    type Item = std::io::Result<tokio::net::UnixStream>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0
            .poll_accept(cx)
            .map(|accepted| Some(accepted.map(|(stream, _)| stream)))
    }
}
