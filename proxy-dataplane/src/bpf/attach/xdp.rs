//! The XDP program on the served interfaces (`ebpf.xdp`): one bpf_link per interface,
//! pinned as `links/xdp-native@<name>` or `links/xdp-generic@<name>` (the mode is in the
//! name: a link cannot change it), adopted on start by swapping the program in, so an
//! agent restart or upgrade keeps translating without a gap. XDP goes on after TC (which
//! handles whatever XDP passes) and comes off first. A restart in the other mode detaches
//! our link of the old one first: a device runs one XDP mode at a time.
//!
//! Bonds and VLANs: XDP attaches where the kernel allows it — a bond in native mode
//! when all its slaves' drivers have native XDP (the bond redirects to the slave), a
//! VLAN device only in generic mode (no driver of its own); `native` then refuses to
//! start naming the device and its driver, `best-effort` runs it generic.

use std::{
    collections::BTreeMap,
    fmt, fs,
    path::Path,
    str::FromStr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use crate::error::{Error, ErrorKind, Kind as _, Result};
use aya::programs::{Xdp, XdpMode as KernelMode, links::FdLink, xdp::XdpLink};

use super::link_update;

/// The program's name (`bpftool prog show`, `bpftool net show`).
pub const XDP_PROGRAM: &str = "xdp_ingress";
/// The pin-name prefixes of the XDP links, by the mode each runs in.
pub const PREFIXES: [(&str, Running); 2] = [
    ("xdp-native@", Running::Native),
    ("xdp-generic@", Running::Generic),
];

/// `ebpf.xdp`: whether and how the XDP program runs on the served interfaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum XdpMode {
    /// No XDP program (the TC path only): today's behaviour.
    #[default]
    Off,
    /// In the driver; the agent refuses to start where a driver has no native XDP.
    Native,
    /// Native where the driver allows, else generic (logged and counted per interface).
    BestEffort,
    /// Generic XDP (after the skb is made: for testing, or drivers without it).
    Generic,
}

impl FromStr for XdpMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "native" => Ok(Self::Native),
            "best-effort" => Ok(Self::BestEffort),
            "generic" => Ok(Self::Generic),
            other => Err(format!(
                "{other:?}: expected native, best-effort, generic or off"
            )),
        }
    }
}

impl fmt::Display for XdpMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Native => "native",
            Self::BestEffort => "best-effort",
            Self::Generic => "generic",
        })
    }
}

/// How the program runs on one interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Running {
    Native,
    Generic,
}

impl Running {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Generic => "generic",
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            Self::Native => PREFIXES[0].0,
            Self::Generic => PREFIXES[1].0,
        }
    }

    fn other(self) -> Self {
        match self {
            Self::Native => Self::Generic,
            Self::Generic => Self::Native,
        }
    }

    fn kernel(self) -> KernelMode {
        match self {
            Self::Native => KernelMode::Driver,
            Self::Generic => KernelMode::Skb,
        }
    }
}

/// Which interfaces run XDP, how, and how often `best-effort` fell back (for `/metrics`):
/// shared between the dataplane and the endpoints.
#[derive(Clone, Debug, Default)]
pub struct XdpStatus(Arc<XdpStatusInner>);

#[derive(Debug, Default)]
struct XdpStatusInner {
    running: Mutex<BTreeMap<String, Running>>,
    fallbacks: AtomicU64,
}

impl XdpStatus {
    /// Interface → mode, for the interfaces that run the program now.
    pub fn running(&self) -> BTreeMap<String, Running> {
        lock(&self.0.running).clone()
    }

    /// `best-effort` attachments that ran generic because native failed.
    pub fn fallbacks(&self) -> u64 {
        self.0.fallbacks.load(Ordering::Relaxed)
    }

    fn set(&self, name: &str, how: Option<Running>) {
        let mut running = lock(&self.0.running);
        match how {
            Some(how) => running.insert(name.to_string(), how),
            None => running.remove(name),
        };
    }
}

/// What the classifiers need to run XDP.
#[derive(Clone, Debug, Default)]
pub struct XdpSetup {
    pub mode: XdpMode,
    pub status: XdpStatus,
}

/// `native` could not attach: the agent must not start (or, for an interface that
/// appeared later, the interface is left to TC and reported).
#[derive(Debug, thiserror::Error)]
#[error(
    "native XDP cannot attach to {interface} (driver {driver}): {cause}; \
     use ebpf.xdp: best-effort or generic, or leave the interface out"
)]
pub struct NativeRefused {
    pub interface: String,
    pub driver: String,
    pub cause: String,
}

impl From<NativeRefused> for Error {
    fn from(refused: NativeRefused) -> Self {
        Error::transparent(ErrorKind::Setting, refused)
    }
}

