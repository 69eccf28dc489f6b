//! `proxy-agent cleanup --kube-proxy`: removes what kube-proxy leaves in the current
//! network namespace, as `kube-proxy --cleanup` does — its iptables chains (legacy and
//! nft backends, both families), its nftables tables, the IPVS services on `kube-ipvs0`
//! and that dummy device — and reports what it removed, what it left and why.

mod iptables;
mod report;

pub use report::{Outcome, Report};

use std::net::IpAddr;

use anyhow::{Context as _, Result};
use netlink_packet_core::{NLM_F_REQUEST, NetlinkPayload};
use netlink_packet_route::{
    RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
    link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage},
};
use netlink_sys::protocols::NETLINK_ROUTE;

use crate::dataplane::bpf::netlink::Channel;

/// The dummy device kube-proxy's IPVS mode binds Service addresses to.
pub const IPVS_DEVICE: &str = "kube-ipvs0";

/// Runs every step; one that fails is reported and the others still run.
pub fn cleanup() -> Report {
    let mut report = Report::default();
    let backends = iptables::backends();
    if backends.is_empty() {
        report.add(
            Outcome::Left,
            "iptables",
            "no iptables-save/-restore commands on this host: iptables not checked".into(),
        );
    }
    for b in &backends {
        iptables::clean(b, &mut report);
    }
    nftables(&mut report);
    ipvs_services(&mut report);
    ipvs_device(&mut report);
    report
}

/// The `ip kube-proxy` and `ip6 kube-proxy` tables of kube-proxy's nftables mode. Other
/// tables (iptables-nft's own among them) are never touched.
fn nftables(report: &mut Report) {
    let Some(nft) = iptables::find("nft") else {
        report.add(
            Outcome::Left,
            "nftables",
            "no nft command on this host: nftables not checked".into(),
        );
        return;
    };
    let listed = match std::process::Command::new(&nft)
        .args(["list", "tables"])
        .output()
    {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        Ok(out) => {
            let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
            report.add(
                Outcome::Failed,
                "nftables",
                format!("nft list tables: {err}"),
            );
            return;
        }
        Err(e) => {
            report.add(Outcome::Failed, "nftables", format!("nft: {e}"));
            return;
        }
    };
    for family in ["ip", "ip6"] {
        let line = format!("table {family} kube-proxy");
        if !listed.lines().any(|l| l.trim() == line) {
            continue;
        }
        let out = std::process::Command::new(&nft)
            .args(["delete", "table", family, "kube-proxy"])
            .output();
        match out {
            Ok(o) if o.status.success() => report.add(Outcome::Removed, "nftables", line),
            Ok(o) => report.add(
                Outcome::Failed,
                "nftables",
                format!("{line}: {}", String::from_utf8_lossy(&o.stderr).trim()),
            ),
            Err(e) => report.add(Outcome::Failed, "nftables", format!("{line}: {e}")),
        }
    }
}

/// One IPVS virtual service, as `/proc/net/ip_vs` lists it.
#[derive(Debug, PartialEq)]
struct VirtualService {
    proto: String,
    addr: IpAddr,
    port: u16,
}

/// The virtual services of `/proc/net/ip_vs` (`TCP  0A60000A:0050 rr`, IPv6 as
/// `[fd96:0000:...]:0050`); fwmark services have no address and are skipped.
fn parse_ip_vs(text: &str) -> Vec<VirtualService> {
    text.lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with('\t'))
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let proto = w.next()?;
            if !matches!(proto, "TCP" | "UDP" | "SCTP") {
                return None;
            }
            let (addr, port) = w.next()?.rsplit_once(':')?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let addr = if let Some(v6) = addr.strip_prefix('[') {
                IpAddr::V6(v6.trim_end_matches(']').parse().ok()?)
            } else {
                IpAddr::V4(u32::from_str_radix(addr, 16).ok()?.into())
            };
            Some(VirtualService {
                proto: proto.to_string(),
                addr,
                port,
            })
        })
        .collect()
}

/// IPVS virtual services whose address sits on `kube-ipvs0` (ClusterIPs, external and
/// load-balancer IPs kube-proxy bound there), deleted with `ipvsadm`. Services on other
/// addresses — kube-proxy's NodePorts among them, but also anyone else's — are reported
/// and left: `kube-proxy --cleanup` flushes every IPVS service, `ipvsadm -C` does that.
fn ipvs_services(report: &mut Report) {
    let text = match std::fs::read_to_string("/proc/net/ip_vs") {
        Ok(t) => t,
        Err(_) => {
            report.add(
                Outcome::Left,
                "ipvs",
                "no IPVS in this kernel (ip_vs not loaded, no /proc/net/ip_vs): no virtual services to remove".into(),
            );
            return;
        }
    };
    let services = parse_ip_vs(&text);
    if services.is_empty() {
        return;
    }
    let bound = match device_addresses(IPVS_DEVICE) {
        Ok(a) => a,
        Err(e) => {
            report.add(
                Outcome::Failed,
                "ipvs",
                format!("addresses of {IPVS_DEVICE}: {e:#}"),
            );
            return;
        }
    };
    let ipvsadm = iptables::find("ipvsadm");
    for s in services {
        let name = match s.addr {
            IpAddr::V4(a) => format!("{} {a}:{}", s.proto, s.port),
            IpAddr::V6(a) => format!("{} [{a}]:{}", s.proto, s.port),
        };
        if !bound.contains(&s.addr) {
            report.add(
                Outcome::Left,
                "ipvs",
                format!("{name}: not on {IPVS_DEVICE} (kube-proxy's NodePorts look like this; `ipvsadm -C` removes every service)"),
            );
            continue;
        }
        let Some(ipvsadm) = &ipvsadm else {
            report.add(
                Outcome::Failed,
                "ipvs",
                format!("{name}: no ipvsadm command to remove it"),
            );
            continue;
        };
        let flag = match s.proto.as_str() {
            "UDP" => "-u",
            "SCTP" => "--sctp-service",
            _ => "-t",
        };
        let addr = name.split_once(' ').map_or("", |(_, a)| a);
        match std::process::Command::new(ipvsadm)
            .args(["-D", flag, addr])
            .output()
        {
            Ok(o) if o.status.success() => report.add(Outcome::Removed, "ipvs", name),
            Ok(o) => report.add(
                Outcome::Failed,
                "ipvs",
                format!("{name}: {}", String::from_utf8_lossy(&o.stderr).trim()),
            ),
            Err(e) => report.add(Outcome::Failed, "ipvs", format!("{name}: {e}")),
        }
    }
}

