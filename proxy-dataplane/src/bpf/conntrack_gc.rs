//! The connection-tracking collector: flows expire by their own state's idle limit, not
//! by LRU luck. The programs already ignore (and replace) an expired flow; this pass
//! frees its entries — and with them its masquerade port — and measures how full the
//! tables really are. It is what netfilter's and Cilium's conntrack GC do.

use std::{collections::HashMap as StdHashMap, path::PathBuf, time::Duration};

use crate::error::{Context as _, ErrorKind, Kind as _, Result};
use aya::maps::{HashMap, MapData};
use proxy_common::{
    CT_DIR_FORWARD, CtKey, CtTimeouts, CtValue, PROTO_TCP, ct_closed, elapsed_ns, flow_last_seen,
    forward_key_of, map_names, reply_key_of,
};

use super::{
    maps::{MapSet, remove_ignoring_absent},
    stats::Ended,
};

/// How often the collector runs.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// The answered table's room for promotions: past `ROOM_HIGH` of its capacity, flows go
/// (`make_room`) until it is down to `ROOM_LOW` (per mille). A table filled with flows
/// that carry nothing — made complete by a forger, or simply left idle — never keeps real
/// flows from being answered for longer than one pass.
const ROOM_HIGH: u64 = 900;
const ROOM_LOW: u64 = 800;

/// A reply entry is written a moment before its forward partner (and moved first when a
/// flow is answered): one without a partner is an orphan only once it is this old.
const ORPHAN_GRACE_NS: u64 = 5_000_000_000;

/// What one pass saw and did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Collected {
    /// Entries (two per flow) left in the table of answered flows, and its capacity.
    pub answered: u64,
    pub answered_capacity: u64,
    /// Entries left in the table of flows not answered yet, and its capacity.
    pub new: u64,
    pub new_capacity: u64,
    /// Entries this pass removed (expired flows and orphaned reply entries).
    pub collected: u64,
    /// Entries of live answered flows this pass removed to keep room (`ROOM_HIGH`), the
    /// idlest first.
    pub evicted: u64,
}

/// The running collector: dropping it stops it (at its next wake-up, or once the pass
/// under way ends).
#[must_use = "dropping the handle stops the collector"]
pub struct Collector {
    _stop: std::sync::mpsc::Sender<()>,
}

