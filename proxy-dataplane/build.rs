//! Builds the BPF object with the pinned nightly (via aya-build) so the dataplane can
//! embed it.

use std::{env, path::PathBuf};

use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

/// Keep in step with xtask's NIGHTLY.
const NIGHTLY: &str = "nightly-2026-10-29";

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest_dir.parent().context("workspace root")?;
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
    println!("cargo::rerun-if-changed=../proxy-common/src");
    let ebpf_dir = root.join("proxy-ebpf");
    let ebpf_dir = ebpf_dir.to_str().context("utf-8 path")?;
    aya_build::build_ebpf(
        [Package {
            name: "proxy-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        Toolchain::Custom(NIGHTLY),
    )
}
