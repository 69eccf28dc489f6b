//! `proxy-agent trace`: what happens to a packet, answered by the real programs. Each case
//! gets a private set of maps (never the live pinned ones), the node settings and the
//! objects' node view are written into them, and every packet is run through the real
//! per-packet classifier with `BPF_PROG_TEST_RUN`.
//!
//! Reported path: the per-packet (TC) path, whose outcome is kube-proxy's. The connect-time
//! path reaches the same backends without NAT on the wire (see docs/differences.md).

pub mod connect;
pub mod packet;
pub mod scenario;

use std::{
    collections::{BTreeSet, HashMap},
    net::{IpAddr, SocketAddr},
};

use anyhow::{Context as _, Result};
use aya::{Ebpf, TestRun as _, TestRunOptions, programs::SchedClassifier};

use self::scenario::{Case, Expect, Packet, Verdict};
use crate::{
    dataplane::bpf::{self, MapSet, Mirror, TC_PROGRAM},
    model::{NodeSettings, NodeView, Protocol, node_view},
};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

/// What the programs did with one packet.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Outcome {
    pub case: String,
    pub packet: String,
    /// Which datapath produced the outcome.
    pub path: &'static str,
    pub verdict: Verdict,
    /// Every endpoint new flows were sent to (`dnat` only).
    pub endpoints: Vec<SocketAddr>,
    pub masquerade: bool,
    /// The Service port whose frontend matched, if any.
    pub service: Option<String>,
    /// The scheduler that chose among the endpoints (`dnat` only), and the endpoint the
    /// first packet's flow went to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first: Option<SocketAddr>,
    /// Differences from the file's `expect`; empty when it matched (or said nothing).
    pub mismatches: Vec<String>,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.mismatches.is_empty()
    }
}

/// One case's private dataplane.
struct Bench {
    ebpf: Ebpf,
    nodes: Vec<IpAddr>,
    view: NodeView,
    /// Each service entry's scheduler, as the maps hold it.
    schedulers: HashMap<proxy_common::ServiceKey, u8>,
}

/// The scheduler of every service entry in `maps`.
fn schedulers(maps: &MapSet) -> HashMap<proxy_common::ServiceKey, u8> {
    maps.services
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| (k, v.scheduler))
        .collect()
}

/// The object with private maps and the programs a trace runs already loaded (loading
/// relocates map references, and the map handles are not kept for long).
fn load_programs() -> Result<(Ebpf, MapSet)> {
    let (mut ebpf, maps) = bpf::load_private(&[])?;
    let prog: &mut SchedClassifier = ebpf
        .program_mut(TC_PROGRAM)
        .context("BPF object has no classifier")?
        .try_into()?;
    prog.load().context("loading the classifier")?;
    for name in ["connect4", "connect6"] {
        let prog: &mut aya::programs::CgroupSockAddr = ebpf
            .program_mut(name)
            .with_context(|| format!("BPF object has no {name}"))?
            .try_into()?;
        prog.load().with_context(|| format!("loading {name}"))?;
    }
    Ok((ebpf, maps))
}

impl Bench {
    fn new(case: &Case) -> Result<Self> {
        let (ebpf, mut maps) = load_programs()?;
        let mut state = Mirror::adopt(&maps)?;
        bpf::writer::configure(
            &mut maps,
            &NodeSettings::new(&case.node.info, [], &case.node.view),
            &bpf::ConntrackOptions::default(),
        )?;
        // The programs' own limit, as the runner gives it to the agent's view.
        let view_cfg = crate::model::ViewConfig {
            max_endpoints: bpf::MAX_ENDPOINTS,
            ..case.node.view.clone()
        };
        let (view, rejected) = node_view(&case.model, &case.node.info, &view_cfg);
        for r in rejected {
            tracing::warn!(case = case.id, object = %r.object, reason = r.reason, "object left out");
        }
        let report = state.apply(&mut maps, &view)?;
        anyhow::ensure!(
            report.failed.is_empty(),
            "programming the case failed: {:?}",
            report
                .failed
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        );
        let schedulers = schedulers(&maps);
        drop::<MapSet>(maps);
        Ok(Self {
            ebpf,
            schedulers,
            nodes: case.node.info.addresses.clone(),
            view,
        })
    }

