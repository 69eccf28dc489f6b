//! Shared by the integration tests; each test binary uses only part of it.
#![allow(dead_code, reason = "each test binary uses part of the support code")]

/// One fake API server for these tests and the test crates' (proxy-testbed's, which the
/// e2e suite and the churn, fan-out and soak benchmarks use).
#[path = "../../../tests/testbed/src/fake_apiserver.rs"]
pub mod fake_apiserver;
pub mod logs;
pub mod tc_harness;
pub mod testbed;

/// Cases per property: `PROXY_FUZZ_CASES` (the long run, `cargo xtask fuzz`), else
/// `default` (a few seconds, for every `cargo xtask test`). `PROPTEST_RNG_SEED` replays a run.
/// `fuzz_config` for costlier properties: `default` cases, or the long run's divided by
/// `divisor`.
pub fn fuzz_config_scaled(default: u32, divisor: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROXY_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .map_or(default, |n| (n / divisor.max(1)).max(1));
    proptest::test_runner::Config {
        cases,
        ..fuzz_config(default)
    }
}

pub fn fuzz_config(default: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROXY_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    proptest::test_runner::Config {
        cases,
        // Minimized failures become named regression tests, not files beside the source.
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    }
}
