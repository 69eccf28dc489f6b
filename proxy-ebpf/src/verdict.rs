//! Verdict codes of the per-packet pipeline: what a packet's program returns, and where a
//! translated packet goes next. The pipeline speaks TC's codes at either hook; the XDP
//! entry maps them to XDP actions (`xdp_action`), with two codes of its own for what
//! only XDP does.
//!
//! Layer 0 (a leaf). Owns: `PASS_ON`, `DONE`, `DROP`, `XDP_SENT_BACK`, `XDP_REDIRECTED`, `TO_TC`,
//! `Verdict`, `xdp_action`. May import: no crate module.

use aya_ebpf::bindings::{
    TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC,
    xdp_action::{XDP_DROP, XDP_PASS, XDP_REDIRECT, XDP_TX},
};

/// Where a translated packet goes next.
pub enum Verdict {
    /// On through the stack (routing, local delivery).
    Stack,
    /// Already sent out of an interface: return this code.
    Redirected(i32),
}

impl Verdict {
    pub fn code(self) -> i32 {
        match self {
            Verdict::Stack => DONE,
            Verdict::Redirected(code) => code,
        }
    }
}

/// Not ours: let the next program (or the stack) have it.
pub const PASS_ON: i32 = TC_ACT_UNSPEC;
pub const DONE: i32 = TC_ACT_OK as i32;
/// Dropped: given only by `drop::packet`, which counts why.
pub const DROP: i32 = TC_ACT_SHOT as i32;

/// XDP: translated and sent back out of the interface it came in on (`XDP_TX`). (Outside
/// TC's range of codes.)
pub const XDP_SENT_BACK: i32 = 0x100;
/// XDP: translated and handed to another interface (`bpf_redirect`'s `XDP_REDIRECT`).
pub const XDP_REDIRECTED: i32 = 0x101;

/// XDP: a packet of ours (a frontend's, a flow's) that XDP cannot finish, passed to the
/// stack unchanged for TC to handle (`XDP_PASS`).
pub const TO_TC: i32 = 0x102;

/// The XDP action for the pipeline's verdict. Everything but a drop and a send passes on
/// to the stack, where TC's programs finish what XDP left (the pipeline passes a packet
/// it cannot finish before changing it).
#[inline(always)]
pub fn xdp_action(verdict: i32) -> u32 {
    match verdict {
        DROP => XDP_DROP,
        XDP_SENT_BACK => XDP_TX,
        XDP_REDIRECTED => XDP_REDIRECT,
        _ => XDP_PASS,
    }
}
