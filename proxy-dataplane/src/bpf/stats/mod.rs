//! Per-frontend and per-backend statistics as `ipvsadm -Ln --stats` shows them: the
//! programs' per-CPU counts per (frontend, backend) pair (`LB_STATS`) summed — a
//! frontend's over its pairs, its removed backends' folded-in counts included — with
//! the counts answered flows hold in their own entries (`CONNTRACK`) and those the agent
//! folded from the entries it removed (`StatsKey::ended`), and the two scopes of a
//! frontend merged into one row, as one IPVS virtual service.
//!
//! A flow's counts move from its entries to `LB_STATS` as the entries go; a read that
//! meets the move half-way may miss or repeat them once (as it may meet the fold of a
//! removed backend's pair).

mod rows;
mod table;

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::error::{Context as _, ErrorKind, Kind as _, Result};
use aya::maps::{MapError, PerCpuValues};
use proxy_common::{
    BackendSlotKey, CT_DIR_FORWARD, CtKey, CtValue, LbStats, MemberKey, SVC_F_WEIGHTED,
    ServiceValue, StatsKey, map_names,
};

pub use self::rows::{BackendStats, FrontendStats, Totals};
pub use self::table::{large_number, render_table};
use super::{
    codec::protocol_of,
    maps::remove_ignoring_absent,
    maps::{MapSet, is_absent},
};
use proxy_model::{Frontend, schedule::Scheduler};

/// What an answered flow's entry (keyed `key`) counted — one direction's packets and
/// bytes — and the pair it counts for; `None` when it holds nothing to add (no packets
/// yet, or no frontend: direct server return's flows at the backend's node).
fn entry_counts(key: &CtKey, v: &CtValue) -> Option<(StatsKey, Totals)> {
    if v.packets == 0 || v.rev_nat_id == 0 {
        return None;
    }
    let pair = StatsKey {
        rev_nat_id: v.rev_nat_id,
        backend_id: v.backend_id,
    };
    let t = if key.dir == CT_DIR_FORWARD {
        Totals {
            packets_in: v.packets,
            bytes_in: v.bytes,
            ..Totals::default()
        }
    } else {
        Totals {
            packets_out: v.packets,
            bytes_out: v.bytes,
            ..Totals::default()
        }
    };
    Some((pair, t))
}

/// Counts of removed flow entries, per pair, for [`fold_ended`].
#[derive(Debug, Default)]
pub struct Ended(HashMap<StatsKey, Totals>);

impl Ended {
    /// Removes flow entry `key` (last read as `value`) from `table`, its counts noted;
    /// returns the entries removed (0: gone meanwhile, and whoever removed it kept its
    /// counts). A packet counted between that read and the removal is lost: the agent
    /// removes only flows that idled past their limit or whose backend left.
    pub fn remove(
        &mut self,
        table: &mut aya::maps::HashMap<aya::maps::MapData, CtKey, CtValue>,
        key: &CtKey,
        value: &CtValue,
    ) -> Result<u64> {
        match table.remove(key) {
            Ok(()) => {
                if let Some((pair, t)) = entry_counts(key, value) {
                    *self.0.entry(pair).or_default() += t;
                }
                Ok(1)
            }
            Err(e) if is_absent(&e) => Ok(0),
            Err(e) => Err(e).kind(ErrorKind::Map, "removing a conntrack entry"),
        }
    }
}

/// The agent's read-modify-writes of the `LB_STATS` entries only it writes (`retired`,
/// `ended`): the collector's thread and the map writer's both fold, one at a time.
static AGENT_FOLDS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Adds the counts of flow entries the agent removed to their pairs' `ended` entries.
pub fn fold_ended(maps: &mut MapSet, ended: Ended) -> Result<()> {
    if ended.0.is_empty() {
        return Ok(());
    }
    let _one_at_a_time = AGENT_FOLDS.lock().unwrap_or_else(|e| e.into_inner());
    for (pair, t) in ended.0 {
        add_to(maps, StatsKey::ended(pair.rev_nat_id, pair.backend_id), t)?;
    }
    Ok(())
}

