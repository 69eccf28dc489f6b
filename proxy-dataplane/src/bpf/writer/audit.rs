//! The audit: the maps compared with the mirror a little at a time, between applies, so
//! the periodic check never holds a change back (a whole re-read of 100k Services' maps
//! took seconds, during which every change waited). Two halves per pass:
//!
//! - **the mirror's frontends**, a share per step: each one's service entry, slots,
//!   backends, Maglev chunks, reverse-NAT entry and weights looked up; a frontend whose
//!   entries differ (deleted or overwritten behind our back) is written again, as a new
//!   generation, from the mirror;
//! - **the maps' entries**, a batch per step (`batch::Walk`): service entries, slots,
//!   Maglev chunks, backends and reverse-NAT entries that no mirrored frontend owns are
//!   removed (a crashed write's leftovers, or someone else's).
//!
//! The mirror is the truth here: it is what the incremental applies wrote, and those are
//! tested against full applies (`tests/incremental_apply.rs`).

use std::collections::HashMap;

use crate::error::Result;
use proxy_common::{
    Backend, BackendSlot, BackendSlotKey, MaglevChunk, MemberKey, RevNatValue, SVC_F_WEIGHTED,
    ServiceKey, ServiceValue,
};

use super::{
    adopt::adopt_table,
    audit_pass::{AuditPass, Table},
    generation::Generation,
    mirror::{Extras, Mirror, Programmed},
};
use crate::bpf::{codec::rev_nat_of, maps::remove_ignoring_absent};
use aya::maps::IterableMap as _;

use crate::{
    AuditReport,
    bpf::{
        batch::{self, Walk},
        maps::MapSet,
    },
};

/// The most frontends one step compares: each costs a lookup per entry (two dozen
/// syscalls for ten endpoints), and a change that arrives meanwhile waits for the step.
/// Above 25,600 frontends a pass takes longer than the resync period, in proportion
/// (at 100k, about four periods for the frontends, then the walks of the maps), rather
/// than each step taking longer.
const MAX_FRONTENDS_PER_STEP: usize = 256;
/// The most map entries one step reads back (one batch read).
const MAX_ENTRIES_PER_STEP: usize = 8192;

impl Mirror {
    /// One step of the audit: about `fraction` of the frontends and of each map's
    /// entries. A new pass begins after the last one ended.
    pub fn audit_step(&mut self, maps: &mut MapSet, fraction: f64) -> Result<AuditReport> {
        let mut report = AuditReport::default();
        // Nothing left of the last pass (or none yet): a new one.
        if self.audit.frontends.is_empty() && self.audit.walks.is_empty() {
            self.audit = AuditPass {
                frontends: self.services.keys().copied().collect(),
                walks: vec![
                    Table::Services,
                    Table::Slots,
                    Table::Maglev,
                    Table::Backends,
                    Table::RevNat,
                ],
                walk: Walk::default(),
            };
        }
        let fraction = fraction.clamp(0.0, 1.0);
        let share = |total: usize| ((total as f64 * fraction).ceil() as usize).max(64);

        // The mirror's frontends.
        let n = share(self.services.len())
            .min(MAX_FRONTENDS_PER_STEP)
            .min(self.audit.frontends.len());
        let at = self.audit.frontends.len() - n;
        let batch: Vec<ServiceKey> = self.audit.frontends.drain(at..).collect();
        for key in batch {
            let Some(p) = self.services.get(&key) else {
                continue; // removed since the pass began
            };
            if !entries_match(maps, key, p, &self.backends) {
                tracing::warn!(frontend = ?key, "the maps lost or changed this frontend's entries; writing them again");
                self.rewrite(maps, key)?;
                report.repaired += 1;
            }
        }

        // The maps' entries: one batch of the current walk.
        if self.audit.frontends.is_empty()
            && let Some(&table) = self.audit.walks.first()
        {
            let max = share(self.table_size(table)).min(MAX_ENTRIES_PER_STEP) as u32;
            match self.sweep(maps, table, max) {
                Ok(n) => report.removed += n,
                Err(e)
                    if e.downcast_ref::<std::io::Error>()
                        .is_some_and(batch::unsupported) =>
                {
                    tracing::warn!(
                        "this kernel has no batch map reads: the audit checks the programmed frontends only"
                    );
                    self.audit.walks.clear();
                }
                Err(e) => return Err(e),
            }
            if self.audit.walk.done {
                self.audit.walks.remove(0);
                self.audit.walk = Walk::default();
            }
        }
        report.pass_done = self.audit.frontends.is_empty() && self.audit.walks.is_empty();
        Ok(report)
    }

    /// How many entries of `table` the mirror accounts for (what a step's share is of).
    fn table_size(&self, table: Table) -> usize {
        match table {
            Table::Services | Table::RevNat => self.services.len(),
            Table::Slots => self.live_slots as usize,
            Table::Maglev => self
                .services
                .values()
                .map(|p| super::generation::chunks(p.value.table_len) as usize)
                .sum(),
            Table::Backends => self.backends.len(),
        }
    }

