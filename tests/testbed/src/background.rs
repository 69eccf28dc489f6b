//! A client running in the background whose output is read as it comes: a test that
//! leaves it unread for minutes (100k connections meanwhile, under a loaded CI machine)
//! must not find it blocked on a full pipe, its later attempts never made.

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc::{self, Receiver},
    thread::{self, JoinHandle},
};

use anyhow::{Context as _, Result};

use crate::client::{self, Attempt};

pub struct Background {
    child: Child,
    lines: Receiver<String>,
    reader: JoinHandle<()>,
}

impl Background {
    /// Starts `cmd` with its output piped to a reader thread that keeps every complete
    /// line (a line cut short by a kill is left out).
    pub fn spawn(mut cmd: Command) -> Result<Self> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .context("starting e2e-client")?;
        let out = child
            .stdout
            .take()
            .context("the client's output is not piped")?;
        let (tx, lines) = mpsc::channel();
        let reader = thread::spawn(move || {
            let mut out = BufReader::new(out);
            let mut line = Vec::new();
            while matches!(out.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                if line.last() != Some(&b'\n') {
                    break;
                }
                if tx
                    .send(String::from_utf8_lossy(&line).into_owned())
                    .is_err()
                {
                    break;
                }
                line.clear();
            }
        });
        Ok(Self {
            child,
            lines,
            reader,
        })
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Each complete line, as the client prints it; ends with the client's output.
    pub fn lines(&self) -> impl Iterator<Item = String> + '_ {
        self.lines.iter()
    }

    /// Waits for the first attempt: lets a test change things only once the client is
    /// surely under way, however slowly it started. Later calls to `stop`/`finish` get
    /// the attempts after it.
    pub fn first_attempt(&mut self) -> Result<Attempt> {
        let line = self
            .lines
            .recv()
            .context("the client ended before its first attempt")?;
        client::parse_attempts(&line)?
            .pop()
            .context("the client's first line is no attempt")
    }

    /// Stops a client that would run on, and collects the attempts it finished.
    pub fn stop(mut self) -> Result<Vec<Attempt>> {
        let _ = self.child.kill();
        self.finish()
    }

    /// Collects the client's attempts, once it ends.
    pub fn finish(mut self) -> Result<Vec<Attempt>> {
        self.child.wait().context("waiting for the client")?;
        let _ = self.reader.join();
        let text: String = self.lines.try_iter().collect();
        client::parse_attempts(&text)
    }
}

#[cfg(test)]
mod tests {
    use std::{
        path::Path,
        time::{Duration, Instant},
    };

    use super::*;

    /// A client whose output outgrows a pipe's buffer (64 KiB) while nobody reads it
    /// still runs to its end: here it writes ~300 KB, then leaves a mark.
    #[test]
    fn output_left_unread_never_blocks_the_client() {
        let dir = std::env::temp_dir().join(format!("pxy-bg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mark = dir.join("done");
        let line = r#"{"seq":7,"ok":true,"backend":"backend-0","seen_as":"10.0.0.1","peer":"10.96.0.10:53","error":null,"errno":null,"ms":0.25,"at_ms":1.5}"#;
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!(
                "i=0; while [ $i -lt 2000 ]; do echo '{line}'; i=$((i+1)); done; touch {}; exec sleep 30",
                mark.display()
            ));
        let client = Background::spawn(cmd).expect("spawn");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !Path::new(&mark).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let done = mark.exists();
        let attempts = client.stop().expect("attempts");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(done, "the client blocked on its unread output");
        assert_eq!(attempts.len(), 2000);
    }
}
