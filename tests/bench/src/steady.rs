//! The per-packet cost in steady state: `BPF_PROG_TEST_RUN` with a repeat count, so the
//! program and the maps it touches stay in the caches as under a stream of packets (a
//! single run starts cold: the syscall's own skb and copies evict them first). A run of
//! `repeat` sees one packet again and again, so every contender sits behind the same
//! front (`bench_gen.rs`) that writes the original headers back first — and, for new
//! flows, takes the next source port — then tail-calls it; the pass-through program
//! behind the front is the baseline. Medians of interleaved rounds, with their spread.

use super::gen_object::BENCH_GEN_OBJECT;
use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf, EbpfLoader, TestRun as _, TestRunOptions,
    maps::{Array, ProgramArray},
    programs::{ProgramFd, SchedClassifier, Xdp},
};

use super::{median, spread_of};

/// Bytes the front restores (`bench_gen.rs`'s `HEADERS`).
const HEADERS: usize = 54;

/// Nanoseconds per packet in steady state: medians over rounds, and each one's spread.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Steady {
    pub rounds: u32,
    pub repeat: u32,
    pub xdp_established_ns: f64,
    pub xdp_established_spread_ns: f64,
    pub xdp_pass_ns: f64,
    pub xdp_pass_spread_ns: f64,
    pub tc_established_ns: f64,
    pub tc_established_spread_ns: f64,
    pub tc_new_flow_ns: f64,
    pub tc_new_flow_spread_ns: f64,
    /// The backend's packet of the established flow (the reply direction), at TC.
    pub tc_reply_ns: f64,
    pub tc_reply_spread_ns: f64,
    pub tc_pass_ns: f64,
    pub tc_pass_spread_ns: f64,
}

impl Steady {
    pub fn xdp_established_vs_pass(&self) -> f64 {
        self.xdp_established_ns / self.xdp_pass_ns.max(1.0)
    }

    pub fn tc_established_vs_pass(&self) -> f64 {
        self.tc_established_ns / self.tc_pass_ns.max(1.0)
    }

    pub fn tc_new_flow_vs_pass(&self) -> f64 {
        self.tc_new_flow_ns / self.tc_pass_ns.max(1.0)
    }

    pub fn tc_reply_vs_pass(&self) -> f64 {
        self.tc_reply_ns / self.tc_pass_ns.max(1.0)
    }
}

/// The packets: an established flow's `ack` (through both hooks; received on `uplink` at
/// XDP) and its backend's `reply` (TC only), and a SYN template `syn` whose source port
/// the front varies (TC only).
pub struct Packets<'a> {
    pub ack: &'a [u8],
    pub reply: &'a [u8],
    pub syn: &'a [u8],
    pub uplink: u32,
}

