//! The map ABI shared by the BPF programs (`proxy-ebpf`) and the agent (`proxy-agent`).
//!
//! Every key and value is `#[repr(C)]` with explicit padding fields, so both sides agree
//! byte for byte and the kernel never sees uninitialised padding in a key. Addresses are
//! stored as four 32-bit words in network byte order; an IPv4 address uses word 0 and
//! leaves the rest zero. Ports are in network byte order too, as the packet carries them.
//! `ABI.md` beside this crate describes each map.
#![cfg_attr(not(test), no_std)]

/// Address family tag stored in keys and values.
pub const FAMILY_V4: u8 = 4;
/// Address family tag stored in keys and values.
pub const FAMILY_V6: u8 = 6;

/// IP protocol numbers as they appear in the IP header.
pub const PROTO_TCP: u8 = 6;
/// IP protocol numbers as they appear in the IP header.
pub const PROTO_UDP: u8 = 17;
/// IP protocol numbers as they appear in the IP header.
pub const PROTO_SCTP: u8 = 132;

/// CRC32c — SCTP's checksum — arithmetic for rewriting ports in place. The CRC is linear:
/// when the first word of an `len`-byte packet changes by `delta` (xor), its checksum
/// changes by the raw CRC of `delta` followed by `len - 4` zero bytes, whatever the rest
/// holds. Branch-free and bounded, so the verifier walks it quickly.
pub mod crc32c {
    /// The CRC32c polynomial, bit-reflected.
    pub const POLY: u32 = 0x82F6_3B78;

    /// `a·b mod POLY` in the reflected representation (bit 31 is x^0).
    #[inline(always)]
    pub const fn mul(a: u32, mut b: u32) -> u32 {
        let mut p = 0;
        let mut i = 0;
        while i < 32 {
            p ^= b & ((a >> (31 - i)) & 1).wrapping_neg();
            b = (b >> 1) ^ (POLY & (b & 1).wrapping_neg());
            i += 1;
        }
        p
    }

    /// `X2N[k] = x^(2^k) mod POLY`.
    pub const X2N: [u32; 32] = {
        let mut t = [0u32; 32];
        let mut p = 1u32 << 30; // x^1
        let mut k = 0;
        while k < 32 {
            t[k] = p;
            p = mul(p, p);
            k += 1;
        }
        t
    };

    /// `x^(8·n) mod POLY`: what `n` (< 65 536) zero bytes do to a CRC.
    #[inline(always)]
    pub fn zeros(n: u32) -> u32 {
        let mut p = 1u32 << 31; // x^0
        let mut k = 0;
        while k < 16 {
            let m = mul(X2N[(k + 3) & 31], p);
            let take = ((n >> k) & 1).wrapping_neg();
            p = (m & take) | (p & !take);
            k += 1;
        }
        p
    }

    /// The raw CRC (no initial value, no final xor) of four bytes, given as the
    /// little-endian word they make.
    #[inline(always)]
    pub const fn word(mut c: u32) -> u32 {
        let mut i = 0;
        while i < 32 {
            c = (c >> 1) ^ (POLY & (c & 1).wrapping_neg());
            i += 1;
        }
        c
    }

    /// The checksum (as the little-endian word SCTP stores) of a packet whose first four
    /// bytes changed by `delta`, given `zeros(len)` for its length `len`: the raw CRC of
    /// a word is the word times x^32, so the shift past the word and the `len - 4`
    /// bytes after it is `zeros(len)`.
    #[inline(always)]
    pub fn after_first_word_change(checksum: u32, delta: u32, zeros_len: u32) -> u32 {
        checksum ^ mul(zeros_len, delta)
    }

    /// The checksum SCTP stores (as a little-endian word) for `packet` (the SCTP header
    /// and chunks), its checksum field taken as zero. Bit by bit: for tools and tests.
    pub fn sctp_checksum(packet: &[u8]) -> u32 {
        let mut c = !0u32;
        let mut i = 0;
        while i < packet.len() {
            c ^= if (8..12).contains(&i) {
                0
            } else {
                packet[i] as u32
            };
            let mut bit = 0;
            while bit < 8 {
                c = (c >> 1) ^ (POLY & (c & 1).wrapping_neg());
                bit += 1;
            }
            i += 1;
        }
        !c
    }

