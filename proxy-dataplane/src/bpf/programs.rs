//! The embedded BPF object: its programs' names, and loading it (with private maps for
//! tests and `trace`; the agent's own load, with pins, is `BpfDataplane::start`).

use crate::error::{ErrorKind, Kind as _, Result};
use aya::{Ebpf, EbpfLoader, programs::SchedClassifier};
use proxy_common::map_names;

use super::{kernel::Kernel, maps::MapSet};

/// The BPF object built from `proxy-ebpf`, embedded so one binary is all a node needs.
pub static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

/// The cgroup sock_addr programs, by name (the name is also the attach point).
pub const CGROUP_PROGRAMS: [&str; 8] = [
    "connect4",
    "connect6",
    "sendmsg4",
    "sendmsg6",
    "recvmsg4",
    "recvmsg6",
    "getpeername4",
    "getpeername6",
];
/// The cgroup sock program that forgets released sockets (`SOCK_LB`), attached beside
/// them.
pub const SOCK_RELEASE_PROGRAM: &str = "sock_release";
/// The per-packet classifier.
pub const TC_PROGRAM: &str = "tc_ingress";
/// Its egress half on the same interfaces: replies and ICMP errors the node itself sends
/// about translated flows (endpoints on the node's own addresses).
pub const TC_EGRESS_PROGRAM: &str = "tc_egress";
/// Its tail call for SCTP checksums.
pub const TC_SCTP_PROGRAM: &str = "tc_sctp_crc";

/// The programs' switches for helpers an older kernel lacks (see `kernel`): a switch off
/// makes the call dead code the verifier removes unchecked.
const SET_RETVAL_GLOBAL: &str = "SET_RETVAL";
const COARSE_CLOCK_GLOBAL: &str = "COARSE_CLOCK";

/// Sets the programs' switches as `kernel` found it.
pub(super) fn set_switches(loader: &mut EbpfLoader, kernel: &Kernel) {
    for (name, on) in [
        (SET_RETVAL_GLOBAL, kernel.set_retval),
        (COARSE_CLOCK_GLOBAL, kernel.coarse_clock),
    ] {
        // The loader holds the value until it loads: a static one.
        let value: &'static u8 = if on { &1 } else { &0 };
        loader.override_global(name, value, true);
    }
}

/// Loads the object with private, unpinned maps and nothing attached: for tests and for
/// tracing packets without touching the live maps. `max_entries` overrides capacities by
/// map name (to exercise full maps).
pub fn load_private(max_entries: &[(&str, u32)]) -> Result<(Ebpf, MapSet)> {
    load_private_on(&Kernel::probed_helpers(), max_entries)
}

/// `load_private` with the programs' switches as `kernel` says, not as probed: tests
/// run the fallbacks of an older kernel's helpers here.
pub fn load_private_on(kernel: &Kernel, max_entries: &[(&str, u32)]) -> Result<(Ebpf, MapSet)> {
    let mut loader = EbpfLoader::new();
    for (name, size) in max_entries {
        loader.map_max_entries(name, *size);
    }
    set_switches(&mut loader, kernel);
    let mut ebpf = loader
        .load(BPF_OBJECT)
        .kind(ErrorKind::Load, "loading the BPF object")?;
    prepare_sctp(&mut ebpf)?;
    let maps = MapSet::take(&mut ebpf)?;
    Ok((ebpf, maps))
}

/// Readies the SCTP checksum tail call before any program can run: the CRC32c shift
/// table, and `tc_sctp_crc` in `TC_TAIL`.
pub(super) fn prepare_sctp(ebpf: &mut Ebpf) -> Result<()> {
    let map = ebpf
        .map_mut(map_names::SCTP_ZEROS)
        .kind(ErrorKind::Load, "the BPF object has no SCTP_ZEROS map")?;
    let mut table: aya::maps::Array<_, u32> = aya::maps::Array::try_from(map)
        .kind(ErrorKind::Load, "SCTP_ZEROS is not an array of u32")?;
    let x8 = proxy_common::crc32c::zeros(1);
    let mut z = proxy_common::crc32c::zeros(0);
    for len in 0..proxy_common::crc32c::TABLE_LEN {
        table
            .set(len, &z, 0)
            .kind_with(ErrorKind::Load, || format!("filling SCTP_ZEROS[{len}]"))?;
        z = proxy_common::crc32c::mul(x8, z);
    }
    let prog: &mut SchedClassifier = ebpf
        .program_mut(TC_SCTP_PROGRAM)
        .kind(ErrorKind::Load, "the BPF object has no tc_sctp_crc program")?
        .try_into()?;
    prog.load().kind(ErrorKind::Load, "loading tc_sctp_crc")?;
    let fd = prog.fd()?.try_clone()?;
    let map = ebpf
        .map_mut(map_names::TC_TAIL)
        .kind(ErrorKind::Load, "the BPF object has no TC_TAIL map")?;
    let mut tail = aya::maps::ProgramArray::try_from(map).kind(ErrorKind::Load, "TC_TAIL")?;
    tail.set(proxy_common::TAIL_SCTP_CRC, &fd, 0)
        .kind(ErrorKind::Load, "installing the SCTP checksum tail call")?;
    Ok(())
}
