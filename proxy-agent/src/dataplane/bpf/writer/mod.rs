//! Brings the maps to a node view with minimal writes. The agent's mirror of the maps is
//! rebuilt from the maps themselves on start (adoption), so a restarted agent only writes
//! what changed while it was away.
//!
//! Order matters for live traffic: backends first, then a frontend's new slot set under a
//! new generation, then the frontend entry flip, then the old slots; removed frontends go
//! before the backends they used.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
};

use anyhow::{Context as _, Result};
use aya::maps::{MapError, lpm_trie::Key as LpmKey};
use proxy_common::{
    BACKEND_ACTIVE, Backend, BackendSlot, BackendSlotKey, CFG_LOCAL_DETECTOR, CFG_MASQUERADE_ALL,
    CtTimeouts, CtValue, FAMILY_V4, FAMILY_V6, LPM_TAG_BITS, LPM_TAG_NODE, LPM_TAG_POD, LpmData,
    MAGLEV_CHUNK, MaglevChunk, MemberKey, NodeConfig, PROTO_SCTP, PROTO_TCP, PROTO_UDP,
    RevNatValue, SCOPE_EXTERNAL, SCOPE_INTERNAL, SVC_F_AFFINITY, SVC_F_DROP_NO_BACKENDS,
    SVC_F_EXT_LOCAL, SVC_F_EXTERNAL, SVC_F_SOURCE_RANGES, SVC_F_TWO_SCOPES, SVC_F_WEIGHTED,
    ServiceKey, ServiceValue,
};
use rustc_hash::FxHashMap;

use super::{ConntrackOptions, maps::MapSet, members};

pub mod encode;
use crate::{
    dataplane::ApplyReport,
    model::{
        BackendSet, Frontend, FrontendKind, FrontendState, NodeSettings, NodeView, Protocol,
        WhenEmpty, schedule::Schedule,
    },
};

/// One service-map entry the view asks for.
struct Desired<'a> {
    frontend: &'a Frontend,
    state: &'a FrontendState,
    set: &'a BackendSet,
    flags: u16,
    /// Source ranges (external scope only: pods and the node are not filtered).
    ranges: &'a [ipnet::IpNet],
}

/// The service-map entries of a view: the external (or only) scope of each frontend, and
/// an internal scope where internal traffic uses other backends.
fn desired_entries<'a>(
    frontends: impl Iterator<Item = (&'a Frontend, &'a FrontendState)>,
) -> Vec<(ServiceKey, Desired<'a>)> {
    let mut out = Vec::with_capacity(frontends.size_hint().0);
    for (fe, st) in frontends {
        let affinity = if st.affinity_timeout_s.is_some() {
            SVC_F_AFFINITY
        } else {
            0
        };
        let flags = |set: &BackendSet| {
            affinity
                | match set.when_empty {
                    WhenEmpty::Drop => SVC_F_DROP_NO_BACKENDS,
                    WhenEmpty::Reject => 0,
                }
        };
        let key = service_key(fe);
        let two = if st.internal.is_some() {
            SVC_F_TWO_SCOPES
        } else {
            0
        };
        let external = if st.kind == FrontendKind::ClusterIp {
            0
        } else {
            SVC_F_EXTERNAL
        } | if st.external_local {
            SVC_F_EXT_LOCAL
        } else {
            0
        };
        let ranges = if st.source_ranges.is_empty() {
            0
        } else {
            SVC_F_SOURCE_RANGES
        };
        out.push((
            key,
            Desired {
                frontend: fe,
                state: st,
                set: &st.backends,
                flags: flags(&st.backends) | two | external | ranges,
                ranges: &st.source_ranges,
            },
        ));
        if let Some(internal) = &st.internal {
            let key = ServiceKey {
                scope: SCOPE_INTERNAL,
                ..key
            };
            out.push((
                key,
                Desired {
                    frontend: fe,
                    state: st,
                    set: internal,
                    flags: flags(internal) | external,
                    ranges: &[],
                },
            ));
        }
    }
    out
}

/// A UDP endpoint that left one frontend (kube-proxy clears such flows per Service port:
/// the same pod may still serve another Service).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeftUdp {
    pub rev_nat_id: u32,
    pub backend_id: u32,
    pub backend: Backend,
    /// No frontend uses the backend any more.
    pub gone: bool,
}

