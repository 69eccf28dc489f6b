//! Builds of the workspace, and its test crates' binaries run by the commands.

use std::{path::Path, process::Command};

use anyhow::Result;

use crate::{
    process::run,
    toolchain::{STABLE, cargo},
};

/// The test crates whose binaries the commands run: the testbed (the helpers the testbeds
/// spawn, the demo), the benchmarks (and the soak), the cluster in a box.
pub const TESTBED: &str = "proxy-testbed";
pub const BENCH: &str = "proxy-bench";
pub const CLUSTER: &str = "proxy-cluster";

/// `cargo run` of `package`'s binary `name` (debug build); its arguments follow.
pub fn bin(root: &Path, package: &str, name: &str) -> Command {
    let mut cmd = cargo(root, STABLE);
    cmd.args(["run", "--quiet", "-p", package, "--bin", name, "--"]);
    cmd
}

/// The same, release build: for benchmarks, whose helpers share the machine with the
/// agent they measure.
pub fn release_bin(root: &Path, package: &str, name: &str) -> Command {
    let mut cmd = cargo(root, STABLE);
    cmd.args([
        "run",
        "--quiet",
        "--release",
        "-p",
        package,
        "--bin",
        name,
        "--",
    ]);
    cmd
}

/// The agent and the helpers the testbeds spawn (proxy-testbed's binaries), found next to
/// the binary that runs them (a release build: `target/release/`).
pub fn build_agent_bins(root: &Path, release: bool) -> Result<()> {
    let mut cmd = cargo(root, STABLE);
    cmd.arg("build");
    if release {
        cmd.arg("--release");
    }
    cmd.args(["-p", "proxy-agent", "-p", TESTBED, "--bins"]);
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
