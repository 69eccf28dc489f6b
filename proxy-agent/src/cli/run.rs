//! `proxy-agent run`: the flags over the config file, then the agent's wiring — the
//! dataplane, the source, the HTTP endpoints, the conntrack collector and the runner.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use clap::Args;
use proxy_agent::{
    config::{BpfLogLevel, CgroupChoice, Config, LocalDetector, TcAttachMode, XdpMode},
    dataplane::bpf::{self, BpfDataplane, InterfaceSelector},
    model::{NodeInfo, ViewConfig},
    runner::{self, Timing, status::ConntrackFill},
    source::{self, SharedSnapshot},
};

use super::source::{SourceArgs, kube_client, spawn_files};

#[derive(Args)]
pub struct RunArgs {
    /// kube-proxy's KubeProxyConfiguration file (plus our `ebpf:` section); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Where Services and EndpointSlices come from: `files`, `kube` (the API server), or
    /// `server=ADDR[,ADDR…]` (`proxy-agent serve` replicas, any of which will do;
    /// `server` alone: those of `ebpf.feed.servers`).
    #[arg(long, value_parser = SourceKind::parse, default_value = "files")]
    source: SourceKind,
    /// With `--source server=`: this node's client certificate (kubelet's: CN
    /// `system:node:<name>`, O `system:nodes`), its key, and the CA of the servers'
    /// certificates; without them, plain text.
    #[arg(long, requires_all = ["feed_key", "feed_ca"])]
    feed_cert: Option<PathBuf>,
    #[arg(long, requires = "feed_cert")]
    feed_key: Option<PathBuf>,
    #[arg(long, requires = "feed_cert")]
    feed_ca: Option<PathBuf>,
    #[command(flatten)]
    from: SourceArgs,
    /// Folder on a bpffs where maps and links are pinned [default: /sys/fs/bpf/proxy-agent].
    #[arg(long)]
    bpffs: Option<PathBuf>,
    /// cgroup v2 folder for the connect-time hooks; `auto` finds the cgroup2 mount
    /// (every process on the node), `none` leaves them out [default: auto].
    #[arg(long)]
    cgroup: Option<CgroupChoice>,
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
    tc_attach: Option<TcAttachMode>,
    /// The XDP program on the served interfaces (`ebpf.xdp`): `native` (in the driver;
    /// refuses to start where a driver has none), `best-effort` (native, else generic per
    /// interface), `generic`, `off` [default: off].
    #[arg(long)]
    xdp: Option<XdpMode>,
    /// Level of log messages from the BPF programs: off, error, warn, info, debug, trace
    /// [default: warn].
    #[arg(long)]
    bpf_log_level: Option<BpfLogLevel>,
    /// Minimum interval between syncs, in milliseconds (coalesces bursts) [default: 10].
    #[arg(long)]
    min_sync_ms: Option<u64>,
    /// Periodic full resync, in seconds [default: 30].
    #[arg(long)]
    resync_s: Option<u64>,
    /// Serve only Services labelled service.kubernetes.io/service-proxy-name=NAME (and
    /// unlabelled ones).
    #[arg(long)]
    service_proxy_name: Option<String>,
    /// An extra debug endpoint (model, view, watch, metrics), served wherever it listens;
    /// a loopback metrics address serves them too, another one not; `off` disables
    /// [default: off].
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
            cfg.bpffs = v.clone();
        }
        if let Some(v) = &self.cgroup {
            cfg.cgroup = v.clone();
        }
        if let Some(v) = &self.interfaces {
            cfg.interfaces = v.iter().filter(|s| !s.is_empty()).cloned().collect();
        }
        if let Some(v) = self.tc_attach {
            cfg.tc_attach = v;
        }
        if let Some(v) = self.xdp {
            cfg.xdp = v;
        }
        if let Some(v) = self.bpf_log_level {
            cfg.bpf_log_level = v;
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
        if let Some(v) = &self.from.kubeconfig {
            cfg.kubeconfig = Some(v.display().to_string());
        }
        if let Some(v) = self.from.api_server.as_ref().filter(|v| !v.is_empty()) {
            cfg.api_server = Some(v.clone());
        }
        if let Some(v) = &self.node.node_name {
            cfg.hostname_override = Some(v.clone());
        }
        cfg.validate().map_err(anyhow::Error::msg)?;
        Ok(cfg)
    }
}

