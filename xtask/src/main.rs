//! Developer workflow: `cargo xtask setup | build-ebpf | build | test | fuzz | bench | soak |
//! demo | cluster | cluster-scale | conformance | kernels`. `main` parses and dispatches; each
//! command lives in the module that owns it.

mod cluster;
mod fuzz;
mod kernels;
mod packages;
mod process;
mod runs;
mod summary;
mod test;
mod toolchain;
mod workspace;

use anyhow::Result;
use clap::{Parser, Subcommand};

use crate::{
    toolchain::{build_ebpf, setup, workspace_root},
    workspace::build,
};

#[derive(Parser)]
#[command(about = "Developer workflow for the eBPF service proxy")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install the pinned toolchains and bpf-linker (idempotent; seconds when done).
    Setup,
    /// Build the BPF object (target/bpfel-unknown-none/release/proxy-ebpf).
    BuildEbpf,
    /// Build the agent (which embeds the BPF object) and the test helpers.
    Build,
    /// Run every test: unit, BPF (BPF_PROG_TEST_RUN) and end-to-end (root).
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// The fuzzing property tests (parsers, and packets through the real classifiers as
    /// root) with many cases; a failure prints its minimized input.
    Fuzz {
        /// Cases per property (`cargo xtask test` runs a few hundred).
        #[arg(long, default_value_t = 100_000)]
        cases: u32,
        /// Replay a run: proptest's RNG seed (`PROPTEST_RNG_SEED`).
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Benchmarks (figures, not pass/fail): control-plane scale of the node view and map diff,
    /// the datapaths beside kube-proxy's rules, and the agent under EndpointSlice churn.
    Bench {
        /// Small sizes, for CI smoke runs.
        #[arg(long)]
        quick: bool,
    },
    /// Both datapaths at once under a traffic mix (short and keep-alive TCP, DNS-like and
    /// connected UDP) while endpoints churn, the agent restarts and the API server
    /// misbehaves on a schedule; fails on any failure.
    Soak {
        /// How long traffic runs (keep-alive connections idle 65 s between requests).
        #[arg(long, default_value_t = 10.0)]
        minutes: f64,
        /// Serve the objects from a folder, without API-server faults (default: the fake
        /// API server, with them).
        #[arg(long)]
        files: bool,
    },
    /// Build, make a namespace testbed, run the agent on deploy/examples, show the spread.
    Demo {
        /// Requests to send.
        #[arg(long, default_value_t = 300)]
        requests: u32,
    },
    /// Build (once, cached in .tools/) etcd, kube-apiserver and kube-controller-manager and
    /// run them on loopback with TLS until Ctrl-C: a cluster in a box, without kubelets.
    Cluster {
        /// Only build the binaries (CI prebuilds them for the tests).
        #[arg(long)]
        build_only: bool,
        /// Real nodes (kubelet, containerd, runc, CNI), each in its own network namespace
        /// and cgroup subtree: 1 or 2.
        #[arg(long, default_value_t = 0)]
        nodes: usize,
    },
    /// Kubernetes' own sig-network e2e specs (Services, Conntrack, Networking, KubeProxy,
    /// traffic distribution) on a box with two real nodes: with the agent as the
    /// DaemonSet, then with kube-proxy (nftables) as the reference; JUnit and JSON reports
    /// in target/conformance/, the side-by-side table in docs/conformance.md.
    Conformance {
        /// Only the [Conformance] specs among them (19; ~4 min a run here; all 82: longer).
        #[arg(long)]
        conformance_only: bool,
        /// Only the agent's run (the table keeps kube-proxy's column from the last run).
        #[arg(long)]
        agent_only: bool,
    },
    /// The agent on Debian's kernel lines (5.10, 6.1, 6.12), each booted under QEMU with no
    /// network: the programs loaded, packets traced, both paths served; the table in
    /// docs/kernels.md.
    Kernels {
        /// Kernel lines to boot (default: all; with --quick, the floor).
        #[arg(long = "kernel")]
        kernel: Vec<String>,
        /// CI's form: the floor kernel, the loads and one request per path.
        #[arg(long)]
        quick: bool,
    },
    /// The agent (release build) against the cluster in a box at N Services created through
    /// the API: time to all programmed, then programming latency under readiness churn.
    ClusterScale {
        /// Passed to the `cluster-scale` binary, which owns them and their defaults:
        /// `--services N`, `--changes-per-s R`, `--churn-s S`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root()?;
    match cli.cmd {
        Cmd::Setup => setup(&root),
        Cmd::BuildEbpf => setup(&root).and_then(|()| build_ebpf(&root)),
        Cmd::Build => setup(&root).and_then(|()| build(&root)),
        Cmd::Test { args } => {
            setup(&root)?;
            build(&root)?;
            test::test(&root, &args)
        }
        Cmd::Fuzz { cases, seed } => {
            setup(&root)?;
            fuzz::run_all(&root, cases, seed)
        }
        Cmd::Bench { quick } => runs::bench(&root, quick),
        Cmd::Soak { minutes, files } => runs::soak(&root, minutes, files),
        Cmd::Demo { requests } => runs::demo(&root, requests),
        Cmd::ClusterScale { args } => runs::cluster_scale(&root, &args),
        Cmd::Conformance {
            conformance_only,
            agent_only,
        } => runs::conformance(&root, conformance_only, agent_only),
        Cmd::Cluster { build_only, nodes } => runs::cluster(&root, build_only, nodes),
        Cmd::Kernels { kernel, quick } => {
            setup(&root)?;
            kernels::kernels(&root, &kernel, quick)
        }
    }
}
