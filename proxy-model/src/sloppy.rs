//! Addresses as kube-proxy reads them (`netutils.ParseIPSloppy`, `ParseCIDRSloppy`): IPv4
//! parts may carry leading zeros and are read as decimal (`010.096.000.010` is
//! 10.96.0.10), as Go's parser did before 1.17 and as objects written then still hold.

use std::net::{IpAddr, Ipv4Addr};

use crate::error::AddrError;

/// An address, leading zeros in IPv4 parts allowed.
pub fn parse_ip(s: &str) -> Result<IpAddr, AddrError> {
    if let Ok(ip) = s.parse() {
        return Ok(ip);
    }
    parse_v4_sloppy(s)
        .map(IpAddr::V4)
        .ok_or(AddrError::NotAnAddress)
}

/// A CIDR, leading zeros in IPv4 parts allowed.
pub fn parse_cidr(s: &str) -> Result<ipnet::IpNet, AddrError> {
    if let Ok(net) = s.parse() {
        return Ok(net);
    }
    let (addr, len) = s.split_once('/').ok_or(AddrError::NoPrefixLength)?;
    let ip = parse_v4_sloppy(addr).ok_or(AddrError::NotACidr)?;
    let len: u8 = len.parse().map_err(|_| AddrError::InvalidPrefixLength)?;
    ipnet::Ipv4Net::new(ip, len)
        .map(ipnet::IpNet::V4)
        .map_err(|_| AddrError::PrefixLengthOutOfRange)
}

fn parse_v4_sloppy(s: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for octet in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let digits = part.trim_start_matches('0');
        *octet = if digits.is_empty() {
            0
        } else if digits.len() > 3 {
            return None;
        } else {
            digits.parse().ok()?
        };
    }
    parts.next().is_none().then(|| Ipv4Addr::from(octets))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_zeros_are_decimal() {
        assert_eq!(
            parse_ip("010.096.000.010"),
            Ok("10.96.0.10".parse().unwrap())
        );
        assert_eq!(parse_ip("10.96.0.10"), Ok("10.96.0.10".parse().unwrap()));
        assert_eq!(parse_ip("2001:db8::1"), Ok("2001:db8::1".parse().unwrap()));
        for bad in [
            "256.1.1.1",
            "1.2.3",
            "1.2.3.4.5",
            "1..2.3",
            "a.b.c.d",
            "",
            "0x1.2.3.4",
        ] {
            assert!(parse_ip(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_cidr("010.000.000.000/8"),
            Ok("10.0.0.0/8".parse().unwrap())
        );
        assert!(parse_cidr("10.0.0.0/33").is_err());
    }
}