#[derive(Clone, Debug)]
pub enum SourceKind {
    /// A folder of YAML manifests (the embedded default; no cluster needed).
    Files,
    /// The Kubernetes API server.
    Kube,
    /// `proxy-agent serve` replicas (`host:port` each, checked when parsed).
    Server(Vec<String>),
}

impl SourceKind {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "files" => Ok(Self::Files),
            "kube" => Ok(Self::Kube),
            "server" => Ok(Self::Server(Vec::new())),
            _ => {
                let Some(list) = s.strip_prefix("server=") else {
                    return Err(format!(
                        "{s:?}: expected files, kube or server=ADDR[,ADDR...]"
                    ));
                };
                let addrs: Vec<String> = list
                    .split(',')
                    .map(str::trim)
                    .filter(|a| !a.is_empty())
                    .map(str::to_string)
                    .collect();
                if addrs.is_empty() {
                    return Err("server= names no address".into());
                }
                // Here, not at each connection: a bad address was retried for ever.
                for addr in &addrs {
                    proxy_agent::config::check_feed_server(addr)
                        .map_err(|e| format!("feed server {e}"))?;
                }
                Ok(Self::Server(addrs))
            }
        }
    }
}

/// Who this node is, for the file source (the API-server source reads the Node object).
#[derive(Args)]
pub struct NodeArgs {
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
    fn info(&self, name_override: Option<&str>) -> Result<NodeInfo> {
        Ok(NodeInfo {
            name: proxy_agent::source::node_name(name_override)?,
            labels: self.node_labels.iter().cloned().collect(),
            addresses: self.node_ips.clone(),
            ..Default::default()
        })
    }
}

/// Starts the agent's parts, each once, in the order the kernel needs them: the source
/// first (its first lists arrive while the programs load), then the dataplane, what
/// serves and collects beside it, and the runner last — which writes no map before the
/// source's first full sync (what arrives before it is only staged).
pub async fn run(args: RunArgs) -> Result<()> {
    let agent = Agent::new(args)?;
    let snapshots = agent.start_source().await?;
    // After the source is under way: its lists (seconds at 100k Services) arrive while
    // the programs load and the maps are made; the runner stages them from then on.
    let mut dataplane = agent.start_dataplane()?;
    agent.serve_http();
    // Stops when dropped, as this function returns.
    let _collector = agent.collect_conntrack()?;
    runner::run(
        snapshots,
        agent.view_config(),
        &mut dataplane,
        agent.timing(),
        agent.status,
        shutdown_signal(),
    )
    .await
}

/// What `run` decided from its flags and the config file before starting anything.
struct Agent {
    args: RunArgs,
    cfg: Config,
    status: runner::Status,
    node: NodeInfo,
    dataplane: bpf::Options,
}

impl Agent {
    /// The flags over the config file, and every check that can fail before anything is
    /// attached: a typo must not leave a node with programs and no source.
    fn new(args: RunArgs) -> Result<Self> {
        let cfg = args.config()?;
        if matches!(args.source, SourceKind::Files) {
            args.from.existing_manifests()?;
        }
        let status = runner::Status::default();
        let dataplane = dataplane_options(&cfg, &status)?;
        bpf::check_masquerade_ports(cfg.conntrack.masquerade_ports)?;
        tracing::info!(cgroup = ?dataplane.cgroup, interfaces = ?cfg.interfaces, "starting");
        let node = args.node.info(cfg.hostname_override.as_deref())?;
        if cfg.local_detector == LocalDetector::NodeCidr && matches!(args.source, SourceKind::Files)
        {
            anyhow::bail!(
                "detectLocalMode NodeCIDR reads this Node's spec.podCIDRs: it needs --source kube"
            );
        }
        Ok(Self {
            args,
            cfg,
            status,
            node,
            dataplane,
        })
    }

    /// The source `--source` names, under way: its snapshots.
    async fn start_source(&self) -> Result<Snapshots> {
        let (tx, rx) = tokio::sync::watch::channel(None);
        match &self.args.source {
            SourceKind::Server(servers) => self.start_feed(servers, tx)?,
            SourceKind::Files => {
                spawn_files(self.args.from.manifests.clone(), self.node.clone(), tx)
            }
            SourceKind::Kube => self.start_kube(tx).await?,
        }
        Ok(rx)
    }

