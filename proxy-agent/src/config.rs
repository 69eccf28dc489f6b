//! The agent's settings: kube-proxy's own `KubeProxyConfiguration` file (the fields that
//! apply to this proxy) plus our extra fields under `ebpf:`, in one typed config. Fields
//! we do not know, or know but do not support, are reported — never silently ignored.
//! Flags override the file.

use std::{collections::BTreeMap, path::Path, time::Duration};

use serde::Deserialize;
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

/// The parts of `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1) we read.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct KubeProxyConfiguration {
    api_version: Option<String>,
    kind: Option<String>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    detect_local_mode: Option<String>,
    detect_local: Option<DetectLocal>,
    node_port_addresses: Option<Vec<String>>,
    min_sync_period: Option<String>,
    sync_period: Option<String>,
    healthz_bind_address: Option<String>,
    metrics_bind_address: Option<String>,
    hostname_override: Option<String>,
    conntrack: Option<Conntrack>,
    mode: Option<String>,
    iptables: Option<ModeSection>,
    nftables: Option<ModeSection>,
    ipvs: Option<ModeSection>,
    client_connection: Option<ClientConnection>,
    ebpf: Option<EbpfSection>,
    /// Everything else: reported as unknown or unsupported.
    #[serde(flatten)]
    rest: BTreeMap<String, serde_json::Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DetectLocal {
    bridge_interface: Option<String>,
    interface_name_prefix: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ModeSection {
    masquerade_all: Option<bool>,
    localhost_node_ports: Option<bool>,
    min_sync_period: Option<String>,
    sync_period: Option<String>,
    /// `ipvs.scheduler`.
    scheduler: Option<String>,
    #[serde(flatten)]
    rest: BTreeMap<String, serde_json::Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Conntrack {
    tcp_established_timeout: Option<String>,
    tcp_close_wait_timeout: Option<String>,
    udp_timeout: Option<String>,
    udp_stream_timeout: Option<String>,
    max_per_core: Option<i64>,
    min: Option<i64>,
    #[serde(flatten)]
    rest: BTreeMap<String, serde_json::Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClientConnection {
    kubeconfig: Option<String>,
    #[serde(flatten)]
    rest: BTreeMap<String, serde_json::Value>,
}

/// Our own settings, under `ebpf:` in the same file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct EbpfSection {
    bpffs: Option<String>,
    cgroup: Option<String>,
    interfaces: Option<Vec<String>>,
    tc_attach: Option<String>,
    bpf_log_level: Option<String>,
    service_proxy_name: Option<String>,
    debug_bind_address: Option<String>,
    masquerade_port_range: Option<String>,
    api_server: Option<String>,
    node_port_range: Option<String>,
    map_sizes: Option<MapSizesSection>,
    maglev_table_size: Option<u32>,
}

/// `ebpf.mapSizes`: capacities of the service-side maps.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct MapSizesSection {
    services: Option<u32>,
    backend_slots: Option<u32>,
    backends: Option<u32>,
}

pub use crate::dataplane::bpf::MapSizes;
use crate::model::schedule::Scheduler;

/// How local (pod) traffic is told apart from other traffic.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum LocalDetector {
    /// Sources in the cluster's pod CIDRs (`clusterCIDR`).
    ClusterCidr(Vec<ipnet::IpNet>),
    /// Sources in this Node's `spec.podCIDRs` (API-server source only).
    NodeCidr,
    /// Not told apart: no `clusterCIDR` and no mode.
    None,
}

/// Connection tracking of the per-packet path: idle limits, table size, masquerade ports.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ConntrackSettings {
    /// TCP flows the backend has not answered yet.
    pub tcp_syn: Duration,
    pub tcp_established: Duration,
    pub tcp_close_wait: Duration,
    pub udp: Duration,
    pub udp_stream: Duration,
    /// Answered flows the table holds: `maxPerCore` × CPUs, at least `min`, as kube-proxy
    /// sizes netfilter's table (`conntrack.maxPerCore`, `conntrack.min`).
    pub max_per_core: u32,
    pub min: u32,
    /// Masquerade source ports (inclusive): `ebpf.masqueradePortRange`.
    pub masquerade_ports: (u16, u16),
}

