//! Direct server return's IPv4 option and IPv6 header: how the node a client sent to
//! tells the backend's node which frontend the flow is for (the packet's own destination
//! is already the backend), and which node it is (the packet's source is the client's).
//! It rides on every packet of the flow, right after the base header, so a backend node
//! that lost its entries (an agent restart) learns the flow again from the next packet.
//!
//! IPv4: twelve bytes (`ihl` 5 → 8), `[type, length, port (2), frontend (4), entry node
//! (4)]`, all in network order. The type is "copied" (bit 7: every fragment carries it),
//! class 0, number 26 — the value Cilium's DSR uses, unassigned by IANA; Linux skips
//! options it does not know, so a backend's stack accepts the packet as it is. (Cilium's
//! option is eight bytes, without the entry node: the lengths tell them apart.)

// IPv4.

/// The option's type byte.
pub const DSR_OPT_TYPE: u8 = 0x80 | 26;
/// The option's length, and the bytes it adds to each packet.
pub const DSR_OPT_LEN: u8 = 12;

/// The frontend and the entry node an option or header names, network byte order (an
/// IPv4 address in word 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DsrNamed {
    pub frontend: [u32; 4],
    pub port: u16,
    /// The address of the node the client sent to (`NodeConfig::snat_v4`/`_v6` there).
    pub entry: [u32; 4],
}

/// The option's twelve bytes for frontend `addr:port`, sent through node `entry` (all in
/// network byte order).
pub fn dsr_option(addr: u32, port: u16, entry: u32) -> [u8; 12] {
    let p = port.to_ne_bytes();
    let a = addr.to_ne_bytes();
    let e = entry.to_ne_bytes();
    [
        DSR_OPT_TYPE,
        DSR_OPT_LEN,
        p[0],
        p[1],
        a[0],
        a[1],
        a[2],
        a[3],
        e[0],
        e[1],
        e[2],
        e[3],
    ]
}

/// What an option's twelve bytes name, if they are ours.
pub fn parse_dsr_option(b: &[u8; 12]) -> Option<DsrNamed> {
    if b[0] != DSR_OPT_TYPE || b[1] != DSR_OPT_LEN {
        return None;
    }
    Some(DsrNamed {
        frontend: [u32::from_ne_bytes([b[4], b[5], b[6], b[7]]), 0, 0, 0],
        port: u16::from_ne_bytes([b[2], b[3]]),
        entry: [u32::from_ne_bytes([b[8], b[9], b[10], b[11]]), 0, 0, 0],
    })
}

// IPv6: a Destination Options header right after the base header, holding one option.
// `[next header, length 4 (40 bytes), type, 36, frontend (16), entry node (16), port (2),
// 0, 0]`. The type's top bits are 00 ("skip if unknown", RFC 8200 4.2) and its change bit
// 0: a backend's stack that does not know it goes on with the packet. 0x1B is the value
// Cilium's DSR uses, unassigned by IANA. Only a first-hop header of exactly this shape is
// ours.

/// IPv6's next-header value of a Destination Options header.
pub const IPPROTO_DSTOPTS: u8 = 60;
/// The option's type byte.
pub const DSR_OPT6_TYPE: u8 = 0x1b;
/// The option's data length (two addresses, port, two zero bytes).
const DSR_OPT6_DATA: u8 = 36;
/// The header's length: the bytes it adds to each packet.
pub const DSR_HDR6_LEN: u8 = 40;
/// The header's 32-bit words.
pub const DSR_HDR6_WORDS: usize = DSR_HDR6_LEN as usize / 4;

/// The header's first word (`next`, its length, the option's type and length), as it
/// lies in the packet.
pub fn dsr_header6_first(next: u8) -> u32 {
    u32::from_ne_bytes([next, DSR_HDR6_LEN / 8 - 1, DSR_OPT6_TYPE, DSR_OPT6_DATA])
}

