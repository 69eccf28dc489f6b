//! Developer workflow: `cargo xtask setup | build-ebpf | build | test | fuzz | bench | soak |
//! demo | cluster`.
//!
//! Toolchains are pinned here (and in `rust-toolchain.toml`); bpf-linker is installed into
//! the project-local `.tools/` folder, linked against the pinned nightly's own LLVM.

mod cluster;
mod fuzz;
mod packages;
mod summary;

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

const STABLE: &str = "1.99.1";
const NIGHTLY: &str = "nightly-2026-10-29";
const BPF_LINKER: &str = "bpf-linker@0.13.0";
const BPF_LINKER_VERSION: &str = "bpf-linker 0.13.0";
const BPF_TARGET: &str = "bpfel-unknown-none";

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
        Cmd::BuildEbpf => {
            setup(&root)?;
            build_ebpf(&root)
        }
        Cmd::Build => {
            setup(&root)?;
            build(&root)
        }
        Cmd::Test { args } => {
            setup(&root)?;
            build(&root)?;
            test(&root, &args)
        }
        Cmd::Fuzz { cases, seed } => {
            setup(&root)?;
            fuzz::run_all(&root, cases, seed)
        }
        Cmd::Bench { quick } => {
            setup(&root)?;
            build(&root)?;
            // Control-plane scale of the node view and map diff.
            let mut cmd = cargo(&root, STABLE);
            cmd.args(["bench", "-p", "proxy-agent", "--bench", "node_view", "--"])
                .arg(if quick { "1000" } else { "10000" });
            run(&mut cmd)?;
            // The API source's decoding: item by item (`Decoded<K>`) against kube's typed
            // decode, as a ratio.
            let mut cmd = cargo(&root, STABLE);
            cmd.args(["bench", "-p", "proxy-agent", "--bench", "api_decode", "--"])
                .arg(if quick { "2000" } else { "20000" });
            run(&mut cmd)?;
            // Side by side with kube-proxy's iptables and nftables rules, with the
            // release agent.
            build_agent_bins(&root, true)?;
            let mut cmd = e2e_release_bin(&root, "bench");
            cmd.arg("--agent")
                .arg(root.join("target/release/proxy-agent"))
                .arg("--out")
                .arg(root.join("target/bench"));
            if quick {
                cmd.arg("--quick");
            }
            run(&mut cmd)?;
            // Fan-out: `proxy-agent serve` against the fake API server, light clients
            // as nodes, and the direct watchers beside it, on loopback
            // (target/bench/fanout-<services>.json); full: 10k and 100k Services.
            let sizes: &[&str] = if quick {
                &["quick"]
            } else {
                &["10000", "100000"]
            };
            for services in sizes {
                let mut cmd = e2e_release_bin(&root, "fanout");
                cmd.arg("--agent")
                    .arg(root.join("target/release/proxy-agent"))
                    .arg("--out")
                    .arg(root.join("target/bench"));
                if quick {
                    cmd.arg("--quick");
                } else {
                    cmd.args(["--services", services, "--nodes", "1000"]);
                    cmd.args(["--changes-per-s", "100"]);
                }
                run(&mut cmd)?;
            }
            // The control plane under churn: the release agent against the fake API
            // server at 1k / 10k (/ 100k) Services (target/bench/churn.json).
            let mut cmd = e2e_release_bin(&root, "churn");
            cmd.arg("--agent")
                .arg(root.join("target/release/proxy-agent"))
                .arg("--out")
                .arg(root.join("target/bench"));
            if quick {
                cmd.arg("--quick");
            }
            run(&mut cmd)
        }
        Cmd::Soak { minutes, files } => {
            setup(&root)?;
            build_agent_bins(&root, false)?;
            let mut cmd = e2e_bin(&root, "soak");
            cmd.arg("--agent")
                .arg(root.join("target/debug/proxy-agent"))
                .arg("--minutes")
                .arg(minutes.to_string())
                .args(["--source", if files { "files" } else { "api" }]);
            run(&mut cmd)
        }
        Cmd::Demo { requests } => {
            setup(&root)?;
            build(&root)?;
            let mut cmd = e2e_bin(&root, "demo");
            cmd.arg("--agent")
                .arg(root.join("target/debug/proxy-agent"))
                .arg("--manifests")
                .arg(root.join("deploy/examples"))
                .arg("--requests")
                .arg(requests.to_string());
            run(&mut cmd)
        }
        Cmd::ClusterScale { args } => {
            let bin_dir = cluster::build(&root)?;
            setup(&root)?;
            run(cargo(&root, STABLE).args(["build", "--release", "-p", "proxy-agent"]))?;
            run(cargo(&root, STABLE).args(["build", "-p", "proxy-e2e", "--bins"]))?;
            let mut cmd = e2e_bin(&root, "cluster-scale");
            cmd.env("PROXY_AGENT_BIN", root.join("target/release/proxy-agent"))
                .arg("--bin-dir")
                .arg(bin_dir)
                .args(args);
            run(&mut cmd)
        }
        Cmd::Conformance {
            conformance_only,
            agent_only,
        } => {
            setup(&root)?;
            let bin_dir = cluster::build_nodes(&root, true)?;
            build_agent_bins(&root, false)?;
            let out = root.join("target/conformance");
            let proxies: &[&str] = if agent_only {
                &["agent"]
            } else {
                &["agent", "kube-proxy"]
            };
            for proxy in proxies {
                let mut cmd = e2e_bin(&root, "conformance");
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
            let mut cmd = e2e_bin(&root, "conformance");
            cmd.arg("--bin-dir")
                .arg(&bin_dir)
                .arg("--out")
                .arg(&out)
                .arg("--summarize")
                .arg(root.join("docs/conformance.md"));
            run(&mut cmd)
        }
        Cmd::Cluster { build_only, nodes } => {
            let bin_dir = if nodes > 0 || build_only {
                cluster::build_nodes(&root, false)?
            } else {
                cluster::build(&root)?
            };
            if build_only {
                eprintln!("xtask: cluster binaries in {}", bin_dir.display());
                return Ok(());
            }
            setup(&root)?;
            if nodes > 0 {
                run(cargo(&root, STABLE).args(["build", "-p", "proxy-agent"]))?;
            }
            let mut cmd = e2e_bin(&root, "cluster");
            cmd.arg("--bin-dir")
                .arg(bin_dir)
                .arg("--nodes")
                .arg(nodes.to_string())
                .arg("--agent")
                .arg(root.join("target/debug/proxy-agent"));
            run(&mut cmd)
        }
    }
}