/// Adds `t` to agent-written entry `key` (its first CPU's value; the readers sum CPUs).
fn add_to(maps: &mut MapSet, key: StatsKey, t: Totals) -> Result<()> {
    let cpus = aya::util::nr_cpus()
        .map_err(|(_, e)| e)
        .kind(ErrorKind::Io, "counting CPUs")?
        .get() as usize;
    let mut sum: Vec<LbStats> = match present(maps.lb_stats.get(&key, 0))
        .kind_with(ErrorKind::Map, || {
            format!("reading {} {key:?}", map_names::LB_STATS)
        })? {
        Some(v) => v.to_vec(),
        None => vec![LbStats::default(); cpus],
    };
    let first = sum.first_mut().kind(ErrorKind::Map, "no CPU values")?;
    let mut added: Totals = std::iter::once(&*first).sum();
    added += t;
    *first = LbStats::from(added);
    let sum = PerCpuValues::try_from(sum).kind(ErrorKind::Map, "per-CPU values")?;
    maps.lb_stats
        .insert(&key, sum, 0)
        .kind_with(ErrorKind::Map, || {
            format!("writing {} {key:?}", map_names::LB_STATS)
        })
}

/// Every programmed frontend with its totals and its backends'.
pub fn read(maps: &MapSet) -> Result<Vec<FrontendStats>> {
    let pairs = pair_totals(maps)?;
    let mut per_frontend: HashMap<u32, Totals> = HashMap::new();
    for (key, t) in &pairs {
        *per_frontend.entry(key.rev_nat_id).or_default() += *t;
    }
    let mut entries = maps
        .services
        .iter()
        .collect::<Result<Vec<_>, _>>()
        .kind_with(ErrorKind::Map, || {
            format!("reading {}", map_names::SERVICES)
        })?;
    // A frontend's external (or only) scope first: its scheduler and weights show.
    entries.sort_unstable_by_key(|(key, _)| *key);
    let mut rows: BTreeMap<Frontend, FrontendStats> = BTreeMap::new();
    for (key, value) in entries {
        let Some(protocol) = protocol_of(key.proto) else {
            continue;
        };
        let address = proxy_common::addr::socket_addr(key.addr, key.family, key.port);
        let row = rows
            .entry(Frontend {
                ip: address.ip(),
                port: address.port(),
                protocol,
            })
            .or_insert_with(|| FrontendStats {
                address,
                protocol,
                scheduler: scheduler_name(value.scheduler),
                service_ids: Vec::new(),
                stats: Totals::default(),
                backends: Vec::new(),
            });
        row.service_ids.push(value.id);
        row.stats += per_frontend
            .get(&value.rev_nat_id)
            .copied()
            .unwrap_or_default();
        for (backend_id, slots) in slot_counts(maps, &value)? {
            let pair = pairs
                .get(&StatsKey {
                    rev_nat_id: value.rev_nat_id,
                    backend_id,
                })
                .copied()
                .unwrap_or_default();
            if let Some(b) = row.backends.iter_mut().find(|b| b.id == backend_id) {
                b.stats += pair; // the other scope's
                continue;
            }
            if let Some(b) = backend_stats(maps, &value, backend_id, slots, pair)? {
                row.backends.push(b);
            }
        }
    }
    let mut rows: Vec<FrontendStats> = rows.into_values().collect();
    for row in &mut rows {
        row.service_ids.sort_unstable();
        row.backends.sort_by_key(|b| b.address);
    }
    Ok(rows)
}

/// Every pair's counts, summed over CPUs, with its `ended` entry's and its answered
/// flows' live entries'.
fn pair_totals(maps: &MapSet) -> Result<HashMap<StatsKey, Totals>> {
    let mut out: HashMap<StatsKey, Totals> = HashMap::new();
    for entry in maps.lb_stats.iter() {
        let (key, per_cpu) = entry.kind_with(ErrorKind::Map, || {
            format!("reading {}", map_names::LB_STATS)
        })?;
        *out.entry(key.pair()).or_default() += per_cpu.iter().sum::<Totals>();
    }
    let live = super::batch::read_all(&maps.conntrack).kind_with(ErrorKind::Map, || {
        format!("reading {}", map_names::CONNTRACK)
    })?;
    for (pair, t) in live.iter().filter_map(|(key, v)| entry_counts(key, v)) {
        *out.entry(pair).or_default() += t;
    }
    Ok(out)
}

