//! Direct server return's IPv4 option and IPv6 header: how the node a client sent to
//! tells the backend's node which frontend the flow is for (the packet's own destination
//! is already the backend). It rides on every packet of the flow, right after the base
//! header, so a backend node that lost its entries (an agent restart) learns the flow
//! again from the next packet.
//!
//! IPv4: eight bytes (`ihl` 5 → 7), `[type, length, port (2, network order), address (4,
//! network order)]`. The type is "copied" (bit 7: every fragment carries it), class 0,
//! number 26 — the value Cilium's DSR uses, unassigned by IANA; Linux skips options it
//! does not know, so a backend's stack accepts the packet as it is.

// IPv4.

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

// IPv6: a Destination Options header right after the base header, holding one option.
// `[next header, length 2 (24 bytes), type, 20, address (16), port (2), 0, 0]`. The type's
// top bits are 00 ("skip if unknown", RFC 8200 4.2) and its change bit 0: a backend's
// stack that does not know it goes on with the packet. 0x1B is the value Cilium's DSR
// uses, unassigned by IANA. Only a first-hop header of exactly this shape is ours.

/// IPv6's next-header value of a Destination Options header.
pub const IPPROTO_DSTOPTS: u8 = 60;
/// The option's type byte.
pub const DSR_OPT6_TYPE: u8 = 0x1b;
/// The option's data length (address, port, two zero bytes).
const DSR_OPT6_DATA: u8 = 20;
/// The header's length: the bytes it adds to each packet.
pub const DSR_HDR6_LEN: u8 = 24;

/// The header's first word (`next`, its length, the option's type and length), as it
/// lies in the packet.
fn dsr_header6_first(next: u8) -> u32 {
    u32::from_ne_bytes([next, DSR_HDR6_LEN / 8 - 1, DSR_OPT6_TYPE, DSR_OPT6_DATA])
}

/// The header's last word: the port (network byte order) and two zero bytes.
fn dsr_header6_last(port: u16) -> u32 {
    let p = port.to_ne_bytes();
    u32::from_ne_bytes([p[0], p[1], 0, 0])
}

/// The 24-byte header's six words for frontend `addr:port` (network byte order), ahead
/// of a payload of protocol `next`: the first, the address's four, the last.
pub fn dsr_header6(next: u8, addr: [u32; 4], port: u16) -> [u32; 6] {
    [
        dsr_header6_first(next),
        addr[0],
        addr[1],
        addr[2],
        addr[3],
        dsr_header6_last(port),
    ]
}

/// Whether a header's first word is ours (whatever its next header).
pub fn is_dsr_header6(first: u32) -> bool {
    first.to_ne_bytes()[1..] == dsr_header6_first(0).to_ne_bytes()[1..]
}

/// The payload's protocol and the frontend in a header's six words, if they are ours:
/// `(next, addr, port)`, network byte order.
pub fn parse_dsr_header6(w: &[u32; 6]) -> Option<(u8, [u32; 4], u16)> {
    if !is_dsr_header6(w[0]) {
        return None;
    }
    let p = w[5].to_ne_bytes();
    Some((
        w[0].to_ne_bytes()[0],
        [w[1], w[2], w[3], w[4]],
        u16::from_ne_bytes([p[0], p[1]]),
    ))
}

/// `DSR_PERMITS`' key: what a backend's node accepts an option (or header) for — a
/// frontend of a Service in `dsr` mode, with one of that Service's backends. The agent
/// writes one per (DSR frontend, backend); the classifier learns a flow from an option
/// only when the packet's own destination and the frontend it names make a key here.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DsrPermitKey {
    /// The frontend's address; all zero for a NodePort, whose address is the entry
    /// node's own (`DSR_ANY_NODE`).
    pub frontend: [u32; 4],
    /// The backend's address (the packet's destination).
    pub backend: [u32; 4],
    /// Network byte order, both.
    pub frontend_port: u16,
    pub backend_port: u16,
    pub proto: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}

/// `DsrPermitKey::frontend` of a NodePort: any node's address (the backend's node does
/// not know the others').
pub const DSR_ANY_NODE: [u32; 4] = [0; 4];

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

    #[test]
    fn the_ipv6_header_round_trips_in_network_order() {
        let addr: [u32; 4] = {
            let o = "fd00:50::10"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets();
            core::array::from_fn(|i| {
                u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
            })
        };
        let port = 30091u16.to_be();
        let w = dsr_header6(6, addr, port);
        let b: Vec<u8> = w.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(&b[..4], &[6, 2, 0x1b, 20]);
        assert_eq!(&b[4..6], &[0xfd, 0x00]);
        assert_eq!(&b[20..], &[0x75, 0x8b, 0, 0]);
        // Eight-byte units, as RFC 8200 counts them: 2 + 20 + 2.
        assert_eq!(usize::from(b[1] + 1) * 8, b.len());
        assert_eq!(parse_dsr_header6(&w), Some((6, addr, port)));
        let mut other = w;
        other[0] = u32::from_ne_bytes([6, 2, 0x1e, 20]); // someone else's experiment
        assert_eq!(parse_dsr_header6(&other), None);
    }
}
