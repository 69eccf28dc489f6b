//! The port filters, `REPLY_PORTS` and `FRONTEND_PORTS`: a byte per port, set before any
//! entry that needs it is written and never cleared, so the classifier skips the reply
//! probe for a packet from an unmarked port and passes a packet to an unmarked port at
//! once. The programs mark reply ports, the agent frontend ports (`MapSet::put_service`).
//!
//! A filter made new beside pinned tables an older agent filled (an upgrade) has none of
//! their marks: without them the replies of live flows, and the packets of flows to a
//! frontend since removed, would pass untranslated. So, before the classifier meets their
//! packets, `mark_from_tables` marks every port those tables use.
//!
//! Layer: the BPF dataplane's maps. Owns: reading and writing the filters' bytes. May
//! import: `maps`.

use std::collections::{BTreeMap, btree_map::Entry};

use aya::maps::{Array, MapData, MapError};
use proxy_common::{CT_DIR_FORWARD, CT_DIR_REPLY, CtKey, PORTS_PER_ENTRY, port_slot};

use super::MapSet;

pub type PortFilter = Array<MapData, [u8; PORTS_PER_ENTRY]>;

/// Which filters were made new at this start.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fresh {
    pub reply_ports: bool,
    pub frontend_ports: bool,
}

/// Marks, in each filter made new, every port the tables already use: reply entries'
/// source ports; service entries' ports and forward entries' destination ports (a flow
/// outlives its frontend). Returns the ports marked (reply, frontend).
pub fn mark_from_tables(maps: &mut MapSet, fresh: Fresh) -> Result<(usize, usize), MapError> {
    // Both tables walked once, and only when a filter is new. An entry deleted while the
    // walk passes it (the collector, an LRU eviction) is gone with its flow: nothing to
    // mark.
    let keys: Vec<CtKey> = if fresh.reply_ports || fresh.frontend_ports {
        [&maps.conntrack, &maps.conntrack_new]
            .into_iter()
            .flat_map(|table| table.keys().filter_map(Result::ok))
            .collect()
    } else {
        Vec::new()
    };
    let mut marked = (0, 0);
    if fresh.reply_ports {
        let ports = keys
            .iter()
            .filter(|k| k.dir == CT_DIR_REPLY)
            .map(|k| k.sport);
        marked.0 = mark(&mut maps.reply_ports, ports)?;
    }
    if fresh.frontend_ports {
        let mut ports: Vec<u16> = keys
            .iter()
            .filter(|k| k.dir == CT_DIR_FORWARD)
            .map(|k| k.dport)
            .collect();
        ports.extend(maps.services.keys().filter_map(Result::ok).map(|k| k.port));
        marked.1 = mark(&mut maps.frontend_ports, ports)?;
    }
    Ok(marked)
}

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
