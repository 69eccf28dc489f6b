//! Every map the programs share with the agent. Types and names come from `proxy-common`;
//! the agent pins them under its bpffs folder (and re-adopts them on restart); a private
//! load (tests, `trace`) gets fresh unpinned maps.
//!
//! Layer 0 (a leaf). Owns: the maps the agent pins (`proxy_common::map::ALL`, no other),
//! `count` (`COUNTERS`) and `port_marked` (the port filters' read). A map each load makes
//! afresh (a per-CPU scratch value, a rate limiter's tokens) lives beside the one module
//! that uses it instead. May import: no crate module.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{
        Array, HashMap, LpmTrie, LruHashMap, LruPerCpuHashMap, PerCpuArray, PerCpuHashMap,
        ProgramArray,
    },
    macros::btf_map,
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, BackendSlot, BackendSlotKey, CtKey, CtValue, DsrPermitKey,
    FragKey, FragPorts, LbStats, LpmData, MaglevChunk, MemberKey, NodeConfig, PORTS_PER_ENTRY,
    RevNatValue, SctpPending, ServiceKey, ServiceValue, SockLb, SockLbFilter, SockSlot, StatsKey,
    capacity, counter, crc32c, port_slot,
};

const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

#[btf_map]
pub static SERVICES: HashMap<
    ServiceKey,
    ServiceValue,
    { capacity::SERVICES as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static BACKEND_SLOTS: HashMap<
    BackendSlotKey,
    BackendSlot,
    { capacity::BACKEND_SLOTS as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static BACKENDS: HashMap<u32, Backend, { capacity::BACKENDS as usize }, NO_PREALLOC> =
    HashMap::new();

#[btf_map]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityValue, { capacity::AFFINITY as usize }> =
    LruHashMap::new();

#[btf_map]
pub static REV_NAT: HashMap<u32, RevNatValue, { capacity::REV_NAT as usize }, NO_PREALLOC> =
    HashMap::new();

/// Per socket (by cookie): where the connect-time hooks sent it. Not LRU: `sock_release`
/// deletes a socket's entry, so a full map means that many live sockets, and a new
/// socket goes untracked (counted) rather than evicting a live one's entry.
#[btf_map]
pub static SOCK_LB: HashMap<u64, SockLb, { capacity::SOCK_LB as usize }, NO_PREALLOC> =
    HashMap::new();

/// Connected sockets' bindings, in the slot each socket's cookie names: no hash, no
/// allocation, and consecutive sockets in neighbouring slots (a `SOCK_LB` insert's cold
/// bucket was a third of `connect4` in a profile). A socket whose slot another live
/// socket holds goes to `SOCK_LB`; `sock_release` frees the slot.
#[btf_map]
pub static SOCK_CONNECTED: Array<SockSlot, { capacity::SOCK_CONNECTED as usize }> = Array::new();

/// `SOCK_LB` entries per cookie slot, counted under `SOCK_LB_FILTER`'s generation: a
/// release whose slot counts none skips the `SOCK_LB` lookup (ABI.md, "the release
/// filter").
#[btf_map]
pub static SOCK_LB_COUNTS: Array<u32, { capacity::SOCK_LB_COUNTS as usize }> = Array::new();

#[btf_map]
pub static SOCK_LB_FILTER: Array<SockLbFilter, { capacity::SOCK_LB_FILTER as usize }> =
    Array::new();

/// (service entry, backend id) pairs of the current backend sets, with the time each was
/// added (agent-written).
#[btf_map]
pub static MEMBERS: HashMap<MemberKey, u64, { capacity::MEMBERS as usize }, NO_PREALLOC> =
    HashMap::new();

/// Answered flows: a preallocated hash, never evicted; the agent's collector removes
/// flows that idled past their state's limit.
#[btf_map]
pub static CONNTRACK: HashMap<CtKey, CtValue, { capacity::CONNTRACK as usize }> = HashMap::new();

/// Flows the backend has not answered yet: LRU, so a flood of new flows only evicts its
/// own kind.
#[btf_map]
pub static CONNTRACK_NEW: LruHashMap<CtKey, CtValue, { capacity::CONNTRACK_NEW as usize }> =
    LruHashMap::new();

/// The source ports reply tuples use, a byte each (`proxy_common::port_slot`).
#[btf_map]
pub static REPLY_PORTS: Array<[u8; PORTS_PER_ENTRY], { capacity::REPLY_PORTS as usize }> =
    Array::new();

/// The ports frontends use, a byte each (`proxy_common::port_slot`); the agent's.
#[btf_map]
pub static FRONTEND_PORTS: Array<[u8; PORTS_PER_ENTRY], { capacity::FRONTEND_PORTS as usize }> =
    Array::new();

/// Whether `port` (network byte order) is marked in a port filter (`REPLY_PORTS`,
/// `FRONTEND_PORTS`). An index past the map cannot happen (65,536 ports fill it
/// exactly); were it to, the answer is "marked", which costs only a lookup.
#[inline(always)]
pub fn port_marked<const N: usize>(filter: &Array<[u8; PORTS_PER_ENTRY], N>, port: u16) -> bool {
    let (idx, byte) = port_slot(port);
    filter.get(idx).is_none_or(|ports| ports[byte] != 0)
}

#[btf_map]
pub static COUNTERS: PerCpuArray<u64, { counter::COUNT as usize }> = PerCpuArray::new();

#[btf_map]
pub static NODE_CONFIG: Array<NodeConfig, 1> = Array::new();

/// The pod network and the node's own addresses: who is "inside".
#[btf_map]
pub static LOCAL_NETS: LpmTrie<LpmData, u8, { capacity::LOCAL_NETS as usize }> = LpmTrie::new();

/// `loadBalancerSourceRanges`, per service id.
#[btf_map]
pub static SOURCE_RANGES: LpmTrie<LpmData, u8, { capacity::SOURCE_RANGES as usize }> =
    LpmTrie::new();

/// `crc32c::zeros(len)` at index `len`, filled by the agent before anything is
/// attached: the CRC32c shift an SCTP port rewrite needs.
#[btf_map]
pub static SCTP_ZEROS: Array<u32, { crc32c::TABLE_LEN as usize }> = Array::new();

/// The classifier's tail calls: `TAIL_SCTP_CRC` finishes SCTP checksums in a program of
/// its own, which the verifier walks once (inline, its arithmetic would be walked on
/// every path of the classifier).
#[btf_map]
pub static TC_TAIL: ProgramArray<1> = ProgramArray::new();

#[btf_map]
pub static SCTP_PENDING: PerCpuArray<SctpPending, 1> = PerCpuArray::new();

/// First-fragment ports of fragmented IPv4 datagrams, for their later fragments.
#[btf_map]
pub static FRAGMENTS: LruHashMap<FragKey, FragPorts, { capacity::FRAGMENTS as usize }> =
    LruHashMap::new();

/// Flows netfilter translated before the classifier was attached (kube-proxy's), by
/// their forward tuple; written by the agent from the kernel's conntrack table.
#[btf_map]
pub static NETFILTER_FLOWS: LruHashMap<CtKey, u8, { capacity::NETFILTER_FLOWS as usize }> =
    LruHashMap::new();

/// Counts one event of kind `idx` (a `proxy_common::counter` index).
#[inline(always)]
pub fn count(idx: u32) {
    if let Some(v) = COUNTERS.get_ptr_mut(idx) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *v += 1 };
    }
}