fn workspace_root() -> Result<PathBuf> {
    let manifest = env::var("CARGO_MANIFEST_DIR").context("run through `cargo xtask`")?;
    Ok(Path::new(&manifest)
        .parent()
        .context("xtask has a parent folder")?
        .to_path_buf())
}

fn tools_dir(root: &Path) -> PathBuf {
    root.join(".tools")
}

/// `cargo run` of one of proxy-e2e's binaries (debug build); its arguments follow.
fn e2e_bin(root: &Path, name: &str) -> Command {
    let mut cmd = cargo(root, STABLE);
    cmd.args(["run", "--quiet", "-p", "proxy-e2e", "--bin", name, "--"]);
    cmd
}

/// The same, release build: for benchmarks, whose helpers share the machine with the
/// agent they measure.
fn e2e_release_bin(root: &Path, name: &str) -> Command {
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

/// A cargo command for `toolchain`, with the project's tools first on PATH.
fn cargo(root: &Path, toolchain: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", toolchain, "cargo"]).current_dir(root);
    let path = env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![tools_dir(root).join("bin")];
    paths.extend(env::split_paths(&path));
    if let Ok(joined) = env::join_paths(paths) {
        cmd.env("PATH", joined);
    }
    // A toolchain chosen by an outer `cargo +x` must not leak into the inner build.
    for key in ["RUSTC", "RUSTDOC", "RUSTUP_TOOLCHAIN", "CARGO"] {
        cmd.env_remove(key);
    }
    cmd
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("spawning {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn toolchain_ready(name: &str, component: &str) -> bool {
    Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", name])
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(component))
        .unwrap_or(false)
}

fn setup(root: &Path) -> Result<()> {
    packages::ensure()?;
    if !toolchain_ready(STABLE, "clippy") {
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            STABLE,
            "--profile",
            "minimal",
            "--component",
            "clippy,rustfmt",
        ]))?;
    }
    if !toolchain_ready(NIGHTLY, "rust-src") {
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            NIGHTLY,
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))?;
    }
    let tools = tools_dir(root);
    let linker = tools.join("bin/bpf-linker");
    let works = Command::new(&linker)
        .arg("--version")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .map(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION)
        })
        .unwrap_or(false);
    if works {
        return Ok(());
    }
    eprintln!("xtask: installing {BPF_LINKER} into {}", tools.display());
    let sysroot =
        output(Command::new("rustc").args([&format!("+{NIGHTLY}"), "--print", "sysroot"]))?;
    let sysroot = PathBuf::from(sysroot.trim());
    let version = output(Command::new("rustc").args([&format!("+{NIGHTLY}"), "-vV"]))?;
    let llvm_major = version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("nightly rustc reports no LLVM version")?
        .to_string();
    let lib_dir = sysroot.join("lib");
    let libllvm = std::fs::read_dir(&lib_dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("libLLVM.so."))
        .with_context(|| format!("no libLLVM.so.* in {}", lib_dir.display()))?;
    // bpf-linker's build looks for libLLVM.so under LLVM_PREFIX/lib.
    let shim = tools.join("llvm-shim/lib");
    std::fs::create_dir_all(&shim)?;
    let link = shim.join("libLLVM.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(lib_dir.join(&libllvm), &link)?;
    let mut cmd = cargo(root, STABLE);
    cmd.args(["install", "--locked", "--root"])
        .arg(&tools)
        .args([BPF_LINKER, "--no-default-features", "--features"])
        .arg(format!("llvm-{llvm_major}"))
        .env("LLVM_PREFIX", tools.join("llvm-shim"))
        // The linker resolves libLLVM through RUNPATH at the nightly's own lib folder.
        .env(
            "RUSTFLAGS",
            format!("-C link-arg=-Wl,-rpath,{}", lib_dir.display()),
        );
    run(&mut cmd)?;
    run(Command::new(&linker)
        .arg("--version")
        .env_remove("LD_LIBRARY_PATH"))
}