    /// `--source server=`: the feed from `proxy-agent serve` replicas.
    fn start_feed(&self, servers: &[String], tx: SnapshotSender) -> Result<()> {
        let servers = if servers.is_empty() {
            self.cfg.feed_servers.clone()
        } else {
            servers.to_vec()
        };
        anyhow::ensure!(
            !servers.is_empty(),
            "--source server names no server: give server=ADDR or ebpf.feed.servers"
        );
        let flags = self.args.feed_cert.clone().map(|cert| {
            [
                cert,
                self.args.feed_key.clone().unwrap_or_default(),
                self.args.feed_ca.clone().unwrap_or_default(),
            ]
        });
        let tls = flags
            .or_else(|| self.cfg.feed_tls.clone())
            .map(|[cert, key, ca]| proxy_agent::feed::tls::TlsFiles { cert, key, ca });
        let link = self.status.clone();
        let opts = proxy_agent::source::feed::FeedOptions {
            servers,
            node: self.node.clone(),
            tls,
            on_link: std::sync::Arc::new(move |up| link.source_link(up, std::time::Instant::now())),
            prefer_every: proxy_agent::source::feed::PREFER_EVERY,
        };
        // No server yet is a link not yet made: /healthz counts from now.
        self.status.source_link(false, std::time::Instant::now());
        tokio::spawn(proxy_agent::source::feed::run(opts, tx));
        Ok(())
    }

    /// `--source kube`: the API server's watches, once it answers, and the "Starting"
    /// event beside them.
    async fn start_kube(&self, tx: SnapshotSender) -> Result<()> {
        let api = source::api_server::ApiServerOptions {
            kubeconfig: self.cfg.kubeconfig.clone(),
            api_server: self.cfg.api_server.clone(),
        };
        let counters = self.status.api_counters();
        let (client, url) = kube_client(&api, &counters).await?;
        let opts = source::kube::KubeOptions {
            node_name: self.node.name.clone(),
            label_selector: source::kube::label_selector(self.cfg.service_proxy_name.as_deref()),
            counters,
            // The runner stages the first programming as the lists arrive.
            stream_first_list: true,
            // The cluster's nodes, the only senders DSR believes: one more watch.
            all_nodes: true,
            ..Default::default()
        };
        let (status, name) = (self.status.clone(), self.node.name.clone());
        tokio::spawn(async move {
            source::api_server::wait_reachable(&client, &url).await;
            // Beside the source, never before it: an events endpoint that does not
            // answer must not leave the node unprogrammed.
            let events = client.clone();
            tokio::spawn(async move {
                if let Err(e) = source::events::announce_start(events, &name).await {
                    tracing::warn!(error = format!("{e:#}"), "no Starting event");
                    status.count_event_failure();
                }
            });
            source::kube::run(client, opts, tx).await
        });
        Ok(())
    }

    /// Loads and attaches the programs, with the pump of their log and the follower of
    /// new interfaces.
    fn start_dataplane(&self) -> Result<BpfDataplane> {
        let mut dataplane = BpfDataplane::start(&self.dataplane)?;
        {
            let mut ebpf = dataplane
                .ebpf
                .lock()
                .map_err(|_| anyhow::anyhow!("the BPF object's lock is poisoned"))?;
            bpf::program_log::spawn(&mut ebpf);
        }
        if let Some(follower) = dataplane.take_interface_follower() {
            tokio::spawn(async move {
                // Interfaces already served keep their classifier; new ones wait for a restart.
                if let Err(e) = follower.run().await {
                    tracing::error!(error = format!("{e:#}"), "no longer following interfaces");
                }
            });
        }
        Ok(dataplane)
    }

    /// The health, metrics and debug endpoints, each where the config puts it (empty:
    /// not served).
    fn serve_http(&self) {
        use proxy_agent::http_server::{self, Endpoints};
        for (addr, endpoints) in [
            (&self.cfg.healthz_bind_address, Endpoints::Healthz),
            (&self.cfg.metrics_bind_address, Endpoints::Metrics),
            (&self.cfg.debug_bind_address, Endpoints::Debug),
        ] {
            if addr.is_empty() {
                continue;
            }
            let (addr, st) = (addr.clone(), self.status.clone());
            let maps = self.dataplane.pin_dir.join("maps");
            let service_metrics = self.cfg.service_metrics;
            tokio::spawn(async move {
                // A port that is taken is retried; an address that does not parse is
                // reported. Proxying goes on either way.
                if let Err(e) =
                    http_server::serve(&addr, endpoints, st, Some(maps), service_metrics).await
                {
                    tracing::error!(error = format!("{e:#}"), ?endpoints, "endpoint unavailable");
                }
            });
        }
    }

