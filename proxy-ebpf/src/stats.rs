//! What `ipvsadm -Ln --stats` shows, per backend under its frontend (`rev_nat_id`): new
//! connections, and packets and bytes each way. One per-CPU entry per pair, so a packet
//! counts with one lookup (the agent sums a frontend's pairs); an entry is made on its
//! first use, and the agent's collector folds it into its frontend's `backend_id` 0 once
//! the backend is gone, and removes it with its frontend.
//!
//! Layer 1. Owns: the `LB_STATS` accounting. May import: `maps`, `verdict`, `mem`.

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
    let key = StatsKey {
        rev_nat_id,
        backend_id,
    };
    let bytes = u64::from(len);
    // The counts go straight into the entry: a delta built first would be zeroed by
    // the compiler's byte-loop memset on every packet (see `mem`).
    if let Some(v) = LB_STATS.get_ptr_mut(&key) {
        // SAFETY: this CPU's own value; nothing else runs on this CPU meanwhile.
        let v = unsafe { &mut *v };
        v.conns += u64::from(new);
        if dir == IN {
            v.packets_in += packets;
            v.bytes_in += bytes;
        } else {
            v.packets_out += packets;
            v.bytes_out += bytes;
        }
        return;
    }
    // The first count: a full map loses it, never the packet.
    let mut slot = core::mem::MaybeUninit::uninit();
    let first: &mut LbStats = crate::mem::zeroed_in(&mut slot);
    first.conns = u64::from(new);
    if dir == IN {
        (first.packets_in, first.bytes_in) = (packets, bytes);
    } else {
        (first.packets_out, first.bytes_out) = (packets, bytes);
    }
    let _ = LB_STATS.insert(&key, first, 0);
}
