//! Which interfaces get the per-packet classifier: names, glob patterns and `auto`, and
//! the rule that only devices with an Ethernet header qualify.

use crate::error::{ErrorKind, Result, fail};

/// Longest interface name the kernel accepts (IFNAMSIZ - 1).
const IFNAME_MAX: usize = 15;

/// The interfaces `--interfaces` / `ebpf.interfaces` ask for.
///
/// Each entry is an exact name (`eth0`), a glob where `*` stands for any run of
/// characters (`veth*`, `*-pod`, `cali*x`), or `auto`, which is `*`: every interface.
/// Only devices with an Ethernet header are ever served (see [`DeviceKind`]), so `auto`
/// leaves out loopback, WireGuard, L3 tunnels and the like.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InterfaceSelector {
    patterns: Vec<String>,
}

impl InterfaceSelector {
    /// Checks and keeps the entries; empty ones are dropped.
    pub fn parse(entries: &[String]) -> Result<Self> {
        let mut patterns = Vec::new();
        for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            let pattern = if entry == "auto" { "*" } else { entry };
            if pattern.replace('*', "").len() > IFNAME_MAX {
                fail!(
                    ErrorKind::Attach,
                    "interface pattern {entry:?}: longer than an interface name ({IFNAME_MAX})"
                );
            }
            if let Some(c) = pattern
                .chars()
                .find(|c| *c == '/' || *c == ':' || c.is_whitespace() || c.is_control())
            {
                fail!(
                    ErrorKind::Attach,
                    "interface pattern {entry:?}: {c:?} cannot be part of an interface name"
                );
            }
            patterns.push(pattern.to_string());
        }
        Ok(Self { patterns })
    }

    /// No interface wanted: the classifier is attached nowhere.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// Whether `name` is one of the wanted interfaces (its device type aside).
    pub fn matches(&self, name: &str) -> bool {
        self.patterns.iter().any(|p| glob(p, name))
    }
}

/// `*` matches any run of characters (also none); everything else matches itself.
fn glob(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    // split always yields at least one part.
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty(); // no `*`: an exact name
    };
    for part in middle {
        // Leftmost match leaves the most room for what follows.
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

/// What a device's link-layer type (ARPHRD_*) means for the classifier, which parses a
/// 14-byte Ethernet header at the start of every packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// ARPHRD_ETHER: veths, physical NICs, bridges, bonds, VLANs, VXLAN, tap devices.
    Ethernet,
    /// ARPHRD_LOOPBACK.
    Loopback,
    /// Anything else (WireGuard and tun are ARPHRD_NONE, ipip ARPHRD_TUNNEL, ...): packets
    /// start at the IP header, which the classifier would misread.
    Other(u16),
}

/// What to do with one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Attach,
    /// Matched, but the classifier cannot serve it.
    SkipNotEthernet,
    /// Not asked for (or loopback under a pattern: never worth a log line).
    Ignore,
}

impl InterfaceSelector {
    pub fn decide(&self, name: &str, kind: DeviceKind) -> Decision {
        match kind {
            _ if !self.matches(name) => Decision::Ignore,
            DeviceKind::Ethernet => Decision::Attach,
            DeviceKind::Loopback if !self.patterns.iter().any(|p| p == name) => Decision::Ignore,
            DeviceKind::Loopback | DeviceKind::Other(_) => Decision::SkipNotEthernet,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(entries: &[&str]) -> InterfaceSelector {
        let entries: Vec<String> = entries.iter().map(|e| e.to_string()).collect();
        InterfaceSelector::parse(&entries).expect("valid patterns")
    }

    #[test]
    fn exact_names_match_only_themselves() {
        let s = sel(&["eth0", "eth1"]);
        assert!(s.matches("eth0") && s.matches("eth1"));
        assert!(!s.matches("eth10") && !s.matches("eth") && !s.matches("xeth0"));
    }

    #[test]
    fn star_matches_prefix_suffix_and_middle() {
        let s = sel(&["veth*", "*-pod", "cali*x"]);
        for yes in ["veth", "veth1a2b", "a-pod", "-pod", "calix", "cali12x"] {
            assert!(s.matches(yes), "{yes} should match");
        }
        for no in ["eth0", "vet", "pod", "a-pods", "cali12", "xcali1x1"] {
            assert!(!s.matches(no), "{no} should not match");
        }
        let s = sel(&["*a*b*"]);
        assert!(s.matches("ab") && s.matches("xaxbx") && s.matches("bab"));
        assert!(!s.matches("ba"));
    }

    #[test]
    fn auto_is_every_ethernet_device_but_loopback() {
        let s = sel(&["auto"]);
        assert_eq!(s.decide("eth0", DeviceKind::Ethernet), Decision::Attach);
        assert_eq!(s.decide("veth9", DeviceKind::Ethernet), Decision::Attach);
        assert_eq!(s.decide("lo", DeviceKind::Loopback), Decision::Ignore);
        // ARPHRD_NONE: WireGuard, tun.
        assert_eq!(
            s.decide("wg0", DeviceKind::Other(65534)),
            Decision::SkipNotEthernet
        );
    }

    #[test]
    fn named_non_ethernet_devices_are_skipped_with_a_reason() {
        let s = sel(&["lo", "tun0", "eth0"]);
        assert_eq!(
            s.decide("lo", DeviceKind::Loopback),
            Decision::SkipNotEthernet
        );
        assert_eq!(
            s.decide("tun0", DeviceKind::Other(65534)),
            Decision::SkipNotEthernet
        );
        assert_eq!(s.decide("eth1", DeviceKind::Ethernet), Decision::Ignore);
    }

    #[test]
    fn empty_entries_mean_nothing_and_bad_ones_are_refused() {
        assert!(sel(&["", " "]).is_empty());
        assert!(!sel(&["eth0"]).is_empty());
        for bad in ["a/b", "eth 0", "eth0:1", "sixteen-chars-xx"] {
            assert!(
                InterfaceSelector::parse(&[bad.to_string()]).is_err(),
                "{bad:?} accepted"
            );
        }
        // `*` does not count towards the name's length.
        assert!(InterfaceSelector::parse(&["fifteen-chars-x*".to_string()]).is_ok());
    }
}
