//! Forwarding of translated packets whose source is one of the node's own addresses
//! (masqueraded flows, and replies from NodePorts): the stack would drop them as martians
//! (a forwarded packet claiming a local source), so they go straight out of the
//! interface the FIB picks, with the neighbour resolved by the kernel. Since they skip
//! the stack's forwarding, they also skip its MTU check: `lookup` makes it (the FIB
//! knows the egress MTU), and a packet too big is answered with "fragmentation needed"
//! or "packet too big" instead of vanishing (no PMTU black hole).
//!
//! Layer 3. Owns: the FIB lookup with its MTU check, and the redirect out of an interface.
//! May import: layers 0-2 (`maps`, `verdict`, `packet`, `stats`, `node`).

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        __sk_buff, BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH,
        BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SKIP_NEIGH, bpf_fib_lookup,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect_neigh},
    programs::TcContext,
};
use proxy_common::{FAMILY_V4, PROTO_TCP};

use crate::{
    packet::{ETH_HLEN, Packet, ifindex},
    verdict::Verdict,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// Packets "arriving" on loopback are the node's own or a `BPF_PROG_TEST_RUN`: the stack
/// handles those.
const LOOPBACK_IFINDEX: u32 = 1;
/// IPv4's don't-fragment bit (in the flags/offset word, host order).
const IP_DF: u16 = 0x4000;

/// Sends the packet (already rewritten to `src` -> `dst`) out of its route's interface;
/// falls back to the stack when there is no route. No MTU check: for packets that cannot
/// be answered with an error (ICMP errors themselves).
#[inline(never)]
pub fn forward(ctx: &TcContext, family: u8, src: &[u32; 4], dst: &[u32; 4]) -> Verdict {
    redirect(fib(ctx, family, src, dst, 0))
}

/// Where the packet `pkt` goes once rewritten to `src` -> `dst`: an interface (> 0), the
/// stack (0), or — too big for that interface, and not to be fragmented — minus the
/// MTU. A scalar: a BPF function returns one register. Call before rewriting, so an
/// error can quote the packet as its sender knows it.
#[inline(never)]
pub fn lookup(ctx: &TcContext, pkt: &Packet, src: &[u32; 4], dst: &[u32; 4]) -> i64 {
    // The headers each segment of an offloaded (GSO) packet carries.
    let mut headers = (pkt.l4_off - ETH_HLEN) as u32;
    if pkt.proto == PROTO_TCP {
        let Ok(doff) = ctx.load::<u8>(pkt.l4_off + 12) else {
            return 0;
        };
        headers += u32::from(doff >> 4) * 4;
    } else {
        headers += 8;
    }
    let hop = fib(ctx, pkt.family, src, dst, headers);
    if hop < 0 && pkt.family == FAMILY_V4 {
        // IPv4 without DF may be fragmented: the stack's business (as before).
        match ctx.load::<u16>(ETH_HLEN + 6) {
            Ok(frag) if u16::from_be(frag) & IP_DF != 0 => {}
            _ => return 0,
        }
    }
    hop
}

/// Sends the packet out of interface `hop` (from `lookup`), or on to the stack (0).
#[inline(always)]
pub fn redirect(hop: i64) -> Verdict {
    if hop <= 0 {
        return Verdict::Stack;
    }
    // SAFETY: no memory arguments (the kernel resolves the neighbour itself).
    let r = unsafe { bpf_redirect_neigh(hop as u32, core::ptr::null_mut(), 0, 0) };
    Verdict::Redirected(r as i32)
}

/// The FIB's answer for `src` -> `dst` (see `lookup`); `headers` > 0 checks the MTU, with
/// the per-segment headers of a GSO packet (the FIB helper lets every GSO packet pass).
#[inline(always)]
fn fib(ctx: &TcContext, family: u8, src: &[u32; 4], dst: &[u32; 4], headers: u32) -> i64 {
    let ingress = ifindex(ctx);
    if ingress == LOOPBACK_IFINDEX {
        return 0;
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
    // With `tot_len` left zero the helper checks the skb against the egress device's
    // MTU and reports that MTU in `mtu_result`.
    // SAFETY: `p` is a valid, correctly sized parameter block on our stack.
    let mut rc = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &mut p,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            BPF_FIB_LOOKUP_SKIP_NEIGH,
        )
    };
    if rc < 0 {
        // Kernels before 6.3 refuse SKIP_NEIGH (-EINVAL, before touching `p`): ask again
        // with the neighbour lookup, whose NO_NEIGH answer is accepted below as well.
        // SAFETY: as above.
        rc = unsafe {
            fib_lookup(
                ctx.as_ptr(),
                &mut p,
                core::mem::size_of::<bpf_fib_lookup>() as i32,
                0,
            )
        };
    }
    // SAFETY: the helper wrote the union's `mtu_result` (zero when it did not).
    let mtu = u32::from(unsafe { p.__bindgen_anon_1.mtu_result });
    if rc == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED) {
        return if headers > 0 && mtu > 0 {
            -i64::from(mtu)
        } else {
            0
        };
    }
    if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) && rc != i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return 0;
    }
    if headers > 0 && mtu > 0 {
        // SAFETY: the context is a valid __sk_buff; gso_size is a plain readable field.
        let gso = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).gso_size };
        if gso != 0 && gso + headers > mtu {
            return -i64::from(mtu);
        }
    }
    i64::from(p.ifindex)
}