impl Default for ConntrackSettings {
    fn default() -> Self {
        Self {
            tcp_syn: Duration::from_secs(60),
            tcp_established: Duration::from_secs(86_400),
            tcp_close_wait: Duration::from_secs(3_600),
            udp: Duration::from_secs(30),
            udp_stream: Duration::from_secs(120),
            max_per_core: 32_768,
            min: 131_072,
            masquerade_ports: (proxy_common::SNAT_PORT_MIN, proxy_common::SNAT_PORT_MAX),
        }
    }
}

impl ConntrackSettings {
    /// Entries of the answered-flows table on a node with `cpus` CPUs.
    pub fn table_entries(&self, cpus: usize) -> u32 {
        let per_core = self.max_per_core.saturating_mul(cpus as u32);
        per_core.max(self.min).max(1_024)
    }
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

/// The agent's settings, after defaults, file and flags.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Config {
    pub local_detector: LocalDetector,
    pub masquerade_all: bool,
    pub localhost_node_ports: bool,
    pub node_port_addresses: Vec<ipnet::IpNet>,
    /// `nodePortAddresses` holds `primary`.
    pub node_port_primary: bool,
    /// The API server's `--service-node-port-range` (`ebpf.nodePortRange`).
    pub node_port_range: (u16, u16),
    pub min_sync_period: Duration,
    pub sync_period: Duration,
    pub healthz_bind_address: String,
    pub metrics_bind_address: String,
    pub hostname_override: Option<String>,
    pub conntrack: ConntrackSettings,
    pub kubeconfig: Option<String>,
    /// The API server's URL (`ebpf.apiServer`), overriding the kubeconfig's or the
    /// in-cluster one (the `kubernetes` ClusterIP, which only a service proxy serves).
    pub api_server: Option<String>,
    pub bpffs: String,
    pub cgroup: String,
    pub interfaces: Vec<String>,
    /// How the classifier is hooked: `auto`, `tcx` or `clsact` (`ebpf.tcAttach`).
    pub tc_attach: String,
    /// Capacities of the service-side maps (`ebpf.mapSizes`).
    pub map_sizes: MapSizes,
    /// The node's scheduler: `ipvs.scheduler` (default `rr`) when `mode: ipvs`, else
    /// random; a Service's annotation overrides it.
    pub scheduler: Scheduler,
    /// Maglev table length for `sh`, `dh`, `mh` (`ebpf.maglevTableSize`).
    pub maglev_table_len: u32,
    pub bpf_log_level: String,
    pub service_proxy_name: Option<String>,
    /// An extra debug endpoint (model, view, watch); empty (the default) disables it: the
    /// metrics address serves the same views.
    pub debug_bind_address: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            local_detector: LocalDetector::None,
            masquerade_all: false,
            localhost_node_ports: true,
            node_port_addresses: Vec::new(),
            node_port_primary: false,
            node_port_range: crate::model::DEFAULT_NODE_PORT_RANGE,
            // kube-proxy defaults to 1s because each iptables sync is costly; a map
            // update is not, so bursts are coalesced over a much shorter window.
            min_sync_period: Duration::from_millis(100),
            sync_period: Duration::from_secs(30),
            healthz_bind_address: "0.0.0.0:10256".into(),
            metrics_bind_address: "127.0.0.1:10249".into(),
            hostname_override: None,
            conntrack: ConntrackSettings::default(),
            kubeconfig: None,
            api_server: None,
            bpffs: "/sys/fs/bpf/proxy-agent".into(),
            cgroup: "auto".into(),
            interfaces: Vec::new(),
            tc_attach: "auto".into(),
            map_sizes: MapSizes::default(),
            scheduler: Scheduler::Random,
            maglev_table_len: crate::model::schedule::DEFAULT_MAGLEV_TABLE_LEN,
            bpf_log_level: "warn".into(),
            service_proxy_name: None,
            // Off: the metrics address serves the debug views, and 10250 is kubelet's.
            debug_bind_address: String::new(),
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
    /// Checks what flags may have set beyond the file's checks: periods within
    /// `MAX_SYNC_PERIOD`.
    pub fn validate(&self) -> Result<(), String> {
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
        let file: KubeProxyConfiguration = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
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
        let cidrs = parse_cidrs(file.cluster_cidr.as_deref().unwrap_or(""), "clusterCIDR")?;
        let detect = file.detect_local.unwrap_or_default();
        // Unset or empty (kubeadm's ""): kube-proxy's default, ClusterCIDR when there is one.
        let mode = file.detect_local_mode.as_deref().filter(|m| !m.is_empty());
        cfg.local_detector = match mode.unwrap_or(if cidrs.is_empty() { "" } else { "ClusterCIDR" })
        {
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
        };
        if let Some(list) = &file.node_port_addresses {
            let (nets, primary) = parse_node_port_addresses(list)?;
            cfg.node_port_addresses = nets;
            cfg.node_port_primary = primary;
        }
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
                cfg.scheduler = s;
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
                cfg.masquerade_all |= m;
            }
            if let Some(l) = section.localhost_node_ports {
                cfg.localhost_node_ports = l;
            }
            cfg.min_sync_period = duration_or(
                section.min_sync_period.as_deref(),
                &format!("{name}.minSyncPeriod"),
                cfg.min_sync_period,
            )?;
            cfg.sync_period = duration_or(
                section.sync_period.as_deref(),
                &format!("{name}.syncPeriod"),
                cfg.sync_period,
            )?;
            for key in section.rest.keys() {
                warnings.push(format!(
                    "{name}.{key}: not applicable to the eBPF proxy, ignored"
                ));
            }
        }
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
            // `0s` (kubeadm's) leaves a timeout at its default, never at zero.
            let d = |v: &Option<String>, name: &str, default: Duration| {
                duration_or(v.as_deref(), &format!("conntrack.{name}"), default)
            };
            let size = |v: Option<i64>, name: &str, default: u32| -> Result<u32, String> {
                match v {
                    None => Ok(default),
                    // kube-proxy: 0 leaves the kernel's limit alone; ours is the default.
                    Some(0) => Ok(default),
                    Some(n) => u32::try_from(n)
                        .map_err(|_| format!("conntrack.{name}: {n} is out of range")),
                }
            };
            let defaults = ConntrackSettings::default();
            cfg.conntrack = ConntrackSettings {
                tcp_syn: cfg.conntrack.tcp_syn,
                tcp_established: d(
                    &ct.tcp_established_timeout,
                    "tcpEstablishedTimeout",
                    cfg.conntrack.tcp_established,
                )?,
                tcp_close_wait: d(
                    &ct.tcp_close_wait_timeout,
                    "tcpCloseWaitTimeout",
                    cfg.conntrack.tcp_close_wait,
                )?,
                udp: d(&ct.udp_timeout, "udpTimeout", cfg.conntrack.udp)?,
                udp_stream: d(
                    &ct.udp_stream_timeout,
                    "udpStreamTimeout",
                    cfg.conntrack.udp_stream,
                )?,
                max_per_core: size(ct.max_per_core, "maxPerCore", defaults.max_per_core)?,
                min: size(ct.min, "min", defaults.min)?,
                masquerade_ports: cfg.conntrack.masquerade_ports,
            };
            for key in ct.rest.keys() {
                warnings.push(format!("conntrack.{key}: not supported, ignored"));
            }
        }
        if let Some(cc) = file.client_connection {
            cfg.kubeconfig = cc.kubeconfig.filter(|k| !k.is_empty());
            for key in cc.rest.keys() {
                warnings.push(format!("clientConnection.{key}: not supported, ignored"));
            }
        }
        if let Some(e) = file.ebpf {
            if let Some(v) = e.bpffs {
                cfg.bpffs = v;
            }
            if let Some(v) = e.cgroup {
                cfg.cgroup = v;
            }
            if let Some(v) = e.interfaces {
                cfg.interfaces = v;
            }
            if let Some(v) = e.tc_attach {
                v.parse::<crate::dataplane::bpf::TcAttachMode>()
                    .map_err(|e| format!("ebpf.tcAttach: {e}"))?;
                cfg.tc_attach = v;
            }
            if let Some(v) = e.bpf_log_level {
                cfg.bpf_log_level = v;
            }
            cfg.service_proxy_name = e.service_proxy_name;
            if let Some(v) = e.debug_bind_address {
                cfg.debug_bind_address = v;
            }
            cfg.api_server = e.api_server.filter(|s| !s.is_empty());
            if let Some(v) = e.node_port_range {
                cfg.node_port_range =
                    parse_port_range(&v, 1).map_err(|e| format!("ebpf.nodePortRange: {e}"))?;
            }
            if let Some(v) = e.masquerade_port_range {
                cfg.conntrack.masquerade_ports = parse_port_range(&v, 1024)
                    .map_err(|e| format!("ebpf.masqueradePortRange: {e}"))?;
            }
            if let Some(n) = e.maglev_table_size {
                cfg.maglev_table_len =
                    crate::model::schedule::check_table_len(n).map_err(|e| format!("ebpf.{e}"))?;
            }
            if let Some(m) = e.map_sizes {
                let sizes = &mut cfg.map_sizes;
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
        }
        Ok((cfg, warnings))
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

/// Go's `time.Duration` text: `1s`, `500ms`, `1m30s`, `24h0m0s`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let mut total = Duration::ZERO;
    let mut rest = s.trim();
    if rest == "0" {
        return Ok(total);
    }
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_end);
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}"))?;
        let secs = match unit {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return Err(format!("invalid duration {s:?}: unit {unit:?}")),
        };
        let part = n * secs;
        // Go's durations are i64 nanoseconds: nothing longer is a duration.
        if !part.is_finite() || part > GO_DURATION_MAX_S {
            return Err(format!(
                "duration {s:?} out of range (Go durations end at 2562047h47m16s)"
            ));
        }
        total = total
            .checked_add(Duration::from_secs_f64(part))
            .filter(|t| t.as_secs_f64() <= GO_DURATION_MAX_S)
            .ok_or_else(|| format!("duration {s:?} out of range"))?;
        rest = tail;
    }
    Ok(total)
}

