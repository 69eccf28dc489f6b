//! The packet as the per-packet pipeline sees it, whichever hook runs it: TC (an skb) or
//! XDP (the driver's buffer, before an skb exists). One pipeline, two hooks: the code that
//! parses, tracks, balances and rewrites is generic over `Frame`, and each hook supplies
//! loads, stores and checksum updates.
//!
//! Checksums: XDP has no `l3/l4_csum_replace`, so its frames fold the difference
//! themselves (`csum`, RFC 1624). TC keeps the kernel's helpers: an skb may be
//! `CHECKSUM_PARTIAL` (a GSO or locally made packet whose L4 field holds only the
//! pseudo-header sum, not inverted) or `CHECKSUM_COMPLETE` (a `skb->csum` to keep in step
//! with the bytes), and only `bpf_l4_csum_replace` knows which and updates the right one.
//! At XDP a frame is what the wire delivered: its checksums are complete.
//!
//! Layer 0 (a leaf). Owns: `Frame`, its TC and XDP implementations, `CsumKind`, and the
//! one's-complement arithmetic (`csum`) every rewrite that folds its own checksum uses.
//! May import: no crate module.

use core::{ffi::c_void, mem::MaybeUninit};

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        __sk_buff, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, bpf_adj_room_mode::BPF_ADJ_ROOM_NET,
        xdp_md,
    },
    helpers::{bpf_csum_update, bpf_xdp_adjust_head, bpf_xdp_load_bytes, bpf_xdp_store_bytes},
    programs::{TcContext, XdpContext},
};

/// What an L4 checksum update covers.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum CsumKind {
    /// TCP's checksum (and UDP's over IPv6): a zero is a value like any other.
    Always,
    /// UDP: zero means "no checksum" (IPv4) and stays zero (over IPv6, where a zero is
    /// invalid, it is left for the receiver to drop); a computed zero is sent as 0xffff.
    ZeroIsNone,
}

/// A packet of either hook.
pub trait Frame {
    /// Runs at XDP: no skb, so no checksum states, no `bpf_redirect_neigh`, no resizing
    /// helpers; whatever the pipeline cannot finish goes to TC unchanged.
    const XDP: bool;

    fn load<T>(&self, off: usize) -> Result<T, i64>;
    fn store<T>(&self, off: usize, v: &T) -> Result<(), i64>;
    /// Makes the first `len` bytes (or the whole packet, if shorter) directly readable:
    /// `load` and `store` of small fields reach only those.
    fn linearize(&self, len: usize);
    /// The packet's length (the linear part and the rest).
    fn len(&self) -> u32;
    /// The interface the packet arrived on.
    fn ifindex(&self) -> u32;
    /// The context pointer helpers take.
    fn ptr(&self) -> *mut c_void;
    /// The L4 checksum at `off` after the data it covers changed: `pseudo` is the sum of
    /// the changes in the pseudo-header (addresses), `plain` of those in the segment
    /// itself (ports), each as `csum::delta`s. (One update per packet side, not one per
    /// field: the sums are folded here.)
    fn l4_csum_diff(&self, off: usize, pseudo: u64, plain: u64, kind: CsumKind) -> Result<(), i64>;
    /// The skb, for what only TC can do (refusals, ICMP errors, the SCTP tail call).
    fn tc(&self) -> Option<&TcContext>;
    /// `ROOM` bytes of room right after the base IP header, which ends `BASE` bytes into
    /// the frame (34 for IPv4, 54 for IPv6): the Ethernet and base IP headers move
    /// ahead, the rest stays. Nothing else changes (the caller writes the room and fixes
    /// the header's fields).
    fn grow_network_header<const BASE: usize, const ROOM: usize>(&self) -> Result<(), i64>;
    /// The frame's bytes changed by `diff` (a sum of `csum::delta`s) where no checksum
    /// field in it makes up for the change (an IPv6 header's fields, an inserted header):
    /// a `CHECKSUM_COMPLETE` skb's `skb->csum` follows. Other states, and XDP, need nothing.
    fn bytes_changed(&self, diff: u64);
}

