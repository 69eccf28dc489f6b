//! The agent's settings: kube-proxy's own `KubeProxyConfiguration` file (the fields that
//! apply to this proxy) plus our extra fields under `ebpf:`, in one typed config. Fields
//! we do not know, or know but do not support, are reported — never silently ignored.
//! Flags override the file.

mod duration;
mod file;

use std::{
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use thiserror::Error;

/// A config file that cannot be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

pub use self::duration::parse_duration;
use self::file::{Conntrack, EbpfSection, KubeProxyConfiguration};
pub use crate::dataplane::bpf::{BpfLogLevel, ConntrackOptions, MapSizes, TcAttachMode, XdpMode};
pub use crate::model::lb_mode::LbMode;
use crate::{
    dataplane::bpf::DEFAULT_PIN_DIR,
    model::{ViewConfig, schedule::Scheduler},
    runner::Timing,
};

/// Where `metricsBindAddress` listens by default (kube-proxy's); `dump --view`, `dump
/// --model` and `watch` ask the agent there.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:10249";
/// kube-proxy's default `healthzBindAddress`.
pub const DEFAULT_HEALTHZ_ADDR: &str = "0.0.0.0:10256";

/// Which cgroup v2 folder gets the connect-time hooks (`--cgroup`, `ebpf.cgroup`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CgroupChoice {
    /// The cgroup2 mount point: every process on the node.
    #[default]
    Auto,
    /// No connect-time hooks.
    None,
    Path(PathBuf),
}

impl FromStr for CgroupChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.trim() {
            "auto" => Self::Auto,
            "none" | "" => Self::None,
            path => Self::Path(PathBuf::from(path)),
        })
    }
}

/// How local (pod) traffic is told apart from other traffic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalDetector {
    /// Sources in the cluster's pod CIDRs (`clusterCIDR`).
    ClusterCidr(Vec<ipnet::IpNet>),
    /// Sources in this Node's `spec.podCIDRs` (API-server source only).
    NodeCidr,
    /// Not told apart: no `clusterCIDR` and no mode.
    None,
}

/// A duration field as kube-proxy reads it: absent, empty or zero (kubeadm writes `0s`
/// for what it leaves unset) keeps `default`.
fn duration_or(v: Option<&str>, field: &str, default: Duration) -> Result<Duration, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(default),
        Some(s) => {
            let d = parse_duration(s).map_err(|e| format!("{field}: {e}"))?;
            Ok(if d.is_zero() { default } else { d })
        }
    }
}

/// A port range, `FIRST-LAST`, both in `lowest..=65535`.
fn parse_port_range(text: &str, lowest: u16) -> Result<(u16, u16), String> {
    let (a, b) = text
        .split_once('-')
        .ok_or_else(|| format!("{text:?}: expected FIRST-LAST, e.g. 20000-29999"))?;
    let port = |s: &str| {
        s.trim()
            .parse::<u16>()
            .map_err(|e| format!("{s:?}: {e}"))
            .and_then(|p| {
                if p < lowest {
                    Err(format!("{p}: below {lowest}"))
                } else {
                    Ok(p)
                }
            })
    };
    let (a, b) = (port(a)?, port(b)?);
    if b < a {
        return Err(format!("{text:?}: the last port is below the first"));
    }
    Ok((a, b))
}

/// A listen address, `IP:PORT` with the port in 1–65535, as kube-proxy checks it: one
/// that cannot be bound must stop the start, not be retried for ever.
fn check_bind_address(addr: &str) -> Result<(), String> {
    let (_, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| format!("{addr:?}: expected IP:PORT, e.g. 0.0.0.0:10256"))?;
    match port.parse::<u16>() {
        Ok(0) | Err(_) => return Err(format!("{addr:?}: port {port:?} is not in 1-65535")),
        Ok(_) => {}
    }
    addr.parse::<std::net::SocketAddr>()
        .map(drop)
        .map_err(|_| format!("{addr:?}: expected IP:PORT, e.g. 0.0.0.0:10256 or [::]:10256"))
}

