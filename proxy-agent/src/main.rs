//! `proxy-agent`: run the service proxy, inspect what the kernel holds, clean up.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result};
use clap::{Args, Parser, Subcommand};
use proxy_agent::{
    config::Config,
    dataplane::bpf::{
        self, AttachOptions, BpfDataplane, InterfaceSelector, MapSet, writer::words_addr,
    },
    netns, source,
    sync::{self, SyncTiming},
};

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
    Run(Box<RunArgs>),
    /// Show what the pinned maps hold (works while the agent is down) — with `--stats`,
    /// traffic per frontend and backend — or, from a running agent's debug endpoint, this
    /// node's view (`--view`) or the model (`--model`).
    Dump {
        #[arg(long, default_value = DEFAULT_BPFFS)]
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
        #[arg(long, default_value = DEFAULT_DEBUG_ADDR)]
        debug_addr: String,
    },
    /// Stream this node's view changes as they happen (`+`/`-` lines), from a running agent.
    Watch {
        #[arg(long, default_value = DEFAULT_DEBUG_ADDR)]
        debug_addr: String,
    },
    /// What happens to a packet: runs packets through the real programs on private maps.
    Trace(TraceArgs),
    /// (Internal) the child side of `trace --path connect`.
    #[command(hide = true)]
    TraceProbe,
    /// Detach every program and remove every pin the agent made; with `--kube-proxy`,
    /// remove kube-proxy's leftovers instead (as `kube-proxy --cleanup`).
    Cleanup {
        #[arg(long, default_value = DEFAULT_BPFFS)]
        bpffs: PathBuf,
        /// Remove what kube-proxy leaves in this network namespace (its iptables chains,
        /// nftables tables, IPVS services and kube-ipvs0), reporting what was removed and
        /// what was left; our own pins are not touched. Exit status 1 if a step failed.
        #[arg(long)]
        kube_proxy: bool,
    },
}

const DEFAULT_BPFFS: &str = "/sys/fs/bpf/proxy-agent";
/// Where `dump --view`, `dump --model` and `watch` find the agent: its metrics address
/// (kube-proxy's metricsBindAddress), which serves the debug views too.
const DEFAULT_DEBUG_ADDR: &str = "127.0.0.1:10249";

#[derive(Args)]
struct RunArgs {
    /// kube-proxy's KubeProxyConfiguration file (plus our `ebpf:` section); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Where Services and EndpointSlices come from.
    #[arg(long, value_enum, default_value = "files")]
    source: SourceKind,
    /// Folder of Kubernetes manifests (Services, EndpointSlices), re-read on change
    /// (`--source files`).
    #[arg(long, default_value = "deploy/examples")]
    manifests: PathBuf,
    /// kubeconfig for `--source kube`; default: the config file's, else in-cluster, else
    /// ~/.kube/config.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The API server's URL for `--source kube` (`https://HOST:PORT`), overriding the
    /// kubeconfig's; with no kubeconfig, used with the in-cluster ServiceAccount
    /// credentials (the in-cluster address is a ClusterIP that only a proxy serves).
    #[arg(long, env = "PROXY_AGENT_API_SERVER")]
    api_server: Option<String>,
    /// Folder on a bpffs where maps and links are pinned [default: /sys/fs/bpf/proxy-agent].
    #[arg(long)]
    bpffs: Option<PathBuf>,
    /// cgroup v2 folder for the connect-time hooks; `auto` finds the cgroup2 mount
    /// (every process on the node), `none` leaves them out [default: auto].
    #[arg(long)]
    cgroup: Option<String>,
    /// Interfaces for the per-packet classifier (comma-separated names or `*` globs such
    /// as `veth*`), now and as they appear; `auto` is every interface with an Ethernet
    /// header except loopback. Devices without one (WireGuard, tun, ipip) are skipped
    /// [default: none].
    #[arg(long, value_delimiter = ',')]
    interfaces: Option<Vec<String>>,
    /// How the classifier is hooked to those interfaces: `tcx` (bpf links, Linux 6.6),
    /// `clsact` (filters on a clsact qdisc, older kernels), `auto`: tcx where the kernel
    /// has it [default: auto].
    #[arg(long)]
    tc_attach: Option<String>,
    /// Level of log messages from the BPF programs: off, error, warn, info, debug, trace
    /// [default: warn].
    #[arg(long)]
    bpf_log_level: Option<String>,
    /// Minimum interval between syncs, in milliseconds (coalesces bursts) [default: 100].
    #[arg(long)]
    min_sync_ms: Option<u64>,
    /// Periodic full resync, in seconds [default: 30].
    #[arg(long)]
    resync_s: Option<u64>,
    /// Serve only Services labelled service.kubernetes.io/service-proxy-name=NAME (and
    /// unlabelled ones).
    #[arg(long)]
    service_proxy_name: Option<String>,
    /// An extra debug endpoint (model, view, watch, metrics; the metrics address serves them
    /// too); `off` disables [default: off].
    #[arg(long)]
    debug_addr: Option<String>,
    #[command(flatten)]
    node: NodeArgs,
}