/// What one frontend looks like in the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Programmed {
    value: ServiceValue,
    backend_ids: Vec<u32>,
    /// The endpoints `backend_ids` stand for, in slot order: a sync compares these (one
    /// run of memory) instead of looking up every endpoint's id (a cache miss each, which
    /// made a one-change sync at 10k Services cost milliseconds).
    endpoints: Vec<SocketAddr>,
    /// `backend_ids` are exactly what `endpoints` and `schedule` make (false for an
    /// adopted set whose slots did not all resolve).
    complete: bool,
    /// The schedule `backend_ids` were laid out for (adopted: the scheduler only).
    schedule: Schedule,
    /// `sh`/`mh`: the Maglev table (indexes into `backend_ids`) in `MAGLEV`.
    table: Vec<u16>,
    ranges: Vec<ipnet::IpNet>,
    /// The last sync whose view held this frontend (`MapState::epoch`).
    seen: u64,
}

/// The agent's mirror of the maps' service, slot and backend entries.
#[derive(Debug, Default)]
pub struct MapState {
    services: FxHashMap<ServiceKey, Programmed>,
    /// Fx hashing: the sync compares every frontend's endpoints through this map, and
    /// SipHash made that the bulk of a one-change sync at 10k Services.
    backend_ids: FxHashMap<Backend, u32>,
    backends_by_id: HashMap<u32, Backend>,
    /// How many live slots point at each backend; a backend is deleted at zero. Keeps
    /// each sync proportional to what changed, not to the number of backends.
    refs: HashMap<u32, u32>,
    /// Live slots in all (the sum of `refs`), for the fill gauges.
    live_slots: u64,
    /// Backends whose count dropped to zero (or were never used) since the last sweep.
    maybe_unused: HashSet<u32>,
    used_service_ids: HashSet<u32>,
    /// Counts syncs: frontends not `seen` in the current one are removed.
    epoch: u64,
    /// UDP endpoints that left a frontend since `take_left_udp` last ran.
    left_udp: Vec<LeftUdp>,
    /// `MEMBERS` changes adoption found necessary, written by the next apply.
    members_fix: members::Reconcile,
    next_service_id: u32,
    next_backend_id: u32,
}

/// Encodes an address as the ABI's four network-order words.
pub fn addr_words(ip: IpAddr) -> ([u32; 4], u8) {
    match ip {
        IpAddr::V4(v4) => ([u32::from_ne_bytes(v4.octets()), 0, 0, 0], FAMILY_V4),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([w(0), w(4), w(8), w(12)], FAMILY_V6)
        }
    }
}

/// Decodes the ABI's address words.
pub fn words_addr(words: [u32; 4], family: u8) -> IpAddr {
    if family == FAMILY_V4 {
        IpAddr::from(words[0].to_ne_bytes())
    } else {
        let mut o = [0u8; 16];
        for (i, w) in words.iter().enumerate() {
            o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        IpAddr::from(o)
    }
}

fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => PROTO_TCP,
        Protocol::Udp => PROTO_UDP,
        Protocol::Sctp => PROTO_SCTP,
    }
}

/// The service-map key of a frontend.
pub fn service_key(fe: &Frontend) -> ServiceKey {
    let (addr, family) = addr_words(fe.ip);
    ServiceKey {
        addr,
        port: fe.port.to_be(),
        proto: proto_number(fe.protocol),
        family,
        scope: SCOPE_EXTERNAL,
        _pad: [0; 3],
    }
}

fn backend_value(sa: SocketAddr, protocol: Protocol) -> Backend {
    let (addr, family) = addr_words(sa.ip());
    Backend {
        addr,
        port: sa.port().to_be(),
        proto: proto_number(protocol),
        family,
        state: BACKEND_ACTIVE,
        _pad: [0; 3],
    }
}

