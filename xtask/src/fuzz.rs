//! `cargo xtask fuzz [--cases N]`: the fuzzing property tests with many cases — the
//! parsers (manifests into the node view, the API server's answers through the agent's
//! client, config, scenarios, `--packet`, the feed's wire messages), the packet fuzzer
//! through the real classifiers, direct server return's option at the backend's node, and the connect fuzzer through the real connect-time
//! hooks (root). `cargo xtask test` runs the same tests with a few cases each (the
//! costlier properties scale N down).

use std::{path::Path, time::Instant};

use anyhow::Result;

use crate::{
    process::run,
    toolchain::{STABLE, cargo},
};

/// The fuzzing test targets of `proxy-agent`.
const TARGETS: [&str; 5] = [
    "fuzz_parsers",
    "fuzz_packets",
    "fuzz_dsr",
    "fuzz_connect",
    "fuzz_wire",
];

/// Runs every target with `cases` cases per property (`seed`: replay a run's
/// `PROPTEST_RNG_SEED`), and prints how long each took.
pub fn run_all(root: &Path, cases: u32, seed: Option<u64>) -> Result<()> {
    let mut took = Vec::new();
    for target in TARGETS {
        let mut cmd = cargo(root, STABLE);
        cmd.args([
            "test",
            "-p",
            "proxy-agent",
            "--test",
            target,
            "--",
            "--nocapture",
        ])
        .env("PROXY_FUZZ_CASES", cases.to_string());
        if let Some(seed) = seed {
            cmd.env("PROPTEST_RNG_SEED", seed.to_string());
        }
        let started = Instant::now();
        run(&mut cmd)?;
        took.push((target, started.elapsed()));
    }
    for (target, t) in took {
        eprintln!(
            "xtask fuzz: {target}: {cases} cases per property, {:.1} min, no failure",
            t.as_secs_f64() / 60.0
        );
    }
    Ok(())
}
