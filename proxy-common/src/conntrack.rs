//! Connection tracking of the per-packet path (`CONNTRACK`, `CONNTRACK_NEW`,
//! `NETFILTER_FLOWS`, the port filters): keys, values, flags, timeouts and the partner of each entry.

use crate::ip::{PROTO_SCTP, PROTO_TCP};

/// `CtValue::flags`: the flow's source was rewritten (masquerade to the node, or a new
/// source port alone when the client's own tuple would clash with another flow's).
pub const CT_F_SNAT: u8 = 1 << 0;
/// `CtValue::flags` (forward entries): the backend has answered.
pub const CT_F_REPLIED: u8 = 1 << 1;
/// `CtValue::flags` (forward entries): the client sent a FIN.
pub const CT_F_FIN_ORIG: u8 = 1 << 2;
/// `CtValue::flags` (forward entries): the backend sent a FIN.
pub const CT_F_FIN_REPLY: u8 = 1 << 3;
/// `CtValue::flags` (forward entries): either side sent a RST.
pub const CT_F_RST: u8 = 1 << 4;
/// `CtValue::flags` (forward entries): the flow is established — netfilter's ASSURED.
/// TCP: the client acknowledged the backend's SYN-ACK (a spoofed SYN never gets here);
/// UDP and SCTP: the backend answered. Set when the flow moves to the answered table.
pub const CT_F_ASSURED: u8 = 1 << 5;
/// `CtValue::flags` (forward entries): direct server return, at the node the client sent
/// to — every packet of the flow carries the frontend in an IP option to the backend's
/// node, and no reply comes back this way.
pub const CT_F_DSR: u8 = 1 << 6;
/// `CtValue::flags` (forward entries): direct server return, at the backend's node — the
/// entries were made from the option; the client's packets pass on untranslated (the
/// node they came through translated them), the backend's replies leave as the frontend.
pub const CT_F_DSR_BACKEND: u8 = 1 << 7;

/// Masquerade source ports by default (host byte order): below the NodePort range and
/// outside the kernel's default ephemeral range (32768-60999), so a masqueraded flow
/// never shares a tuple with a connection the node itself opens (Calico's eBPF dataplane
/// uses the same range). The agent checks the node's `ip_local_port_range`.
pub const SNAT_PORT_MIN: u16 = 20_000;
pub const SNAT_PORT_MAX: u16 = 29_999;

/// `CtKey::dir`: a packet from the client towards the service.
pub const CT_DIR_FORWARD: u8 = 0;
/// `CtKey::dir`: a reply from the backend towards the client.
pub const CT_DIR_REPLY: u8 = 1;

/// The port filters (`REPLY_PORTS`, `FRONTEND_PORTS`): ports an entry holds, a byte each
/// (set once, never cleared: a plain store, no read-modify-write another CPU could race).
pub const PORTS_PER_ENTRY: usize = 64;

/// Where port `port_be` (network byte order) is marked in a port filter: the entry, and
/// the byte in it. `REPLY_PORTS`: a port is marked before any flow's reply entry with that
/// source port (the backend's port) is written, so a packet from an unmarked port is no
/// reply and skips that lookup. `FRONTEND_PORTS`: a port is marked before any service
/// entry with that port is written, so a packet to an unmarked port is for no frontend
/// and no flow of ours.
pub const fn port_slot(port_be: u16) -> (u32, usize) {
    let port = u16::from_be(port_be) as usize;
    ((port / PORTS_PER_ENTRY) as u32, port % PORTS_PER_ENTRY)
}

/// Connection-tracking key of the per-packet path: the packet's own 5-tuple plus direction.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    /// Network byte order.
    pub sport: u16,
    /// Network byte order.
    pub dport: u16,
    pub proto: u8,
    pub family: u8,
    /// `CT_DIR_*`.
    pub dir: u8,
    pub _pad: u8,
}

