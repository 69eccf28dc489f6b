//! Generations of a service entry: a new slot set (and Maglev table, in chunks) written
//! beside the live one, then the flip of slot 0 to it, then the old one removed — a lookup
//! never sees half a set.

use std::collections::HashSet;

use crate::error::{Error, ErrorKind, Kind as _, Result};
use proxy_common::{
    BackendSlot, BackendSlotKey, MAGLEV_CHUNK, MaglevChunk, MemberKey, SVC_F_WEIGHTED, ServiceKey,
    ServiceValue,
};

use super::mirror::{Extras, Mirror, Programmed};
use crate::bpf::{codec::range_key, maps::remove_ignoring_absent};
use crate::bpf::{maps::MapSet, members};
use proxy_model::{EndpointSet, schedule::Schedule};

impl Mirror {
    /// Writes a new generation of `key`'s slots, its reverse-NAT entry and the flip.
    pub(super) fn write_generation(
        &mut self,
        maps: &mut MapSet,
        key: ServiceKey,
        old: Option<&Programmed>,
        generation: Generation,
        ranges: &[ipnet::IpNet],
    ) -> Result<()> {
        let id = generation.id;
        let backend_ids = generation.backend_ids;
        let table = generation.table;
        let weights = generation.weights;
        let table_len = u16::try_from(table.len()).map_err(|_| {
            Error::new(
                ErrorKind::Map,
                format!("a Maglev table of {} entries", table.len()),
            )
        })?;
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
            maps.put_weight(&key, weight)
                .kind(ErrorKind::Map, "writing a backend weight")?;
        }
        let old_ids: &[u32] = old.map_or(&[], |o| &o.backend_ids);
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
            // The entry's own count: a torn adopted set lost some of its ids, not its slots.
            remove_generation(maps, &old.value, usize::from(old.value.count))?;
            for net in old.ranges().iter().filter(|n| !ranges.contains(n)) {
                remove_ignoring_absent(maps.source_ranges.remove(&range_key(id, net)))?;
            }
            members::leave(maps, id, &old.backend_ids, &backend_ids)?;
        }
        // A staged frontend (never flipped) served nothing: no flow or socket used it.
        let was_live = !self.unflipped.contains(&key);
        if maps.withhold_services {
            self.unflipped.insert(key);
        } else {
            self.unflipped.remove(&key);
        }
        if let Some(old) = old
            && was_live
        {
            self.note_left(key, old, &backend_ids);
        }
        self.hold(&backend_ids);
        if let Some(old) = self.services.insert(
            key,
            Programmed {
                value,
                backend_ids: backend_ids.into(),
                extras: Extras::of(table, weights, ranges.to_vec()),
                endpoints: EndpointSet::default(), // filled by the caller, which has them
                complete: false,
                schedule: Schedule::default(),
                seen: self.epoch,
            },
        ) {
            self.release(&old.backend_ids);
        }
        Ok(())
    }
}

/// One generation of a service entry, as `write_generation` writes it.
pub(super) struct Generation {
    pub(super) id: u32,
    /// In slot order.
    pub(super) backend_ids: Vec<u32>,
    pub(super) flags: u16,
    pub(super) timeout: u32,
    pub(super) count: u16,
    pub(super) scheduler: u8,
    /// (backend id, weight), for `SVC_F_WEIGHTED` entries.
    pub(super) weights: Vec<(u32, u32)>,
    /// `sh`/`mh`: the Maglev table, as slots.
    pub(super) table: Vec<u16>,
}

/// The `MAGLEV` key of chunk `chunk` of service entry `value`'s table.
pub(super) fn chunk_key(value: &ServiceValue, chunk: u32) -> BackendSlotKey {
    BackendSlotKey {
        service_id: value.id,
        rev: value.rev,
        slot: chunk,
    }
}

pub(super) fn chunks(table_len: u16) -> u32 {
    u32::from(table_len).div_ceil(MAGLEV_CHUNK)
}

/// Writes `table` as `value`'s generation of its Maglev table.
pub(super) fn write_table(maps: &mut MapSet, value: &ServiceValue, table: &[u16]) -> Result<()> {
    for (i, entries) in table.chunks(MAGLEV_CHUNK as usize).enumerate() {
        let mut chunk = MaglevChunk::default();
        chunk.slots[..entries.len()].copy_from_slice(entries);
        maps.put_chunk(&chunk_key(value, i as u32), &chunk)
            .map_err(|e| {
                crate::error::Error::caused(
                    crate::error::ErrorKind::Map,
                    "writing a Maglev table",
                    e,
                )
            })?;
    }
    Ok(())
}

/// Removes the first `slots` backend slots of `value`'s generation.
pub(super) fn remove_slots(maps: &mut MapSet, value: &ServiceValue, slots: usize) -> Result<()> {
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
pub(super) fn remove_generation(
    maps: &mut MapSet,
    value: &ServiceValue,
    slots: usize,
) -> Result<()> {
    remove_slots(maps, value, slots)?;
    remove_table(maps, value)
}

/// Removes `value`'s generation of its Maglev table, if it has one.
pub(super) fn remove_table(maps: &mut MapSet, value: &ServiceValue) -> Result<()> {
    for chunk in 0..chunks(value.table_len) {
        remove_ignoring_absent(maps.maglev.remove(&chunk_key(value, chunk)))?;
    }
    Ok(())
}

/// Removes service entry `service_id`'s weights of `backend_ids` (repeats allowed).
pub(super) fn forget_weights<'a>(
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

/// Writes a new generation's slots, its reverse-NAT entry and source ranges, then flips
/// the service entry to it.
pub(super) fn flip(
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
        if let Err(e) = maps.put_slot(
            &slot_key,
            &BackendSlot {
                backend_id: *backend_id,
            },
        ) {
            let _ = remove_slots(maps, value, slot);
            return Err(crate::error::Error::caused(
                crate::error::ErrorKind::Map,
                "writing backend slots",
                e,
            ));
        }
    }
    if let Err(e) = write_table(maps, value, table) {
        let _ = remove_generation(maps, value, backend_ids.len());
        return Err(e);
    }
    maps.put_rev_nat(&id, &crate::bpf::codec::rev_nat_of(&key))
        .map_err(|e| {
            crate::error::Error::caused(
                crate::error::ErrorKind::Map,
                "writing reverse-NAT entry",
                e,
            )
        })?;
    let old_ranges: &[ipnet::IpNet] = old.map_or(&[], |o| o.ranges());
    for net in ranges.iter().filter(|n| !old_ranges.contains(n)) {
        maps.source_ranges
            .insert(&range_key(id, net), &1, 0)
            .map_err(|e| {
                crate::error::Error::caused(
                    crate::error::ErrorKind::Map,
                    "writing a source range",
                    e,
                )
            })?;
    }
    // The flip: one update makes the new set visible.
    maps.put_service(&key, value).map_err(|e| {
        crate::error::Error::caused(crate::error::ErrorKind::Map, "writing service entry", e)
    })?;
    Ok(())
}