/// A feed server's address (`--source server=`, `ebpf.feed.servers`), `HOST:PORT` with
/// an IPv6 host in brackets: one the connection cannot use must stop the start, not be
/// retried for ever.
pub fn check_feed_server(addr: &str) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!(
            "{addr:?}: {why}; expected HOST:PORT, e.g. 10.0.0.1:10270, [fd00::1]:10270 or \
             feed.example:10270"
        ))
    };
    let Some((host, port)) = addr.rsplit_once(':') else {
        return bad("no port");
    };
    if let Some(inner) = host.strip_prefix('[') {
        if inner
            .strip_suffix(']')
            .and_then(|ip| ip.parse::<std::net::Ipv6Addr>().ok())
            .is_none()
        {
            return bad("not an IPv6 address in brackets");
        }
    } else if host.is_empty() {
        return bad("no host");
    } else if host.contains(':') {
        return bad("an IPv6 address goes in brackets");
    } else if !host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return bad("the host is neither an IP address nor a DNS name");
    }
    let port = match port.parse::<u16>() {
        Ok(0) | Err(_) => return bad("the port is not in 1-65535"),
        Ok(p) => p,
    };
    // The connection's URI is built from it: host and port, nothing else.
    match addr.parse::<http::uri::Authority>() {
        Ok(a) if a.host() == host && a.port_u16() == Some(port) => Ok(()),
        _ => bad("not a URI's host and port"),
    }
}

/// The agent's settings, after defaults, file and flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub local_detector: LocalDetector,
    pub masquerade_all: bool,
    pub localhost_node_ports: bool,
    pub node_port_addresses: Vec<ipnet::IpNet>,
    /// `nodePortAddresses` holds `primary`.
    pub node_port_primary: bool,
    /// The API server's `--service-node-port-range` (`ebpf.nodePortRange`): NodePorts
    /// from files outside it are refused; the API server's own are programmed as stored.
    pub node_port_range: (u16, u16),
    pub min_sync_period: Duration,
    pub sync_period: Duration,
    pub healthz_bind_address: String,
    pub metrics_bind_address: String,
    pub hostname_override: Option<String>,
    pub conntrack: ConntrackOptions,
    pub kubeconfig: Option<String>,
    /// The API server's URL (`ebpf.apiServer`), overriding the kubeconfig's or the
    /// in-cluster one (the `kubernetes` ClusterIP, which only a service proxy serves).
    pub api_server: Option<String>,
    pub bpffs: PathBuf,
    pub cgroup: CgroupChoice,
    pub interfaces: Vec<String>,
    /// How the classifier is hooked (`ebpf.tcAttach`).
    pub tc_attach: TcAttachMode,
    /// Whether and how the XDP program runs on the served interfaces (`ebpf.xdp`).
    pub xdp: XdpMode,
    /// Capacities of the service-side maps (`ebpf.mapSizes`).
    pub map_sizes: MapSizes,
    /// The node's scheduler: `ipvs.scheduler` (default `rr`) when `mode: ipvs`, else
    /// random; a Service's annotation overrides it.
    pub scheduler: Scheduler,
    /// Maglev table length for `sh`, `dh`, `mh` (`ebpf.maglevTableSize`).
    pub maglev_table_len: u32,
    /// `ebpf.loadBalancer.mode`: `snat` (the default), `dsr` or `hybrid`; a Service's
    /// annotation overrides it.
    pub lb_mode: LbMode,
    pub bpf_log_level: BpfLogLevel,
    pub service_proxy_name: Option<String>,
    /// An extra debug endpoint (model, view, watch); empty (the default) disables it: a
    /// loopback metrics address serves the same views (one that is not serves none).
    pub debug_bind_address: String,
    /// Per-Service series (`proxy_agent_service_*`) on every metrics address
    /// (`ebpf.serviceMetrics`); by default only where the object views are served.
    pub service_metrics: bool,
    /// `proxy-agent serve` replicas for `--source server` (`ebpf.feed.servers`).
    pub feed_servers: Vec<String>,
    /// This node's client certificate, its key and the servers' CA (`ebpf.feed.cert`,
    /// `.key`, `.ca`: all three or none).
    pub feed_tls: Option<[PathBuf; 3]>,
}

