//! Crafting test packets (Ethernet + IPv4/IPv6 + TCP SYN, UDP or SCTP DATA, valid
//! checksums) and reading back what a program made of them, checksums verified.

use std::net::{IpAddr, SocketAddr};

use proxy_common::{PROTO_SCTP, PROTO_TCP, PROTO_UDP, crc32c::sctp_checksum};

use crate::model::Protocol;

/// The internet checksum's ones'-complement sum of `data` (big-endian words) onto `acc`.
pub fn sum16(data: &[u8], mut acc: u32) -> u32 {
    for chunk in data.chunks(2) {
        let word = u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]);
        acc += u32::from(word);
    }
    acc
}

/// Folds a `sum16` into the 16-bit checksum (complemented): 0 when the data checks.
pub fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// Ethernet + IP + TCP with the given flags (SYN, ACK, FIN...) and a valid checksum.
pub fn build_tcp(src: SocketAddr, dst: SocketAddr, flags: u8) -> Vec<u8> {
    let mut p = build(src, dst, Protocol::Tcp);
    let l4 = if src.is_ipv4() { 34 } else { 54 };
    let old = p[l4 + 13];
    p[l4 + 13] = flags;
    // Keep the checksum valid: the flags byte is the low byte of its 16-bit word.
    let csum = u16::from_be_bytes([p[l4 + 16], p[l4 + 17]]);
    let sum = u32::from(!csum) + u32::from(!u16::from(old)) + u32::from(u16::from(flags));
    p[l4 + 16..l4 + 18].copy_from_slice(&fold(sum).to_be_bytes());
    p
}

/// Inserts direct server return's option (IPv4, after the base header) or Destination
/// Options header (IPv6, first) naming `frontend` and entry node `entry` (of the same
/// family; else none, zero) into `pkt` (as `build` made it), as an entry node would; the
/// lengths and the IPv4 header checksum follow (the L4 checksum does not cover either).
pub fn add_dsr(pkt: &mut Vec<u8>, frontend: SocketAddr, entry: IpAddr) {
    let port = frontend.port().to_be();
    match frontend.ip() {
        IpAddr::V4(ip) => {
            let entry = match entry {
                IpAddr::V4(e) => u32::from_ne_bytes(e.octets()),
                IpAddr::V6(_) => 0,
            };
            let opt = proxy_common::dsr_option(u32::from_ne_bytes(ip.octets()), port, entry);
            pkt.splice(34..34, opt);
            pkt[14] = 0x45 + proxy_common::DSR_OPT_LEN / 4;
            let total = u16::from_be_bytes([pkt[16], pkt[17]]) + opt.len() as u16;
            pkt[16..18].copy_from_slice(&total.to_be_bytes());
            pkt[24..26].fill(0);
            let c = fold(sum16(&pkt[14..34 + opt.len()], 0));
            pkt[24..26].copy_from_slice(&c.to_be_bytes());
        }
        IpAddr::V6(ip) => {
            let (words, _) = proxy_common::addr::to_words(IpAddr::V6(ip));
            let entry = match entry {
                IpAddr::V6(_) => proxy_common::addr::to_words(entry).0,
                IpAddr::V4(_) => [0; 4],
            };
            let hdr = proxy_common::dsr_header6(pkt[20], words, port, entry);
            pkt.splice(54..54, hdr.iter().flat_map(|w| w.to_ne_bytes()));
            let payload =
                u16::from_be_bytes([pkt[18], pkt[19]]) + u16::from(proxy_common::DSR_HDR6_LEN);
            pkt[18..20].copy_from_slice(&payload.to_be_bytes());
            pkt[20] = proxy_common::IPPROTO_DSTOPTS;
        }
    }
}

