//! The kernel's own connection tracking: UDP entries towards a removed backend are
//! deleted (ctnetlink), as kube-proxy does after a UDP endpoint goes away; flows netfilter
//! translated before the classifier was attached (kube-proxy's, during a migration) are
//! mirrored into `NETFILTER_FLOWS`, so the classifier leaves them to netfilter.
//!
//! Our programs never leave their NAT decision in the kernel's table (the per-packet path
//! translates before netfilter sees the packet), but other NAT on the node does: a
//! CNI's hostPort or masquerade rules, or kube-proxy's rules from before the switch. A
//! stale entry there keeps a UDP client pinned to a dead pod until it idles out.

use std::{collections::HashSet, net::IpAddr};

use aya::maps::{HashMap, MapData};

use crate::error::{Context as _, Error, ErrorKind, Kind as _, Result};
use netlink_packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkPayload};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
    conntrack::{
        ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol, Status, Tuple,
    },
};
use netlink_sys::protocols::NETLINK_NETFILTER;
use proxy_common::{Backend, CT_DIR_FORWARD, CtKey, PROTO_SCTP, PROTO_TCP, PROTO_UDP};

use super::netlink::Channel;

/// Deletes the UDP entries of the current network namespace whose original destination
/// or reply source is one of `gone`. Returns how many went.
pub fn forget_udp_flows_to(gone: &[Backend]) -> Result<usize> {
    let gone: HashSet<(IpAddr, u16)> = gone
        .iter()
        .filter(|b| b.proto == PROTO_UDP)
        .map(|b| {
            (
                proxy_common::addr::from_words(b.addr, b.family),
                u16::from_be(b.port),
            )
        })
        .collect();
    if gone.is_empty() {
        return Ok(0);
    }
    let mut nl = Channel::open(NETLINK_NETFILTER, "ctnetlink")?;
    let mut deleted = 0;
    for family in [NetfilterProtoFamily::IPv4, NetfilterProtoFamily::IPv6] {
        for orig in udp_entries(&mut nl, family, &gone)? {
            let request = NetfilterMessage::new(
                NetfilterHeader::new(family, 0, 0),
                ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(orig)]),
            );
            // Already gone (timed out meanwhile) is fine.
            match nl.act(0, None, request) {
                Ok(()) => deleted += 1,
                Err(e) => tracing::debug!(error = format!("{e:#}"), "conntrack entry not deleted"),
            }
        }
    }
    Ok(deleted)
}

/// Deletes the kernel's entries that our per-packet flows left: netfilter saw each
/// unmasqueraded flow's packets already translated, as two flows it never sees answered —
/// the client's towards the backend, and the replies from the frontend (picked up
/// mid-stream). Once the classifier is gone, the client's packets (to the frontend again)
/// would match the second one's reply direction, go untranslated and stall; without
/// them they are new to netfilter, and whatever NAT is loaded (kube-proxy's rules, on the
/// way back) takes them: to the same backend the connection goes on, to another one it
/// gets a reset. Masqueraded flows are redirected past netfilter and left none. Returns
/// how many entries went.
pub fn forget_translated_flows(maps: &super::maps::MapSet) -> Result<usize> {
    use proxy_common::CT_F_SNAT;
    let mut nl = Channel::open(NETLINK_NETFILTER, "ctnetlink")?;
    let mut deleted = 0;
    for table in [&maps.conntrack, &maps.conntrack_new] {
        for (key, value) in table.iter().filter_map(Result::ok) {
            if key.dir != CT_DIR_FORWARD || value.flags & CT_F_SNAT != 0 {
                continue;
            }
            let client = (
                proxy_common::addr::from_words(key.saddr, key.family),
                u16::from_be(key.sport),
            );
            let frontend = (
                proxy_common::addr::from_words(key.daddr, key.family),
                u16::from_be(key.dport),
            );
            let backend = (
                proxy_common::addr::from_words(value.xlate_addr, key.family),
                u16::from_be(value.xlate_port),
            );
            let family = if key.family == proxy_common::FAMILY_V4 {
                NetfilterProtoFamily::IPv4
            } else {
                NetfilterProtoFamily::IPv6
            };
            for (src, dst) in [(client, backend), (frontend, client)] {
                let request = NetfilterMessage::new(
                    NetfilterHeader::new(family, 0, 0),
                    ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(tuple(
                        key.proto, src, dst,
                    ))]),
                );
                // None (never seen, or gone meanwhile) is fine.
                if nl.act(0, None, request).is_ok() {
                    deleted += 1;
                }
            }
        }
    }
    Ok(deleted)
}