impl MapState {
    /// Rebuilds the mirror from what the maps hold (entries another agent wrote).
    pub fn adopt(maps: &MapSet) -> Result<Self> {
        let mut state = MapState {
            next_service_id: 1,
            next_backend_id: 1,
            ..Default::default()
        };
        for entry in maps.backends.iter() {
            let (id, be) = entry?;
            state.backend_ids.insert(be, id);
            state.backends_by_id.insert(id, be);
            // Swept at the next apply unless a frontend turns out to use it.
            state.maybe_unused.insert(id);
            state.next_backend_id = state.next_backend_id.max(id.wrapping_add(1));
        }
        let mut ranges_by_id: HashMap<u32, Vec<ipnet::IpNet>> = HashMap::new();
        for key in maps.source_ranges.keys() {
            let key = key?;
            let data = key.data();
            let (family, bits) =
                if data.addr[1..] == [0, 0, 0] && key.prefix_len() <= LPM_TAG_BITS + 32 {
                    (FAMILY_V4, key.prefix_len() - LPM_TAG_BITS)
                } else {
                    (FAMILY_V6, key.prefix_len() - LPM_TAG_BITS)
                };
            if let Ok(net) = ipnet::IpNet::new(words_addr(data.addr, family), bits as u8) {
                ranges_by_id.entry(data.tag).or_default().push(net);
            }
        }
        for entry in maps.services.iter() {
            let (key, value) = entry?;
            let mut backend_ids = Vec::with_capacity(usize::from(value.count));
            for slot in 0..u32::from(value.count) {
                let slot_key = BackendSlotKey {
                    service_id: value.id,
                    rev: value.rev,
                    slot,
                };
                match maps.slots.get(&slot_key, 0) {
                    Ok(s) => backend_ids.push(s.backend_id),
                    // A torn set (agent died mid-write) is rewritten on the next apply.
                    Err(_) => backend_ids.clear(),
                }
            }
            let table = adopt_table(maps, &value);
            state.next_service_id = state.next_service_id.max(value.id.wrapping_add(1));
            state.used_service_ids.insert(value.id);
            state.hold(&backend_ids);
            let ranges = ranges_by_id.remove(&value.id).unwrap_or_default();
            let endpoints: Vec<SocketAddr> = backend_ids
                .iter()
                .filter_map(|id| state.backends_by_id.get(id))
                .map(|be| SocketAddr::new(words_addr(be.addr, be.family), u16::from_be(be.port)))
                .collect();
            state.services.insert(
                key,
                Programmed {
                    value,
                    complete: endpoints.len() == backend_ids.len(),
                    backend_ids,
                    endpoints,
                    schedule: Schedule {
                        scheduler: encode::scheduler_of_code(value.scheduler).unwrap_or_default(),
                        ..Default::default()
                    },
                    table,
                    ranges,
                    seen: 0,
                },
            );
        }
        let programmed = state
            .services
            .values()
            .flat_map(|p| {
                p.backend_ids.iter().map(|&backend_id| MemberKey {
                    service_id: p.value.id,
                    backend_id,
                })
            })
            .collect();
        state.members_fix = members::Reconcile::plan(maps, &programmed)?;
        Ok(state)
    }

    /// Number of frontends programmed.
    pub fn frontends(&self) -> usize {
        self.services.len()
    }

    /// How full the service-side maps are.
    pub fn fill(&self) -> crate::dataplane::MapFill {
        crate::dataplane::MapFill {
            services: self.services.len() as u64,
            backend_slots: self.live_slots,
            backends: self.backends_by_id.len() as u64,
        }
    }

    /// Applies `view`, comparing every frontend. A frontend that cannot be written (a
    /// full map) keeps its previous entries and is reported; the others still apply.
    pub fn apply(&mut self, maps: &mut MapSet, view: &NodeView) -> Result<ApplyReport> {
        self.apply_changes(maps, view, None)
    }

