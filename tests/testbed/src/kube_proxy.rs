//! Rules shaped like kube-proxy's, for the benchmark and the migration tests: its
//! iptables mode (nat chains per Service and endpoint; the filter and mangle chains it
//! adds, and kubelet's own KUBE-* chains beside them) and its nftables mode, and loading
//! them into a namespace.

use std::{fmt::Write as _, path::Path, process::Command};

use anyhow::{Result, bail};

/// Prefix length of one host, and the pod network, in `vip`'s family.
fn family_of(vip: &str) -> (u8, &'static str) {
    if vip.contains(':') {
        (128, "fd00::/8")
    } else {
        (32, "10.0.0.0/8")
    }
}

/// The address of an `ip:port` endpoint (`[v6]:port` too).
fn endpoint_ip(ep: &str) -> &str {
    let ip = ep.rsplit_once(':').map_or(ep, |(ip, _)| ip);
    ip.trim_start_matches('[').trim_end_matches(']')
}

fn chain_id(prefix: &str, i: usize, j: Option<usize>) -> String {
    // kube-proxy hashes names into 16 characters; any unique 16-character tag will do.
    match j {
        Some(j) => format!("{prefix}-{:010X}{j:02X}", i),
        None => format!("{prefix}-{:012X}", i),
    }
}

