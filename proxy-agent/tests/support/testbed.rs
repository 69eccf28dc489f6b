//! A network namespace with a node's two sides (the uplink `xt0`, the pods' `xt1`), for
//! the BPF_PROG_TEST_RUN tests that need the FIB; and node-b, the backend's node of
//! direct server return, as its own agent programs it.

use std::process::Command;

use proxy_agent::model::{FrontendKind, NodeView, Protocol};

use super::tc_harness::{Harness, frontend};

/// The packet's interface (the uplink) and the pods' (a bridge's veth).
pub const UPLINK: &str = "xt0";
pub const PODS: &str = "xt1";
pub const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x99];
pub const OTHER_NODE_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x20];
/// The entry node of direct server return as node-b sees it: another node of the
/// cluster (192.0.2.30, 2001:db8:a::30), a neighbour on the uplink.
pub const ENTRY_NODE_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x30];
pub const ENTRY_NODE: &str = "192.0.2.30";
pub const ENTRY_NODE6: &str = "2001:db8:a::30";
/// Another node of the cluster on the uplink's network, whose neighbour entry node-b has
/// not (yet) got.
pub const UNRESOLVED_NODE: &str = "192.0.2.40";
pub const POD_MAC: [u8; 6] = [2, 0, 0, 0, 1, 5];

/// Runs `test` on a thread of its own in a new network namespace (gone with the thread):
/// the uplink `xt0` with the node's addresses, the client and another node (whose pod
/// network is routed through it) as permanent neighbours; `xt1` towards local pods.
pub fn in_testbed(test: impl FnOnce(u32, u32) + Send + 'static) {
    let t = std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare");
        let mac = |m: [u8; 6]| {
            m.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        };
        let (client, other, pod) = (mac(CLIENT_MAC), mac(OTHER_NODE_MAC), mac(POD_MAC));
        let entry = mac(ENTRY_NODE_MAC);
        let script = format!(
            "set -e
            ip link set lo up
            ip link add {UPLINK} type veth peer name {PODS}
            ip link set {UPLINK} up; ip link set {PODS} up
            ip addr add 192.0.2.10/24 dev {UPLINK}
            ip -6 addr add 2001:db8:a::10/64 dev {UPLINK} nodad
            ip addr add 10.244.1.1/24 dev {PODS}
            ip -6 addr add fd00:244:1::1/64 dev {PODS} nodad
            ip neigh add 192.0.2.99 lladdr {client} dev {UPLINK} nud permanent
            ip neigh add 192.0.2.20 lladdr {other} dev {UPLINK} nud permanent
            ip neigh add 2001:db8:a::99 lladdr {client} dev {UPLINK} nud permanent
            ip neigh add 2001:db8:a::20 lladdr {other} dev {UPLINK} nud permanent
            ip neigh add {ENTRY_NODE} lladdr {entry} dev {UPLINK} nud permanent
            ip neigh add {ENTRY_NODE6} lladdr {entry} dev {UPLINK} nud permanent
            ip neigh add 10.244.1.5 lladdr {pod} dev {PODS} nud permanent
            ip neigh add fd00:244:1::5 lladdr {pod} dev {PODS} nud permanent
            ip route add 10.244.2.0/24 via 192.0.2.20 dev {UPLINK}
            ip -6 route add fd00:244:2::/64 via 2001:db8:a::20 dev {UPLINK}
            sysctl -qw net.ipv4.conf.all.forwarding=1 net.ipv6.conf.all.forwarding=1"
        );
        let ok = Command::new("sh")
            .args(["-c", &script])
            .status()
            .expect("sh");
        assert!(ok.success(), "test namespace set up");
        test(ifindex(UPLINK), ifindex(PODS));
    });
    if let Err(panic) = t.join() {
        std::panic::resume_unwind(panic);
    }
}

pub fn ifindex(name: &str) -> u32 {
    nix::net::if_::if_nametoindex(name).expect("interface")
}

/// A packet an entry node in this namespace sent with DSR's option (IPv4) or header
/// (IPv6), as node-b receives it from that node: one namespace plays both nodes, so the
/// entry node node-b knows is `ENTRY_NODE` — its address in the option, its MAC as the
/// sender.
pub fn via_entry_node(pkt: &[u8]) -> Vec<u8> {
    let mut p = pkt.to_vec();
    set_dsr_entry(&mut p, ENTRY_NODE_MAC, ENTRY_NODE, ENTRY_NODE6);
    p
}

/// `pkt`'s option (or header) naming entry node `v4` or `v6` (by the packet's family),
/// sent from `mac`; the IPv4 header checksum follows.
pub fn set_dsr_entry(pkt: &mut [u8], mac: [u8; 6], v4: &str, v6: &str) {
    pkt[6..12].copy_from_slice(&mac);
    if pkt[14] >> 4 == 4 {
        let ip: std::net::Ipv4Addr = v4.parse().expect("ip");
        pkt[42..46].copy_from_slice(&ip.octets());
        pkt[24..26].fill(0);
        let c = proxy_agent::trace::packet::fold(proxy_agent::trace::packet::sum16(
            &pkt[14..14 + usize::from(pkt[14] & 0x0f) * 4],
            0,
        ));
        pkt[24..26].copy_from_slice(&c.to_be_bytes());
    } else {
        let ip: std::net::Ipv6Addr = v6.parse().expect("ip");
        pkt[74..90].copy_from_slice(&ip.octets());
    }
}

/// The backend's node, node-b (192.0.2.20, pods 10.244.2.0/24): its own agent, with the
/// Service in `dsr` mode as a NodePort on its own addresses, `backends` its endpoints.
pub fn backend_node(backends: &[&str]) -> Harness {
    let mut h = Harness::new(&[]);
    configure_node_b(&mut h);
    let mut view = NodeView::new();
    for node_ip in ["192.0.2.20", "2001:db8:a::20"] {
        let family: Vec<&str> = backends
            .iter()
            .copied()
            .filter(|b| b.starts_with('[') != node_ip.contains('.'))
            .collect();
        let (f, mut st) = frontend(node_ip, 30080, Protocol::Tcp, &family);
        st.kind = FrontendKind::NodePort;
        st.dsr = true;
        view.insert(f, st);
    }
    h.apply(&view);
    h
}

/// (Its pod network holds both nodes' IPv6 pod CIDRs: fd00:244:1:: and fd00:244:2::.)
pub fn configure_node_b(h: &mut Harness) {
    proxy_agent::dataplane::bpf::writer::configure(
        &mut h.maps,
        &proxy_agent::model::NodeSettings {
            pod_cidrs: vec![
                "10.244.0.0/16".parse().expect("cidr"),
                "fd00:244::/32".parse().expect("cidr"),
            ],
            node_addresses: vec![
                "192.0.2.20".parse().expect("ip"),
                "2001:db8:a::20".parse().expect("ip"),
            ],
            masquerade_all: false,
            node_pod_cidrs: vec![
                "10.244.2.0/24".parse().expect("cidr"),
                "fd00:244:2::/64".parse().expect("cidr"),
            ],
            // The entry node, and node-a (whose address the testbed's uplink has: no
            // neighbour, so never proven).
            peer_addresses: [
                ENTRY_NODE,
                ENTRY_NODE6,
                UNRESOLVED_NODE,
                "192.0.2.10",
                "2001:db8:a::10",
            ]
            .iter()
            .map(|a| a.parse().expect("ip"))
            .collect(),
        },
        &Default::default(),
    )
    .expect("configure");
}
