//! Loading the BPF object: maps reused from their pins (or pinned), their sizes as the
//! options say, the globals set; a failed load leaves no pin of its own behind.

use std::{
    fs,
    path::{Path, PathBuf},
};

use crate::error::{Error, ErrorKind, Result};
use aya::{Ebpf, EbpfLoader};
use proxy_common::map_names;

use super::{
    kernel::Kernel,
    options::{Options, conntrack_capacities},
    pins::{replace_reshaped_counts, warn_if_pinned_size_differs},
    programs::{BPF_OBJECT, set_switches},
};

/// The loaded object, and which maps it pinned anew (none were pinned before it).
pub struct Loaded {
    pub ebpf: Ebpf,
    pub made_new: Vec<&'static str>,
}

/// Loads the object with its maps pinned under `maps_dir`.
pub fn load(opts: &Options, kernel: &Kernel, maps_dir: &Path) -> Result<Loaded> {
    let mut loader = EbpfLoader::new();
    let pins: Vec<(&str, PathBuf)> = map_names::ALL
        .iter()
        .map(|n| (*n, maps_dir.join(n)))
        .collect();
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    let level = opts.bpf_log_level.code();
    loader.override_global("AYA_LOG_LEVEL", &level, false);
    set_switches(&mut loader, kernel);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (name, size) in conntrack_capacities(opts.conntrack.table_entries(cpus)) {
        loader.map_max_entries(name, size);
        warn_if_pinned_size_differs(&maps_dir.join(name), size);
    }
    for (name, size) in opts.map_sizes.capacities() {
        loader.map_max_entries(name, size);
        warn_if_pinned_size_differs(&maps_dir.join(name), size);
    }
    replace_reshaped_counts(maps_dir);
    let pinned_before: Vec<bool> = pins.iter().map(|(_, p)| p.exists()).collect();
    let ebpf = match loader.load(BPF_OBJECT) {
        Ok(ebpf) => ebpf,
        Err(e) => {
            // A pin set this object cannot use (another version's maps) fails midway:
            // the pins this attempt made go again, so nothing half-made is left for
            // the next run to trip on; the older pins stay for their own agent.
            for ((_, path), existed) in pins.iter().zip(pinned_before) {
                if !existed {
                    let _ = fs::remove_file(path);
                }
            }
            return Err(Error::caused(
                ErrorKind::Load,
                "loading the BPF object (is this kernel eBPF-capable, are we root? pins of \
                 another version under the pin folder: `proxy-agent cleanup` removes them)",
                e,
            ));
        }
    };

    let made_new = pins
        .iter()
        .zip(&pinned_before)
        .filter(|(_, before)| !**before)
        .map(|((name, _), _)| *name)
        .collect();
    Ok(Loaded { ebpf, made_new })
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// A bpffs of the test's own, unmounted on drop (also when the test fails).
    struct Bpffs(PathBuf);

    impl Bpffs {
        fn mount() -> Self {
            let dir = std::env::temp_dir().join(format!("proxy-load-test-{}", std::process::id()));
            fs::create_dir_all(&dir).expect("mount point");
            let ok = Command::new("mount")
                .args(["-t", "bpf", "bpf"])
                .arg(&dir)
                .status()
                .expect("mount")
                .success();
            assert!(ok, "mounting a bpffs on {}", dir.display());
            Self(dir)
        }
    }

    impl Drop for Bpffs {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
            let _ = fs::remove_dir(&self.0);
        }
    }

    /// A pin set the object cannot use (another shape under one of our names, as another
    /// version might leave) fails as a load, says what to do, and leaves no pin of its own.
    #[test_support::needs_root]
    #[test]
    fn an_incompatible_pin_is_a_load_error_and_leaves_no_pin_of_ours() {
        let fs = Bpffs::mount();
        let maps_dir = fs.0.join("maps");
        fs::create_dir_all(&maps_dir).expect("maps folder");
        aya::maps::HashMap::<_, u8, u8>::create(4, 0)
            .expect("a private map")
            .pin(maps_dir.join(map_names::SERVICES))
            .expect("pinned under our name");
        let kernel = Kernel {
            tc_hook: None,
            ..Kernel::probed_helpers()
        };
        let Err(e) = load(&Options::default(), &kernel, &maps_dir) else {
            panic!("a SERVICES map of another shape must be refused");
        };
        assert_eq!(e.kind(), ErrorKind::Load, "{e:#}");
        assert!(format!("{e:#}").contains("proxy-agent cleanup"), "{e:#}");
        let left: Vec<_> = fs::read_dir(&maps_dir)
            .expect("maps")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, [map_names::SERVICES], "pins left: {left:?}");
    }
}
