//! `ServiceValue::scheduler`: how a new flow's backend is chosen, IPVS's schedulers as
//! map lookups. For `WRR` and the hashing ones the agent expands the backend set into the
//! slots (weighted interleave, Maglev table); the programs then pick a slot.

/// A uniformly random slot (iptables' `statistic mode random`): the default.
pub const RANDOM: u8 = 0;
/// Round robin: a per-CPU cursor per service entry.
pub const RR: u8 = 1;
/// Weighted round robin: round robin over slots the agent interleaved by weight.
pub const WRR: u8 = 2;
/// Source hashing: the client's address picks an entry of a Maglev table (`MAGLEV`).
pub const SH: u8 = 3;
/// Destination hashing: the frontend's address picks a slot of a Maglev table.
pub const DH: u8 = 4;
/// Maglev hashing of the flow (client address and port): the same flow lands on the
/// same backend on every node, and a removed backend moves only its own flows.
pub const MH: u8 = 5;
/// Least connections: fewest active connections (`ACTIVE_CONNS`).
pub const LC: u8 = 6;
/// Weighted least connections: fewest active connections per weight.
pub const WLC: u8 = 7;
/// Shortest expected delay: fewest (active + 1) per weight.
pub const SED: u8 = 8;
/// Never queue: an idle backend if there is one, else as `SED`.
pub const NQ: u8 = 9;
/// Backends the least-connection schedulers compare per new flow: all of them up to
/// this many, else this many slots from a random start (a bounded loop for the
/// verifier; the best of several random choices is near the least loaded).
pub const LC_SCAN: u32 = 4;

/// The hash of a client (or frontend) address and port that the hashing schedulers use:
/// the same function in the programs and in the agent's reference and `trace`. `port` is
/// as the packet carries it (network byte order), 0 where there is none.
#[inline(always)]
pub fn sched_hash(addr: &[u32; 4], port: u16) -> u32 {
    // murmur3's finalizer over the words: cheap, and every input bit reaches every
    // output bit, so a `% table_len` of it spreads evenly.
    let mut h: u32 = 0x9747_b28c;
    let mut i = 0;
    while i < 4 {
        h ^= addr[i];
        h = h
            .wrapping_mul(0xcc9e_2d51)
            .rotate_left(15)
            .wrapping_mul(0x1b87_3593);
        i += 1;
    }
    h ^= u32::from(port);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}