/// kube-proxy's iptables mode: KUBE-SERVICES → KUBE-SVC-… (statistic mode random) →
/// KUBE-SEP-… (KUBE-MARK-MASQ for hairpin, DNAT), with KUBE-MARK-MASQ for traffic from
/// outside the pod network. A full iptables-restore input.
pub fn iptables_rules(svcs: &[(String, Vec<String>)]) -> String {
    let mut r = String::with_capacity(svcs.len() * 700);
    r.push_str("*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-POSTROUTING - [0:0]\n");
    for (i, (_, eps)) in svcs.iter().enumerate() {
        let _ = writeln!(r, ":{} - [0:0]", chain_id("KUBE-SVC", i, None));
        for j in 0..eps.len() {
            let _ = writeln!(r, ":{} - [0:0]", chain_id("KUBE-SEP", i, Some(j)));
        }
    }
    r.push_str(
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
    );
    r.push_str("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    r.push_str("-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n");
    r.push_str("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n");
    r.push_str("-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n");
    r.push_str("-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n");
    r.push_str("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n");
    for (i, (vip, eps)) in svcs.iter().enumerate() {
        let svc = chain_id("KUBE-SVC", i, None);
        let (host, pods) = family_of(vip);
        let _ = writeln!(
            r,
            "-A KUBE-SERVICES -d {vip}/{host} -p tcp -m comment --comment \"bench/s{i}:http cluster IP\" -m tcp --dport 80 -j {svc}"
        );
        let _ = writeln!(
            r,
            "-A {svc} ! -s {pods} -d {vip}/{host} -p tcp -m tcp --dport 80 -j KUBE-MARK-MASQ"
        );
        let n = eps.len();
        for (j, ep) in eps.iter().enumerate() {
            let sep = chain_id("KUBE-SEP", i, Some(j));
            if j + 1 < n {
                let p = 1.0 / (n - j) as f64;
                let _ = writeln!(
                    r,
                    "-A {svc} -m statistic --mode random --probability {p:.11} -j {sep}"
                );
            } else {
                let _ = writeln!(r, "-A {svc} -j {sep}");
            }
            let ip = endpoint_ip(ep);
            let _ = writeln!(r, "-A {sep} -s {ip}/{host} -j KUBE-MARK-MASQ");
            let _ = writeln!(r, "-A {sep} -p tcp -m tcp -j DNAT --to-destination {ep}");
        }
    }
    r.push_str("COMMIT\n");
    r
}

/// What kube-proxy's iptables partial sync writes for one changed Service: KUBE-SERVICES
/// in full (it always is) and the changed Service's chains.
pub fn iptables_one_change(svcs: &[(String, Vec<String>)], changed: usize) -> String {
    let mut r = String::from("*nat\n:KUBE-SERVICES - [0:0]\n");
    let svc = chain_id("KUBE-SVC", changed, None);
    let _ = writeln!(r, ":{svc} - [0:0]");
    for (i, (vip, _)) in svcs.iter().enumerate() {
        let _ = writeln!(
            r,
            "-A KUBE-SERVICES -d {vip}/{} -p tcp -m tcp --dport 80 -j {}",
            family_of(vip).0,
            chain_id("KUBE-SVC", i, None)
        );
    }
    let (vip, eps) = &svcs[changed];
    let (host, pods) = family_of(vip);
    let _ = writeln!(
        r,
        "-A {svc} ! -s {pods} -d {vip}/{host} -p tcp -m tcp --dport 80 -j KUBE-MARK-MASQ"
    );
    // One endpoint fewer.
    let _ = writeln!(
        r,
        "-A {svc} -j {}",
        chain_id("KUBE-SEP", changed, Some(eps.len() - 1))
    );
    r.push_str("COMMIT\n");
    r
}

/// kube-proxy's nftables mode: a `service-ips` verdict map jumping to per-Service chains
/// that pick an endpoint with `numgen random mod N vmap`, endpoint chains that DNAT. The
/// table is `ip kube-proxy`, or `ip6 kube-proxy` for IPv6 Services (one family per table,
/// as kube-proxy's).
pub fn nft_rules(svcs: &[(String, Vec<String>)]) -> String {
    let v6 = svcs.first().is_some_and(|(vip, _)| vip.contains(':'));
    let (fam, addr_type) = if v6 {
        ("ip6", "ipv6_addr")
    } else {
        ("ip", "ipv4_addr")
    };
    let mut r = String::with_capacity(svcs.len() * 600);
    let _ = writeln!(r, "table {fam} kube-proxy {{");
    // nft 1.0 wants a `;` before each closing brace of a one-line block.
    r.push_str(" chain mark-for-masquerade { meta mark set meta mark | 0x4000; }\n");
    r.push_str(" chain masquerading { type nat hook postrouting priority srcnat; meta mark & 0x4000 == 0 return; meta mark set meta mark ^ 0x4000; masquerade fully-random; }\n");
    for (i, (vip, eps)) in svcs.iter().enumerate() {
        let svc = format!("service-{i}");
        let mut picks = Vec::new();
        for (j, ep) in eps.iter().enumerate() {
            let sep = format!("endpoint-{i}-{j}");
            let ip = endpoint_ip(ep);
            let _ = writeln!(
                r,
                " chain {sep} {{ {fam} saddr {ip} jump mark-for-masquerade; meta l4proto tcp dnat to {ep}; }}"
            );
            picks.push(format!("{j} : goto {sep}"));
        }
        let pods = family_of(vip).1;
        let _ = writeln!(
            r,
            " chain {svc} {{ {fam} daddr {vip} tcp dport 80 {fam} saddr != {pods} jump mark-for-masquerade; numgen random mod {} vmap {{ {} }}; }}",
            eps.len(),
            picks.join(", ")
        );
    }
    let _ = write!(
        r,
        " map service-ips {{ type {addr_type} . inet_proto . inet_service : verdict; elements = {{ "
    );
    let elems: Vec<String> = svcs
        .iter()
        .enumerate()
        .map(|(i, (vip, _))| format!("{vip} . tcp . 80 : goto service-{i}"))
        .collect();
    r.push_str(&elems.join(", "));
    r.push_str(" }; }\n");
    let _ = writeln!(
        r,
        " chain services {{ {fam} daddr . meta l4proto . th dport vmap @service-ips; }}"
    );
    r.push_str(
        " chain nat-prerouting { type nat hook prerouting priority dstnat; jump services; }\n",
    );
    r.push_str(" chain nat-output { type nat hook output priority -100; jump services; }\n");
    r.push_str("}\n");
    r
}

/// What kube-proxy's nftables mode writes for one changed Service: its chain, flushed and
/// rewritten with one endpoint fewer.
pub fn nft_one_change(svcs: &[(String, Vec<String>)], changed: usize) -> String {
    let (vip, eps) = &svcs[changed];
    let n = eps.len() - 1;
    let picks: Vec<String> = (0..n)
        .map(|j| format!("{j} : goto endpoint-{changed}-{j}"))
        .collect();
    let mut out = format!(
        "flush chain ip kube-proxy service-{changed}\nadd rule ip kube-proxy service-{changed} ip daddr {vip} tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade\n"
    );
    // Its last endpoint gone, the chain picks none (kube-proxy then rejects through its
    // no-endpoint map).
    if n > 0 {
        out.push_str(&format!(
            "add rule ip kube-proxy service-{changed} numgen random mod {n} vmap {{ {} }}\n",
            picks.join(", ")
        ));
    }
    out
}

/// What kube-proxy's iptables mode adds besides the Service chains (`iptables_rules`),
/// and kubelet's chains beside them, as an `iptables-restore --noflush` input for one
/// family: filter's KUBE-SERVICES / KUBE-EXTERNAL-SERVICES / KUBE-NODEPORTS /
/// KUBE-FORWARD / KUBE-PROXY-FIREWALL with their jumps from INPUT, FORWARD and OUTPUT
/// (kube-proxy's own comments and matches), the KUBE-PROXY-CANARY chains of mangle, nat
/// and filter, nat's KUBE-NODEPORTS; kubelet's KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY
/// and (IPv4) KUBE-FIREWALL with its jumps. Needs `iptables_rules` loaded first (nat's
/// KUBE-SERVICES).
#[derive(Clone, Copy, Debug, Default)]
pub struct NodeChains {
    pub v6: bool,
    /// kube-proxy's `-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP`, which it
    /// leaves out when `nf_conntrack_tcp_be_liberal` is set (`conntrack.tcpBeLiberal`).
    pub drop_invalid: bool,
}

/// `NodeChains` as an `iptables-restore --noflush` input.
pub fn iptables_node_chains(opts: NodeChains) -> String {
    let NodeChains { v6, drop_invalid } = opts;
    let mut r = String::from(
        "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n",
    );
    r.push_str("*filter\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\n:KUBE-EXTERNAL-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-FORWARD - [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\n");
    const NEW: &str = "-m conntrack --ctstate NEW";
    for (chain, jumps) in [
        (
            "INPUT",
            &[
                (
                    NEW,
                    "kubernetes load balancer firewall",
                    "KUBE-PROXY-FIREWALL",
                ),
                (
                    "",
                    "kubernetes health check service ports",
                    "KUBE-NODEPORTS",
                ),
                (
                    NEW,
                    "kubernetes externally-visible service portals",
                    "KUBE-EXTERNAL-SERVICES",
                ),
            ][..],
        ),
        (
            "FORWARD",
            &[
                (
                    NEW,
                    "kubernetes load balancer firewall",
                    "KUBE-PROXY-FIREWALL",
                ),
                ("", "kubernetes forwarding rules", "KUBE-FORWARD"),
                (NEW, "kubernetes service portals", "KUBE-SERVICES"),
                (
                    NEW,
                    "kubernetes externally-visible service portals",
                    "KUBE-EXTERNAL-SERVICES",
                ),
            ][..],
        ),
        (
            "OUTPUT",
            &[
                (
                    NEW,
                    "kubernetes load balancer firewall",
                    "KUBE-PROXY-FIREWALL",
                ),
                (NEW, "kubernetes service portals", "KUBE-SERVICES"),
            ][..],
        ),
    ] {
        for (m, comment, target) in jumps {
            let _ = writeln!(
                r,
                "-A {chain} {m} -m comment --comment \"{comment}\" -j {target}"
            );
        }
    }
    if drop_invalid {
        r.push_str("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n");
    }
    r.push_str("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n");
    r.push_str("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n");
    if !v6 {
        // kubelet's martian-packet protection (route_localnet).
        r.push_str(
            ":KUBE-FIREWALL - [0:0]\n-A INPUT -j KUBE-FIREWALL\n-A OUTPUT -j KUBE-FIREWALL\n",
        );
        r.push_str("-A KUBE-FIREWALL -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m comment --comment \"block incoming localnet connections\" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n");
    }
    r.push_str("COMMIT\n*nat\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\n:KUBE-NODEPORTS - [0:0]\n");
    r.push_str("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n");
    r.push_str("COMMIT\n");
    r
}

/// Loads a rules file into namespace `ns` with `tool` (`iptables-restore`,
/// `ip6tables-nft-restore`, ... read it on stdin; `nft` takes `-f FILE`).
pub fn restore(ns: &str, tool: &str, args: &[&str], file: &Path) -> Result<()> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, tool]).args(args);
    let out = if tool == "nft" {
        cmd.arg(file).output()?
    } else {
        cmd.stdin(std::fs::File::open(file)?).output()?
    };
    if !out.status.success() {
        bail!("{tool} in {ns}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The change drops the Service's last endpoint: the chain picks none, and `nft`
    /// gets no `numgen … mod 0` (a syntax error). With more, it picks among those left.
    #[test]
    fn one_nft_change_picks_among_the_endpoints_left() {
        let svc = |n: usize| {
            vec![(
                "10.96.0.10".to_string(),
                (0..n).map(|i| format!("10.244.0.{i}:8081")).collect(),
            )]
        };
        let last_one = nft_one_change(&svc(1), 0);
        assert!(!last_one.contains("numgen"), "{last_one}");
        assert!(last_one.contains("flush chain ip kube-proxy service-0"));
        let of_three = nft_one_change(&svc(3), 0);
        assert!(
            of_three.contains(
                "numgen random mod 2 vmap { 0 : goto endpoint-0-0, 1 : goto endpoint-0-1 }"
            ),
            "{of_three}"
        );
    }
}