/// Runs the collector every `INTERVAL` on its own handle of the pinned maps (opened
/// when they exist), refreshing the flows left to netfilter while there are any, and
/// hands each pass's figures to `record` — on a thread of its own, not the runtime's
/// blocking pool: the runtime's drop waits for that pool, and an endless task there held
/// every SIGTERM (the agent logged "shutting down" and waited for SIGKILL).
pub fn spawn(
    maps_dir: PathBuf,
    mut record: impl FnMut(Collected) + Send + 'static,
) -> Result<Collector> {
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("conntrack-gc".into())
        .spawn(move || {
            let mut maps = None;
            // Sleeps INTERVAL; ends as soon as the handle is dropped.
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(INTERVAL)
            {
                if maps.is_none() {
                    maps = MapSet::open_pinned(&maps_dir)
                        .inspect_err(|e| {
                            tracing::warn!(error = format!("{e:#}"), "conntrack collector: no maps")
                        })
                        .ok();
                }
                let Some(m) = maps.as_mut() else { continue };
                // While flows from before us (kube-proxy's) are left to netfilter, follow
                // its table: they go from the map as they end there.
                if m.netfilter_flows.keys().next().is_some()
                    && let Err(e) = super::ctnetlink::refresh_netfilter_flows(m)
                {
                    tracing::warn!(error = format!("{e:#}"), "netfilter flows not refreshed");
                }
                match collect(m, monotonic_ns()) {
                    Ok(st) => {
                        tracing::debug!(?st, "conntrack collected");
                        record(st);
                    }
                    Err(e) => {
                        tracing::warn!(error = format!("{e:#}"), "conntrack collector failed")
                    }
                }
            }
            tracing::debug!("conntrack collector stopped");
        })
        .kind(ErrorKind::Io, "starting the conntrack collector's thread")?;
    Ok(Collector { _stop: stop })
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_ns()`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One pass over both tables at time `now_ns`, with the timeouts the programs use
/// (`NODE_CONFIG`).
pub fn collect(maps: &mut MapSet, now_ns: u64) -> Result<Collected> {
    let timeouts = maps
        .node_config
        .get(&0, 0)
        .kind(ErrorKind::Map, "reading NODE_CONFIG")?
        .timeouts;
    let mut stats = Collected::default();
    // The counts of the answered flows' entries this pass removes (the unanswered
    // ones' count in `LB_STATS` already).
    let mut ended = Ended::default();
    let (mut answered, cap, collected) =
        collect_table(&mut maps.conntrack, &timeouts, now_ns, &mut ended)
            .with_context(|| format!("collecting {}", map_names::CONNTRACK))?;
    stats.evicted = make_room(&mut maps.conntrack, &mut answered, cap, &mut ended)
        .with_context(|| format!("making room in {}", map_names::CONNTRACK))?;
    (stats.answered, stats.answered_capacity) = (answered.len() as u64, cap);
    stats.collected += collected;
    super::stats::fold_ended(maps, ended).context("keeping the counts of removed flows")?;
    let (new, cap, collected) = collect_table(
        &mut maps.conntrack_new,
        &timeouts,
        now_ns,
        &mut Ended::default(),
    )
    .with_context(|| format!("collecting {}", map_names::CONNTRACK_NEW))?;
    (stats.new, stats.new_capacity) = (new.len() as u64, cap);
    stats.collected += collected;
    // From the tables as this pass left them: each is read once a pass.
    let sockets = super::sock_state::SockState::read(maps)?;
    recount_active(maps, [&answered, &new], &sockets, &timeouts, now_ns)
        .context("recounting active connections")?;
    // Not settling only keeps every release looking its socket up: no reason to skip the
    // rest of the pass.
    if let Err(e) = super::sock_filter::settle(maps, &sockets.entries) {
        tracing::warn!(
            error = format!("{e:#}"),
            "sock_release's filter not settled"
        );
    }
    super::stats::fold_removed(maps).context("removing statistics of removed entries")?;
    Ok(stats)
}

/// Sets `ACTIVE_CONNS` to the connections open now, per backend: live flows of the
/// per-packet path that are not closing (as IPVS's ActiveConn) and connected sockets of
/// the connect-time path. The programs add one per new connection at once; closed ones
/// leave the counts here, every pass.
fn recount_active(
    maps: &mut MapSet,
    tables: [&Snapshot; 2],
    sockets: &super::sock_state::SockState,
    timeouts: &CtTimeouts,
    now: u64,
) -> Result<()> {
    let mut open: StdHashMap<u32, u64> = StdHashMap::new();
    for entries in tables {
        for (key, v) in entries {
            let closing = key.proto == PROTO_TCP && ct_closed(v.flags);
            if key.dir == CT_DIR_FORWARD
                && !closing
                && !flow_expired(timeouts, key, v, reply_in(entries, key, v), now)
            {
                *open.entry(v.backend_id).or_default() += 1;
            }
        }
    }
    for (_, binding) in sockets.connected() {
        *open.entry(binding.backend_id).or_default() += 1;
    }
    let stale: Vec<u32> = maps
        .active_conns
        .keys()
        .filter_map(Result::ok)
        .filter(|id| !open.contains_key(id))
        .collect();
    for id in stale {
        remove_ignoring_absent(maps.active_conns.remove(&id))?;
    }
    for (id, n) in open {
        maps.active_conns.insert(&id, &n, 0)?;
    }
    Ok(())
}

/// Whether the flow of forward entry `fwd` (at `key`, its reply entry `reply` if found)
/// has idled past its state's limit: by the later stamp of the two.
fn flow_expired(
    timeouts: &CtTimeouts,
    key: &CtKey,
    fwd: &CtValue,
    reply: Option<&CtValue>,
    now: u64,
) -> bool {
    timeouts.expired(key.proto, fwd.flags, flow_last_seen(fwd, reply), now)
}

/// The reply entry of forward entry `fwd` (at `key`) in `entries`, if it names this flow.
fn reply_in<'a>(entries: &'a Snapshot, key: &CtKey, fwd: &CtValue) -> Option<&'a CtValue> {
    let reply = reply_key_of(key, fwd);
    entries
        .get(&reply)
        .filter(|r| forward_key_of(&reply, r) == *key)
}

/// A flow table as one batch read saw it.
type Snapshot = StdHashMap<CtKey, CtValue>;

/// Returns the entries left (as last read), the capacity and how many entries were
/// removed; the removed entries' counts go to `ended`.
fn collect_table(
    table: &mut HashMap<MapData, CtKey, CtValue>,
    timeouts: &CtTimeouts,
    now: u64,
    ended: &mut Ended,
) -> Result<(Snapshot, u64, u64)> {
    use aya::maps::IterableMap as _;
    let capacity = u64::from(table.map().info()?.max_entries());
    let mut entries: Snapshot = super::batch::read_all(table)?.into_iter().collect();
    let expired =
        |key: &CtKey, f: &CtValue, r: Option<&CtValue>| flow_expired(timeouts, key, f, r, now);
    let mut doomed = Vec::new();
    for (key, value) in &entries {
        if key.dir == CT_DIR_FORWARD {
            if expired(key, value, reply_in(&entries, key, value)) {
                doomed.push(*key);
            }
            continue;
        }
        let fwd_key = forward_key_of(key, value);
        let partnered = entries.get(&fwd_key).is_some_and(|f| {
            reply_key_of(&fwd_key, f) == *key && !expired(&fwd_key, f, Some(value))
        });
        if !partnered && elapsed_ns(now, value.last_seen_ns) > ORPHAN_GRACE_NS {
            doomed.push(*key);
        }
    }
    let mut removed = 0;
    // The snapshot follows: what is removed leaves it, what is read again replaces it.
    for key in doomed {
        // Read again: a packet may have revived the flow, or a new flow taken the tuple,
        // since the snapshot.
        let Ok(value) = table.get(&key, 0) else {
            entries.remove(&key);
            continue;
        };
        if key.dir == CT_DIR_FORWARD {
            removed += remove_flow(table, &mut entries, ended, key, value, |f, r| {
                expired(&key, f, r)
            })?;
        } else {
            let fwd_key = forward_key_of(&key, &value);
            let partnered = table.get(&fwd_key, 0).is_ok_and(|f| {
                reply_key_of(&fwd_key, &f) == key && !expired(&fwd_key, &f, Some(&value))
            });
            // The entry read again may be a new flow's, written since the snapshot.
            if !partnered && elapsed_ns(now, value.last_seen_ns) > ORPHAN_GRACE_NS {
                removed += ended.remove(table, &key, &value)?;
                entries.remove(&key);
            } else {
                entries.insert(key, value);
            }
        }
    }
    Ok((entries, capacity, removed))
}

/// Past `ROOM_HIGH` of `capacity`, removes flows (both entries) of `entries` until
/// `ROOM_LOW` is left — those whose backend never spoke since they were established,
/// then the idlest; returns the entries removed. A flow that a packet touched since the
/// snapshot stays.
fn make_room(
    table: &mut HashMap<MapData, CtKey, CtValue>,
    entries: &mut Snapshot,
    capacity: u64,
    ended: &mut Ended,
) -> Result<u64> {
    if (entries.len() as u64) * 1000 <= capacity * ROOM_HIGH {
        return Ok(0);
    }
    let target = capacity * ROOM_LOW / 1000;
    // First the flows whose backend has sent nothing since they were established — a
    // blind forger's (it cannot make the backend talk; stray data it sends is answered
    // with a reset, which closes the flow) — then the others; the idlest first in each.
    // A client that merely idles past a forger's flood is not the first to go.
    let mut flows: Vec<(bool, u64, CtKey)> = entries
        .iter()
        .filter(|(k, _)| k.dir == CT_DIR_FORWARD)
        .map(|(k, v)| {
            let reply = reply_in(entries, k, v);
            let spoke = reply.is_some_and(|r| r.packets > 0);
            (spoke, flow_last_seen(v, reply), *k)
        })
        .collect();
    flows.sort_unstable_by_key(|(spoke, seen, _)| (*spoke, *seen));
    let mut removed = 0;
    for (_, seen, key) in flows {
        if entries.len() as u64 <= target {
            break;
        }
        let Ok(value) = table.get(&key, 0) else {
            entries.remove(&key);
            continue;
        };
        // A flow a packet touched since the snapshot stays.
        removed += remove_flow(table, entries, ended, key, value, |f, r| {
            flow_last_seen(f, r) == seen
        })?;
    }
    if removed > 0 {
        tracing::warn!(
            entries = removed,
            capacity,
            "the table of answered flows was past 90% full: flows removed (silent ones, then the idlest)"
        );
    }
    Ok(removed)
}

/// The flow of forward entry `key`, as just read again (`value`), with its reply entry
/// (only if it still names this flow): both removed if `still_doomed` says so now, else
/// kept, the snapshot `entries` following either way. Returns the entries removed.
fn remove_flow(
    table: &mut HashMap<MapData, CtKey, CtValue>,
    entries: &mut Snapshot,
    ended: &mut Ended,
    key: CtKey,
    value: CtValue,
    still_doomed: impl Fn(&CtValue, Option<&CtValue>) -> bool,
) -> Result<u64> {
    let reply = reply_key_of(&key, &value);
    let r = table
        .get(&reply, 0)
        .ok()
        .filter(|r| forward_key_of(&reply, r) == key);
    if !still_doomed(&value, r.as_ref()) {
        entries.insert(key, value);
        if let Some(r) = r {
            entries.insert(reply, r);
        }
        return Ok(0);
    }
    let mut removed = ended.remove(table, &key, &value)?;
    entries.remove(&key);
    if let Some(r) = r {
        removed += ended.remove(table, &reply, &r)?;
        entries.remove(&reply);
    }
    Ok(removed)
}
