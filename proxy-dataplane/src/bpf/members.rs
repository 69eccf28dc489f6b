//! `MEMBERS`: which backend ids are in which service entry's current set, and since when.
//!
//! The programs honour a session-affinity entry or an unconnected socket's backend only
//! while its (service, backend) pair is here and was already when the choice was made.
//! So a client is never pinned to an endpoint that left the Service (even one that still
//! serves another), and an id freed and later reused (by this agent or one restarted)
//! starts a new membership that no earlier choice matches.

use std::collections::HashSet;

use crate::error::{ErrorKind, Kind as _, Result};
use proxy_common::MemberKey;

use super::maps::MapSet;

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of the programs' `bpf_ktime_get_ns`.
pub fn now_ns() -> u64 {
    // SAFETY: a zeroed timespec is valid; clock_gettime only writes into it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// Adds the pairs of `service_id` with `ids` that `old_ids` lacks, as of now. Before a
/// flip, so a backend is a member before anyone can choose it. On failure, what was added
/// is removed again. Returns the ids added (for `undo`).
pub fn join(maps: &mut MapSet, service_id: u32, ids: &[u32], old_ids: &[u32]) -> Result<Vec<u32>> {
    let now = now_ns();
    let mut seen: HashSet<u32> = old_ids.iter().copied().collect();
    let mut added = Vec::new();
    for &backend_id in ids {
        if !seen.insert(backend_id) {
            continue;
        }
        let key = MemberKey {
            service_id,
            backend_id,
        };
        if let Err(e) = maps.put_member(&key, &now) {
            undo(maps, service_id, &added);
            return Err(crate::error::Error::caused(
                crate::error::ErrorKind::Map,
                "writing a service membership",
                e,
            ));
        }
        added.push(backend_id);
    }
    Ok(added)
}

/// Removes what `join` added, after a failed write.
pub fn undo(maps: &mut MapSet, service_id: u32, added: &[u32]) {
    for &backend_id in added {
        let _ = maps.members.remove(&MemberKey {
            service_id,
            backend_id,
        });
    }
}

/// Removes the pairs of `service_id` with the `old_ids` that `ids` lacks. After the flip.
pub fn leave(maps: &mut MapSet, service_id: u32, old_ids: &[u32], ids: &[u32]) -> Result<()> {
    let kept: HashSet<u32> = ids.iter().copied().collect();
    for &backend_id in old_ids.iter().filter(|id| !kept.contains(id)) {
        let key = MemberKey {
            service_id,
            backend_id,
        };
        if let Err(e) = maps.members.remove(&key)
            && !super::maps::is_absent(&e)
        {
            return Err(crate::error::Error::caused(
                crate::error::ErrorKind::Map,
                "removing a service membership",
                e,
            ));
        }
    }
    Ok(())
}

/// What an adopted set of maps needs so `MEMBERS` holds exactly the programmed pairs:
/// pairs to add (maps written by an agent without `MEMBERS`) and pairs to remove (an
/// agent that died between a flip and its cleanup).
#[derive(Debug, Default)]
pub struct Reconcile {
    add: Vec<MemberKey>,
    remove: Vec<MemberKey>,
}

impl Reconcile {
    /// Compares `programmed` with the map.
    pub fn plan(maps: &MapSet, programmed: &HashSet<MemberKey>) -> Result<Self> {
        let present: HashSet<MemberKey> = super::batch::read_all(&maps.members)
            .kind(ErrorKind::Map, "reading MEMBERS")?
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        Ok(Self {
            add: programmed.difference(&present).copied().collect(),
            remove: present.difference(programmed).copied().collect(),
        })
    }

    /// Writes the plan. Added pairs count from now: affinity entries of the agent before
    /// us are not trusted, as their ids may have been reused.
    pub fn apply(&mut self, maps: &mut MapSet) -> Result<()> {
        let now = now_ns();
        for key in &self.add {
            maps.members
                .insert(key, &now, 0)
                .kind(ErrorKind::Map, "writing an adopted service membership")?;
        }
        self.add.clear();
        for key in std::mem::take(&mut self.remove) {
            leave(maps, key.service_id, &[key.backend_id], &[])?;
        }
        Ok(())
    }
}
