//! What each scheduler adds to a new flow (issue 14): one Service of ten endpoints per
//! scheduler (and `mh` on two more table lengths), all in one private map set, fed the
//! same new flows (SYNs) through the real classifier with BPF_PROG_TEST_RUN, in rounds
//! (every scheduler once per round, so drift hits all alike), and compared with
//! `random` measured in the same run.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr},
    ops::Range,
};

use anyhow::{Context as _, Result, bail};
use aya::{TestRun as _, TestRunOptions, programs::SchedClassifier};
use proxy_agent::{
    dataplane::bpf::{self, MapSet, Mirror},
    model::NodeView,
    model::schedule::{DEFAULT_MAGLEV_TABLE_LEN, MAGLEV_TABLE_LENS, Schedule, Scheduler},
    trace::packet,
};
use proxy_common::{CtKey, map_names};

use super::{BACKEND_PORT, CONNTRACK_NEW_ROOM, TCP_SYN, cluster_ip, median};

/// Endpoints of each measured Service.
pub const ENDPOINTS: u32 = 10;

/// How much to measure.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Runs {
    /// New flows per scheduler per round (the new-flow table is emptied after each).
    pub batch: u32,
    /// Rounds, after one round of warm-up that is not counted.
    pub rounds: u32,
}

/// One scheduler's figures.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SchedulerCost {
    /// The scheduler (`mh/65521`: `mh` on a table of that length).
    pub scheduler: String,
    /// Mean kernel time of the classifier per new flow, over every round.
    pub new_flow_ns: f64,
    /// The median over rounds of this round's time ÷ random's (a round another process
    /// disturbed does not move it); and the lowest and highest of those ratios, which
    /// show how far drift and interference moved them.
    pub ratio_to_random: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    /// Distinct endpoints the measured flows went to (`dh`: one, by design).
    pub endpoints_reached: usize,
}

/// Every scheduler's new-flow cost, measured in one run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SchedulerCosts {
    pub endpoints: u32,
    pub flows_per_scheduler: u64,
    /// A program that only returns, run on the same packets: the floor of
    /// BPF_PROG_TEST_RUN's own timing, in every figure above.
    pub pass_through_ns: f64,
    pub schedulers: Vec<SchedulerCost>,
}

/// One measured Service.
struct Measured {
    /// The scheduler's name, and the Maglev table length where it is not the default.
    label: String,
    schedule: Schedule,
    vip: SocketAddr,
    endpoints: BTreeSet<SocketAddr>,
}

/// Every scheduler (hashing ones on the default Maglev table), then `mh` on the
/// smallest and the largest table: the slot lookup's cost grows with the table.
fn contenders() -> Vec<(String, Schedule)> {
    let schedule = |s, len| Schedule::new(s, Default::default(), len);
    let mut out: Vec<(String, Schedule)> = Scheduler::ALL
        .into_iter()
        .map(|s| (s.name().to_string(), schedule(s, DEFAULT_MAGLEV_TABLE_LEN)))
        .collect();
    for len in [
        MAGLEV_TABLE_LENS[0],
        MAGLEV_TABLE_LENS[MAGLEV_TABLE_LENS.len() - 1],
    ] {
        out.push((format!("mh/{len}"), schedule(Scheduler::Mh, len)));
    }
    out
}

/// Service `i`: its own ClusterIP and ten endpoints of its own (10.50.i.1-10).
fn measured(i: usize, label: String, schedule: Schedule) -> Measured {
    let vip = Ipv4Addr::new(10, 96, 1, i as u8 + 1);
    let endpoints = (1..=ENDPOINTS)
        .map(|k| SocketAddr::from((Ipv4Addr::new(10, 50, i as u8, k as u8), BACKEND_PORT)))
        .collect();
    Measured {
        label,
        schedule,
        vip: SocketAddr::from((vip, 80)),
        endpoints,
    }
}

/// New flow `k`'s client: 65,536 addresses (so `sh`, which hashes only the address,
/// spreads) × 60,000 ports, never the same tuple twice in a run.
fn client(k: u32) -> SocketAddr {
    let addr = Ipv4Addr::from(0x0af4_0000 | (k & 0xffff)); // 10.244.0.0/16
    let port = 1024 + (k >> 16) % 60_000;
    SocketAddr::from((addr, port as u16))
}