/// The skb's `data` and `data_end`, read afresh each time: volatile reads, so that LLVM
/// never hands them to a non-inlined function as arguments (it promotes plain reads,
/// and the verifier refuses arithmetic on a `data_end` passed that way).
#[inline(always)]
fn skb_data(ctx: &TcContext) -> usize {
    // SAFETY: the context is a valid __sk_buff; `data` is a plain readable field.
    unsafe { core::ptr::read_volatile(&(*(ctx.as_ptr() as *const __sk_buff)).data) as usize }
}

#[inline(always)]
fn skb_data_end(ctx: &TcContext) -> usize {
    // SAFETY: as for `skb_data`.
    unsafe { core::ptr::read_volatile(&(*(ctx.as_ptr() as *const __sk_buff)).data_end) as usize }
}

impl Frame for TcContext {
    const XDP: bool = false;

    // The small fields directly, in the linear part `linearize` made (a helper call per
    // field costs more than the field's own work); the larger ones by the helper, whose
    // byte-wise direct copies would crowd the 512-byte stack. No fallback to the helper
    // for the small ones: one path per load keeps the verifier's walk short.
    #[inline(always)]
    fn load<T>(&self, off: usize) -> Result<T, i64> {
        if core::mem::size_of::<T>() > 4 {
            return TcContext::load(self, off);
        }
        let p = skb_data(self) + off;
        // (At least 2: LLVM turns `p + 1 <= end` into `p < end`, which the verifier does
        // not follow. No field read alone ends a packet.)
        if p + core::mem::size_of::<T>().max(2) > skb_data_end(self) {
            return Err(-1);
        }
        // SAFETY: inside the linear part (checked above); T is plain data.
        Ok(unsafe { (p as *const T).read_unaligned() })
    }

    #[inline(always)]
    fn store<T>(&self, off: usize, v: &T) -> Result<(), i64> {
        if core::mem::size_of::<T>() > 4 {
            return TcContext::store(self, off, v, 0);
        }
        let p = skb_data(self) + off;
        // (`max(2)`: as in `load`.)
        if p + core::mem::size_of::<T>().max(2) > skb_data_end(self) {
            return Err(-1);
        }
        // SAFETY: inside the linear part (checked above), which a classifier may write
        // (the kernel unclones a cloned skb before such a program runs).
        unsafe { (p as *mut T).write_unaligned(core::ptr::read(v)) };
        Ok(())
    }

    #[inline(always)]
    fn linearize(&self, len: usize) {
        // Short packets (an ACK is 54 bytes) are linear whole: no helper call for them.
        let len = (len as u32).min(TcContext::len(self));
        if skb_data(self) + len as usize <= skb_data_end(self) {
            return;
        }
        // A failure leaves the packet as it was: what lies beyond the linear part then
        // reads as missing, and the packet passes untranslated.
        let _ = self.pull_data(len);
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        TcContext::len(self)
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: the context is a valid __sk_buff; ifindex is a plain readable field.
        unsafe { (*(self.as_ptr() as *const __sk_buff)).ifindex }
    }

    #[inline(always)]
    fn ptr(&self) -> *mut c_void {
        self.as_ptr()
    }

    // Each kind of change once, by its difference (`size` 0): the helper knows the skb's
    // checksum state — `CHECKSUM_PARTIAL` takes only the pseudo-header's changes,
    // `CHECKSUM_COMPLETE` keeps `skb->csum` in step with them.
    #[inline(always)]
    fn l4_csum_diff(&self, off: usize, pseudo: u64, plain: u64, kind: CsumKind) -> Result<(), i64> {
        let flags = if kind == CsumKind::ZeroIsNone {
            u64::from(BPF_F_MARK_MANGLED_0)
        } else {
            0
        };
        if pseudo != 0 {
            let d = u64::from(csum::fold(pseudo));
            TcContext::l4_csum_replace(self, off, 0, d, flags | u64::from(BPF_F_PSEUDO_HDR))?;
        }
        if plain != 0 {
            let d = u64::from(csum::fold(plain));
            TcContext::l4_csum_replace(self, off, 0, d, flags)?;
        }
        Ok(())
    }

