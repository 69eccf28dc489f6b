//! The port filters' marks for tables filled before them. A filter made new beside pinned
//! tables an older agent filled (an upgrade) has none of their marks: without them the
//! replies of live flows, and the packets of flows to a frontend since removed, would pass
//! untranslated. So, before the classifier meets their packets, `mark_from_tables` marks
//! every port those tables use.

use aya::maps::MapError;
use proxy_common::{CT_DIR_FORWARD, CT_DIR_REPLY, CtKey};

use super::{maps::MapSet, port_filters::mark};

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
