//! The config file's format: the parts of kube-proxy's `KubeProxyConfiguration` we read,
//! plus our `ebpf:` section, as serde reads them. Everything else lands in `rest` and is
//! reported.

use std::collections::BTreeMap;

use serde::Deserialize;

/// The parts of `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1) we read.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct KubeProxyConfiguration {
    pub(super) api_version: Option<String>,
    pub(super) kind: Option<String>,
    #[serde(rename = "clusterCIDR")]
    pub(super) cluster_cidr: Option<String>,
    pub(super) detect_local_mode: Option<String>,
    pub(super) detect_local: Option<DetectLocal>,
    pub(super) node_port_addresses: Option<Vec<String>>,
    pub(super) min_sync_period: Option<String>,
    pub(super) sync_period: Option<String>,
    pub(super) healthz_bind_address: Option<String>,
    pub(super) metrics_bind_address: Option<String>,
    pub(super) hostname_override: Option<String>,
    pub(super) conntrack: Option<Conntrack>,
    pub(super) mode: Option<String>,
    pub(super) iptables: Option<ModeSection>,
    pub(super) nftables: Option<ModeSection>,
    pub(super) ipvs: Option<ModeSection>,
    pub(super) client_connection: Option<ClientConnection>,
    pub(super) ebpf: Option<EbpfSection>,
    /// Everything else: reported as unknown or unsupported.
    #[serde(flatten)]
    pub(super) rest: BTreeMap<String, serde_json::Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct DetectLocal {
    pub(super) bridge_interface: Option<String>,
    pub(super) interface_name_prefix: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ModeSection {
    pub(super) masquerade_all: Option<bool>,
    pub(super) localhost_node_ports: Option<bool>,
    pub(super) min_sync_period: Option<String>,
    pub(super) sync_period: Option<String>,
    /// `ipvs.scheduler`.
    pub(super) scheduler: Option<String>,
    #[serde(flatten)]
    pub(super) rest: BTreeMap<String, serde_json::Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Conntrack {
    pub(super) tcp_established_timeout: Option<String>,
    pub(super) tcp_close_wait_timeout: Option<String>,
    pub(super) udp_timeout: Option<String>,
    pub(super) udp_stream_timeout: Option<String>,
    pub(super) max_per_core: Option<i64>,
    pub(super) min: Option<i64>,
    #[serde(flatten)]
    pub(super) rest: BTreeMap<String, serde_json::Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ClientConnection {
    pub(super) kubeconfig: Option<String>,
    #[serde(flatten)]
    pub(super) rest: BTreeMap<String, serde_json::Value>,
}

/// Our own settings, under `ebpf:` in the same file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct EbpfSection {
    pub(super) bpffs: Option<String>,
    pub(super) cgroup: Option<String>,
    pub(super) interfaces: Option<Vec<String>>,
    pub(super) tc_attach: Option<String>,
    pub(super) xdp: Option<String>,
    pub(super) bpf_log_level: Option<String>,
    pub(super) service_proxy_name: Option<String>,
    pub(super) debug_bind_address: Option<String>,
    pub(super) service_metrics: Option<bool>,
    pub(super) masquerade_port_range: Option<String>,
    pub(super) api_server: Option<String>,
    pub(super) node_port_range: Option<String>,
    pub(super) map_sizes: Option<MapSizesSection>,
    pub(super) maglev_table_size: Option<u32>,
    pub(super) feed: Option<FeedSection>,
    pub(super) load_balancer: Option<LoadBalancerSection>,
}

/// `ebpf.loadBalancer`: how traffic from outside the node reaches backends on other
/// nodes.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct LoadBalancerSection {
    pub(super) mode: Option<String>,
}

/// `ebpf.feed`: the `proxy-agent serve` replicas `--source server` reads from, and this
/// node's TLS files for them.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct FeedSection {
    pub(super) servers: Option<Vec<String>>,
    pub(super) cert: Option<String>,
    pub(super) key: Option<String>,
    pub(super) ca: Option<String>,
}

/// `ebpf.mapSizes`: capacities of the service-side maps.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct MapSizesSection {
    pub(super) services: Option<u32>,
    pub(super) backend_slots: Option<u32>,
    pub(super) backends: Option<u32>,
}

impl KubeProxyConfiguration {
    /// Reads the YAML text of a config file.
    pub(super) fn parse(text: &str) -> Result<Self, String> {
        serde_norway::from_str(text).map_err(|e| e.to_string())
    }
}
