//! Go's `time.Duration` text, as kube-proxy's config file writes its periods: read by
//! kube-core's [`Duration`](kube::core::Duration) (Go's grammar and units), inside the
//! bounds Go itself keeps.
//!
//! What this adds to kube-core's reading, where it differs from Go's or from a period:
//! - white space around the text is dropped, and an empty text is refused (kube-core
//!   reads it as zero);
//! - a sign is refused: a period is never negative (kube-core reads `-1s` as a negative
//!   duration, and panics on a sign after the first part, `1s-1s`);
//! - a last number without a unit is refused (`1s0`, which kube-core takes as `1s`;
//!   Go says "missing unit");
//! - nothing beyond Go's range (i64 nanoseconds) is accepted, and nothing far beyond it
//!   reaches kube-core, which multiplies each part in floating point and panics past
//!   u64 seconds.

use std::time::Duration;

/// Go's `time.Duration` text: `1s`, `500ms`, `1m30s`, `24h0m0s`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty duration".into());
    }
    if s.contains(['-', '+']) {
        return Err(format!("invalid duration {s:?}: a period has no sign"));
    }
    if s != "0" && !s.ends_with(char::is_alphabetic) {
        return Err(format!("invalid duration {s:?}: missing a unit"));
    }
    if surely_beyond_go(s) {
        return Err(out_of_range(s));
    }
    let d: kube::core::Duration = s
        .parse()
        .map_err(|e| format!("invalid duration {s:?}: {e}"))?;
    let d = Duration::from(d);
    if d > GO_DURATION_MAX {
        return Err(out_of_range(s));
    }
    Ok(d)
}

fn out_of_range(s: &str) -> String {
    format!("duration {s:?} out of range (Go durations end at 2562047h47m16s)")
}

/// The longest Go `time.Duration` (i64::MAX nanoseconds).
const GO_DURATION_MAX: Duration = Duration::from_nanos(i64::MAX as u64);

/// Whether `s` is longer than any Go duration by its parts' whole digits alone (split as
/// kube-core splits them: a number, then its unit's letters). A part of `d` whole digits
/// is below `10^d` units, so the sum of those bounds is at most ten times the duration
/// plus a unit a part: past 10^19 s it is far beyond Go's 9.2·10^9 s, and below it
/// kube-core neither overflows a part nor the sum.
fn surely_beyond_go(s: &str) -> bool {
    const LIMIT_NS: u128 = 10u128.pow(28);
    let mut bound_ns = 0u128;
    let mut rest = s;
    while let Some(at) = rest.find(char::is_alphabetic) {
        let (number, tail) = rest.split_at(at);
        let end = tail
            .find(|c: char| !c.is_alphabetic())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(end);
        let unit_ns: u128 = match unit {
            "ns" => 1,
            "us" | "\u{00b5}s" | "\u{03bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            // Not a unit: kube-core refuses it.
            _ => return false,
        };
        if !number.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
            // Not a number: kube-core refuses it.
            return false;
        }
        let whole = number.split('.').next().unwrap_or_default();
        let digits = whole.trim_start_matches('0').len();
        let part = u32::try_from(digits)
            .ok()
            .and_then(|d| 10u128.checked_pow(d))
            .map_or(u128::MAX, |p| p.saturating_mul(unit_ns));
        bound_ns = bound_ns.saturating_add(part);
        if bound_ns > LIMIT_NS {
            return true;
        }
        rest = tail;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        for (s, ms) in [
            ("1s", 1000),
            ("500ms", 500),
            ("1m30s", 90_000),
            ("24h0m0s", 86_400_000),
            ("0", 0),
            ("1.5s", 1500),
        ] {
            assert_eq!(parse_duration(s), Ok(Duration::from_millis(ms)), "{s}");
        }
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    /// Where kube-core's reading is not a period's: each refused here, never a panic.
    #[test]
    fn what_kube_core_reads_otherwise() {
        for s in ["-1s", "+1s", "-0", "1s-1s", "1s0", "1.5", " ", "00"] {
            assert!(parse_duration(s).is_err(), "{s:?}");
        }
        for s in [
            "99999999999999999999999h",
            "18446744073709551616s",
            "5000000000000000h5000000000000000h",
            "2562047h47m17s",
            "9223372036854775808ns",
        ] {
            let err = parse_duration(s).expect_err(s);
            assert!(err.contains("range"), "{s}: {err}");
        }
        // Go's own: both micro signs, fractions without a leading or trailing digit.
        assert_eq!(parse_duration("12\u{03bc}s"), Ok(Duration::from_micros(12)));
        assert_eq!(parse_duration("12\u{00b5}s"), Ok(Duration::from_micros(12)));
        assert_eq!(parse_duration(".5s"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5.s"), Ok(Duration::from_secs(5)));
    }
}