pub fn new_flow_costs(runs: Runs) -> Result<SchedulerCosts> {
    let (mut ebpf, mut maps) =
        bpf::load_private(&[(map_names::CONNTRACK_NEW, CONNTRACK_NEW_ROOM)])?;
    for name in ["tc_ingress", "tc_pass"] {
        let prog: &mut SchedClassifier = ebpf.program_mut(name).context("program")?.try_into()?;
        prog.load().with_context(|| format!("loading {name}"))?;
    }
    let services: Vec<Measured> = contenders()
        .into_iter()
        .enumerate()
        .map(|(i, (label, schedule))| measured(i, label, schedule))
        .collect();
    let mut view = NodeView::new();
    for m in &services {
        let (fe, state) = cluster_ip(m.vip.ip(), m.endpoints.clone(), m.schedule.clone());
        view.insert(fe, state);
    }
    let report = Mirror::adopt(&maps)?.apply(&mut maps, &view)?;
    if !report.failed.is_empty() {
        bail!("programming the measured Services: {:?}", report.failed);
    }
    let ingress: &SchedClassifier = ebpf.program("tc_ingress").context("program")?.try_into()?;
    let pass: &SchedClassifier = ebpf.program("tc_pass").context("program")?.try_into()?;

    // Warm-up: round-robin cursors, connection counts (the least-connection schedulers
    // read them; they appear as flows open) and caches, as a busy node has them.
    let flows = |round: u32| round * runs.batch..(round + 1) * runs.batch;
    let mut reached = vec![BTreeSet::new(); services.len()];
    for (m, reached) in services.iter().zip(&mut reached) {
        batch(ingress, m, flows(0), reached)?;
        forget_new_flows(&mut maps)?;
    }
    reached.iter_mut().for_each(BTreeSet::clear);

    let mut pass_ns = 0u128;
    // Per service, per round: kernel nanoseconds for the batch.
    let mut ns = vec![Vec::new(); services.len()];
    for round in 1..=runs.rounds {
        pass_ns += pass_through(pass, &services[0], flows(round))?;
        for (i, m) in services.iter().enumerate() {
            ns[i].push(batch(ingress, m, flows(round), &mut reached[i])?);
            forget_new_flows(&mut maps)?;
        }
    }
    drop(maps);

    let flows_per_scheduler = u64::from(runs.batch) * u64::from(runs.rounds);
    let random = services
        .iter()
        .position(|m| m.schedule.scheduler == Scheduler::Random)
        .context("Scheduler::ALL has random")?;
    let mean = |rounds: &[u128]| rounds.iter().sum::<u128>() as f64 / flows_per_scheduler as f64;
    let schedulers = services
        .iter()
        .zip(&ns)
        .zip(&reached)
        .map(|((m, rounds), reached)| {
            let mut per_round: Vec<f64> = rounds
                .iter()
                .zip(&ns[random])
                .map(|(a, b)| *a as f64 / (*b).max(1) as f64)
                .collect();
            SchedulerCost {
                scheduler: m.label.clone(),
                new_flow_ns: mean(rounds),
                ratio_to_random: median(&mut per_round),
                // `median` sorted them.
                ratio_min: per_round.first().copied().unwrap_or(0.0),
                ratio_max: per_round.last().copied().unwrap_or(0.0),
                endpoints_reached: reached.len(),
            }
        })
        .collect();
    Ok(SchedulerCosts {
        endpoints: ENDPOINTS,
        flows_per_scheduler,
        pass_through_ns: pass_ns as f64 / flows_per_scheduler as f64,
        schedulers,
    })
}

/// Opens new flows `ks` to `m`'s ClusterIP; the kernel's nanoseconds for them all. Each
/// must leave translated to an endpoint: anything else (a drop, a refusal, an
/// established flow) is not the path this measures.
fn batch(
    prog: &SchedClassifier,
    m: &Measured,
    ks: Range<u32>,
    reached: &mut BTreeSet<SocketAddr>,
) -> Result<u128> {
    let name = &m.label;
    let mut total = 0u128;
    let mut out = vec![0u8; 256];
    for k in ks {
        let src = client(k);
        let data = packet::build_tcp(src, m.vip, TCP_SYN);
        let res = prog
            .test_run(TestRunOptions {
                data_in: Some(&data),
                data_out: Some(&mut out),
                ..Default::default()
            })
            .with_context(|| format!("{name}: running tc_ingress"))?;
        total += res.duration.as_nanos();
        let seen = packet::inspect(&out[..res.data_size_out as usize])
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("{name}: the SYN from {src}"))?;
        if !m.endpoints.contains(&seen.dst) {
            bail!(
                "{name}: the SYN from {src} to {} left for {} (verdict {}), not an endpoint",
                m.vip,
                seen.dst,
                res.return_value
            );
        }
        reached.insert(seen.dst);
    }
    Ok(total)
}

/// The same packets through a program that only returns.
fn pass_through(prog: &SchedClassifier, m: &Measured, ks: Range<u32>) -> Result<u128> {
    let mut total = 0u128;
    let mut out = vec![0u8; 256];
    for k in ks {
        let data = packet::build_tcp(client(k), m.vip, TCP_SYN);
        let res = prog
            .test_run(TestRunOptions {
                data_in: Some(&data),
                data_out: Some(&mut out),
                ..Default::default()
            })
            .context("running tc_pass")?;
        total += res.duration.as_nanos();
    }
    Ok(total)
}

/// Empties the new-flow table: every batch starts from the same state, and the LRU
/// never evicts (evictions would be measured as the scheduler's cost).
fn forget_new_flows(maps: &mut MapSet) -> Result<()> {
    let keys: Vec<CtKey> = maps
        .conntrack_new
        .keys()
        .collect::<Result<_, _>>()
        .context("listing CONNTRACK_NEW")?;
    for key in keys {
        maps.conntrack_new
            .remove(&key)
            .context("emptying CONNTRACK_NEW")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    #[test]
    fn clients_never_repeat_within_a_run() {
        let seen: BTreeSet<SocketAddr> = (0..200_000).map(client).collect();
        assert_eq!(seen.len(), 200_000);
        assert_ne!(client(0).ip(), IpAddr::from(Ipv4Addr::UNSPECIFIED));
    }
}
