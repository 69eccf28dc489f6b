//! Where cgroup v2 is mounted (the connect-time hooks attach under it).

/// The cgroup v2 mount point, from /proc/self/mountinfo (`/sys/fs/cgroup` on most hosts).
pub fn cgroup2_mount() -> anyhow::Result<std::path::PathBuf> {
    use anyhow::Context as _;
    let info = std::fs::read_to_string("/proc/self/mountinfo").context("reading mountinfo")?;
    info.lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            post.starts_with("cgroup2 ")
                .then(|| pre.split(' ').nth(4).map(std::path::PathBuf::from))?
        })
        .context("no cgroup2 mount found: pass --cgroup PATH or --cgroup none")
}