/// The header's last word: the port (network byte order) and two zero bytes.
pub fn dsr_header6_last(port: u16) -> u32 {
    let p = port.to_ne_bytes();
    u32::from_ne_bytes([p[0], p[1], 0, 0])
}

/// The 40-byte header's ten words for frontend `addr:port`, sent through node `entry`
/// (network byte order), ahead of a payload of protocol `next`: the first, the
/// frontend's four, the entry node's four, the last.
pub fn dsr_header6(next: u8, addr: [u32; 4], port: u16, entry: [u32; 4]) -> [u32; DSR_HDR6_WORDS] {
    [
        dsr_header6_first(next),
        addr[0],
        addr[1],
        addr[2],
        addr[3],
        entry[0],
        entry[1],
        entry[2],
        entry[3],
        dsr_header6_last(port),
    ]
}

/// Whether a header's first word is ours (whatever its next header).
pub fn is_dsr_header6(first: u32) -> bool {
    first.to_ne_bytes()[1..] == dsr_header6_first(0).to_ne_bytes()[1..]
}

/// The payload's protocol and what a header's ten words name, if they are ours.
pub fn parse_dsr_header6(w: &[u32; DSR_HDR6_WORDS]) -> Option<(u8, DsrNamed)> {
    if !is_dsr_header6(w[0]) {
        return None;
    }
    let p = w[9].to_ne_bytes();
    Some((
        w[0].to_ne_bytes()[0],
        DsrNamed {
            frontend: [w[1], w[2], w[3], w[4]],
            port: u16::from_ne_bytes([p[0], p[1]]),
            entry: [w[5], w[6], w[7], w[8]],
        },
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

    fn v4(a: [u8; 4]) -> u32 {
        u32::from_ne_bytes(a)
    }

    #[test]
    fn round_trips_in_network_order() {
        let addr = v4([192, 168, 50, 10]);
        let entry = v4([192, 168, 50, 11]);
        let port = 30080u16.to_be();
        let b = dsr_option(addr, port, entry);
        assert_eq!(
            b,
            [0x9a, 12, 0x75, 0x80, 192, 168, 50, 10, 192, 168, 50, 11]
        );
        assert_eq!(
            parse_dsr_option(&b),
            Some(DsrNamed {
                frontend: [addr, 0, 0, 0],
                port,
                entry: [entry, 0, 0, 0]
            })
        );
        let mut other = b;
        other[0] = 0x94; // router alert
        assert_eq!(parse_dsr_option(&other), None);
        let mut cilium = b;
        cilium[1] = 8; // Cilium's option: no entry node
        assert_eq!(parse_dsr_option(&cilium), None);
    }

    #[test]
    fn the_ipv6_header_round_trips_in_network_order() {
        let words = |s: &str| -> [u32; 4] {
            let o = s.parse::<std::net::Ipv6Addr>().unwrap().octets();
            core::array::from_fn(|i| {
                u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
            })
        };
        let (addr, entry) = (words("fd00:50::10"), words("fd00:50::11"));
        let port = 30091u16.to_be();
        let w = dsr_header6(6, addr, port, entry);
        let b: Vec<u8> = w.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(&b[..4], &[6, 4, 0x1b, 36]);
        assert_eq!(&b[4..6], &[0xfd, 0x00]);
        assert_eq!(&b[20..22], &[0xfd, 0x00]);
        assert_eq!(b[35], 0x11);
        assert_eq!(&b[36..], &[0x75, 0x8b, 0, 0]);
        // Eight-byte units, as RFC 8200 counts them: 2 + 36 + 2.
        assert_eq!(usize::from(b[1] + 1) * 8, b.len());
        assert_eq!(
            parse_dsr_header6(&w),
            Some((
                6,
                DsrNamed {
                    frontend: addr,
                    port,
                    entry
                }
            ))
        );
        let mut other = w;
        other[0] = u32::from_ne_bytes([6, 4, 0x1e, 36]); // someone else's experiment
        assert_eq!(parse_dsr_header6(&other), None);
    }
}
