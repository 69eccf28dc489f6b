//! `sock_release`'s filter (`SOCK_LB_COUNTS`, `SOCK_LB_FILTER`; ABI.md, "the release
//! filter"): the programs count the `SOCK_LB` entries they make per cookie slot, so a
//! socket whose slot counts none — most of what a hooked cgroup releases — skips the
//! lookup. The agent owns the filter's two settings: the generation entries are counted
//! under, and whether entries counted under no generation of these counts may be left.

use crate::error::{ErrorKind, Kind as _, Result};
use aya::{
    Ebpf,
    maps::{Array, IterableMap as _, MapData},
};
use proxy_common::{SockLb, SockLbFilter, map_names};

use super::maps::MapSet;

/// At start, before the hooks are swapped in: the generation is the id of the counts map
/// this load uses (a new counts map, a new generation: entries counted in another are not
/// in this one), and entries of another generation may be left — an older release's, or
/// any made before this map — until `settle` finds none.
pub fn arm(ebpf: &mut Ebpf) -> Result<SockLbFilter> {
    let generation = {
        let map = ebpf
            .map(map_names::SOCK_LB_COUNTS)
            .kind_with(ErrorKind::Load, || {
                format!("BPF object has no map {}", map_names::SOCK_LB_COUNTS)
            })?;
        let counts: Array<&MapData, u32> = map.try_into()?;
        counts.map().info()?.id()
    };
    let filter = SockLbFilter {
        generation,
        uncounted: 1,
    };
    let map = ebpf
        .map_mut(map_names::SOCK_LB_FILTER)
        .kind_with(ErrorKind::Load, || {
            format!("BPF object has no map {}", map_names::SOCK_LB_FILTER)
        })?;
    let mut settings: Array<&mut MapData, SockLbFilter> = map.try_into()?;
    settings.set(0, &filter, 0).kind_with(ErrorKind::Map, || {
        format!("writing {}", map_names::SOCK_LB_FILTER)
    })?;
    Ok(filter)
}

/// The collector's part, with `SOCK_LB` as a pass read it: once every entry carries the
/// current generation, releases may trust the counts. (Entries made from now on are
/// counted: only the hooks swapped out made others, and they are gone.)
pub fn settle(maps: &mut MapSet, entries: &[(u64, SockLb)]) -> Result<()> {
    let filter = maps
        .sock_lb_filter
        .get(&0, 0)
        .kind_with(ErrorKind::Map, || {
            format!("reading {}", map_names::SOCK_LB_FILTER)
        })?;
    if !may_clear(&filter, entries) {
        return Ok(());
    }
    maps.sock_lb_filter
        .set(
            0,
            &SockLbFilter {
                uncounted: 0,
                ..filter
            },
            0,
        )
        .kind_with(ErrorKind::Map, || {
            format!("writing {}", map_names::SOCK_LB_FILTER)
        })?;
    tracing::info!(
        generation = filter.generation,
        sockets = entries.len(),
        "every socket entry counted: releases now skip the lookup for sockets never translated"
    );
    Ok(())
}

/// Whether `uncounted` may be cleared: set, with a generation, and no entry of another.
fn may_clear(filter: &SockLbFilter, entries: &[(u64, SockLb)]) -> bool {
    filter.uncounted != 0
        && filter.generation != 0
        && entries.iter().all(|(_, e)| e.counted == filter.generation)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(counted: u32) -> (u64, SockLb) {
        (
            1,
            SockLb {
                counted,
                ..SockLb::default()
            },
        )
    }

    #[test]
    fn cleared_only_when_every_entry_has_the_generation() {
        let armed = SockLbFilter {
            generation: 7,
            uncounted: 1,
        };
        assert!(may_clear(&armed, &[]));
        assert!(may_clear(&armed, &[entry(7), entry(7)]));
        // An older release's entry (0), or one counted in another counts map.
        assert!(!may_clear(&armed, &[entry(7), entry(0)]));
        assert!(!may_clear(&armed, &[entry(6)]));
        // Nothing to clear, or a load nobody armed (its programs filter nothing).
        assert!(!may_clear(
            &SockLbFilter {
                uncounted: 0,
                ..armed
            },
            &[]
        ));
        assert!(!may_clear(
            &SockLbFilter {
                generation: 0,
                uncounted: 1
            },
            &[]
        ));
    }
}