    /// Entries of the `SCTP_ZEROS` table (`zeros(len)` at index `len`): SCTP packets shorter
    /// than this get their ports rewritten with a valid checksum. (Longer ones only come
    /// as offloaded segments whose CRC the kernel computes later.)
    pub const TABLE_LEN: u32 = 16_384;
}

/// Lookup scope of a service entry: used by traffic from outside the node (and by every
/// caller when the service has a single scope).
pub const SCOPE_EXTERNAL: u8 = 0;
/// Lookup scope of a service entry: traffic from pods and the node itself, used only when
/// the service carries [`SVC_F_TWO_SCOPES`] (internal and external backends differ).
pub const SCOPE_INTERNAL: u8 = 1;

/// `ServiceValue::flags`: `sessionAffinity: ClientIP`.
pub const SVC_F_AFFINITY: u16 = 1 << 0;
/// `ServiceValue::flags`: internal traffic looks up the `SCOPE_INTERNAL` entry.
pub const SVC_F_TWO_SCOPES: u16 = 1 << 1;
/// `ServiceValue::flags`: with no backends, drop silently instead of rejecting.
pub const SVC_F_DROP_NO_BACKENDS: u16 = 1 << 2;
/// `ServiceValue::flags`: an external frontend (NodePort, external IP, load-balancer IP):
/// masqueraded like kube-proxy's KUBE-EXT chains.
pub const SVC_F_EXTERNAL: u16 = 1 << 3;
/// `ServiceValue::flags`: `externalTrafficPolicy: Local`: outside clients keep their
/// source address (only traffic the node itself sends is masqueraded).
pub const SVC_F_EXT_LOCAL: u16 = 1 << 4;
/// `ServiceValue::flags`: only sources in `SOURCE_RANGES` for this service id may connect.
pub const SVC_F_SOURCE_RANGES: u16 = 1 << 5;
/// Backends have unequal weights: `WEIGHTS` holds them (else every weight is 1).
pub const SVC_F_WEIGHTED: u16 = 1 << 6;

/// `ServiceValue::scheduler`: how a new flow's backend is chosen, IPVS's schedulers as
/// map lookups. For `WRR` and the hashing ones the agent expands the backend set into the
/// slots (weighted interleave, Maglev table); the programs then pick a slot.
pub mod sched {
    /// A uniformly random slot (iptables' `statistic mode random`): the default.
    pub const RANDOM: u8 = 0;
    /// Round robin: a per-CPU cursor per service entry.
    pub const RR: u8 = 1;
    /// Weighted round robin: round robin over slots the agent interleaved by weight.
    pub const WRR: u8 = 2;
    /// Source hashing: the client's address picks an entry of a Maglev table (`MAGLEV`).
    pub const SH: u8 = 3;
    /// Destination hashing: the frontend's address picks a slot of a Maglev table.
    pub const DH: u8 = 4;
    /// Maglev hashing of the flow (client address and port): the same flow lands on the
    /// same backend on every node, and a removed backend moves only its own flows.
    pub const MH: u8 = 5;
    /// Least connections: fewest active connections (`ACTIVE_CONNS`).
    pub const LC: u8 = 6;
    /// Weighted least connections: fewest active connections per weight.
    pub const WLC: u8 = 7;
    /// Shortest expected delay: fewest (active + 1) per weight.
    pub const SED: u8 = 8;
    /// Never queue: an idle backend if there is one, else as `SED`.
    pub const NQ: u8 = 9;
    /// Backends the least-connection schedulers compare per new flow: all of them up to
    /// this many, else this many slots from a random start (a bounded loop for the
    /// verifier; the best of several random choices is near the least loaded).
    pub const LC_SCAN: u32 = 4;
}

/// The hash of a client (or frontend) address and port that the hashing schedulers use:
/// the same function in the programs and in the agent's reference and `trace`. `port` is
/// as the packet carries it (network byte order), 0 where there is none.
#[inline(always)]
pub fn sched_hash(addr: &[u32; 4], port: u16) -> u32 {
    // murmur3's finalizer over the words: cheap, and every input bit reaches every
    // output bit, so a `% table_len` of it spreads evenly.
    let mut h: u32 = 0x9747_b28c;
    let mut i = 0;
    while i < 4 {
        h ^= addr[i];
        h = h
            .wrapping_mul(0xcc9e_2d51)
            .rotate_left(15)
            .wrapping_mul(0x1b87_3593);
        i += 1;
    }
    h ^= u32::from(port);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// Per frontend (by `rev_nat_id`) and per backend (by id): what `ipvsadm -Ln --stats`
/// shows. Per CPU; the agent sums.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbStats {
    /// New connections (flows) scheduled.
    pub conns: u64,
    /// Client to backend.
    pub packets_in: u64,
    pub bytes_in: u64,
    /// Backend to client.
    pub packets_out: u64,
    pub bytes_out: u64,
}