    #[inline(always)]
    fn tc(&self) -> Option<&TcContext> {
        Some(self)
    }

    #[inline(always)]
    fn grow_network_header<const BASE: usize, const ROOM: usize>(&self) -> Result<(), i64> {
        // BPF_ADJ_ROOM_NET opens the room after the base network header (the kernel
        // knows its length by the family); a GSO packet's segment size shrinks by as
        // much (no FIXED_GSO), so its segments still fit. The room is zeroes, which
        // change no `skb->csum`.
        self.adjust_room(ROOM as i32, BPF_ADJ_ROOM_NET, 0)
    }

    #[inline(always)]
    fn bytes_changed(&self, diff: u64) {
        // Adds to `skb->csum` when the skb is CHECKSUM_COMPLETE; otherwise refuses,
        // which is right: nothing else holds a sum of these bytes.
        // SAFETY: a valid __sk_buff; no memory arguments.
        let _ = unsafe {
            bpf_csum_update(self.as_ptr() as *mut __sk_buff, u32::from(csum::fold(diff)))
        };
    }
}

/// The frame's `data` and `data_end`, read afresh each time, as `skb_data` and for the
/// same reason.
#[inline(always)]
fn xdp_data(ctx: &XdpContext) -> usize {
    // SAFETY: the context is a valid xdp_md; `data` is a plain readable field.
    unsafe { core::ptr::read_volatile(&(*ctx.ctx).data) as usize }
}

#[inline(always)]
fn xdp_data_end(ctx: &XdpContext) -> usize {
    // SAFETY: as for `xdp_data`.
    unsafe { core::ptr::read_volatile(&(*ctx.ctx).data_end) as usize }
}

impl Frame for XdpContext {
    const XDP: bool = true;

    // Direct packet access for the small fields (a bounds check the verifier follows,
    // then the bytes: a helper call per field costs more than the field's own work); the
    // helpers for larger ones (IPv6 addresses, MACs), whose byte-wise copies would crowd
    // the 512-byte stack the call chain shares.
    #[inline(always)]
    fn load<T>(&self, off: usize) -> Result<T, i64> {
        if core::mem::size_of::<T>() > 4 {
            let mut v = MaybeUninit::<T>::uninit();
            // SAFETY: the helper writes exactly size_of::<T>() bytes into `v` or fails.
            let rc = unsafe {
                bpf_xdp_load_bytes(
                    self.ctx,
                    off as u32,
                    v.as_mut_ptr() as *mut c_void,
                    core::mem::size_of::<T>() as u32,
                )
            };
            if rc < 0 {
                return Err(rc);
            }
            // SAFETY: initialised by the helper (rc == 0); T is plain data.
            return Ok(unsafe { v.assume_init() });
        }
        let p = xdp_data(self) + off;
        if p + core::mem::size_of::<T>() > xdp_data_end(self) {
            return Err(-1);
        }
        // SAFETY: inside the packet (checked above); T is plain data.
        Ok(unsafe { (p as *const T).read_unaligned() })
    }

    #[inline(always)]
    fn store<T>(&self, off: usize, v: &T) -> Result<(), i64> {
        if core::mem::size_of::<T>() > 4 {
            // SAFETY: the helper reads size_of::<T>() bytes from `v`.
            let rc = unsafe {
                bpf_xdp_store_bytes(
                    self.ctx,
                    off as u32,
                    v as *const T as *mut c_void,
                    core::mem::size_of::<T>() as u32,
                )
            };
            return if rc < 0 { Err(rc) } else { Ok(()) };
        }
        let p = xdp_data(self) + off;
        if p + core::mem::size_of::<T>() > xdp_data_end(self) {
            return Err(-1);
        }
        // SAFETY: inside the packet (checked above), which XDP may write.
        unsafe { (p as *mut T).write_unaligned(core::ptr::read(v)) };
        Ok(())
    }