    /// Applies `view`; with `changed`, only those frontends are compared and written
    /// (the ones that differ from the view of the last successful apply), so a sync
    /// costs what changed, not what exists.
    pub fn apply_changes(
        &mut self,
        maps: &mut MapSet,
        view: &NodeView,
        changed: Option<&BTreeSet<Frontend>>,
    ) -> Result<ApplyReport> {
        let mut report = ApplyReport::default();
        let desired = match changed {
            None => desired_entries(view.iter()),
            Some(changed) => {
                desired_entries(changed.iter().filter_map(|fe| Some((fe, view.get(fe)?))))
            }
        };
        self.members_fix.apply(maps)?;

        self.epoch += 1;
        // 1. Entries that are new or changed.
        for (key, d) in &desired {
            let written = self.write_frontend(maps, *key, d);
            // Still wanted, even if rewriting it failed (it keeps its old entries).
            if let Some(p) = self.services.get_mut(key) {
                p.seen = self.epoch;
            }
            match written {
                Ok(true) => report.frontends_written += 1,
                Ok(false) => {}
                Err(e) => {
                    let (fe, svc) = (d.frontend, &d.state.service);
                    tracing::error!(frontend = %fe, service = %svc, error = format!("{e:#}"),
                        "could not program frontend; its previous entries stay");
                    report.failed.push(format!("{fe} ({svc}): {e:#}"));
                }
            }
        }
        // 2. Frontends (or scopes of them) no longer wanted.
        let stale: Vec<ServiceKey> = match changed {
            None => self
                .services
                .iter()
                .filter(|(_, p)| p.seen != self.epoch)
                .map(|(k, _)| *k)
                .collect(),
            Some(changed) => changed
                .iter()
                .flat_map(|fe| {
                    let key = service_key(fe);
                    [
                        key,
                        ServiceKey {
                            scope: SCOPE_INTERNAL,
                            ..key
                        },
                    ]
                })
                .filter(|k| self.services.get(k).is_some_and(|p| p.seen != self.epoch))
                .collect(),
        };
        for key in stale {
            self.remove_frontend(maps, key)?;
            report.frontends_removed += 1;
        }
        // 3. Backends no frontend uses any more.
        let candidates: Vec<u32> = self.maybe_unused.drain().collect();
        let mut removed = HashSet::new();
        for id in candidates {
            if self.refs.get(&id).copied().unwrap_or(0) > 0 {
                continue;
            }
            remove_ignoring_absent(maps.backends.remove(&id))?;
            if let Some(be) = self.backends_by_id.remove(&id) {
                self.backend_ids.remove(&be);
            }
            self.refs.remove(&id);
            removed.insert(id);
            report.backends_removed += 1;
        }
        for left in &mut self.left_udp {
            left.gone |= removed.contains(&left.backend_id);
        }
        // 4. UDP flows of endpoints that left their frontend: their entries go now, so a
        // UDP client (which never closes its flow) is rebalanced on its next packet, even
        // if the pod still serves another Service or a new backend later reuses the id.
        // TCP flows stay: a terminating pod finishes them.
        let pairs: HashSet<(u32, u32)> = self
            .left_udp
            .iter()
            .map(|l| (l.rev_nat_id, l.backend_id))
            .collect();
        if !pairs.is_empty() {
            let mut cleared = 0;
            let is_stale = |v: &CtValue| pairs.contains(&(v.rev_nat_id, v.backend_id));
            for table in [&mut maps.conntrack, &mut maps.conntrack_new] {
                let stale: Vec<_> = table
                    .iter()
                    .filter_map(Result::ok)
                    .filter(|(k, v)| k.proto == PROTO_UDP && is_stale(v))
                    .map(|(k, _)| k)
                    .collect();
                for key in &stale {
                    // Read again: since the walk the programs may have replaced the flow
                    // on this tuple (its backend id deleted a step earlier) with a new
                    // one, which must not go too.
                    if table.get(key, 0).is_ok_and(|v| is_stale(&v)) {
                        remove_ignoring_absent(table.remove(key))?;
                        cleared += 1;
                    }
                }
            }
            if cleared > 0 {
                tracing::debug!(entries = cleared, "flows of removed backends cleared");
            }
        }
        report.fill = Some(self.fill());
        Ok(report)
    }

    /// Removes one service-map entry with its slots, reverse-NAT entry, members and
    /// source ranges; its backends go when no other frontend uses them.
    fn remove_frontend(&mut self, maps: &mut MapSet, key: ServiceKey) -> Result<()> {
        let Some(old) = self.services.remove(&key) else {
            return Ok(());
        };
        self.note_left(key, &old, &[]);
        self.release(&old.backend_ids);
        remove_ignoring_absent(maps.services.remove(&key))?;
        remove_generation(maps, &old.value, old.backend_ids.len())?;
        remove_ignoring_absent(maps.rev_nat.remove(&old.value.rev_nat_id))?;
        members::leave(maps, old.value.id, &old.backend_ids, &[])?;
        if old.value.flags & SVC_F_WEIGHTED != 0 {
            forget_weights(maps, old.value.id, old.backend_ids.iter())?;
        }
        for net in &old.ranges {
            remove_ignoring_absent(maps.source_ranges.remove(&range_key(old.value.id, net)))?;
        }
        self.used_service_ids.remove(&old.value.id);
        Ok(())
    }

    /// The UDP endpoints that left a frontend since the last call (their connected
    /// sockets and kernel conntrack entries may need clearing).
    pub fn take_left_udp(&mut self) -> Vec<LeftUdp> {
        std::mem::take(&mut self.left_udp)
    }

    /// Records the UDP endpoints of `old` (frontend `key`) that `now` no longer has.
    fn note_left(&mut self, key: ServiceKey, old: &Programmed, now: &[u32]) {
        if key.proto != PROTO_UDP {
            return;
        }
        for id in old.backend_ids.iter().filter(|id| !now.contains(id)) {
            if let Some(backend) = self.backends_by_id.get(id) {
                self.left_udp.push(LeftUdp {
                    rev_nat_id: old.value.rev_nat_id,
                    backend_id: *id,
                    backend: *backend,
                    gone: false,
                });
            }
        }
    }

