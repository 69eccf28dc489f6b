//! The per-packet cost of the XDP program (`BPF_PROG_TEST_RUN`) beside an XDP program that
//! only passes and our TC classifier, in one run: an established flow and new flows, in a
//! network namespace of its own whose FIB and neighbour table give every packet its next
//! hop, so the measured path is the real one (translate, FIB, `XDP_REDIRECT`). Medians of
//! repeated rounds, with their spread.

use std::{net::SocketAddr, process::Command};

use anyhow::{Context as _, Result, bail};
use aya::{
    TestRun as _, TestRunOptions,
    programs::{SchedClassifier, Xdp},
};
use proxy_agent::{
    dataplane::bpf::{self, Mirror},
    trace::packet,
};

use super::{CONNTRACK_NEW_ROOM, TCP_ACK, TCP_SYN, VIP, median, services, spread_of, view_of};

/// Nanoseconds per packet: medians over rounds, and each one's spread (max - min).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct XdpPerPacket {
    pub rounds: u32,
    pub xdp_established_ns: f64,
    pub xdp_established_spread_ns: f64,
    pub xdp_new_flow_ns: f64,
    pub xdp_new_flow_spread_ns: f64,
    pub xdp_pass_ns: f64,
    pub xdp_pass_spread_ns: f64,
    pub tc_established_ns: f64,
    pub tc_established_spread_ns: f64,
    /// The same paths in steady state (repeated runs behind a restoring front).
    pub steady: super::steady::Steady,
}

impl XdpPerPacket {
    /// The XDP program's established flow against the pass-through program.
    pub fn established_vs_pass(&self) -> f64 {
        self.xdp_established_ns / self.xdp_pass_ns.max(1.0)
    }

    /// Our TC classifier's established flow against the XDP program's.
    pub fn tc_vs_xdp(&self) -> f64 {
        self.tc_established_ns / self.xdp_established_ns.max(1.0)
    }
}

const UPLINK: &str = "xb0";
const PODS: &str = "xb1";

/// Runs the measurement on a thread of its own in a new network namespace.
pub fn per_packet(n: usize, runs: u32, rounds: u32) -> Result<XdpPerPacket> {
    let t = std::thread::spawn(move || -> Result<XdpPerPacket> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).context("unshare")?;
        let script = format!(
            "set -e
            ip link set lo up
            ip link add {UPLINK} type veth peer name {PODS}
            ip link set {UPLINK} up; ip link set {PODS} up
            ip addr add 192.0.2.10/24 dev {UPLINK}
            ip addr add 10.20.0.1/16 dev {PODS}
            ip neigh add 192.0.2.99 lladdr 02:00:00:00:00:99 dev {UPLINK} nud permanent
            for i in 0 1 2; do
              ip neigh add 10.20.$i.2 lladdr 02:00:00:00:01:0$i dev {PODS} nud permanent
            done
            sysctl -qw net.ipv4.conf.all.forwarding=1"
        );
        if !Command::new("sh").args(["-c", &script]).status()?.success() {
            bail!("setting up the benchmark's namespace");
        }
        measure(n, runs, rounds)
    });
    t.join()
        .map_err(|_| anyhow::anyhow!("the XDP benchmark panicked"))?
}

/// The object with private maps (room for every new flow), `xdp_ingress`, `xdp_pass` and
/// `tc_ingress` loaded, and `svcs` programmed: what the XDP benchmarks start from.
pub(super) fn load_with_services(
    svcs: &[(String, Vec<String>)],
) -> Result<(aya::Ebpf, bpf::MapSet)> {
    let (mut ebpf, mut maps) =
        bpf::load_private(&[(proxy_common::map_names::CONNTRACK_NEW, CONNTRACK_NEW_ROOM)])?;
    for name in ["xdp_ingress", "xdp_pass"] {
        let prog: &mut Xdp = ebpf.program_mut(name).context("program")?.try_into()?;
        prog.load()?;
    }
    for name in ["tc_ingress", "tc_pass"] {
        let tc: &mut SchedClassifier = ebpf.program_mut(name).context("program")?.try_into()?;
        tc.load()?;
    }
    let mut state = Mirror::adopt(&maps)?;
    state.apply(&mut maps, &view_of(svcs)?)?;
    Ok((ebpf, maps))
}

