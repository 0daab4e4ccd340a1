//! The idle connections to the upstream, kept for reuse and closed when they have waited too long.

use std::sync::{Mutex, Weak};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

/// An idle pooled connection is closed once it has waited this long: by the sweep
/// ([`Pool::sweep`]), which wakes when the oldest one's time is up, or when the pool is used.
pub(super) const IDLE_FOR: Duration = Duration::from_secs(30);

/// Idle connections to the upstream, the most recent last.
pub(super) struct Pool {
    pub(super) idle: Mutex<Vec<(TcpStream, Instant)>>,
    pub(super) max_idle: usize,
}

impl Pool {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(TcpStream, Instant)>> {
        // A list of sockets stays consistent whatever panicked while holding it.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most recent idle connection that is still open.
    pub(super) fn checkout(&self) -> Option<TcpStream> {
        let mut idle = self.lock();
        while let Some((io, since)) = idle.pop() {
            if since.elapsed() < IDLE_FOR && is_open(&io) {
                return Some(io);
            }
        }
        None
    }

    pub(super) fn checkin(&self, io: TcpStream) {
        let mut idle = self.lock();
        Self::expire(&mut idle);
        if idle.len() < self.max_idle {
            idle.push((io, Instant::now()));
        }
    }

    /// Closes the expired idle connections as their time runs out, for as long as the pool lives:
    /// it sleeps until the oldest one's `IDLE_FOR` is up (or `IDLE_FOR`, when none waits), so no
    /// idle connection stays open much past `IDLE_FOR`, requests or not.
    pub(super) async fn sweep(pool: Weak<Self>) {
        loop {
            let next = {
                let Some(pool) = pool.upgrade() else { return };
                let mut idle = pool.lock();
                Self::expire(&mut idle);
                idle.first().map_or_else(Instant::now, |(_, since)| *since) + IDLE_FOR
            };
            tokio::time::sleep_until(next).await;
        }
    }

    /// Closes the connections idle for `IDLE_FOR` or more: the oldest, at the front.
    pub(super) fn expire(idle: &mut Vec<(TcpStream, Instant)>) {
        let expired = idle.partition_point(|(_, since)| since.elapsed() >= IDLE_FOR);
        idle.drain(..expired);
    }
}

/// Whether an idle connection is still open with nothing unasked-for to read: the upstream may
/// have closed it while it sat in the pool. A peek at the socket itself, not at the runtime's
/// record of its readiness, which a busy thread updates late.
fn is_open(io: &TcpStream) -> bool {
    #[cfg(unix)]
    {
        use rustix::net::RecvFlags;
        let mut byte = [0; 1];
        matches!(
            rustix::net::recv(io, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT),
            Err(rustix::io::Errno::AGAIN)
        )
    }
    #[cfg(not(unix))]
    {
        let mut byte = [0; 1];
        matches!(io.try_read(&mut byte), Err(err) if err.kind() == std::io::ErrorKind::WouldBlock)
    }
}
