//! The guest's first root: busybox, the few modules that reach the host's root over 9p
//! (virtio, 9p and what they need, taken from the guest kernel's own package), and an
//! `/init` that mounts it read-only and hands over to the guest script. A newc cpio,
//! written here (the kernel takes it uncompressed).

use std::{fs, path::Path, process::Command};

use anyhow::{Context as _, Result, bail};

use super::fetch::Unpacked;

/// What the initramfs loads, by module path; each after what `modules.dep` says it needs.
/// One a kernel builds in (virtio_pci on 6.12) is not in `modules.dep`, and not needed.
const ROOT_MODULES: [&str; 3] = [
    "kernel/drivers/virtio/virtio_pci.ko",
    "kernel/net/9p/9pnet_virtio.ko",
    "kernel/fs/9p/9p.ko",
];

const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod /lib/$m || echo "initramfs: insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose root /newroot \
  || { echo "initramfs: no root over 9p"; poweroff -f; }
guest=$(sed -n 's/.* guest=\([^ ]*\).*/\1/p' /proc/cmdline)
umount /proc /sys /dev
exec switch_root /newroot /bin/bash "$guest"
"#;

/// Writes the initramfs for `kernel` to `out`.
pub fn build(kernel: &Unpacked, out: &Path) -> Result<()> {
    let dep = fs::read_to_string(kernel.modules().join("modules.dep"))?;
    let needs = |module: &str| -> Option<Vec<String>> {
        dep.lines().find_map(|l| {
            let (m, deps) = l.split_once(':')?;
            // "kernel/fs/9p/9p.ko" or its compressed "…ko.xz"
            (m == module || m.strip_prefix(module).is_some_and(|s| s.starts_with('.'))).then(|| {
                std::iter::once(m.to_string())
                    .chain(deps.split_whitespace().map(str::to_string))
                    .collect()
            })
        })
    };
    let mut order: Vec<String> = Vec::new();
    fn add(m: &str, dep: &dyn Fn(&str) -> Option<Vec<String>>, order: &mut Vec<String>) {
        if order.iter().any(|o| o == m) {
            return;
        }
        if let Some(found) = dep(m) {
            for d in &found[1..] {
                add(d, dep, order);
            }
            if !order.contains(&found[0]) {
                order.push(found[0].clone());
            }
        }
    }
    for m in ROOT_MODULES {
        add(m, &needs, &mut order);
    }
    if !order.iter().any(|m| m.contains("/9p.ko")) {
        bail!("{}: no 9p module in modules.dep", kernel.release);
    }
    let mut cpio = Cpio::default();
    for dir in ["bin", "lib", "proc", "sys", "dev", "newroot"] {
        cpio.dir(dir);
    }
    let busybox = fs::read("/usr/bin/busybox").context("busybox (package busybox-static)")?;
    cpio.file("bin/busybox", 0o755, &busybox);
    let mut names = String::new();
    for m in &order {
        let path = kernel.modules().join(m);
        let (name, bytes) = decompressed(&path)?;
        cpio.file(&format!("lib/{name}"), 0o644, &bytes);
        names.push_str(&name);
        names.push('\n');
    }
    cpio.file("modules", 0o644, names.as_bytes());
    cpio.file("init", 0o755, INIT.as_bytes());
    fs::write(out, cpio.finish())?;
    Ok(())
}

/// A module as insmod takes it: `.ko.xz` and `.ko.zst` decompressed.
fn decompressed(path: &Path) -> Result<(String, Vec<u8>)> {
    let name = path
        .file_name()
        .context("a module file")?
        .to_string_lossy()
        .into_owned();
    let tool = match path.extension().and_then(|e| e.to_str()) {
        Some("xz") => Some("xz"),
        Some("zst") => Some("zstd"),
        _ => None,
    };
    let Some(tool) = tool else {
        return Ok((name, fs::read(path)?));
    };
    let out = Command::new(tool)
        .arg("-dc")
        .arg(path)
        .output()
        .with_context(|| format!("{tool} -dc {}", path.display()))?;
    if !out.status.success() {
        bail!("{tool} -dc {} failed", path.display());
    }
    let stem = name
        .rsplit_once('.')
        .map_or(name.as_str(), |(s, _)| s)
        .to_string();
    Ok((stem, out.stdout))
}

/// A newc ("070701") archive: entries, then the trailer.
#[derive(Default)]
struct Cpio {
    bytes: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, &[]);
    }

    fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | mode, data);
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            1, // nlink
            0, // mtime
            data.len() as u32,
            0, // devmajor
            0, // devminor
            0, // rdevmajor
            0, // rdevminor
            name.len() as u32 + 1,
            0, // check
        ];
        self.bytes.extend_from_slice(b"070701");
        for f in fields {
            self.bytes.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.bytes
    }
}
