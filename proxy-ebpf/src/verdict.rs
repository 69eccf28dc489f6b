//! Verdict codes of the classifiers: what a packet's program returns, and where a
//! translated packet goes next.
//!
//! Layer 0 (a leaf). Owns: `PASS_ON`, `DONE`, `DROP`, `Verdict`. May import: no crate
//! module.

use aya_ebpf::bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC};

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
pub const DROP: i32 = TC_ACT_SHOT as i32;
