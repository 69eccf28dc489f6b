//! Adoption: the mirror rebuilt from what the maps hold, so a restarted agent writes only
//! what changed while it was away.

use std::{collections::HashMap, net::SocketAddr};

use crate::error::Result;
use proxy_common::{
    BackendSlotKey, FAMILY_V4, FAMILY_V6, LPM_TAG_BITS, MaglevChunk, MemberKey, SVC_F_WEIGHTED,
    ServiceValue,
};

use super::{
    generation::{chunk_key, chunks},
    mirror::{Extras, Mirror, Programmed},
};
use crate::bpf::{batch, maps::MapSet, members};
use proxy_model::{EndpointSet, schedule::Schedule};

impl Mirror {
    /// Rebuilds the mirror from what the maps hold (entries another agent wrote).
    pub fn adopt(maps: &MapSet) -> Result<Self> {
        let mut state = Mirror {
            next_service_id: 1,
            next_backend_id: 1,
            ..Default::default()
        };
        // Whole maps in a few batch reads, then joined in memory.
        let slots: HashMap<BackendSlotKey, u32> = batch::read_all(&maps.slots)?
            .into_iter()
            .map(|(k, s)| (k, s.backend_id))
            .collect();
        let maglev: HashMap<BackendSlotKey, MaglevChunk> =
            batch::read_all(&maps.maglev)?.into_iter().collect();
        let mut weights: HashMap<u32, Vec<(u32, u32)>> = HashMap::new();
        for (k, w) in batch::read_all(&maps.weights)? {
            weights
                .entry(k.service_id)
                .or_default()
                .push((k.backend_id, w));
        }
        for (id, be) in batch::read_all(&maps.backends)? {
            state.backends.insert(id, be);
            // Swept at the next apply unless a frontend turns out to use it.
            state.maybe_unused.insert(id);
            state.next_backend_id = state.next_backend_id.max(id.wrapping_add(1));
        }
        let mut ranges_by_id = source_ranges(maps)?;
        for (key, value) in batch::read_all(&maps.services)? {
            let backend_ids = slot_ids(&slots, &value);
            let table = adopt_table(|k| maglev.get(k).copied(), &value);
            state.next_service_id = state.next_service_id.max(value.id.wrapping_add(1));
            state.used_service_ids.insert(value.id);
            state.hold(&backend_ids);
            let ranges = ranges_by_id.remove(&value.id).unwrap_or_default();
            let mut weights = if value.flags & SVC_F_WEIGHTED != 0 {
                weights.remove(&value.id).unwrap_or_default()
            } else {
                Vec::new()
            };
            weights.sort_unstable();
            let endpoints: Vec<SocketAddr> = backend_ids
                .iter()
                .filter_map(|id| state.backends.get(*id))
                .map(|be| proxy_common::addr::socket_addr(be.addr, be.family, be.port))
                .collect();
            // Complete only as a write would leave it: every slot resolved, each endpoint
            // once, in order (a repeating or reordered layout compares by ids instead).
            let resolved = endpoints.len() == backend_ids.len();
            let (endpoints, complete) = match EndpointSet::from_sorted(endpoints) {
                Some(set) => (set, resolved),
                None => (EndpointSet::default(), false),
            };
            state.services.insert(
                key,
                Programmed {
                    value,
                    complete,
                    backend_ids: backend_ids.into(),
                    endpoints,
                    schedule: Schedule {
                        scheduler: crate::bpf::codec::scheduler_of_code(value.scheduler)
                            .unwrap_or_default(),
                        ..Default::default()
                    },
                    extras: Extras::of(table, weights, ranges),
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
        state.dsr = super::dsr_permits::DsrPermits::adopt(maps)?;
        Ok(state)
    }
}

/// Each frontend's source ranges (`SOURCE_RANGES`), by its service id.
fn source_ranges(maps: &MapSet) -> Result<HashMap<u32, Vec<ipnet::IpNet>>> {
    let mut ranges_by_id: HashMap<u32, Vec<ipnet::IpNet>> = HashMap::new();
    for key in maps.source_ranges.keys() {
        let key = key?;
        let data = key.data();
        let (family, bits) = if data.addr[1..] == [0, 0, 0] && key.prefix_len() <= LPM_TAG_BITS + 32
        {
            (FAMILY_V4, key.prefix_len() - LPM_TAG_BITS)
        } else {
            (FAMILY_V6, key.prefix_len() - LPM_TAG_BITS)
        };
        if let Ok(net) = ipnet::IpNet::new(
            proxy_common::addr::from_words(data.addr, family),
            bits as u8,
        ) {
            ranges_by_id.entry(data.tag).or_default().push(net);
        }
    }
    Ok(ranges_by_id)
}

/// The backend ids of a service entry's slots, in order; empty for a torn set (an agent
/// that died mid-write), which the next apply rewrites.
fn slot_ids(slots: &HashMap<BackendSlotKey, u32>, value: &ServiceValue) -> Vec<u32> {
    let mut backend_ids = Vec::with_capacity(usize::from(value.count));
    for slot in 0..u32::from(value.count) {
        let slot_key = BackendSlotKey {
            service_id: value.id,
            rev: value.rev,
            slot,
        };
        match slots.get(&slot_key) {
            Some(&id) => backend_ids.push(id),
            // A torn set (agent died mid-write) is rewritten on the next apply.
            None => {
                backend_ids.clear();
                break;
            }
        }
    }
    backend_ids
}

/// Reads an adopted entry's Maglev table; empty when it has none or a chunk is missing
/// (a torn write: rewritten on the next apply).
pub(super) fn adopt_table(
    chunk_of: impl Fn(&BackendSlotKey) -> Option<MaglevChunk>,
    value: &ServiceValue,
) -> Vec<u16> {
    let mut table = Vec::with_capacity(usize::from(value.table_len));
    for chunk in 0..chunks(value.table_len) {
        match chunk_of(&chunk_key(value, chunk)) {
            Some(c) => table.extend_from_slice(&c.slots),
            None => return Vec::new(),
        }
    }
    table.truncate(usize::from(value.table_len));
    table
}