    /// Writes one frontend if it differs from what is programmed; `Ok(false)` if not.
    fn write_frontend(
        &mut self,
        maps: &mut MapSet,
        key: ServiceKey,
        d: &Desired<'_>,
    ) -> Result<bool> {
        let timeout = d.state.affinity_timeout_s.unwrap_or(0);
        let schedule = &d.state.schedule;
        // Fast path, the common case at scale: nothing about this entry changed.
        if let Some(old) = self.services.get(&key)
            && old.value.flags & !SVC_F_WEIGHTED == d.flags
            && old.value.affinity_timeout_s == timeout
            && old.ranges == d.ranges
            && old.complete
            && old.schedule == *schedule
            && old.endpoints.iter().eq(&d.set.endpoints)
        {
            return Ok(false);
        }
        let endpoints: Vec<SocketAddr> = d.set.endpoints.iter().copied().collect();
        let weighted = schedule.weighted(&endpoints);
        let flags = d.flags | if weighted { SVC_F_WEIGHTED } else { 0 };
        // The scheduler's slot layout (each endpoint once, by weight, or a Maglev
        // table), as backend ids; each endpoint's id is looked up once.
        let mut id_of: Vec<Option<u32>> = vec![None; endpoints.len()];
        let layout = crate::dataplane::layout::layout(schedule, &endpoints, d.frontend.ip);
        let mut backend_ids = Vec::with_capacity(layout.slots.len());
        for &i in &layout.slots {
            let i = i as usize;
            let id = match id_of[i] {
                Some(id) => id,
                None => {
                    let id = self
                        .ensure_backend(maps, backend_value(endpoints[i], d.frontend.protocol))?;
                    id_of[i] = Some(id);
                    id
                }
            };
            backend_ids.push(id);
        }
        let weights: Vec<(u32, u32)> = if weighted {
            endpoints
                .iter()
                .zip(&id_of)
                .filter_map(|(sa, id)| Some(((*id)?, schedule.weight(sa.ip()))))
                .collect()
        } else {
            Vec::new()
        };
        let count = u16::try_from(backend_ids.len()).map_err(|_| {
            anyhow::anyhow!(
                "{} backend slots exceed the 65535 per frontend",
                backend_ids.len()
            )
        })?;
        let scheduler = encode::scheduler_code(schedule.scheduler);
        let old = self.services.get(&key).cloned();
        if let Some(old) = &old
            && old.backend_ids == backend_ids
            && old.value.flags == flags
            && old.value.affinity_timeout_s == timeout
            && old.value.scheduler == scheduler
            && (!weighted || old.schedule.weights == schedule.weights)
            && old.table == layout.table
            && old.ranges == d.ranges
        {
            self.remember_endpoints(key, &d.set.endpoints, schedule);
            return Ok(false);
        }
        let id = match &old {
            Some(o) => o.value.id,
            None => self.allocate_service_id(),
        };
        let written = self.write_generation(
            maps,
            key,
            old.as_ref(),
            Generation {
                id,
                backend_ids,
                flags,
                timeout,
                count,
                scheduler,
                weights,
                table: layout.table,
            },
            d.ranges,
        );
        if written.is_err() && old.is_none() {
            self.used_service_ids.remove(&id);
        }
        written?;
        self.remember_endpoints(key, &d.set.endpoints, schedule);
        Ok(true)
    }

