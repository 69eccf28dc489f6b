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
}