impl Default for Config {
    /// Each setting's default comes from the layer that owns it.
    fn default() -> Self {
        let view = ViewConfig::default();
        let timing = Timing::default();
        Self {
            local_detector: LocalDetector::None,
            masquerade_all: view.masquerade_all,
            localhost_node_ports: view.localhost_node_ports,
            node_port_addresses: Vec::new(),
            node_port_primary: false,
            node_port_range: view.node_port_range,
            min_sync_period: timing.min_interval,
            sync_period: timing.resync,
            healthz_bind_address: DEFAULT_HEALTHZ_ADDR.into(),
            metrics_bind_address: DEFAULT_METRICS_ADDR.into(),
            hostname_override: None,
            conntrack: ConntrackOptions::default(),
            kubeconfig: None,
            api_server: None,
            bpffs: PathBuf::from(DEFAULT_PIN_DIR),
            cgroup: CgroupChoice::Auto,
            interfaces: Vec::new(),
            tc_attach: TcAttachMode::default(),
            xdp: XdpMode::default(),
            map_sizes: MapSizes::default(),
            scheduler: view.scheduler,
            maglev_table_len: view.maglev_table_len,
            lb_mode: view.lb_mode,
            bpf_log_level: BpfLogLevel::default(),
            service_proxy_name: None,
            // Off: the metrics address serves the debug views, and 10250 is kubelet's.
            debug_bind_address: String::new(),
            service_metrics: false,
            feed_servers: Vec::new(),
            feed_tls: None,
        }
    }
}

/// Fields that are kube-proxy's but mean nothing for an eBPF proxy.
const NOT_APPLICABLE: [&str; 10] = [
    "winkernel",
    "bindAddress",
    "bindAddressHardFail",
    "oomScoreAdj",
    "portRange",
    "configSyncPeriod",
    "enableProfiling",
    "showHiddenMetricsForVersion",
    "featureGates",
    "logging",
];

impl Config {
    /// Checks what the file's fields cannot check alone, and what flags may have set:
    /// periods within `MAX_SYNC_PERIOD`, listen addresses that can be bound, and
    /// masquerade ports apart from NodePorts.
    pub fn validate(&self) -> Result<(), String> {
        for (field, addr) in [
            ("healthzBindAddress", &self.healthz_bind_address),
            ("metricsBindAddress", &self.metrics_bind_address),
            (
                "ebpf.debugBindAddress (--debug-addr)",
                &self.debug_bind_address,
            ),
        ] {
            // Empty: the debug endpoint is off (the other two are never empty here).
            if !addr.is_empty() {
                check_bind_address(addr).map_err(|e| format!("{field}: {e}"))?;
            }
        }
        // A masquerade source port that is also a NodePort: the backend's answer to a
        // masqueraded flow would come back to the node's NodePort frontend.
        let (masq, nodeport) = (self.conntrack.masquerade_ports, self.node_port_range);
        if masq.0 <= nodeport.1 && nodeport.0 <= masq.1 {
            return Err(format!(
                "ebpf.masqueradePortRange {}-{} overlaps ebpf.nodePortRange {}-{}: \
                 masquerade ports must not be NodePorts",
                masq.0, masq.1, nodeport.0, nodeport.1
            ));
        }
        for (field, d) in [
            ("syncPeriod (--resync-s)", self.sync_period),
            ("minSyncPeriod (--min-sync-ms)", self.min_sync_period),
        ] {
            if d > MAX_SYNC_PERIOD {
                return Err(format!(
                    "{field}: {} s is above the longest accepted period, {} s (a year)",
                    d.as_secs(),
                    MAX_SYNC_PERIOD.as_secs()
                ));
            }
        }
        Ok(())
    }