/// Connection-tracking value. A flow has two entries, one per direction, in the same
/// table. Forward entries (keyed by the client's tuple) hold the flow's state — `flags`
/// and `last_seen_ns`, updated by packets of both directions — the backend the flow was
/// sent to (`xlate_*`) and, when masqueraded, the source it leaves with (`nat_*`).
/// Reply entries (keyed by the backend's reply tuple) hold the frontend replies come from
/// (`xlate_*`) and, when masqueraded, the client's address and port to restore (`nat_*`);
/// their `flags` carry only `CT_F_SNAT`. Either entry names its partner
/// ([`reply_key_of`], [`forward_key_of`]).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtValue {
    /// `CLOCK_MONOTONIC` of the entry's last packet: forward entries, any packet of the
    /// flow's but an answered flow's replies that go alone; reply entries, those (and
    /// the flow's start). The flow's is the later ([`flow_last_seen`]).
    pub last_seen_ns: u64,
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub nat_addr: [u32; 4],
    /// Forward: the backend's address, so an established flow keeps reaching a backend
    /// that left its Service (a terminating pod), as kube-proxy's conntrack does.
    /// Reply: the frontend's address.
    pub xlate_addr: [u32; 4],
    /// Network byte order.
    pub nat_port: u16,
    /// Network byte order.
    pub xlate_port: u16,
    /// `CT_F_*`.
    pub flags: u8,
    /// Reply entries: whether the frontend is one of the node's addresses (`CT_NODE_*`),
    /// learnt at the flow's first reply so later ones skip that lookup; 0 until then (and
    /// in forward entries).
    pub frontend_node: u8,
    pub _pad: [u8; 2],
    /// Entries of answered flows (`CONNTRACK`): packets and bytes of this entry's
    /// direction (forward: client to backend; reply: back) since the flow was answered,
    /// added atomically by the programs. Whoever removes the entry folds them into
    /// `LB_STATS` (the programs into the pair's entry, the agent into its
    /// [`StatsKey::ended`](crate::StatsKey::ended) one); the statistics add the live
    /// entries' to those. Unanswered flows count in `LB_STATS` directly (an LRU
    /// eviction would lose counts held here); their entries keep 0.
    pub packets: u64,
    pub bytes: u64,
}

/// `CtValue::frontend_node`: the frontend is one of the node's addresses (its replies
/// leave by the FIB).
pub const CT_NODE_YES: u8 = 1;
/// `CtValue::frontend_node`: the frontend is not one of the node's addresses.
pub const CT_NODE_NO: u8 = 2;

/// A flow's last packet, by its forward entry `fwd` and, if known, its reply entry
/// `reply`: an answered flow's replies that change no state stamp only their own entry
/// (one lookup per reply), so the later stamp of the two counts.
#[inline(always)]
pub fn flow_last_seen(fwd: &CtValue, reply: Option<&CtValue>) -> u64 {
    // Compared as `elapsed_ns` does, by the signed difference: stamps near a wrap of the
    // clock (a flow aged past the clock's start, in tests) still order right.
    match reply {
        Some(r) if (r.last_seen_ns.wrapping_sub(fwd.last_seen_ns) as i64) > 0 => r.last_seen_ns,
        _ => fwd.last_seen_ns,
    }
}

/// The key of a forward entry's partner: the tuple the backend's replies carry.
pub fn reply_key_of(fwd_key: &CtKey, fwd: &CtValue) -> CtKey {
    let mut key = CtKey::default();
    set_reply_key(&mut key, fwd_key, fwd);
    key
}

/// `reply_key_of`, written field by field into `out` (a per-CPU slot: the BPF programs
/// build partner keys off the stack).
#[inline(always)]
pub fn set_reply_key(out: &mut CtKey, fwd_key: &CtKey, fwd: &CtValue) {
    let snat = fwd.flags & CT_F_SNAT != 0;
    out.saddr = fwd.xlate_addr;
    out.daddr = if snat { fwd.nat_addr } else { fwd_key.saddr };
    out.sport = fwd.xlate_port;
    out.dport = if snat { fwd.nat_port } else { fwd_key.sport };
    out.proto = fwd_key.proto;
    out.family = fwd_key.family;
    out.dir = CT_DIR_REPLY;
    out._pad = 0;
}

/// The key of a reply entry's partner: the client's tuple towards the frontend.
pub fn forward_key_of(reply_key: &CtKey, reply: &CtValue) -> CtKey {
    let mut key = CtKey::default();
    set_forward_key(&mut key, reply_key, reply);
    key
}

/// `forward_key_of`, written field by field into `out`.
#[inline(always)]
pub fn set_forward_key(out: &mut CtKey, reply_key: &CtKey, reply: &CtValue) {
    let snat = reply.flags & CT_F_SNAT != 0;
    out.saddr = if snat {
        reply.nat_addr
    } else {
        reply_key.daddr
    };
    out.daddr = reply.xlate_addr;
    out.sport = if snat {
        reply.nat_port
    } else {
        reply_key.dport
    };
    out.dport = reply.xlate_port;
    out.proto = reply_key.proto;
    out.family = reply_key.family;
    out.dir = CT_DIR_FORWARD;
    out._pad = 0;
}

/// Nanoseconds from `then` to `now` on `bpf_ktime_get_ns()`'s clock; 0 when `then` is
/// later. Another CPU may stamp an entry with a time read after ours: a plain
/// subtraction would wrap and call a live flow long idle.
#[inline(always)]
pub const fn elapsed_ns(now: u64, then: u64) -> u64 {
    let d = now.wrapping_sub(then) as i64;
    if d < 0 { 0 } else { d as u64 }
}

