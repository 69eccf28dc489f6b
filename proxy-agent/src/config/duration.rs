//! Go's `time.Duration` text, as kube-proxy's config file writes its periods.

use std::time::Duration;

/// Go's `time.Duration` text: `1s`, `500ms`, `1m30s`, `24h0m0s`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let mut total = Duration::ZERO;
    let mut rest = s.trim();
    if rest == "0" {
        return Ok(total);
    }
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_end);
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}"))?;
        let secs = match unit {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return Err(format!("invalid duration {s:?}: unit {unit:?}")),
        };
        let part = n * secs;
        // Go's durations are i64 nanoseconds: nothing longer is a duration.
        if !part.is_finite() || part > GO_DURATION_MAX_S {
            return Err(format!(
                "duration {s:?} out of range (Go durations end at 2562047h47m16s)"
            ));
        }
        total = total
            .checked_add(Duration::from_secs_f64(part))
            .filter(|t| t.as_secs_f64() <= GO_DURATION_MAX_S)
            .ok_or_else(|| format!("duration {s:?} out of range"))?;
        rest = tail;
    }
    Ok(total)
}

/// The longest Go `time.Duration`, in seconds (i64::MAX nanoseconds).
const GO_DURATION_MAX_S: f64 = 9_223_372_036.854_775;

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
}
