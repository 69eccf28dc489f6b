//! The port filters, `REPLY_PORTS` and `FRONTEND_PORTS`: a byte per port, set before any
//! entry that needs it is written and never cleared, so the classifier skips the reply
//! probe for a packet from an unmarked port and passes a packet to an unmarked port at
//! once. The programs mark reply ports, the agent frontend ports (`MapSet::put_service`).
//!
//! Layer: the BPF dataplane's maps (a leaf). Owns: reading and writing the filters'
//! bytes (`port_backfill` marks what pinned tables already use).

use std::collections::{BTreeMap, btree_map::Entry};

use aya::maps::{Array, MapData, MapError};
use proxy_common::{PORTS_PER_ENTRY, port_slot};

pub type PortFilter = Array<MapData, [u8; PORTS_PER_ENTRY]>;

/// Marks `ports` (network byte order), keeping the marks already there; returns how
/// many were not marked before.
pub fn mark(map: &mut PortFilter, ports: impl IntoIterator<Item = u16>) -> Result<usize, MapError> {
    let mut entries: BTreeMap<u32, [u8; PORTS_PER_ENTRY]> = BTreeMap::new();
    let mut marked = 0;
    for port in ports {
        let (idx, byte) = port_slot(port);
        let entry = match entries.entry(idx) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => v.insert(map.get(&idx, 0)?),
        };
        if entry[byte] == 0 {
            entry[byte] = 1;
            marked += 1;
        }
    }
    for (idx, entry) in &entries {
        map.set(*idx, entry, 0)?;
    }
    Ok(marked)
}

/// Whether `port` (network byte order) is marked.
pub fn marked(map: &PortFilter, port: u16) -> Result<bool, MapError> {
    let (idx, byte) = port_slot(port);
    Ok(map.get(&idx, 0)?[byte] != 0)
}