/// Ethernet + IP + TCP (SYN), UDP or SCTP (one DATA chunk) with valid checksums.
pub fn build(src: SocketAddr, dst: SocketAddr, protocol: Protocol) -> Vec<u8> {
    let payload = b"hello";
    let l4_len = match protocol {
        Protocol::Tcp => 20 + payload.len(),
        Protocol::Udp => 8 + payload.len(),
        // Common header, DATA chunk header, payload padded to 4 bytes.
        Protocol::Sctp => 12 + 16 + payload.len().next_multiple_of(4),
    };
    let mut l4 = vec![0u8; l4_len];
    l4[0..2].copy_from_slice(&src.port().to_be_bytes());
    l4[2..4].copy_from_slice(&dst.port().to_be_bytes());
    let proto = match protocol {
        Protocol::Tcp => {
            l4[4..8].copy_from_slice(&1000u32.to_be_bytes());
            l4[12] = 5 << 4;
            l4[13] = 0x02; // SYN
            l4[14..16].copy_from_slice(&64240u16.to_be_bytes());
            l4[20..].copy_from_slice(payload);
            PROTO_TCP
        }
        Protocol::Udp => {
            l4[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
            l4[8..].copy_from_slice(payload);
            PROTO_UDP
        }
        Protocol::Sctp => {
            l4[4..8].copy_from_slice(&0x5ca1_ab1eu32.to_be_bytes()); // verification tag
            l4[12] = 0; // DATA
            l4[13] = 0x03; // a whole message
            l4[14..16].copy_from_slice(&((16 + payload.len()) as u16).to_be_bytes());
            l4[16..20].copy_from_slice(&1u32.to_be_bytes()); // TSN
            l4[28..28 + payload.len()].copy_from_slice(payload);
            PROTO_SCTP
        }
    };
    // Mixed families: callers never build these.
    let Some(mut pkt) = ip_frame(src.ip(), dst.ip(), proto, 0, l4_len) else {
        return Vec::new();
    };
    if proto == PROTO_SCTP {
        let c = sctp_checksum(&l4);
        l4[8..12].copy_from_slice(&c.to_le_bytes());
    } else {
        let csum_off = if proto == PROTO_TCP { 16 } else { 6 };
        let c = l4_checksum(&pkt, &l4, proto);
        l4[csum_off..csum_off + 2].copy_from_slice(&c.to_be_bytes());
    }
    pkt.extend_from_slice(&l4);
    pkt
}

/// Ethernet and an IP header (TTL 64, `tos` the IPv4 type of service) from `src` to `dst`
/// for `l4_len` bytes of protocol `proto`, the IPv4 checksum made; `None` for mixed
/// families. The caller appends the L4 bytes.
pub fn ip_frame(src: IpAddr, dst: IpAddr, proto: u8, tos: u8, l4_len: usize) -> Option<Vec<u8>> {
    let mut pkt = vec![0u8; 12];
    pkt[0..6].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
    pkt[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            pkt.extend_from_slice(&0x0800u16.to_be_bytes());
            let mut ip = vec![0u8; 20];
            ip[0] = 0x45;
            ip[1] = tos;
            ip[2..4].copy_from_slice(&((20 + l4_len) as u16).to_be_bytes());
            ip[8] = 64;
            ip[9] = proto;
            ip[12..16].copy_from_slice(&s.octets());
            ip[16..20].copy_from_slice(&d.octets());
            let c = fold(sum16(&ip, 0));
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            pkt.extend_from_slice(&ip);
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            pkt.extend_from_slice(&0x86DDu16.to_be_bytes());
            let mut ip = vec![0u8; 40];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
            ip[6] = proto;
            ip[7] = 64;
            ip[8..24].copy_from_slice(&s.octets());
            ip[24..40].copy_from_slice(&d.octets());
            pkt.extend_from_slice(&ip);
        }
        _ => return None,
    }
    Some(pkt)
}

/// The L4 checksum of segment `l4` of protocol `proto` (not necessarily the IP header's
/// next header: an IPv6 extension header may come between).
fn l4_checksum(pkt_with_ip: &[u8], l4: &[u8], proto: u8) -> u16 {
    let v4 = pkt_with_ip[12..14] == [0x08, 0x00];
    let pseudo = if v4 {
        sum16(&pkt_with_ip[14 + 12..14 + 20], 0)
    } else {
        sum16(&pkt_with_ip[14 + 8..14 + 40], 0)
    };
    let acc = pseudo + u32::from(proto) + l4.len() as u32;
    let c = fold(sum16(l4, acc));
    if c == 0 && proto == 17 { 0xffff } else { c }
}

/// Parsed view of a packet the program returned, with checksums verified.
/// The addresses of a packet a program returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// TCP flags (0 for UDP).
    pub tcp_flags: u8,
}

