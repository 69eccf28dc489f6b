//! The Debian packages the tests and the benchmark call: installed by `cargo xtask setup`
//! as root (apt-get), named with the command to run elsewhere.

use std::process::Command;

use anyhow::{Result, bail};

/// A command the tests or the benchmark run, and the package that has it.
const NEEDED: [(&str, &str, &str); 16] = [
    ("ip", "iproute2", "namespaces, veth, routes"),
    (
        "ethtool",
        "ethtool",
        "checksum offload off in the per-packet tests",
    ),
    ("python3", "python3", "HTTP checks"),
    (
        "setpriv",
        "util-linux",
        "the agent with exactly the DaemonSet's capabilities",
    ),
    ("nginx", "nginx", "the benchmark's backends"),
    ("wrk", "wrk", "the benchmark's load"),
    (
        "iptables-restore",
        "iptables",
        "kube-proxy's iptables rules in the benchmark and the migration tests",
    ),
    (
        "nft",
        "nftables",
        "kube-proxy's nftables rules in the per-packet and migration tests",
    ),
    ("bpftool", "bpftool", "inspecting programs and maps"),
    (
        "containerd",
        "containerd",
        "the box's nodes' container runtime",
    ),
    ("runc", "runc", "the box's nodes' containers"),
    (
        "/usr/lib/cni/bridge",
        "containernetworking-plugins",
        "the box's nodes' Pod network (bridge, host-local, loopback)",
    ),
    (
        "busybox",
        "busybox-static",
        "the shell tools of the box's images",
    ),
    (
        "nc.openbsd",
        "netcat-openbsd",
        "the agnhost image's nc, as the e2e specs call it",
    ),
    (
        "curl",
        "curl",
        "the agnhost image's curl, as the e2e specs call it",
    ),
    (
        "wget",
        "wget",
        "the agnhost image's wget (busybox 1.35's segfaults on -T)",
    ),
];

fn on_path(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Installs what is missing (as root); elsewhere says which command would.
pub fn ensure() -> Result<()> {
    ensure_these(&NEEDED)
}

/// `ensure` for another command's list: (command, package, why).
pub fn ensure_these(needed: &[(&str, &str, &str)]) -> Result<()> {
    let missing: Vec<(&str, &str, &str)> = needed
        .iter()
        .copied()
        .filter(|(cmd, _, _)| !on_path(cmd))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let packages: Vec<&str> = missing.iter().map(|(_, p, _)| *p).collect();
    for (cmd, package, why) in &missing {
        eprintln!("xtask: no {cmd} (package {package}: {why})");
    }
    if !is_root() {
        eprintln!(
            "xtask: not root, so not installing; run as root: apt-get install -y {} \
             (the tests that need them need root too, and are skipped without it)",
            packages.join(" ")
        );
        return Ok(());
    }
    eprintln!("xtask: installing {}", packages.join(" "));
    let update = Command::new("apt-get").args(["update", "-qq"]).status()?;
    if !update.success() {
        bail!("apt-get update failed: {update}");
    }
    let install = Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&packages)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()?;
    if !install.success() {
        bail!("apt-get install {} failed: {install}", packages.join(" "));
    }
    Ok(())
}
