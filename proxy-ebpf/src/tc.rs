//! Per-packet service NAT (TC ingress): DNAT of packets addressed to a frontend, with
//! connection tracking so every packet of a flow keeps its backend, and reverse NAT of
//! the replies. Packets that are not ours pass on untouched (`TCX_NEXT`).

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::bpf_ktime_get_ns,
    programs::TcContext,
};
use proxy_common::{
    AFFINITY_BY_ADDR, CT_DIR_FORWARD, CT_DIR_REPLY, CtKey, CtValue, FAMILY_V4, FAMILY_V6,
    PROTO_TCP, PROTO_UDP, counter,
};

use crate::{
    lb::{self, Client},
    maps::{CONNTRACK, REV_NAT, count},
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const IPV4_CSUM_OFF: usize = ETH_HLEN + 10;
const IPV4_SADDR_OFF: usize = ETH_HLEN + 12;
const IPV4_DADDR_OFF: usize = ETH_HLEN + 16;
const IPV6_SADDR_OFF: usize = ETH_HLEN + 8;
const IPV6_DADDR_OFF: usize = ETH_HLEN + 24;
const IPV6_HLEN: usize = 40;

/// Not ours: let the next program (or the stack) have it.
const PASS_ON: i32 = TC_ACT_UNSPEC;
const DONE: i32 = TC_ACT_OK as i32;
const DROP: i32 = TC_ACT_SHOT as i32;

/// The parts of a TCP/UDP packet the NAT reads and rewrites.
struct Packet {
    family: u8,
    proto: u8,
    saddr: [u32; 4],
    daddr: [u32; 4],
    /// Network byte order, as in the packet.
    sport: u16,
    dport: u16,
    l4_off: usize,
}

impl Packet {
    fn ct_key(&self, dir: u8) -> CtKey {
        CtKey {
            saddr: self.saddr,
            daddr: self.daddr,
            sport: self.sport,
            dport: self.dport,
            proto: self.proto,
            family: self.family,
            dir,
            _pad: 0,
        }
    }
}

pub fn ingress(ctx: &TcContext) -> Result<i32, i32> {
    let Some(pkt) = parse(ctx)? else {
        return Ok(PASS_ON);
    };
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };

    // A reply of a translated flow: show the frontend as its source.
    if let Some(ct) = CONNTRACK.get_ptr_mut(&pkt.ct_key(CT_DIR_REPLY)) {
        // SAFETY: the entry stays valid during this program run (RCU); a racy timestamp
        // store is harmless.
        let rev_nat_id = unsafe {
            (*ct).last_seen_ns = now;
            (*ct).rev_nat_id
        };
        // SAFETY: the value is copied out at once.
        if let Some(frontend) = unsafe { REV_NAT.get(&rev_nat_id).copied() } {
            rewrite(ctx, &pkt, Side::Source, frontend.addr, frontend.port)?;
            count(counter::CT_REPLY_NAT);
        }
        return Ok(DONE);
    }

    // A packet of a flow we already translated keeps its backend while that exists.
    let fwd_key = pkt.ct_key(CT_DIR_FORWARD);
    // SAFETY: the value is copied out at once.
    if let Some(ct) = unsafe { CONNTRACK.get(&fwd_key).copied() }
        && let Some(be) = lb::backend(ct.backend_id)
    {
        rewrite(ctx, &pkt, Side::Destination, be.addr, be.port)?;
        if let Some(entry) = CONNTRACK.get_ptr_mut(&fwd_key) {
            // SAFETY: as above.
            unsafe { (*entry).last_seen_ns = now };
        }
        return Ok(DONE);
    }

    // Until the local-traffic detector (clusterCIDR) arrives with the external-traffic
    // path, every packet this classifier sees is treated as internal (pod) traffic.
    let Some(svc) = lb::lookup_service(pkt.daddr, pkt.dport, pkt.proto, pkt.family, true) else {
        return Ok(PASS_ON);
    };
    count(counter::SVC_HIT);
    let client = Client {
        id: pkt.saddr,
        kind: AFFINITY_BY_ADDR,
        family: pkt.family,
    };
    // No usable backend: the per-packet path drops (ICMP reject belongs to the
    // external-traffic path); the reason is counted by `select_backend`.
    let (backend_id, be) = lb::select_backend(&svc, &client).map_err(|_| DROP)?;

    let entry = CtValue {
        last_seen_ns: now,
        backend_id,
        rev_nat_id: svc.rev_nat_id,
    };
    let reply_key = CtKey {
        saddr: be.addr,
        daddr: pkt.saddr,
        sport: be.port,
        dport: pkt.sport,
        proto: pkt.proto,
        family: pkt.family,
        dir: CT_DIR_REPLY,
        _pad: 0,
    };
    // Both entries or neither: a forward entry without its reply entry would leave
    // replies untranslated. The packet is translated either way.
    if CONNTRACK.insert(&reply_key, &entry, 0).is_err()
        || CONNTRACK.insert(&fwd_key, &entry, 0).is_err()
    {
        count(counter::CT_CREATE_FAILED);
    }
    rewrite(ctx, &pkt, Side::Destination, be.addr, be.port)?;
    Ok(DONE)
}

