//! Connect-time load balancing (cgroup sock_addr hooks): the socket is pointed at a
//! backend before the first packet exists, so no per-packet NAT is needed, and
//! replies and `getpeername` are translated back so applications only ever see the VIP.
//!
//! Layer 5, an entry pipeline. Owns: the connect-time hooks' bodies, `SOCK_CONNECTED`'s
//! slots, `SOCK_LB`'s entries with their counts (`SOCK_LB_COUNTS`; the agent owns
//! `SOCK_LB_FILTER`) and `SOCK_LB_ZERO`. May import: layers 0-4 (every module but
//! `pipeline` and `main`).

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    EbpfContext as _, Global,
    bindings::BPF_NOEXIST,
    btf_maps::Array,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns, bpf_set_retval},
    macros::btf_map,
    programs::{SockAddrContext, SockContext},
};
use aya_log_ebpf::debug;
use proxy_common::{
    AFFINITY_BY_NETNS, Backend, FAMILY_V4, PROTO_SCTP, PROTO_TCP, PROTO_UDP, SOCK_SENT_SLOTS,
    ServiceValue, SockBinding, SockLb, SockSlot, counter, sock_count_slot, sock_slot,
};

use crate::{
    lb::{self, Client, NoBackend},
    maps::{REV_NAT, SOCK_CONNECTED, SOCK_LB, SOCK_LB_COUNTS, SOCK_LB_FILTER, count},
};

/// Let the call proceed.
const ALLOW: i32 = 1;
/// Fail the call (with EPERM, or the errno set by `bpf_set_retval`).
const DENY: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// Whether this kernel has `bpf_set_retval` for sock_addr programs (Linux 5.18): set by
/// the agent at load from its probe.
#[unsafe(no_mangle)]
static SET_RETVAL: Global<u8> = Global::new(1);

/// Which hook runs `translate_to_backend`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// connect4/6: the socket gets one peer.
    Connect,
    /// sendmsg4/6: one datagram of a socket that may send to several frontends.
    Sendmsg,
}

/// connect4/6 (TCP and connected UDP) and sendmsg4/6 (unconnected UDP): translate a
/// frontend to a backend, or refuse when the service has no usable endpoints. An
/// unconnected socket keeps its backend per frontend while that backend stays in the
/// service (as kube-proxy's conntrack keeps a source port's), so QUIC and DTLS work.
#[inline(always)]
pub fn translate_to_backend(ctx: &SockAddrContext, family: u8, hook: Hook) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: `sa` is the kernel-provided context; these are plain field reads.
    let (raw_proto, port) = unsafe { ((*sa).protocol, (*sa).user_port as u16) };
    let proto = match raw_proto {
        6 => PROTO_TCP,
        17 => PROTO_UDP,
        // Kernels with SCTP run these hooks for its connect() too.
        132 => PROTO_SCTP,
        _ => return ALLOW,
    };
    // A port no frontend uses: no service lookup, whose bucket is a cache miss away (most
    // of a pod's own connections). The agent marks a port before any service entry has
    // it, and fills a new filter from the tables before these hooks are swapped in.
    if !lb::may_be_frontend(port) {
        return ALLOW;
    }
    let (addr, svc_family, mapped) = unmap(read_addr(ctx, family), family);
    // Sockets belong to pods or the node itself: internal traffic.
    let Some(svc) = lb::lookup_service(addr, port, proto, svc_family, true) else {
        return ALLOW;
    };
    count(counter::SVC_HIT);
    // SAFETY: valid context pointer for this program type.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if hook == Hook::Sendmsg
        && let Some(entry) = SOCK_LB.get_ptr_mut(&cookie)
        && let Some((addr, port)) = kept(entry, &svc)
    {
        write_addr(ctx, family, map(addr, mapped), port);
        return ALLOW;
    }
    // The source address is not chosen yet at connect time: the client is its netns.
    // SAFETY: valid context pointer for this program type.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let id = [netns as u32, (netns >> 32) as u32, 0, 0];
    let client = Client {
        id: &id,
        kind: AFFINITY_BY_NETNS,
        family: svc_family,
        port: 0,
    };
    let slot = lb::schedule(svc, &client);
    match lb::select_backend(svc, &lb::affinity_key(svc, &client), slot) {
        Ok((id, be)) => {
            lb::opened(&svc, id);
            // The socket sees the backend in the form it used for the frontend.
            write_addr(ctx, family, map(be.addr, mapped), be.port);
            let binding = binding(hook, &svc, id, &be);
            if !(hook == Hook::Connect && claim_slot(cookie, &binding)) {
                match entry_of(&cookie) {
                    Some(entry) => bind(entry, hook, binding),
                    None => count(counter::SOCK_REV_NAT_FAILED),
                }
            }
            crate::stats::connection(svc.rev_nat_id, id);
            ALLOW
        }
        Err(NoBackend::Reject) => {
            debug!(ctx, "service {} has no usable backends: refused", svc.id);
            // A constant to the verifier (frozen .rodata): where the agent found no
            // bpf_set_retval the call is dead code, never checked, and the caller gets
            // EPERM instead of ECONNREFUSED.
            if SET_RETVAL.load() != 0 {
                // SAFETY: helper with no memory arguments.
                unsafe { bpf_set_retval(-ECONNREFUSED) };
            }
            DENY
        }
        Err(NoBackend::Drop(_)) => DENY,
    }
}

