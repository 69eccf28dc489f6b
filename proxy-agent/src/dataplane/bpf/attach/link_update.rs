//! Swapping a new program into a pinned link (`BPF_LINK_UPDATE`), for link types whose
//! aya wrapper has no `attach_to_link` (cgroup sock programs).

use std::{
    ffi::CString,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::Path,
};

use anyhow::{Context as _, Result, bail};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_UPDATE: libc::c_long = 29;

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

/// Makes the link pinned at `pin` run `prog` from now on; the link (and its attachment)
/// stays, so there is no moment without a program.
pub fn replace_program(pin: &Path, prog: BorrowedFd<'_>) -> Result<()> {
    let path = CString::new(pin.as_os_str().as_encoded_bytes())?;
    let ptr = path.as_ptr() as u64;
    // bpf_attr for BPF_OBJ_GET: pathname (u64), bpf_fd, file_flags.
    let fd = bpf(BPF_OBJ_GET, &[ptr as u32, (ptr >> 32) as u32, 0, 0])
        .with_context(|| format!("opening pinned link {}", pin.display()))?;
    let Ok(raw) = i32::try_from(fd) else {
        bail!("bpf(BPF_OBJ_GET) returned {fd}");
    };
    // SAFETY: a fresh file descriptor the kernel just gave us; owned from here on.
    let link = unsafe { OwnedFd::from_raw_fd(raw) };
    // bpf_attr for BPF_LINK_UPDATE: link_fd, new_prog_fd, flags, old_prog_fd.
    bpf(
        BPF_LINK_UPDATE,
        &[link.as_raw_fd() as u32, prog.as_raw_fd() as u32, 0, 0],
    )
    .with_context(|| format!("replacing the program of {}", pin.display()))?;
    Ok(())
}