/// A closed TCP flow (both FINs — netfilter's TIME_WAIT — or a RST — CLOSE): a new SYN
/// on its tuple opens a new flow, and its masquerade port may be given to another.
pub const fn ct_closed(flags: u8) -> bool {
    flags & CT_F_RST != 0
        || flags & (CT_F_FIN_ORIG | CT_F_FIN_REPLY) == (CT_F_FIN_ORIG | CT_F_FIN_REPLY)
}

/// Seconds an idle flow is kept, by state (kube-proxy's conntrack settings where it has
/// them, netfilter's defaults for the rest). An expired flow is ignored, replaced by the
/// next new flow on its tuple, and removed by the agent's collector.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtTimeouts {
    /// TCP (and SCTP) before the backend answered.
    pub tcp_syn: u32,
    /// TCP after it did (`conntrack.tcpEstablishedTimeout`).
    pub tcp_established: u32,
    /// TCP after a FIN from one side (`conntrack.tcpCloseWaitTimeout`).
    pub tcp_closing: u32,
    /// UDP before an answer (`conntrack.udpTimeout`).
    pub udp: u32,
    /// UDP after one (`conntrack.udpStreamTimeout`).
    pub udp_stream: u32,
    /// TCP after FINs from both sides (netfilter's TIME_WAIT).
    pub tcp_time_wait: u32,
    /// TCP after a RST (netfilter's CLOSE).
    pub tcp_close: u32,
}

impl CtTimeouts {
    /// Built-in defaults: kube-proxy's conntrack defaults, netfilter's TIME_WAIT and
    /// CLOSE, 60 s for unanswered TCP.
    pub const DEFAULT: Self = Self {
        tcp_syn: 60,
        tcp_established: 86_400,
        tcp_closing: 3_600,
        udp: 30,
        udp_stream: 120,
        tcp_time_wait: 120,
        tcp_close: 10,
    };

    /// How long a flow in this state (protocol, forward entry's `CT_F_*`) may idle.
    /// Shared by the programs and the agent's collector, so both expire alike.
    #[inline(always)]
    pub fn idle_limit_s(&self, proto: u8, flags: u8) -> u32 {
        let d = Self::DEFAULT;
        let pick = |v: u32, default: u32| if v == 0 { default } else { v };
        if proto == PROTO_TCP || proto == PROTO_SCTP {
            // SCTP has no FIN we watch: its associations age like TCP that never closes.
            if flags & CT_F_RST != 0 {
                pick(self.tcp_close, d.tcp_close)
            } else if ct_closed(flags) {
                pick(self.tcp_time_wait, d.tcp_time_wait)
            } else if flags & (CT_F_FIN_ORIG | CT_F_FIN_REPLY) != 0 {
                pick(self.tcp_closing, d.tcp_closing)
            } else if flags & CT_F_ASSURED != 0 {
                pick(self.tcp_established, d.tcp_established)
            } else {
                // Also after a SYN-ACK until the client acknowledges it (SYN_RECV).
                pick(self.tcp_syn, d.tcp_syn)
            }
        } else if flags & CT_F_REPLIED != 0 {
            pick(self.udp_stream, d.udp_stream)
        } else {
            pick(self.udp, d.udp)
        }
    }

    /// Whether a flow last seen at `last_seen_ns` has idled past its limit at `now_ns`.
    /// A `last_seen_ns` after `now_ns` (another CPU stamped the flow after this one read
    /// the clock) is no idle time at all, not a wrapped-around eternity.
    #[inline(always)]
    pub fn expired(&self, proto: u8, flags: u8, last_seen_ns: u64, now_ns: u64) -> bool {
        elapsed_ns(now_ns, last_seen_ns)
            > u64::from(self.idle_limit_s(proto, flags)) * 1_000_000_000
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FAMILY_V4, PROTO_TCP, PROTO_UDP};
    use core::mem::{align_of, size_of};

    /// Sizes are part of the ABI: a change here must be a deliberate, versioned change.
    #[test]
    fn layout_is_stable() {
        assert_eq!(size_of::<CtKey>(), 40);
        assert_eq!(size_of::<CtValue>(), 72);
        assert_eq!(size_of::<CtTimeouts>(), 28);
        // The kernel rejects hash values aligned above 8 bytes.
        assert!(align_of::<CtValue>() <= 8);
    }

    /// No implicit padding: the sum of the field sizes equals the struct size.
    #[test]
    fn no_implicit_padding() {
        assert_eq!(size_of::<CtKey>(), 16 + 16 + 2 + 2 + 1 + 1 + 1 + 1);
        assert_eq!(
            size_of::<CtValue>(),
            8 + 4 + 4 + 16 + 16 + 2 + 2 + 1 + 3 + 8 + 8
        );
    }