/// Parses a packet and verifies its IPv4 header (options included) and L4 checksums.
pub fn inspect(pkt: &[u8]) -> Result<Seen, String> {
    if pkt.len() < 14 + 20 + 8 {
        return Err(format!("{} bytes: too short", pkt.len()));
    }
    let v4 = pkt[12..14] == [0x08, 0x00];
    let (src_ip, dst_ip, l4_off, proto): (IpAddr, IpAddr, usize, u8) = if v4 {
        let ihl = usize::from(pkt[14] & 0x0f) * 4;
        if ihl < 20 || pkt.len() < 14 + ihl + 8 {
            return Err(format!("IPv4 header length {ihl} in {} bytes", pkt.len()));
        }
        let ip = &pkt[14..14 + ihl];
        if fold(sum16(ip, 0)) != 0 {
            return Err("IPv4 header checksum invalid".into());
        }
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        // (More on the wire is padding.)
        if total < ihl || total > pkt.len() - 14 {
            return Err(format!(
                "IPv4 total length {total}, {} on the wire",
                pkt.len() - 14
            ));
        }
        let s: [u8; 4] = ip[12..16].try_into().map_err(|_| "short".to_string())?;
        let d: [u8; 4] = ip[16..20].try_into().map_err(|_| "short".to_string())?;
        (s.into(), d.into(), 14 + ihl, ip[9])
    } else {
        if pkt.len() < 54 + 8 {
            return Err(format!("{} bytes: too short for IPv6", pkt.len()));
        }
        let ip = &pkt[14..54];
        let s: [u8; 16] = ip[8..24].try_into().map_err(|_| "short".to_string())?;
        let d: [u8; 16] = ip[24..40].try_into().map_err(|_| "short".to_string())?;
        let payload = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
        if payload > pkt.len() - 54 {
            return Err(format!(
                "IPv6 payload length {payload}, {} on the wire",
                pkt.len() - 54
            ));
        }
        // A Destination Options header (direct server return's) is stepped over.
        let (mut next, mut off) = (ip[6], 54);
        if next == 60 {
            let len = pkt
                .get(off + 1)
                .map(|l| (usize::from(*l) + 1) * 8)
                .ok_or("Destination Options header cut short")?;
            if pkt.len() < off + len + 8 {
                return Err("Destination Options header cut short".into());
            }
            (next, off) = (pkt[off], off + len);
        }
        (s.into(), d.into(), off, next)
    };
    let l4 = &pkt[l4_off..];
    if proto == PROTO_SCTP {
        if l4.len() < 12 {
            return Err("SCTP header cut short".into());
        }
        if u32::from_le_bytes([l4[8], l4[9], l4[10], l4[11]]) != sctp_checksum(l4) {
            return Err("SCTP CRC32c invalid".into());
        }
        return Ok(Seen {
            src: SocketAddr::new(src_ip, u16::from_be_bytes([l4[0], l4[1]])),
            dst: SocketAddr::new(dst_ip, u16::from_be_bytes([l4[2], l4[3]])),
            tcp_flags: 0,
        });
    }
    let csum_off = if proto == 6 { 16 } else { 6 };
    let stored = u16::from_be_bytes([l4[csum_off], l4[csum_off + 1]]);
    if !(proto == 17 && v4 && stored == 0) {
        let mut zeroed = l4.to_vec();
        zeroed[csum_off] = 0;
        zeroed[csum_off + 1] = 0;
        if l4_checksum(&pkt[..l4_off], &zeroed, proto) != stored {
            return Err("L4 checksum invalid".into());
        }
    }
    Ok(Seen {
        src: SocketAddr::new(src_ip, u16::from_be_bytes([l4[0], l4[1]])),
        dst: SocketAddr::new(dst_ip, u16::from_be_bytes([l4[2], l4[3]])),
        tcp_flags: if proto == 6 { l4[13] } else { 0 },
    })
}

/// Whether `pkt` is a refusal sent back to a client: a TCP reset, an ICMP port
/// unreachable or an ICMPv6 port unreachable, with valid checksums.
pub fn is_refusal(pkt: &[u8]) -> Result<bool, String> {
    if pkt.len() < 14 + 20 + 8 {
        return Err(format!("{} bytes: too short", pkt.len()));
    }
    let v4 = pkt[12..14] == [0x08, 0x00];
    let (proto, l4_off) = if v4 { (pkt[23], 34) } else { (pkt[20], 54) };
    match proto {
        6 => Ok(inspect(pkt)?.tcp_flags & 0x04 != 0),
        1 if v4 => {
            if fold(sum16(&pkt[14..34], 0)) != 0 {
                return Err("IPv4 header checksum invalid".into());
            }
            let icmp = &pkt[l4_off..];
            if fold(sum16(icmp, 0)) != 0 {
                return Err("ICMP checksum invalid".into());
            }
            Ok(icmp[0] == 3 && icmp[1] == 3)
        }
        58 if !v4 => {
            let icmp = &pkt[l4_off..];
            let pseudo = sum16(&pkt[22..54], 0) + 58 + icmp.len() as u32;
            if fold(sum16(icmp, pseudo)) != 0 {
                return Err("ICMPv6 checksum invalid".into());
            }
            Ok(icmp[0] == 1 && icmp[1] == 4)
        }
        _ => Ok(false),
    }
}
