//! proxy-agent: an eBPF service proxy for Kubernetes.
//!
//! `source` → `model` (node view) → `sync` → `dataplane` → BPF maps.

pub mod config;
pub mod dataplane;
pub mod debug;
pub mod health;
pub mod kube_proxy_cleanup;
pub mod metrics;
pub mod model;
pub mod netns;
pub mod source;
pub mod sync;
pub mod trace;

// Selects rustls' crypto provider (ring) for the API client; nothing to call.
use rustls as _;

/// This node's name as kube-proxy finds it: the override (`--node-name`, `NODE_NAME` from
/// the downward API, `hostnameOverride`) or else the host name — trimmed and lowercased,
/// as Node names are.
pub fn node_name(name_override: Option<&str>) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let name = match name_override.map(str::trim).filter(|n| !n.is_empty()) {
        Some(n) => n.to_string(),
        None => nix::unistd::gethostname()
            .context("reading the host name (or pass --node-name / NODE_NAME)")?
            .to_string_lossy()
            .trim()
            .to_string(),
    };
    anyhow::ensure!(
        !name.is_empty(),
        "empty node name: pass --node-name or NODE_NAME"
    );
    Ok(name.to_lowercase())
}

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

#[cfg(test)]
mod tests {
    #[test]
    fn node_names_are_lowercased_and_trimmed() {
        assert_eq!(
            super::node_name(Some(" Node-A.Example ")).expect("name"),
            "node-a.example"
        );
        let host = super::node_name(None).expect("the host name");
        assert_eq!(host, host.to_lowercase());
        assert_eq!(super::node_name(Some("")).expect("falls back"), host);
    }
}
