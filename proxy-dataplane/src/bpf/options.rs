//! What the BPF dataplane is told at start: where to pin and attach, map capacities,
//! connection tracking, the programs' log level. Each default is written here once.

use std::{fs, path::PathBuf, str::FromStr, time::Duration};

use crate::error::{ErrorKind, Kind as _, Result, fail};
use proxy_common::map_names;

use super::{
    attach::{
        interfaces::InterfaceSelector,
        links::AttachFailures,
        ownership::NodeHooks,
        xdp::{XdpMode, XdpStatus},
    },
    kernel::TcAttachMode,
};

/// Where the agent pins its maps and links unless told otherwise.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/proxy-agent";

/// Where and how to attach.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Folder on a bpffs for this agent's pins (`maps/`, `links/`).
    pub pin_dir: PathBuf,
    /// cgroup v2 folder for the connect-time hooks; `None` leaves them out.
    pub cgroup: Option<PathBuf>,
    /// Interfaces whose ingress gets the per-packet classifier, now and as they appear.
    pub interfaces: InterfaceSelector,
    /// How the classifier is hooked to them: tcx, a clsact filter, or whichever the
    /// kernel has.
    pub tc_attach: TcAttachMode,
    /// Whether and how the XDP program runs on the served interfaces.
    pub xdp: XdpMode,
    /// Which interfaces run XDP and how (shared with `/metrics`).
    pub xdp_status: XdpStatus,
    /// Level of the programs' log messages.
    pub bpf_log_level: BpfLogLevel,
    /// The per-packet path's flow tables: idle limits, size, masquerade ports.
    pub conntrack: ConntrackOptions,
    /// Counts classifier attachments that failed.
    pub attach_failures: AttachFailures,
    /// Where the checks of the hooks report foreign classifiers and repairs.
    pub hooks: NodeHooks,
    /// Capacities of the service-side maps.
    pub map_sizes: MapSizes,
}

/// Capacities of the service-side maps (`ebpf.mapSizes`). Sizing: `services` ≥ frontends
/// (Service ports × their cluster, external, load-balancer and NodePort addresses), plus
/// one per externalTrafficPolicy-Local frontend; `backendSlots` ≥ the sum over frontends
/// of their endpoints, with room for one backend set being replaced; `backends` ≥
/// distinct endpoint addresses and ports. The maps allocate entries as they fill (no
/// preallocation), but the kernel allocates each map's hash buckets (16 bytes per
/// entry of capacity, rounded up to a power of two) when it is created.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MapSizes {
    /// `SERVICES` and `REV_NAT`.
    pub services: u32,
    /// `BACKEND_SLOTS`, `MEMBERS`, `MAGLEV` and `LB_STATS`.
    pub backend_slots: u32,
    /// `BACKENDS` and `ACTIVE_CONNS`.
    pub backends: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: proxy_common::capacity::SERVICES,
            backend_slots: proxy_common::capacity::BACKEND_SLOTS,
            backends: proxy_common::capacity::BACKENDS,
        }
    }
}

impl MapSizes {
    pub const MIN: u32 = 1_024;
    /// The kernel's hash maps take up to 2^31 buckets; far more than a node needs.
    pub const MAX: u32 = 1 << 26;

    /// Each map's capacity, by name.
    pub fn capacities(&self) -> [(&'static str, u32); 8] {
        [
            (map_names::SERVICES, self.services),
            (map_names::REV_NAT, self.services),
            (map_names::BACKEND_SLOTS, self.backend_slots),
            (map_names::MEMBERS, self.backend_slots),
            (map_names::MAGLEV, self.backend_slots),
            (map_names::LB_STATS, self.backend_slots),
            (map_names::BACKENDS, self.backends),
            (map_names::ACTIVE_CONNS, self.backends),
        ]
    }
}

/// Capacities of the two connection-tracking tables for `entries` answered entries.
pub fn conntrack_capacities(entries: u32) -> [(&'static str, u32); 2] {
    [
        (map_names::CONNTRACK, entries),
        (map_names::CONNTRACK_NEW, (entries / 4).max(1_024)),
    ]
}

/// Refuses a masquerade port range that overlaps the node's ephemeral ports
/// (`net.ipv4.ip_local_port_range`): a connection the node opens itself could then
/// share its tuple with a masqueraded flow.
pub fn check_masquerade_ports(range: (u16, u16)) -> Result<()> {
    let path = "/proc/sys/net/ipv4/ip_local_port_range";
    let text = fs::read_to_string(path).kind_with(ErrorKind::Io, || format!("reading {path}"))?;
    let mut parts = text.split_whitespace().map(str::parse::<u16>);
    let (Some(Ok(lo)), Some(Ok(hi))) = (parts.next(), parts.next()) else {
        fail!(ErrorKind::Setting, "{path}: unexpected content {text:?}");
    };
    if range.0 <= hi && lo <= range.1 {
        fail!(
            ErrorKind::Setting,
            "masquerade ports {}-{} overlap the node's ephemeral ports {lo}-{hi} \
             (net.ipv4.ip_local_port_range): set ebpf.masqueradePortRange outside them",
            range.0,
            range.1
        );
    }
    Ok(())
}

/// Connection tracking of the per-packet path: idle limits, table size, masquerade ports.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ConntrackOptions {
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

impl Default for ConntrackOptions {
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

impl ConntrackOptions {
    /// Entries of the answered-flows table on a node with `cpus` CPUs.
    pub fn table_entries(&self, cpus: usize) -> u32 {
        let per_core = self.max_per_core.saturating_mul(cpus as u32);
        per_core.max(self.min).max(1_024)
    }
}

/// Level of the programs' log messages (aya-log's, forwarded to the agent's log).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BpfLogLevel {
    Off,
    Error,
    #[default]
    Warn,
    Info,
    Debug,
    Trace,
}

impl BpfLogLevel {
    /// The `AYA_LOG_LEVEL` global's value.
    pub fn code(self) -> u8 {
        self as u8
    }
}

impl FromStr for BpfLogLevel {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "off" => Self::Off,
            "error" => Self::Error,
            "warn" => Self::Warn,
            "info" => Self::Info,
            "debug" => Self::Debug,
            "trace" => Self::Trace,
            other => {
                return Err(format!(
                    "unknown BPF log level {other:?} (off, error, warn, info, debug, trace)"
                ));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_levels_parse_to_aya_codes() {
        for (name, code) in [
            ("off", 0),
            ("error", 1),
            ("warn", 2),
            ("info", 3),
            ("debug", 4),
            ("trace", 5),
        ] {
            assert_eq!(name.parse::<BpfLogLevel>().map(BpfLogLevel::code), Ok(code));
        }
        assert!("loud".parse::<BpfLogLevel>().is_err());
        assert_eq!(BpfLogLevel::default(), BpfLogLevel::Warn);
    }
}
