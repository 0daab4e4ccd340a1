//! The connection a gRPC stream came on, as far as the processor's one log line goes: Envoy opens
//! a few HTTP/2 connections and sends every HTTP request as a stream on one of them, so a
//! misconfiguration that fails every stream is logged once per connection, not once per request.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tonic::transport::server::TcpConnectInfo;

/// One connection: its peer and whether the observability-mode error was logged for it.
///
/// [`serve`](super::serve) makes one for each connection it accepts (its `Connected::ConnectInfo`),
/// and tonic puts a clone into the extensions of every request on that connection. tonic puts only
/// this type there, not `TcpConnectInfo`: `tonic::Request::remote_addr` is `None` for the services
/// `serve` runs (its own two, and neither reads it); the peer address is kept here.
#[derive(Clone, Debug)]
pub(crate) struct Origin {
    peer: Option<SocketAddr>,
    logged: Arc<AtomicBool>,
}

impl Origin {
    /// A new connection, nothing logged for it yet.
    pub(crate) fn connection(peer: Option<SocketAddr>) -> Self {
        Self {
            peer,
            logged: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The origin of a stream whose request carries `extensions`: the connection's, under
    /// [`serve`](super::serve). In a tonic server of the embedder's own, there is nothing per
    /// connection to hold a flag: `fallback`, the processor's flag, stands in, so the line is
    /// logged once per processor (a flag per stream would log at the rate of requests, and a
    /// flag per peer address would need a table that grows with every connection Envoy opens).
    /// The peer is still named when the server put tonic's `TcpConnectInfo` there.
    pub(crate) fn of(extensions: &http::Extensions, fallback: &Arc<AtomicBool>) -> Self {
        if let Some(origin) = extensions.get::<Origin>() {
            return origin.clone();
        }
        Self {
            peer: extensions
                .get::<TcpConnectInfo>()
                .and_then(TcpConnectInfo::remote_addr),
            logged: Arc::clone(fallback),
        }
    }

    /// A stream failed because Envoy runs the filter in `observability_mode`: logs why, the first
    /// time only (an `error` line).
    pub(crate) fn observability_mode(&self) {
        if !self.logged.swap(true, Ordering::Relaxed) {
            tracing::error!(
                peer = self.peer.map(tracing::field::display),
                "observability_mode is on in Envoy's ext_proc filter config: Envoy forwards \
                 requests and responses without waiting for the processor, so router-owned names \
                 reach the upstream and annotations reach clients; every stream fails with \
                 FAILED_PRECONDITION: turn observability_mode off"
            );
        }
    }
}