/// Per frontend, its pairs in `LB_STATS` summed over CPUs and scopes: entries with counts
/// only (through `REV_NAT`, without walking the slots), for a scrape.
pub fn frontend_totals(maps: &MapSet) -> Result<BTreeMap<Frontend, Totals>> {
    let mut per_id: HashMap<u32, Totals> = HashMap::new();
    for (key, t) in pair_totals(maps)? {
        *per_id.entry(key.rev_nat_id).or_default() += t;
    }
    let mut out: BTreeMap<Frontend, Totals> = BTreeMap::new();
    for (id, t) in per_id {
        // Gone since (the collector removes its counts next): nothing to name it by.
        let Some(rev) = present(maps.rev_nat.get(&id, 0)).kind_with(ErrorKind::Map, || {
            format!("reading {} {id}", map_names::REV_NAT)
        })?
        else {
            continue;
        };
        let Some(protocol) = protocol_of(rev.proto) else {
            continue;
        };
        let frontend = Frontend {
            ip: proxy_common::addr::from_words(rev.addr, rev.family),
            port: u16::from_be(rev.port),
            protocol,
        };
        *out.entry(frontend).or_default() += t;
    }
    Ok(out)
}

/// The collector's part (every pass): the pairs of removed frontends go; a removed
/// backend's pair (and its `ended` entry) under a live frontend is folded into the
/// frontend's [`StatsKey::retired`] entry and goes, so the frontend's totals keep its
/// counts (as IPVS keeps a virtual service's when a real server goes). A flow of the
/// removed backend that goes on makes its pair again, folded at the next pass. The
/// programs never write `backend_id` 0, so the fold's read-modify-write races with
/// nothing.
pub fn fold_removed(maps: &mut MapSet) -> Result<()> {
    let keys: Vec<StatsKey> = maps.lb_stats.keys().filter_map(Result::ok).collect();
    if keys.is_empty() {
        return Ok(());
    }
    let _one_at_a_time = AGENT_FOLDS.lock().unwrap_or_else(|e| e.into_inner());
    let frontends = live_ids(&maps.rev_nat, keys.iter().map(|k| k.pair().rev_nat_id))
        .with_context(|| format!("reading {}", map_names::REV_NAT))?;
    let backends = live_ids(&maps.backends, keys.iter().map(|k| k.pair().backend_id))
        .with_context(|| format!("reading {}", map_names::BACKENDS))?;
    for key in keys {
        let pair = key.pair();
        if !frontends.contains(&pair.rev_nat_id) {
            remove_ignoring_absent(maps.lb_stats.remove(&key))?;
            continue;
        }
        if pair.backend_id == 0 || backends.contains(&pair.backend_id) {
            continue;
        }
        let Some(counts) = present(maps.lb_stats.get(&key, 0)).kind_with(ErrorKind::Map, || {
            format!("reading {} {key:?}", map_names::LB_STATS)
        })?
        else {
            continue;
        };
        let counts: Totals = counts.iter().sum();
        add_to(maps, StatsKey::retired(pair.rev_nat_id), counts)?;
        remove_ignoring_absent(maps.lb_stats.remove(&key))?;
    }
    Ok(())
}

/// Pairs' ids up to this many are looked up one by one; more, and the map is read whole
/// in batches. Few pairs are the common case (only pairs with traffic have entries), and
/// reading a million backends at 100k Services every pass was a CPU burst of its own.
const POINT_LOOKUPS_MAX: usize = 16_384;

/// Which of `ids` are keys of `map`.
fn live_ids<V: aya::Pod>(
    map: &aya::maps::HashMap<aya::maps::MapData, u32, V>,
    ids: impl Iterator<Item = u32>,
) -> Result<HashSet<u32>> {
    let wanted: HashSet<u32> = ids.collect();
    if wanted.len() > POINT_LOOKUPS_MAX {
        return Ok(super::batch::read_all(map)?
            .into_iter()
            .map(|(id, _)| id)
            .filter(|id| wanted.contains(id))
            .collect());
    }
    let mut live = HashSet::new();
    for id in wanted {
        if present(map.get(&id, 0))?.is_some() {
            live.insert(id);
        }
    }
    Ok(live)
}

/// Backend ids of a service entry's live slots, with the number of slots each fills.
fn slot_counts(maps: &MapSet, value: &ServiceValue) -> Result<Vec<(u32, u32)>> {
    let mut counts: HashMap<u32, u32> = HashMap::new();
    let mut order = Vec::new();
    for slot in 0..u32::from(value.count) {
        let key = BackendSlotKey {
            service_id: value.id,
            rev: value.rev,
            slot,
        };
        // A slot missing here was flipped away while we read: the next dump sees the rest.
        let Some(s) = present(maps.slots.get(&key, 0)).kind_with(ErrorKind::Map, || {
            format!("reading {} {}/{}", map_names::BACKEND_SLOTS, value.id, slot)
        })?
        else {
            continue;
        };
        let n = counts.entry(s.backend_id).or_default();
        if *n == 0 {
            order.push(s.backend_id);
        }
        *n += 1;
    }
    Ok(order.into_iter().map(|id| (id, counts[&id])).collect())
}

