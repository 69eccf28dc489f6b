//! The model's values as the map ABI spells them: protocols, frontend keys,
//! backend entries, LPM keys and scheduler codes.

use std::net::SocketAddr;

use aya::maps::lpm_trie::Key as LpmKey;
use proxy_common::{
    BACKEND_ACTIVE, Backend, LPM_TAG_BITS, LpmData, PROTO_SCTP, PROTO_TCP, PROTO_UDP, RevNatValue,
    SCOPE_EXTERNAL, ServiceKey, addr::to_words, sched,
};

use proxy_model::{Frontend, Protocol, schedule::Scheduler};

/// The reverse-NAT entry of frontend `key`: the address replies are given back.
pub fn rev_nat_of(key: &ServiceKey) -> RevNatValue {
    RevNatValue {
        addr: key.addr,
        port: key.port,
        family: key.family,
        proto: key.proto,
    }
}

/// The `ServiceValue::scheduler` code of a scheduler.
pub fn scheduler_code(s: Scheduler) -> u8 {
    match s {
        Scheduler::Random => sched::RANDOM,
        Scheduler::Rr => sched::RR,
        Scheduler::Wrr => sched::WRR,
        Scheduler::Sh => sched::SH,
        Scheduler::Dh => sched::DH,
        Scheduler::Mh => sched::MH,
        Scheduler::Lc => sched::LC,
        Scheduler::Wlc => sched::WLC,
        Scheduler::Sed => sched::SED,
        Scheduler::Nq => sched::NQ,
    }
}

/// The scheduler a `ServiceValue::scheduler` code names.
pub fn scheduler_of_code(code: u8) -> Option<Scheduler> {
    Scheduler::ALL
        .into_iter()
        .find(|&s| scheduler_code(s) == code)
}

pub(super) fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => PROTO_TCP,
        Protocol::Udp => PROTO_UDP,
        Protocol::Sctp => PROTO_SCTP,
    }
}

/// The protocol an IP protocol number names, if we serve it (`proto_number`'s inverse).
pub fn protocol_of(proto: u8) -> Option<Protocol> {
    match proto {
        PROTO_TCP => Some(Protocol::Tcp),
        PROTO_UDP => Some(Protocol::Udp),
        PROTO_SCTP => Some(Protocol::Sctp),
        _ => None,
    }
}

/// The service-map key of a frontend.
pub fn service_key(fe: &Frontend) -> ServiceKey {
    let (addr, family) = to_words(fe.ip);
    ServiceKey {
        addr,
        port: fe.port.to_be(),
        proto: proto_number(fe.protocol),
        family,
        scope: SCOPE_EXTERNAL,
        _pad: [0; 3],
    }
}

/// The frontend a service key stands for (either scope).
pub fn frontend_of(key: &ServiceKey) -> Frontend {
    Frontend {
        ip: proxy_common::addr::from_words(key.addr, key.family),
        port: u16::from_be(key.port),
        // A key the writer made carries one of the three.
        protocol: protocol_of(key.proto).unwrap_or(Protocol::Tcp),
    }
}

pub(super) fn backend_value(sa: SocketAddr, protocol: Protocol) -> Backend {
    let (addr, family) = to_words(sa.ip());
    Backend {
        addr,
        port: sa.port().to_be(),
        proto: proto_number(protocol),
        family,
        state: BACKEND_ACTIVE,
        _pad: [0; 3],
    }
}

/// The `SOURCE_RANGES` key of one CIDR of one service.
pub(super) fn range_key(service_id: u32, net: &ipnet::IpNet) -> LpmKey<LpmData> {
    lpm_key(service_id, net)
}

pub(super) fn lpm_key(tag: u32, net: &ipnet::IpNet) -> LpmKey<LpmData> {
    let (addr, _) = to_words(net.network());
    LpmKey::new(
        LPM_TAG_BITS + u32::from(net.prefix_len()),
        LpmData { tag, addr },
    )
}

#[cfg(test)]
mod tests {
    use proxy_common::FAMILY_V4;

    use super::*;

    /// A key names its frontend back, for each protocol and family.
    #[test]
    fn a_key_gives_its_frontend_back() {
        for (ip, protocol) in [
            ("10.96.0.10", Protocol::Tcp),
            ("2001:db8::1", Protocol::Udp),
            ("192.0.2.1", Protocol::Sctp),
        ] {
            let fe = Frontend {
                ip: ip.parse().expect("ip"),
                port: 8443,
                protocol,
            };
            assert_eq!(frontend_of(&service_key(&fe)), fe);
        }
        assert_eq!(protocol_of(1), None, "ICMP is no frontend's");
    }

    #[test]
    fn frontend_key_is_network_order() {
        let key = service_key(&Frontend {
            ip: "10.96.0.10".parse().expect("ip"),
            port: 80,
            protocol: Protocol::Udp,
        });
        // The bytes as the packet carries them.
        assert_eq!(key.addr[0].to_ne_bytes(), [10, 96, 0, 10]);
        assert_eq!(key.addr[1..], [0, 0, 0]);
        assert_eq!(key.port.to_ne_bytes(), [0, 80]);
        assert_eq!(
            (key.proto, key.family, key.scope),
            (PROTO_UDP, FAMILY_V4, SCOPE_EXTERNAL)
        );
    }

    #[test]
    fn backend_entry_carries_target_port() {
        let be = backend_value("10.244.1.5:8080".parse().expect("sa"), Protocol::Tcp);
        assert_eq!(be.port.to_ne_bytes(), 8080u16.to_be_bytes());
        assert_eq!(
            (be.proto, be.family, be.state),
            (PROTO_TCP, FAMILY_V4, BACKEND_ACTIVE)
        );
    }

    #[test]
    fn scheduler_codes_round_trip() {
        for s in Scheduler::ALL {
            assert_eq!(scheduler_of_code(scheduler_code(s)), Some(s));
        }
        assert_eq!(scheduler_of_code(0xff), None);
    }
}
