//! Packets per second per core delivered into a backend namespace through a veth, for an
//! established flow to a ClusterIP from outside the node: our XDP program, our TC
//! classifier, and kube-proxy-shaped iptables and nftables DNAT. Frames are generated
//! in the kernel by `BPF_PROG_TEST_RUN` in live-frame mode (`BPF_F_TEST_XDP_LIVE_FRAMES`)
//! on the uplink of a router namespace, one per contender: the generator
//! (`xdp-bench-gen`) writes the original headers back and tail-calls our `xdp_ingress`
//! (translate, FIB, `XDP_REDIRECT` to the pods' veth) or `xdp_pass` (the frame becomes an
//! skb in the stack, where our classifier or netfilter translates it and the kernel
//! forwards it). Delivered = the backend-side veth's received packets; the generating
//! thread, and with it the whole path (softirqs included), is pinned to one CPU.
//! Contenders alternate within each round; medians of the rounds, with their spread.

use std::{
    fs::File,
    net::SocketAddr,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf, EbpfLoader, TestRun as _, TestRunAttrs, TestRunOptions,
    maps::{Array, ProgramArray},
    programs::{SchedClassifier, TcAttachType, Xdp},
};
use proxy_agent::{dataplane::bpf, trace::packet};
use proxy_testbed::kube_proxy;

use super::{TCP_ACK, TCP_SYN, VIP, median, range, services};

/// One contender's delivered rate: medians over rounds, and the spread (max - min).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Rate {
    pub contender: String,
    pub mpps: f64,
    pub mpps_spread: f64,
    /// Delivered / generated (median): below 1 where frames were dropped on the way.
    pub delivered_share: f64,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Throughput {
    pub services: usize,
    pub rounds: u32,
    pub frames_per_round: u32,
    pub cpu: usize,
    pub rates: Vec<Rate>,
}

impl Throughput {
    pub fn mpps(&self, contender: &str) -> f64 {
        self.rates
            .iter()
            .find(|r| r.contender == contender)
            .map_or(0.0, |r| r.mpps)
    }

    /// `a`'s rate over `b`'s.
    pub fn ratio(&self, a: &str, b: &str) -> f64 {
        self.mpps(a) / self.mpps(b).max(1e-9)
    }
}

pub const CONTENDERS: [&str; 4] = ["xdp", "tc", "iptables", "nftables"];
/// The control: frames passed to a stack that translates nothing. Whatever reaches its
/// backend was counted without being translated, and the run stops.
const CONTROL: &str = "none";

const UPLINK: &str = "up0";
const UPLINK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x10];
const PODS: &str = "pod0";
const BACKEND: &str = "pod1";
/// Ethernet, IPv4 and TCP headers: what the generator writes back (`bench_gen.rs`).
const HEADERS: usize = 54;

/// The namespaces of one run, deleted however it ends.
struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn sh(script: &str) -> Result<()> {
    let out = Command::new("sh").args(["-c", script]).output()?;
    if !out.status.success() {
        bail!(
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr).trim_end()
        );
    }
    Ok(())
}

/// A router namespace (uplink, pods' veth, forwarding on) and a backend namespace behind
/// it whose veth counts what arrives (GRO on: the veth's NAPI, which `XDP_REDIRECT`
/// into a veth needs) and drops it (the neighbour entries' MACs are not its own).
/// IPv6 is off in both: a link coming up sends MLD reports and router solicitations,
/// which the backend's counter would take for frames (one did, in CI).
fn topology(router: &str, backend: &str) -> Result<()> {
    let mac = UPLINK_MAC.map(|b| format!("{b:02x}")).join(":");
    let mut script = format!(
        "set -e
        ip netns add {router}; ip netns add {backend}
        ip netns exec {router} sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
        ip netns exec {backend} sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
        ip -n {router} link set lo up
        ip -n {router} link add {UPLINK} address {mac} type veth peer name up1
        ip -n {router} link add {PODS} type veth peer name {BACKEND} netns {backend}
        ip -n {router} link set {UPLINK} up; ip -n {router} link set up1 up
        ip -n {router} link set {PODS} up; ip -n {backend} link set {BACKEND} up
        ip -n {router} addr add 192.0.2.10/24 dev {UPLINK}
        ip -n {router} addr add 10.20.0.1/16 dev {PODS}
        ip -n {router} neigh add 192.0.2.99 lladdr 02:00:00:00:00:99 dev {UPLINK} nud permanent
        ip netns exec {router} sysctl -qw net.ipv4.conf.all.forwarding=1
        ip netns exec {router} sysctl -qw net.ipv4.conf.all.rp_filter=0
        ip netns exec {router} sysctl -qw net.ipv4.conf.{UPLINK}.rp_filter=0
        ip netns exec {backend} ethtool -K {BACKEND} gro on
        "
    );
    for i in 0..3 {
        script += &format!(
            "ip -n {router} neigh add {} lladdr 02:00:00:00:01:0{i} dev {PODS} nud permanent\n",
            proxy_testbed::Testbed::backend_ip4(i)
        );
    }
    sh(&script).context("the throughput benchmark's namespaces")
}

