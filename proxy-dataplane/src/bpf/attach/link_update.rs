//! Pinned links: swapping a new program in (`BPF_LINK_UPDATE`, for link types whose aya
//! wrapper has no `attach_to_link`: cgroup sock programs), and what the kernel says of
//! one (its fdinfo: the program it runs, the device or cgroup it is attached to).

use std::{
    ffi::CString,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::Path,
};

use crate::error::{ErrorKind, Kind as _, Result, fail};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `bpf(cmd, attr)`; the attribute union is passed zero-padded, as the kernel wants.
fn bpf(cmd: libc::c_long, attr: &[u32]) -> std::io::Result<libc::c_long> {
    let mut buf = [0u64; 16];
    // SAFETY: `attr` fits in `buf` (checked by the callers' sizes); plain copy of words.
    unsafe {
        std::ptr::copy_nonoverlapping(attr.as_ptr(), buf.as_mut_ptr().cast::<u32>(), attr.len());
    }
    // SAFETY: `buf` is a valid, zero-padded bpf_attr of the size we pass.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            buf.as_mut_ptr(),
            std::mem::size_of_val(&buf),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

/// BPF_OBJ_GET: a file descriptor for the object pinned at `pin` (aya keeps its own
/// private).
fn open_pinned(pin: &Path) -> Result<OwnedFd> {
    let path = CString::new(pin.as_os_str().as_encoded_bytes())?;
    let ptr = path.as_ptr() as u64;
    // bpf_attr for BPF_OBJ_GET: pathname (u64), bpf_fd, file_flags (0: links are only
    // handed out read-write).
    let fd = bpf(BPF_OBJ_GET, &[ptr as u32, (ptr >> 32) as u32, 0, 0])
        .kind_with(ErrorKind::Attach, || {
            format!("opening pinned object {}", pin.display())
        })?;
    let Ok(raw) = i32::try_from(fd) else {
        fail!(ErrorKind::Attach, "bpf(BPF_OBJ_GET) returned {fd}");
    };
    // SAFETY: a fresh file descriptor the kernel just gave us; owned from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// One number of the fdinfo of the link pinned at `pin` (`prog_id`, `ifindex` of a tcx
/// link, `cgroup_id` of a cgroup link: 0 once the link is detached from its device or
/// cgroup).
pub fn pinned_field(pin: &Path, key: &str) -> Result<u64> {
    let fd = open_pinned(pin)?;
    let path = format!("/proc/self/fdinfo/{}", fd.as_raw_fd());
    let info = std::fs::read_to_string(&path)
        .kind_with(ErrorKind::Attach, || format!("reading {path}"))?;
    info.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .kind_with(ErrorKind::Attach, || {
            format!("no {key} in the fdinfo of {}", pin.display())
        })?
        .trim()
        .parse::<u64>()
        .kind_with(ErrorKind::Attach, || {
            format!("parsing {key} of {}", pin.display())
        })
}

/// Makes the link pinned at `pin` run `prog` from now on; the link (and its attachment)
/// stays, so there is no moment without a program.
pub fn replace_program(pin: &Path, prog: BorrowedFd<'_>) -> Result<()> {
    let link = open_pinned(pin)?;
    // bpf_attr for BPF_LINK_UPDATE: link_fd, new_prog_fd, flags, old_prog_fd.
    bpf(
        BPF_LINK_UPDATE,
        &[link.as_raw_fd() as u32, prog.as_raw_fd() as u32, 0, 0],
    )
    .kind_with(ErrorKind::Attach, || {
        format!("replacing the program of {}", pin.display())
    })?;
    Ok(())
}

/// Detaches the link pinned at `pin` from its device now (`BPF_LINK_DETACH`); the pin
/// stays, of a link that is attached to nothing. Unpinning alone releases the link
/// later, from a kernel work queue: an attachment made right after it can still find
/// the device taken.
pub fn detach_now(pin: &Path) -> Result<()> {
    let link = open_pinned(pin)?;
    // bpf_attr for BPF_LINK_DETACH: link_fd.
    bpf(BPF_LINK_DETACH, &[link.as_raw_fd() as u32])
        .kind_with(ErrorKind::Attach, || format!("detaching {}", pin.display()))?;
    Ok(())
}

/// Which pinned device link `pinned_on_device` reads (its log lines name it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceLink {
    Tcx,
    Xdp,
}

/// The link pinned at `pin`, when it is attached to the device `index` (`name`, for the
/// log): a program swapped into it keeps the device served without a gap. `None` when
/// the pin is of an earlier device of this name, or unreadable: the caller replaces it.
pub fn pinned_on_device(
    pin: &Path,
    index: u32,
    name: &str,
    link: DeviceLink,
) -> Result<Option<aya::programs::links::FdLink>> {
    // The log names XDP's link as it always has, a tcx link plainly.
    let what = match link {
        DeviceLink::Tcx => "link",
        DeviceLink::Xdp => "XDP link",
    };
    match pinned_field(pin, "ifindex") {
        Ok(pinned) if pinned == u64::from(index) => {
            let link = aya::programs::links::PinnedLink::from_pin(pin)
                .kind_with(ErrorKind::Attach, || {
                    format!("opening pinned link {}", pin.display())
                })?;
            return Ok(Some(link.into()));
        }
        Ok(pinned) => tracing::info!(
            interface = name,
            pinned_ifindex = pinned,
            ifindex = index,
            "pinned {what} belongs to an earlier device of this name; replacing it"
        ),
        Err(e) => tracing::warn!(
            interface = name,
            error = format!("{e:#}"),
            "pinned {what} unreadable; replacing it"
        ),
    }
    Ok(None)
}
