//! What the workspace's test crates share (proxy-agent's integration tests and the crates
//! under tests/): the root guard.
//!
//! Most tests need root: network namespaces, cgroup v2, a bpffs and BPF programs and maps.
//! libtest has no run-time skip, and a test that returns early without root would count
//! as passed. So [`needs_root`] decides when the tests are built: built as root (euid 0),
//! they run; built as another user, they are `#[ignore]`d, and `cargo test` lists them as
//! `ignored, needs root …` and counts them as ignored. A test built as root that then
//! runs without root (or one run with `--ignored`) fails, saying why: it never passes
//! without having run.
//!
//! ```text
//! use test_support::needs_root;
//!
//! #[needs_root]
//! #[test]
//! fn reaches_the_backends() {
//!     // the test, as root
//! }
//! ```
//!
//! The binaries that need root (the demo, benchmarks, the soak) check with [`require_root`].
//!
//! A test that finds at run time that this machine cannot do what it tests (a kernel that
//! refuses a facility) calls [`cannot_run`]: under `cargo xtask test` it is counted as
//! skipped, with the reason; anywhere else it fails. It never passes without having run.

use std::fmt;

/// The guard: put it above a test's `#[test]` or `#[tokio::test]`. See the crate's docs.
pub use test_support_macros::needs_root;

/// What root is needed for.
pub const WHY_ROOT: &str = "network namespaces, cgroup v2, bpffs and BPF programs and maps";

/// `what` needs root and does not run as root.
#[derive(Debug)]
pub struct NotRoot {
    what: String,
    euid: u32,
}

impl fmt::Display for NotRoot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} needs root ({WHY_ROOT}) but runs as uid {}",
            self.what, self.euid
        )
    }
}

impl std::error::Error for NotRoot {}

/// The one root check, of the tests and of the binaries: whether the effective user is
/// root, else why `what` cannot run.
pub fn require_root(what: &str) -> Result<(), NotRoot> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        return Ok(());
    }
    Err(NotRoot {
        what: what.to_string(),
        euid,
    })
}

/// What [`needs_root`] puts first in a test: fails the test, saying why, when it runs
/// without root.
#[doc(hidden)]
#[track_caller]
pub fn assert_root(test: &str) {
    if let Err(e) = require_root(test) {
        panic!(
            "{e}. It was built as root (or runs with --ignored): run it as root, e.g. \
             `cargo xtask test`; built as another user, it is ignored instead"
        );
    }
}

/// The file where tests record that they could not run (`cannot_run`), set by `cargo
/// xtask test`: one `test<TAB>reason` line each.
pub const SKIPS_ENV: &str = "PROXY_TEST_SKIPS";

/// `test` cannot run on this machine, for `why`: recorded for `cargo xtask test`, which
/// counts it as skipped; without that runner (no `PROXY_TEST_SKIPS`), the test fails
/// saying why. Return from the test right after.
#[track_caller]
pub fn cannot_run(test: &str, why: &str) {
    use std::io::Write as _;
    let Some(path) = std::env::var_os(SKIPS_ENV) else {
        panic!("{test} cannot run here: {why} (run by `cargo xtask test`, it is skipped)");
    };
    let line = format!("{test}\t{}\n", why.replace(['\t', '\n'], " "));
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        panic!("{test} cannot run here ({why}), and recording it failed: {e}");
    }
    eprintln!("{test}: skipped, cannot run here: {why}");
}