impl RunArgs {
    /// Defaults, then the config file, then flags.
    fn config(&self) -> Result<Config> {
        let mut cfg = match &self.config {
            Some(path) => {
                let (cfg, warnings) = Config::from_file(path)?;
                for w in warnings {
                    tracing::warn!(config = %path.display(), "{w}");
                }
                cfg
            }
            None => Config::default(),
        };
        if let Some(v) = &self.bpffs {
            cfg.bpffs = v.display().to_string();
        }
        if let Some(v) = &self.cgroup {
            cfg.cgroup = v.clone();
        }
        if let Some(v) = &self.interfaces {
            cfg.interfaces = v.iter().filter(|s| !s.is_empty()).cloned().collect();
        }
        if let Some(v) = &self.tc_attach {
            cfg.tc_attach = v.clone();
        }
        if let Some(v) = &self.bpf_log_level {
            cfg.bpf_log_level = v.clone();
        }
        if let Some(v) = self.min_sync_ms {
            cfg.min_sync_period = Duration::from_millis(v);
        }
        if let Some(v) = self.resync_s {
            cfg.sync_period = Duration::from_secs(v.max(1));
        }
        if let Some(v) = &self.service_proxy_name {
            cfg.service_proxy_name = Some(v.clone());
        }
        if let Some(v) = &self.debug_addr {
            cfg.debug_bind_address = if v == "off" { String::new() } else { v.clone() };
        }
        if let Some(v) = &self.kubeconfig {
            cfg.kubeconfig = Some(v.display().to_string());
        }
        if let Some(v) = self.api_server.as_ref().filter(|v| !v.is_empty()) {
            cfg.api_server = Some(v.clone());
        }
        if let Some(v) = &self.node.node_name {
            cfg.hostname_override = Some(v.clone());
        }
        cfg.validate().map_err(anyhow::Error::msg)?;
        Ok(cfg)
    }
}

