//! A packet generator's front for `cargo xtask bench`'s throughput run, a BPF object of
//! its own (never loaded by the agent). `BPF_PROG_TEST_RUN` in live-frame mode
//! (`BPF_F_TEST_XDP_LIVE_FRAMES`) recycles its pages without restoring their bytes, so a
//! program that rewrites the packet (ours: DNAT, MACs) would see its own output on the
//! next run. This program writes the original headers back, then tail-calls the
//! contender in `NEXT[0]` (our `xdp_ingress`, or `xdp_pass` for the paths that work in the
//! stack): every contender pays the same restore.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::xdp_action::XDP_ABORTED,
    btf_maps::{Array, ProgramArray},
    helpers::bpf_xdp_store_bytes,
    macros::{btf_map, xdp},
    programs::XdpContext,
};

/// Bytes restored: Ethernet, IPv4 and TCP headers without options.
const HEADERS: usize = 54;

#[btf_map]
static FRAME: Array<[u8; HEADERS], 1> = Array::new();

#[btf_map]
static NEXT: ProgramArray<1> = ProgramArray::new();

#[xdp]
pub fn xdp_bench_gen(ctx: XdpContext) -> u32 {
    let Some(headers) = FRAME.get(0) else {
        return XDP_ABORTED;
    };
    // SAFETY: the helper reads HEADERS bytes from a map value of that size.
    let rc = unsafe {
        bpf_xdp_store_bytes(
            ctx.ctx,
            0,
            headers.as_ptr() as *mut core::ffi::c_void,
            HEADERS as u32,
        )
    };
    if rc < 0 {
        return XDP_ABORTED;
    }
    // SAFETY: a tail call either jumps or returns; on return the slot is empty.
    unsafe { NEXT.tail_call(&ctx, 0) };
    XDP_ABORTED
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
