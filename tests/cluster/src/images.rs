//! The box's Pod images, made here with no registry: pause (from upstream's pause.c),
//! agnhost (its Go source, beside busybox, curl and OpenBSD nc, which the e2e specs exec)
//! and the agent's, each a docker-archive tarball that `ctr images import` takes, named as
//! the e2e suite and deploy/ name them.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

/// What k8s.io/kubernetes v1.37.2 names them (test/utils/image/manifest.go, and the
/// kubelet's default sandbox image in cmd/kubelet/app/options/container_runtime.go).
pub const PAUSE: &str = "registry.k8s.io/pause:3.10.2";
pub const AGNHOST: &str = "registry.k8s.io/e2e-test-images/agnhost:2.66.1";
/// The e2e suite's busybox (init containers, e.g. the Conntrack spec whose endpoints start
/// unready).
pub const BUSYBOX_IMAGE: &str = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2";
/// deploy/daemonset.yaml's image (kustomization.yaml's tag).
pub const AGENT: &str = "proxy-agent:0.1.0";

/// Host programs copied, with the libraries `ldd` names, into the agnhost image: what
/// the e2e specs run inside it (`curl`, `wget -q -O - -T 1`, `nc -v -t -w 2`, `ip`).
/// GNU wget: Debian 12's busybox (1.35) wget segfaults when given `-T`, as the Services
/// specs' `verifyServeHostnameServiceUp` does.
const AGNHOST_TOOLS: [&str; 4] = [
    "/usr/bin/curl",
    "/usr/bin/wget",
    "/usr/bin/nc.openbsd",
    "/usr/bin/ip",
];
/// Bumped when what goes into the cached images changes, so a stale one is rebuilt.
const RECIPE: u32 = 3;
/// Busybox gives the rest of the shell tools (nslookup, mountpoint, mount).
const BUSYBOX: &str = "/bin/busybox";
/// Not busybox's: Debian builds its ash to run its own applets before PATH, so `nc -v`
/// in a spec would be busybox's nc, which has no -v. /bin/sh is dash; bash is there too.
const SHELLS: [&str; 2] = ["/usr/bin/dash", "/usr/bin/bash"];
/// Applets left out, so that PATH finds the real programs (or the shells).
const NOT_APPLETS: [&str; 7] = ["busybox", "sh", "ash", "bash", "nc", "ip", "wget"];

/// Every image a box with nodes imports: pause and agnhost (cached beside the binaries in
/// `bin_dir/images`) and the agent's (from `agent`, into `out`).
pub fn for_box(bin_dir: &Path, agent: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    let mut images = build_cached(
        &bin_dir.join("images"),
        &pause_source()?,
        &bin_dir.join("agnhost"),
    )?;
    images.push(build_agent(agent, out)?);
    Ok(images)
}