/// A conntrack tuple.
fn tuple(proto: u8, (saddr, sport): (IpAddr, u16), (daddr, dport): (IpAddr, u16)) -> Vec<Tuple> {
    let protocol = match proto {
        PROTO_TCP => Protocol::Tcp,
        PROTO_UDP => Protocol::Udp,
        PROTO_SCTP => Protocol::Sctp,
        other => Protocol::Other(other),
    };
    vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(saddr),
            IPTuple::DestinationAddress(daddr),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(protocol),
            ProtoTuple::SourcePort(sport),
            ProtoTuple::DestinationPort(dport),
        ]),
    ]
}

/// The original tuples of the UDP entries of one family that involve a `gone` backend.
fn udp_entries(
    nl: &mut Channel,
    family: NetfilterProtoFamily,
    gone: &HashSet<(IpAddr, u16)>,
) -> Result<Vec<Vec<Tuple>>> {
    let mut found = Vec::new();
    dump(nl, family, |attrs| {
        let mut orig = None;
        let mut hit = false;
        for attr in attrs {
            match attr {
                ConntrackAttribute::CtaTupleOrig(t) => {
                    let e = endpoints(&t);
                    hit |= e.udp && e.dst.is_some_and(|d| gone.contains(&d));
                    orig = Some(t);
                }
                ConntrackAttribute::CtaTupleReply(t) => {
                    let e = endpoints(&t);
                    hit |= e.udp && e.src.is_some_and(|s| gone.contains(&s));
                }
                _ => {}
            }
        }
        if let (true, Some(orig)) = (hit, orig) {
            found.push(orig);
        }
    })?;
    Ok(found)
}

/// Calls `each` with the attributes of every entry of one family.
fn dump(
    nl: &mut Channel,
    family: NetfilterProtoFamily,
    mut each: impl FnMut(Vec<ConntrackAttribute>),
) -> Result<()> {
    let seq = nl.send(
        NLM_F_REQUEST | NLM_F_DUMP,
        None,
        NetfilterMessage::new(
            NetfilterHeader::new(family, 0, 0),
            ConntrackMessage::Get(Vec::new()),
        ),
    )?;
    nl.receive::<NetfilterMessage>(seq, |payload| match payload {
        NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)),
            ..
        }) => {
            each(attrs);
            Ok(false)
        }
        NetlinkPayload::Done(_) => Ok(true),
        NetlinkPayload::Error(e) => Err(Error::new(
            ErrorKind::Netlink,
            format!("conntrack dump failed: {e}"),
        )),
        _ => Ok(false),
    })
    .context("listing the kernel's conntrack entries")
}

/// The forward tuples (as the classifier keys them) of the kernel's entries that
/// netfilter destination-NATed: TCP, UDP and SCTP flows some NAT rule (kube-proxy's
/// DNAT, a CNI's hostPort) translated. Only the ones aimed at a frontend ever matter.
pub fn dnat_flows() -> Result<HashSet<CtKey>> {
    let mut nl = Channel::open(NETLINK_NETFILTER, "ctnetlink")?;
    let mut keys = HashSet::new();
    for family in [NetfilterProtoFamily::IPv4, NetfilterProtoFamily::IPv6] {
        dump(&mut nl, family, |attrs| {
            let dnat = attrs.iter().any(
                |a| matches!(a, ConntrackAttribute::CtaStatus(s) if s.contains(Status::DstNat)),
            );
            let orig = attrs.iter().find_map(|a| match a {
                ConntrackAttribute::CtaTupleOrig(t) => Some(t),
                _ => None,
            });
            if let (true, Some(key)) = (dnat, orig.and_then(|t| forward_key(t))) {
                keys.insert(key);
            }
        })?;
    }
    Ok(keys)
}