    fn remember_endpoints<'e>(
        &mut self,
        key: ServiceKey,
        endpoints: impl IntoIterator<Item = &'e SocketAddr>,
        schedule: &Schedule,
    ) {
        if let Some(p) = self.services.get_mut(&key) {
            p.endpoints.clear();
            p.endpoints.extend(endpoints);
            p.complete = true;
            if p.schedule != *schedule {
                p.schedule = schedule.clone();
            }
        }
    }

    /// Writes a new generation of `key`'s slots, its reverse-NAT entry and the flip.
    fn write_generation(
        &mut self,
        maps: &mut MapSet,
        key: ServiceKey,
        old: Option<&Programmed>,
        generation: Generation,
        ranges: &[ipnet::IpNet],
    ) -> Result<()> {
        let id = generation.id;
        let backend_ids = generation.backend_ids;
        let weights = generation.weights;
        let table = generation.table;
        let table_len = u16::try_from(table.len())
            .map_err(|_| anyhow::anyhow!("a Maglev table of {} entries", table.len()))?;
        let rev = old.map_or(1, |o| o.value.rev.wrapping_add(1));
        let value = ServiceValue {
            id,
            rev,
            count: generation.count,
            flags: generation.flags,
            affinity_timeout_s: generation.timeout,
            rev_nat_id: id,
            scheduler: generation.scheduler,
            _pad: 0,
            table_len,
        };
        // Weights before the flip (they are per service entry, not per generation: the
        // old generation reads them too for a moment, which only shifts a few choices).
        for (backend_id, weight) in &weights {
            let key = MemberKey {
                service_id: id,
                backend_id: *backend_id,
            };
            maps.weights
                .insert(&key, weight, 0)
                .context("writing a backend weight")?;
        }
        let old_ids: &[u32] = old.map_or(&[], |o| o.backend_ids.as_slice());
        let joined = members::join(maps, id, &backend_ids, old_ids)?;
        let flipped = flip(maps, key, old, &value, &backend_ids, &table, ranges);
        if flipped.is_err() {
            members::undo(maps, id, &joined);
        }
        flipped?;
        if let Some(old) = old
            && old.value.flags & SVC_F_WEIGHTED != 0
        {
            let kept: HashSet<u32> = weights.iter().map(|(id, _)| *id).collect();
            forget_weights(
                maps,
                id,
                old.backend_ids.iter().filter(|b| !kept.contains(b)),
            )?;
        }
        if let Some(old) = old {
            remove_generation(maps, &old.value, old.backend_ids.len())?;
            for net in old.ranges.iter().filter(|n| !ranges.contains(n)) {
                remove_ignoring_absent(maps.source_ranges.remove(&range_key(id, net)))?;
            }
            members::leave(maps, id, &old.backend_ids, &backend_ids)?;
        }
        if let Some(old) = old {
            self.note_left(key, old, &backend_ids);
        }
        self.hold(&backend_ids);
        let ranges = ranges.to_vec();
        if let Some(old) = self.services.insert(
            key,
            Programmed {
                value,
                table,
                backend_ids,
                endpoints: Vec::new(), // filled by the caller, which has them
                complete: false,
                schedule: Schedule::default(),
                ranges,
                seen: self.epoch,
            },
        ) {
            self.release(&old.backend_ids);
        }
        Ok(())
    }

    fn ensure_backend(&mut self, maps: &mut MapSet, be: Backend) -> Result<u32> {
        if let Some(id) = self.backend_ids.get(&be) {
            return Ok(*id);
        }
        let id = next_free_key(&mut self.next_backend_id, &self.backends_by_id);
        maps.backends
            .insert(&id, &be, 0)
            .map_err(|e| anyhow::Error::new(e).context("writing backend"))?;
        self.backend_ids.insert(be, id);
        self.backends_by_id.insert(id, be);
        // Unused until a frontend write that references it succeeds.
        self.maybe_unused.insert(id);
        Ok(id)
    }

    fn hold(&mut self, ids: &[u32]) {
        self.live_slots += ids.len() as u64;
        for id in ids {
            *self.refs.entry(*id).or_insert(0) += 1;
        }
    }

    fn release(&mut self, ids: &[u32]) {
        self.live_slots = self.live_slots.saturating_sub(ids.len() as u64);
        for id in ids {
            if let Some(n) = self.refs.get_mut(id) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.maybe_unused.insert(*id);
                }
            }
        }
    }

    fn allocate_service_id(&mut self) -> u32 {
        let id = next_free(&mut self.next_service_id, &self.used_service_ids);
        self.used_service_ids.insert(id);
        id
    }
}

/// The `MAGLEV` key of chunk `chunk` of service entry `value`'s table.
fn chunk_key(value: &ServiceValue, chunk: u32) -> BackendSlotKey {
    BackendSlotKey {
        service_id: value.id,
        rev: value.rev,
        slot: chunk,
    }
}

fn chunks(table_len: u16) -> u32 {
    u32::from(table_len).div_ceil(MAGLEV_CHUNK)
}

/// Writes `table` as `value`'s generation of its Maglev table.
fn write_table(maps: &mut MapSet, value: &ServiceValue, table: &[u16]) -> Result<()> {
    for (i, entries) in table.chunks(MAGLEV_CHUNK as usize).enumerate() {
        let mut chunk = MaglevChunk::default();
        chunk.slots[..entries.len()].copy_from_slice(entries);
        maps.maglev
            .insert(&chunk_key(value, i as u32), &chunk, 0)
            .map_err(|e| anyhow::Error::new(e).context("writing a Maglev table"))?;
    }
    Ok(())
}

/// Removes the first `slots` backend slots of `value`'s generation.
fn remove_slots(maps: &mut MapSet, value: &ServiceValue, slots: usize) -> Result<()> {
    for slot in 0..slots as u32 {
        remove_ignoring_absent(maps.slots.remove(&BackendSlotKey {
            service_id: value.id,
            rev: value.rev,
            slot,
        }))?;
    }
    Ok(())
}

/// Removes `value`'s generation: its `slots` backend slots and its Maglev table.
fn remove_generation(maps: &mut MapSet, value: &ServiceValue, slots: usize) -> Result<()> {
    remove_slots(maps, value, slots)?;
    remove_table(maps, value)
}

/// Removes `value`'s generation of its Maglev table, if it has one.
fn remove_table(maps: &mut MapSet, value: &ServiceValue) -> Result<()> {
    for chunk in 0..chunks(value.table_len) {
        remove_ignoring_absent(maps.maglev.remove(&chunk_key(value, chunk)))?;
    }
    Ok(())
}

