//! `bypass-marker ext-proc`: the Envoy external processor with the binary's metrics.

use std::future::Future;
use std::io;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::cli::{ExtProcArgs, Listen, Metrics, NameError};
use crate::envoy::{self, ExtProc};

/// The metrics `args` count in: a frame series per configured name.
pub fn metrics_for(args: &ExtProcArgs) -> Result<Arc<Metrics>, NameError> {
    let layer = args.naming.layer()?;
    Ok(Arc::new(Metrics::new(layer.names(), args.naming.sdk_safe)))
}

/// A bound listener for the processor: TCP, or a Unix domain socket (`--listen unix:PATH`).
#[derive(Debug)]
pub enum Listener {
    /// A TCP listener.
    Tcp(TcpListener),
    /// A Unix domain socket listener.
    #[cfg(unix)]
    Unix(tokio::net::UnixListener),
}

impl Listener {
    /// Binds `listen`. For `unix:PATH`, a socket file left at PATH by a process that is gone is
    /// removed first (a path that is not a socket is an error, as is a socket still in use).
    pub async fn bind(listen: &Listen) -> io::Result<Self> {
        match listen {
            Listen::Tcp(addr) => TcpListener::bind(addr).await.map(Self::Tcp),
            #[cfg(unix)]
            Listen::Unix(path) => {
                use std::os::unix::fs::FileTypeExt as _;
                if let Ok(meta) = std::fs::symlink_metadata(path) {
                    if !meta.file_type().is_socket() {
                        return Err(io::Error::new(
                            io::ErrorKind::AlreadyExists,
                            "the path exists and is not a socket",
                        ));
                    }
                    if std::os::unix::net::UnixStream::connect(path).is_ok() {
                        return Err(io::Error::new(
                            io::ErrorKind::AddrInUse,
                            "another process listens on this socket",
                        ));
                    }
                    std::fs::remove_file(path)?;
                }
                tokio::net::UnixListener::bind(path).map(Self::Unix)
            }
            #[cfg(not(unix))]
            Listen::Unix(_) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "Unix domain sockets need a Unix system",
            )),
        }
    }

    /// The address it listens on (with the port a `:0` address got).
    pub fn local_addr(&self) -> io::Result<Listen> {
        match self {
            Self::Tcp(listener) => listener.local_addr().map(Listen::Tcp),
            #[cfg(unix)]
            Self::Unix(listener) => {
                let addr = listener.local_addr()?;
                let path = addr.as_pathname().ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, "an unnamed Unix socket")
                })?;
                Ok(Listen::Unix(path.to_owned()))
            }
        }
    }
}

impl From<TcpListener> for Listener {
    fn from(listener: TcpListener) -> Self {
        Self::Tcp(listener)
    }
}

/// Serves the processor that `args` describe on `listener`, counting removed and forwarded frames
/// in `metrics`, until `shutdown` completes; then stops gracefully (see [`envoy::serve`]).
pub async fn serve<F>(
    listener: impl Into<Listener>,
    args: &ExtProcArgs,
    metrics: Arc<Metrics>,
    shutdown: F,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    F: Future<Output = ()> + Send,
{
    let layer = args.naming.layer()?.observe(metrics);
    let processor = ExtProc::new(layer).max_body_bytes(args.naming.max_body);
    match listener.into() {
        Listener::Tcp(listener) => envoy::serve(listener, processor, shutdown).await?,
        #[cfg(unix)]
        Listener::Unix(listener) => envoy::serve_unix(listener, processor, shutdown).await?,
    }
    Ok(())
}