    /// A private copy of a running node's maps (read from its pins, never written), so a
    /// trace cannot disturb live traffic.
    fn from_live(pin_dir: &std::path::Path) -> Result<Self> {
        let live = MapSet::open_pinned(&pin_dir.join("maps"))?;
        let (ebpf, mut maps) = load_programs()?;
        macro_rules! copy {
            ($field:ident) => {
                for entry in live.$field.iter() {
                    let (k, v) = entry?;
                    maps.$field.insert(&k, &v, 0)?;
                }
            };
        }
        // The frontend ports' marks with the entries: the classifier looks a service up
        // only on a marked port (`port_filters`).
        for idx in 0..proxy_common::capacity::FRONTEND_PORTS {
            let ports = live.frontend_ports.get(&idx, 0)?;
            if ports.iter().any(|b| *b != 0) {
                maps.frontend_ports.set(idx, &ports, 0)?;
            }
        }
        copy!(services);
        copy!(slots);
        copy!(backends);
        copy!(rev_nat);
        // What the schedulers read: unequal weights, and connections open now.
        copy!(weights);
        copy!(active_conns);
        for entry in live.local_nets.iter() {
            let (k, v) = entry?;
            maps.local_nets.insert(&k, &v, 0)?;
        }
        for entry in live.source_ranges.iter() {
            let (k, v) = entry?;
            maps.source_ranges.insert(&k, &v, 0)?;
        }
        let cfg = live.node_config.get(&0, 0)?;
        maps.node_config.set(0, &cfg, 0)?;
        let nodes = [
            (cfg.snat_v4, proxy_common::FAMILY_V4),
            (cfg.snat_v6, proxy_common::FAMILY_V6),
        ]
        .into_iter()
        .filter(|(a, _)| *a != [0; 4])
        .map(|(a, f)| proxy_common::addr::from_words(a, f))
        .collect();
        Ok(Self {
            ebpf,
            nodes,
            view: NodeView::new(),
            schedulers: schedulers(&maps),
        })
    }

    fn run(&self, data: &[u8]) -> Result<(u32, Vec<u8>)> {
        let prog: &SchedClassifier = self
            .ebpf
            .program(TC_PROGRAM)
            .context("BPF object has no classifier")?
            .try_into()?;
        let mut out = vec![0u8; data.len() + 256];
        let res = prog.test_run(TestRunOptions {
            data_in: Some(data),
            data_out: Some(&mut out),
            ..Default::default()
        })?;
        out.truncate(res.data_size_out as usize);
        Ok((res.return_value, out))
    }

    /// Whether `dst`'s answer to `src` leaves with another source than `dst`.
    fn reply_rewritten(&self, src: SocketAddr, dst: SocketAddr, proto: Protocol) -> Result<bool> {
        let reply = match proto {
            Protocol::Tcp => packet::build_tcp(dst, src, 0x12),
            _ => packet::build(dst, src, proto),
        };
        let (_, out) = self.run(&reply)?;
        let seen = packet::inspect(&out).map_err(anyhow::Error::msg)?;
        Ok(seen.src != dst)
    }

    fn is_node_address(&self, ip: IpAddr) -> bool {
        ip.is_loopback() || self.nodes.contains(&ip)
    }

    /// Runs `p`: the first flow decides the verdict; for `dnat`, more new flows (other
    /// source ports) show the whole endpoint set.
    fn trace(&self, case: &str, p: &Packet) -> Result<Outcome> {
        let proto = p.protocol;
        let first_port = p.src_port.unwrap_or(40_000);
        let src = SocketAddr::new(p.src, first_port);
        let mut first_packet = packet::build(src, p.dst, proto);
        if let Some(frontend) = p.dsr {
            // No entry node: a trace runs without an interface, where no option is
            // believed (`dsr::refusal`): the forged cases.
            let none = match frontend {
                SocketAddr::V4(_) => IpAddr::from([0u8; 4]),
                SocketAddr::V6(_) => IpAddr::from([0u16; 8]),
            };
            packet::add_dsr(&mut first_packet, frontend, none);
        }
        let (ret, out) = self.run(&first_packet)?;
        let mut endpoints = BTreeSet::new();
        let mut masquerade = false;
        let mut first = None;
        let verdict = match ret {
            TC_ACT_SHOT => Verdict::Drop,
            TC_ACT_REDIRECT => {
                anyhow::ensure!(
                    packet::is_refusal(&out).map_err(anyhow::Error::msg)?,
                    "redirected, but not a reset or an ICMP unreachable"
                );
                Verdict::Reject
            }
            TC_ACT_OK => {
                let seen = packet::inspect(&out).map_err(anyhow::Error::msg)?;
                if seen.dst == p.dst {
                    Verdict::Accept
                } else {
                    // Rewritten to a node address (when the node itself sent it, the
                    // address stays and only the port is reallocated).
                    masquerade = seen.src != src && self.is_node_address(seen.src.ip());
                    endpoints.insert(seen.dst);
                    first = Some(seen.dst);
                    Verdict::Dnat
                }
            }
            // Carried an option: did the node learn its flow? The destination's reply
            // says: it leaves as the frontend then.
            _ if p.dsr.is_some() && self.reply_rewritten(src, p.dst, proto)? => Verdict::Learned,
            // Not ours: what the stack does with it.
            _ if self.is_node_address(p.dst.ip()) => Verdict::Local,
            _ => Verdict::Accept,
        };
        if verdict == Verdict::Dnat {
            let want = p.expect.as_ref().map_or(0, |e| e.endpoints.len()).max(2);
            let tries = 16 + 24 * want as u16;
            for i in 1..=tries {
                let port = probe_port(first_port, i);
                let (ret, out) =
                    self.run(&packet::build(SocketAddr::new(p.src, port), p.dst, proto))?;
                if ret == TC_ACT_OK {
                    endpoints.insert(packet::inspect(&out).map_err(anyhow::Error::msg)?.dst);
                }
            }
        }
        let service = self
            .view
            .iter()
            .find(|(fe, _)| {
                fe.ip == p.dst.ip() && fe.port == p.dst.port() && fe.protocol == p.protocol
            })
            .map(|(_, st)| st.service.clone());
        let mut outcome = Outcome {
            case: case.to_string(),
            packet: p.name.clone(),
            path: "per-packet (tc_ingress)",
            verdict,
            endpoints: endpoints.into_iter().collect(),
            masquerade,
            service,
            scheduler: (verdict == Verdict::Dnat).then(|| self.scheduler_of(p)),
            first,
            mismatches: Vec::new(),
        };
        if let Some(expect) = &p.expect {
            outcome.mismatches = compare(expect, &outcome);
        }
        Ok(outcome)
    }
}

