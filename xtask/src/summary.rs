//! `cargo xtask test`'s last line: how many tests ran, passed, failed and were skipped
//! (and why), read from libtest's own output as it streams past.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, ExitStatus, Stdio},
    thread,
};

use anyhow::{Context as _, Result};

/// What the test binaries reported.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    /// Why tests were skipped (libtest's `ignored, <reason>`), with how many.
    pub reasons: BTreeMap<String, u64>,
    /// The tests that failed.
    pub failures: Vec<String>,
    /// The test binaries cargo reports as failed (`error: test failed, to rerun pass ...`).
    pub failed_binaries: Vec<String>,
}

impl Summary {
    /// Takes in one line of the run's output.
    pub fn read(&mut self, line: &str) {
        let line = line.trim_end();
        if let Some(rest) = line.strip_prefix("test result: ") {
            for part in rest.split(';') {
                let mut words = part.split_whitespace().rev();
                let (Some(what), Some(n)) = (words.next(), words.next()) else {
                    continue;
                };
                let Ok(n) = n.parse::<u64>() else { continue };
                match what {
                    "passed" => self.passed += n,
                    "failed" => self.failed += n,
                    "ignored" => self.ignored += n,
                    _ => {}
                }
            }
        } else if let Some(test) = line.strip_prefix("test ") {
            if let Some((name, reason)) = test.split_once(" ... ignored, ") {
                let _ = name;
                *self.reasons.entry(reason.to_string()).or_default() += 1;
            } else if let Some(name) = test.strip_suffix(" ... ignored") {
                let _ = name;
                *self.reasons.entry("no reason given".into()).or_default() += 1;
            } else if let Some(name) = test.strip_suffix(" ... FAILED") {
                self.failures.push(name.to_string());
            }
        } else if let Some(rest) = line.strip_prefix("error: test failed, to rerun pass `") {
            self.failed_binaries
                .push(rest.trim_end_matches('`').to_string());
        }
    }

    /// Moves the tests that recorded they could not run (`test_support::cannot_run`, one
    /// `test<TAB>reason` line each in `skips`) from passed to skipped.
    pub fn take_skips(&mut self, skips: &str) {
        for line in skips.lines() {
            let Some((_, why)) = line.split_once('\t') else {
                continue;
            };
            self.passed = self.passed.saturating_sub(1);
            self.ignored += 1;
            *self
                .reasons
                .entry(format!("cannot run here: {why}"))
                .or_default() += 1;
        }
    }

    /// The one line.
    pub fn line(&self) -> String {
        let ran = self.passed + self.failed;
        let mut s = format!(
            "xtask test: {ran} tests ran: {} passed, {} failed, {} skipped",
            self.passed, self.failed, self.ignored
        );
        if !self.reasons.is_empty() {
            let why: Vec<String> = self
                .reasons
                .iter()
                .map(|(r, n)| format!("{n} {r}"))
                .collect();
            s += &format!(" ({})", why.join("; "));
        }
        if !self.failures.is_empty() {
            s += &format!("; failed: {}", self.failures.join(", "));
        }
        if !self.failed_binaries.is_empty() {
            s += &format!("; failing binaries: {}", self.failed_binaries.join(", "));
        }
        s
    }
}

/// Runs `cmd`, passing its output through, and reads the summary from it.
pub fn run(cmd: &mut Command) -> Result<(ExitStatus, Summary)> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {cmd:?}"))?;
    let stderr = child.stderr.take().context("stderr")?;
    // cargo reports failed binaries on stderr, libtest its results on stdout.
    let errors = thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            lines.push(line);
        }
        lines
    });
    let mut summary = Summary::default();
    let stdout = child.stdout.take().context("stdout")?;
    let mut out = std::io::stdout().lock();
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        let _ = writeln!(out, "{line}");
        summary.read(&line);
    }
    drop(out);
    for line in errors.join().unwrap_or_default() {
        summary.read(&line);
    }
    Ok((child.wait()?, summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test that recorded it could not run counts as skipped, with its reason, not
    /// as passed.
    #[test]
    fn a_test_that_cannot_run_counts_as_skipped() {
        let mut s = Summary::default();
        s.read("test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.0s");
        s.take_skips("live_frames\tthe kernel refuses live frames (EPERM)\n");
        assert_eq!((s.passed, s.ignored), (2, 1));
        assert!(
            s.line()
                .contains("1 cannot run here: the kernel refuses live frames (EPERM)")
        );
    }

    #[test]
    fn counts_results_reasons_and_failures() {
        let mut s = Summary::default();
        for line in [
            "test a ... ok",
            "test b ... ignored, needs root (network namespaces)",
            "test c ... ignored, needs root (network namespaces)",
            "test d ... FAILED",
            "test result: FAILED. 5 passed; 1 failed; 2 ignored; 0 measured; 0 filtered out; finished in 1.0s",
            "test result: ok. 7 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.1s",
            "error: test failed, to rerun pass `-p proxy-agent --test tc_test_run`",
        ] {
            s.read(line);
        }
        assert_eq!((s.passed, s.failed, s.ignored), (12, 1, 2));
        assert_eq!(s.failures, ["d"]);
        assert_eq!(
            s.line(),
            "xtask test: 13 tests ran: 12 passed, 1 failed, 2 skipped (2 needs root (network \
             namespaces)); failed: d; failing binaries: -p proxy-agent --test tc_test_run"
        );
    }
}