/// `None` when the backend was removed while we read.
fn backend_stats(
    maps: &MapSet,
    value: &ServiceValue,
    id: u32,
    slots: u32,
    stats: Totals,
) -> Result<Option<BackendStats>> {
    let context = |map: &str| format!("reading {map} of backend {id}");
    let Some(b) = present(maps.backends.get(&id, 0))
        .kind_with(ErrorKind::Map, || context(map_names::BACKENDS))?
    else {
        return Ok(None);
    };
    let weight = if value.flags & SVC_F_WEIGHTED != 0 {
        let member = MemberKey {
            service_id: value.id,
            backend_id: id,
        };
        present(maps.weights.get(&member, 0))
            .kind_with(ErrorKind::Map, || context(map_names::WEIGHTS))?
            .unwrap_or(1)
    } else if super::codec::scheduler_of_code(value.scheduler) == Some(Scheduler::Wrr) {
        slots
    } else {
        1
    };
    Ok(Some(BackendStats {
        address: proxy_common::addr::socket_addr(b.addr, b.family, b.port),
        id,
        weight,
        active_conns: present(maps.active_conns.get(&id, 0))
            .kind_with(ErrorKind::Map, || context(map_names::ACTIVE_CONNS))?
            .unwrap_or(0),
        stats,
    }))
}

/// A lookup's value, `None` when the key is absent.
fn present<T>(r: Result<T, MapError>) -> Result<Option<T>, MapError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if is_absent(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// An unknown code (a newer agent's scheduler) shows as `?`, never as another's name.
fn scheduler_name(code: u8) -> &'static str {
    match super::codec::scheduler_of_code(code) {
        Some(s) => s.name(),
        None => "?",
    }
}

#[cfg(test)]
mod tests {
    use proxy_model::Protocol;

    use super::*;

    #[test_support::needs_root]
    #[test]
    fn live_ids_agree_looked_up_one_by_one_and_read_whole() {
        use aya::maps::{HashMap as BpfHashMap, MapData};
        let mut m = BpfHashMap::<MapData, u32, u64>::create(40_000, 0).expect("a private map");
        let entries: Vec<(u32, u64)> = (0..30_000u32).map(|k| (k * 2, 1)).collect();
        super::super::batch::write_all(&mut m, &entries).expect("write");
        // Even ids are keys, odd ones not: few asked, then more than the point limit.
        for asked in [10u32, POINT_LOOKUPS_MAX as u32 * 2] {
            let live = live_ids(&m, 0..asked).expect("live ids");
            let expected: HashSet<u32> = (0..asked).filter(|id| id % 2 == 0).collect();
            assert_eq!(live, expected, "{asked} ids asked");
        }
    }

    #[test]
    fn per_cpu_values_and_rows_add_up() {
        let per_cpu = [
            LbStats {
                conns: 1,
                packets_in: 2,
                bytes_in: 120,
                packets_out: 1,
                bytes_out: 60,
            },
            LbStats::default(),
            LbStats {
                conns: 0,
                packets_in: 1,
                bytes_in: 54,
                packets_out: 3,
                bytes_out: 9_000,
            },
        ];
        let mut t: Totals = per_cpu.iter().sum();
        assert_eq!(
            t,
            Totals {
                conns: 1,
                packets_in: 3,
                packets_out: 4,
                bytes_in: 174,
                bytes_out: 9_060,
            }
        );
        t += Totals {
            conns: 2,
            ..Totals::default()
        };
        assert_eq!(t.conns, 3);
        assert_eq!(t.bytes_out, 9_060);
    }

    /// `dump --stats --json`: addresses and protocols as people write them.
    #[test]
    fn json_rows_read_like_the_table() {
        let row = FrontendStats {
            address: "[fd96::10]:53".parse().expect("addr"),
            protocol: Protocol::Udp,
            scheduler: "rr",
            service_ids: vec![4],
            stats: Totals::default(),
            backends: Vec::new(),
        };
        let json = serde_json::to_value(&row).expect("json");
        assert_eq!(json["address"], "[fd96::10]:53");
        assert_eq!(json["protocol"], "UDP");
        assert_eq!(json["scheduler"], "rr");
        assert_eq!(json["stats"]["bytes_out"], 0);
    }

    #[test]
    fn codes_of_a_newer_agent_are_not_misnamed() {
        assert_eq!(scheduler_name(proxy_common::sched::MH), "mh");
        assert_eq!(scheduler_name(200), "?");
    }
}