/// The backend an unconnected socket already sends `svc`'s datagrams to, while it is
/// still one of `svc`'s active backends.
#[inline(always)]
fn kept(entry: *mut SockLb, svc: &ServiceValue) -> Option<([u32; 4], u16)> {
    for i in 0..SOCK_SENT_SLOTS {
        // SAFETY: `entry` points at a live SOCK_LB value; `i` is in bounds.
        let b = unsafe { (*entry).sent.get(i).copied()? };
        if b.service_id != svc.id {
            continue;
        }
        if lb::member_since(svc.id, b.backend_id, b.bound_ns)
            && lb::active_backend(b.backend_id).is_some()
        {
            return Some((b.addr, b.port));
        }
        return None;
    }
    None
}

/// A zeroed `SockLb`, never written: the initial value of a new `SOCK_LB` entry (too big
/// for the stack; not pinned: each load has its own).
#[btf_map]
static SOCK_LB_ZERO: Array<SockLb, 1> = Array::new();

/// The socket's `SOCK_LB` entry, made (zeroed, and counted for `forget`'s filter) if it
/// has none; `None` when the map is full.
#[inline(always)]
fn entry_of(cookie: &u64) -> Option<*mut SockLb> {
    if let Some(entry) = SOCK_LB.get_ptr_mut(cookie) {
        return Some(entry);
    }
    let zero = SOCK_LB_ZERO.get(0)?;
    // NOEXIST: another thread sending on the same socket may have made it meanwhile
    // (and counted it).
    let made = SOCK_LB.insert(cookie, zero, u64::from(BPF_NOEXIST)).is_ok();
    let entry = SOCK_LB.get_ptr_mut(cookie)?;
    if made {
        count_entry(*cookie, entry);
    }
    Some(entry)
}

/// A new entry, stamped with the filter's generation and counted in its cookie's slot
/// (no generation: neither). Its socket cannot be released meanwhile: the hook's call
/// holds it.
#[inline(always)]
fn count_entry(cookie: u64, entry: *mut SockLb) {
    let generation = SOCK_LB_FILTER.get(0).map_or(0, |f| f.generation);
    if generation == 0 {
        return;
    }
    let Some(n) = SOCK_LB_COUNTS.get_ptr_mut(sock_count_slot(cookie)) else {
        return;
    };
    // SAFETY: a live SOCK_LB value and a live array slot; other CPUs count in the same
    // slot at the same time, hence the atomic add.
    unsafe {
        (*entry).counted = generation;
        atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(n, 1);
    }
}

/// The socket's `SOCK_CONNECTED` slot, if free or already its own: `binding` written there.
/// Two sockets whose cookies share a slot connecting in the same instant on two CPUs may
/// both write it: one that finds the other's cookie there afterwards gives up the slot
/// (ABI.md).
#[inline(always)]
fn claim_slot(cookie: u64, binding: &SockBinding) -> bool {
    let Some(slot) = SOCK_CONNECTED.get_ptr_mut(sock_slot(cookie)) else {
        return false;
    };
    // SAFETY: a live array slot; its owner changes only at connect and release.
    unsafe {
        let owner = core::ptr::read_volatile(&(*slot).cookie);
        if owner != 0 && owner != cookie {
            return false;
        }
        (*slot).binding = *binding;
        core::ptr::write_volatile(&mut (*slot).cookie, cookie);
        core::ptr::read_volatile(&(*slot).cookie) == cookie
    }
}

