//! Joining a network namespace, for agents that run beside (not inside) a node's netns.

use std::path::Path;

use crate::error::{ErrorKind, Kind as _, Result};

/// Moves the calling thread into the network namespace at `path` (e.g. /run/netns/x).
/// Call it before any other thread starts so the whole process follows.
pub fn enter(path: &Path) -> Result<()> {
    let file = std::fs::File::open(path).kind_with(ErrorKind::Io, || {
        format!("opening network namespace {}", path.display())
    })?;
    nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).kind_with(ErrorKind::Io, || {
        format!("entering network namespace {}", path.display())
    })
}
