//! The map ABI shared by the BPF programs (`proxy-ebpf`) and the agent (`proxy-agent`).
//!
//! Every key and value is `#[repr(C)]` with explicit padding fields, so both sides agree
//! byte for byte and the kernel never sees uninitialised padding in a key. Addresses are
//! stored as four 32-bit words in network byte order; an IPv4 address uses word 0 and
//! leaves the rest zero. Ports are in network byte order too, as the packet carries them.
//! `ABI.md` beside this crate describes each map; [`MAPS`] names each with its capacity.
#![cfg_attr(not(test), no_std)]

#[cfg(feature = "user")]
pub mod addr;
pub mod counter;
pub mod crc32c;
pub mod sched;

mod ip;

mod affinity;
mod backend;
mod conntrack;
mod dsr;
mod frag;
mod maps;
mod node;
mod sctp;
mod service;
mod sock;
mod stats;

pub use affinity::*;
pub use backend::*;
pub use conntrack::*;
pub use dsr::*;
pub use frag::*;
pub use ip::*;
pub use maps::{MAPS, MapSpec, capacity, map_names};
pub use node::*;
pub use sched::sched_hash;
pub use sctp::*;
pub use service::*;
pub use sock::*;
pub use stats::*;

#[cfg(feature = "user")]
mod user {
    use super::*;

    macro_rules! pod {
        ($($t:ty),* $(,)?) => {$(
            // SAFETY: the type derives bytemuck::Pod, which proves at compile time that it
            // is #[repr(C)] with integer fields and no implicit padding.
            unsafe impl aya::Pod for $t {}
        )*};
    }
    pod!(
        ServiceKey,
        ServiceValue,
        BackendSlotKey,
        BackendSlot,
        Backend,
        AffinityKey,
        AffinityValue,
        RevNatValue,
        SockBinding,
        SockLb,
        SockLbFilter,
        SockSlot,
        MemberKey,
        CtKey,
        CtValue,
        NodeConfig,
        CtTimeouts,
        LpmData,
        FragKey,
        FragPorts,
        LbStats,
        StatsKey,
        MaglevChunk,
        DsrPermitKey,
    );
}
