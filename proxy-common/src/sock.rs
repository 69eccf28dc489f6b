//! The connect-time path's per-socket state (`SOCK_CONNECTED`, `SOCK_LB`).

/// One frontend a socket was sent to by the connect-time hooks, and the backend chosen.
/// `service_id == 0` marks an empty binding.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockBinding {
    /// The backend's own address (IPv4 for an IPv6 socket that named `::ffff:a.b.c.d`).
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub family: u8,
    pub _pad: u8,
    /// The service entry the backend was chosen from (`MEMBERS` key).
    pub service_id: u32,
    /// The frontend replies are shown as (`REV_NAT` key).
    pub rev_nat_id: u32,
    pub backend_id: u32,
    /// `bpf_ktime_get_ns()` when the backend was chosen: the binding holds while
    /// `MEMBERS` has the pair since no later than this. `sent` bindings only (0 in
    /// `connected`, which nothing re-checks).
    pub bound_ns: u64,
}

/// `SockLb::sent` length: frontends one unconnected socket keeps a backend for at once.
pub const SOCK_SENT_SLOTS: usize = 8;

/// `SOCK_LB` value (keyed by the socket cookie, a `u64`): what the connect-time hooks did
/// for one socket. Deleted by `sock_release` when the socket goes.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockLb {
    /// Where `connect` sent the socket (TCP, connected UDP, SCTP).
    pub connected: SockBinding,
    /// Where `sendto` datagrams go, per frontend (unconnected UDP).
    pub sent: [SockBinding; SOCK_SENT_SLOTS],
    /// The `sent` slot to reuse next when all are taken.
    pub next: u32,
    /// The `SockLbFilter::generation` this entry is counted under in `SOCK_LB_COUNTS`
    /// (0: not counted, as an older release made it).
    pub counted: u32,
}

/// `SOCK_LB_FILTER`'s one value: lets `sock_release` skip the `SOCK_LB` lookup for a
/// socket no hook ever translated (most sockets), whose bucket is a cache miss away.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockLbFilter {
    /// The generation entries made now are counted under (the agent sets the id of the
    /// `SOCK_LB_COUNTS` map in use); 0: no counting, every release looks its socket up.
    pub generation: u32,
    /// Nonzero while `SOCK_LB` may hold entries not counted under `generation` (made by
    /// an older release, or under another counts map): every release looks its socket
    /// up. The agent sets it at start and clears it once no such entry is left.
    pub uncounted: u32,
}

/// `SOCK_CONNECTED` value: the binding of the connected socket whose cookie names this
/// slot (`sock_slot`). `cookie == 0`: a free slot.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockSlot {
    pub cookie: u64,
    pub binding: SockBinding,
}

/// The `SOCK_CONNECTED` index of a socket cookie. Consecutive cookies (sockets made one
/// after another take consecutive ones) take consecutive slots: a new connection's slot
/// shares a cache line with the last one's, where a hash bucket would be a cache miss.
pub const fn sock_slot(cookie: u64) -> u32 {
    cookie_index(cookie, crate::maps::capacity::SOCK_CONNECTED)
}

/// The `SOCK_LB_COUNTS` index of a socket cookie. Consecutive cookies (sockets released
/// one after another take consecutive ones) share cache lines.
pub const fn sock_count_slot(cookie: u64) -> u32 {
    cookie_index(cookie, crate::maps::capacity::SOCK_LB_COUNTS)
}

/// The index of `cookie` in an array of `len` entries indexed by cookie.
const fn cookie_index(cookie: u64, len: u32) -> u32 {
    (cookie % len as u64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    /// Sizes are part of the ABI: a change here must be a deliberate, versioned change.
    #[test]
    fn layout_is_stable() {
        assert_eq!(size_of::<SockBinding>(), 40);
        assert_eq!(size_of::<SockLb>(), 40 * (1 + SOCK_SENT_SLOTS) + 8);
        assert_eq!(size_of::<SockLbFilter>(), 8);
        assert_eq!(size_of::<SockSlot>(), 48);
    }

    #[test]
    fn consecutive_cookies_take_consecutive_slots() {
        use crate::capacity::{SOCK_CONNECTED, SOCK_LB_COUNTS};
        let slots = [
            (sock_slot as fn(u64) -> u32, SOCK_CONNECTED),
            (sock_count_slot, SOCK_LB_COUNTS),
        ];
        for (slot, cap) in slots {
            let cap = u64::from(cap);
            assert_eq!(slot(7), 7);
            assert_eq!(slot(cap + 7), 7);
            assert_eq!(slot(cap - 1) + 1, cap as u32);
        }
    }

    /// No implicit padding: the sum of the field sizes equals the struct size.
    #[test]
    fn no_implicit_padding() {
        assert_eq!(size_of::<SockBinding>(), 16 + 2 + 1 + 1 + 4 + 4 + 4 + 8);
    }
}