fn measure(n: usize, runs: u32, rounds: u32) -> Result<XdpPerPacket> {
    let uplink = nix::net::if_::if_nametoindex(UPLINK)?;
    let (ebpf, maps) = load_with_services(&services(n))?;
    let vip: SocketAddr = format!("{VIP}:80").parse()?;
    let client: SocketAddr = "192.0.2.99:40000".parse()?;
    let xdp_run = |prog: &str, data: &[u8]| -> Result<(u32, u128)> {
        let p: &Xdp = ebpf.program(prog).context("program")?.try_into()?;
        let mut md = [0u8; 24];
        md[4..8].copy_from_slice(&(data.len() as u32).to_ne_bytes());
        md[12..16].copy_from_slice(&uplink.to_ne_bytes());
        let mut out = vec![0u8; 256];
        let res = p.test_run(TestRunOptions {
            data_in: Some(data),
            data_out: Some(&mut out),
            ctx_in: Some(&md),
            ..Default::default()
        })?;
        Ok((res.return_value, res.duration.as_nanos()))
    };
    // The established flow: a completed handshake, opened at XDP, its reply through TC.
    let (action, _) = xdp_run("xdp_ingress", &packet::build_tcp(client, vip, TCP_SYN))?;
    if action != 4 {
        bail!("the XDP program did not redirect the SYN (action {action}): no next hop?");
    }
    let tc_run = |data: &[u8]| -> Result<(Vec<u8>, u128)> {
        let p: &SchedClassifier = ebpf.program("tc_ingress").context("program")?.try_into()?;
        let mut out = vec![0u8; 256];
        let res = p.test_run(TestRunOptions {
            data_in: Some(data),
            data_out: Some(&mut out),
            ..Default::default()
        })?;
        out.truncate(res.data_size_out as usize);
        Ok((out, res.duration.as_nanos()))
    };
    let backend = maps
        .conntrack_new
        .iter()
        .filter_map(Result::ok)
        .find(|(k, _)| k.dir == proxy_common::CT_DIR_FORWARD)
        .map(|(k, v)| proxy_common::addr::socket_addr(v.xlate_addr, k.family, v.xlate_port))
        .context("the SYN's flow")?;
    tc_run(&packet::build_tcp(backend, client, TCP_SYN | TCP_ACK))?;
    xdp_run("xdp_ingress", &packet::build_tcp(client, vip, TCP_ACK))?;
    let ack = packet::build_tcp(client, vip, TCP_ACK);
    let mean_xdp = |prog: &str, new_flows: bool| -> Result<f64> {
        let mut total = 0u128;
        for i in 0..runs {
            let data = if new_flows {
                let src: SocketAddr = format!("192.0.2.99:{}", 1024 + (i % 60_000)).parse()?;
                packet::build_tcp(src, vip, TCP_SYN)
            } else {
                ack.clone()
            };
            total += xdp_run(prog, &data)?.1;
        }
        Ok(total as f64 / f64::from(runs))
    };
    let mean_tc = || -> Result<f64> {
        let mut total = 0u128;
        for _ in 0..runs {
            total += tc_run(&ack)?.1;
        }
        Ok(total as f64 / f64::from(runs))
    };
    let (mut est, mut new, mut pass, mut tcs) = (vec![], vec![], vec![], vec![]);
    // Alternate the contenders so drift hits all alike.
    for _ in 0..rounds.max(1) {
        pass.push(mean_xdp("xdp_pass", false)?);
        est.push(mean_xdp("xdp_ingress", false)?);
        new.push(mean_xdp("xdp_ingress", true)?);
        tcs.push(mean_tc()?);
    }
    // Steady state: new flows from a client of their own (the single runs above used
    // 192.0.2.99's ports).
    let syn = packet::build_tcp("192.0.2.98:1024".parse()?, vip, TCP_SYN);
    let reply = packet::build_tcp(backend, client, TCP_ACK);
    let steady = super::steady::measure(
        &ebpf,
        &super::steady::Packets {
            ack: &ack,
            reply: &reply,
            syn: &syn,
            uplink,
        },
        rounds,
        runs.min(20_000),
    )?;
    Ok(XdpPerPacket {
        rounds: rounds.max(1),
        xdp_established_spread_ns: spread_of(&est),
        xdp_new_flow_spread_ns: spread_of(&new),
        xdp_pass_spread_ns: spread_of(&pass),
        tc_established_spread_ns: spread_of(&tcs),
        xdp_established_ns: median(&mut est),
        xdp_new_flow_ns: median(&mut new),
        xdp_pass_ns: median(&mut pass),
        tc_established_ns: median(&mut tcs),
        steady,
    })
}