/// Maglev tables of the hashing schedulers, `MAGLEV_CHUNK` entries per value (sized as
/// `BACKEND_SLOTS` by the agent).
#[btf_map]
pub static MAGLEV: HashMap<
    BackendSlotKey,
    MaglevChunk,
    { capacity::BACKEND_SLOTS as usize },
    NO_PREALLOC,
> = HashMap::new();

/// Round-robin cursors, per service entry and CPU (each CPU takes its own turn through
/// the slots, as per-CPU counters do: no atomic on the new-flow path).
#[btf_map]
pub static RR_CURSORS: LruPerCpuHashMap<u32, u32, { capacity::RR_CURSORS as usize }> =
    LruPerCpuHashMap::new();

/// Connections open now, per backend id: incremented when a flow or socket is
/// scheduled, recounted by the agent's collector from the flows and sockets it sees.
#[btf_map]
pub static ACTIVE_CONNS: HashMap<u32, u64, { capacity::BACKENDS as usize }, NO_PREALLOC> =
    HashMap::new();

/// Weights of services with unequal ones (`SVC_F_WEIGHTED`).
#[btf_map]
pub static WEIGHTS: HashMap<MemberKey, u32, { capacity::WEIGHTS as usize }, NO_PREALLOC> =
    HashMap::new();

/// Per (frontend `rev_nat_id`, backend id): connections, packets and bytes.
#[btf_map]
pub static LB_STATS: PerCpuHashMap<
    StatsKey,
    LbStats,
    { capacity::LB_STATS as usize },
    NO_PREALLOC,
> = PerCpuHashMap::new();

/// Direct server return at a backend's node: the (frontend, backend) pairs whose option
/// it believes (`dsr::arrival`).
#[btf_map]
pub static DSR_PERMITS: HashMap<DsrPermitKey, u8, { capacity::DSR_PERMITS as usize }, NO_PREALLOC> =
    HashMap::new();

/// Per device: the device it is a port of (a bridge, a bond), for `route`'s reverse-path
/// check.
#[btf_map]
pub static IF_MASTERS: HashMap<u32, u32, { capacity::IF_MASTERS as usize }, NO_PREALLOC> =
    HashMap::new();
