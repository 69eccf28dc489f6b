//! Connect-time load balancing (cgroup sock_addr hooks): the socket is pointed at a
//! backend before the first packet exists, so no per-packet NAT is needed, and
//! replies and `getpeername` are translated back so applications only ever see the VIP.

use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use aya_log_ebpf::debug;
use proxy_common::{
    AFFINITY_BY_NETNS, FAMILY_V4, PROTO_SCTP, PROTO_TCP, PROTO_UDP, SockRevNatKey, SockRevNatValue,
    counter,
};

use crate::{
    lb::{self, Client, NoBackend},
    maps::{REV_NAT, SOCK_REV_NAT, count},
};

/// Let the call proceed.
const ALLOW: i32 = 1;
/// Fail the call (with EPERM, or the errno set by `bpf_set_retval`).
const DENY: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// connect4/6 (TCP and connected UDP) and sendmsg4/6 (unconnected UDP): translate a
/// frontend to a backend, or refuse when the service has no usable endpoints.
#[inline(always)]
pub fn translate_to_backend(ctx: &SockAddrContext, family: u8) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: `sa` is the kernel-provided context; these are plain field reads.
    let (raw_proto, port) = unsafe { ((*sa).protocol, (*sa).user_port as u16) };
    let proto = match raw_proto {
        6 => PROTO_TCP,
        17 => PROTO_UDP,
        // Kernels with SCTP run these hooks for its connect() too.
        132 => PROTO_SCTP,
        _ => return ALLOW,
    };
    let (addr, svc_family, mapped) = unmap(read_addr(ctx, family), family);
    // Sockets belong to pods or the node itself: internal traffic.
    let Some(svc) = lb::lookup_service(addr, port, proto, svc_family, true) else {
        return ALLOW;
    };
    count(counter::SVC_HIT);
    // The source address is not chosen yet at connect time: the client is its netns.
    // SAFETY: valid context pointer for this program type.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let client = Client {
        id: [netns as u32, (netns >> 32) as u32, 0, 0],
        kind: AFFINITY_BY_NETNS,
        family: svc_family,
    };
    match lb::select_backend(&svc, &client) {
        Ok((_, be)) => {
            // The socket sees the backend in the form it used for the frontend.
            write_addr(ctx, family, map(be.addr, mapped), be.port);
            // SAFETY: valid context pointer for this program type.
            let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
            // Keyed by the backend's own (unmapped) form: a mapped IPv6 socket's datagrams
            // go out through sendmsg4 but come back through recvmsg6.
            let key = SockRevNatKey {
                cookie,
                addr: be.addr,
                port: be.port,
                family: svc_family,
                _pad: [0; 5],
            };
            let value = SockRevNatValue {
                rev_nat_id: svc.rev_nat_id,
            };
            if SOCK_REV_NAT.insert(&key, &value, 0).is_err() {
                count(counter::SOCK_REV_NAT_FAILED);
            }
            ALLOW
        }
        Err(NoBackend::Reject) => {
            debug!(ctx, "service {} has no usable backends: refused", svc.id);
            // SAFETY: helper with no memory arguments.
            unsafe { bpf_set_retval(-ECONNREFUSED) };
            DENY
        }
        Err(NoBackend::Drop) => DENY,
    }
}

/// recvmsg4/6 and getpeername4/6: a backend address the socket was sent to on behalf of
/// a frontend is shown as that frontend. These hooks must always return ALLOW.
#[inline(always)]
pub fn translate_to_frontend(ctx: &SockAddrContext, family: u8) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: plain field read of the kernel-provided context.
    let port = unsafe { (*sa).user_port as u16 };
    // SAFETY: valid context pointer for this program type.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let (addr, key_family, mapped) = unmap(read_addr(ctx, family), family);
    let key = SockRevNatKey {
        cookie,
        addr,
        port,
        family: key_family,
        _pad: [0; 5],
    };
    // SAFETY: values are copied out at once.
    let Some(rn) = (unsafe { SOCK_REV_NAT.get(&key).copied() }) else {
        return ALLOW;
    };
    // SAFETY: as above.
    if let Some(frontend) = unsafe { REV_NAT.get(&rn.rev_nat_id).copied() } {
        write_addr(ctx, family, map(frontend.addr, mapped), frontend.port);
    }
    ALLOW
}

/// `::ffff:0:0/96` as the first three words of an IPv6 address (network order).
const V4_MAPPED: [u32; 3] = [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff])];

/// An IPv6 socket may name an IPv4 peer as `::ffff:a.b.c.d` (dual-stack applications —
/// the JVM, for one — do): such an address is looked up as the IPv4 address it carries.
/// Returns the address and family to look up, and whether it was mapped.
#[inline(always)]
fn unmap(addr: [u32; 4], family: u8) -> ([u32; 4], u8, bool) {
    if family != FAMILY_V4 && addr[0..3] == V4_MAPPED {
        ([addr[3], 0, 0, 0], FAMILY_V4, true)
    } else {
        (addr, family, false)
    }
}

/// The inverse of `unmap`: an IPv4 address as the mapped IPv6 socket names it.
#[inline(always)]
fn map(addr: [u32; 4], mapped: bool) -> [u32; 4] {
    if mapped {
        [V4_MAPPED[0], V4_MAPPED[1], V4_MAPPED[2], addr[0]]
    } else {
        addr
    }
}

#[inline(always)]
fn read_addr(ctx: &SockAddrContext, family: u8) -> [u32; 4] {
    let sa = ctx.sock_addr;
    // SAFETY: plain 4-byte field reads, as the verifier requires for this context.
    unsafe {
        if family == FAMILY_V4 {
            [(*sa).user_ip4, 0, 0, 0]
        } else {
            [
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ]
        }
    }
}

#[inline(always)]
fn write_addr(ctx: &SockAddrContext, family: u8, addr: [u32; 4], port: u16) {
    let sa = ctx.sock_addr;
    // SAFETY: 4-byte stores to writable context fields.
    unsafe {
        if family == FAMILY_V4 {
            (*sa).user_ip4 = addr[0];
        } else {
            (*sa).user_ip6[0] = addr[0];
            (*sa).user_ip6[1] = addr[1];
            (*sa).user_ip6[2] = addr[2];
            (*sa).user_ip6[3] = addr[3];
        }
        (*sa).user_port = u32::from(port);
    }
}