/// `NodeConfig::flags`: masquerade every service connection (kube-proxy's masqueradeAll).
pub const CFG_MASQUERADE_ALL: u32 = 1 << 0;
/// `NodeConfig::flags`: pod traffic can be told apart (`LOCAL_NETS` holds the pod CIDRs).
pub const CFG_LOCAL_DETECTOR: u32 = 1 << 1;

/// `LpmData::tag` of a pod-network CIDR in `LOCAL_NETS` (or'ed with the family).
pub const LPM_TAG_POD: u32 = 0;
/// `LpmData::tag` of one of the node's own addresses in `LOCAL_NETS` (or'ed with the family).
pub const LPM_TAG_NODE: u32 = 0x100;
/// Bits of `LpmData::tag` every LPM key matches in full before the address bits.
pub const LPM_TAG_BITS: u32 = 32;

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

/// Masquerade source ports by default (host byte order): below the NodePort range and
/// outside the kernel's default ephemeral range (32768-60999), so a masqueraded flow
/// never shares a tuple with a connection the node itself opens (Calico's eBPF dataplane
/// uses the same range). The agent checks the node's `ip_local_port_range`.
pub const SNAT_PORT_MIN: u16 = 20_000;
pub const SNAT_PORT_MAX: u16 = 29_999;

/// `Backend::state`: receives new connections.
pub const BACKEND_ACTIVE: u8 = 0;
/// `Backend::state`: keeps existing flows, gets no new ones.
pub const BACKEND_TERMINATING: u8 = 1;

/// `AffinityKey::kind`: the client is identified by its source address (per-packet path).
pub const AFFINITY_BY_ADDR: u8 = 0;
/// `AffinityKey::kind`: the client is identified by its network-namespace cookie
/// (connect-time path, where the source address is not chosen yet).
pub const AFFINITY_BY_NETNS: u8 = 1;

/// `CtKey::dir`: a packet from the client towards the service.
pub const CT_DIR_FORWARD: u8 = 0;
/// `CtKey::dir`: a reply from the backend towards the client.
pub const CT_DIR_REPLY: u8 = 1;

/// Names of the maps, as the BPF object declares them and as they are pinned.
pub mod map_names {
    pub const SERVICES: &str = "SERVICES";
    pub const BACKEND_SLOTS: &str = "BACKEND_SLOTS";
    pub const BACKENDS: &str = "BACKENDS";
    pub const AFFINITY: &str = "AFFINITY";
    pub const REV_NAT: &str = "REV_NAT";
    /// Connect-time path: what the hooks did for each socket (by cookie).
    pub const SOCK_LB: &str = "SOCK_LB";
    /// Which backend ids belong to which service entry, and since when.
    pub const MEMBERS: &str = "MEMBERS";
    /// Answered flows (hash, expired by the agent's collector).
    pub const CONNTRACK: &str = "CONNTRACK";
    /// Flows not answered yet (LRU: a flood of new flows only evicts its own kind).
    pub const CONNTRACK_NEW: &str = "CONNTRACK_NEW";
    pub const COUNTERS: &str = "COUNTERS";
    pub const NODE_CONFIG: &str = "NODE_CONFIG";
    pub const LOCAL_NETS: &str = "LOCAL_NETS";
    pub const SOURCE_RANGES: &str = "SOURCE_RANGES";
    /// The per-packet path's tail calls (`TAIL_SCTP_CRC`), the SCTP checksum work in
    /// flight, and the CRC32c shift table.
    pub const TC_TAIL: &str = "TC_TAIL";
    pub const SCTP_PENDING: &str = "SCTP_PENDING";
    pub const SCTP_ZEROS: &str = "SCTP_ZEROS";
    /// The ports of IPv4 datagrams whose later fragments are in flight.
    pub const FRAGMENTS: &str = "FRAGMENTS";
    /// Flows netfilter translated before the classifier was attached (kube-proxy's),
    /// by their client tuple: the classifier leaves their packets to netfilter.
    pub const NETFILTER_FLOWS: &str = "NETFILTER_FLOWS";
    /// Maglev tables (`sched::SH`, `MH`) in chunks (`MaglevChunk`).
    pub const MAGLEV: &str = "MAGLEV";
    /// Per service entry, per CPU: the round-robin cursor (`sched::RR`, `WRR`).
    pub const RR_CURSORS: &str = "RR_CURSORS";
    /// Per backend id: connections open now (the least-connection schedulers).
    pub const ACTIVE_CONNS: &str = "ACTIVE_CONNS";
    /// Per (service entry, backend) with unequal weights: the weight.
    pub const WEIGHTS: &str = "WEIGHTS";
    /// `LbStats` per frontend (`rev_nat_id`) and per backend id.
    pub const LB_STATS: &str = "LB_STATS";
    pub const BACKEND_STATS: &str = "BACKEND_STATS";
    /// Every map the agent pins, in a stable order. (The SCTP ones are pinned so a tail
    /// call keeps working while the agent is down: a program array loses its entries
    /// when nothing in user space holds it.)
    pub const ALL: [&str; 24] = [
        SERVICES,
        BACKEND_SLOTS,
        BACKENDS,
        AFFINITY,
        REV_NAT,
        SOCK_LB,
        MEMBERS,
        CONNTRACK,
        CONNTRACK_NEW,
        COUNTERS,
        NODE_CONFIG,
        LOCAL_NETS,
        SOURCE_RANGES,
        TC_TAIL,
        SCTP_PENDING,
        SCTP_ZEROS,
        FRAGMENTS,
        NETFILTER_FLOWS,
        MAGLEV,
        RR_CURSORS,
        ACTIVE_CONNS,
        WEIGHTS,
        LB_STATS,
        BACKEND_STATS,
    ];
}

