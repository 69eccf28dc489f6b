//! Standard output of the commands that print (`dump`, `watch`, `trace`, `cleanup`): a
//! reader that goes away early (`proxy-agent dump | head`) ends the command quietly with
//! status 0, as `head` expects, where `println!` panicked on the broken pipe (Rust
//! ignores SIGPIPE, so the write fails with EPIPE instead of ending the process).

use std::io::Write as _;

/// Standard output was closed by its reader: the command stops, having nothing to say.
#[derive(Debug, thiserror::Error)]
#[error("standard output closed by its reader")]
pub struct Closed;

/// Writes `args` to standard output, flushed (so a closed pipe is seen here, not at exit).
pub fn write(args: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Closed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("writing to standard output")),
    }
}

/// Whether a command ended because its reader went away (not a failure).
pub fn closed(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<Closed>())
}
