//! Direct server return's IPv4 option: how the node a client sent to tells the backend's
//! node which frontend the flow is for (the packet's own destination is already the
//! backend). Eight bytes, right after the base header (`ihl` 5 → 7), on every packet of
//! the flow, so a backend node that lost its entries (an agent restart) learns the flow
//! again from the next packet.
//!
//! `[type, length, port (2, network order), address (4, network order)]`. The type is
//! "copied" (bit 7: every fragment carries it), class 0, number 26 — the value Cilium's
//! DSR uses, unassigned by IANA; Linux skips options it does not know, so a backend's
//! stack accepts the packet as it is.

/// The option's type byte.
pub const DSR_OPT_TYPE: u8 = 0x80 | 26;
/// The option's length, and the bytes it adds to each packet.
pub const DSR_OPT_LEN: u8 = 8;

/// The option's eight bytes for frontend `addr:port` (both in network byte order).
pub fn dsr_option(addr: u32, port: u16) -> [u8; 8] {
    let p = port.to_ne_bytes();
    let a = addr.to_ne_bytes();
    [
        DSR_OPT_TYPE,
        DSR_OPT_LEN,
        p[0],
        p[1],
        a[0],
        a[1],
        a[2],
        a[3],
    ]
}

/// The frontend in an option's eight bytes, if they are ours: `(addr, port)`, network
/// byte order.
pub fn parse_dsr_option(b: &[u8; 8]) -> Option<(u32, u16)> {
    if b[0] != DSR_OPT_TYPE || b[1] != DSR_OPT_LEN {
        return None;
    }
    Some((
        u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
        u16::from_ne_bytes([b[2], b[3]]),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_in_network_order() {
        let addr = u32::from_be_bytes([192, 168, 50, 10]).to_be();
        let port = 30080u16.to_be();
        let b = dsr_option(addr, port);
        assert_eq!(b, [0x9a, 8, 0x75, 0x80, 192, 168, 50, 10]);
        assert_eq!(parse_dsr_option(&b), Some((addr, port)));
        let mut other = b;
        other[0] = 0x94; // router alert
        assert_eq!(parse_dsr_option(&other), None);
    }
}
