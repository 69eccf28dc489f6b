//! `proxy-agent run`: the flags over the config file, then the agent's wiring — the
//! dataplane, the source, the HTTP endpoints, the conntrack collector and the runner.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use clap::Args;
use proxy_agent::{
    config::{BpfLogLevel, CgroupChoice, Config, LocalDetector, TcAttachMode, XdpMode},
    dataplane::bpf::{self, BpfDataplane, InterfaceSelector},
    runner::{self, Timing, status::ConntrackFill},
    source,
};

use super::source::SourceArgs;

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
    fn info(&self, name_override: Option<&str>) -> Result<proxy_agent::model::NodeInfo> {
        Ok(proxy_agent::model::NodeInfo {
            name: proxy_agent::source::node_name(name_override)?,
            labels: self.node_labels.iter().cloned().collect(),
            addresses: self.node_ips.clone(),
            ..Default::default()
        })
    }
}

pub async fn run(args: RunArgs) -> Result<()> {
    let cfg = args.config()?;
    // Before anything is attached: a typo must not leave a node with programs and no source.
    if matches!(args.source, SourceKind::Files) {
        args.from.existing_manifests()?;
    }
    let status = runner::Status::default();
    let opts = bpf::Options {
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
    };
    bpf::check_masquerade_ports(cfg.conntrack.masquerade_ports)?;
    tracing::info!(cgroup = ?opts.cgroup, interfaces = ?cfg.interfaces, "starting");
    let timing = Timing {
        min_interval: cfg.min_sync_period,
        resync: cfg.sync_period.max(Duration::from_secs(1)),
        ..Timing::default()
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
        node_port_addresses: cfg.node_port_addresses.clone(),
        node_port_primary: cfg.node_port_primary,
        node_port_range: cfg.node_port_range,
        localhost_node_ports: cfg.localhost_node_ports,
        service_proxy_name: cfg.service_proxy_name.clone(),
        scheduler: cfg.scheduler,
        lb_mode: cfg.lb_mode,
        maglev_table_len: cfg.maglev_table_len,
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::watch::channel(None);
    match args.source.clone() {
        SourceKind::Server(servers) => {
            let servers = if servers.is_empty() {
                cfg.feed_servers.clone()
            } else {
                servers
            };
            anyhow::ensure!(
                !servers.is_empty(),
                "--source server names no server: give server=ADDR or ebpf.feed.servers"
            );
            let flags = args.feed_cert.clone().map(|cert| {
                [
                    cert,
                    args.feed_key.clone().unwrap_or_default(),
                    args.feed_ca.clone().unwrap_or_default(),
                ]
            });
            let tls = flags
                .or_else(|| cfg.feed_tls.clone())
                .map(|[cert, key, ca]| proxy_agent::wire::tls::TlsFiles { cert, key, ca });
            let link = status.clone();
            let opts = proxy_agent::feed::FeedOptions {
                servers,
                node,
                tls,
                on_link: std::sync::Arc::new(move |up| {
                    link.source_link(up, std::time::Instant::now())
                }),
                prefer_every: proxy_agent::feed::PREFER_EVERY,
            };
            // No server yet is a link not yet made: /healthz counts from now.
            status.source_link(false, std::time::Instant::now());
            tokio::spawn(proxy_agent::feed::run(opts, tx));
        }
        SourceKind::Files => {
            let dir = args.from.manifests.clone();
            tokio::spawn(async move {
                if let Err(e) = source::files::follow::run(dir, node, tx).await {
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
            let counters = status.api_counters();
            let client = source::api_server::client(config, &counters)?;
            let opts = source::kube::KubeOptions {
                node_name: node.name.clone(),
                label_selector: source::kube::label_selector(cfg.service_proxy_name.as_deref()),
                counters,
                // The runner stages the first programming as the lists arrive.
                stream_first_list: true,
                // The cluster's nodes, the only senders DSR believes: one more watch.
                all_nodes: true,
                ..Default::default()
            };
            let status = status.clone();
            tokio::spawn(async move {
                source::api_server::wait_reachable(&client, &url).await;
                // Beside the source, never before it: an events endpoint that does not
                // answer must not leave the node unprogrammed.
                let (events, name) = (client.clone(), node.name.clone());
                tokio::spawn(async move {
                    if let Err(e) = source::events::announce_start(events, &name).await {
                        tracing::warn!(error = format!("{e:#}"), "no Starting event");
                        status.count_event_failure();
                    }
                });
                source::kube::run(client, opts, tx).await
            });
        }
    }
    // After the source is under way: its lists (seconds at 100k Services) arrive while
    // the programs load and the maps are made; the runner stages them from then on.
    let mut dataplane = BpfDataplane::start(&opts)?;
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
    use proxy_agent::http_server::Endpoints;
    for (addr, endpoints) in [
        (&cfg.healthz_bind_address, Endpoints::Healthz),
        (&cfg.metrics_bind_address, Endpoints::Metrics),
        (&cfg.debug_bind_address, Endpoints::Debug),
    ] {
        if addr.is_empty() {
            continue;
        }
        let (addr, st, maps) = (addr.clone(), status.clone(), opts.pin_dir.join("maps"));
        let service_metrics = cfg.service_metrics;
        tokio::spawn(async move {
            // A port that is taken is retried; an address that does not parse is reported.
            // Proxying goes on either way.
            if let Err(e) =
                proxy_agent::http_server::serve(&addr, endpoints, st, Some(maps), service_metrics)
                    .await
            {
                tracing::error!(error = format!("{e:#}"), ?endpoints, "endpoint unavailable");
            }
        });
    }
    // Stops when dropped, as this function returns.
    let _collector = {
        let status = status.clone();
        bpf::conntrack_gc::spawn(opts.pin_dir.join("maps"), move |st| {
            let fill = ConntrackFill {
                answered: st.answered,
                answered_capacity: st.answered_capacity,
                new: st.new,
                new_capacity: st.new_capacity,
                collected_total: 0,
                evicted_total: 0,
            };
            status.record_conntrack(fill, st.collected, st.evicted);
        })?
    };
    runner::run(rx, view_cfg, &mut dataplane, timing, status, shutdown).await
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
