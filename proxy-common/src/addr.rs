//! The ABI's address codec for user space: an address is four 32-bit words in network
//! byte order (each word holds four bytes of the address as they appear on the wire, so
//! its value as a host integer depends on the host's byte order) and a family tag; an
//! IPv4 address uses word 0 and leaves the rest zero. Ports are `u16` in network byte
//! order.
//!
//! An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) stays IPv6 both ways: the programs
//! compare words, and a v6 key never matches a v4 one.

use crate::ip::{FAMILY_V4, FAMILY_V6};
use core::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// An address as the ABI's words and family (`FAMILY_V4` or `FAMILY_V6`).
pub fn to_words(ip: IpAddr) -> ([u32; 4], u8) {
    match ip {
        IpAddr::V4(v4) => ([u32::from_ne_bytes(v4.octets()), 0, 0, 0], FAMILY_V4),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([w(0), w(4), w(8), w(12)], FAMILY_V6)
        }
    }
}

/// The address of the ABI's words and family. Any family other than `FAMILY_V4` reads
/// all four words as IPv6.
pub fn from_words(words: [u32; 4], family: u8) -> IpAddr {
    if family == FAMILY_V4 {
        IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))
    } else {
        let mut o = [0u8; 16];
        for (i, w) in words.iter().enumerate() {
            o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        IpAddr::V6(Ipv6Addr::from(o))
    }
}

/// The socket address of the ABI's words, family and port (network byte order, as keys
/// and values hold it).
pub fn socket_addr(words: [u32; 4], family: u8, port_be: u16) -> SocketAddr {
    SocketAddr::new(from_words(words, family), u16::from_be(port_be))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes the words hold in memory, as the kernel sees them.
    fn bytes(words: [u32; 4]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_ne_bytes()).collect()
    }

    #[test]
    fn v4_uses_word_zero_in_network_order() {
        let ip: IpAddr = "10.96.0.1".parse().unwrap();
        let (words, family) = to_words(ip);
        assert_eq!(family, FAMILY_V4);
        assert_eq!(
            bytes(words),
            [10, 96, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(words[0], u32::from_be_bytes([10, 96, 0, 1]).to_be());
        assert_eq!(from_words(words, family), ip);
    }

    #[test]
    fn v6_fills_the_four_words_in_network_order() {
        let ip: IpAddr = "fd00:10:96::1:a".parse().unwrap();
        let (words, family) = to_words(ip);
        assert_eq!(family, FAMILY_V6);
        let IpAddr::V6(v6) = ip else { unreachable!() };
        assert_eq!(bytes(words), v6.octets());
        assert_eq!(from_words(words, family), ip);
    }

    #[test]
    fn v4_mapped_stays_v6() {
        let ip: IpAddr = "::ffff:10.96.0.1".parse().unwrap();
        let (words, family) = to_words(ip);
        assert_eq!(family, FAMILY_V6);
        assert_eq!(
            bytes(words),
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 96, 0, 1]
        );
        let back = from_words(words, family);
        assert_eq!(back, ip);
        assert!(back.is_ipv6());
        // The same address as IPv4 is another key.
        assert_ne!(to_words("10.96.0.1".parse().unwrap()), (words, family));
    }

    #[test]
    fn round_trips() {
        for s in [
            "0.0.0.0",
            "127.0.0.1",
            "192.168.255.254",
            "255.255.255.255",
            "::",
            "::1",
            "::ffff:0.0.0.0",
            "2001:db8::8a2e:370:7334",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ] {
            let ip: IpAddr = s.parse().unwrap();
            let (words, family) = to_words(ip);
            assert_eq!(from_words(words, family), ip, "{s}");
            assert_eq!(to_words(from_words(words, family)), (words, family), "{s}");
        }
    }

    #[test]
    fn socket_addr_takes_the_port_in_network_order() {
        let (words, family) = to_words("10.244.1.7".parse().unwrap());
        let sa = socket_addr(words, family, 8080u16.to_be());
        assert_eq!(sa, "10.244.1.7:8080".parse().unwrap());
        let (words, family) = to_words("fd00::7".parse().unwrap());
        let sa = socket_addr(words, family, 53u16.to_be());
        assert_eq!(sa, "[fd00::7]:53".parse().unwrap());
        assert_eq!(
            socket_addr([0; 4], FAMILY_V4, 0),
            "0.0.0.0:0".parse().unwrap()
        );
    }
}