fn compare(expect: &Expect, got: &Outcome) -> Vec<String> {
    let mut m = Vec::new();
    if expect.verdict != got.verdict {
        m.push(
            format!(
                "verdict: expected {:?}, got {:?}",
                expect.verdict, got.verdict
            )
            .to_lowercase(),
        );
    }
    if expect.verdict == Verdict::Dnat && got.verdict == Verdict::Dnat {
        let want: BTreeSet<SocketAddr> = expect.endpoints.iter().copied().collect();
        let have: BTreeSet<SocketAddr> = got.endpoints.iter().copied().collect();
        let missing: Vec<String> = want.difference(&have).map(ToString::to_string).collect();
        let extra: Vec<String> = have.difference(&want).map(ToString::to_string).collect();
        if !missing.is_empty() {
            m.push(format!("endpoints never chosen: {}", missing.join(", ")));
        }
        if !extra.is_empty() {
            m.push(format!("endpoints not expected: {}", extra.join(", ")));
        }
    }
    if let Some(masq) = expect.masquerade
        && masq != got.masquerade
    {
        m.push(format!(
            "masquerade: expected {masq}, got {}",
            got.masquerade
        ));
    }
    m
}

/// Which datapaths a trace runs.
#[derive(Clone, Debug, Default)]
pub struct TraceOptions {
    /// Also (or only, with `skip_tc`) the connect-time path: real connects by a probe
    /// child, this executable run as `<exe> trace-probe`.
    pub connect_probe: Option<std::path::PathBuf>,
    pub skip_tc: bool,
}

const CONNECT_PATH: &str = "connect-time (cgroup connect4/6)";

/// Runs every case of a parsed scenario file. Outcomes come with the index of their
/// packet (over all cases); per case, the per-packet path first.
pub fn run(cases: &[Case], opts: &TraceOptions) -> Result<Vec<(usize, Outcome)>> {
    let mut out = Vec::new();
    let mut index = 0;
    for (n, case) in cases.iter().enumerate() {
        let mut bench = Bench::new(case).with_context(|| format!("case {:?}", case.id))?;
        if !opts.skip_tc {
            for (i, p) in case.packets.iter().enumerate() {
                let o = bench
                    .trace(&case.id, p)
                    .with_context(|| format!("case {:?} packet {:?}", case.id, p.name))?;
                out.push((index + i, o));
            }
        }
        if let Some(exe) = &opts.connect_probe {
            let outcomes = bench
                .connect_trace(case, exe, n)
                .with_context(|| format!("case {:?}: connect-time path", case.id))?;
            out.extend(outcomes.into_iter().map(|(i, o)| (index + i, o)));
        }
        index += case.packets.len();
    }
    Ok(out)
}