/// The binding of socket `cookie`'s slot, if the slot is its.
#[inline(always)]
fn slot_of(cookie: u64) -> Option<*mut SockSlot> {
    let slot = SOCK_CONNECTED.get_ptr_mut(sock_slot(cookie))?;
    // SAFETY: a live array slot.
    (unsafe { core::ptr::read_volatile(&(*slot).cookie) } == cookie).then_some(slot)
}

/// What a socket is bound to: backend `backend_id` (`be`) of `svc`.
#[inline(always)]
fn binding(hook: Hook, svc: &ServiceValue, backend_id: u32, be: &Backend) -> SockBinding {
    SockBinding {
        addr: be.addr,
        port: be.port,
        family: be.family,
        _pad: 0,
        service_id: svc.id,
        rev_nat_id: svc.rev_nat_id,
        backend_id,
        // Only `sent` bindings are re-checked by it (`kept`): a connected socket's peer
        // is fixed, and the clock read was ~10% of `connect4` in a VM.
        bound_ns: if hook == Hook::Sendmsg {
            // SAFETY: no preconditions.
            unsafe { bpf_ktime_get_ns() }
        } else {
            0
        },
    }
}

/// Remembers `binding` in a `SOCK_LB` entry: as the socket's peer (connect) or as where
/// its datagrams to the binding's Service go (sendmsg) — in that Service's slot, a free
/// one, or the oldest.
#[inline(always)]
fn bind(entry: *mut SockLb, hook: Hook, binding: SockBinding) {
    // SAFETY: `entry` points at a live SOCK_LB value; writes stay inside it.
    unsafe {
        if hook == Hook::Connect {
            (*entry).connected = binding;
            return;
        }
        let mut free = None;
        for i in 0..SOCK_SENT_SLOTS {
            let id = (*entry).sent[i].service_id;
            if id == binding.service_id {
                (*entry).sent[i] = binding;
                return;
            }
            if id == 0 && free.is_none() {
                free = Some(i);
            }
        }
        let i = match free {
            Some(i) => i,
            None => {
                let next = (*entry).next;
                (*entry).next = next.wrapping_add(1);
                next as usize % SOCK_SENT_SLOTS
            }
        };
        if let Some(slot) = (*entry).sent.get_mut(i) {
            *slot = binding;
        }
    }
}

/// recvmsg4/6 and getpeername4/6: a backend address the socket was sent to on behalf of
/// a frontend is shown as that frontend. These hooks must always return ALLOW.
#[inline(always)]
pub fn translate_to_frontend(ctx: &SockAddrContext, family: u8) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: plain field read of the kernel-provided context.
    let port = unsafe { (*sa).user_port as u16 };
    // SAFETY: valid context pointer for this program type.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // Bindings hold the backend's own form: a mapped IPv6 socket's datagrams go out
    // through sendmsg4 but come back through recvmsg6.
    let (addr, key_family, mapped) = unmap(read_addr(ctx, family), family);
    let is = |b: &SockBinding| {
        b.service_id != 0 && b.port == port && b.family == key_family && b.addr == addr
    };
    // SAFETY: the socket's own slot, copied out at once.
    let peer = slot_of(cookie).map(|slot| unsafe { (*slot).binding });
    let rev_nat_id = match peer {
        Some(b) if is(&b) => b.rev_nat_id,
        _ => {
            let Some(entry) = SOCK_LB.get_ptr_mut(&cookie) else {
                return ALLOW;
            };
            let Some(id) = frontend_of(entry, is) else {
                return ALLOW;
            };
            id
        }
    };
    // SAFETY: the value is copied out at once.
    if let Some(frontend) = unsafe { REV_NAT.get(&rev_nat_id).copied() } {
        write_addr(ctx, family, map(frontend.addr, mapped), frontend.port);
    }
    ALLOW
}

