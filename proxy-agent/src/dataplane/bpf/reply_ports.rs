//! `REPLY_PORTS` filled from the flow tables. The programs mark a port before they write a
//! reply entry with it; a map made new beside flow tables an older agent's programs filled
//! (an upgrade) has none of their marks, and without them the replies of those live flows
//! would skip the reply probe and leave untranslated. So, before the classifier meets
//! their packets, every reply entry's source port is marked.
//!
//! Layer: the BPF dataplane's start. Owns: nothing but this one pass. May import: `maps`.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result};
use aya::maps::{Array, MapData};
use proxy_common::{CT_DIR_REPLY, REPLY_PORTS_PER_ENTRY, map_names, reply_port_slot};

use super::MapSet;

type Ports = Array<MapData, [u8; REPLY_PORTS_PER_ENTRY]>;

/// Marks the source port of every reply entry in both flow tables; returns how many
/// distinct ports were marked.
pub fn mark_from_flows(maps: &mut MapSet) -> Result<usize> {
    let mut ports = Vec::new();
    for table in [&maps.conntrack, &maps.conntrack_new] {
        // An entry deleted while the walk passes it (the collector, an LRU eviction) is
        // gone with its flow: nothing to mark.
        ports.extend(
            table
                .keys()
                .filter_map(Result::ok)
                .filter(|k| k.dir == CT_DIR_REPLY)
                .map(|k| k.sport),
        );
    }
    mark(&mut maps.reply_ports, ports)
}

/// Marks `ports` (network byte order), keeping the marks already there; returns how
/// many distinct ports were given.
pub fn mark(map: &mut Ports, ports: impl IntoIterator<Item = u16>) -> Result<usize> {
    let mut entries: BTreeMap<u32, [u8; REPLY_PORTS_PER_ENTRY]> = BTreeMap::new();
    let mut marked = 0;
    for port in ports {
        let (idx, byte) = reply_port_slot(port);
        let entry = match entries.entry(idx) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                let now = map
                    .get(&idx, 0)
                    .with_context(|| format!("reading {} {idx}", map_names::REPLY_PORTS))?;
                v.insert(now)
            }
        };
        if entry[byte] == 0 {
            entry[byte] = 1;
            marked += 1;
        }
    }
    for (idx, entry) in &entries {
        map.set(*idx, entry, 0)
            .with_context(|| format!("writing {} {idx}", map_names::REPLY_PORTS))?;
    }
    Ok(marked)
}

/// Whether `port` (network byte order) is marked.
pub fn marked(map: &Ports, port: u16) -> Result<bool> {
    let (idx, byte) = reply_port_slot(port);
    let entry = map
        .get(&idx, 0)
        .with_context(|| format!("reading {} {idx}", map_names::REPLY_PORTS))?;
    Ok(entry[byte] != 0)
}
