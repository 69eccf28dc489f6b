//! What this kernel offers, probed once at start: where a feature has a fallback the
//! choice is made here (tcx or a clsact filter, `bpf_set_retval` or EPERM), and a missing
//! essential refuses to start with the feature named.
//!
//! What the programs need beyond Linux 5.14 (RHEL 9) / 5.15 (Ubuntu 22.04), and how
//! each is met:
//! - tcx links (6.6): a `bpf` filter on a clsact qdisc instead (see `clsact`).
//! - `bpf_set_retval` in sock_addr programs (5.18): without it, a connect to a Service
//!   with no endpoints fails with EPERM instead of ECONNREFUSED (`SET_RETVAL` global).
//! - `BPF_FIB_LOOKUP_SKIP_NEIGH` (6.3): the classifier asks again without the flag.
//! - `bpf_ktime_get_coarse_ns` (5.11): the flows' clock reads `bpf_ktime_get_ns` instead
//!   (`COARSE_CLOCK` global).
//!
//! Everything else is older than 5.14 and probed here so an older kernel is refused by
//! name rather than by a verifier log; attach points that cannot be probed without
//! attaching (cgroup bpf_link 5.7, getpeername hooks 5.8, sock_release 5.9) name their
//! feature in the attach error.

use std::{fmt, str::FromStr, sync::OnceLock};

use crate::error::{ErrorKind, Kind as _, Result, fail};
use aya::{
    maps::MapType,
    programs::{ProgramError, ProgramType, SchedClassifier, TcAttachType},
    sys::{BpfHelper, is_bpf_global_data_supported, is_helper_supported, is_map_supported},
};

/// The loopback device, ifindex 1 in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

/// How the classifier is hooked to an interface (`--tc-attach`, `ebpf.tcAttach`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TcAttachMode {
    /// tcx where the kernel has it, else clsact.
    #[default]
    Auto,
    Tcx,
    Clsact,
}

impl FromStr for TcAttachMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "tcx" => Ok(Self::Tcx),
            "clsact" => Ok(Self::Clsact),
            other => Err(format!("{other:?}: expected auto, tcx or clsact")),
        }
    }
}

impl fmt::Display for TcAttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Tcx => "tcx",
            Self::Clsact => "clsact",
        })
    }
}

/// The hook the classifier gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcHook {
    /// A tcx bpf_link per hook (Linux 6.6), pinned under `links/`.
    Tcx,
    /// A `bpf` filter on the device's clsact qdisc, through netlink.
    Clsact,
}

/// Picks the hook for `mode`; `tcx` where the kernel has none is refused.
pub fn choose_tc_hook(mode: TcAttachMode) -> Result<TcHook> {
    let tcx = tcx_supported()?;
    match mode {
        TcAttachMode::Clsact => Ok(TcHook::Clsact),
        TcAttachMode::Tcx if !tcx => fail!(
            ErrorKind::Kernel,
            "tc attach mode tcx: this kernel has no tcx (BPF_TCX_INGRESS/EGRESS links, \
             Linux 6.6); use auto or clsact"
        ),
        TcAttachMode::Tcx => Ok(TcHook::Tcx),
        TcAttachMode::Auto if tcx => Ok(TcHook::Tcx),
        TcAttachMode::Auto => Ok(TcHook::Clsact),
    }
}

/// BPF_PROG_QUERY of loopback's tcx ingress: answered where tcx exists, EINVAL where the
/// kernel does not know the attach type. Read-only: nothing is attached to find out.
pub fn tcx_supported() -> Result<bool> {
    match SchedClassifier::query_tcx(LOOPBACK_IFINDEX, TcAttachType::Ingress) {
        Ok(_) => Ok(true),
        Err(ProgramError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EINVAL) => {
            Ok(false)
        }
        Err(e) => Err(e).kind(ErrorKind::Kernel, "probing tcx (BPF_PROG_QUERY on lo)"),
    }
}

/// This kernel's version (major, minor), from `/proc/sys/kernel/osrelease`: for logs and
/// tests only — the probes decide.
pub fn release() -> Result<(u32, u32)> {
    let text = release_text()?;
    let mut parts = text.split(['.', '-']).map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => Ok((major, minor)),
        _ => fail!(
            ErrorKind::Kernel,
            "{OSRELEASE}: unexpected release {text:?}"
        ),
    }
}

const OSRELEASE: &str = "/proc/sys/kernel/osrelease";

/// This kernel's release as it names itself (`6.1.0-57-amd64`).
pub fn release_text() -> Result<String> {
    let text = std::fs::read_to_string(OSRELEASE)
        .kind_with(ErrorKind::Kernel, || format!("reading {OSRELEASE}"))?;
    Ok(text.trim().to_string())
}

/// Whether sock_addr programs may call `bpf_set_retval` (Linux 5.18); probed once. A
/// failed probe: the older kernel (EPERM is a safe answer).
pub fn has_set_retval() -> bool {
    static PROBED: OnceLock<bool> = OnceLock::new();
    probed_once(
        &PROBED,
        ProgramType::CgroupSockAddr,
        BpfHelper::BPF_FUNC_set_retval,
    )
}

/// Whether the classifier may call `bpf_ktime_get_coarse_ns` (Linux 5.11); probed once.
/// A failed probe: the fine clock, which every kernel has.
pub fn has_coarse_clock() -> bool {
    static PROBED: OnceLock<bool> = OnceLock::new();
    probed_once(
        &PROBED,
        ProgramType::SchedClassifier,
        BpfHelper::BPF_FUNC_ktime_get_coarse_ns,
    )
}

