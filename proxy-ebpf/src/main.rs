//! BPF programs of the service proxy. Entry points are thin: the work lives in `lb`
//! (service lookup, backend choice), `sock` (connect-time path) and `pipeline` (the
//! per-packet path of both TC and XDP, with `frame`, `packet`, `conntrack`, `nat`, `icmp`,
//! `reject` and `route`).
//!
//! The modules are layered by concept, as Cilium's `bpf/lib`: a module may import
//! (`use crate::x`, or a `crate::x::` path) only modules of a lower layer, never one of
//! its own layer or above, so no module imports one that calls it.
//!
//! - layer 0: `verdict` (verdict codes), `maps` (the pinned maps, `count`), `frame` (the
//!   packet at either hook, TC or XDP, and checksum arithmetic), `mem` (zeroing);
//! - layer 1: `packet` (parsing, fragments), `stats` (per-frontend and per-backend
//!   statistics), `drop` (the one drop exit: a reason, counted);
//! - layer 2: `node` (the node's addresses, the local-traffic detector);
//! - layer 3: `conntrack` (flows, tuple claims, masquerade ports), `lb` (services,
//!   backends), `reject` (refusals), `route` (FIB lookup, redirect);
//! - layer 4: `nat` (rewrites, masquerade decision, SCTP checksum), `icmp` (ICMP errors),
//!   `dsr` (direct server return's option);
//! - layer 5: `pipeline` (per-packet pipeline, TC and XDP), `sock` (connect-time
//!   pipeline);
//! - layer 6: `main` (the programs, entry points only).
//!
//! A map each load makes afresh (not pinned) is declared beside the one module that uses
//! it; the pinned ones are all in `maps`.
#![no_std]
#![no_main]
// Atomic adds on map values: the BPF target has no `fetch_add` in `core::sync::atomic`
// (no compare-and-swap), but LLVM lowers an unused atomic add to BPF's `lock xadd`.
#![feature(core_intrinsics)]
#![allow(
    internal_features,
    reason = "core_intrinsics: the atomic add, as said above"
)]

mod conntrack;
mod drop;
mod dsr;
mod frame;
mod icmp;
mod lb;
mod maps;
mod mem;
mod nat;
mod node;
mod packet;
mod pipeline;
mod reject;
mod route;
mod sock;
mod stats;
mod verdict;

use aya_ebpf::{
    macros::{cgroup_sock, cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, SockContext, TcContext, XdpContext},
};
use proxy_common::{FAMILY_V4, FAMILY_V6};

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    sock::translate_to_backend(&ctx, FAMILY_V4, sock::Hook::Connect)
}

#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    sock::translate_to_backend(&ctx, FAMILY_V6, sock::Hook::Connect)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate_to_backend(&ctx, FAMILY_V4, sock::Hook::Sendmsg)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::translate_to_backend(&ctx, FAMILY_V6, sock::Hook::Sendmsg)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate_to_frontend(&ctx, FAMILY_V4)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::translate_to_frontend(&ctx, FAMILY_V6)
}

#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    sock::translate_to_frontend(&ctx, FAMILY_V4)
}

#[cgroup_sock_addr(getpeername6)]
pub fn getpeername6(ctx: SockAddrContext) -> i32 {
    sock::translate_to_frontend(&ctx, FAMILY_V6)
}

/// A socket of the hooked cgroup is closed: forget what the hooks did for it.
#[cgroup_sock(sock_release)]
pub fn sock_release(ctx: SockContext) -> i32 {
    sock::forget(&ctx)
}

#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    pipeline::ingress(&ctx)
}

/// The same interfaces' egress: replies and ICMP errors the node itself sends about
/// translated flows (endpoints on the node's own addresses).
#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    pipeline::egress(&ctx)
}

/// Tail call of `tc_ingress` for SCTP packets whose ports it rewrote: their CRC32c.
#[classifier]
pub fn tc_sctp_crc(ctx: TcContext) -> i32 {
    nat::sctp_checksum(&ctx)
}

/// Does nothing but pass the packet on: the baseline `cargo xtask bench` measures the
/// classifier against.
#[classifier]
pub fn tc_pass(_ctx: TcContext) -> i32 {
    aya_ebpf::bindings::TC_ACT_OK as i32
}

/// The node's external interfaces, at the driver: NodePorts, externalIPs, load-balancer
/// IPs (and ClusterIPs from outside) translated and forwarded before an skb exists;
/// everything else passes to the stack and `tc_ingress` unchanged.
#[xdp]
pub fn xdp_ingress(ctx: XdpContext) -> u32 {
    pipeline::xdp(&ctx)
}

/// Does nothing but pass the packet on: the baseline `cargo xtask bench` measures the XDP
/// program against.
#[xdp]
pub fn xdp_pass(_ctx: XdpContext) -> u32 {
    aya_ebpf::bindings::xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