/// `TC_TAIL` index of the program that finishes an SCTP packet's checksum.
pub const TAIL_SCTP_CRC: u32 = 0;

/// An SCTP packet's checksum work, left by the classifier for its tail call (per CPU).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SctpPending {
    /// Xor of the old and new first word (the ports), as loaded; 0 = nothing to do.
    pub delta: u32,
    /// The SCTP packet's length.
    pub len: u32,
    /// Offset of the checksum in the packet.
    pub sum_off: u32,
    /// The classifier's verdict, returned by the tail call.
    pub verdict: i32,
}

/// Default capacities; the agent may override them at load time. The hash maps that the
/// agent writes are not preallocated: an unused entry costs only its bucket.
pub mod capacity {
    /// Frontends × scopes: 100k Services with room to spare.
    pub const SERVICES: u32 = 262_144;
    /// 100k Service ports × 10 endpoints on their ClusterIPs, with room for NodePorts and
    /// for the second generation of a backend set during a flip (`ebpf.mapSizes`
    /// raises it).
    pub const BACKEND_SLOTS: u32 = 2_097_152;
    /// 1M endpoints: 100k Services × 10.
    pub const BACKENDS: u32 = 1_048_576;
    pub const AFFINITY: u32 = 65_536;
    pub const REV_NAT: u32 = 262_144;
    /// Live sockets that connected or sent to a frontend (entries go when the socket is
    /// released, so this bounds concurrent sockets, not connections over time).
    pub const SOCK_LB: u32 = 262_144;
    /// One entry per live backend slot of the current generations.
    pub const MEMBERS: u32 = 2_097_152;
    /// Answered flows: kube-proxy's `conntrack.min` (the agent sizes it from
    /// `conntrack.maxPerCore` × CPUs, at least `conntrack.min`).
    pub const CONNTRACK: u32 = 131_072;
    /// Flows not answered yet (a quarter of the answered table by default).
    pub const CONNTRACK_NEW: u32 = 32_768;
    pub const LOCAL_NETS: u32 = 1_024;
    pub const SOURCE_RANGES: u32 = 16_384;
    pub const FRAGMENTS: u32 = 8_192;
    /// Flows netfilter already translated when the agent started (a migration's live
    /// connections; LRU: beyond this, the oldest go back to being dropped as `ct_invalid`).
    pub const NETFILTER_FLOWS: u32 = 65_536;
    /// Round-robin cursors (LRU: an evicted cursor restarts at a random slot).
    pub const RR_CURSORS: u32 = 65_536;
    /// Weights of backends in services with unequal weights.
    pub const WEIGHTS: u32 = 262_144;
}

/// Most backend slots one service entry may reference; bounds the BPF loops.
pub const MAX_BACKENDS_PER_SERVICE: u32 = 65_535;