/// Reads an adopted entry's Maglev table; empty when it has none or a chunk is missing
/// (a torn write: rewritten on the next apply).
fn adopt_table(maps: &MapSet, value: &ServiceValue) -> Vec<u16> {
    let mut table = Vec::with_capacity(usize::from(value.table_len));
    for chunk in 0..chunks(value.table_len) {
        match maps.maglev.get(&chunk_key(value, chunk), 0) {
            Ok(c) => table.extend_from_slice(&c.slots),
            Err(_) => return Vec::new(),
        }
    }
    table.truncate(usize::from(value.table_len));
    table
}

/// One generation of a service entry, as `write_generation` writes it.
struct Generation {
    id: u32,
    /// In slot order.
    backend_ids: Vec<u32>,
    flags: u16,
    timeout: u32,
    count: u16,
    scheduler: u8,
    /// (backend id, weight), for `SVC_F_WEIGHTED` entries.
    weights: Vec<(u32, u32)>,
    /// `sh`/`mh`: the Maglev table, as slots.
    table: Vec<u16>,
}

/// Removes service entry `service_id`'s weights of `backend_ids` (repeats allowed).
fn forget_weights<'a>(
    maps: &mut MapSet,
    service_id: u32,
    backend_ids: impl Iterator<Item = &'a u32>,
) -> Result<()> {
    let mut done = HashSet::new();
    for &backend_id in backend_ids {
        if done.insert(backend_id) {
            remove_ignoring_absent(maps.weights.remove(&MemberKey {
                service_id,
                backend_id,
            }))?;
        }
    }
    Ok(())
}

/// The next id from `next` that is neither 0 nor in use; advances `next` past it.
fn next_free(next: &mut u32, used: &HashSet<u32>) -> u32 {
    next_free_by(next, |id| used.contains(&id))
}

fn next_free_key<V>(next: &mut u32, used: &HashMap<u32, V>) -> u32 {
    next_free_by(next, |id| used.contains_key(&id))
}

fn next_free_by(next: &mut u32, in_use: impl Fn(u32) -> bool) -> u32 {
    let mut id = (*next).max(1);
    while id == 0 || in_use(id) {
        id = id.wrapping_add(1);
    }
    *next = id.wrapping_add(1);
    id
}

/// Writes a new generation's slots, its reverse-NAT entry and source ranges, then flips
/// the service entry to it.
fn flip(
    maps: &mut MapSet,
    key: ServiceKey,
    old: Option<&Programmed>,
    value: &ServiceValue,
    backend_ids: &[u32],
    table: &[u16],
    ranges: &[ipnet::IpNet],
) -> Result<()> {
    let (id, rev) = (value.id, value.rev);
    // New slots under the new generation; on failure remove what was written.
    for (slot, backend_id) in backend_ids.iter().enumerate() {
        let slot_key = BackendSlotKey {
            service_id: id,
            rev,
            slot: slot as u32,
        };
        if let Err(e) = maps.slots.insert(
            &slot_key,
            &BackendSlot {
                backend_id: *backend_id,
            },
            0,
        ) {
            let _ = remove_slots(maps, value, slot);
            return Err(anyhow::Error::new(e).context("writing backend slots"));
        }
    }
    if let Err(e) = write_table(maps, value, table) {
        let _ = remove_generation(maps, value, backend_ids.len());
        return Err(e);
    }
    let rev_nat = RevNatValue {
        addr: key.addr,
        port: key.port,
        family: key.family,
        proto: key.proto,
    };
    maps.rev_nat
        .insert(&id, &rev_nat, 0)
        .map_err(|e| anyhow::Error::new(e).context("writing reverse-NAT entry"))?;
    let old_ranges: &[ipnet::IpNet] = old.map_or(&[], |o| o.ranges.as_slice());
    for net in ranges.iter().filter(|n| !old_ranges.contains(n)) {
        maps.source_ranges
            .insert(&range_key(id, net), &1, 0)
            .map_err(|e| anyhow::Error::new(e).context("writing a source range"))?;
    }
    // The flip: one update makes the new set visible.
    maps.services
        .insert(&key, value, 0)
        .map_err(|e| anyhow::Error::new(e).context("writing service entry"))?;
    Ok(())
}

/// The `SOURCE_RANGES` key of one CIDR of one service.
fn range_key(service_id: u32, net: &ipnet::IpNet) -> LpmKey<LpmData> {
    lpm_key(service_id, net)
}

fn lpm_key(tag: u32, net: &ipnet::IpNet) -> LpmKey<LpmData> {
    let (addr, _) = addr_words(net.network());
    LpmKey::new(
        LPM_TAG_BITS + u32::from(net.prefix_len()),
        LpmData { tag, addr },
    )
}

