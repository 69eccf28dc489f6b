//! Service and backend ids: allocation, reference counts, and which backends may go.

use std::collections::HashSet;

use crate::error::Result;
use proxy_common::Backend;

use super::mirror::Mirror;
use crate::bpf::maps::MapSet;

impl Mirror {
    pub(super) fn ensure_backend(&mut self, maps: &mut MapSet, be: Backend) -> Result<u32> {
        if let Some(id) = self.backends.id_of(&be) {
            return Ok(id);
        }
        let backends = &self.backends;
        let id = next_free_by(&mut self.next_backend_id, |id| backends.contains(id));
        maps.put_backend(&id, &be).map_err(|e| {
            crate::error::Error::caused(crate::error::ErrorKind::Map, "writing backend", e)
        })?;
        self.backends.insert(id, be);
        // Unused until a frontend write that references it succeeds.
        self.maybe_unused.insert(id);
        Ok(id)
    }

    pub(super) fn hold(&mut self, ids: &[u32]) {
        self.live_slots += ids.len() as u64;
        for id in ids {
            self.backends.hold(*id);
        }
    }

    pub(super) fn release(&mut self, ids: &[u32]) {
        self.live_slots = self.live_slots.saturating_sub(ids.len() as u64);
        for id in ids {
            if self.backends.release(*id) {
                self.maybe_unused.insert(*id);
            }
        }
    }

    pub(super) fn allocate_service_id(&mut self) -> u32 {
        let id = next_free(&mut self.next_service_id, &self.used_service_ids);
        self.used_service_ids.insert(id);
        id
    }
}

/// The next id from `next` that is neither 0 nor in use; advances `next` past it.
pub(super) fn next_free(next: &mut u32, used: &HashSet<u32>) -> u32 {
    next_free_by(next, |id| used.contains(&id))
}

pub(super) fn next_free_by(next: &mut u32, in_use: impl Fn(u32) -> bool) -> u32 {
    let mut id = (*next).max(1);
    while id == 0 || in_use(id) {
        id = id.wrapping_add(1);
    }
    *next = id.wrapping_add(1);
    id
}
