//! Maglev's lookup table (Eisenbud et al., NSDI 2016, §3.4): each backend walks its own
//! permutation of the table's positions, `(offset + j·skip) mod M` with `offset` and
//! `skip` from two hashes of the backend's name, and the backends take turns claiming
//! the next free position of theirs until the table is full. A backend's turns per round
//! are its weight. The name is the endpoint's address and port, so every node builds the
//! same table for the same endpoints, whatever ids it gave them.

use std::net::SocketAddr;

/// One backend of the table.
#[derive(Clone, Copy, Debug)]
pub struct Member {
    pub endpoint: SocketAddr,
    /// Turns per round; 0 is treated as 1 (the caller leaves out weight-0 backends).
    pub weight: u32,
}

/// The table: `len` (a prime) entries, each an index into `members`. Empty without
/// members.
pub fn table(members: &[Member], len: u32) -> Vec<u32> {
    const EMPTY: u32 = u32::MAX;
    let m = u64::from(len);
    if members.is_empty() || m < 2 {
        return Vec::new();
    }
    let perms: Vec<(u64, u64)> = members
        .iter()
        .map(|b| {
            let name = b.endpoint.to_string();
            let offset = fnv1a(name.as_bytes(), OFFSET_SEED) % m;
            let skip = fnv1a(name.as_bytes(), SKIP_SEED) % (m - 1) + 1;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0u64; members.len()];
    let mut entry = vec![EMPTY; len as usize];
    let mut filled = 0u64;
    'fill: loop {
        for (i, b) in members.iter().enumerate() {
            for _ in 0..b.weight.max(1) {
                let (offset, skip) = perms[i];
                let mut c = (offset + next[i] * skip) % m;
                while entry[c as usize] != EMPTY {
                    next[i] += 1;
                    c = (offset + next[i] * skip) % m;
                }
                entry[c as usize] = i as u32;
                next[i] += 1;
                filled += 1;
                if filled == m {
                    break 'fill;
                }
            }
        }
    }
    entry
}

const OFFSET_SEED: u64 = 0xcbf2_9ce4_8422_2325;
const SKIP_SEED: u64 = 0x8422_2325_cbf2_9ce4;

/// FNV-1a, 64-bit, from `seed`: fixed here (not the standard library's randomised
/// hasher) so the table is the same on every node and in every version.
fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    let mut h = seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    // FNV's low bits mix poorly on short keys; a final avalanche (splitmix64's).
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: u32) -> Vec<Member> {
        (0..n)
            .map(|i| Member {
                endpoint: SocketAddr::from(([10, 2, (i >> 8) as u8, i as u8], 8080)),
                weight: 1,
            })
            .collect()
    }

    /// The paper's construction, written as directly as it reads (pseudocode of §3.4),
    /// with the same permutations: the table above must equal it.
    fn paper(members: &[Member], len: u32) -> Vec<u32> {
        let m = u64::from(len);
        let permutation: Vec<Vec<u64>> = members
            .iter()
            .map(|b| {
                let name = b.endpoint.to_string();
                let offset = fnv1a(name.as_bytes(), OFFSET_SEED) % m;
                let skip = fnv1a(name.as_bytes(), SKIP_SEED) % (m - 1) + 1;
                (0..m).map(|j| (offset + j * skip) % m).collect()
            })
            .collect();
        let mut next = vec![0usize; members.len()];
        let mut entry: Vec<i64> = vec![-1; len as usize];
        let mut n = 0;
        loop {
            for i in 0..members.len() {
                let mut c = permutation[i][next[i]];
                while entry[c as usize] >= 0 {
                    next[i] += 1;
                    c = permutation[i][next[i]];
                }
                entry[c as usize] = i as i64;
                next[i] += 1;
                n += 1;
                if n == m {
                    return entry.into_iter().map(|e| e as u32).collect();
                }
            }
        }
    }

    #[test]
    fn matches_the_papers_construction() {
        for (n, len) in [(1, 251), (3, 251), (10, 4093), (100, 16381)] {
            let ms = members(n);
            assert_eq!(table(&ms, len), paper(&ms, len), "{n} backends, M={len}");
        }
    }

    #[test]
    fn spreads_within_bound() {
        // With M ≥ 100·N the paper measures at most ~1% imbalance; ours: every
        // backend's share of the table within 5% of the mean at M = 409·N.
        let ms = members(10);
        let t = table(&ms, 4093);
        let mean = 4093.0 / 10.0;
        for i in 0..10 {
            let share = t.iter().filter(|&&e| e == i).count() as f64;
            assert!(
                (share - mean).abs() / mean < 0.05,
                "backend {i}: {share} of 4093"
            );
        }
        // Weights: a weight-3 backend holds about three times a weight-1 one's share.
        let mut w = members(2);
        w[0].weight = 3;
        let t = table(&w, 4093);
        let heavy = t.iter().filter(|&&e| e == 0).count() as f64 / 4093.0;
        assert!((heavy - 0.75).abs() < 0.02, "{heavy}");
    }

    #[test]
    fn removing_one_backend_moves_little_else() {
        // Over 100k flows: the removed backend's flows move (they must), and of the
        // others only few (Maglev is not perfectly consistent: the paper's bound is
        // small, not zero).
        let ms = members(10);
        let before = table(&ms, 16381);
        let mut fewer = ms.clone();
        let removed = fewer.remove(3);
        let after = table(&fewer, 16381);
        let name = |t: &[u32], ms: &[Member], h: u32| ms[t[h as usize % t.len()] as usize].endpoint;
        let mut moved_others = 0;
        for flow in 0u32..100_000 {
            let h =
                proxy_common::sched_hash(&[flow.wrapping_mul(2654435761), 7, 0, 0], flow as u16);
            let was = name(&before, &ms, h);
            let now = name(&after, &fewer, h);
            if was != removed.endpoint && was != now {
                moved_others += 1;
            }
            assert_ne!(now, removed.endpoint);
        }
        eprintln!("removing 1 of 10 backends (M = 16381) moved {moved_others} of 100k flows");
        assert!(
            moved_others < 2_000,
            "{moved_others} of 100k flows of other backends moved"
        );
    }
}
