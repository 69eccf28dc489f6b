//! The per-packet programs' one drop exit, as Cilium's `bpf/lib/drop.h`: a packet is
//! dropped only by `packet(reason)`, which counts the reason in `COUNTERS` (exported as
//! `bpf_events_total{event}`) and gives the verdict, so no drop goes uncounted.
//!
//! Layer 1 (a leaf: every caller is above it). Owns: `Reason` (each a
//! `proxy_common::counter` index) and `packet`. May import: `maps`, `verdict`.

use proxy_common::counter;

use crate::{maps::count, verdict::DROP};

/// Why a packet is dropped: its `COUNTERS` index. (An `Option<Reason>` is as small as
/// a `Reason`: one register.)
#[repr(u32)]
#[derive(Clone, Copy)]
pub enum Reason {
    /// A lookup or helper that cannot fail did (index 0 of a one-entry array, a valid
    /// scratch index, a helper given valid arguments): a bug if ever counted.
    Unreachable = counter::DROP_UNREACHABLE,
    /// No usable backend, and the Service drops rather than refuses.
    NoBackend = counter::NO_BACKEND_DROP,
    /// The client is outside the Service's `loadBalancerSourceRanges`.
    SourceRange = counter::SOURCE_RANGE_DROP,
    /// A TCP segment other than a SYN, for a frontend, with no flow.
    CtInvalid = counter::CT_INVALID,
    /// No masquerade port left for a new flow.
    SnatPortsExhausted = counter::SNAT_PORTS_EXHAUSTED,
    /// A rewrite of the packet (translation, direct server return's option, XDP's next
    /// hop, the SCTP checksum) failed half-way.
    RewriteFailed = counter::REWRITE_FAILED,
    /// A refusal or "too big" over the rate limit.
    RejectRateLimited = counter::REJECT_RATE_LIMITED,
    /// A refusal or "too big" not made: the packet has IP options or an IPv6 extension
    /// header.
    RejectIpOptions = counter::REJECT_IP_OPTIONS,
    /// Making a refusal or "too big" failed half-way (a helper failed).
    RejectFailed = counter::REJECT_FAILED,
    /// Direct server return's option not believed, by reason (`dsr::refusal`).
    DsrRefusedSource = counter::DSR_REFUSED_SOURCE,
    DsrRefusedFrontend = counter::DSR_REFUSED_FRONTEND,
    DsrRefusedBackend = counter::DSR_REFUSED_BACKEND,
    DsrRefusedNode = counter::DSR_REFUSED_NODE,
}

/// Drops the packet for `reason`: counts it, and returns the verdict. (Inlined: a call
/// would put a frame of its own on the deepest call chain.)
#[inline(always)]
pub fn packet(reason: Reason) -> i32 {
    count(reason as u32);
    DROP
}
