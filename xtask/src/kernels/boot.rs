//! Booting a kernel under QEMU (TCG: this machine has no usable hardware virtualisation)
//! with no network device: the host's root read-only over 9p, a writable folder for
//! results, and a job file of shell lines the guest runs in order.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::fetch::Unpacked;

/// What one line of the job did.
pub struct Step {
    pub line: String,
    pub status: Option<i32>,
    pub seconds: u64,
    pub log: String,
}

/// What the guest did: its kernel release and every step, in order.
pub struct Boot {
    pub release: String,
    pub steps: Vec<Step>,
    pub seconds: u64,
}

/// Boots `kernel` with `initramfs`, runs `job` in the guest from `workdir`, and reads back
/// what each line did. `run_dir` (outside /tmp, which the guest covers) holds the
/// guest's script, the job and the results.
pub fn run(
    kernel: &Unpacked,
    initramfs: &Path,
    run_dir: &Path,
    workdir: &Path,
    job: &[String],
    timeout: Duration,
) -> Result<Boot> {
    let out = run_dir.join("out");
    let _ = fs::remove_dir_all(&out);
    fs::create_dir_all(&out)?;
    let guest = run_dir.join("guest.sh");
    fs::write(&guest, include_str!("guest.sh"))?;
    let job_file = run_dir.join("job");
    fs::write(&job_file, job.join("\n") + "\n")?;
    let console = fs::File::create(run_dir.join("console.log"))?;
    let append = format!(
        "console=ttyS0 quiet panic=-1 guest={} kroot={} job={} workdir={}",
        guest.display(),
        kernel.root.display(),
        job_file.display(),
        workdir.display()
    );
    let started = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            "max",
            "-smp",
            "2",
            "-m",
            "4G",
        ])
        .args(["-nic", "none", "-nographic", "-no-reboot"])
        .arg("-kernel")
        .arg(kernel.vmlinuz())
        .arg("-initrd")
        .arg(initramfs)
        .arg("-append")
        .arg(&append)
        .arg("-virtfs")
        .arg("local,path=/,mount_tag=root,security_model=none,readonly=on,multidevs=remap")
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=out,security_model=none",
            out.display()
        ))
        .stdin(Stdio::null())
        .stdout(console.try_clone()?)
        .stderr(console)
        .spawn()
        .context("spawning qemu-system-x86_64 (package qemu-system-x86)")?;
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{} did not power off within {timeout:?} (console: {})",
                kernel.release,
                run_dir.join("console.log").display()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let release = fs::read_to_string(out.join("release"))
        .with_context(|| {
            format!(
                "{} never ran the guest script (console: {})",
                kernel.release,
                run_dir.join("console.log").display()
            )
        })?
        .trim()
        .to_string();
    let steps = job
        .iter()
        .enumerate()
        .map(|(i, line)| step(&out, i + 1, line))
        .collect();
    Ok(Boot {
        release,
        steps,
        seconds: started.elapsed().as_secs(),
    })
}

fn step(out: &Path, n: usize, line: &str) -> Step {
    let status = fs::read_to_string(out.join(format!("{n}.status"))).unwrap_or_default();
    let mut parts = status.split_whitespace();
    Step {
        line: line.to_string(),
        status: parts.next().and_then(|s| s.parse().ok()),
        seconds: parts.next().and_then(|s| s.parse().ok()).unwrap_or(0),
        log: fs::read_to_string(out.join(format!("{n}.log"))).unwrap_or_default(),
    }
}

/// Where a kernel's run keeps its files: `target/kernels/<line>/`.
pub fn run_dir(root: &Path, line: &str) -> PathBuf {
    root.join("target/kernels").join(line)
}