    /// Removes the entries of one batch of `table` that no mirrored frontend owns.
    fn sweep(&mut self, maps: &mut MapSet, table: Table, max: u32) -> Result<usize> {
        // The live generation of each service entry id.
        let live = |state: &Self| -> HashMap<u32, ServiceValue> {
            state
                .services
                .values()
                .map(|p| (p.value.id, p.value))
                .collect()
        };
        let mut removed = 0;
        match table {
            Table::Services => {
                let batch = self
                    .audit
                    .walk
                    .next::<ServiceKey, ServiceValue>(maps.services.map(), max)?;
                for (k, _) in batch {
                    if !self.services.contains_key(&k) {
                        remove_ignoring_absent(maps.services.remove(&k))?;
                        removed += 1;
                    }
                }
            }
            Table::Slots | Table::Maglev => {
                let live = live(self);
                let owned = |k: &BackendSlotKey, maglev: bool| {
                    live.get(&k.service_id).is_some_and(|v| {
                        v.rev == k.rev
                            && if maglev {
                                k.slot < super::generation::chunks(v.table_len)
                            } else {
                                k.slot < u32::from(v.count)
                            }
                    })
                };
                if let Table::Slots = table {
                    let batch = self
                        .audit
                        .walk
                        .next::<BackendSlotKey, BackendSlot>(maps.slots.map(), max)?;
                    for (k, _) in batch.iter().filter(|(k, _)| !owned(k, false)) {
                        remove_ignoring_absent(maps.slots.remove(k))?;
                        removed += 1;
                    }
                } else {
                    let batch = self
                        .audit
                        .walk
                        .next::<BackendSlotKey, MaglevChunk>(maps.maglev.map(), max)?;
                    for (k, _) in batch.iter().filter(|(k, _)| !owned(k, true)) {
                        remove_ignoring_absent(maps.maglev.remove(k))?;
                        removed += 1;
                    }
                }
            }
            Table::Backends => {
                let batch = self
                    .audit
                    .walk
                    .next::<u32, Backend>(maps.backends.map(), max)?;
                for (id, _) in batch {
                    if !self.backends.contains(id) {
                        remove_ignoring_absent(maps.backends.remove(&id))?;
                        removed += 1;
                    }
                }
            }
            Table::RevNat => {
                let ids: std::collections::HashSet<u32> =
                    self.services.values().map(|p| p.value.rev_nat_id).collect();
                let batch = self
                    .audit
                    .walk
                    .next::<u32, RevNatValue>(maps.rev_nat.map(), max)?;
                for (id, _) in batch {
                    if !ids.contains(&id) {
                        remove_ignoring_absent(maps.rev_nat.remove(&id))?;
                        removed += 1;
                    }
                }
            }
        }
        Ok(removed)
    }

    /// Writes frontend `key` again from the mirror, as a new generation, with its
    /// backends first.
    fn rewrite(&mut self, maps: &mut MapSet, key: ServiceKey) -> Result<()> {
        let Some(p) = self.services.get(&key).cloned() else {
            return Ok(());
        };
        for id in &p.backend_ids {
            if let Some(be) = self.backends.get(*id) {
                maps.backends.insert(id, be, 0).map_err(|e| {
                    crate::error::Error::caused(
                        crate::error::ErrorKind::Map,
                        "writing a backend again",
                        e,
                    )
                })?;
            }
        }
        // As if no source range were written: all of them are written again.
        let old = Programmed {
            extras: Extras::of(p.table().to_vec(), p.weights().to_vec(), Vec::new()),
            ..p.clone()
        };
        self.write_generation(
            maps,
            key,
            Some(&old),
            Generation {
                id: p.value.id,
                backend_ids: p.backend_ids.to_vec(),
                flags: p.value.flags,
                timeout: p.value.affinity_timeout_s,
                count: p.value.count,
                scheduler: p.value.scheduler,
                weights: p.weights().to_vec(),
                table: p.table().to_vec(),
            },
            p.ranges(),
        )?;
        // What the caller of a write fills in.
        if let Some(now) = self.services.get_mut(&key) {
            now.endpoints = p.endpoints;
            now.complete = p.complete;
            now.schedule = p.schedule;
        }
        Ok(())
    }
}

/// Whether the maps hold frontend `key` as the mirror says.
fn entries_match(
    maps: &MapSet,
    key: ServiceKey,
    p: &Programmed,
    backends: &super::backend_table::BackendTable,
) -> bool {
    let Ok(value) = maps.services.get(&key, 0) else {
        return false;
    };
    if value != p.value {
        return false;
    }
    for (slot, id) in p.backend_ids.iter().enumerate() {
        let slot_key = BackendSlotKey {
            service_id: value.id,
            rev: value.rev,
            slot: slot as u32,
        };
        if maps.slots.get(&slot_key, 0).ok().map(|s| s.backend_id) != Some(*id) {
            return false;
        }
    }
    let mut seen = std::collections::HashSet::new();
    for id in p.backend_ids.iter().filter(|id| seen.insert(**id)) {
        if maps.backends.get(id, 0).ok() != backends.get(*id).copied() {
            return false;
        }
    }
    if !p.table().is_empty() && adopt_table(|k| maps.maglev.get(k, 0).ok(), &value) != p.table() {
        return false;
    }
    if maps.rev_nat.get(&value.rev_nat_id, 0).ok() != Some(rev_nat_of(&key)) {
        return false;
    }
    if value.flags & SVC_F_WEIGHTED != 0 {
        for (backend_id, weight) in p.weights() {
            let k = MemberKey {
                service_id: value.id,
                backend_id: *backend_id,
            };
            if maps.weights.get(&k, 0).ok() != Some(*weight) {
                return false;
            }
        }
    }
    true
}