impl Bench {
    /// Pod- and node-sourced packets as real connects (outside clients never meet the
    /// connect-time hooks). Masquerade does not apply: nothing is rewritten on the wire.
    fn connect_trace(
        &mut self,
        case: &Case,
        exe: &std::path::Path,
        n: usize,
    ) -> Result<Vec<(usize, Outcome)>> {
        let inside = |ip: IpAddr| {
            self.is_node_address(ip) || case.node.view.pod_cidrs.iter().any(|c| c.contains(&ip))
        };
        let picked: Vec<(usize, &Packet)> = case
            .packets
            .iter()
            .enumerate()
            // SCTP needs the kernel's SCTP stack for a real connect; the per-packet path
            // checks it with crafted packets. A socket sends no DSR option: those packets
            // are the per-packet path's alone.
            .filter(|(_, p)| inside(p.src) && p.protocol != Protocol::Sctp && p.dsr.is_none())
            .collect();
        if picked.is_empty() {
            return Ok(Vec::new());
        }
        let mut listen: BTreeSet<SocketAddr> = BTreeSet::new();
        for st in self.view.values() {
            listen.extend(st.backends.endpoints.iter());
            if let Some(i) = &st.internal {
                listen.extend(i.endpoints.iter());
            }
        }
        let probes: Vec<connect::Probe> = picked
            .iter()
            .map(|(_, p)| {
                listen.insert(p.dst);
                let want = p.expect.as_ref().map_or(0, |e| e.endpoints.len()).max(2) as u32;
                connect::Probe {
                    udp: p.protocol == Protocol::Udp,
                    dst: p.dst,
                    tries: 16 + 24 * want,
                }
            })
            .collect();
        let cgroup = connect::HookedCgroup::new(&mut self.ebpf, &n.to_string())?;
        let results = connect::run_probes(exe, &cgroup.path, &listen, &probes)?;
        let mut out = Vec::new();
        for ((i, p), r) in picked.into_iter().zip(results) {
            let (verdict, endpoints) = match r.error.as_deref() {
                Some("ECONNREFUSED") => (Verdict::Reject, vec![]),
                // Before Linux 5.18 (no bpf_set_retval) a refusal fails the connect with
                // EPERM too: what the frontend was programmed to do tells them apart.
                Some("EPERM") if !bpf::kernel::has_set_retval() => (self.when_empty_of(p), vec![]),
                Some("EPERM") => (Verdict::Drop, vec![]),
                Some(other) => anyhow::bail!("packet {:?}: connect failed: {other}", p.name),
                None if r.peers == [p.dst] && self.is_node_address(p.dst.ip()) => {
                    (Verdict::Local, vec![])
                }
                None if r.peers == [p.dst] => (Verdict::Accept, vec![]),
                None => (Verdict::Dnat, r.peers),
            };
            let mut o = Outcome {
                case: case.id.clone(),
                packet: p.name.clone(),
                path: CONNECT_PATH,
                verdict,
                endpoints,
                masquerade: false,
                service: self.service_of(p),
                scheduler: (verdict == Verdict::Dnat).then(|| self.scheduler_of(p)),
                first: None,
                mismatches: Vec::new(),
            };
            if let Some(e) = &p.expect {
                // By design the connect-time path never masquerades: compare the rest.
                let e = Expect {
                    masquerade: None,
                    ..e.clone()
                };
                o.mismatches = compare(&e, &o);
            }
            out.push((i, o));
        }
        Ok(out)
    }

    /// The scheduler of the frontend `p` is addressed to (its external scope's: the
    /// internal one, where there is one, has the same).
    fn scheduler_of(&self, p: &Packet) -> &'static str {
        let key = bpf::writer::service_key(&crate::model::Frontend {
            ip: p.dst.ip(),
            port: p.dst.port(),
            protocol: p.protocol,
        });
        self.schedulers
            .get(&key)
            .and_then(|code| bpf::codec::scheduler_of_code(*code))
            .unwrap_or_default()
            .name()
    }

    /// What the connect-time hooks do for `p`'s frontend with no endpoint to use: its
    /// internal backend set's (the hooks see pods and the node only).
    fn when_empty_of(&self, p: &Packet) -> Verdict {
        let empty = self
            .state_of(p)
            .map(|st| st.internal.as_deref().unwrap_or(&st.backends).when_empty);
        match empty {
            Some(crate::model::WhenEmpty::Reject) => Verdict::Reject,
            _ => Verdict::Drop,
        }
    }

    /// The Service port whose frontend `p` is addressed to.
    fn service_of(&self, p: &Packet) -> Option<String> {
        self.state_of(p).map(|st| st.service.clone())
    }

    /// The view's state of the frontend `p` is addressed to.
    fn state_of(&self, p: &Packet) -> Option<&crate::model::FrontendState> {
        self.view
            .iter()
            .find(|(fe, _)| {
                fe.ip == p.dst.ip() && fe.port == p.dst.port() && fe.protocol == p.protocol
            })
            .map(|(_, st)| st)
    }
}

