//! The pinned toolchains (stable for the workspace, the nightly for the BPF crate) and
//! bpf-linker in the project-local `.tools/` folder, linked against the nightly's LLVM.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result};

use crate::{
    packages,
    process::{output, run},
};

pub const STABLE: &str = "1.99.1";
pub const NIGHTLY: &str = "nightly-2026-10-29";
pub const BPF_LINKER: &str = "bpf-linker@0.13.0";
pub const BPF_LINKER_VERSION: &str = "bpf-linker 0.13.0";
pub const BPF_TARGET: &str = "bpfel-unknown-none";

pub fn workspace_root() -> Result<PathBuf> {
    let manifest = env::var("CARGO_MANIFEST_DIR").context("run through `cargo xtask`")?;
    Ok(Path::new(&manifest)
        .parent()
        .context("xtask has a parent folder")?
        .to_path_buf())
}

pub fn tools_dir(root: &Path) -> PathBuf {
    root.join(".tools")
}

/// A cargo command for `toolchain`, with the project's tools first on PATH.
pub fn cargo(root: &Path, toolchain: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", toolchain, "cargo"]).current_dir(root);
    let path = env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![tools_dir(root).join("bin")];
    paths.extend(env::split_paths(&path));
    if let Ok(joined) = env::join_paths(paths) {
        cmd.env("PATH", joined);
    }
    // A toolchain chosen by an outer `cargo +x` must not leak into the inner build.
    for key in ["RUSTC", "RUSTDOC", "RUSTUP_TOOLCHAIN", "CARGO"] {
        cmd.env_remove(key);
    }
    cmd
}

fn toolchain_ready(name: &str, component: &str) -> bool {
    Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", name])
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(component))
        .unwrap_or(false)
}

pub fn setup(root: &Path) -> Result<()> {
    packages::ensure()?;
    if !toolchain_ready(STABLE, "clippy") {
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            STABLE,
            "--profile",
            "minimal",
            "--component",
            "clippy,rustfmt",
        ]))?;
    }
    if !toolchain_ready(NIGHTLY, "rust-src") {
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            NIGHTLY,
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))?;
    }
    let tools = tools_dir(root);
    let linker = tools.join("bin/bpf-linker");
    let works = Command::new(&linker)
        .arg("--version")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .map(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION)
        })
        .unwrap_or(false);
    if works {
        return Ok(());
    }
    eprintln!("xtask: installing {BPF_LINKER} into {}", tools.display());
    let sysroot =
        output(Command::new("rustc").args([&format!("+{NIGHTLY}"), "--print", "sysroot"]))?;
    let sysroot = PathBuf::from(sysroot.trim());
    let version = output(Command::new("rustc").args([&format!("+{NIGHTLY}"), "-vV"]))?;
    let llvm_major = version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("nightly rustc reports no LLVM version")?
        .to_string();
    let lib_dir = sysroot.join("lib");
    let libllvm = std::fs::read_dir(&lib_dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("libLLVM.so."))
        .with_context(|| format!("no libLLVM.so.* in {}", lib_dir.display()))?;
    // bpf-linker's build looks for libLLVM.so under LLVM_PREFIX/lib.
    let shim = tools.join("llvm-shim/lib");
    std::fs::create_dir_all(&shim)?;
    let link = shim.join("libLLVM.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(lib_dir.join(&libllvm), &link)?;
    let mut cmd = cargo(root, STABLE);
    cmd.args(["install", "--locked", "--root"])
        .arg(&tools)
        .args([BPF_LINKER, "--no-default-features", "--features"])
        .arg(format!("llvm-{llvm_major}"))
        .env("LLVM_PREFIX", tools.join("llvm-shim"))
        // The linker resolves libLLVM through RUNPATH at the nightly's own lib folder.
        .env(
            "RUSTFLAGS",
            format!("-C link-arg=-Wl,-rpath,{}", lib_dir.display()),
        );
    run(&mut cmd)?;
    run(Command::new(&linker)
        .arg("--version")
        .env_remove("LD_LIBRARY_PATH"))
}

pub fn build_ebpf(root: &Path) -> Result<()> {
    let mut cmd = cargo(root, NIGHTLY);
    cmd.args([
        "build",
        "-p",
        "proxy-ebpf",
        "--release",
        "--target",
        BPF_TARGET,
        "-Z",
        "build-std=core",
    ])
    // The same flags aya-build uses from proxy-dataplane's build.rs.
    .env(
        "CARGO_ENCODED_RUSTFLAGS",
        format!(
            "--cfg=bpf_target_arch=\"{}\"\x1f-Cdebuginfo=2\x1f-Clink-arg=--btf",
            std::env::consts::ARCH
        ),
    );
    run(&mut cmd)?;
    eprintln!(
        "xtask: BPF object at {}",
        root.join("target")
            .join(BPF_TARGET)
            .join("release/proxy-ebpf")
            .display()
    );
    Ok(())
}