/// Attaches (or adopts) the program on `name` (`index`) as `setup.mode` asks, removing a
/// link of the other mode afterwards (both run for that moment: no gap). `Off` removes
/// ours. Returns how it runs now.
pub fn attach(
    prog: &mut Xdp,
    setup: &XdpSetup,
    links_dir: &Path,
    name: &str,
    index: u32,
) -> Result<Option<Running>> {
    let how = match setup.mode {
        XdpMode::Off => {
            detach(setup, links_dir, name);
            return Ok(None);
        }
        XdpMode::Native => match attach_in(prog, links_dir, name, index, Running::Native) {
            Ok(how) => how,
            Err(e) => {
                let cause = if occupied(&e) {
                    format!("another XDP program is attached to it ({e:#})")
                } else {
                    format!("{e:#}")
                };
                return Err(NativeRefused {
                    interface: name.to_string(),
                    driver: driver(name),
                    cause,
                }
                .into());
            }
        },
        XdpMode::Generic => attach_in(prog, links_dir, name, index, Running::Generic)?,
        XdpMode::BestEffort => match attach_in(prog, links_dir, name, index, Running::Native) {
            Ok(how) => how,
            Err(e) => {
                setup.status.0.fallbacks.fetch_add(1, Ordering::Relaxed);
                // Only a refusal by the driver is the driver's: a device already running
                // another XDP program says so.
                if occupied(&e) {
                    tracing::warn!(
                        interface = name,
                        error = format!("{e:#}"),
                        "native XDP unavailable: another XDP program (not ours) is attached \
                         to the device; running generic XDP"
                    );
                } else {
                    tracing::warn!(
                        interface = name,
                        driver = driver(name),
                        error = format!("{e:#}"),
                        "native XDP refused by the driver; running generic XDP"
                    );
                }
                attach_in(prog, links_dir, name, index, Running::Generic)?
            }
        },
    };
    for (prefix, other) in PREFIXES {
        if other != how {
            remove_pin(&links_dir.join(format!("{prefix}{name}")));
        }
    }
    setup.status.set(name, Some(how));
    Ok(Some(how))
}

/// Takes our XDP program off `name` (unpinning the last reference detaches it).
pub fn detach(setup: &XdpSetup, links_dir: &Path, name: &str) {
    for (prefix, _) in PREFIXES {
        let pin = links_dir.join(format!("{prefix}{name}"));
        if pin.exists() {
            remove_pin(&pin);
            tracing::info!(interface = name, "XDP link unpinned");
        }
    }
    setup.status.set(name, None);
}

/// The interfaces whose XDP link is pinned in `links_dir`, and how each runs: what
/// `dump` shows.
pub fn pinned(links_dir: &Path) -> BTreeMap<String, Running> {
    let mut out = BTreeMap::new();
    let Ok(entries) = fs::read_dir(links_dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        for (prefix, how) in PREFIXES {
            if let Some(name) = file.strip_prefix(prefix) {
                out.insert(name.to_string(), how);
            }
        }
    }
    out
}

/// `attach_as`, making way for it: a device runs XDP in one mode at a time, so our own
/// link of the other mode on this device (an earlier run's) is detached and unpinned
/// when the kernel refuses the new one beside it, and the new one attached again. For
/// that moment TC alone translates (the two share conntrack: no flow is lost); left in
/// place, the old link kept a restart in the mode it ran before (`best-effort` after
/// `generic` stayed generic, blaming the driver; `generic` after `native` failed).
fn attach_in(
    prog: &mut Xdp,
    links_dir: &Path,
    name: &str,
    index: u32,
    how: Running,
) -> Result<Running> {
    let first = match attach_as(prog, links_dir, name, index, how) {
        Ok(how) => return Ok(how),
        Err(e) => e,
    };
    let other = how.other();
    let pin = links_dir.join(format!("{}{name}", other.prefix()));
    if !occupied(&first) || !on_device(&pin, index) {
        return Err(first);
    }
    tracing::info!(
        interface = name,
        from = other.as_str(),
        to = how.as_str(),
        "our XDP link of the other mode makes way (one mode per device)"
    );
    // Detached first: the pin's release alone frees the device only later.
    if let Err(e) = link_update::detach_now(&pin) {
        tracing::warn!(
            interface = name,
            error = format!("{e:#}"),
            "detaching our XDP link"
        );
    }
    remove_pin(&pin);
    attach_as(prog, links_dir, name, index, how)
}

/// The link pinned at `pin` is attached to the device `index`.
fn on_device(pin: &Path, index: u32) -> bool {
    pin.exists() && link_update::pinned_field(pin, "ifindex").is_ok_and(|i| i == u64::from(index))
}

/// The kernel refused the attachment because the device already runs an XDP program
/// (`EEXIST`: one of the other mode; `EBUSY`: one of this mode), not for its driver.
fn occupied(e: &Error) -> bool {
    matches!(e.errno(), Some(libc::EEXIST | libc::EBUSY))
}

