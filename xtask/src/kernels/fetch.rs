//! Debian's kernel packages: the newest image of a suite, downloaded with apt-get into a
//! private state folder (the machine's own sources and cache untouched), unpacked and
//! indexed (`depmod`) under `.tools/kernels/<package>_<version>/`, kept there.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::process::{output, run};

/// A kernel of the matrix: its line, the Debian suite that ships it, and who runs it.
pub struct Line {
    pub name: &'static str,
    pub suite: &'static str,
    pub who: &'static str,
}

/// The kernels the matrix boots, the floor first.
pub const LINES: [Line; 3] = [
    Line {
        name: "5.10",
        suite: "bullseye",
        who: "Debian 11, Amazon Linux 2's 5.10",
    },
    Line {
        name: "6.1",
        suite: "bookworm",
        who: "Debian 12, Bottlerocket, AL2023's first kernel, COS",
    },
    Line {
        name: "6.12",
        suite: "trixie",
        who: "Debian 13",
    },
];

/// An unpacked kernel: `root` holds `boot/vmlinuz-<release>` and
/// `lib/modules/<release>/`.
pub struct Unpacked {
    pub package: String,
    pub version: String,
    pub release: String,
    pub root: PathBuf,
}

impl Unpacked {
    pub fn vmlinuz(&self) -> PathBuf {
        self.root.join(format!("boot/vmlinuz-{}", self.release))
    }

    pub fn modules(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.release)
    }
}

/// The newest kernel image of `line`'s suite, fetched and unpacked once.
pub fn kernel(tools: &Path, line: &Line) -> Result<Unpacked> {
    let base = tools.join("kernels");
    let apt = Apt::new(&base.join("apt").join(line.suite), line.suite)?;
    let (package, version) = apt.image()?;
    let root = base.join(format!("{package}_{version}"));
    let ready = root.join(".ready");
    if !ready.exists() {
        let debs = base.join("debs");
        fs::create_dir_all(&debs)?;
        let deb = apt.download(&debs, &package, &version)?;
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root)?;
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
        // Merged-/usr suites (trixie) ship the modules under usr/lib.
        if !root.join("lib").exists() && root.join("usr/lib/modules").exists() {
            std::os::unix::fs::symlink("usr/lib", root.join("lib"))?;
        }
        let release = release_of(&root)?;
        run(Command::new("depmod").arg("-b").arg(&root).arg(&release))?;
        fs::write(&ready, &release)?;
    }
    let release = fs::read_to_string(&ready)?.trim().to_string();
    Ok(Unpacked {
        package,
        version,
        release,
        root,
    })
}

/// The kernel release an unpacked image carries (`boot/vmlinuz-<release>`).
fn release_of(root: &Path) -> Result<String> {
    for entry in fs::read_dir(root.join("boot"))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(release) = name.strip_prefix("vmlinuz-") {
            return Ok(release.to_string());
        }
    }
    bail!("no vmlinuz in {}", root.join("boot").display())
}

/// apt-get on one suite, with its own lists and cache.
struct Apt {
    state: PathBuf,
}

impl Apt {
    fn new(state: &Path, suite: &str) -> Result<Self> {
        fs::create_dir_all(state.join("lists/partial"))?;
        fs::create_dir_all(state.join("cache/archives/partial"))?;
        let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
        fs::write(
            state.join("sources.list"),
            format!(
                "deb [signed-by={keyring}] http://deb.debian.org/debian {suite} main\n\
                 deb [signed-by={keyring}] http://deb.debian.org/debian-security {suite}-security main\n"
            ),
        )?;
        let apt = Self {
            state: state.to_path_buf(),
        };
        // The lists once a day: a security update brings a newer image.
        let fresh = fs::metadata(state.join("lists/.updated"))
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|e| e.as_secs() < 86_400));
        if !fresh {
            run(apt.cmd("apt-get").args(["update", "-qq"]))?;
            fs::write(state.join("lists/.updated"), "")?;
        }
        Ok(apt)
    }

    fn cmd(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        let s = |p: &str| self.state.join(p).display().to_string();
        for (key, value) in [
            ("Dir::Etc::SourceList", s("sources.list")),
            ("Dir::Etc::SourceParts", "/dev/null".to_string()),
            ("Dir::State::Lists", s("lists")),
            ("Dir::Cache", s("cache")),
            ("Debug::NoLocking", "1".to_string()),
        ] {
            cmd.arg("-o").arg(format!("{key}={value}"));
        }
        cmd
    }

    /// The image package the suite's `linux-image-amd64` names, and its version.
    fn image(&self) -> Result<(String, String)> {
        let show = output(self.cmd("apt-cache").args(["show", "linux-image-amd64"]))?;
        // Every version the lists hold: the newest one's dependency.
        let mut best: Option<(String, String)> = None;
        for stanza in show.split("\n\n") {
            let field = |name: &str| {
                stanza
                    .lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
                    .map(str::to_string)
            };
            let (Some(version), Some(depends)) = (field("Version"), field("Depends")) else {
                continue;
            };
            let newer = match &best {
                None => true,
                Some((v, _)) => Command::new("dpkg")
                    .args(["--compare-versions", &version, "gt", v])
                    .status()
                    .is_ok_and(|s| s.success()),
            };
            if newer {
                best = Some((version, depends));
            }
        }
        let (_, depends) = best.context("no linux-image-amd64 in the suite's lists")?;
        // "linux-image-5.10.0-46-amd64 (= 5.10.262-1)"
        let (package, version) = depends
            .split_once(" (= ")
            .and_then(|(p, v)| Some((p.trim(), v.strip_suffix(')')?)))
            .with_context(|| format!("unexpected Depends {depends:?}"))?;
        Ok((package.to_string(), version.to_string()))
    }

    fn download(&self, dir: &Path, package: &str, version: &str) -> Result<PathBuf> {
        let file = dir.join(format!("{package}_{version}_amd64.deb"));
        if !file.exists() {
            run(self
                .cmd("apt-get")
                .args(["download", "-qq", &format!("{package}={version}")])
                .current_dir(dir))?;
        }
        let found = fs::read_dir(dir)?.flatten().map(|e| e.path()).find(|p| {
            p.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with(&format!("{package}_{version}")) && n.ends_with(".deb")
            })
        });
        found.with_context(|| format!("{package} {version} not downloaded into {}", dir.display()))
    }
}
