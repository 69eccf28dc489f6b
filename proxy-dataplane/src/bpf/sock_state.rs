//! The connect-time path's per-socket state as the agent reads it: connected sockets'
//! bindings in `SOCK_CONNECTED`'s slots (most) and `SOCK_LB`'s entries (a socket whose
//! slot was taken; unconnected UDP sockets' `sent` bindings). ABI.md, "SOCK_CONNECTED,
//! SOCK_LB".

use std::collections::HashSet;

use crate::error::{ErrorKind, Kind as _, Result};
use proxy_common::{SockBinding, SockLb, map_names};

use super::{batch, maps::MapSet};

/// One read of both maps.
#[derive(Debug, Default)]
pub struct SockState {
    /// Taken slots: (cookie, binding).
    pub slots: Vec<(u64, SockBinding)>,
    /// `SOCK_LB`'s entries, by cookie.
    pub entries: Vec<(u64, SockLb)>,
}

impl SockState {
    pub fn read(maps: &MapSet) -> Result<Self> {
        let slots = batch::read_array(&maps.sock_connected)
            .kind_with(ErrorKind::Map, || {
                format!("reading {}", map_names::SOCK_CONNECTED)
            })?
            .into_iter()
            .filter(|(_, s)| s.cookie != 0)
            .map(|(_, s)| (s.cookie, s.binding))
            .collect();
        let entries = batch::read_all(&maps.sock_lb)
            .kind_with(ErrorKind::Map, || format!("reading {}", map_names::SOCK_LB))?;
        Ok(Self { slots, entries })
    }

    /// Every connected socket's binding, by cookie: its slot's, else its `SOCK_LB`
    /// entry's (a socket that connected again since its entry was made is in a slot now,
    /// and the slot is what the programs read first).
    pub fn connected(&self) -> impl Iterator<Item = (u64, &SockBinding)> {
        let slotted: HashSet<u64> = self.slots.iter().map(|(c, _)| *c).collect();
        let entries = self
            .entries
            .iter()
            .filter(move |(c, e)| e.connected.service_id != 0 && !slotted.contains(c))
            .map(|(c, e)| (*c, &e.connected));
        self.slots
            .iter()
            .filter(|(_, b)| b.service_id != 0)
            .map(|(c, b)| (*c, b))
            .chain(entries)
    }

    /// Live sockets the hooks remember something of (in a slot, an entry, or both).
    pub fn sockets(&self) -> usize {
        let mut cookies: HashSet<u64> = self.slots.iter().map(|(c, _)| *c).collect();
        cookies.extend(self.entries.iter().map(|(c, _)| *c));
        cookies.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(backend_id: u32) -> SockBinding {
        SockBinding {
            service_id: 1,
            backend_id,
            ..SockBinding::default()
        }
    }

    #[test]
    fn a_slot_wins_over_an_older_entry_of_the_same_socket() {
        let state = SockState {
            slots: vec![(7, binding(1)), (8, binding(2))],
            entries: vec![
                (
                    7,
                    SockLb {
                        connected: binding(9),
                        ..SockLb::default()
                    },
                ),
                (
                    9,
                    SockLb {
                        connected: binding(3),
                        ..SockLb::default()
                    },
                ),
                // Unconnected: `sent` bindings only.
                (10, SockLb::default()),
            ],
        };
        let mut got: Vec<(u64, u32)> = state.connected().map(|(c, b)| (c, b.backend_id)).collect();
        got.sort_unstable();
        assert_eq!(got, [(7, 1), (8, 2), (9, 3)]);
        assert_eq!(state.sockets(), 4);
    }
}
