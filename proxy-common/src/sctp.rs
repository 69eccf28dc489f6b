//! SCTP checksum work (`TC_TAIL`, `SCTP_PENDING`; `SCTP_ZEROS` holds
//! [`crate::crc32c::zeros`]).

/// `TC_TAIL` index of the program that finishes an SCTP packet's checksum.
pub const TAIL_SCTP_CRC: u32 = 0;

/// An SCTP packet's checksum work, left by the classifier for its tail call (per CPU).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SctpPending {
    /// Xor of the old and new first word (the ports), as loaded; 0 = nothing to do.
    pub delta: u32,
    /// The SCTP packet's length.
    pub len: u32,
    /// Offset of the checksum in the packet.
    pub sum_off: u32,
    /// The classifier's verdict, returned by the tail call.
    pub verdict: i32,
}