#[derive(Args)]
struct TraceArgs {
    /// A scenario file (../shared/scenarios/README.md); exit status 1 if any packet
    /// differs from its `expect`.
    #[arg(long, conflicts_with_all = ["objects", "packet"])]
    scenario: Option<PathBuf>,
    /// Services and EndpointSlices (a folder or file of manifests), for `--packet`.
    #[arg(long, requires = "packet", conflicts_with = "live")]
    objects: Option<PathBuf>,
    /// One packet: `tcp 10.244.0.3:40000 -> 10.96.0.10:80`.
    #[arg(long)]
    packet: Option<String>,
    /// Trace `--packet` against a running node's maps (copied from its pins; never written).
    #[arg(long, requires = "packet")]
    live: bool,
    /// The running node's pin folder, for `--live`.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    bpffs: PathBuf,
    /// JSON lines instead of text.
    #[arg(long)]
    json: bool,
    /// Which datapath: the per-packet classifier (`tc`), real connects through the
    /// connect-time hooks (`connect`, pod- and node-sourced packets), or `both`.
    #[arg(long, value_enum, default_value = "tc")]
    path: TracePath,
    /// The node's addresses (for `--packet`; repeatable).
    #[arg(long = "node-ip")]
    node_ips: Vec<std::net::IpAddr>,
    /// The pod network (for `--packet`; repeatable); none: pod traffic is not told apart.
    #[arg(long = "cluster-cidr")]
    cluster_cidrs: Vec<ipnet::IpNet>,
    #[arg(long)]
    masquerade_all: bool,
    #[arg(long, default_value = "node-a")]
    node_name: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TracePath {
    Tc,
    Connect,
    Both,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum SourceKind {
    /// A folder of YAML manifests (the embedded default; no cluster needed).
    Files,
    /// The Kubernetes API server.
    Kube,
}

/// Who this node is, for the file source (the API-server source reads the Node object).
#[derive(Args)]
struct NodeArgs {
    /// This node's name (kube-proxy's hostnameOverride; the DaemonSet passes the
    /// downward API's spec.nodeName as NODE_NAME) [default: the host name, lowercased].
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// This node's addresses, for NodePorts (repeatable).
    #[arg(long = "node-ip")]
    node_ips: Vec<std::net::IpAddr>,
    /// A node label, `key=value` (repeatable; topology.kubernetes.io/zone matters).
    #[arg(long = "node-label", value_parser = parse_label)]
    node_labels: Vec<(String, String)>,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

impl NodeArgs {
    fn info(&self, name_override: Option<&str>) -> Result<proxy_agent::model::NodeInfo> {
        Ok(proxy_agent::model::NodeInfo {
            name: proxy_agent::node_name(name_override)?,
            labels: self.node_labels.iter().cloned().collect(),
            addresses: self.node_ips.clone(),
            ..Default::default()
        })
    }
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // Records from the BPF programs are already filtered by --bpf-log-level.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,proxy_ebpf=trace")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    // Before the runtime starts threads: setns only moves the calling thread.
    if let Some(ns) = &cli.netns {
        netns::enter(ns)?;
    }
    match cli.cmd {
        Cmd::Run(args) => tokio::runtime::Runtime::new()?.block_on(run(*args)),
        Cmd::Dump {
            view: true,
            json,
            debug_addr,
            ..
        } => dump_view(&debug_addr, json),
        Cmd::Dump {
            model: true,
            debug_addr,
            ..
        } => {
            println!("{}", fetch(&debug_addr, "/debug/model")?);
            Ok(())
        }
        Cmd::Dump {
            stats: true,
            bpffs,
            json,
            exact,
            ..
        } => dump_stats(&bpffs, json, exact),
        Cmd::Dump { bpffs, json, .. } => dump(&bpffs, json),
        Cmd::Watch { debug_addr } => watch(&debug_addr),
        // 1 means one thing: a packet differs. Anything else that stops a trace (a
        // malformed file or packet, a missing file, no arguments) is 2, like clap's usage
        // errors.
        Cmd::Trace(args) => trace(args).or_else(|e| {
            eprintln!("Error: {e:#}");
            std::process::exit(EXIT_BAD_SCENARIO)
        }),
        Cmd::TraceProbe => proxy_agent::trace::connect::probe_main(),
        Cmd::Cleanup {
            kube_proxy: true, ..
        } => {
            let report = proxy_agent::kube_proxy_cleanup::cleanup();
            println!("{report}");
            if report.count(proxy_agent::kube_proxy_cleanup::Outcome::Failed) > 0 {
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Cleanup { bpffs, .. } => {
            let report = bpf::cleanup(&bpffs)?;
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
    }
}

async fn run(args: RunArgs) -> Result<()> {
    let cfg = args.config()?;
    // Before anything is attached: a typo must not leave a node with programs and no source.
    if matches!(args.source, SourceKind::Files) && !args.manifests.exists() {
        anyhow::bail!(
            "--manifests {}: no such file or folder",
            args.manifests.display()
        );
    }
    let status = sync::Status::default();
    let opts = AttachOptions {
        pin_dir: PathBuf::from(&cfg.bpffs),
        cgroup: resolve_cgroup(&cfg.cgroup)?,
        interfaces: InterfaceSelector::parse(&cfg.interfaces)
            .context("--interfaces (ebpf.interfaces)")?,
        tc_attach: cfg
            .tc_attach
            .parse()
            .map_err(|e| anyhow::anyhow!("--tc-attach (ebpf.tcAttach): {e}"))?,
        bpf_log_level: log_level(&cfg.bpf_log_level)?,
        conntrack_entries: cfg
            .conntrack
            .table_entries(std::thread::available_parallelism().map_or(1, |n| n.get())),
        attach_failures: status.attach_failures(),
        map_sizes: cfg.map_sizes,
    };
    proxy_agent::dataplane::bpf::check_masquerade_ports(cfg.conntrack.masquerade_ports)?;
    tracing::info!(cgroup = ?opts.cgroup, interfaces = ?cfg.interfaces, "starting");
    let mut dataplane = BpfDataplane::start(&opts)?;
    {
        let mut ebpf = dataplane
            .ebpf
            .lock()
            .map_err(|_| anyhow::anyhow!("the BPF object's lock is poisoned"))?;
        spawn_program_logger(&mut ebpf);
    }
    if let Some(watch) = dataplane.take_interface_watch() {
        tokio::spawn(async move {
            // Interfaces already served keep their classifier; new ones wait for a restart.
            if let Err(e) = watch.run().await {
                tracing::error!(error = format!("{e:#}"), "no longer following interfaces");
            }
        });
    }
    let timing = SyncTiming {
        min_interval: cfg.min_sync_period,
        resync: cfg.sync_period.max(Duration::from_secs(1)),
        ..SyncTiming::default()
    };
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down; pinned programs keep serving traffic");
    };
    let node = args.node.info(cfg.hostname_override.as_deref())?;
    use proxy_agent::config::LocalDetector;
    if cfg.local_detector == LocalDetector::NodeCidr && matches!(args.source, SourceKind::Files) {
        anyhow::bail!(
            "detectLocalMode NodeCIDR reads this Node's spec.podCIDRs: it needs --source kube"
        );
    }
    let view_cfg = proxy_agent::model::ViewConfig {
        pod_cidrs: match &cfg.local_detector {
            LocalDetector::ClusterCidr(nets) => nets.clone(),
            LocalDetector::NodeCidr | LocalDetector::None => Vec::new(),
        },
        pod_cidrs_from_node: cfg.local_detector == LocalDetector::NodeCidr,
        masquerade_all: cfg.masquerade_all,
        conntrack: cfg.conntrack.clone(),
        node_port_addresses: cfg.node_port_addresses.clone(),
        node_port_primary: cfg.node_port_primary,
        node_port_range: cfg.node_port_range,
        localhost_node_ports: cfg.localhost_node_ports,
        service_proxy_name: cfg.service_proxy_name.clone(),
        scheduler: cfg.scheduler,
        maglev_table_len: cfg.maglev_table_len,
    };
    let (tx, rx) = tokio::sync::watch::channel(None);
    match args.source {
        SourceKind::Files => {
            let dir = args.manifests.clone();
            tokio::spawn(async move {
                if let Err(e) = source::manifest_watch::run(dir, node, tx).await {
                    tracing::error!(error = format!("{e:#}"), "file source stopped");
                }
            });
        }
        SourceKind::Kube => {
            let api = source::api_server::ApiServerOptions {
                kubeconfig: cfg.kubeconfig.clone(),
                api_server: cfg.api_server.clone(),
            };
            let config = source::api_server::client_config(&api).await?;
            let url = config.cluster_url.to_string();
            let client = kube::Client::try_from(config).context("building the API client")?;
            let selector = source::kube::label_selector(cfg.service_proxy_name.as_deref());
            tokio::spawn(async move {
                source::api_server::wait_reachable(&client, &url).await;
                source::events::announce_start(client.clone(), &node.name).await;
                source::kube::run(client, node.name, selector, tx).await
            });
        }
    }
    use proxy_agent::debug::Endpoints;
    for (addr, endpoints) in [
        (&cfg.healthz_bind_address, Endpoints::Healthz),
        (&cfg.metrics_bind_address, Endpoints::Metrics),
        (&cfg.debug_bind_address, Endpoints::Debug),
    ] {
        if addr.is_empty() {
            continue;
        }
        let (addr, st, maps) = (addr.clone(), status.clone(), opts.pin_dir.join("maps"));
        tokio::spawn(async move {
            // An endpoint that cannot listen is reported; proxying goes on without it.
            if let Err(e) = proxy_agent::debug::serve(&addr, endpoints, st, Some(maps)).await {
                tracing::error!(error = format!("{e:#}"), ?endpoints, "endpoint unavailable");
            }
        });
    }
    spawn_conntrack_collector(opts.pin_dir.join("maps"), status.clone());
    sync::run(rx, view_cfg, &mut dataplane, timing, status, shutdown).await
}

/// Expires flows by their state's limits every `ct_collector::INTERVAL`, on its own
/// handle of the pinned maps, and publishes the tables' fill.
fn spawn_conntrack_collector(maps_dir: PathBuf, status: sync::Status) {
    use proxy_agent::{dataplane::bpf::ct_collector, sync::status::ConntrackFill};
    tokio::task::spawn_blocking(move || {
        let mut maps = None;
        loop {
            std::thread::sleep(ct_collector::INTERVAL);
            if maps.is_none() {
                maps = MapSet::open_pinned(&maps_dir)
                    .inspect_err(|e| {
                        tracing::warn!(error = format!("{e:#}"), "conntrack collector: no maps")
                    })
                    .ok();
            }
            let Some(m) = maps.as_mut() else { continue };
            // While flows from before us (kube-proxy's) are left to netfilter, follow
            // its table: they go from the map as they end there.
            if m.netfilter_flows.keys().next().is_some()
                && let Err(e) = bpf::sync_netfilter_flows(m)
            {
                tracing::warn!(error = format!("{e:#}"), "netfilter flows not refreshed");
            }
            match ct_collector::collect(m, ct_collector::monotonic_ns()) {
                Ok(st) => {
                    tracing::debug!(?st, "conntrack collected");
                    let fill = ConntrackFill {
                        answered: st.answered,
                        answered_capacity: st.answered_capacity,
                        new: st.new,
                        new_capacity: st.new_capacity,
                        collected_total: 0,
                    };
                    status.record_conntrack(fill, st.collected);
                }
                Err(e) => tracing::warn!(error = format!("{e:#}"), "conntrack collector failed"),
            }
        }
    });
}

/// Forwards aya-log records from the programs to our tracing output.
fn spawn_program_logger(ebpf: &mut aya::Ebpf) {
    let logger = match aya_log::EbpfLogger::init(ebpf) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "BPF program logs unavailable");
            return;
        }
    };
    // SAFETY: the logger owns its ring-buffer fd; flushing neither closes nor replaces it.
    let fd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    };
    let Ok(mut fd) = fd else {
        tracing::warn!("BPF program logs unavailable: cannot poll the ring buffer");
        return;
    };
    tokio::spawn(async move {
        loop {
            let Ok(mut guard) = fd.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
}

fn log_level(name: &str) -> Result<u8> {
    Ok(match name {
        "off" => 0,
        "error" => 1,
        "warn" => 2,
        "info" => 3,
        "debug" => 4,
        "trace" => 5,
        other => anyhow::bail!("unknown --bpf-log-level {other:?}"),
    })
}

/// `auto`: the cgroup2 mount point from /proc/self/mountinfo.
fn resolve_cgroup(arg: &str) -> Result<Option<PathBuf>> {
    match arg {
        "none" | "" => Ok(None),
        "auto" => Ok(Some(proxy_agent::cgroup2_mount()?)),
        path => Ok(Some(PathBuf::from(path))),
    }
}

/// Exit status for a scenario file that cannot be used at all.
const EXIT_BAD_SCENARIO: i32 = 2;

/// The largest scenario file read (`--scenario /dev/zero` once grew to 10 GB).
const MAX_SCENARIO_BYTES: u64 = 64 << 20;

fn read_scenario(path: &Path) -> Result<String> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_file() {
        anyhow::bail!("{}: not a regular file", path.display());
    }
    if meta.len() > MAX_SCENARIO_BYTES {
        anyhow::bail!(
            "{}: {} bytes, larger than the {MAX_SCENARIO_BYTES} a scenario may be",
            path.display(),
            meta.len()
        );
    }
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn trace(args: TraceArgs) -> Result<()> {
    use proxy_agent::trace::{self, scenario};
    if args.live {
        let spec = args.packet.as_deref().context("--live needs --packet")?;
        let packet = trace::parse_packet_spec(spec).map_err(anyhow::Error::msg)?;
        let outcomes = trace::run_live(&args.bpffs, std::slice::from_ref(&packet))?;
        for o in &outcomes {
            if args.json {
                println!("{}", serde_json::to_string(o)?);
            } else {
                println!("path: {}\n{}", o.path, trace::describe(o, None));
            }
        }
        return Ok(());
    }
    let cases = match (&args.scenario, &args.packet, &args.objects) {
        (Some(path), _, _) => {
            let text = read_scenario(path)?;
            match scenario::parse(&text) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{}: {e}", path.display());
                    std::process::exit(EXIT_BAD_SCENARIO);
                }
            }
        }
        (None, Some(spec), Some(objects)) => {
            let packet = trace::parse_packet_spec(spec).map_err(anyhow::Error::msg)?;
            let (model, errors) = source::files::load(objects)?;
            for e in errors {
                tracing::warn!(error = %e, "skipping manifest");
            }
            vec![scenario::Case {
                id: "packet".into(),
                node: scenario::Node {
                    info: proxy_agent::model::NodeInfo {
                        name: args.node_name.clone(),
                        addresses: args.node_ips.clone(),
                        ..Default::default()
                    },
                    view: proxy_agent::model::ViewConfig {
                        pod_cidrs: args.cluster_cidrs.clone(),
                        masquerade_all: args.masquerade_all,
                        ..Default::default()
                    },
                },
                model,
                packets: vec![packet],
            }]
        }
        _ => anyhow::bail!("give --scenario FILE, or --objects DIR and --packet SPEC"),
    };
    let opts = trace::TraceOptions {
        connect_probe: (args.path != TracePath::Tc)
            .then(std::env::current_exe)
            .transpose()
            .context("locating this executable for the connect probe")?,
        skip_tc: args.path == TracePath::Connect,
    };
    let outcomes = trace::run(&cases, &opts)?;
    let packets: Vec<&scenario::Packet> = cases.iter().flat_map(|c| &c.packets).collect();
    let mut current_case = String::new();
    for (i, o) in &outcomes {
        let p = packets.get(*i).copied();
        if args.json {
            println!("{}", serde_json::to_string(o)?);
            continue;
        }
        let heading = format!("case {} (path: {})", o.case, o.path);
        if heading != current_case {
            println!("{heading}");
            current_case = heading;
        }
        println!("{}", trace::describe(o, p));
    }
    let failed = outcomes.iter().filter(|(_, o)| !o.ok()).count();
    if !args.json {
        println!(
            "\n{} packets, {} as expected, {failed} differ",
            outcomes.len(),
            outcomes.len() - failed
        );
    }
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}

fn fetch(addr: &str, path: &str) -> Result<String> {
    let url = format!("http://{addr}{path}");
    let mut resp = ureq::get(&url).call().with_context(|| {
        format!("asking the agent at {url} (is it running, with --debug-addr {addr}?)")
    })?;
    Ok(resp.body_mut().read_to_string()?)
}

fn dump_view(addr: &str, json: bool) -> Result<()> {
    let body = fetch(addr, "/debug/view")?;
    if json {
        println!("{body}");
        return Ok(());
    }
    let entries: Vec<serde_json::Value> = serde_json::from_str(&body).context("agent's view")?;
    println!(
        "{:<30} {:<13} {:<28} BACKENDS",
        "FRONTEND", "KIND", "SERVICE"
    );
    for e in entries {
        let st = &e["state"];
        let set = |b: &serde_json::Value| {
            let eps: Vec<&str> = b["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str())
                .collect();
            if eps.is_empty() {
                format!(
                    "none ({})",
                    b["when_empty"].as_str().unwrap_or("?").to_lowercase()
                )
            } else {
                eps.join(" ")
            }
        };
        let mut backends = set(&st["backends"]);
        if !st["internal"].is_null() {
            backends.push_str(&format!("  | internal: {}", set(&st["internal"])));
        }
        println!(
            "{:<30} {:<13} {:<28} {}",
            e["frontend"].as_str().unwrap_or(""),
            st["kind"].as_str().unwrap_or(""),
            st["service"].as_str().unwrap_or(""),
            backends
        );
    }
    Ok(())
}

fn watch(addr: &str) -> Result<()> {
    use std::io::{BufRead as _, Write as _};
    let url = format!("http://{addr}/debug/watch");
    let resp = ureq::get(&url)
        .config()
        .timeout_global(None)
        .build()
        .call()
        .with_context(|| format!("asking the agent at {url}"))?;
    let reader = std::io::BufReader::new(resp.into_body().into_reader());
    let mut out = std::io::stdout().lock();
    for line in reader.lines() {
        writeln!(out, "{}", line?)?;
        out.flush()?;
    }
    Ok(())
}

fn open_pins(bpffs: &Path) -> Result<MapSet> {
    MapSet::open_pinned(&bpffs.join("maps"))
        .with_context(|| format!("is an agent's state pinned under {}?", bpffs.display()))
}

/// `dump --stats`: every frontend's and backend's counts, as `ipvsadm -Ln --stats`.
fn dump_stats(bpffs: &Path, json: bool, exact: bool) -> Result<()> {
    let rows = bpf::stats::read(&open_pins(bpffs)?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", bpf::stats::render_table(&rows, exact));
    }
    Ok(())
}

fn dump(bpffs: &Path, json: bool) -> Result<()> {
    let maps = open_pins(bpffs)?;
    let mut rows = Vec::new();
    for entry in maps.services.iter() {
        let (key, value) = entry?;
        let mut backends = Vec::new();
        for slot in 0..u32::from(value.count) {
            let slot_key = proxy_common::BackendSlotKey {
                service_id: value.id,
                rev: value.rev,
                slot,
            };
            if let Ok(s) = maps.slots.get(&slot_key, 0)
                && let Ok(b) = maps.backends.get(&s.backend_id, 0)
            {
                backends.push(
                    std::net::SocketAddr::new(words_addr(b.addr, b.family), u16::from_be(b.port))
                        .to_string(),
                );
            }
        }
        rows.push(serde_json::json!({
            "frontend": std::net::SocketAddr::new(words_addr(key.addr, key.family), u16::from_be(key.port)).to_string(),
            "protocol": match key.proto {
                proxy_common::PROTO_UDP => "UDP",
                proxy_common::PROTO_SCTP => "SCTP",
                _ => "TCP",
            },
            "id": value.id,
            "rev": value.rev,
            "affinity_timeout_s": value.affinity_timeout_s,
            "backends": backends,
        }));
    }
    let counters = maps.counters()?;
    // Live sockets the connect-time hooks remember (entries go when a socket closes).
    let sockets = maps.sock_lb.keys().filter(Result::is_ok).count();
    // Per-packet flows (two entries each): answered, and not answered yet.
    let answered = maps.conntrack.keys().filter(Result::is_ok).count();
    let new = maps.conntrack_new.keys().filter(Result::is_ok).count();
    // Flows netfilter translated before the classifier was attached (kube-proxy's).
    let netfilter = maps.netfilter_flows.keys().filter(Result::is_ok).count();
    if json {
        let counters: serde_json::Map<String, serde_json::Value> = counters
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).into()))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "services": rows,
                "counters": counters,
                "sockets": sockets,
                "conntrack": {"answered": answered, "new": new},
                "netfilter_flows": netfilter,
            }))?
        );
    } else {
        println!(
            "{:<28} {:<5} {:>5} {:>4}  BACKENDS",
            "FRONTEND", "PROTO", "ID", "REV"
        );
        for r in &rows {
            println!(
                "{:<28} {:<5} {:>5} {:>4}  {}",
                r["frontend"].as_str().unwrap_or(""),
                r["protocol"].as_str().unwrap_or(""),
                r["id"].as_u64().unwrap_or(0),
                r["rev"].as_u64().unwrap_or(0),
                r["backends"]
                    .as_array()
                    .map(|b| b
                        .iter()
                        .filter_map(|v| v.as_str())
                        .collect::<Vec<_>>()
                        .join(" "))
                    .unwrap_or_default()
            );
        }
        println!("\nsockets tracked: {sockets}");
        println!("conntrack entries: {answered} answered, {new} new (two per flow)");
        println!("flows left to netfilter (translated before the classifier): {netfilter}\n");
        for (name, value) in counters {
            println!("{name:<24} {value}");
        }
    }
    Ok(())
}
