//! The commands that run a binary of the test crates: the benchmarks, the soak, the demo,
//! the cluster in a box, its scale run and Kubernetes' conformance specs.

use std::path::Path;

use anyhow::Result;

use crate::{
    cluster,
    process::run,
    toolchain::{STABLE, cargo, setup},
    workspace::{BENCH, CLUSTER, TESTBED, bin, build, build_agent_bins, release_bin},
};

/// `cargo xtask bench`: the control plane's scale, the datapaths beside kube-proxy's
/// rules, the feed's fan-out and the agent under churn.
pub fn bench(root: &Path, quick: bool) -> Result<()> {
    setup(root)?;
    build(root)?;
    // Control-plane scale of the node view and map diff.
    let mut cmd = cargo(root, STABLE);
    cmd.args(["bench", "-p", "proxy-agent", "--bench", "node_view", "--"])
        .arg(if quick { "1000" } else { "10000" });
    run(&mut cmd)?;
    // The API source's decoding: item by item (`Decoded<K>`) against kube's typed
    // decode, as a ratio.
    let mut cmd = cargo(root, STABLE);
    cmd.args(["bench", "-p", "proxy-agent", "--bench", "api_decode", "--"])
        .arg(if quick { "2000" } else { "20000" });
    run(&mut cmd)?;
    // Side by side with kube-proxy's iptables and nftables rules, with the release agent.
    build_agent_bins(root, true)?;
    let mut cmd = release_bin(root, BENCH, "bench");
    agent_and_out(root, &mut cmd, "release");
    if quick {
        cmd.arg("--quick");
    }
    run(&mut cmd)?;
    // Fan-out: `proxy-agent serve` against the fake API server, light clients as nodes,
    // and the direct watchers beside it, on loopback (target/bench/fanout-<services>.json);
    // full: 10k and 100k Services.
    let sizes: &[&str] = if quick {
        &["quick"]
    } else {
        &["10000", "100000"]
    };
    for services in sizes {
        let mut cmd = release_bin(root, BENCH, "fanout");
        agent_and_out(root, &mut cmd, "release");
        if quick {
            cmd.arg("--quick");
        } else {
            cmd.args(["--services", services, "--nodes", "1000"]);
            cmd.args(["--changes-per-s", "100"]);
        }
        run(&mut cmd)?;
    }
    // The control plane under churn: the release agent against the fake API server at
    // 1k / 10k (/ 100k) Services (target/bench/churn.json).
    let mut cmd = release_bin(root, BENCH, "churn");
    agent_and_out(root, &mut cmd, "release");
    if quick {
        cmd.arg("--quick");
    }
    run(&mut cmd)
}

/// `--agent target/<profile>/proxy-agent --out target/bench`.
fn agent_and_out(root: &Path, cmd: &mut std::process::Command, profile: &str) {
    cmd.arg("--agent")
        .arg(root.join("target").join(profile).join("proxy-agent"))
        .arg("--out")
        .arg(root.join("target/bench"));
}

/// `cargo xtask soak`: both datapaths under a traffic mix while everything churns.
pub fn soak(root: &Path, minutes: f64, files: bool) -> Result<()> {
    setup(root)?;
    build_agent_bins(root, false)?;
    let mut cmd = bin(root, BENCH, "soak");
    cmd.arg("--agent")
        .arg(root.join("target/debug/proxy-agent"))
        .arg("--minutes")
        .arg(minutes.to_string())
        .args(["--source", if files { "files" } else { "api" }]);
    run(&mut cmd)
}

/// `cargo xtask demo`: a namespace testbed, the agent on deploy/examples, the spread.
pub fn demo(root: &Path, requests: u32) -> Result<()> {
    setup(root)?;
    build(root)?;
    let mut cmd = bin(root, TESTBED, "demo");
    cmd.arg("--agent")
        .arg(root.join("target/debug/proxy-agent"))
        .arg("--manifests")
        .arg(root.join("deploy/examples"))
        .arg("--requests")
        .arg(requests.to_string());
    run(&mut cmd)
}

/// `cargo xtask cluster-scale`: the release agent against the cluster in a box at N
/// Services.
pub fn cluster_scale(root: &Path, args: &[String]) -> Result<()> {
    let bin_dir = cluster::build(root)?;
    setup(root)?;
    run(cargo(root, STABLE).args(["build", "--release", "-p", "proxy-agent"]))?;
    run(cargo(root, STABLE).args(["build", "-p", TESTBED, "--bins"]))?;
    let mut cmd = bin(root, CLUSTER, "cluster-scale");
    cmd.env("PROXY_AGENT_BIN", root.join("target/release/proxy-agent"))
        .arg("--bin-dir")
        .arg(bin_dir)
        .args(args);
    run(&mut cmd)
}

/// `cargo xtask conformance`: the sig-network specs with the agent, then with
/// kube-proxy (unless `agent_only`), and the side-by-side table.
pub fn conformance(root: &Path, conformance_only: bool, agent_only: bool) -> Result<()> {
    setup(root)?;
    let bin_dir = cluster::build_nodes(root, true)?;
    build_agent_bins(root, false)?;
    let out = root.join("target/conformance");
    let proxies: &[&str] = if agent_only {
        &["agent"]
    } else {
        &["agent", "kube-proxy"]
    };
    for proxy in proxies {
        let mut cmd = bin(root, CLUSTER, "conformance");
        cmd.env(cluster::BIN_DIR_ENV, &bin_dir)
            .env("PROXY_AGENT_BIN", root.join("target/debug/proxy-agent"))
            .arg("--bin-dir")
            .arg(&bin_dir)
            .arg("--proxy")
            .arg(proxy)
            .arg("--out")
            .arg(&out);
        if conformance_only {
            cmd.arg("--conformance-only");
        }
        run(&mut cmd)?;
    }
    let mut cmd = bin(root, CLUSTER, "conformance");
    cmd.arg("--bin-dir")
        .arg(&bin_dir)
        .arg("--out")
        .arg(&out)
        .arg("--summarize")
        .arg(root.join("docs/conformance.md"));
    run(&mut cmd)
}

/// `cargo xtask cluster`: the cluster in a box (with `nodes` real nodes) until Ctrl-C.
pub fn cluster(root: &Path, build_only: bool, nodes: usize) -> Result<()> {
    let bin_dir = if nodes > 0 || build_only {
        cluster::build_nodes(root, false)?
    } else {
        cluster::build(root)?
    };
    if build_only {
        eprintln!("xtask: cluster binaries in {}", bin_dir.display());
        return Ok(());
    }
    setup(root)?;
    if nodes > 0 {
        run(cargo(root, STABLE).args(["build", "-p", "proxy-agent"]))?;
    }
    let mut cmd = bin(root, CLUSTER, "cluster");
    cmd.arg("--bin-dir")
        .arg(bin_dir)
        .arg("--nodes")
        .arg(nodes.to_string())
        .arg("--agent")
        .arg(root.join("target/debug/proxy-agent"));
    run(&mut cmd)
}