/// A service frontend: VIP, port and protocol, in one lookup scope.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub family: u8,
    pub scope: u8,
    pub _pad: [u8; 3],
}

/// What a frontend leads to. `count` backend slots are live under `(id, rev)`; the agent
/// writes a new set under a new `rev` and then replaces this value in one update, so a
/// lookup sees either the old set or the new one, never a mix.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    /// Agent-assigned, unique per frontend; also names the slots and affinity entries.
    pub id: u32,
    /// Generation of the backend slots in use.
    pub rev: u32,
    /// Number of live slots; 0 means "no usable endpoints": reject (or drop).
    pub count: u16,
    /// `SVC_F_*`.
    pub flags: u16,
    /// `sessionAffinity` timeout in seconds (0 when affinity is off).
    pub affinity_timeout_s: u32,
    /// Key into `REV_NAT` that turns a backend address back into this frontend.
    pub rev_nat_id: u32,
    /// `sched::*`: how a new flow's slot is chosen.
    pub scheduler: u8,
    pub _pad: u8,
    /// `SH`/`MH`: the length of the Maglev table in `MAGLEV` (0 for the others).
    pub table_len: u16,
}

/// Entries of a Maglev table per `MAGLEV` value.
pub const MAGLEV_CHUNK: u32 = 16;

/// `MAGLEV_CHUNK` consecutive entries of a service entry's Maglev table, keyed by
/// `BackendSlotKey {service_id, rev, slot: entry / MAGLEV_CHUNK}`: each the slot (of
/// that generation's `BACKEND_SLOTS`) a flow hashing to it takes. A table of thousands of
/// entries is a few hundred small values, which stay in the cache where thousands of
/// slot entries did not.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaglevChunk {
    pub slots: [u16; MAGLEV_CHUNK as usize],
}

/// One backend slot of one generation of a service's backend set.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSlotKey {
    pub service_id: u32,
    pub rev: u32,
    /// 0-based, `< ServiceValue::count`.
    pub slot: u32,
}

/// The backend a slot points at.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendSlot {
    pub backend_id: u32,
}

/// A backend, keyed by its agent-assigned id (`u32`).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend {
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub family: u8,
    /// `BACKEND_*`.
    pub state: u8,
    pub _pad: [u8; 3],
}

/// Session-affinity key: one client of one service.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    /// Client address, or the netns cookie in words 0-1 (`AFFINITY_BY_NETNS`).
    pub client: [u32; 4],
    pub service_id: u32,
    pub family: u8,
    /// `AFFINITY_BY_*`.
    pub kind: u8,
    pub _pad: [u8; 2],
}

/// Session-affinity value: the backend a client is pinned to and when it was last used.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityValue {
    /// `bpf_ktime_get_ns()` of the last use.
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub _pad: u32,
}

/// Reverse-NAT value (keyed by `ServiceValue::rev_nat_id`, a `u32`): the frontend that
/// replies must appear to come from.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNatValue {
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub family: u8,
    pub proto: u8,
}

/// One frontend a socket was sent to by the connect-time hooks, and the backend chosen.
/// `service_id == 0` marks an empty binding.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockBinding {
    /// The backend's own address (IPv4 for an IPv6 socket that named `::ffff:a.b.c.d`).
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub family: u8,
    pub _pad: u8,
    /// The service entry the backend was chosen from (`MEMBERS` key).
    pub service_id: u32,
    /// The frontend replies are shown as (`REV_NAT` key).
    pub rev_nat_id: u32,
    pub backend_id: u32,
    /// `bpf_ktime_get_ns()` when the backend was chosen: the binding holds while
    /// `MEMBERS` has the pair since no later than this.
    pub bound_ns: u64,
}

/// `SockLb::sent` length: frontends one unconnected socket keeps a backend for at once.
pub const SOCK_SENT_SLOTS: usize = 8;

/// `SOCK_LB` value (keyed by the socket cookie, a `u64`): what the connect-time hooks did
/// for one socket. Deleted by `sock_release` when the socket goes.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockLb {
    /// Where `connect` sent the socket (TCP, connected UDP, SCTP).
    pub connected: SockBinding,
    /// Where `sendto` datagrams go, per frontend (unconnected UDP).
    pub sent: [SockBinding; SOCK_SENT_SLOTS],
    /// The `sent` slot to reuse next when all are taken.
    pub next: u32,
    pub _pad: u32,
}