fn build_ebpf(root: &Path) -> Result<()> {
    let mut cmd = cargo(root, NIGHTLY);
    cmd.args([
        "build",
        "-p",
        "proxy-ebpf",
        "--release",
        "--target",
        BPF_TARGET,
        "-Z",
        "build-std=core",
    ])
    // The same flags aya-build uses from proxy-agent's build.rs.
    .env(
        "CARGO_ENCODED_RUSTFLAGS",
        format!(
            "--cfg=bpf_target_arch=\"{}\"\x1f-Cdebuginfo=2\x1f-Clink-arg=--btf",
            std::env::consts::ARCH
        ),
    );
    run(&mut cmd)?;
    eprintln!(
        "xtask: BPF object at {}",
        root.join("target")
            .join(BPF_TARGET)
            .join("release/proxy-ebpf")
            .display()
    );
    Ok(())
}

/// The agent and the e2e helpers' binaries (a release build: `target/release/`).
fn build_agent_bins(root: &Path, release: bool) -> Result<()> {
    let mut cmd = cargo(root, STABLE);
    cmd.arg("build");
    if release {
        cmd.arg("--release");
    }
    cmd.args(["-p", "proxy-agent", "-p", "proxy-e2e", "--bins"]);
    run(&mut cmd)
}

fn build(root: &Path) -> Result<()> {
    let mut cmd = cargo(root, STABLE);
    cmd.args([
        "build",
        "--workspace",
        "--exclude",
        "proxy-ebpf",
        "--bins",
        "--tests",
    ]);
    run(&mut cmd)
}

fn test(root: &Path, args: &[String]) -> Result<()> {
    // The lint gate first; the tests run whatever it says, and the command fails after
    // them when it failed.
    let lint = lint_gate(root);
    // The cluster in a box's binaries, the nodes' too (cached under .tools/): its tests
    // fail without them. The node smoke test (tests/tests/cluster_node.rs) takes ~40 s.
    let bin_dir = cluster::build_nodes(root, false)?;
    let mut cmd = cargo(root, STABLE);
    cmd.args(["test", "--workspace", "--exclude", "proxy-ebpf"]);
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
