//! `cfg(proxy_root)` when this crate is built as root (euid 0): `#[needs_root]` then leaves
//! the tests to run; otherwise it marks them ignored, so a non-root `cargo test` counts them
//! as ignored (and says why) instead of as passed.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(proxy_root)");
    // Cargo does not know who builds. These change with the user (su, sudo, a login), so a
    // build as another user re-runs this script and rebuilds the tests that depend on it.
    for var in ["USER", "LOGNAME", "HOME", "SUDO_UID"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    println!("cargo::rerun-if-changed=build.rs");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        println!("cargo::rustc-cfg=proxy_root");
    }
}
