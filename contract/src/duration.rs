//! The one duration grammar of Remora: flags, env, annotations, the
//! `remora.dev/lifecycle` JSON and the CRD all accept exactly this.
//!
//! Whole numbers with the units `h`, `m`, `s`, `ms`, concatenated largest
//! first or not (`45s`, `1m30s`, `250ms`, `1h`), surrounding whitespace
//! ignored. This is the subset of Go's `time.ParseDuration` that CEL's
//! `duration()` also accepts, so the API server refuses what we refuse.
//!
//! A bare number is refused everywhere: `30` could mean seconds (Istio's env)
//! or milliseconds, and the CRD's CEL rule cannot accept it, so rather than
//! guessing on one side only, the error says to write `30s`. (The Istio alias
//! `TERMINATION_DRAIN_DURATION_SECONDS` names its unit; [`parse_seconds`]
//! reads it.)
//!
//! Every duration is bounded by [`MAX`]: a larger value is refused, and a
//! value derived from outside input (a grace period in seconds) saturates at
//! it, so no instant computed from a duration can overflow.

use std::time::Duration;

/// The largest duration anything in Remora accepts.
pub const MAX: Duration = Duration::from_secs(24 * 3600);
/// [`MAX`] as the grammar writes it.
pub const MAX_TEXT: &str = "24h";
/// The grammar as a regular expression (the CRD schema's `pattern`).
pub const PATTERN: &str = "^([0-9]+(h|m|s|ms))+$";
/// The longest text accepted (the CRD schema's `maxLength`).
pub const MAX_LEN: usize = 32;
/// The CRD's CEL rule: the same bound, checked by the API server.
pub const CEL_RULE: &str = "duration(self) >= duration('0s') && duration(self) <= duration('24h')";
/// The message of [`CEL_RULE`].
pub const CEL_MESSAGE: &str = "must be a duration between 0s and 24h, e.g. 45s, 1m30s or 250ms";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("empty duration (write e.g. 45s, 1m30s or 250ms)")]
    Empty,
    #[error("{0:?} has no unit: write {0}s for seconds (units: h, m, s, ms)")]
    NoUnit(String),
    #[error("{0:?} is not a duration like 45s, 1m30s or 250ms (whole numbers; units h, m, s, ms)")]
    Syntax(String),
    #[error("{0:?} is longer than the bound of {MAX_TEXT}")]
    TooLong(String),
}

/// Parse a duration of the grammar, at most [`MAX`].
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    // Shown back in errors: keep it short whatever the input was.
    let shown = || s.chars().take(MAX_LEN + 8).collect::<String>();
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(DurationError::NoUnit(shown()));
    }
    if s.len() > MAX_LEN {
        return Err(DurationError::Syntax(shown()));
    }
    let mut total_ms: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| DurationError::Syntax(shown()))?;
        if digits == 0 {
            return Err(DurationError::Syntax(shown()));
        }
        // At most 32 digits in all: u128 holds any of them.
        let n: u128 = rest[..digits]
            .parse()
            .map_err(|_| DurationError::Syntax(shown()))?;
        rest = &rest[digits..];
        let (unit_ms, len) = if rest.starts_with("ms") {
            (1, 2)
        } else if rest.starts_with('h') {
            (3_600_000, 1)
        } else if rest.starts_with('m') {
            (60_000, 1)
        } else if rest.starts_with('s') {
            (1_000, 1)
        } else {
            return Err(DurationError::Syntax(shown()));
        };
        rest = &rest[len..];
        total_ms = n
            .checked_mul(unit_ms)
            .and_then(|v| total_ms.checked_add(v))
            .ok_or_else(|| DurationError::TooLong(shown()))?;
    }
    if total_ms > MAX.as_millis() {
        return Err(DurationError::TooLong(shown()));
    }
    // Bounded by MAX just above, so it fits a u64.
    Ok(Duration::from_millis(
        u64::try_from(total_ms).unwrap_or(u64::MAX),
    ))
}