/// Measures `ebpf`'s loaded `xdp_ingress`, `xdp_pass`, `tc_ingress` and `tc_pass` behind
/// the fronts, `rounds` interleaved rounds of `repeat` runs each.
pub fn measure(ebpf: &Ebpf, p: &Packets<'_>, rounds: u32, repeat: u32) -> Result<Steady> {
    let mut front: Ebpf = EbpfLoader::new()
        .load(BENCH_GEN_OBJECT)
        .context("loading the front")?;
    {
        let x: &mut Xdp = front
            .program_mut("xdp_bench_gen")
            .context("program")?
            .try_into()?;
        x.load()?;
        let t: &mut SchedClassifier = front
            .program_mut("tc_bench_gen")
            .context("program")?
            .try_into()?;
        t.load()?;
    }
    let xdp_fd = |name: &str| -> Result<ProgramFd> {
        let p: &Xdp = ebpf.program(name).context("program")?.try_into()?;
        Ok(p.fd()?.try_clone()?)
    };
    let tc_fd = |name: &str| -> Result<ProgramFd> {
        let p: &SchedClassifier = ebpf.program(name).context("program")?.try_into()?;
        Ok(p.fd()?.try_clone()?)
    };
    let contenders = [
        ("xdp_pass", xdp_fd("xdp_pass")?),
        ("xdp_ingress", xdp_fd("xdp_ingress")?),
        ("tc_pass", tc_fd("tc_pass")?),
        ("tc_ingress", tc_fd("tc_ingress")?),
    ];
    let mut samples: [Vec<f64>; 6] = Default::default();
    for round in 0..rounds.max(1) {
        let mut order: Vec<usize> = (0..6).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            // 0..4: the contenders on the established flow's packet; 4: new flows at TC;
            // 5: the flow's reply at TC.
            let (name, fd) = &contenders[i.min(3)];
            let new_flows = i == 4;
            let data = match i {
                4 => p.syn,
                5 => p.reply,
                _ => p.ack,
            };
            // Every new flow its own source port (the front has 60,000), over all rounds.
            let n = if new_flows {
                repeat.min(59_000 / rounds.max(1))
            } else {
                repeat
            };
            let ns = run(&mut front, p.uplink, data, name, fd, new_flows, n)?;
            samples[i].push(ns);
        }
    }
    let [mut xp, mut xe, mut tp, mut te, mut tn, mut tr] = samples;
    Ok(Steady {
        rounds: rounds.max(1),
        repeat,
        xdp_pass_spread_ns: spread_of(&xp),
        xdp_established_spread_ns: spread_of(&xe),
        tc_pass_spread_ns: spread_of(&tp),
        tc_established_spread_ns: spread_of(&te),
        tc_new_flow_spread_ns: spread_of(&tn),
        tc_reply_spread_ns: spread_of(&tr),
        tc_reply_ns: median(&mut tr),
        xdp_pass_ns: median(&mut xp),
        xdp_established_ns: median(&mut xe),
        tc_pass_ns: median(&mut tp),
        tc_established_ns: median(&mut te),
        tc_new_flow_ns: median(&mut tn),
    })
}

/// One round of one contender: the mean of `repeat` runs, as the kernel times them.
fn run(
    front: &mut Ebpf,
    uplink: u32,
    data: &[u8],
    contender: &str,
    fd: &ProgramFd,
    new_flows: bool,
    repeat: u32,
) -> Result<f64> {
    let xdp = contender.starts_with("xdp");
    let mut headers = [0u8; HEADERS];
    headers.copy_from_slice(data.get(..HEADERS).context("a short packet")?);
    Array::<_, [u8; HEADERS]>::try_from(front.map_mut("FRAME").context("FRAME")?)?
        .set(0, &headers, 0)?;
    Array::<_, u32>::try_from(front.map_mut("STEP").context("STEP")?)?.set(
        0,
        &u32::from(new_flows),
        0,
    )?;
    let slot = if xdp { "NEXT" } else { "NEXT_TC" };
    ProgramArray::try_from(front.map_mut(slot).context("program array")?)?.set(0, fd, 0)?;
    let mut out = vec![0u8; 256];
    let res = if xdp {
        let prog: &Xdp = front
            .program("xdp_bench_gen")
            .context("program")?
            .try_into()?;
        let mut md = [0u8; 24];
        md[4..8].copy_from_slice(&(data.len() as u32).to_ne_bytes());
        md[12..16].copy_from_slice(&uplink.to_ne_bytes());
        prog.test_run(TestRunOptions {
            data_in: Some(data),
            data_out: Some(&mut out),
            ctx_in: Some(&md),
            repeat,
            ..Default::default()
        })?
    } else {
        let prog: &SchedClassifier = front
            .program("tc_bench_gen")
            .context("program")?
            .try_into()?;
        prog.test_run(TestRunOptions {
            data_in: Some(data),
            data_out: Some(&mut out),
            repeat,
            ..Default::default()
        })?
    };
    // What each contender answers when it ran (the front's own failures answer XDP's
    // ABORTED or TC's SHOT): the pass-through programs pass, ours translated the packet
    // (an address changed).
    let addrs = |b: &[u8]| b.get(26..34).map(<[u8]>::to_vec);
    let ran = match contender {
        "xdp_pass" => res.return_value == 2,
        "xdp_ingress" => res.return_value == 4,
        "tc_pass" => res.return_value == 0,
        _ => addrs(&out) != addrs(data),
    };
    if !ran {
        bail!(
            "{contender} behind the front answered {} (did it run?)",
            res.return_value
        );
    }
    Ok(res.duration.as_nanos() as f64)
}
