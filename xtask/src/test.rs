//! `cargo xtask test`: the lint gate, then every test of the workspace, with the summary
//! of what ran, passed, failed and was skipped.

use std::path::Path;

use anyhow::{Result, bail};

use crate::{
    cluster,
    process::run,
    summary,
    toolchain::{STABLE, cargo},
    workspace::build,
};

pub fn test(root: &Path, args: &[String]) -> Result<()> {
    // The lint gate first; the tests run whatever it says, and the command fails after
    // them when it failed.
    let lint = lint_gate(root);
    // The cluster in a box's binaries, the nodes' too (cached under .tools/): its tests
    // fail without them. The node smoke test (tests/cluster/tests/cluster_node.rs) takes ~40 s.
    let bin_dir = cluster::build_nodes(root, false)?;
    // Every binary and test first: the helpers the testbeds spawn from target/debug/
    // (e2e-echo, e2e-client, e2e-synflood) are proxy-testbed's binaries, and `cargo test`
    // builds a package's binaries only for that package's own integration tests (the
    // testbed has none). The same build as `cargo test`'s, which then finds it done.
    build(root)?;
    let mut cmd = cargo(root, STABLE);
    cmd.args([
        "test",
        "--workspace",
        "--exclude",
        "proxy-ebpf",
        "--exclude",
        "bench-ebpf",
    ]);
    // Every binary runs, whichever fails first.
    if !args.iter().any(|a| a == "--no-fail-fast") {
        cmd.arg("--no-fail-fast");
    }
    // Tests that find they cannot run here record it (`test_support::cannot_run`).
    let skips = root.join("target/test-skips.txt");
    let _ = std::fs::remove_file(&skips);
    cmd.env("PROXY_AGENT_BIN", root.join("target/debug/proxy-agent"))
        .env(cluster::BIN_DIR_ENV, bin_dir)
        .env("PROXY_TEST_SKIPS", &skips)
        .args(args);
    let (status, mut summary) = summary::run(&mut cmd)?;
    summary.take_skips(&std::fs::read_to_string(&skips).unwrap_or_default());
    eprintln!("{}", summary.line());
    if let Err(e) = &lint {
        eprintln!("xtask test: the lint gate failed: {e:#}");
    }
    if !status.success() {
        bail!("cargo test failed: {status}");
    }
    lint
}

/// `cargo fmt --check` and clippy with every warning an error, on every crate but the BPF
/// one (its target needs the nightly toolchain and bpf-linker; the verifier and its own
/// build are its gate).
fn lint_gate(root: &Path) -> Result<()> {
    let fmt = run(cargo(root, STABLE).args(["fmt", "--all", "--check"]));
    let clippy = run(cargo(root, STABLE).args([
        "clippy",
        "--workspace",
        "--exclude",
        "proxy-ebpf",
        "--exclude",
        "bench-ebpf",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]));
    match (fmt, clippy) {
        (Ok(()), Ok(())) => Ok(()),
        (fmt, clippy) => bail!(
            "{}{}",
            fmt.err()
                .map_or(String::new(), |e| format!("cargo fmt --check: {e:#}; ")),
            clippy
                .err()
                .map_or(String::new(), |e| format!("cargo clippy: {e:#}"))
        ),
    }
}