/// The reverse-NAT id of the binding that `is` the address shown: the peer first, then
/// the frontends datagrams were sent to.
#[inline(always)]
fn frontend_of(entry: *mut SockLb, is: impl Fn(&SockBinding) -> bool) -> Option<u32> {
    // SAFETY: `entry` points at a live SOCK_LB value.
    unsafe {
        if is(&(*entry).connected) {
            return Some((*entry).connected.rev_nat_id);
        }
        for i in 0..SOCK_SENT_SLOTS {
            let b = &(*entry).sent[i];
            if is(b) {
                return Some(b.rev_nat_id);
            }
        }
    }
    None
}

/// sock_release: the socket is gone, and so is what the hooks remembered of it: its
/// `SOCK_CONNECTED` slot is free again, and `SOCK_LB` kept to live sockets, however many
/// short connections come and go. A socket whose cookie's count slot counts no entry has
/// none (ABI.md, "the release filter"): most sockets, spared a lookup whose bucket is a
/// cache miss away.
#[inline(always)]
pub fn forget(ctx: &SockContext) -> i32 {
    // SAFETY: valid context pointer for this program type.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some(slot) = slot_of(cookie) {
        // SAFETY: the socket's own slot: freed for the next socket.
        unsafe { core::ptr::write_volatile(&mut (*slot).cookie, 0) };
    }
    let filter = SOCK_LB_FILTER.get(0).copied().unwrap_or_default();
    let count = SOCK_LB_COUNTS.get_ptr_mut(sock_count_slot(cookie));
    if filter.generation != 0 && filter.uncounted == 0 {
        // SAFETY: a live array slot; a racy read sees another socket's count or not,
        // never this socket's (counted before its release could begin).
        if let Some(n) = count
            && unsafe { core::ptr::read_volatile(n) } == 0
        {
            return ALLOW;
        }
    }
    // Most sockets have no entry: a lookup is lock-free, a delete takes the bucket's lock.
    let Some(entry) = SOCK_LB.get_ptr(&cookie) else {
        return ALLOW;
    };
    // SAFETY: a live SOCK_LB value, read before the delete.
    let counted = unsafe { (*entry).counted };
    if SOCK_LB.remove(&cookie).is_ok()
        && counted != 0
        && counted == filter.generation
        && let Some(n) = count
    {
        // SAFETY: a live array slot; the add of `u32::MAX` takes one away, atomically.
        unsafe { atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(n, u32::MAX) };
    }
    ALLOW
}

/// `::ffff:0:0/96` as the first three words of an IPv6 address (network order).
const V4_MAPPED: [u32; 3] = [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff])];

/// An IPv6 socket may name an IPv4 peer as `::ffff:a.b.c.d` (dual-stack applications —
/// the JVM, for one — do): such an address is looked up as the IPv4 address it carries.
/// Returns the address and family to look up, and whether it was mapped.
#[inline(always)]
fn unmap(addr: [u32; 4], family: u8) -> ([u32; 4], u8, bool) {
    if family != FAMILY_V4 && addr[0..3] == V4_MAPPED {
        ([addr[3], 0, 0, 0], FAMILY_V4, true)
    } else {
        (addr, family, false)
    }
}

/// The inverse of `unmap`: an IPv4 address as the mapped IPv6 socket names it.
#[inline(always)]
fn map(addr: [u32; 4], mapped: bool) -> [u32; 4] {
    if mapped {
        [V4_MAPPED[0], V4_MAPPED[1], V4_MAPPED[2], addr[0]]
    } else {
        addr
    }
}

#[inline(always)]
fn read_addr(ctx: &SockAddrContext, family: u8) -> [u32; 4] {
    let sa = ctx.sock_addr;
    // SAFETY: plain 4-byte field reads, as the verifier requires for this context.
    unsafe {
        if family == FAMILY_V4 {
            [(*sa).user_ip4, 0, 0, 0]
        } else {
            [
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ]
        }
    }
}

#[inline(always)]
fn write_addr(ctx: &SockAddrContext, family: u8, addr: [u32; 4], port: u16) {
    let sa = ctx.sock_addr;
    // SAFETY: 4-byte stores to writable context fields.
    unsafe {
        if family == FAMILY_V4 {
            (*sa).user_ip4 = addr[0];
        } else {
            (*sa).user_ip6[0] = addr[0];
            (*sa).user_ip6[1] = addr[1];
            (*sa).user_ip6[2] = addr[2];
            (*sa).user_ip6[3] = addr[3];
        }
        (*sa).user_port = u32::from(port);
    }
}
