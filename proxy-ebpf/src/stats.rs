//! What `ipvsadm -Ln --stats` shows, per backend under its frontend (`rev_nat_id`): new
//! connections, and packets and bytes each way. One per-CPU entry per pair, so a packet
//! counts with one lookup (the agent sums a frontend's pairs); an entry is made on its
//! first use, and the agent's collector folds it into its frontend's `backend_id` 0 once
//! the backend is gone, and removes it with its frontend.
//!
//! Layer 1. Owns: the `LB_STATS` accounting. May import: `maps`, `verdict`.

use proxy_common::{LbStats, StatsKey};

use crate::maps::LB_STATS;

/// Client to backend.
pub const IN: u8 = 0;
/// Backend to client.
pub const OUT: u8 = 1;

/// Counts one packet of `len` bytes going `dir` (`IN`/`OUT`) on a flow of frontend
/// `rev_nat_id` and backend `backend_id`; `new`: the flow's first (a new connection).
#[inline(never)]
pub fn account(rev_nat_id: u32, backend_id: u32, dir: u8, len: u32, new: bool) {
    // No frontend known here (direct server return's flows at the backend's node: the
    // node the client sent to counts them).
    if rev_nat_id == 0 {
        return;
    }
    add(rev_nat_id, backend_id, dir, 1, len, new);
}

/// A new connection the connect-time hooks scheduled (its packets never pass a
/// classifier of ours: the socket talks to the backend directly).
#[inline(never)]
pub fn connection(rev_nat_id: u32, backend_id: u32) {
    add(rev_nat_id, backend_id, IN, 0, 0, true);
}

#[inline(always)]
fn add(rev_nat_id: u32, backend_id: u32, dir: u8, packets: u64, len: u32, new: bool) {
    let mut delta = LbStats {
        conns: u64::from(new),
        ..LbStats::default()
    };
    if dir == IN {
        (delta.packets_in, delta.bytes_in) = (packets, u64::from(len));
    } else {
        (delta.packets_out, delta.bytes_out) = (packets, u64::from(len));
    }
    let key = StatsKey {
        rev_nat_id,
        backend_id,
    };
    match LB_STATS.get_ptr_mut(&key) {
        // SAFETY: this CPU's own value; nothing else runs on this CPU meanwhile.
        Some(v) => unsafe {
            (*v).conns += delta.conns;
            (*v).packets_in += delta.packets_in;
            (*v).bytes_in += delta.bytes_in;
            (*v).packets_out += delta.packets_out;
            (*v).bytes_out += delta.bytes_out;
        },
        // The first count: a full map loses it, never the packet.
        None => {
            let _ = LB_STATS.insert(&key, &delta, 0);
        }
    }
}