/// The longest Go `time.Duration`, in seconds (i64::MAX nanoseconds).
const GO_DURATION_MAX_S: f64 = 9_223_372_036.854_775;

/// The longest sync period the agent accepts: longer ones are typos, and the timers
/// built from them must not overflow.
pub const MAX_SYNC_PERIOD: Duration = Duration::from_secs(365 * 24 * 3600);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipvs_mode_chooses_the_nodes_scheduler() {
        let parse = |text: &str| Config::from_text(text).expect("valid");
        let (cfg, _) = parse("mode: ipvs\nipvs: {scheduler: \"\"}\n");
        assert_eq!(
            cfg.scheduler,
            Scheduler::Rr,
            "kube-proxy's default in ipvs mode"
        );
        let (cfg, _) = parse("mode: ipvs\nipvs: {scheduler: mh}\n");
        assert_eq!(cfg.scheduler, Scheduler::Mh);
        let (cfg, warnings) = parse("mode: ipvs\nipvs: {scheduler: lblcr}\n");
        assert_eq!(cfg.scheduler, Scheduler::Wlc);
        assert!(warnings.iter().any(|w| w.contains("wlc")), "{warnings:?}");
        let (cfg, warnings) = parse("mode: nftables\nipvs: {scheduler: sh}\n");
        assert_eq!(cfg.scheduler, Scheduler::Random, "only ipvs mode reads it");
        assert!(
            warnings.iter().any(|w| w.contains("ipvs.scheduler")),
            "{warnings:?}"
        );
        assert_eq!(parse("{}").0.scheduler, Scheduler::Random);
        assert!(Config::from_text("mode: ipvs\nipvs: {scheduler: fastest}\n").is_err());
        let (cfg, _) = parse("ebpf: {maglevTableSize: 16381}\n");
        assert_eq!(cfg.maglev_table_len, 16381);
        let err = Config::from_text("ebpf: {maglevTableSize: 1000}\n").expect_err("not prime");
        assert!(err.contains("maglevTableSize"), "{err}");
    }

    #[test]
    fn go_durations() {
        for (s, ms) in [
            ("1s", 1000),
            ("500ms", 500),
            ("1m30s", 90_000),
            ("24h0m0s", 86_400_000),
            ("0", 0),
            ("1.5s", 1500),
        ] {
            assert_eq!(parse_duration(s), Ok(Duration::from_millis(ms)), "{s}");
        }
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn a_kube_proxy_config_file() {
        let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clusterCIDR: 10.244.0.0/16,fd00:244::/48
nodePortAddresses: [192.0.2.0/24]
iptables:
  masqueradeAll: true
  masqueradeBit: 14
  minSyncPeriod: 2s
  syncPeriod: 1m
conntrack:
  tcpEstablishedTimeout: 24h0m0s
  udpTimeout: 45s
  maxPerCore: 32768
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
hostnameOverride: node-a
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 5
someFutureField: true
ebpf:
  interfaces: [eth0]
  tcAttach: clsact
  serviceProxyName: ebpf-proxy
  mapSizes: {backendSlots: 8388608}
";
        let (cfg, warnings) = Config::from_text(text).expect("valid");
        assert_eq!(
            cfg.local_detector,
            LocalDetector::ClusterCidr(vec![
                "10.244.0.0/16".parse().expect("cidr"),
                "fd00:244::/48".parse().expect("cidr")
            ])
        );
        assert!(cfg.masquerade_all);
        assert_eq!(
            cfg.node_port_addresses,
            vec!["192.0.2.0/24".parse::<ipnet::IpNet>().expect("cidr")]
        );
        assert_eq!(
            (cfg.min_sync_period, cfg.sync_period),
            (Duration::from_secs(2), Duration::from_secs(60))
        );
        assert_eq!(cfg.conntrack.udp, Duration::from_secs(45));
        assert_eq!(cfg.hostname_override.as_deref(), Some("node-a"));
        assert_eq!(
            cfg.kubeconfig.as_deref(),
            Some("/var/lib/kube-proxy/kubeconfig.conf")
        );
        assert_eq!(cfg.interfaces, vec!["eth0"]);
        assert_eq!(cfg.tc_attach, "clsact");
        assert_eq!(
            (cfg.map_sizes.backend_slots, cfg.map_sizes.services),
            (8_388_608, MapSizes::default().services),
            "a size given, the others kept"
        );
        assert_eq!(Config::default().tc_attach, "auto");
        assert_eq!(cfg.service_proxy_name.as_deref(), Some("ebpf-proxy"));
        for needle in [
            "mode \"nftables\": not applicable",
            "iptables.masqueradeBit",
            "clientConnection.qps",
            "someFutureField: unknown field",
        ] {
            assert!(
                warnings.iter().any(|w| w.contains(needle)),
                "{needle} not reported in {warnings:?}"
            );
        }
        assert_eq!(warnings.len(), 4, "{warnings:?}");
        assert_eq!(cfg.conntrack.table_entries(8), 8 * 32_768);
        assert_eq!(cfg.conntrack.table_entries(2), 131_072);
    }

    /// The `config.conf` of kubeadm's `kube-proxy` ConfigMap, verbatim: what it leaves
    /// unset it writes as `""`, `0s` or `null`, and each keeps kube-proxy's default —
    /// never "off" and never zero.
    #[test]
    fn kubeadms_configmap_as_kube_proxy_reads_it() {
        let text = include_str!("../tests/data/kubeadm-kube-proxy-config.conf");
        let (cfg, warnings) = Config::from_text(text).expect("kubeadm's file is valid");
        let defaults = Config::default();
        assert_eq!(cfg.healthz_bind_address, "0.0.0.0:10256");
        assert_eq!(cfg.metrics_bind_address, "127.0.0.1:10249");
        assert_eq!(cfg.sync_period, Duration::from_secs(30));
        assert_eq!(cfg.min_sync_period, defaults.min_sync_period);
        assert_eq!(
            cfg.conntrack,
            ConntrackSettings::default(),
            "udpTimeout: 0s is the default"
        );
        assert_eq!(
            cfg.local_detector,
            LocalDetector::ClusterCidr(vec!["10.244.0.0/16".parse().expect("cidr")]),
            "detectLocalMode \"\" is ClusterCIDR"
        );
        assert_eq!(cfg.hostname_override, None);
        assert_eq!(
            cfg.kubeconfig.as_deref(),
            Some("/var/lib/kube-proxy/kubeconfig.conf")
        );
        assert!(!cfg.masquerade_all && cfg.localhost_node_ports);
        assert!(cfg.node_port_addresses.is_empty());
        // Fields that mean nothing here are reported, none refused.
        assert!(warnings.iter().any(|w| w.contains("ipvs")), "{warnings:?}");
    }

    /// kube-proxy's `nodePortAddresses` keywords and `detectLocalMode: NodeCIDR`.
    #[test]
    fn node_port_keywords_and_node_cidr() {
        let text = "kind: KubeProxyConfiguration
detectLocalMode: NodeCIDR
nodePortAddresses: [primary, localhost, 010.001.0.0/16]
";
        let (cfg, warnings) = Config::from_text(text).expect("valid");
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(cfg.local_detector, LocalDetector::NodeCidr);
        assert!(cfg.node_port_primary);
        let nets: Vec<String> = cfg
            .node_port_addresses
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(nets, ["127.0.0.0/8", "::1/128", "10.1.0.0/16"]);
        let (all, _) =
            Config::from_text("kind: KubeProxyConfiguration\nnodePortAddresses: [all]\n")
                .expect("valid");
        assert!(!all.node_port_primary);
        assert_eq!(all.node_port_addresses.len(), 2, "0.0.0.0/0 and ::/0");
    }

    /// Huge durations are errors naming the field, never a panic (hostile input).
    #[test]
    fn durations_out_of_range_are_refused() {
        for (text, needle) in [
            ("syncPeriod: 4000000000000000h", "syncPeriod"),
            ("syncPeriod: 2562047788015215h", "syncPeriod"),
            ("syncPeriod: 99999999999999999999999h", "syncPeriod"),
            ("conntrack: {udpTimeout: 2562048h}", "conntrack.udpTimeout"),
            ("syncPeriod: 2562047h2562047h", "syncPeriod"),
        ] {
            let text = format!("kind: KubeProxyConfiguration\n{text}\n");
            let err = Config::from_text(&text).expect_err(&text);
            assert!(err.contains(needle) && err.contains("range"), "{err}");
        }
        // Within Go's range but beyond a sane period: refused by validate, with the field.
        let (cfg, _) = Config::from_text("kind: KubeProxyConfiguration\nsyncPeriod: 9000h\n")
            .expect("a Go duration");
        assert!(cfg.validate().expect_err("a year").contains("syncPeriod"));
        let cfg = Config {
            sync_period: Duration::from_secs(u64::MAX),
            ..Config::default()
        };
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn invalid_files_are_refused_with_the_field() {
        for (text, needle) in [
            (
                "kind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/33\n",
                "clusterCIDR",
            ),
            (
                "kind: KubeProxyConfiguration\nsyncPeriod: soon\n",
                "syncPeriod",
            ),
            (
                "kind: KubeProxyConfiguration\ndetectLocalMode: ClusterCIDR\n",
                "needs clusterCIDR",
            ),
            ("kind: Deployment\n", "expected KubeProxyConfiguration"),
            (
                "kind: KubeProxyConfiguration\nebpf: {mapSizes: {services: 10}}\n",
                "ebpf.mapSizes.services",
            ),
            (
                "kind: KubeProxyConfiguration\nebpf: {mapSizes: {slots: 4096}}\n",
                "slots",
            ),
            ("kind: KubeProxyConfiguration\nebpf: {bogus: 1}\n", "bogus"),
            (
                "kind: KubeProxyConfiguration\nebpf: {masqueradePortRange: 30000-2000}\n",
                "masqueradePortRange",
            ),
            (
                "kind: KubeProxyConfiguration\nebpf: {tcAttach: netlink}\n",
                "ebpf.tcAttach",
            ),
            (
                "kind: KubeProxyConfiguration\nconntrack: {maxPerCore: -1}\n",
                "conntrack.maxPerCore",
            ),
            // Refused by name, never accepted and ignored.
            (
                "kind: KubeProxyConfiguration\ndetectLocalMode: BridgeInterface\n\
                 detectLocal: {bridgeInterface: cbr0}\n",
                "detectLocalMode BridgeInterface (\"cbr0\") is not supported",
            ),
            (
                "kind: KubeProxyConfiguration\ndetectLocalMode: InterfaceNamePrefix\n",
                "detectLocalMode InterfaceNamePrefix",
            ),
            (
                "kind: KubeProxyConfiguration\nnodePortAddresses: [primary, primary]\n",
                "duplicate keyword \"primary\"",
            ),
            (
                "kind: KubeProxyConfiguration\nnodePortAddresses: [everything]\n",
                "one of the keywords primary, localhost, all",
            ),
        ] {
            let err = Config::from_text(text).expect_err(text);
            assert!(err.contains(needle), "{err} lacks {needle}");
        }
    }
}