    /// The later of a flow's two stamps, across the clock's wrap too.
    #[test]
    fn a_flows_last_packet_is_the_later_stamp_of_its_entries() {
        let at = |t: u64| CtValue {
            last_seen_ns: t,
            ..CtValue::default()
        };
        assert_eq!(flow_last_seen(&at(5), Some(&at(9))), 9);
        assert_eq!(flow_last_seen(&at(9), Some(&at(5))), 9);
        assert_eq!(flow_last_seen(&at(9), None), 9);
        assert_eq!(
            flow_last_seen(&at(u64::MAX - 3), Some(&at(2))),
            2,
            "after the wrap"
        );
        assert_eq!(flow_last_seen(&at(2), Some(&at(u64::MAX - 3))), 2);
    }

    /// Each TCP state ages by its own limit, as netfilter's do; zero means the default.
    #[test]
    fn idle_limits_follow_the_flow_state() {
        let t = CtTimeouts {
            tcp_established: 500,
            ..CtTimeouts::default()
        };
        let tcp = |flags| t.idle_limit_s(PROTO_TCP, flags);
        assert_eq!(tcp(0), 60);
        assert_eq!(tcp(CT_F_REPLIED), 60, "SYN-ACK seen, not acknowledged");
        assert_eq!(tcp(CT_F_REPLIED | CT_F_ASSURED), 500);
        assert_eq!(tcp(CT_F_REPLIED | CT_F_FIN_ORIG), 3_600);
        assert_eq!(tcp(CT_F_REPLIED | CT_F_FIN_REPLY), 3_600);
        assert_eq!(tcp(CT_F_REPLIED | CT_F_FIN_ORIG | CT_F_FIN_REPLY), 120);
        assert_eq!(tcp(CT_F_REPLIED | CT_F_RST), 10);
        assert_eq!(tcp(CT_F_RST | CT_F_FIN_ORIG), 10);
        assert_eq!(t.idle_limit_s(PROTO_UDP, CT_F_SNAT), 30);
        assert_eq!(t.idle_limit_s(PROTO_UDP, CT_F_REPLIED), 120);
        assert!(!t.expired(PROTO_UDP, 0, 1_000, 1_000 + 30_000_000_000));
        assert!(t.expired(PROTO_UDP, 0, 1_000, 1_001 + 30_000_000_000));
        // Stamped by another CPU a moment after our clock read: just seen, not ancient.
        assert!(!t.expired(PROTO_TCP, CT_F_ASSURED, 5_000, 4_000));
        assert_eq!(elapsed_ns(4_000, 5_000), 0);
        // Entries aged past the clock's start (a young machine) still age correctly.
        assert_eq!(elapsed_ns(1_000, 1_000u64.wrapping_sub(7_000)), 7_000);
        assert!(ct_closed(CT_F_RST) && !ct_closed(CT_F_FIN_ORIG));
        // Stamped by another CPU after this one read the clock: not idle, not expired.
        assert!(!t.expired(PROTO_TCP, CT_F_REPLIED, 1_000_001, 1_000_000));
    }

    /// Each entry of a flow names its partner, masqueraded or not.
    #[test]
    fn partner_keys_round_trip() {
        let client = CtKey {
            saddr: [0x0a00_0001, 0, 0, 0],
            daddr: [0x0a60_000a, 0, 0, 0],
            sport: 40_000u16.to_be(),
            dport: 80u16.to_be(),
            proto: PROTO_TCP,
            family: FAMILY_V4,
            dir: CT_DIR_FORWARD,
            _pad: 0,
        };
        for snat in [false, true] {
            let fwd = CtValue {
                xlate_addr: [0x0af4_0002, 0, 0, 0],
                xlate_port: 8080u16.to_be(),
                nat_addr: if snat { [0xc0a8_000a, 0, 0, 0] } else { [0; 4] },
                nat_port: if snat { 20_001u16.to_be() } else { 0 },
                flags: if snat { CT_F_SNAT } else { 0 },
                ..CtValue::default()
            };
            let rkey = reply_key_of(&client, &fwd);
            assert_eq!(rkey.saddr, fwd.xlate_addr);
            assert_eq!(rkey.dir, CT_DIR_REPLY);
            let reply = CtValue {
                xlate_addr: client.daddr,
                xlate_port: client.dport,
                nat_addr: if snat { client.saddr } else { [0; 4] },
                nat_port: if snat { client.sport } else { 0 },
                flags: fwd.flags,
                ..CtValue::default()
            };
            assert_eq!(forward_key_of(&rkey, &reply), client);
        }
    }
}
