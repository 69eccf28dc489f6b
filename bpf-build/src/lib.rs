//! Builds a BPF crate of the workspace from a build script (aya-build, the pinned
//! nightly, bpf-linker from the project's `.tools/`), into the calling crate's OUT_DIR:
//! the dataplane's programs (`proxy-ebpf`) and the benchmark's generator (`bench-ebpf`)
//! are built the same way.

use std::{env, path::PathBuf};

use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

/// Keep in step with xtask's NIGHTLY.
pub const NIGHTLY: &str = "nightly-2026-10-29";

/// Builds the BPF crate `name` in the workspace folder `dir` (beside the calling crate's
/// manifest folder, or below the workspace root).
pub fn build(name: &str, dir: &str) -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest_dir
        .ancestors()
        .find(|d| d.join(".tools").exists() || d.join("Cargo.lock").exists())
        .context("workspace root")?
        .to_path_buf();
    // bpf-linker lives in the project-local tools folder (`cargo xtask setup`).
    let tools_bin = root.join(".tools/bin");
    if !tools_bin.join("bpf-linker").exists() {
        return Err(anyhow!(
            "bpf-linker not found in {}: run `cargo xtask setup` first",
            tools_bin.display()
        ));
    }
    let mut paths = vec![tools_bin];
    paths.extend(env::split_paths(&env::var_os("PATH").unwrap_or_default()));
    // SAFETY: build scripts are single-threaded at this point.
    unsafe { env::set_var("PATH", env::join_paths(paths)?) };
    println!(
        "cargo::rerun-if-changed={}",
        root.join("proxy-common/src").display()
    );
    let crate_dir = root.join(dir);
    let crate_dir = crate_dir.to_str().context("utf-8 path")?;
    aya_build::build_ebpf(
        [Package {
            name,
            root_dir: crate_dir,
            ..Default::default()
        }],
        Toolchain::Custom(NIGHTLY),
    )
}