/// Runs packets against a copy of a running node's pinned maps (read-only).
pub fn run_live(pin_dir: &std::path::Path, packets: &[Packet]) -> Result<Vec<Outcome>> {
    let bench = Bench::from_live(pin_dir)
        .with_context(|| format!("reading the maps pinned under {}", pin_dir.display()))?;
    let mut out = Vec::new();
    for p in packets {
        let mut o = bench.trace("live", p)?;
        o.path = "per-packet (tc_ingress), live maps (copied, read-only)";
        out.push(o);
    }
    Ok(out)
}

/// Parses `tcp 10.244.0.3:40000 -> 10.96.0.10:80` (the source port may be left out).
pub fn parse_packet_spec(spec: &str) -> Result<Packet, String> {
    let (proto, rest) = spec
        .trim()
        .split_once(char::is_whitespace)
        .ok_or("expected `PROTO SRC -> DST`")?;
    let protocol = match proto.to_ascii_lowercase().as_str() {
        "tcp" => Protocol::Tcp,
        "udp" => Protocol::Udp,
        "sctp" => Protocol::Sctp,
        other => return Err(format!("unsupported protocol {other:?}")),
    };
    let (src, dst) = rest.split_once("->").ok_or("expected `SRC -> DST`")?;
    let (src, src_port) = match src.trim().parse::<SocketAddr>() {
        Ok(sa) => (sa.ip(), Some(sa.port())),
        Err(_) => (
            src.trim()
                .parse::<IpAddr>()
                .map_err(|e| format!("source {src:?}: {e}"))?,
            None,
        ),
    };
    let dst: SocketAddr = dst
        .trim()
        .parse()
        .map_err(|e| format!("destination {dst:?}: {e}"))?;
    if src.is_ipv4() != dst.is_ipv4() {
        return Err("source and destination are of different families".into());
    }
    Ok(Packet {
        name: spec.trim().to_string(),
        protocol,
        src,
        src_port,
        dst,
        dsr: None,
        expect: None,
    })
}

/// `dnat -> a, b masquerade=yes`, or the verdict's name.
fn outcome_text(verdict: Verdict, endpoints: &[SocketAddr], masquerade: Option<bool>) -> String {
    match verdict {
        Verdict::Dnat => format!(
            "dnat -> {} masquerade={}",
            endpoints
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            masquerade.map_or("any", |m| if m { "yes" } else { "no" })
        ),
        v => format!("{v:?}").to_lowercase(),
    }
}

/// Human-readable report lines for one outcome.
pub fn describe(o: &Outcome, p: Option<&Packet>) -> String {
    let what = outcome_text(o.verdict, &o.endpoints, Some(o.masquerade));
    let mut svc = o
        .service
        .as_deref()
        .map(|s| format!("  [{s}]"))
        .unwrap_or_default();
    if let Some(scheduler) = o.scheduler {
        svc.push_str(&format!("  scheduler={scheduler}"));
    }
    if let Some(first) = o.first {
        svc.push_str(&format!(" first={first}"));
    }
    let mut s = format!(
        "  {} {}: {what}{svc}",
        if o.ok() { "ok  " } else { "FAIL" },
        o.packet
    );
    if let Some(e) = p.and_then(|p| p.expect.as_ref())
        && !o.ok()
    {
        let want = outcome_text(e.verdict, &e.endpoints, e.masquerade);
        s.push_str(&format!(
            "\n       - expected: {want}\n       + got:      {what}"
        ));
        for m in &o.mismatches {
            s.push_str(&format!("\n         ({m})"));
        }
    }
    s
}

/// The `i`-th source port after `first` for another new flow: distinct ports, wrapping
/// within 1024..=65535 (a probe from 65535 once collapsed every later one onto 1024).
fn probe_port(first: u16, i: u16) -> u16 {
    const LOW: u32 = 1024;
    const SPAN: u32 = 65536 - LOW;
    let base = u32::from(first).max(LOW) - LOW;
    (LOW + (base + u32::from(i)) % SPAN) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_ports_stay_distinct_across_the_top() {
        let ports: std::collections::BTreeSet<u16> =
            (1..=100).map(|i| probe_port(65_535, i)).collect();
        assert_eq!(ports.len(), 100);
        assert!(ports.iter().all(|p| *p >= 1024 && *p != 65_535));
        assert_eq!(probe_port(40_000, 1), 40_001);
    }
}