    #[inline(always)]
    fn linearize(&self, _len: usize) {
        // An XDP frame's first buffer holds its headers (multi-buffer frames pass on).
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        (xdp_data_end(self) - xdp_data(self)) as u32
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: the context is a valid xdp_md; ingress_ifindex is a plain readable field.
        unsafe { (*(self.ctx as *const xdp_md)).ingress_ifindex }
    }

    #[inline(always)]
    fn ptr(&self) -> *mut c_void {
        self.as_ptr()
    }

    #[inline(always)]
    fn l4_csum_diff(&self, off: usize, pseudo: u64, plain: u64, kind: CsumKind) -> Result<(), i64> {
        let old: u16 = self.load(off)?;
        if old == 0 && kind == CsumKind::ZeroIsNone {
            return Ok(());
        }
        let mut new = csum::fixed(old, pseudo + plain);
        if new == 0 && kind == CsumKind::ZeroIsNone {
            new = 0xffff;
        }
        self.store(off, &new)
    }

    #[inline(always)]
    fn tc(&self) -> Option<&TcContext> {
        None
    }

    #[inline(always)]
    fn grow_network_header<const BASE: usize, const ROOM: usize>(&self) -> Result<(), i64> {
        // SAFETY: a valid xdp_md; the helper checks the headroom.
        let rc = unsafe { bpf_xdp_adjust_head(self.ctx, -(ROOM as i32)) };
        if rc != 0 {
            return Err(rc);
        }
        let (data, end) = (xdp_data(self), xdp_data_end(self));
        if data + ROOM + BASE > end {
            return Err(-1);
        }
        // Forward, word by word: the source lies ROOM bytes after the destination.
        // SAFETY: both ranges lie inside the packet (checked above), which XDP may write.
        unsafe {
            let (from, to) = ((data + ROOM) as *const u8, data as *mut u8);
            for i in 0..BASE / 2 {
                let w = (from.add(2 * i) as *const u16).read_unaligned();
                (to.add(2 * i) as *mut u16).write_unaligned(w);
            }
        }
        Ok(())
    }

    #[inline(always)]
    fn bytes_changed(&self, _diff: u64) {
        // A frame has no checksum state: what the wire delivered, checksums complete.
    }
}

/// One's-complement checksum arithmetic (RFC 1071 sums, RFC 1624 incremental updates),
/// written once for every rewrite that folds its own checksum difference: the XDP hook's
/// (no checksum helpers there), the ICMP errors' quotes, the refusals, XDP's TTL.
///
/// Values are taken as they lie in the packet: any byte order works as long as the data
/// and the checksum field are loaded alike and the data sits at even offsets.
pub mod csum {
    /// Folds an unfolded one's-complement sum to 16 bits (not inverted).
    #[inline(always)]
    pub fn fold(mut s: u64) -> u16 {
        s = (s & 0xffff) + (s >> 16);
        s = (s & 0xffff) + (s >> 16);
        s = (s & 0xffff) + (s >> 16);
        s = (s & 0xffff) + (s >> 16);
        s as u16
    }

    /// What replacing 32-bit `old` by `new` adds to a sum (RFC 1624: `~m + m'`).
    #[inline(always)]
    pub fn delta(old: u32, new: u32) -> u64 {
        u64::from(!old) + u64::from(new)
    }

    /// `delta` for a 16-bit field.
    #[inline(always)]
    pub fn delta16(old: u16, new: u16) -> u64 {
        u64::from(!old) + u64::from(new)
    }

    /// A checksum field after the data it covers changed by `d` (RFC 1624, eqn. 3:
    /// `HC' = ~(~HC + ~m + m')`).
    #[inline(always)]
    pub fn fixed(csum: u16, d: u64) -> u16 {
        !fold(u64::from(!csum) + d)
    }

    /// A checksum field after one 32-bit (`size` 4) or 16-bit (`size` 2) word it covers
    /// went from `old` to `new`.
    #[inline(always)]
    pub fn replaced(csum: u16, old: u32, new: u32, size: u8) -> u16 {
        let d = if size == 2 {
            delta16(old as u16, new as u16)
        } else {
            delta(old, new)
        };
        fixed(csum, d)
    }
}
