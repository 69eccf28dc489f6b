//! Typed handles on the proxy's maps, opened from a loaded object or from their pins
//! (so `dump` and `cleanup` work while the agent is down).

use std::path::Path;

use crate::error::{ErrorKind, Kind as _, Result};
use aya::{
    Ebpf,
    maps::MapError,
    maps::{Array, HashMap, Map, MapData, PerCpuArray, PerCpuHashMap, lpm_trie::LpmTrie},
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, BackendSlot, BackendSlotKey, CtKey, CtValue, DsrPermitKey,
    LbStats, LpmData, MaglevChunk, MemberKey, NodeConfig, PORTS_PER_ENTRY, RevNatValue, ServiceKey,
    ServiceValue, SockLb, SockLbFilter, SockSlot, StatsKey, map_names,
};

/// Each pinned map's memory as the kernel charges it (`memlock` of the map's fdinfo, in
/// bytes), by name, for the maps of `dir` that are there.
pub fn memory(dir: &Path) -> Vec<(&'static str, u64)> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    map_names::ALL
        .iter()
        .filter_map(|name| {
            let data = MapData::from_pin(dir.join(name)).ok()?;
            let fd = data.fd().as_fd().as_raw_fd();
            let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
            let bytes = info
                .lines()
                .find_map(|l| l.strip_prefix("memlock:"))?
                .trim()
                .parse()
                .ok()?;
            Some((*name, bytes))
        })
        .collect()
}

