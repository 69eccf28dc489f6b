//! A packet generator's front for `cargo xtask bench`'s throughput run, a BPF object of
//! its own (never loaded by the agent). `BPF_PROG_TEST_RUN` in live-frame mode
//! (`BPF_F_TEST_XDP_LIVE_FRAMES`) recycles its pages without restoring their bytes, so a
//! program that rewrites the packet (ours: DNAT, MACs) would see its own output on the
//! next run. This program writes the original headers back, then tail-calls the
//! contender in `NEXT[0]` (our `xdp_ingress`, or `xdp_pass` for the paths that work in the
//! stack): every contender pays the same restore.
//!
//! `tc_bench_gen` is the same front for classifiers (`NEXT_TC[0]`: `tc_ingress` or
//! `tc_pass`), for the per-packet benchmark's steady state: `BPF_PROG_TEST_RUN` with a
//! repeat count runs a program again and again on one packet, so each run must start from
//! the original bytes. With `STEP[0]` set, each run's source port is the next one (a new
//! flow each run); the TCP checksum is then stale, which nothing on the path checks.
#![no_std]
#![no_main]

use aya_ebpf::{
    EbpfContext as _,
    bindings::TC_ACT_SHOT,
    bindings::xdp_action::XDP_ABORTED,
    btf_maps::PerCpuArray,
    btf_maps::{Array, ProgramArray},
    helpers::{bpf_skb_store_bytes, bpf_xdp_store_bytes},
    macros::{btf_map, classifier, xdp},
    programs::{TcContext, XdpContext},
};

/// Bytes restored: Ethernet, IPv4 and TCP headers without options.
const HEADERS: usize = 54;

#[btf_map]
static FRAME: Array<[u8; HEADERS], 1> = Array::new();

#[btf_map]
static NEXT: ProgramArray<1> = ProgramArray::new();

/// The classifier's contender (a program array holds one program type).
#[btf_map]
static NEXT_TC: ProgramArray<1> = ProgramArray::new();

/// Non-zero: each run of `tc_bench_gen` takes the next source port.
#[btf_map]
static STEP: Array<u32, 1> = Array::new();

/// Runs so far on this CPU (the port offset).
#[btf_map]
static RUNS: PerCpuArray<u32, 1> = PerCpuArray::new();

/// The TCP source port's offset in `FRAME` (Ethernet 14 + IPv4 20).
const SPORT: usize = 34;

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

#[classifier]
pub fn tc_bench_gen(ctx: TcContext) -> i32 {
    let (Some(headers), Some(runs)) = (FRAME.get_ptr_mut(0), RUNS.get_ptr_mut(0)) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: map values of their declared types, this CPU's own for RUNS.
    let (headers, runs) = unsafe { (&mut *headers, &mut *runs) };
    if STEP.get(0).is_some_and(|s| *s != 0) {
        *runs = runs.wrapping_add(1);
        let port = 1024 + (*runs % 60_000) as u16;
        headers[SPORT..SPORT + 2].copy_from_slice(&port.to_be_bytes());
    }
    // SAFETY: the helper reads HEADERS bytes from a map value of that size.
    let rc = unsafe {
        bpf_skb_store_bytes(
            ctx.as_ptr() as *mut _,
            0,
            headers.as_ptr() as *const core::ffi::c_void,
            HEADERS as u32,
            0,
        )
    };
    if rc < 0 {
        return TC_ACT_SHOT;
    }
    // SAFETY: a tail call either jumps or returns; on return the slot is empty.
    unsafe { NEXT_TC.tail_call(&ctx, 0) };
    TC_ACT_SHOT
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