    /// The conntrack collector on the pinned maps, its passes recorded in the status.
    fn collect_conntrack(&self) -> Result<bpf::conntrack_gc::Collector> {
        let status = self.status.clone();
        let collector = bpf::conntrack_gc::spawn(self.dataplane.pin_dir.join("maps"), move |st| {
            let fill = ConntrackFill {
                answered: st.answered,
                answered_capacity: st.answered_capacity,
                new: st.new,
                new_capacity: st.new_capacity,
                collected_total: 0,
                evicted_total: 0,
            };
            status.record_conntrack(fill, st.collected, st.evicted);
        })?;
        Ok(collector)
    }

    /// The node view's settings from the config.
    fn view_config(&self) -> ViewConfig {
        let cfg = &self.cfg;
        ViewConfig {
            pod_cidrs: match &cfg.local_detector {
                LocalDetector::ClusterCidr(nets) => nets.clone(),
                LocalDetector::NodeCidr | LocalDetector::None => Vec::new(),
            },
            pod_cidrs_from_node: cfg.local_detector == LocalDetector::NodeCidr,
            masquerade_all: cfg.masquerade_all,
            node_port_addresses: cfg.node_port_addresses.clone(),
            node_port_primary: cfg.node_port_primary,
            node_port_range: cfg.node_port_range,
            localhost_node_ports: cfg.localhost_node_ports,
            service_proxy_name: cfg.service_proxy_name.clone(),
            scheduler: cfg.scheduler,
            lb_mode: cfg.lb_mode,
            maglev_table_len: cfg.maglev_table_len,
            ..Default::default()
        }
    }

    /// The runner's timing from the config (kube-proxy's minSyncPeriod and syncPeriod).
    fn timing(&self) -> Timing {
        Timing {
            min_interval: self.cfg.min_sync_period,
            resync: self.cfg.sync_period.max(Duration::from_secs(1)),
            ..Timing::default()
        }
    }
}

type Snapshots = tokio::sync::watch::Receiver<Option<SharedSnapshot>>;
type SnapshotSender = tokio::sync::watch::Sender<Option<SharedSnapshot>>;

/// The dataplane's options from the config; the status hands out the counters the
/// dataplane shares with it.
fn dataplane_options(cfg: &Config, status: &runner::Status) -> Result<bpf::Options> {
    Ok(bpf::Options {
        pin_dir: cfg.bpffs.clone(),
        cgroup: match &cfg.cgroup {
            CgroupChoice::None => None,
            CgroupChoice::Auto => Some(bpf::cgroup2_mount()?),
            CgroupChoice::Path(p) => Some(p.clone()),
        },
        interfaces: InterfaceSelector::parse(&cfg.interfaces)
            .context("--interfaces (ebpf.interfaces)")?,
        tc_attach: cfg.tc_attach,
        xdp: cfg.xdp,
        xdp_status: status.xdp(),
        bpf_log_level: cfg.bpf_log_level,
        conntrack: cfg.conntrack.clone(),
        attach_failures: status.attach_failures(),
        hooks: status.hooks(),
        map_sizes: cfg.map_sizes,
    })
}

/// Resolves on SIGINT or SIGTERM: the agent ends, and the pinned programs serve on.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down; pinned programs keep serving traffic");
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    /// `--source server=::::` stops at parse time, naming the flag and the address (it
    /// was accepted and retried for ever as an invalid URI).
    #[test]
    fn a_feed_server_that_cannot_be_a_uri_is_refused_at_parse_time() {
        for bad in ["server=::::", "server=10.0.0.1:10270,10.0.0.2"] {
            let err = Cli::try_parse_from(["proxy-agent", "--source", bad])
                .err()
                .map(|e| e.to_string())
                .unwrap_or_else(|| panic!("{bad} accepted"));
            assert!(err.contains("--source") && err.contains(bad), "{err}");
        }
        let cli = Cli::try_parse_from(["proxy-agent", "--source", "server=10.0.0.1:1,[::1]:2"])
            .map_err(|e| e.to_string())
            .expect("valid servers");
        assert!(
            matches!(&cli.run.source, SourceKind::Server(s) if s.len() == 2),
            "{:?}",
            cli.run.source
        );
    }
}
