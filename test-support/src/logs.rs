//! What a test logs through `tracing`, kept for its assertions: shared by the test crates that
//! check log lines (the filter's events, the processor's error lines).

use std::io::Write;
use std::sync::{Arc, Mutex};

/// A writer for `tracing_subscriber` that keeps everything written to it; clones share it.
#[derive(Debug, Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// A subscriber that writes here what is logged at `level` and above, without colours.
    pub fn subscriber(&self, level: tracing::Level) -> impl tracing::Subscriber + Send + Sync {
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish()
    }

    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}