/// `MEMBERS` key: a backend id in a service entry's current backend set. The value (`u64`)
/// is the agent's `CLOCK_MONOTONIC` time (the clock of `bpf_ktime_get_ns`) when the pair
/// was added: an affinity entry or socket binding made before then is from an earlier
/// life of the ids and is ignored.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemberKey {
    pub service_id: u32,
    pub backend_id: u32,
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

/// An IPv4 datagram in fragments: later fragments carry no ports, so the first one's are
/// remembered under the datagram's identity (RFC 791: source, destination, protocol, id).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub saddr: u32,
    pub daddr: u32,
    /// Network byte order.
    pub id: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// The ports of a fragmented datagram, from its first fragment (network byte order).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragPorts {
    pub sport: u16,
    pub dport: u16,
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
    /// Forward entries: `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) of the flow's last packet.
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
    pub _pad: [u8; 3],
}

/// The key of a forward entry's partner: the tuple the backend's replies carry.
pub fn reply_key_of(fwd_key: &CtKey, fwd: &CtValue) -> CtKey {
    let snat = fwd.flags & CT_F_SNAT != 0;
    CtKey {
        saddr: fwd.xlate_addr,
        daddr: if snat { fwd.nat_addr } else { fwd_key.saddr },
        sport: fwd.xlate_port,
        dport: if snat { fwd.nat_port } else { fwd_key.sport },
        proto: fwd_key.proto,
        family: fwd_key.family,
        dir: CT_DIR_REPLY,
        _pad: 0,
    }
}

/// The key of a reply entry's partner: the client's tuple towards the frontend.
pub fn forward_key_of(reply_key: &CtKey, reply: &CtValue) -> CtKey {
    let snat = reply.flags & CT_F_SNAT != 0;
    CtKey {
        saddr: if snat {
            reply.nat_addr
        } else {
            reply_key.daddr
        },
        daddr: reply.xlate_addr,
        sport: if snat {
            reply.nat_port
        } else {
            reply_key.dport
        },
        dport: reply.xlate_port,
        proto: reply_key.proto,
        family: reply_key.family,
        dir: CT_DIR_FORWARD,
        _pad: 0,
    }
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

/// Node-wide settings of the per-packet path (`NODE_CONFIG`, one entry at index 0).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeConfig {
    /// The node address masqueraded IPv4 traffic leaves with (word 0; 0 = none).
    pub snat_v4: [u32; 4],
    /// The node address masqueraded IPv6 traffic leaves with (zero = none).
    pub snat_v6: [u32; 4],
    /// `CFG_*`.
    pub flags: u32,
    /// Connection-tracking timeouts, in seconds, by state (0 = the built-in default).
    pub timeouts: CtTimeouts,
    /// Masquerade source ports, host byte order, inclusive (0 = `SNAT_PORT_MIN`/`MAX`).
    pub snat_port_min: u16,
    pub snat_port_max: u16,
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

/// Data of an LPM-trie key: a tag matched in full, then the address bits.
/// `LOCAL_NETS`: tag = `LPM_TAG_POD | family` or `LPM_TAG_NODE | family`.
/// `SOURCE_RANGES`: tag = the service id.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LpmData {
    /// Always matched in full (the key's prefix length counts its 32 bits first).
    pub tag: u32,
    pub addr: [u32; 4],
}

/// Indices of the per-CPU `COUNTERS` array: why packets and connections took the path
/// they did. The agent exports them as metrics.
pub mod counter {
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
    /// Length of the array.
    pub const COUNT: u32 = 20;
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
    ];
}

#[cfg(feature = "user")]
mod user {
    use super::*;

    macro_rules! pod {
        ($($t:ty),* $(,)?) => {$(
            // SAFETY: the type derives bytemuck::Pod, which proves at compile time that it
            // is #[repr(C)] with integer fields and no implicit padding.
            unsafe impl aya::Pod for $t {}
        )*};
    }
    pod!(
        ServiceKey,
        ServiceValue,
        BackendSlotKey,
        BackendSlot,
        Backend,
        AffinityKey,
        AffinityValue,
        RevNatValue,
        SockBinding,
        SockLb,
        MemberKey,
        CtKey,
        CtValue,
        NodeConfig,
        CtTimeouts,
        LpmData,
        FragKey,
        FragPorts,
        LbStats,
        MaglevChunk,
    );
}

