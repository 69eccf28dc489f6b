//! `proxy-agent cleanup`: our pins and programs, or (`--kube-proxy`) what kube-proxy left.

use std::path::Path;

use anyhow::Result;
use proxy_agent::{dataplane::bpf, kube_proxy_cleanup};

pub fn cleanup(bpffs: &Path, kube_proxy: bool) -> Result<()> {
    if kube_proxy {
        let report = kube_proxy_cleanup::cleanup();
        outln!("{report}");
        if report.count(kube_proxy_cleanup::Outcome::Failed) > 0 {
            std::process::exit(1);
        }
        return Ok(());
    }
    let report = bpf::cleanup(bpffs)?;
    for (path, why) in &report.left {
        tracing::warn!(pin = %path.display(), "left in place: {why}");
    }
    tracing::info!(
        bpffs = %bpffs.display(),
        removed = report.removed,
        left = report.left.len(),
        "removed our pins; our programs are detached"
    );
    Ok(())
}
