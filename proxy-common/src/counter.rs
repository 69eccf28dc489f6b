//! Indices of the per-CPU `COUNTERS` array: why packets and connections took the path
//! they did. The agent exports them as metrics.

pub const SVC_HIT: u32 = 0;
pub const NO_BACKEND_REJECT: u32 = 1;
pub const NO_BACKEND_DROP: u32 = 2;
pub const BACKEND_MISSING: u32 = 3;
pub const CT_CREATE_FAILED: u32 = 4;
pub const CT_REPLY_NAT: u32 = 5;
/// A socket's `SOCK_LB` entry could not be made (the map is full): its replies and
/// `getpeername` show the backend. (Named after the map `SOCK_LB` replaced.)
pub const SOCK_REV_NAT_FAILED: u32 = 6;
pub const AFFINITY_HIT: u32 = 7;
pub const REWRITE_FAILED: u32 = 8;
pub const SOURCE_RANGE_DROP: u32 = 9;
pub const SNAT: u32 = 10;
pub const SNAT_PORTS_EXHAUSTED: u32 = 11;
pub const REJECT_SENT: u32 = 12;
pub const REJECT_RATE_LIMITED: u32 = 13;
/// A TCP segment other than a SYN for a frontend, with no flow: dropped, as
/// kube-proxy drops what netfilter marks INVALID.
pub const CT_INVALID: u32 = 14;
/// An answered flow found the answered-flows table full: it stays in the table of
/// new flows (LRU), where a flood may evict it.
pub const CT_FULL: u32 = 15;
/// A closed or expired flow's tuple (or masquerade port) was taken over by a new one.
pub const CT_REUSED: u32 = 16;
/// An ICMP/ICMPv6 error about a translated flow was translated (its quote and
/// addresses put back as the flow's other side knows them).
pub const ICMP_ERROR_NAT: u32 = 17;
/// A translated packet too big for its route's MTU was answered with "fragmentation
/// needed" / "packet too big" instead of being sent on.
pub const TOO_BIG_SENT: u32 = 18;
/// A packet for a frontend with no flow of ours, of a flow netfilter translated
/// before the classifier was attached (`NETFILTER_FLOWS`): left to netfilter.
pub const NETFILTER_PASS: u32 = 19;
/// XDP translated a packet and sent it back out of the interface it came in on.
pub const XDP_TX: u32 = 20;
/// XDP translated a packet and redirected it to another interface.
pub const XDP_REDIRECT: u32 = 21;
/// A packet for a frontend (or a flow of ours) that XDP left to TC unchanged (a
/// fragment, SCTP, a refusal to send, no neighbour or route the FIB could give).
pub const XDP_TO_TC: u32 = 22;
/// XDP dropped a packet (source ranges, a mid-stream segment of no flow, no backend
/// with a drop policy, …): counted by its reason too, as every drop is.
pub const XDP_DROP: u32 = 23;
/// Direct server return: a packet left for a backend on another node with the
/// frontend in its IP option.
pub const DSR_SENT: u32 = 24;
/// Direct server return: this node (the backend's) learnt a flow from the option.
pub const DSR_RECEIVED: u32 = 25;
/// Direct server return: an option refused because of where the packet came from
/// (a pod's or the node's own address, or not by the route back to its source).
pub const DSR_REFUSED_SOURCE: u32 = 26;
/// Direct server return: an option refused because no Service in `dsr` mode has
/// that frontend with the packet's destination as a backend (`DSR_PERMITS`), or the
/// frontend is this node's own address.
pub const DSR_REFUSED_FRONTEND: u32 = 27;
/// Direct server return: an option refused because its backend is not on this node.
pub const DSR_REFUSED_BACKEND: u32 = 28;
/// Direct server return: an option refused because the node's own flow holds the
/// client's tuple (a learned flow never outranks one the node opened).
pub const DSR_REFUSED_CLASH: u32 = 29;
/// A flow's first reply that did not arrive by the route back to its source (a pod
/// or host forging the backend's answer, or asymmetric routing): translated, but
/// not taken as the flow's answer (the flow stays unanswered, evictable).
pub const CT_REPLY_UNVERIFIED: u32 = 30;
/// A new masqueraded flow found the masquerade ports short and took the port of a
/// half-open TCP flow (never assured, begun over a second ago: a SYN flood's), whose
/// entries went. Answered flows never lose theirs.
pub const SNAT_PORT_RECLAIMED: u32 = 31;
/// Direct server return: an option refused because of the node it names as its
/// entry: not another node of the cluster (`LPM_TAG_PEER_NODE`), or the frame did not
/// come from that node's neighbour (its MAC, by the interface the route to it
/// takes), or no neighbour entry is known for it yet.
pub const DSR_REFUSED_NODE: u32 = 32;
/// A packet dropped where a lookup or helper cannot fail and did (index 0 of a
/// one-entry array, a valid scratch index, a helper given valid arguments): a bug if
/// ever counted.
pub const DROP_UNREACHABLE: u32 = 33;
/// A refusal or "too big" not made, its packet dropped: the packet has IP options or
/// an IPv6 extension header.
pub const REJECT_IP_OPTIONS: u32 = 34;
/// A refusal or "too big" whose making failed half-way (a helper failed): its packet
/// dropped.
pub const REJECT_FAILED: u32 = 35;
/// Length of the array.
pub const COUNT: u32 = 36;
/// Human-readable names, by index.
pub const NAMES: [&str; COUNT as usize] = [
    "service_hit",
    "no_backend_reject",
    "no_backend_drop",
    "backend_missing",
    "ct_create_failed",
    "ct_reply_nat",
    "sock_rev_nat_failed",
    "affinity_hit",
    "rewrite_failed",
    "source_range_drop",
    "snat",
    "snat_ports_exhausted",
    "reject_sent",
    "reject_rate_limited",
    "ct_invalid",
    "ct_full",
    "ct_reused",
    "icmp_error_nat",
    "too_big_sent",
    "netfilter_pass",
    "xdp_tx",
    "xdp_redirect",
    "xdp_to_tc",
    "xdp_drop",
    "dsr_sent",
    "dsr_received",
    "dsr_refused_source",
    "dsr_refused_frontend",
    "dsr_refused_backend",
    "dsr_refused_clash",
    "ct_reply_unverified",
    "snat_port_reclaimed",
    "dsr_refused_node",
    "drop_unreachable",
    "reject_ip_options",
    "reject_failed",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_names_cover_every_index() {
        assert_eq!(NAMES.len(), COUNT as usize);
    }

    /// The names are metric labels: one per index.
    #[test]
    fn counter_names_are_unique() {
        let mut names = NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), NAMES.len());
    }
}
