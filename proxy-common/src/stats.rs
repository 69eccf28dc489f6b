//! The statistics: what the programs count per frontend and backend pair (`LB_STATS`),
//! as `ipvsadm -Ln --stats` shows it. (The reasons' counters are `counter`.)

/// `LB_STATS`' key: a backend under a frontend, as `ipvsadm -Ln --stats` shows a real
/// server under its virtual service. One entry per pair, so a packet counts with one
/// lookup; a frontend's totals are its pairs' sums. `backend_id` 0 (never a backend's)
/// holds what the collector folded in from the frontend's removed backends.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StatsKey {
    pub rev_nat_id: u32,
    pub backend_id: u32,
}

/// `StatsKey::rev_nat_id`'s top bit: an [`StatsKey::ended`] entry (frontend ids are
/// far below it).
pub const STATS_ENDED: u32 = 1 << 31;

impl StatsKey {
    /// A frontend's counts of backends no longer programmed.
    pub const fn retired(rev_nat_id: u32) -> Self {
        StatsKey {
            rev_nat_id,
            backend_id: 0,
        }
    }

    /// The pair's counts of answered flows the agent removed (the collector's expired
    /// flows, a removed UDP backend's): written by the agent alone, so its
    /// read-modify-write races with no program. Summed with the pair's own entry.
    pub const fn ended(rev_nat_id: u32, backend_id: u32) -> Self {
        StatsKey {
            rev_nat_id: rev_nat_id | STATS_ENDED,
            backend_id,
        }
    }

    /// The pair an entry counts for (an `ended` entry's, too).
    pub const fn pair(self) -> Self {
        StatsKey {
            rev_nat_id: self.rev_nat_id & !STATS_ENDED,
            backend_id: self.backend_id,
        }
    }
}

/// Connections, packets and bytes of one `StatsKey`. Per CPU; the agent sums.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbStats {
    /// New connections (flows) scheduled.
    pub conns: u64,
    /// Client to backend.
    pub packets_in: u64,
    pub bytes_in: u64,
    /// Backend to client.
    pub packets_out: u64,
    pub bytes_out: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    /// Sizes are part of the ABI: a change here must be a deliberate, versioned change.
    #[test]
    fn layout_is_stable() {
        assert_eq!(size_of::<LbStats>(), 40);
    }
}
