//! Weighted round robin as IPVS's `wrr` orders it: the weights reduced by their greatest
//! common divisor, then rounds that lower a threshold from the largest weight by that
//! divisor, each taking every backend whose weight reaches it. The programs walk the
//! result with a plain round-robin cursor.

/// One period of the sequence, as indexes into `weights` (every weight above 0).
pub fn sequence(weights: &[u32]) -> Vec<usize> {
    let g = weights.iter().copied().filter(|&w| w > 0).fold(0, gcd);
    if g == 0 {
        return Vec::new();
    }
    let reduced: Vec<u32> = weights.iter().map(|w| w / g).collect();
    let max = reduced.iter().copied().max().unwrap_or(0);
    let mut out = Vec::with_capacity(reduced.iter().map(|&w| w as usize).sum());
    for threshold in (1..=max).rev() {
        for (i, &w) in reduced.iter().enumerate() {
            if w >= threshold {
                out.push(i);
            }
        }
    }
    out
}

/// Scales `weights` down so that their sequence fits in `max` slots, when it does not
/// (IPVS walks its weights without slots, so they never need to fit): after the gcd
/// (`sequence`), each weight `w` becomes max(1, ⌊w·(max−n)/total⌋) — `n` the weights
/// above 0, `total` their sum — so the sum stays within `max` while every backend that
/// takes connections keeps a slot and the proportions stay as near as whole slots allow.
/// Returns how many slots the weights wanted, when they were scaled. (When `n` alone
/// exceeds `max`, every weight becomes 1 and the sequence still does not fit.)
pub fn fit(weights: &mut [u32], max: usize) -> Option<usize> {
    let g = weights.iter().copied().filter(|&w| w > 0).fold(0, gcd);
    if g == 0 {
        return None;
    }
    let wanted: usize = weights.iter().map(|&w| (w / g) as usize).sum();
    if wanted <= max {
        return None;
    }
    let n = weights.iter().filter(|&&w| w > 0).count() as u64;
    let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
    let budget = (max as u64).saturating_sub(n);
    for w in weights.iter_mut().filter(|w| **w > 0) {
        *w = (u64::from(*w) * budget / total).max(1) as u32;
    }
    Some(wanted)
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_backend_appears_weight_over_gcd_times_heaviest_first() {
        assert_eq!(sequence(&[4, 2, 2]), vec![0, 0, 1, 2]);
        assert_eq!(sequence(&[1, 1, 1]), vec![0, 1, 2]);
        assert_eq!(sequence(&[5, 0, 2]), vec![0, 0, 0, 0, 2, 0, 2]);
        assert!(sequence(&[0, 0]).is_empty());
        let s = sequence(&[7, 3, 1]);
        for (i, w) in [7, 3, 1].into_iter().enumerate() {
            assert_eq!(s.iter().filter(|&&k| k == i).count(), w);
        }
    }

    /// Weights of 255 and 256 over 1,000 backends (gcd 1) wanted 255,500 slots, past the
    /// 65,535 of a frontend, and the frontend was never written. Scaled, they fit; 256:1
    /// over 600 backends keeps its proportion as near as whole slots allow.
    #[test]
    fn weights_too_heavy_for_the_slots_are_scaled_to_fit() {
        let max = 65_535;
        let mut w: Vec<u32> = (0..1000).map(|i| 255 + i % 2).collect();
        assert_eq!(fit(&mut w, max), Some(255_500));
        let s = sequence(&w);
        assert!(s.len() <= max, "{}", s.len());
        assert!(
            (0..1000).all(|i| s.contains(&i)),
            "every backend keeps a slot"
        );

        let mut w: Vec<u32> = (0..600).map(|i| if i < 300 { 256 } else { 1 }).collect();
        assert_eq!(fit(&mut w, max), Some(77_100));
        let s = sequence(&w);
        assert!(s.len() <= max, "{}", s.len());
        let count = |i: usize| s.iter().filter(|&&k| k == i).count();
        assert_eq!((count(0), count(599)), (215, 1));

        // What fits (after the gcd) is left alone, and weight 0 stays 0.
        let mut w = vec![512, 256, 0];
        assert_eq!(fit(&mut w, 3), None);
        assert_eq!(w, [512, 256, 0]);
        let mut w = vec![256, 0, 1];
        assert_eq!(fit(&mut w, 3), Some(257));
        assert_eq!(w, [1, 0, 1]);
    }
}
