//! proxy-agent: an eBPF service proxy for Kubernetes.
//!
//! `source` → `model` (node view) → `sync` → `dataplane` → BPF maps.

pub mod config;
pub mod dataplane;
pub mod debug;
pub mod health;
pub mod model;
pub mod netns;
pub mod source;
pub mod sync;
pub mod trace;

// Selects rustls' crypto provider (ring) for the API client; nothing to call.
use rustls as _;

/// The cgroup v2 mount point, from /proc/self/mountinfo (`/sys/fs/cgroup` on most hosts).
pub fn cgroup2_mount() -> anyhow::Result<std::path::PathBuf> {
    use anyhow::Context as _;
    let info = std::fs::read_to_string("/proc/self/mountinfo").context("reading mountinfo")?;
    info.lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            post.starts_with("cgroup2 ")
                .then(|| pre.split(' ').nth(4).map(std::path::PathBuf::from))?
        })
        .context("no cgroup2 mount found: pass --cgroup PATH or --cgroup none")
}
