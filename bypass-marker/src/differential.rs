//! Not part of the API: the way in to the sidecar's own upstream client for the differential test
//! that holds it to hyper's client (`tests/client_differential.rs` and the `client` fuzz target,
//! both through `fuzz/src/client.rs`). Hidden, and it may change with any release.

use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body_util::Empty;

use super::client;
use super::{Upstream, UpstreamResponseBody};

/// The sidecar's upstream client (`Client::new` and `Client::send` as the proxy calls them).
pub struct Client(client::Client);

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

impl Client {
    /// A client of `upstream`, with a 10 s connect timeout and up to 4 idle connections.
    pub fn new(upstream: Upstream) -> Self {
        Self(client::Client::new(upstream, Duration::from_secs(10), 4))
    }

    /// Sends `parts` without a body: the response, or why there is none (the error, with its
    /// source).
    pub async fn send(
        &self,
        parts: &http::request::Parts,
    ) -> Result<Response<UpstreamResponseBody>, String> {
        self.0
            .send(parts, Empty::<Bytes>::new())
            .await
            .map_err(|err| match std::error::Error::source(&err) {
                Some(source) => format!("{err}: {source}"),
                None => err.to_string(),
            })
    }
}