/// `kube-ipvs0`, when it is a dummy device (as kube-proxy, which refuses to delete a
/// device of that name of any other kind).
fn ipvs_device(report: &mut Report) {
    match link_by_name(IPVS_DEVICE) {
        Ok(None) => {}
        Ok(Some((_, kind))) if kind != Some(InfoKind::Dummy) => report.add(
            Outcome::Left,
            "ipvs",
            format!(
                "device {IPVS_DEVICE}: a {} device, not the dummy kube-proxy makes",
                kind.map_or("kindless".to_string(), |k| k.to_string())
            ),
        ),
        Ok(Some((index, _))) => match delete_link(index) {
            Ok(()) => report.add(Outcome::Removed, "ipvs", format!("device {IPVS_DEVICE}")),
            Err(e) => report.add(
                Outcome::Failed,
                "ipvs",
                format!("device {IPVS_DEVICE}: {e:#}"),
            ),
        },
        Err(e) => report.add(
            Outcome::Failed,
            "ipvs",
            format!("device {IPVS_DEVICE}: {e:#}"),
        ),
    }
}

/// The index and kind of the device called `name`; `None` when there is none.
fn link_by_name(name: &str) -> Result<Option<(u32, Option<InfoKind>)>> {
    let mut nl = Channel::open(NETLINK_ROUTE, "route netlink")?;
    let mut msg = LinkMessage::default();
    msg.attributes.push(LinkAttribute::IfName(name.to_string()));
    let seq = nl.send(NLM_F_REQUEST, None, RouteNetlinkMessage::GetLink(msg))?;
    let mut found = None;
    nl.receive::<RouteNetlinkMessage>(seq, |payload| match payload {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(m)) => {
            let kind = m.attributes.iter().find_map(|a| match a {
                LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
                    LinkInfo::Kind(k) => Some(k.clone()),
                    _ => None,
                }),
                _ => None,
            });
            found = Some((m.header.index, kind));
            Ok(true)
        }
        // ENODEV: no such device.
        NetlinkPayload::Error(e) if e.raw_code() == -libc::ENODEV => Ok(true),
        NetlinkPayload::Error(e) if e.code.is_some() => Err(netlink_error(e.to_string())),
        NetlinkPayload::Error(_) | NetlinkPayload::Done(_) => Ok(true),
        _ => Ok(false),
    })
    .with_context(|| format!("looking up device {name}"))?;
    Ok(found)
}

fn delete_link(index: u32) -> Result<()> {
    let mut nl = Channel::open(NETLINK_ROUTE, "route netlink")?;
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    Ok(nl.act(0, None, RouteNetlinkMessage::DelLink(msg))?)
}

/// The kernel's refusal inside a netlink exchange, as the channel's callbacks return it.
fn netlink_error(what: String) -> crate::dataplane::Error {
    crate::dataplane::Error::new(crate::dataplane::ErrorKind::Netlink, what)
}

/// The addresses on device `name` (none when it does not exist).
fn device_addresses(name: &str) -> Result<Vec<IpAddr>> {
    let Some((index, _)) = link_by_name(name)? else {
        return Ok(Vec::new());
    };
    let mut nl = Channel::open(NETLINK_ROUTE, "route netlink")?;
    let seq = nl.send(
        NLM_F_REQUEST | netlink_packet_core::NLM_F_DUMP,
        None,
        RouteNetlinkMessage::GetAddress(AddressMessage::default()),
    )?;
    let mut out = Vec::new();
    nl.receive::<RouteNetlinkMessage>(seq, |payload| match payload {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewAddress(m)) => {
            if m.header.index == index {
                out.extend(m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(ip) => Some(*ip),
                    _ => None,
                }));
            }
            Ok(false)
        }
        NetlinkPayload::Done(_) => Ok(true),
        NetlinkPayload::Error(e) => Err(netlink_error(format!("address dump failed: {e}"))),
        _ => Ok(false),
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_ip_vs_lists_services_of_both_families() {
        let text = "IP Virtual Server version 1.2.1 (size=4096)
Prot LocalAddress:Port Scheduler Flags
  -> RemoteAddress:Port Forward Weight ActiveConn InActConn
TCP  0A60000A:0050 rr
  -> 0A140002:1F90      Masq    1      0          0
UDP  [fd96:0000:0000:0000:0000:0000:0000:0010]:0035 rr
FWM  00000001 rr
";
        assert_eq!(
            parse_ip_vs(text),
            [
                VirtualService {
                    proto: "TCP".into(),
                    addr: "10.96.0.10".parse().unwrap(),
                    port: 80
                },
                VirtualService {
                    proto: "UDP".into(),
                    addr: "fd96::10".parse().unwrap(),
                    port: 53
                },
            ]
        );
    }
}