    /// Reads a config file. Returns the config and a warning for every field that is
    /// unknown or not supported.
    pub fn from_file(path: &Path) -> Result<(Self, Vec<String>), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_text(&text)
            .and_then(|(cfg, warnings)| cfg.validate().map(|()| (cfg, warnings)))
            .map_err(|message| ConfigError::Invalid {
                path: path.display().to_string(),
                message,
            })
    }

    /// Parses the YAML of a config file.
    pub fn from_text(text: &str) -> Result<(Self, Vec<String>), String> {
        let file = KubeProxyConfiguration::parse(text)?;
        let mut warnings = Vec::new();
        if let Some(kind) = &file.kind
            && kind != "KubeProxyConfiguration"
        {
            return Err(format!("kind {kind:?}, expected KubeProxyConfiguration"));
        }
        if let Some(v) = &file.api_version
            && !v.starts_with("kubeproxy.config.k8s.io/")
        {
            warnings.push(format!("apiVersion {v:?} is not kubeproxy.config.k8s.io"));
        }
        let mut cfg = Config::default();
        for key in file.rest.keys() {
            if NOT_APPLICABLE.contains(&key.as_str()) {
                warnings.push(format!("{key}: not applicable to the eBPF proxy, ignored"));
            } else {
                warnings.push(format!("{key}: unknown field, ignored"));
            }
        }
        cfg.local_detector = Self::local_detector(&file)?;
        if let Some(list) = &file.node_port_addresses {
            let (nets, primary) = parse_node_port_addresses(list)?;
            cfg.node_port_addresses = nets;
            cfg.node_port_primary = primary;
        }
        cfg.read_mode(&file, &mut warnings)?;
        cfg.min_sync_period = duration_or(
            file.min_sync_period.as_deref(),
            "minSyncPeriod",
            cfg.min_sync_period,
        )?;
        cfg.sync_period = duration_or(file.sync_period.as_deref(), "syncPeriod", cfg.sync_period)?;
        // Empty means unset (kubeadm writes ""), as kube-proxy reads it: the default.
        if let Some(a) = file.healthz_bind_address.filter(|a| !a.is_empty()) {
            cfg.healthz_bind_address = a;
        }
        if let Some(a) = file.metrics_bind_address.filter(|a| !a.is_empty()) {
            cfg.metrics_bind_address = a;
        }
        cfg.hostname_override = file.hostname_override.filter(|h| !h.is_empty());
        if let Some(ct) = file.conntrack {
            cfg.read_conntrack(ct, &mut warnings)?;
        }
        if let Some(cc) = file.client_connection {
            cfg.kubeconfig = cc.kubeconfig.filter(|k| !k.is_empty());
            for key in cc.rest.keys() {
                warnings.push(format!("clientConnection.{key}: not supported, ignored"));
            }
        }
        if let Some(e) = file.ebpf {
            cfg.read_ebpf(e)?;
        }
        Ok((cfg, warnings))
    }

    /// `detectLocalMode` with `clusterCIDR`: how this node tells its pods' traffic.
    fn local_detector(file: &KubeProxyConfiguration) -> Result<LocalDetector, String> {
        let cidrs = parse_cidrs(file.cluster_cidr.as_deref().unwrap_or(""), "clusterCIDR")?;
        let detect = file.detect_local.clone().unwrap_or_default();
        // Unset or empty (kubeadm's ""): kube-proxy's default, ClusterCIDR when there is one.
        let mode = file.detect_local_mode.as_deref().filter(|m| !m.is_empty());
        Ok(
            match mode.unwrap_or(if cidrs.is_empty() { "" } else { "ClusterCIDR" }) {
                "" => LocalDetector::None,
                "ClusterCIDR" if cidrs.is_empty() => {
                    return Err("detectLocalMode ClusterCIDR needs clusterCIDR".into());
                }
                "ClusterCIDR" => LocalDetector::ClusterCidr(cidrs),
                // Refused rather than accepted and ignored: traffic from pods would then be
                // masqueraded (or not) against the operator's intent.
                mode @ ("BridgeInterface" | "InterfaceNamePrefix") => {
                    let named = if mode == "BridgeInterface" {
                        detect.bridge_interface
                    } else {
                        detect.interface_name_prefix
                    };
                    return Err(format!(
                        "detectLocalMode {mode} ({:?}) is not supported by the eBPF proxy: use \
                     ClusterCIDR (with clusterCIDR) or NodeCIDR",
                        named.unwrap_or_default()
                    ));
                }
                "NodeCIDR" => LocalDetector::NodeCidr,
                other => return Err(format!("unknown detectLocalMode {other:?}")),
            },
        )
    }

    /// `mode` and the mode sections (`iptables`, `nftables`, `ipvs`): `ipvs` chooses the
    /// scheduler; masqueradeAll and the sync periods apply whichever mode named them.
    fn read_mode(
        &mut self,
        file: &KubeProxyConfiguration,
        warnings: &mut Vec<String>,
    ) -> Result<(), String> {
        // The mode: ours whatever it says; `ipvs` only chooses the node's scheduler, as
        // IPVS would (kube-proxy's default for it is rr).
        let mode = file.mode.as_deref().unwrap_or("").trim();
        match mode {
            "" => {}
            "ipvs" => {
                let name = file.ipvs.as_ref().and_then(|i| i.scheduler.as_deref());
                let name = name.filter(|n| !n.trim().is_empty()).unwrap_or("rr");
                let (s, note) =
                    Scheduler::parse(name).map_err(|e| format!("ipvs.scheduler: {e}"))?;
                self.scheduler = s;
                warnings.extend(note.map(|n| format!("ipvs.scheduler: {n}")));
            }
            other => warnings.push(format!(
                "mode {other:?}: not applicable to the eBPF proxy (only ipvs is read, for \
                 its scheduler), ignored"
            )),
        }
        // Mode sections: masqueradeAll and the sync periods apply whichever mode named them.
        for (name, section) in [
            ("iptables", &file.iptables),
            ("nftables", &file.nftables),
            ("ipvs", &file.ipvs),
        ] {
            let Some(section) = section else { continue };
            let scheduler = section
                .scheduler
                .as_deref()
                .filter(|s| !s.trim().is_empty());
            if scheduler.is_some() && (name != "ipvs" || mode != "ipvs") {
                warnings.push(format!(
                    "{name}.scheduler: applies only with mode: ipvs, ignored"
                ));
            }
            if let Some(m) = section.masquerade_all {
                self.masquerade_all |= m;
            }
            if let Some(l) = section.localhost_node_ports {
                self.localhost_node_ports = l;
            }
            self.min_sync_period = duration_or(
                section.min_sync_period.as_deref(),
                &format!("{name}.minSyncPeriod"),
                self.min_sync_period,
            )?;
            self.sync_period = duration_or(
                section.sync_period.as_deref(),
                &format!("{name}.syncPeriod"),
                self.sync_period,
            )?;
            for key in section.rest.keys() {
                warnings.push(format!(
                    "{name}.{key}: not applicable to the eBPF proxy, ignored"
                ));
            }
        }
        Ok(())
    }

    /// The `conntrack` section: the flow tables' timeouts and sizes.
    fn read_conntrack(&mut self, ct: Conntrack, warnings: &mut Vec<String>) -> Result<(), String> {
        // `0s` (kubeadm's) leaves a timeout at its default, never at zero.
        let d = |v: &Option<String>, name: &str, default: Duration| {
            duration_or(v.as_deref(), &format!("conntrack.{name}"), default)
        };
        let size = |v: Option<i64>, name: &str, default: u32| -> Result<u32, String> {
            match v {
                None => Ok(default),
                // kube-proxy: 0 leaves the kernel's limit alone; ours is the default.
                Some(0) => Ok(default),
                Some(n) => {
                    u32::try_from(n).map_err(|_| format!("conntrack.{name}: {n} is out of range"))
                }
            }
        };
        let defaults = ConntrackOptions::default();
        self.conntrack = ConntrackOptions {
            tcp_syn: self.conntrack.tcp_syn,
            tcp_established: d(
                &ct.tcp_established_timeout,
                "tcpEstablishedTimeout",
                self.conntrack.tcp_established,
            )?,
            tcp_close_wait: d(
                &ct.tcp_close_wait_timeout,
                "tcpCloseWaitTimeout",
                self.conntrack.tcp_close_wait,
            )?,
            udp: d(&ct.udp_timeout, "udpTimeout", self.conntrack.udp)?,
            udp_stream: d(
                &ct.udp_stream_timeout,
                "udpStreamTimeout",
                self.conntrack.udp_stream,
            )?,
            max_per_core: size(ct.max_per_core, "maxPerCore", defaults.max_per_core)?,
            min: size(ct.min, "min", defaults.min)?,
            masquerade_ports: self.conntrack.masquerade_ports,
        };
        for key in ct.rest.keys() {
            warnings.push(format!("conntrack.{key}: not supported, ignored"));
        }
        Ok(())
    }

    /// The `ebpf` section: what is ours alone.
    fn read_ebpf(&mut self, e: EbpfSection) -> Result<(), String> {
        if let Some(f) = e.feed {
            self.feed_servers = f.servers.unwrap_or_default();
            for addr in &self.feed_servers {
                check_feed_server(addr).map_err(|e| format!("ebpf.feed.servers: {e}"))?;
            }
            self.feed_tls = match (f.cert, f.key, f.ca) {
                (Some(c), Some(k), Some(a)) => Some([c.into(), k.into(), a.into()]),
                (None, None, None) => None,
                _ => return Err("ebpf.feed: cert, key and ca go together".into()),
            };
        }
        if let Some(v) = e.bpffs {
            self.bpffs = PathBuf::from(v);
        }
        if let Some(v) = e.cgroup {
            self.cgroup = v.parse().map_err(|e| format!("ebpf.cgroup: {e}"))?;
        }
        if let Some(v) = e.interfaces {
            self.interfaces = v;
        }
        if let Some(v) = e.tc_attach {
            self.tc_attach = v.parse().map_err(|e| format!("ebpf.tcAttach: {e}"))?;
        }
        if let Some(v) = e.xdp {
            self.xdp = v.parse().map_err(|e| format!("ebpf.xdp: {e}"))?;
        }
        if let Some(v) = e.load_balancer.and_then(|l| l.mode) {
            self.lb_mode = v
                .parse()
                .map_err(|e| format!("ebpf.loadBalancer.mode: {e}"))?;
        }
        if let Some(v) = e.bpf_log_level {
            self.bpf_log_level = v.parse().map_err(|e| format!("ebpf.bpfLogLevel: {e}"))?;
        }
        self.service_proxy_name = e.service_proxy_name;
        if let Some(v) = e.debug_bind_address {
            self.debug_bind_address = v;
        }
        if let Some(v) = e.service_metrics {
            self.service_metrics = v;
        }
        self.api_server = e.api_server.filter(|s| !s.is_empty());
        if let Some(v) = e.node_port_range {
            self.node_port_range =
                parse_port_range(&v, 1).map_err(|e| format!("ebpf.nodePortRange: {e}"))?;
        }
        if let Some(v) = e.masquerade_port_range {
            self.conntrack.masquerade_ports =
                parse_port_range(&v, 1024).map_err(|e| format!("ebpf.masqueradePortRange: {e}"))?;
        }
        if let Some(n) = e.maglev_table_size {
            self.maglev_table_len =
                crate::model::schedule::check_table_len(n).map_err(|e| format!("ebpf.{e}"))?;
        }
        if let Some(m) = e.map_sizes {
            let sizes = &mut self.map_sizes;
            for (field, given, size) in [
                ("services", m.services, &mut sizes.services),
                ("backendSlots", m.backend_slots, &mut sizes.backend_slots),
                ("backends", m.backends, &mut sizes.backends),
            ] {
                let Some(n) = given else { continue };
                if !(MapSizes::MIN..=MapSizes::MAX).contains(&n) {
                    return Err(format!(
                        "ebpf.mapSizes.{field}: {n} outside {}-{}",
                        MapSizes::MIN,
                        MapSizes::MAX
                    ));
                }
                *size = n;
            }
        }
        Ok(())
    }
}