/// Whether a lookup or removal failed only because the key is not there (aya reports
/// it as `KeyNotFound`, or as the syscall's ENOENT).
pub fn is_absent(e: &MapError) -> bool {
    match e {
        MapError::KeyNotFound => true,
        MapError::SyscallError(e) => e.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// Every map of the proxy, typed.
pub struct MapSet {
    pub services: HashMap<MapData, ServiceKey, ServiceValue>,
    pub slots: HashMap<MapData, BackendSlotKey, BackendSlot>,
    pub backends: HashMap<MapData, u32, Backend>,
    pub affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    pub rev_nat: HashMap<MapData, u32, RevNatValue>,
    /// Per socket cookie: what the connect-time hooks did for it.
    pub sock_lb: HashMap<MapData, u64, SockLb>,
    /// Connected sockets' bindings, in the slot each cookie names.
    pub sock_connected: Array<MapData, SockSlot>,
    /// `SOCK_LB` entries per cookie slot, counted by the programs (`sock_release`'s
    /// filter).
    pub sock_lb_counts: Array<MapData, u32>,
    /// The filter's generation, and whether uncounted entries may be left.
    pub sock_lb_filter: Array<MapData, SockLbFilter>,
    /// (service entry, backend id) → when the pair was added (`CLOCK_MONOTONIC` ns).
    pub members: HashMap<MapData, MemberKey, u64>,
    /// Answered flows (hash) and new ones (LRU).
    pub conntrack: HashMap<MapData, CtKey, CtValue>,
    pub conntrack_new: HashMap<MapData, CtKey, CtValue>,
    /// The source ports reply tuples use, a byte each (`port_slot`).
    pub reply_ports: Array<MapData, [u8; PORTS_PER_ENTRY]>,
    /// The ports frontends use, a byte each (`port_slot`): marked by `put_service`.
    pub frontend_ports: Array<MapData, [u8; PORTS_PER_ENTRY]>,
    /// The ports this handle has seen marked in `frontend_ports` (one bit each), so a
    /// service entry costs no extra syscall for a port already marked.
    frontend_ports_known: Box<[u64; 1024]>,
    pub counters: PerCpuArray<MapData, u64>,
    pub node_config: Array<MapData, NodeConfig>,
    pub local_nets: LpmTrie<MapData, LpmData, u8>,
    pub source_ranges: LpmTrie<MapData, LpmData, u8>,
    /// Flows netfilter translated before the classifier was attached, left to it.
    pub netfilter_flows: HashMap<MapData, CtKey, u8>,
    /// Maglev tables (`sched::SH`, `MH`), in chunks.
    pub maglev: HashMap<MapData, BackendSlotKey, MaglevChunk>,
    /// Per backend id: connections open now (least-connection schedulers).
    pub active_conns: HashMap<MapData, u32, u64>,
    /// Per (service entry, backend id), for services with unequal weights.
    pub weights: HashMap<MapData, MemberKey, u32>,
    /// Per frontend (`rev_nat_id`) and per backend id: connections, packets, bytes.
    pub lb_stats: PerCpuHashMap<MapData, StatsKey, LbStats>,
    /// Direct server return: the (frontend, backend) pairs whose option is believed.
    pub dsr_permits: HashMap<MapData, DsrPermitKey, u8>,
    /// While set, the writer's inserts (`put_*`) are held here and made in batches by
    /// `flush_staged`.
    pub staged: Option<super::batch::Staged>,
    /// While set, service entries are not written at all (`put_service` does nothing):
    /// a first programming ahead of its end writes only what they will point to.
    pub withhold_services: bool,
}

/// The writer's inserts: made now, or staged for a batch.
macro_rules! put {
    ($name:ident, $map:ident, $k:ty, $v:ty) => {
        pub fn $name(&mut self, key: &$k, value: &$v) -> Result<(), MapError> {
            match &mut self.staged {
                Some(s) => {
                    s.$map.push((*key, *value));
                    Ok(())
                }
                None => self.$map.insert(key, value, 0),
            }
        }
    };
}

impl MapSet {
    put!(put_backend, backends, u32, Backend);
    put!(put_slot, slots, BackendSlotKey, BackendSlot);
    put!(put_chunk, maglev, BackendSlotKey, MaglevChunk);
    put!(put_weight, weights, MemberKey, u32);
    put!(put_member, members, MemberKey, u64);
    put!(put_rev_nat, rev_nat, u32, RevNatValue);

    /// A service entry: the flip that makes a frontend visible (withheld while
    /// `withhold_services` is set).
    pub fn put_service(&mut self, key: &ServiceKey, value: &ServiceValue) -> Result<(), MapError> {
        if self.withhold_services {
            return Ok(());
        }
        // The port's mark first: the classifier looks a packet's service up only when
        // its port is marked.
        self.mark_frontend_port(key.port)?;
        match &mut self.staged {
            Some(s) => {
                s.services.push((*key, *value));
                Ok(())
            }
            None => self.services.insert(key, value, 0),
        }
    }

    /// Marks frontend port `port_be` (network byte order) in `FRONTEND_PORTS`, unless this
    /// handle knows it is marked. (The agent is the map's one writer.)
    pub fn mark_frontend_port(&mut self, port_be: u16) -> Result<(), MapError> {
        let port = usize::from(u16::from_be(port_be));
        let (word, bit) = (port / 64, 1u64 << (port % 64));
        if self.frontend_ports_known[word] & bit != 0 {
            return Ok(());
        }
        super::port_filters::mark(&mut self.frontend_ports, [port_be])?;
        self.frontend_ports_known[word] |= bit;
        Ok(())
    }

    /// Makes the staged writes, in batches; stops staging. Everything a service entry
    /// points to is written first — the big maps (backends, slots, memberships: a million
    /// entries each at 100k Services) side by side on threads of their own, as the
    /// kernel's per-entry work is most of a first programming — and the service entries
    /// last, so no entry is visible before what it points to. When a batch fails (a full
    /// map), what was written is removed again, so the maps are as before.
    pub fn flush_staged(&mut self) -> Result<()> {
        use super::batch::write_all;
        let Some(s) = self.staged.take() else {
            return Ok(());
        };
        tracing::debug!(
            backends = s.backends.len(),
            slots = s.slots.len(),
            members = s.members.len(),
            rev_nat = s.rev_nat.len(),
            services = s.services.len(),
            "writing staged entries in batches"
        );
        type Failure = (&'static str, usize, usize, std::io::Error);
        // How far each map got, in the order below, for the roll-back.
        let mut written = [0usize; 7];
        macro_rules! flush {
            ($map:expr, $entries:expr, $what:expr, $count:expr) => {
                match write_all($map, $entries) {
                    Ok(()) => {
                        *$count = $entries.len();
                        Ok(())
                    }
                    Err((n, e)) => {
                        *$count = n;
                        Err::<(), Failure>(($what, n, $entries.len(), e))
                    }
                }
            };
        }
        let [
            w_backends,
            w_slots,
            w_maglev,
            w_weights,
            w_members,
            w_rev_nat,
            w_services,
        ] = &mut written;
        let (backends, slots, members) = (&mut self.backends, &mut self.slots, &mut self.members);
        let (maglev, weights, rev_nat) = (&mut self.maglev, &mut self.weights, &mut self.rev_nat);
        let first: Vec<Result<(), Failure>> = std::thread::scope(|scope| {
            let slots = scope.spawn(|| flush!(slots, &s.slots, "backend slots", w_slots));
            let members = scope.spawn(|| flush!(members, &s.members, "memberships", w_members));
            let rest = flush!(backends, &s.backends, "backends", w_backends)
                .and_then(|()| flush!(maglev, &s.maglev, "Maglev tables", w_maglev))
                .and_then(|()| flush!(weights, &s.weights, "weights", w_weights))
                .and_then(|()| flush!(rev_nat, &s.rev_nat, "reverse-NAT entries", w_rev_nat));
            let joined = |h: std::thread::ScopedJoinHandle<'_, Result<(), Failure>>, what| {
                h.join().unwrap_or_else(|_| {
                    Err((
                        what,
                        0,
                        0,
                        std::io::Error::other("the writing thread panicked"),
                    ))
                })
            };
            vec![
                rest,
                joined(slots, "backend slots"),
                joined(members, "memberships"),
            ]
        });
        let result = first
            .into_iter()
            .collect::<Result<(), Failure>>()
            .and_then(|()| {
                flush!(
                    &mut self.services,
                    &s.services,
                    "service entries",
                    w_services
                )
            });
        let Err((what, n, all, e)) = result else {
            return Ok(());
        };
        macro_rules! undo {
            ($i:expr, $map:ident) => {
                for (k, _) in &s.$map[..written[$i]] {
                    let _ = self.$map.remove(k);
                }
            };
        }
        undo!(6, services);
        undo!(5, rev_nat);
        undo!(4, members);
        undo!(3, weights);
        undo!(2, maglev);
        undo!(1, slots);
        undo!(0, backends);
        Err(crate::error::Error::caused(
            crate::error::ErrorKind::Map,
            format!("writing {what} in batches ({n} of {all} written, all taken back)"),
            e,
        ))
    }
}

impl MapSet {
    /// The capacities of the service-side maps, as created.
    pub fn service_capacities(&self) -> Vec<(&'static str, u32)> {
        use aya::maps::IterableMap as _;
        use proxy_common::map_names as n;
        let info = |m: &MapData| m.info().map(|i| i.max_entries()).unwrap_or(0);
        vec![
            (n::SERVICES, info(self.services.map())),
            (n::REV_NAT, info(self.rev_nat.map())),
            (n::BACKEND_SLOTS, info(self.slots.map())),
            (n::MEMBERS, info(self.members.map())),
            (n::BACKENDS, info(self.backends.map())),
        ]
    }

    /// Takes the maps out of a loaded object.
    pub fn take(ebpf: &mut Ebpf) -> Result<Self> {
        Self::build(|name| {
            ebpf.take_map(name)
                .kind_with(ErrorKind::Load, || format!("BPF object has no map {name}"))
        })
    }

    /// Opens the maps pinned in `dir`.
    pub fn open_pinned(dir: &Path) -> Result<Self> {
        Self::build(|name| {
            let path = dir.join(name);
            let data = MapData::from_pin(&path).kind_with(ErrorKind::Map, || {
                format!("opening pinned map {}", path.display())
            })?;
            Map::from_map_data(data).kind_with(ErrorKind::Map, || format!("map {}", path.display()))
        })
    }

    /// A second handle on the same kernel maps (by map id), e.g. for a reader beside the
    /// writer.
    pub fn duplicate(&self) -> Result<Self> {
        use aya::maps::{IterableMap, PerCpuValues};
        fn id(m: &MapData) -> Result<u32> {
            Ok(m.info()?.id())
        }
        let ids = [
            (map_names::SERVICES, id(IterableMap::map(&self.services))?),
            (map_names::BACKEND_SLOTS, id(IterableMap::map(&self.slots))?),
            (map_names::BACKENDS, id(IterableMap::map(&self.backends))?),
            (map_names::AFFINITY, id(IterableMap::map(&self.affinity))?),
            (map_names::REV_NAT, id(IterableMap::map(&self.rev_nat))?),
            (map_names::SOCK_LB, id(IterableMap::map(&self.sock_lb))?),
            (
                map_names::SOCK_CONNECTED,
                id(IterableMap::<u32, SockSlot>::map(&self.sock_connected))?,
            ),
            (
                map_names::SOCK_LB_COUNTS,
                id(IterableMap::<u32, u32>::map(&self.sock_lb_counts))?,
            ),
            (
                map_names::SOCK_LB_FILTER,
                id(IterableMap::<u32, SockLbFilter>::map(&self.sock_lb_filter))?,
            ),
            (map_names::MEMBERS, id(IterableMap::map(&self.members))?),
            (map_names::CONNTRACK, id(IterableMap::map(&self.conntrack))?),
            (
                map_names::CONNTRACK_NEW,
                id(IterableMap::map(&self.conntrack_new))?,
            ),
            (
                map_names::REPLY_PORTS,
                id(IterableMap::<u32, [u8; PORTS_PER_ENTRY]>::map(
                    &self.reply_ports,
                ))?,
            ),
            (
                map_names::FRONTEND_PORTS,
                id(IterableMap::<u32, [u8; PORTS_PER_ENTRY]>::map(
                    &self.frontend_ports,
                ))?,
            ),
            (
                map_names::COUNTERS,
                id(IterableMap::<u32, PerCpuValues<u64>>::map(&self.counters))?,
            ),
            (
                map_names::NODE_CONFIG,
                id(IterableMap::<u32, NodeConfig>::map(&self.node_config))?,
            ),
            (
                map_names::LOCAL_NETS,
                id(IterableMap::<aya::maps::lpm_trie::Key<LpmData>, u8>::map(
                    &self.local_nets,
                ))?,
            ),
            (
                map_names::SOURCE_RANGES,
                id(IterableMap::<aya::maps::lpm_trie::Key<LpmData>, u8>::map(
                    &self.source_ranges,
                ))?,
            ),
            (
                map_names::NETFILTER_FLOWS,
                id(IterableMap::map(&self.netfilter_flows))?,
            ),
            (map_names::MAGLEV, id(IterableMap::map(&self.maglev))?),
            (
                map_names::ACTIVE_CONNS,
                id(IterableMap::map(&self.active_conns))?,
            ),
            (map_names::WEIGHTS, id(IterableMap::map(&self.weights))?),
            (
                map_names::LB_STATS,
                id(IterableMap::<StatsKey, PerCpuValues<LbStats>>::map(
                    &self.lb_stats,
                ))?,
            ),
            (
                map_names::DSR_PERMITS,
                id(IterableMap::map(&self.dsr_permits))?,
            ),
        ];
        Self::build(|name| {
            let (_, id) = ids
                .iter()
                .find(|(n, _)| *n == name)
                .kind_with(ErrorKind::Map, || format!("no map {name}"))?;
            Ok(Map::from_map_data(MapData::from_id(*id)?)?)
        })
    }

    fn build(mut open: impl FnMut(&str) -> Result<Map>) -> Result<Self> {
        macro_rules! typed {
            ($name:expr) => {
                open($name)?.try_into().kind_with(ErrorKind::Map, || {
                    format!("map {} has an unexpected type or layout", $name)
                })?
            };
        }
        Ok(Self {
            services: typed!(map_names::SERVICES),
            slots: typed!(map_names::BACKEND_SLOTS),
            backends: typed!(map_names::BACKENDS),
            affinity: typed!(map_names::AFFINITY),
            rev_nat: typed!(map_names::REV_NAT),
            sock_lb: typed!(map_names::SOCK_LB),
            sock_connected: typed!(map_names::SOCK_CONNECTED),
            sock_lb_counts: typed!(map_names::SOCK_LB_COUNTS),
            sock_lb_filter: typed!(map_names::SOCK_LB_FILTER),
            members: typed!(map_names::MEMBERS),
            conntrack: typed!(map_names::CONNTRACK),
            conntrack_new: typed!(map_names::CONNTRACK_NEW),
            reply_ports: typed!(map_names::REPLY_PORTS),
            frontend_ports: typed!(map_names::FRONTEND_PORTS),
            frontend_ports_known: Box::new([0; 1024]),
            counters: typed!(map_names::COUNTERS),
            node_config: typed!(map_names::NODE_CONFIG),
            local_nets: typed!(map_names::LOCAL_NETS),
            source_ranges: typed!(map_names::SOURCE_RANGES),
            netfilter_flows: typed!(map_names::NETFILTER_FLOWS),
            maglev: typed!(map_names::MAGLEV),
            active_conns: typed!(map_names::ACTIVE_CONNS),
            weights: typed!(map_names::WEIGHTS),
            lb_stats: typed!(map_names::LB_STATS),
            dsr_permits: typed!(map_names::DSR_PERMITS),
            staged: None,
            withhold_services: false,
        })
    }

    /// The per-CPU counters, summed, by name.
    pub fn counters(&self) -> Result<Vec<(&'static str, u64)>> {
        let mut out = Vec::new();
        for (i, name) in proxy_common::counter::NAMES.iter().enumerate() {
            let per_cpu = self.counters.get(&(i as u32), 0)?;
            out.push((*name, per_cpu.iter().sum()));
        }
        Ok(out)
    }
}

/// A removal that found nothing to remove succeeded.
pub fn remove_ignoring_absent(r: Result<(), MapError>) -> Result<()> {
    match r {
        Err(e) if !is_absent(&e) => Err(e.into()),
        _ => Ok(()),
    }
}
