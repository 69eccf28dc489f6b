//! What a test's tracing records say, as the agent's log would show them.

use std::sync::{Arc, Mutex};

/// Records every line written; clones share the lines.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    /// Starts capturing this thread's records (a test on a single-threaded runtime: all
    /// its tasks); they stop when the guard is dropped.
    pub fn start() -> (Self, tracing::subscriber::DefaultGuard) {
        let log = Self::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        (log, tracing::subscriber::set_default(subscriber))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
    }

    /// The lines that mention `what`.
    pub fn lines_with(&self, what: &str) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| l.contains(what))
            .map(str::to_string)
            .collect()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
