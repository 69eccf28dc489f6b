//! What `ipvsadm -Ln --stats` shows, per backend under its frontend (`rev_nat_id`): new
//! connections, and packets and bytes each way. One per-CPU entry per pair, so a packet
//! counts with one lookup (the agent sums a frontend's pairs); an entry is made on its
//! first use, and the agent's collector folds it into its frontend's `backend_id` 0 once
//! the backend is gone, and removes it with its frontend. An answered flow's packets
//! count in its own conntrack entries instead (`answered`: the entry is in hand, the
//! pair's lookup is spared on every packet), folded in here when the programs remove
//! the entry (`fold`).
//!
//! Layer 1. Owns: the `LB_STATS` accounting and the counts in answered flows' entries.
//! May import: `maps`, `verdict`, `mem`.

use core::intrinsics::{AtomicOrdering::Relaxed, atomic_xadd};

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map};
use proxy_common::{CT_DIR_FORWARD, CtValue, LbStats, StatsKey};

use crate::maps::LB_STATS;

/// Per-CPU room for a pair's first counts while they are built. (Not pinned: each load
/// has its own.)
#[btf_map]
static STATS_SCRATCH: PerCpuArray<LbStats, 1> = PerCpuArray::new();

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
    add(rev_nat_id, backend_id, dir, 1, u64::from(len), new);
}

/// Counts one packet of `len` bytes on an answered flow's entry `ct` (of the packet's
/// direction). Atomic: both directions, and one direction's packets on two CPUs, may
/// meet in one flow.
#[inline(always)]
pub fn answered(ct: *mut CtValue, len: u32) {
    // SAFETY: map memory, valid for this program run; both fields are 8-byte aligned
    // (`CtValue` is, and they sit at 56 and 64).
    // (The intrinsic: `AtomicU64::fetch_add` is not built for this target; an unused
    // result makes it one `lock xadd`.)
    unsafe {
        atomic_xadd::<u64, u64, { Relaxed }>(&raw mut (*ct).packets, 1);
        atomic_xadd::<u64, u64, { Relaxed }>(&raw mut (*ct).bytes, u64::from(len));
    }
}

/// Folds the counts of answered-flow entry `ct` (keyed in direction `dir`, a
/// `CT_DIR_*`) into its pair, as the entry is removed. (Inlined: a frame of its own
/// costs the deep chains a 32-byte step on the verifiers that round frames so.)
#[inline(always)]
pub fn fold(ct: *const CtValue, dir: u8) {
    // SAFETY: map memory, valid for this program run.
    let (rev_nat_id, backend_id, packets, bytes) = unsafe {
        (
            (*ct).rev_nat_id,
            (*ct).backend_id,
            (*ct).packets,
            (*ct).bytes,
        )
    };
    if rev_nat_id == 0 || packets == 0 {
        return;
    }
    let dir = if dir == CT_DIR_FORWARD { IN } else { OUT };
    add(rev_nat_id, backend_id, dir, packets, bytes, false);
}

/// A new connection the connect-time hooks scheduled (its packets never pass a
/// classifier of ours: the socket talks to the backend directly).
#[inline(never)]
pub fn connection(rev_nat_id: u32, backend_id: u32) {
    add(rev_nat_id, backend_id, IN, 0, 0, true);
}

#[inline(always)]
fn add(rev_nat_id: u32, backend_id: u32, dir: u8, packets: u64, bytes: u64, new: bool) {
    let key = StatsKey {
        rev_nat_id,
        backend_id,
    };
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
    // The first count: a full map loses it, never the packet. Built in this CPU's
    // scratch slot, not on the stack: `fold` runs at the bottom of the deepest call
    // chain (a masquerade port claim retiring a stale flow), under the 512-byte limit.
    let Some(first) = STATS_SCRATCH.get_ptr_mut(0) else {
        return; // unreachable: index 0 of a one-entry array
    };
    // SAFETY: this CPU's slot, used by one packet at a time.
    let first = unsafe { &mut *first };
    crate::mem::zero(first);
    first.conns = u64::from(new);
    if dir == IN {
        (first.packets_in, first.bytes_in) = (packets, bytes);
    } else {
        (first.packets_out, first.bytes_out) = (packets, bytes);
    }
    let _ = LB_STATS.insert(&key, first, 0);
}