#[cfg(test)]
mod tests {
    use super::crc32c::sctp_checksum as sctp_crc;

    #[test]
    fn crc32c_known_value_and_port_rewrite() {
        // RFC 3720 B.4: 32 bytes of zeros.
        let mut c = !0u32;
        for _ in 0..32 {
            for _ in 0..8 {
                c = (c >> 1) ^ (super::crc32c::POLY & (c & 1).wrapping_neg());
            }
        }
        assert_eq!(!c, 0x8A91_36AA);
        for len in [12usize, 16, 17, 100, 1480, 9000, 65_000] {
            let mut pkt: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let before = sctp_crc(&pkt);
            let old = u32::from_le_bytes([pkt[0], pkt[1], pkt[2], pkt[3]]);
            pkt[0..4].copy_from_slice(&[0x12, 0x34, 0xab, 0xcd]);
            let new = u32::from_le_bytes([pkt[0], pkt[1], pkt[2], pkt[3]]);
            let zeros = super::crc32c::zeros(len as u32);
            assert_eq!(
                super::crc32c::after_first_word_change(before, old ^ new, zeros),
                sctp_crc(&pkt),
                "len {len}"
            );
        }
    }

    use super::*;
    use core::mem::{align_of, size_of};

    /// Sizes are part of the ABI: a change here must be a deliberate, versioned change.
    #[test]
    fn layout_is_stable() {
        assert_eq!(size_of::<ServiceKey>(), 24);
        assert_eq!(size_of::<ServiceValue>(), 24);
        assert_eq!(size_of::<BackendSlotKey>(), 12);
        assert_eq!(size_of::<BackendSlot>(), 4);
        assert_eq!(size_of::<MaglevChunk>(), 32);
        assert_eq!(size_of::<LbStats>(), 40);
        assert_eq!(size_of::<Backend>(), 24);
        assert_eq!(size_of::<AffinityKey>(), 24);
        assert_eq!(size_of::<AffinityValue>(), 16);
        assert_eq!(size_of::<RevNatValue>(), 20);
        assert_eq!(size_of::<SockBinding>(), 40);
        assert_eq!(size_of::<SockLb>(), 40 * (1 + SOCK_SENT_SLOTS) + 8);
        assert_eq!(size_of::<MemberKey>(), 8);
        assert_eq!(size_of::<CtKey>(), 40);
        assert_eq!(size_of::<FragKey>(), 12);
        assert_eq!(size_of::<FragPorts>(), 4);
        assert_eq!(size_of::<CtValue>(), 56);
        assert_eq!(size_of::<NodeConfig>(), 68);
        assert_eq!(size_of::<CtTimeouts>(), 28);
        assert_eq!(size_of::<LpmData>(), 20);
        // The kernel rejects hash values aligned above 8 bytes.
        assert!(align_of::<AffinityValue>() <= 8 && align_of::<CtValue>() <= 8);
    }

    /// No implicit padding: the sum of the field sizes equals the struct size. (With the
    /// `user` feature, `bytemuck::Pod`'s derive proves the same at compile time.)
    #[test]
    fn no_implicit_padding() {
        assert_eq!(size_of::<ServiceKey>(), 16 + 2 + 1 + 1 + 1 + 3);
        assert_eq!(size_of::<ServiceValue>(), 4 + 4 + 2 + 2 + 4 + 4 + 4);
        assert_eq!(size_of::<Backend>(), 16 + 2 + 1 + 1 + 1 + 3);
        assert_eq!(size_of::<AffinityKey>(), 16 + 4 + 1 + 1 + 2);
        assert_eq!(size_of::<AffinityValue>(), 8 + 4 + 4);
        assert_eq!(size_of::<RevNatValue>(), 16 + 2 + 1 + 1);
        assert_eq!(size_of::<SockBinding>(), 16 + 2 + 1 + 1 + 4 + 4 + 4 + 8);
        assert_eq!(size_of::<CtKey>(), 16 + 16 + 2 + 2 + 1 + 1 + 1 + 1);
        assert_eq!(size_of::<CtValue>(), 8 + 4 + 4 + 16 + 16 + 2 + 2 + 1 + 3);
        assert_eq!(size_of::<NodeConfig>(), 16 + 16 + 4 + 28 + 2 + 2);
    }

    #[test]
    fn counter_names_cover_every_index() {
        assert_eq!(counter::NAMES.len(), counter::COUNT as usize);
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