/// `nodePortAddresses` as kube-proxy expands it: CIDRs and the keywords `primary` (this
/// node's primary address of each family, known once the Node is), `localhost`
/// (127.0.0.0/8, ::1/128) and `all` (0.0.0.0/0, ::/0), each keyword at most once.
fn parse_node_port_addresses(list: &[String]) -> Result<(Vec<ipnet::IpNet>, bool), String> {
    let mut nets = Vec::new();
    let mut primary = false;
    let mut seen = std::collections::BTreeSet::new();
    for entry in list {
        let entry = entry.trim();
        let keyword = matches!(entry, "primary" | "localhost" | "all");
        if keyword && !seen.insert(entry) {
            return Err(format!("nodePortAddresses: duplicate keyword {entry:?}"));
        }
        match entry {
            "primary" => primary = true,
            "localhost" => nets.extend(parse_cidrs("127.0.0.0/8,::1/128", "nodePortAddresses")?),
            "all" => nets.extend(parse_cidrs("0.0.0.0/0,::/0", "nodePortAddresses")?),
            s => nets.extend(parse_cidrs(s, "nodePortAddresses").map_err(|e| {
                format!("{e} (a CIDR or one of the keywords primary, localhost, all)")
            })?),
        }
    }
    Ok((nets, primary))
}

fn parse_cidrs(s: &str, field: &str) -> Result<Vec<ipnet::IpNet>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(|c| {
            crate::model::sloppy::parse_cidr(c)
                .map_err(|e| format!("{field}: invalid CIDR {c:?}: {e}"))
        })
        .collect()
}

/// The longest sync period the agent accepts: longer ones are typos, and the timers
/// built from them must not overflow.
pub const MAX_SYNC_PERIOD: Duration = Duration::from_secs(365 * 24 * 3600);

#[cfg(test)]
mod tests;
