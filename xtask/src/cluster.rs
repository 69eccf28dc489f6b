//! `cargo xtask cluster`: builds etcd, kube-apiserver and kube-controller-manager (and for
//! `--nodes`, the kubelet, kube-scheduler, agnhost, kube-proxy; for `conformance`,
//! e2e.test) from the versions `tools/cluster/go.mod` pins, once, into
//! `.tools/cluster/<versions>/`, then runs the cluster in a box (`proxy_cluster::cluster`)
//! until Ctrl-C.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

/// The variable through which tests learn where the binaries are (`proxy_cluster::cluster`).
pub const BIN_DIR_ENV: &str = "PROXY_CLUSTER_BIN_DIR";

/// Output name and Go package of each binary. etcd's main package is its server module.
const BINARIES: [(&str, &str); 3] = [
    ("etcd", "go.etcd.io/etcd/server/v3"),
    ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
    (
        "kube-controller-manager",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
    ),
];

fn module_dir(root: &Path) -> PathBuf {
    root.join("tools/cluster")
}

/// The version `go.mod` requires of `module`.
fn required_version(go_mod: &str, module: &str) -> Result<String> {
    go_mod
        .lines()
        .filter_map(|l| l.split("//").next())
        .map(str::split_whitespace)
        .find_map(|mut words| {
            let mut name = words.next()?;
            if name == "require" {
                name = words.next()?;
            }
            let version = words.next()?;
            (name == module && version.starts_with('v') && words.next().is_none())
                .then(|| version.to_string())
        })
        .with_context(|| format!("tools/cluster/go.mod requires no {module}"))
}

/// Where the binaries of the pinned versions live (built or not): the cache key is the
/// pair of versions, so a version bump builds anew and never reuses stale binaries.
pub fn bin_dir(root: &Path) -> Result<PathBuf> {
    let go_mod = fs::read_to_string(module_dir(root).join("go.mod"))?;
    let kube = required_version(&go_mod, "k8s.io/kubernetes")?;
    let etcd = required_version(&go_mod, "go.etcd.io/etcd/server/v3")?;
    Ok(root
        .join(".tools/cluster")
        .join(format!("kubernetes-{kube}-etcd-{etcd}")))
}

/// What real nodes add (`cargo xtask cluster --nodes N`): the kubelet, the scheduler,
/// agnhost (the e2e suite's test image's one program) and kube-proxy (the conformance
/// reference); built into the same folder, beside the control plane.
const NODE_BINARIES: [(&str, &str); 4] = [
    ("kubelet", "k8s.io/kubernetes/cmd/kubelet"),
    ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
    ("agnhost", "k8s.io/kubernetes/test/images/agnhost"),
    ("kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy"),
];

/// Builds the control plane's binaries unless all are there; returns their folder.
pub fn build(root: &Path) -> Result<PathBuf> {
    let dir = bin_dir(root)?;
    if BINARIES.iter().all(|(name, _)| dir.join(name).is_file()) {
        return Ok(dir);
    }
    let ldflags = ldflags(root)?;
    // Built into a scratch folder and renamed, so an interrupted build never looks done.
    let partial = dir.with_extension("partial");
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&partial)?;
    eprintln!(
        "xtask: building etcd, kube-apiserver and kube-controller-manager into {} \
         (the first build takes a while: see docs/cluster-in-a-box.md)",
        dir.display()
    );
    let started = Instant::now();
    for (name, pkg) in BINARIES {
        go_build(root, &ldflags, pkg, &partial.join(name))?;
    }
    // One by one: the folder may hold the nodes' binaries already.
    fs::create_dir_all(&dir)?;
    for (name, _) in BINARIES {
        fs::rename(partial.join(name), dir.join(name))?;
    }
    let _ = fs::remove_dir(&partial);
    eprintln!(
        "xtask: built in {:.1} min",
        started.elapsed().as_secs_f64() / 60.0
    );
    Ok(dir)
}

