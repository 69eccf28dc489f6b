//! `cargo xtask kernels`: the agent on the kernels people run. Each of Debian's kernel
//! lines (5.10, 6.1, 6.12) is downloaded once (`fetch`), booted under QEMU with no
//! network device (`initramfs`, `boot`), and runs a job in the guest: the programs
//! loaded and packets traced through them, then the agent serving a namespace testbed
//! through both paths. `--quick` (CI): the floor kernel, the loads and one request per
//! path. The full run writes its table into docs/kernels.md.

mod boot;
mod fetch;
mod initramfs;

use std::{fmt::Write as _, fs, path::Path, time::Duration};

use anyhow::{Result, bail};

use crate::{packages, process::output, toolchain::tools_dir, workspace::build};

/// The host tools the matrix needs beyond the tests' (`packages::NEEDED`).
const NEEDED: [(&str, &str, &str); 5] = [
    ("qemu-system-x86_64", "qemu-system-x86", "boots the kernels"),
    ("depmod", "kmod", "indexes each kernel's modules"),
    ("dpkg-deb", "dpkg", "unpacks the kernel packages"),
    ("xz", "xz-utils", "decompresses the initramfs' modules"),
    ("busybox", "busybox-static", "the initramfs' shell"),
];

/// One kernel's outcome.
struct Row {
    line: &'static str,
    who: &'static str,
    package: String,
    release: String,
    steps: Vec<boot::Step>,
    seconds: u64,
}

pub fn kernels(root: &Path, wanted: &[String], quick: bool) -> Result<()> {
    packages::ensure_these(&NEEDED)?;
    build(root)?;
    let lines: Vec<&fetch::Line> = fetch::LINES
        .iter()
        .filter(|l| {
            if wanted.is_empty() {
                !quick || l.name == fetch::LINES[0].name
            } else {
                wanted.iter().any(|w| w == l.name)
            }
        })
        .collect();
    if lines.is_empty() {
        let known: Vec<&str> = fetch::LINES.iter().map(|l| l.name).collect();
        bail!("no such kernel line among {known:?}");
    }
    let job = job(quick);
    let mut rows = Vec::new();
    for line in lines {
        let kernel = fetch::kernel(&tools_dir(root), line)?;
        let dir = boot::run_dir(root, line.name);
        fs::create_dir_all(&dir)?;
        let initramfs = dir.join("initramfs.cpio");
        initramfs::build(&kernel, &initramfs)?;
        eprintln!(
            "xtask kernels: booting {} ({})",
            kernel.release, kernel.package
        );
        // Under TCG the verifier alone takes minutes on the classifier.
        let timeout = Duration::from_secs(if quick { 1800 } else { 5400 });
        let booted = boot::run(&kernel, &initramfs, &dir, root, &job, timeout)?;
        for (i, step) in booted.steps.iter().enumerate() {
            fs::write(dir.join(format!("step-{}.log", i + 1)), &step.log)?;
        }
        rows.push(Row {
            line: line.name,
            who: line.who,
            package: format!("{} {}", kernel.package, kernel.version),
            release: booted.release,
            steps: booted.steps,
            seconds: booted.seconds,
        });
    }
    let table = table(&rows, &job);
    println!("{table}");
    if !quick {
        write_docs(root, &table)?;
    }
    let failed: Vec<String> = rows
        .iter()
        .flat_map(|r| {
            r.steps
                .iter()
                .enumerate()
                .filter(|(_, s)| s.status != Some(0))
                .map(move |(i, s)| format!("{}: step {} `{}`", r.release, i + 1, s.line))
        })
        .collect();
    if !failed.is_empty() {
        bail!(
            "failed (logs in target/kernels/<line>/step-N.log):\n  {}",
            failed.join("\n  ")
        );
    }
    Ok(())
}

/// What the guest runs, from the repository's root (the host's, read-only).
fn job(quick: bool) -> Vec<String> {
    let agent = "target/debug/proxy-agent";
    let mut job = vec![
        // Every program loaded (the classifiers, XDP, the cgroup hooks), and packets
        // through them: the shared scenarios, per packet and by real connects.
        format!("{agent} trace --scenario tests/scenarios/shared-examples.json --path both"),
    ];
    if !quick {
        for file in ["kube-proxy-parity.json", "forged-dsr.json"] {
            job.push(format!("{agent} trace --scenario tests/scenarios/{file}"));
        }
    }
    // The agent serving a namespace testbed, both paths, IPv4 and IPv6, TCP and UDP.
    let requests = if quick { 1 } else { 30 };
    job.push(format!(
        "PROXY_TEST_TIME_SCALE=30 target/debug/demo --agent {agent} \
         --manifests deploy/examples --requests {requests}"
    ));
    job
}

fn table(rows: &[Row], job: &[String]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "| kernel | runs on | package | {} | boot |",
        (1..=job.len())
            .map(|i| format!("step {i}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let _ = writeln!(t, "|---|---|---|{}---|", "---|".repeat(job.len()));
    for r in rows {
        let steps: Vec<String> = r
            .steps
            .iter()
            .map(|s| match s.status {
                Some(0) => format!("✓ {} s", s.seconds),
                Some(code) => format!("✗ (exit {code}, {} s)", s.seconds),
                None => "not run".to_string(),
            })
            .collect();
        let _ = writeln!(
            t,
            "| {} ({}) | {} | {} | {} | {} s |",
            r.line,
            r.release,
            r.who,
            r.package,
            steps.join(" | "),
            r.seconds
        );
    }
    let _ = writeln!(t);
    for (i, line) in job.iter().enumerate() {
        let _ = writeln!(t, "- step {}: `{line}`", i + 1);
    }
    t
}

const BEGIN: &str = "<!-- cargo xtask kernels: begin -->";
const END: &str = "<!-- cargo xtask kernels: end -->";

/// The table between the markers of docs/kernels.md, dated, with the commit.
fn write_docs(root: &Path, table: &str) -> Result<()> {
    let path = root.join("docs/kernels.md");
    let doc = fs::read_to_string(&path)?;
    let (Some(b), Some(e)) = (doc.find(BEGIN), doc.find(END)) else {
        bail!("docs/kernels.md has no {BEGIN} … {END} section");
    };
    let commit = output(
        std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .current_dir(root),
    )?;
    let date = output(std::process::Command::new("date").args(["-u", "+%Y-%m-%dT%H:%MZ"]))?;
    let section = format!(
        "{BEGIN}\nFrom `cargo xtask kernels` of {} (main {}):\n\n{table}{END}",
        date.trim(),
        commit.trim()
    );
    let updated = format!("{}{section}{}", &doc[..b], &doc[e + END.len()..]);
    fs::write(&path, updated)?;
    Ok(())
}
