//! Address family tags and IP protocol numbers, as keys and values store them.

/// Address family tag stored in keys and values.
pub const FAMILY_V4: u8 = 4;
/// Address family tag stored in keys and values.
pub const FAMILY_V6: u8 = 6;

/// IP protocol numbers as they appear in the IP header.
pub const PROTO_TCP: u8 = 6;
/// IP protocol numbers as they appear in the IP header.
pub const PROTO_UDP: u8 = 17;
/// IP protocol numbers as they appear in the IP header.
pub const PROTO_SCTP: u8 = 132;
