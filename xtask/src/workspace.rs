//! Builds of the workspace, and its test crates' binaries run by the commands.

use std::{path::Path, process::Command};

use anyhow::Result;

use crate::{
    process::run,
    toolchain::{STABLE, cargo},
};

/// `cargo run` of one of proxy-e2e's binaries (debug build); its arguments follow.
pub fn e2e_bin(root: &Path, name: &str) -> Command {
    let mut cmd = cargo(root, STABLE);
    cmd.args(["run", "--quiet", "-p", "proxy-e2e", "--bin", name, "--"]);
    cmd
}

/// The same, release build: for benchmarks, whose helpers share the machine with the
/// agent they measure.
pub fn e2e_release_bin(root: &Path, name: &str) -> Command {
    let mut cmd = cargo(root, STABLE);
    cmd.args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "proxy-e2e",
        "--bin",
        name,
        "--",
    ]);
    cmd
}

/// The agent and the e2e helpers' binaries (a release build: `target/release/`).
pub fn build_agent_bins(root: &Path, release: bool) -> Result<()> {
    let mut cmd = cargo(root, STABLE);
    cmd.arg("build");
    if release {
        cmd.arg("--release");
    }
    cmd.args(["-p", "proxy-agent", "-p", "proxy-e2e", "--bins"]);
    run(&mut cmd)
}

pub fn build(root: &Path) -> Result<()> {
    let mut cmd = cargo(root, STABLE);
    cmd.args([
        "build",
        "--workspace",
        "--exclude",
        "proxy-ebpf",
        "--exclude",
        "bench-ebpf",
        "--bins",
        "--tests",
    ]);
    run(&mut cmd)
}