/// Writes the node settings: the masquerade addresses and flags, the pod network and the
/// node's own addresses (who is "inside").
pub fn configure(maps: &mut MapSet, node: &NodeSettings, ct: &ConntrackOptions) -> Result<()> {
    let first = |v4: bool| {
        node.node_addresses
            .iter()
            .find(|a| a.is_ipv4() == v4)
            .map_or([0; 4], |a| addr_words(*a).0)
    };
    let mut flags = 0;
    if node.masquerade_all {
        flags |= CFG_MASQUERADE_ALL;
    }
    if !node.pod_cidrs.is_empty() {
        flags |= CFG_LOCAL_DETECTOR;
    }
    let secs = |d: std::time::Duration| u32::try_from(d.as_secs().max(1)).unwrap_or(u32::MAX);
    let cfg = NodeConfig {
        snat_v4: first(true),
        snat_v6: first(false),
        flags,
        timeouts: CtTimeouts {
            tcp_syn: secs(ct.tcp_syn),
            tcp_established: secs(ct.tcp_established),
            tcp_closing: secs(ct.tcp_close_wait),
            udp: secs(ct.udp),
            udp_stream: secs(ct.udp_stream),
            // No kube-proxy setting: netfilter's TIME_WAIT and CLOSE (the built-in defaults).
            tcp_time_wait: 0,
            tcp_close: 0,
        },
        snat_port_min: ct.masquerade_ports.0,
        snat_port_max: ct.masquerade_ports.1,
    };
    maps.node_config.set(0, &cfg, 0)?;
    let mut wanted = Vec::new();
    for net in &node.pod_cidrs {
        let family = if net.addr().is_ipv4() {
            FAMILY_V4
        } else {
            FAMILY_V6
        };
        wanted.push(lpm_key(LPM_TAG_POD | u32::from(family), net));
    }
    for ip in &node.node_addresses {
        let family = if ip.is_ipv4() { FAMILY_V4 } else { FAMILY_V6 };
        let net = ipnet::IpNet::from(*ip);
        wanted.push(lpm_key(LPM_TAG_NODE | u32::from(family), &net));
    }
    let present: Vec<LpmKey<LpmData>> = maps.local_nets.keys().filter_map(|k| k.ok()).collect();
    // Stale entries go first: a table left full by an earlier run (or config) must not
    // refuse the entries this one needs.
    for key in present {
        let still = wanted
            .iter()
            .any(|w| w.prefix_len() == key.prefix_len() && w.data() == key.data());
        if !still {
            remove_ignoring_absent(maps.local_nets.remove(&key))?;
        }
    }
    for key in &wanted {
        maps.local_nets
            .insert(key, &1, 0)
            .with_context(|| format!("writing {} local networks", wanted.len()))?;
    }
    Ok(())
}

/// A removal that found nothing to remove succeeded.
pub(super) fn remove_ignoring_absent(r: Result<(), MapError>) -> Result<()> {
    match r {
        Err(e) if !super::maps::is_absent(&e) => Err(e.into()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frontend_key_is_network_order() {
        let key = service_key(&Frontend {
            ip: "10.96.0.10".parse().expect("ip"),
            port: 80,
            protocol: Protocol::Udp,
        });
        // The bytes as the packet carries them.
        assert_eq!(key.addr[0].to_ne_bytes(), [10, 96, 0, 10]);
        assert_eq!(key.addr[1..], [0, 0, 0]);
        assert_eq!(key.port.to_ne_bytes(), [0, 80]);
        assert_eq!(
            (key.proto, key.family, key.scope),
            (PROTO_UDP, FAMILY_V4, SCOPE_EXTERNAL)
        );
    }

    #[test]
    fn ipv6_words_round_trip() {
        let ip: IpAddr = "fd96::10".parse().expect("ip");
        let (words, family) = addr_words(ip);
        assert_eq!(family, FAMILY_V6);
        assert_eq!(words[0].to_ne_bytes(), [0xfd, 0x96, 0, 0]);
        assert_eq!(words[3].to_ne_bytes(), [0, 0, 0, 0x10]);
        assert_eq!(words_addr(words, family), ip);
        let v4: IpAddr = "192.0.2.1".parse().expect("ip");
        let (w, f) = addr_words(v4);
        assert_eq!(words_addr(w, f), v4);
    }

    #[test]
    fn backend_entry_carries_target_port() {
        let be = backend_value("10.244.1.5:8080".parse().expect("sa"), Protocol::Tcp);
        assert_eq!(be.port.to_ne_bytes(), 8080u16.to_be_bytes());
        assert_eq!(
            (be.proto, be.family, be.state),
            (PROTO_TCP, FAMILY_V4, BACKEND_ACTIVE)
        );
    }
}