/// upstream's build/pause/linux/pause.c, in the Go module cache (tools/cluster's
/// k8s.io/kubernetes).
pub fn pause_source() -> Result<PathBuf> {
    let module = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/cluster");
    let out = Command::new("go")
        .args(["list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes"])
        .current_dir(&module)
        .output()
        .context("running `go list -m` (Go must be on PATH)")?;
    if !out.status.success() {
        bail!(
            "go list -m k8s.io/kubernetes: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    Ok(dir.join("build/pause/linux/pause.c"))
}

/// The pause, agnhost and busybox images, built once into `cache` (`.tools/cluster/
/// <versions>/images`): `pause_c` is upstream's build/pause/linux/pause.c, `agnhost` the
/// static binary; busybox is Debian's busybox-static with its applets.
pub fn build_cached(cache: &Path, pause_c: &Path, agnhost: &Path) -> Result<Vec<PathBuf>> {
    fs::create_dir_all(cache)?;
    let pause_tar = cache.join(format!("pause-3.10.2-r{RECIPE}.tar"));
    if !pause_tar.is_file() {
        let root = scratch(cache, "pause")?;
        let status = Command::new("gcc")
            .args(["-Os", "-static", "-DVERSION=3.10.2", "-o"])
            .arg(root.join("pause"))
            .arg(pause_c)
            .status()
            .context("running gcc (the pause image is pause.c, linked static)")?;
        if !status.success() {
            bail!("gcc {} failed: {status}", pause_c.display());
        }
        write_archive(&root, PAUSE, &["/pause"], &[], &pause_tar)?;
        fs::remove_dir_all(&root)?;
    }
    let agnhost_tar = cache.join(format!("agnhost-2.66.1-r{RECIPE}.tar"));
    if !agnhost_tar.is_file() {
        let root = scratch(cache, "agnhost")?;
        fs::copy(agnhost, root.join("agnhost"))?;
        std::os::unix::fs::symlink("agnhost", root.join("agnhost-2"))?;
        add_busybox(&root)?;
        for tool in AGNHOST_TOOLS {
            add_program(&root, Path::new(tool))?;
        }
        std::os::unix::fs::symlink("/usr/bin/nc.openbsd", root.join("usr/bin/nc"))?;
        // agnhost's image has a user of its own, and the specs look some up by name.
        fs::create_dir_all(root.join("etc"))?;
        fs::write(
            root.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nuser-defined-in-image:x:1000:1000::/home:/bin/sh\n",
        )?;
        fs::write(
            root.join("etc/group"),
            "root:x:0:\ngroup-defined-in-image:x:50000:user-defined-in-image\n",
        )?;
        fs::create_dir_all(root.join("uploads"))?;
        fs::create_dir_all(root.join("tmp"))?;
        write_archive(&root, AGNHOST, &["/agnhost"], &["pause"], &agnhost_tar)?;
        fs::remove_dir_all(&root)?;
    }
    let busybox_tar = cache.join(format!("busybox-1.37.0-2-r{RECIPE}.tar"));
    if !busybox_tar.is_file() {
        let root = scratch(cache, "busybox")?;
        add_busybox(&root)?;
        fs::create_dir_all(root.join("tmp"))?;
        // As upstream's: no entrypoint, `sh` by default.
        write_archive(&root, BUSYBOX_IMAGE, &[], &["sh"], &busybox_tar)?;
        fs::remove_dir_all(&root)?;
    }
    Ok(vec![pause_tar, agnhost_tar, busybox_tar])
}

/// The agent's image from its (release) binary, into `out`: rebuilt each time, since the
/// binary changes with every build. Busybox gives the init container's `sh`, `mountpoint`
/// and `mount`.
pub fn build_agent(agent: &Path, out: &Path) -> Result<PathBuf> {
    fs::create_dir_all(out)?;
    let root = scratch(out, "proxy-agent")?;
    add_busybox(&root)?;
    add_program(&root, agent)?;
    let bin = root.join("usr/local/bin");
    fs::create_dir_all(&bin)?;
    let copied = root.join(agent.strip_prefix("/").unwrap_or(agent));
    fs::rename(&copied, bin.join("proxy-agent"))?;
    let tar = out.join("proxy-agent-0.1.0.tar");
    write_archive(&root, AGENT, &["/usr/local/bin/proxy-agent"], &[], &tar)?;
    fs::remove_dir_all(&root)?;
    Ok(tar)
}

fn scratch(parent: &Path, name: &str) -> Result<PathBuf> {
    let root = parent.join(format!("{name}.rootfs"));
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(&root)?;
    Ok(root)
}

fn add_busybox(root: &Path) -> Result<()> {
    let bin = root.join("bin");
    fs::create_dir_all(&bin)?;
    fs::copy(BUSYBOX, bin.join("busybox"))
        .with_context(|| format!("copying {BUSYBOX} (Debian's busybox-static)"))?;
    let list = Command::new(BUSYBOX).arg("--list").output()?;
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if !NOT_APPLETS.contains(&applet) {
            std::os::unix::fs::symlink("busybox", bin.join(applet))?;
        }
    }
    for shell in SHELLS {
        add_program(root, Path::new(shell))?;
    }
    std::os::unix::fs::symlink("/usr/bin/dash", bin.join("sh"))?;
    if !bin.join("bash").exists() {
        std::os::unix::fs::symlink("/usr/bin/bash", bin.join("bash"))?;
    }
    Ok(())
}

/// Copies `program` and the shared libraries `ldd` finds for it to the same paths in
/// `root`.
fn add_program(root: &Path, program: &Path) -> Result<()> {
    let ldd = Command::new("ldd").arg(program).output()?;
    let mut files = vec![program.to_path_buf()];
    // "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)" or "/lib64/ld-linux... (0x...)"
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let path = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(PathBuf::from);
        files.extend(path);
    }
    for file in files {
        let to = root.join(file.strip_prefix("/").unwrap_or(&file));
        fs::create_dir_all(to.parent().context("a file has a folder")?)?;
        // The real file, not the link: /lib64/ld-linux-x86-64.so.2 is a symlink.
        fs::copy(&file, &to).with_context(|| format!("copying {}", file.display()))?;
    }
    Ok(())
}

/// Writes `root` as a one-layer docker-archive image named `name`.
fn write_archive(
    root: &Path,
    name: &str,
    entrypoint: &[&str],
    cmd: &[&str],
    out: &Path,
) -> Result<()> {
    let work = out.with_extension("partial");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    let layer = work.join("layer.tar");
    let status = Command::new("tar")
        .args(["--numeric-owner", "--owner=0", "--group=0", "-C"])
        .arg(root)
        .arg("-cf")
        .arg(&layer)
        .arg(".")
        .status()?;
    if !status.success() {
        bail!("tar of {} failed: {status}", root.display());
    }
    let diff_id = sha256(&layer)?;
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": entrypoint,
            "Cmd": cmd,
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]},
    });
    let config_text = serde_json::to_vec(&config)?;
    fs::write(work.join("config.json"), &config_text)?;
    let config_id = sha256(&work.join("config.json"))?;
    fs::rename(
        work.join("config.json"),
        work.join(format!("{config_id}.json")),
    )?;
    let manifest = serde_json::json!([{
        "Config": format!("{config_id}.json"),
        "RepoTags": [name],
        "Layers": ["layer.tar"],
    }]);
    fs::write(work.join("manifest.json"), serde_json::to_vec(&manifest)?)?;
    let partial = out.with_extension("tar.partial");
    let status = Command::new("tar")
        .arg("-C")
        .arg(&work)
        .arg("-cf")
        .arg(&partial)
        .arg(".")
        .status()?;
    if !status.success() {
        bail!("tar of {} failed: {status}", work.display());
    }
    fs::rename(&partial, out)?;
    fs::remove_dir_all(&work)?;
    Ok(())
}

fn sha256(path: &Path) -> Result<String> {
    let out = Command::new("sha256sum").arg(path).output()?;
    if !out.status.success() {
        bail!("sha256sum {} failed", path.display());
    }
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .map(str::to_string)
        .context("sha256sum printed nothing")
}