/// A helper's probe, made once per process and kept in `cell`; false when it fails.
fn probed_once(cell: &OnceLock<bool>, program: ProgramType, helper: BpfHelper) -> bool {
    *cell.get_or_init(|| is_helper_supported(program, helper).unwrap_or(false))
}

/// One thing the programs cannot do without.
struct Need {
    what: &'static str,
    since: &'static str,
    probe: fn() -> Result<bool>,
}

fn map(t: MapType) -> Result<bool> {
    is_map_supported(t).kind_with(ErrorKind::Kernel, || format!("probing map type {t:?}"))
}

fn helper(p: ProgramType, h: BpfHelper) -> Result<bool> {
    is_helper_supported(p, h).kind_with(ErrorKind::Kernel, || format!("probing {h:?} for {p:?}"))
}

/// Needed whatever is attached: the maps and globals of the object.
const COMMON: &[Need] = &[
    Need {
        what: "BPF global data (.rodata/.bss)",
        since: "5.2",
        probe: || Ok(is_bpf_global_data_supported()?),
    },
    Need {
        what: "LRU hash maps",
        since: "4.10",
        probe: || map(MapType::LruHash),
    },
    Need {
        what: "LPM trie maps",
        since: "4.11",
        probe: || map(MapType::LpmTrie),
    },
    Need {
        what: "BPF ring buffers (program logs)",
        since: "5.8",
        probe: || map(MapType::RingBuf),
    },
];

/// Needed by the per-packet classifier.
const PER_PACKET: &[Need] = &[
    Need {
        what: "bpf_fib_lookup in tc programs",
        since: "4.18",
        probe: || helper(ProgramType::SchedClassifier, BpfHelper::BPF_FUNC_fib_lookup),
    },
    Need {
        what: "bpf_redirect_neigh in tc programs",
        since: "5.10",
        probe: || {
            helper(
                ProgramType::SchedClassifier,
                BpfHelper::BPF_FUNC_redirect_neigh,
            )
        },
    },
];

/// Needed by the connect-time hooks.
const CONNECT_TIME: &[Need] = &[
    Need {
        what: "bpf_get_netns_cookie in sock_addr programs",
        since: "5.7",
        probe: || {
            helper(
                ProgramType::CgroupSockAddr,
                BpfHelper::BPF_FUNC_get_netns_cookie,
            )
        },
    },
    Need {
        what: "bpf_get_socket_cookie in sock_addr programs",
        since: "4.19",
        probe: || {
            helper(
                ProgramType::CgroupSockAddr,
                BpfHelper::BPF_FUNC_get_socket_cookie,
            )
        },
    },
    Need {
        what: "bpf_get_socket_cookie in cgroup sock programs (sock_release)",
        since: "5.7",
        probe: || {
            helper(
                ProgramType::CgroupSock,
                BpfHelper::BPF_FUNC_get_socket_cookie,
            )
        },
    },
];

/// What was found: the fallbacks in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    /// The classifier's hook, when it is attached anywhere.
    pub tc_hook: Option<TcHook>,
    /// `bpf_set_retval` for the connect-time refusal (ECONNREFUSED rather than EPERM).
    pub set_retval: bool,
    /// `bpf_ktime_get_coarse_ns` for the flows' clock (else `bpf_ktime_get_ns`).
    pub coarse_clock: bool,
}

impl Kernel {
    /// The helpers' switches as probed, nothing attached: for loads that attach nothing
    /// (tests, `trace`).
    pub fn probed_helpers() -> Self {
        Self {
            tc_hook: None,
            set_retval: has_set_retval(),
            coarse_clock: has_coarse_clock(),
        }
    }
}

/// Probes what the enabled parts need; refuses, naming every missing feature, when
/// something essential is absent.
pub fn check(connect_time: bool, per_packet: Option<TcAttachMode>) -> Result<Kernel> {
    let mut needs: Vec<&Need> = COMMON.iter().collect();
    if per_packet.is_some() {
        needs.extend(PER_PACKET);
    }
    if connect_time {
        needs.extend(CONNECT_TIME);
    }
    let mut missing = Vec::new();
    for need in needs {
        if !(need.probe)()? {
            missing.push(format!("{} (Linux {})", need.what, need.since));
        }
    }
    if !missing.is_empty() {
        fail!(
            ErrorKind::Kernel,
            "this kernel lacks what the programs need: {}",
            missing.join(", ")
        );
    }
    let kernel = Kernel {
        tc_hook: per_packet.map(choose_tc_hook).transpose()?,
        ..Kernel::probed_helpers()
    };
    if connect_time && !kernel.set_retval {
        tracing::warn!(
            "no bpf_set_retval in sock_addr programs (Linux 5.18): a connect to a Service \
             without endpoints fails with EPERM instead of ECONNREFUSED"
        );
    }
    // One line naming every choice, so an operator with a mixed fleet reads from the log
    // what this node's kernel gave (docs/kernels.md lists what each one costs).
    tracing::info!(
        release = release_text().unwrap_or_default(),
        tc_hook = ?kernel.tc_hook,
        set_retval = kernel.set_retval,
        coarse_clock = kernel.coarse_clock,
        "kernel features chosen"
    );
    if per_packet.is_some() && !kernel.coarse_clock {
        tracing::info!(
            "no bpf_ktime_get_coarse_ns (Linux 5.11): the flows' clock reads the fine \
             monotonic clock, a little dearer per packet"
        );
    }
    Ok(kernel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print() {
        for m in [TcAttachMode::Auto, TcAttachMode::Tcx, TcAttachMode::Clsact] {
            assert_eq!(m.to_string().parse::<TcAttachMode>(), Ok(m));
        }
        assert!("netlink".parse::<TcAttachMode>().is_err());
    }
}
