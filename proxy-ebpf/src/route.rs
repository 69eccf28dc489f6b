//! Forwarding of translated packets whose source is one of the node's own addresses
//! (masqueraded flows, and replies from NodePorts): the stack would drop them as martians
//! (a forwarded packet claiming a local source), so they go straight out of the
//! interface the FIB picks, with the neighbour resolved by the kernel.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SKIP_NEIGH,
        bpf_fib_lookup,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect_neigh},
    programs::TcContext,
};
use proxy_common::FAMILY_V4;

use crate::{packet::ifindex, tc::Verdict};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// Packets "arriving" on loopback are the node's own or a `BPF_PROG_TEST_RUN`: the stack
/// handles those.
const LOOPBACK_IFINDEX: u32 = 1;

/// Sends the packet (already rewritten to `src` -> `dst`) out of its route's interface;
/// falls back to the stack when there is no route.
#[inline(never)]
pub fn forward(ctx: &TcContext, family: u8, src: &[u32; 4], dst: &[u32; 4]) -> Verdict {
    let ingress = ifindex(ctx);
    if ingress == LOOPBACK_IFINDEX {
        return Verdict::Stack;
    }
    // SAFETY: a plain C struct; all-zero is a valid value.
    let mut p: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    p.ifindex = ingress;
    if family == FAMILY_V4 {
        p.family = AF_INET;
        p.__bindgen_anon_3.ipv4_src = src[0];
        p.__bindgen_anon_4.ipv4_dst = dst[0];
    } else {
        p.family = AF_INET6;
        p.__bindgen_anon_3.ipv6_src = *src;
        p.__bindgen_anon_4.ipv6_dst = *dst;
    }
    // SAFETY: `p` is a valid, correctly sized parameter block on our stack.
    let rc = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &mut p,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            BPF_FIB_LOOKUP_SKIP_NEIGH,
        )
    };
    if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) && rc != i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return Verdict::Stack;
    }
    // SAFETY: no memory arguments (the kernel resolves the neighbour itself).
    let r = unsafe { bpf_redirect_neigh(p.ifindex, core::ptr::null_mut(), 0, 0) };
    Verdict::Redirected(r as i32)
}
