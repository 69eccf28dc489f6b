//! Shared by the integration tests; each test binary uses only part of it.
#![allow(dead_code, reason = "each test binary uses part of the support code")]

pub mod fake_apiserver;
pub mod tc_harness;

/// Root is needed to load BPF programs and maps; says why a test skips otherwise.
pub fn root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    eprintln!("SKIP {test}: loading BPF programs and maps (and BPF_PROG_TEST_RUN) needs root");
    false
}