fn enter(ns: &str) -> Result<()> {
    let f = File::open(format!("/run/netns/{ns}")).with_context(|| format!("netns {ns}"))?;
    nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("setns {ns}"))
}

fn rx_packets(backend: &str) -> Result<u64> {
    let out = Command::new("ip")
        .args(["-n", backend, "-j", "-s", "link", "show", BACKEND])
        .output()?;
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).with_context(|| format!("ip -s link in {backend}"))?;
    v[0]["stats64"]["rx"]["packets"]
        .as_u64()
        .context("rx packets in ip's answer")
}

/// Runs the measurement at `n` Services on a thread of its own (it moves between
/// namespaces and pins itself to the last CPU).
/// `only` narrows the contenders (to profile one); empty: all.
pub fn throughput(n: usize, frames: u32, rounds: u32, only: &[String]) -> Result<Throughput> {
    let only = only.to_vec();
    let t = std::thread::spawn(move || measure(n, frames, rounds, &only));
    t.join()
        .map_err(|_| anyhow::anyhow!("the throughput benchmark panicked"))?
}

fn measure(n: usize, frames: u32, rounds: u32, only: &[String]) -> Result<Throughput> {
    let tag = format!("xtp{}", std::process::id());
    let all = || CONTENDERS.iter().copied().chain([CONTROL]);
    let ns = Namespaces(
        all()
            .flat_map(|c| [format!("{tag}-{c}-r"), format!("{tag}-{c}-b")])
            .collect(),
    );
    let router = |c: &str| format!("{tag}-{c}-r");
    let backend = |c: &str| format!("{tag}-{c}-b");
    for c in all() {
        topology(&router(c), &backend(c))?;
    }
    let original_ns = File::open("/proc/self/ns/net")?;
    let svcs = services(n);
    let (mut ebpf, maps) = super::xdp::load_with_services(&svcs)?;

    let vip: SocketAddr = format!("{VIP}:80").parse()?;
    let client: SocketAddr = "192.0.2.99:40000".parse()?;
    let mut ack = packet::build_tcp(client, vip, TCP_ACK);
    ack[0..6].copy_from_slice(&UPLINK_MAC);

    // The flow, opened once (one conntrack table for both our hooks): SYN at XDP, the
    // backend's SYN-ACK through the classifier, the ACK at XDP.
    enter(&router("xdp"))?;
    let uplink = nix::net::if_::if_nametoindex(UPLINK)?;
    handshake(&ebpf, &maps, uplink, client, vip)?;

    // Our classifier on the TC contender's uplink; kube-proxy's rules in theirs.
    enter(&router("tc"))?;
    let tc: &mut SchedClassifier = ebpf
        .program_mut("tc_ingress")
        .context("program")?
        .try_into()?;
    tc.attach(
        nix::net::if_::if_nametoindex(UPLINK)?,
        TcAttachType::Ingress,
    )
    .context("attaching tc_ingress in the TC contender's namespace")?;
    nix::sched::setns(&original_ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
    let dir = std::env::temp_dir().join(format!("{tag}-rules"));
    std::fs::create_dir_all(&dir)?;
    let rules = dir.join("rules.iptables");
    std::fs::write(&rules, kube_proxy::iptables_rules(&svcs))?;
    kube_proxy::restore(&router("iptables"), "iptables-restore", &[], &rules)?;
    let rules = dir.join("rules.nft");
    std::fs::write(&rules, kube_proxy::nft_rules(&svcs))?;
    kube_proxy::restore(&router("nftables"), "nft", &["-f"], &rules)?;
    let _ = std::fs::remove_dir_all(&dir);

    // The generator, its frame, and its tail call.
    let mut gen_obj: Ebpf = EbpfLoader::new()
        .load(super::gen_object::BENCH_GEN_OBJECT)
        .context("loading the generator")?;
    let mut frame: Array<_, [u8; HEADERS]> =
        Array::try_from(gen_obj.map_mut("FRAME").context("FRAME")?)?;
    let mut headers = [0u8; HEADERS];
    headers.copy_from_slice(&ack[..HEADERS]);
    frame.set(0, &headers, 0)?;
    let generator: &mut Xdp = gen_obj
        .program_mut("xdp_bench_gen")
        .context("program")?
        .try_into()?;
    generator.load()?;
    let cpu = std::thread::available_parallelism().map_or(1, |n| n.get()) - 1;
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)?;

    let fd_of = |name: &str| -> Result<aya::programs::ProgramFd> {
        let p: &Xdp = ebpf.program(name).context("program")?.try_into()?;
        Ok(p.fd()?.try_clone()?)
    };
    let (ingress_fd, pass_fd) = (fd_of("xdp_ingress")?, fd_of("xdp_pass")?);
    let mut run = |c: &str, frames: u32| -> Result<(u64, Duration)> {
        {
            let mut next = ProgramArray::try_from(gen_obj.map_mut("NEXT").context("NEXT")?)?;
            next.set(0, if c == "xdp" { &ingress_fd } else { &pass_fd }, 0)?;
        }
        enter(&router(c))?;
        let ifindex = nix::net::if_::if_nametoindex(UPLINK)?;
        let before = rx_packets(&backend(c))?;
        let generator: &Xdp = gen_obj
            .program("xdp_bench_gen")
            .context("program")?
            .try_into()?;
        let elapsed = live_run(generator, &ack, ifindex, frames)
            .with_context(|| format!("generating frames for {c}"))?;
        // Whatever a softirq still holds arrives now.
        std::thread::sleep(Duration::from_millis(50));
        Ok((rx_packets(&backend(c))?.saturating_sub(before), elapsed))
    };
    let (leaked, _) = run(CONTROL, 10_000)?;
    if leaked > 0 {
        bail!(
            "{leaked} of 10,000 untranslated frames reached the control's backend: the count is not of translated frames"
        );
    }
    let mut samples: Vec<(Vec<f64>, Vec<f64>)> = vec![(vec![], vec![]); CONTENDERS.len()];
    for round in 0..rounds.max(1) {
        let mut order: Vec<usize> = (0..CONTENDERS.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let c = CONTENDERS[i];
            if !only.is_empty() && !only.iter().any(|o| o == c) {
                continue;
            }
            let (delivered, elapsed) = run(c, frames)?;
            samples[i]
                .0
                .push(delivered as f64 / elapsed.as_secs_f64() / 1e6);
            samples[i].1.push(delivered as f64 / f64::from(frames));
        }
    }
    nix::sched::setns(&original_ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
    drop(ns);
    let rates = CONTENDERS
        .iter()
        .zip(samples)
        .filter(|(_, (mpps, _))| !mpps.is_empty())
        .map(|(c, (mut mpps, mut share))| {
            let (lo, hi) = range(&mpps);
            Rate {
                contender: (*c).to_string(),
                mpps: median(&mut mpps),
                mpps_spread: hi - lo,
                delivered_share: median(&mut share),
            }
        })
        .collect();
    Ok(Throughput {
        services: n,
        rounds: rounds.max(1),
        frames_per_round: frames,
        cpu,
        rates,
    })
}

/// `frames` copies of `data` through `prog` as if received on `ifindex`, for real.
fn live_run(prog: &Xdp, data: &[u8], ifindex: u32, frames: u32) -> Result<Duration> {
    let mut md = [0u8; 24];
    md[4..8].copy_from_slice(&(data.len() as u32).to_ne_bytes());
    md[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    let start = Instant::now();
    prog.test_run(TestRunOptions {
        data_in: Some(data),
        ctx_in: Some(&md),
        repeat: frames,
        attrs: TestRunAttrs::new().xdp_live_frames(64),
        ..Default::default()
    })?;
    Ok(start.elapsed())
}

/// SYN and ACK through `xdp_ingress` (as received on `uplink`), the SYN-ACK through
/// `tc_ingress`: the flow the timed frames belong to.
fn handshake(
    ebpf: &Ebpf,
    maps: &bpf::MapSet,
    uplink: u32,
    client: SocketAddr,
    vip: SocketAddr,
) -> Result<()> {
    let xdp: &Xdp = ebpf.program("xdp_ingress").context("program")?.try_into()?;
    let xdp_run = |data: &[u8]| -> Result<u32> {
        let mut md = [0u8; 24];
        md[4..8].copy_from_slice(&(data.len() as u32).to_ne_bytes());
        md[12..16].copy_from_slice(&uplink.to_ne_bytes());
        let mut out = vec![0u8; 256];
        let res = xdp.test_run(TestRunOptions {
            data_in: Some(data),
            data_out: Some(&mut out),
            ctx_in: Some(&md),
            ..Default::default()
        })?;
        Ok(res.return_value)
    };
    let action = xdp_run(&packet::build_tcp(client, vip, TCP_SYN))?;
    if action != 4 {
        bail!("the XDP program did not redirect the SYN (action {action}): no next hop?");
    }
    let backend = maps
        .conntrack_new
        .iter()
        .filter_map(Result::ok)
        .find(|(k, _)| k.dir == proxy_common::CT_DIR_FORWARD)
        .map(|(k, v)| proxy_common::addr::socket_addr(v.xlate_addr, k.family, v.xlate_port))
        .context("the SYN's flow")?;
    let tc: &SchedClassifier = ebpf.program("tc_ingress").context("program")?.try_into()?;
    let mut out = vec![0u8; 256];
    tc.test_run(TestRunOptions {
        data_in: Some(&packet::build_tcp(backend, client, TCP_SYN | TCP_ACK)),
        data_out: Some(&mut out),
        ..Default::default()
    })?;
    xdp_run(&packet::build_tcp(client, vip, TCP_ACK))?;
    Ok(())
}

/// Whether `e` (from `throughput`) is this kernel refusing live frames
/// (`BPF_F_TEST_XDP_LIVE_FRAMES`: EPERM on some 6.18 kernels, with every capability but
/// `CAP_SYS_RESOURCE`): the harness cannot run here, which is no result either way.
pub fn live_frames_refused(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .any(|io| io.raw_os_error() == Some(libc::EPERM))
}