/// Render in the grammar (`1m30s`, `250ms`, `0s`); sub-millisecond parts are
/// dropped, so `parse(format(d))` is `d` for every `d` the grammar produced.
pub fn format(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".into();
    }
    let (h, rem) = (ms / 3_600_000, ms % 3_600_000);
    let (m, rem) = (rem / 60_000, rem % 60_000);
    let (s, ms) = (rem / 1000, rem % 1000);
    let mut out = String::new();
    for (n, unit) in [(h, "h"), (m, "m"), (s, "s"), (ms, "ms")] {
        if n > 0 {
            out.push_str(&n.to_string());
            out.push_str(unit);
        }
    }
    out
}

/// A count of seconds from outside (e.g. `terminationGracePeriodSeconds`)
/// as a duration: negative is zero, past [`MAX`] is [`MAX`].
pub fn from_secs_saturating(secs: i64) -> Duration {
    let secs = u64::try_from(secs).unwrap_or(0);
    Duration::from_secs(secs.min(MAX.as_secs()))
}

/// Istio's `TERMINATION_DRAIN_DURATION_SECONDS`: whole seconds, as its name
/// says, or a duration of the grammar; bounded by [`MAX`] either way.
pub fn parse_seconds(text: &str) -> Result<Duration, DurationError> {
    let s = text.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return match s.parse::<u64>() {
            Ok(n) if n <= MAX.as_secs() => Ok(Duration::from_secs(n)),
            _ => Err(DurationError::TooLong(s.chars().take(MAX_LEN).collect())),
        };
    }
    parse(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn grammar() {
        let ok = [
            ("45s", 45_000),
            ("1m30s", 90_000),
            ("250ms", 250),
            (" 5s\n", 5_000),
            ("1h", 3_600_000),
            ("0s", 0),
            ("1s500ms", 1_500),
            ("24h", 86_400_000),
            ("23h59m60s", 86_400_000),
        ];
        for (text, ms) in ok {
            assert_eq!(parse(text), Ok(Duration::from_millis(ms)), "{text:?}");
        }
        assert_eq!(parse(""), Err(DurationError::Empty));
        assert_eq!(parse("30"), Err(DurationError::NoUnit("30".into())));
        for bad in [
            "1.5s", "-1s", "5 s", "1d", "s", "5sec", "1m30", "５s", "∞", "0x10s",
        ] {
            assert!(
                matches!(parse(bad), Err(DurationError::Syntax(_))),
                "{bad:?}: {:?}",
                parse(bad)
            );
        }
        for huge in [
            "24h1ms",
            "25h",
            "2562047788015215h30m2s",
            "99999999999999999999h",
        ] {
            let e = parse(huge).unwrap_err();
            assert!(matches!(e, DurationError::TooLong(_)), "{huge:?}: {e:?}");
            assert!(e.to_string().contains("24h"), "names the bound: {e}");
        }
        assert!(parse(&"9".repeat(100)).is_err());
    }

    #[test]
    fn seconds_alias() {
        assert_eq!(parse_seconds("9"), Ok(Duration::from_secs(9)));
        assert_eq!(parse_seconds("9s"), Ok(Duration::from_secs(9)));
        assert!(parse_seconds("86401").is_err());
        assert!(parse_seconds("99999999999999999999999").is_err());
        assert!(parse_seconds("five").is_err());
    }

    #[test]
    fn saturating_seconds() {
        assert_eq!(from_secs_saturating(-5), Duration::ZERO);
        assert_eq!(from_secs_saturating(30), Duration::from_secs(30));
        assert_eq!(from_secs_saturating(i64::MAX), MAX);
    }

    #[test]
    fn constants_agree() {
        assert_eq!(parse(MAX_TEXT), Ok(MAX));
        assert_eq!(format(MAX), MAX_TEXT);
        assert!(CEL_RULE.contains(&format!("duration('{MAX_TEXT}')")));
    }

    proptest! {
        #[test]
        fn never_panics(s in any::<String>()) {
            let _ = parse(&s);
            let _ = parse_seconds(&s);
        }

        #[test]
        fn format_round_trips(ms in 0u64..=MAX.as_millis() as u64) {
            let d = Duration::from_millis(ms);
            prop_assert_eq!(parse(&format(d)), Ok(d));
        }

        #[test]
        fn accepted_values_are_bounded(s in "[0-9]{1,12}(h|m|s|ms)([0-9]{1,6}(h|m|s|ms))?") {
            if let Ok(d) = parse(&s) {
                prop_assert!(d <= MAX);
            }
        }
    }
}
