//! `proxy-agent`: run the service proxy, inspect what the kernel holds, clean up. This
//! file parses the command line and dispatches; each command lives in `cli/`.

mod cli;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use proxy_agent::{config::DEFAULT_METRICS_ADDR, dataplane::bpf::DEFAULT_PIN_DIR, netns};

/// jemalloc, not glibc's malloc: at 100k Services it parses and builds the view about a
/// fifth faster (`node_view` bench) and gives freed pages back by itself, where glibc
/// kept what the first lists' decoding left in the RSS.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options (read before `main`). Its background thread gives freed pages
/// back on time: without it they go back only as the agent allocates again, so an
/// agent idle after its first programming kept what that left (at 100k Services an RSS
/// of 285 MiB where 235 MiB were live, 2026-12-06).
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: &[u8; 23] = b"background_thread:true\0";

/// How long blocking work still under way may hold the agent's exit.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Parser)]
#[command(
    version,
    about = "eBPF service proxy for Kubernetes (kube-proxy replacement)"
)]
struct Cli {
    /// Enter this network namespace (a path such as /run/netns/NAME) before anything else.
    #[arg(long, global = true)]
    netns: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Load, attach and keep the BPF maps in step with the Services and EndpointSlices.
    Run(Box<cli::run::RunArgs>),
    /// Watch Services, EndpointSlices and Nodes once and serve each node its part over
    /// gRPC, for agents run with `--source server=ADDR,…` (KPNG's split).
    Serve(Box<cli::serve::ServeArgs>),
    /// Show what the pinned maps hold (works while the agent is down) — with `--stats`,
    /// traffic per frontend and backend — or, from a running agent's debug endpoint, this
    /// node's view (`--view`) or the model (`--model`).
    Dump {
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        bpffs: PathBuf,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// This node's view, from the running agent.
        #[arg(long, conflicts_with = "model")]
        view: bool,
        /// The cluster-wide model (Services, EndpointSlices, this node), from the running agent.
        #[arg(long, conflicts_with = "stats")]
        model: bool,
        /// Connections, packets and bytes per frontend and per backend, as
        /// `ipvsadm -Ln --stats` shows them (from the pinned maps).
        #[arg(long, conflicts_with = "view")]
        stats: bool,
        /// With `--stats`: every number in full (ipvsadm's `--exact`).
        #[arg(long, requires = "stats")]
        exact: bool,
        #[arg(long, default_value = DEFAULT_METRICS_ADDR)]
        debug_addr: String,
    },
    /// Stream this node's view changes as they happen (`+`/`-` lines), from a running agent.
    Watch {
        #[arg(long, default_value = DEFAULT_METRICS_ADDR)]
        debug_addr: String,
    },
    /// What happens to a packet: runs packets through the real programs on private maps.
    Trace(cli::trace::TraceArgs),
    /// (Internal) the child side of `trace --path connect`.
    #[command(hide = true)]
    TraceProbe,
    /// Detach every program and remove every pin the agent made; with `--kube-proxy`,
    /// remove kube-proxy's leftovers instead (as `kube-proxy --cleanup`).
    Cleanup {
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        bpffs: PathBuf,
        /// Remove what kube-proxy leaves in this network namespace (its iptables chains,
        /// nftables tables, IPVS services and kube-ipvs0), reporting what was removed and
        /// what was left; our own pins are not touched. Exit status 1 if a step failed.
        #[arg(long)]
        kube_proxy: bool,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // Records from the BPF programs are already filtered by --bpf-log-level.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,proxy_ebpf=trace")),
        )
        // Each record cut to cli::log::MAX_RECORD bytes: no body quoted whole.
        .with_writer(cli::log::Capped(std::io::stderr))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    // Before the runtime starts threads: setns only moves the calling thread.
    if let Some(ns) = &cli.netns {
        netns::enter(ns)?;
    }
    let result = match cli.cmd {
        Cmd::Run(args) => {
            let runtime = tokio::runtime::Runtime::new()?;
            let result = runtime.block_on(cli::run::run(*args));
            // Dropping the runtime would wait for every blocking task (a resolver's lookup
            // of the API server's name that hangs): the pinned programs serve on, nothing
            // is left to save, and SIGTERM must end the process.
            runtime.shutdown_timeout(SHUTDOWN_GRACE);
            result
        }
        Cmd::Serve(args) => {
            let runtime = tokio::runtime::Runtime::new()?;
            let result = runtime.block_on(cli::serve::serve(*args));
            runtime.shutdown_timeout(SHUTDOWN_GRACE);
            result
        }
        Cmd::Dump {
            view: true,
            json,
            debug_addr,
            ..
        } => cli::dump::dump_view(&debug_addr, json),
        Cmd::Dump {
            model: true,
            debug_addr,
            ..
        } => cli::dump::dump_model(&debug_addr),
        Cmd::Dump {
            stats: true,
            bpffs,
            json,
            exact,
            ..
        } => cli::dump::dump_stats(&bpffs, json, exact),
        Cmd::Dump { bpffs, json, .. } => cli::dump::dump(&bpffs, json),
        Cmd::Watch { debug_addr } => cli::agent_client::watch(&debug_addr),
        // 1 means one thing: a packet differs. Anything else that stops a trace (a
        // malformed file or packet, a missing file, no arguments) is 2, like clap's usage
        // errors.
        Cmd::Trace(args) => cli::trace::trace(args).or_else(|e| {
            if cli::output::closed(&e) {
                return Err(e);
            }
            eprintln!("Error: {e:#}");
            std::process::exit(cli::trace::EXIT_BAD_SCENARIO)
        }),
        Cmd::TraceProbe => proxy_agent::trace::connect::probe_main(),
        Cmd::Cleanup { bpffs, kube_proxy } => cli::cleanup::cleanup(&bpffs, kube_proxy),
    };
    match result {
        // `dump | head`: the reader has what it wanted.
        Err(e) if cli::output::closed(&e) => Ok(()),
        other => other,
    }
}