/// The control plane, then the nodes' binaries, each built unless there (into
/// `NAME.partial`, renamed when done), and e2e.test if `e2e` (`cargo xtask conformance`).
pub fn build_nodes(root: &Path, e2e: bool) -> Result<PathBuf> {
    let dir = build(root)?;
    let ldflags = ldflags(root)?;
    for (name, pkg) in NODE_BINARIES {
        let out = dir.join(name);
        if out.is_file() {
            continue;
        }
        let started = Instant::now();
        eprintln!("xtask: building {name} into {}", dir.display());
        let partial = out.with_extension("partial");
        go_build(root, &ldflags, pkg, &partial)?;
        fs::rename(&partial, &out)?;
        eprintln!(
            "xtask: {name} built in {:.1} min",
            started.elapsed().as_secs_f64() / 60.0
        );
    }
    // e2e.test execs kubectl (exec into Pods), the same version as the rest.
    if e2e && !dir.join("kubectl").is_file() {
        let partial = dir.join("kubectl.partial");
        go_build(root, &ldflags, "k8s.io/kubernetes/cmd/kubectl", &partial)?;
        fs::rename(&partial, dir.join("kubectl"))?;
    }
    let out = dir.join("e2e.test");
    if e2e && !out.is_file() {
        let started = Instant::now();
        eprintln!(
            "xtask: building e2e.test (the sig-network specs) into {}",
            dir.display()
        );
        let partial = out.with_extension("partial");
        let status = Command::new("nice")
            .args([
                "-n",
                "19",
                "go",
                "test",
                "-c",
                "-trimpath",
                "-ldflags",
                &ldflags,
                "-o",
            ])
            .arg(&partial)
            .arg("./conformance")
            .current_dir(module_dir(root))
            .env("CGO_ENABLED", "0")
            .status()
            .context("running `go` (Go 1.26 or newer must be on PATH)")?;
        if !status.success() {
            bail!("go test -c ./conformance failed: {status}");
        }
        fs::rename(&partial, &out)?;
        eprintln!(
            "xtask: e2e.test built in {:.1} min",
            started.elapsed().as_secs_f64() / 60.0
        );
    }
    Ok(dir)
}

fn go_build(root: &Path, ldflags: &str, pkg: &str, out: &Path) -> Result<()> {
    let status = Command::new("nice")
        .args(["-n", "19", "go"])
        .current_dir(module_dir(root))
        // Static binaries, as Kubernetes releases them.
        .env("CGO_ENABLED", "0")
        .args(["build", "-trimpath", "-ldflags", ldflags, "-o"])
        .arg(out)
        .arg(pkg)
        .status()
        .context("running `go` (Go 1.26 or newer must be on PATH)")?;
    if !status.success() {
        bail!("go build {pkg} failed: {status}");
    }
    Ok(())
}

/// What hack/lib/version.sh stamps into a release build (`--version`, /version); the
/// compatibility version itself is compiled in, not stamped.
fn ldflags(root: &Path) -> Result<String> {
    let go_mod = fs::read_to_string(module_dir(root).join("go.mod"))?;
    let kube = required_version(&go_mod, "k8s.io/kubernetes")?;
    let minor = kube
        .trim_start_matches('v')
        .split('.')
        .nth(1)
        .context("k8s.io/kubernetes version has no minor")?;
    let mut ldflags = String::from("-s -w");
    for pkg in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        ldflags += &format!(
            " -X {pkg}.gitVersion={kube} -X {pkg}.gitMajor=1 -X {pkg}.gitMinor={minor} -X {pkg}.gitTreeState=clean"
        );
    }
    Ok(ldflags)
}

#[cfg(test)]
mod tests {
    use super::required_version;

    #[test]
    fn reads_required_versions_from_go_mod() {
        let go_mod = "module m\n\nrequire (\n\tgo.etcd.io/etcd/server/v3 v3.7.3\n\tk8s.io/kubernetes v1.37.2\n\tk8s.io/api v0.37.2 // indirect\n)\nrequire k8s.io/utils v0.1.0\nreplace k8s.io/api => k8s.io/api v0.37.2\n";
        assert_eq!(
            required_version(go_mod, "k8s.io/kubernetes").unwrap(),
            "v1.37.2"
        );
        assert_eq!(
            required_version(go_mod, "go.etcd.io/etcd/server/v3").unwrap(),
            "v3.7.3"
        );
        assert_eq!(required_version(go_mod, "k8s.io/api").unwrap(), "v0.37.2");
        assert_eq!(required_version(go_mod, "k8s.io/utils").unwrap(), "v0.1.0");
        assert!(required_version(go_mod, "k8s.io/client-go").is_err());
    }
}