/// Reads the 5-tuple; `None` for anything that is not unfragmented TCP/UDP over IP.
#[inline(always)]
fn parse(ctx: &TcContext) -> Result<Option<Packet>, i32> {
    let ether_type = u16::from_be(ctx.load::<u16>(12).map_err(|_| PASS_ON)?);
    let (family, proto, saddr, daddr, l4_off) = match ether_type {
        ETH_P_IP => {
            let ver_ihl: u8 = ctx.load(ETH_HLEN).map_err(|_| PASS_ON)?;
            let ihl = usize::from(ver_ihl & 0x0f) * 4;
            let frag = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).map_err(|_| PASS_ON)?);
            // Later fragments carry no ports; more-fragments or an offset: leave alone.
            if ihl < 20 || frag & 0x3fff != 0 {
                return Ok(None);
            }
            let proto: u8 = ctx.load(ETH_HLEN + 9).map_err(|_| PASS_ON)?;
            let s: u32 = ctx.load(IPV4_SADDR_OFF).map_err(|_| PASS_ON)?;
            let d: u32 = ctx.load(IPV4_DADDR_OFF).map_err(|_| PASS_ON)?;
            (FAMILY_V4, proto, [s, 0, 0, 0], [d, 0, 0, 0], ETH_HLEN + ihl)
        }
        ETH_P_IPV6 => {
            // Extension headers are not walked: such packets pass untranslated.
            let proto: u8 = ctx.load(ETH_HLEN + 6).map_err(|_| PASS_ON)?;
            let s: [u32; 4] = ctx.load(IPV6_SADDR_OFF).map_err(|_| PASS_ON)?;
            let d: [u32; 4] = ctx.load(IPV6_DADDR_OFF).map_err(|_| PASS_ON)?;
            (FAMILY_V6, proto, s, d, ETH_HLEN + IPV6_HLEN)
        }
        _ => return Ok(None),
    };
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Ok(None);
    }
    let sport: u16 = ctx.load(l4_off).map_err(|_| PASS_ON)?;
    let dport: u16 = ctx.load(l4_off + 2).map_err(|_| PASS_ON)?;
    Ok(Some(Packet {
        family,
        proto,
        saddr,
        daddr,
        sport,
        dport,
        l4_off,
    }))
}

enum Side {
    Source,
    Destination,
}

/// Rewrites one side's address and port, keeping the IPv4 header checksum and the L4
/// checksum (whose pseudo-header covers the addresses) valid.
#[inline(always)]
fn rewrite(
    ctx: &TcContext,
    pkt: &Packet,
    side: Side,
    addr: [u32; 4],
    port: u16,
) -> Result<(), i32> {
    let (old_addr, old_port, port_off) = match side {
        Side::Source => (pkt.saddr, pkt.sport, pkt.l4_off),
        Side::Destination => (pkt.daddr, pkt.dport, pkt.l4_off + 2),
    };
    let (csum_off, zero_flag) = if pkt.proto == PROTO_TCP {
        (pkt.l4_off + 16, 0)
    } else {
        // A zero UDP checksum (IPv4) means "none" and must stay zero.
        (pkt.l4_off + 6, u64::from(BPF_F_MARK_MANGLED_0))
    };
    let fail = |_| {
        count(counter::REWRITE_FAILED);
        DROP
    };
    let pseudo = u64::from(BPF_F_PSEUDO_HDR) | zero_flag | 4;
    if pkt.family == FAMILY_V4 {
        let addr_off = match side {
            Side::Source => IPV4_SADDR_OFF,
            Side::Destination => IPV4_DADDR_OFF,
        };
        ctx.l4_csum_replace(csum_off, u64::from(old_addr[0]), u64::from(addr[0]), pseudo)
            .map_err(fail)?;
        ctx.l3_csum_replace(IPV4_CSUM_OFF, u64::from(old_addr[0]), u64::from(addr[0]), 4)
            .map_err(fail)?;
        ctx.store(addr_off, &addr[0], 0).map_err(fail)?;
    } else {
        let addr_off = match side {
            Side::Source => IPV6_SADDR_OFF,
            Side::Destination => IPV6_DADDR_OFF,
        };
        for i in 0..4 {
            ctx.l4_csum_replace(csum_off, u64::from(old_addr[i]), u64::from(addr[i]), pseudo)
                .map_err(fail)?;
        }
        ctx.store(addr_off, &addr, 0).map_err(fail)?;
    }
    ctx.l4_csum_replace(
        csum_off,
        u64::from(old_port),
        u64::from(port),
        zero_flag | 2,
    )
    .map_err(fail)?;
    ctx.store(port_off, &port, 0).map_err(fail)?;
    Ok(())
}