/// Mirrors the kernel's destination-NATed flows into `NETFILTER_FLOWS` (before the
/// classifier is attached, and then while any are left: entries go as netfilter's go).
/// Returns how many the map holds now.
pub fn refresh_netfilter_flows(maps: &mut super::maps::MapSet) -> Result<usize> {
    let flows = dnat_flows()?;
    let (added, removed) = mirror_netfilter_flows(&mut maps.netfilter_flows, &flows)?;
    if added + removed > 0 {
        tracing::info!(
            flows = flows.len(),
            added,
            removed,
            "flows netfilter translated (kube-proxy's from before us) are left to it"
        );
    }
    Ok(flows.len())
}

/// Makes `NETFILTER_FLOWS` hold exactly `flows`; returns (added, removed).
fn mirror_netfilter_flows(
    map: &mut HashMap<MapData, CtKey, u8>,
    flows: &HashSet<CtKey>,
) -> Result<(usize, usize)> {
    let held: HashSet<CtKey> = map.keys().filter_map(Result::ok).collect();
    let (mut added, mut removed) = (0, 0);
    for key in flows.difference(&held) {
        map.insert(key, &1, 0)
            .kind(ErrorKind::Map, "writing NETFILTER_FLOWS")?;
        added += 1;
    }
    for key in held.difference(flows) {
        // Already gone (LRU) is fine.
        if map.remove(key).is_ok() {
            removed += 1;
        }
    }
    Ok((added, removed))
}

/// The classifier's forward key of an entry's original tuple.
fn forward_key(tuple: &[Tuple]) -> Option<CtKey> {
    let e = endpoints(tuple);
    let proto = match e.proto? {
        Protocol::Tcp => PROTO_TCP,
        Protocol::Udp => PROTO_UDP,
        Protocol::Sctp => PROTO_SCTP,
        _ => return None,
    };
    let ((saddr, sport), (daddr, dport)) = (e.src?, e.dst?);
    let (saddr, family) = proxy_common::addr::to_words(saddr);
    let (daddr, _) = proxy_common::addr::to_words(daddr);
    Some(CtKey {
        saddr,
        daddr,
        sport: sport.to_be(),
        dport: dport.to_be(),
        proto,
        family,
        dir: CT_DIR_FORWARD,
        _pad: 0,
    })
}

/// One direction of an entry: its protocol and its two ends.
struct Ends {
    proto: Option<Protocol>,
    udp: bool,
    src: Option<(IpAddr, u16)>,
    dst: Option<(IpAddr, u16)>,
}

fn endpoints(tuple: &[Tuple]) -> Ends {
    let (mut saddr, mut daddr, mut sport, mut dport, mut proto) = (None, None, None, None, None);
    for part in tuple {
        match part {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => saddr = Some(*a),
                        IPTuple::DestinationAddress(a) => daddr = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(protos) => {
                for p in protos {
                    match p {
                        ProtoTuple::Protocol(p) => proto = Some(*p),
                        ProtoTuple::SourcePort(p) => sport = Some(*p),
                        ProtoTuple::DestinationPort(p) => dport = Some(*p),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Ends {
        udp: proto == Some(Protocol::Udp),
        proto,
        src: saddr.zip(sport),
        dst: daddr.zip(dport),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_of_a_udp_tuple() {
        let t = vec![
            Tuple::Ip(vec![
                IPTuple::SourceAddress("10.0.0.1".parse().unwrap()),
                IPTuple::DestinationAddress("10.0.0.2".parse().unwrap()),
            ]),
            Tuple::Proto(vec![
                ProtoTuple::Protocol(Protocol::Udp),
                ProtoTuple::SourcePort(5353),
                ProtoTuple::DestinationPort(53),
            ]),
        ];
        let e = endpoints(&t);
        assert!(e.udp);
        assert_eq!(e.src, Some(("10.0.0.1".parse().unwrap(), 5353)));
        assert_eq!(e.dst, Some(("10.0.0.2".parse().unwrap(), 53)));
    }
}