fn attach_as(
    prog: &mut Xdp,
    links_dir: &Path,
    name: &str,
    index: u32,
    how: Running,
) -> Result<Running> {
    let pin = links_dir.join(format!("{}{name}", how.prefix()));
    if adopt(prog, &pin, name, index)? {
        return Ok(how);
    }
    let id = prog
        .attach(index, how.kernel())
        .kind_with(ErrorKind::Attach, || {
            format!("attaching {XDP_PROGRAM} to {name} ({} XDP)", how.as_str())
        })?;
    let link = FdLink::try_from(prog.take_link(id)?).kind(
        ErrorKind::Attach,
        "the kernel gave a netlink XDP attachment, not a bpf_link (kernel < 5.9?)",
    )?;
    link.pin(&pin)
        .kind_with(ErrorKind::Attach, || format!("pinning {}", pin.display()))?;
    tracing::info!(
        interface = name,
        mode = how.as_str(),
        "XDP program attached"
    );
    Ok(how)
}

/// Swaps our program into the link pinned at `pin` if it is on this very device.
fn adopt(prog: &mut Xdp, pin: &Path, name: &str, index: u32) -> Result<bool> {
    if !pin.exists() {
        return Ok(false);
    }
    if let Some(fd_link) =
        link_update::pinned_on_device(pin, index, name, link_update::DeviceLink::Xdp)?
    {
        let id = prog
            .attach_to_link(XdpLink::try_from(fd_link)?)
            .kind_with(ErrorKind::Attach, || {
                format!("replacing {XDP_PROGRAM} on {name}")
            })?;
        // Pinned already: dropping our fd keeps it attached.
        drop(FdLink::try_from(prog.take_link(id)?)?);
        tracing::info!(interface = name, "XDP link adopted");
        return Ok(true);
    }
    remove_pin(pin);
    Ok(false)
}

fn remove_pin(pin: &Path) {
    if let Err(e) = fs::remove_file(pin)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(pin = %pin.display(), error = %e, "stale XDP pin left");
    }
}

/// The device's driver as `ethtool -i` names it ("?" when it will not say).
pub fn driver(name: &str) -> String {
    drvinfo(name).unwrap_or_else(|| "?".to_string())
}

fn drvinfo(name: &str) -> Option<String> {
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_GDRVINFO: u32 = 3;
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        rest: [u8; 160],
    }
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        data: *mut DrvInfo,
        _pad: [u8; 16],
    }
    let bytes = name.as_bytes();
    if bytes.len() >= libc::IFNAMSIZ {
        return None;
    }
    let mut info = DrvInfo {
        cmd: ETHTOOL_GDRVINFO,
        driver: [0; 32],
        rest: [0; 160],
    };
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        data: &mut info,
        _pad: [0; 16],
    };
    req.name[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: a datagram socket only for the ioctl, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `req` and the `info` it points at outlive the call; the kernel writes
    // at most sizeof(struct ethtool_drvinfo) (196 bytes) into `info`.
    let rc = unsafe { libc::ioctl(fd, SIOCETHTOOL, &mut req) };
    // SAFETY: our own descriptor.
    unsafe { libc::close(fd) };
    if rc < 0 {
        return None;
    }
    let end = info.driver.iter().position(|b| *b == 0).unwrap_or(32);
    Some(String::from_utf8_lossy(&info.driver[..end]).into_owned())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print_as_configured() {
        for text in ["off", "native", "best-effort", "generic"] {
            let mode: XdpMode = text.parse().expect("mode");
            assert_eq!(mode.to_string(), text);
        }
        assert!("driver".parse::<XdpMode>().is_err());
        assert_eq!(XdpMode::default(), XdpMode::Off);
    }

    /// Only a device already taken is "occupied": other refusals are the driver's.
    #[test]
    fn a_taken_device_is_told_from_a_driver_refusal() {
        let kernel = |errno| {
            Error::caused(
                ErrorKind::Attach,
                "attaching",
                std::io::Error::from_raw_os_error(errno),
            )
        };
        assert!(occupied(&kernel(libc::EEXIST)));
        assert!(occupied(&kernel(libc::EBUSY)));
        assert!(!occupied(&kernel(libc::EOPNOTSUPP)));
        assert!(!occupied(&kernel(libc::EINVAL)));
        assert!(!occupied(&Error::new(ErrorKind::Attach, "File exists")));
    }

    #[test]
    fn pinned_links_tell_their_mode() {
        let dir = std::env::temp_dir().join(format!("xdp-pins-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        fs::write(dir.join("xdp-native@eth0"), "").expect("pin");
        fs::write(dir.join("xdp-generic@vlan10"), "").expect("pin");
        fs::write(dir.join("tc_ingress@eth0"), "").expect("pin");
        let found = pinned(&dir);
        let _ = fs::remove_dir_all(&dir);
        assert_eq!(
            found.into_iter().collect::<Vec<_>>(),
            vec![
                ("eth0".to_string(), Running::Native),
                ("vlan10".to_string(), Running::Generic)
            ]
        );
    }
}
