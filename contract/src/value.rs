//! The grammar of the non-duration scalars in flags, env and annotations.

/// The largest Envoy worker count accepted (`0` means one per CPU).
pub const MAX_CONCURRENCY: u32 = 256;

/// `true/false`, `1/0`, `yes/no`, `on/off`, case-insensitive; empty is false
/// (an env var set to nothing).
pub fn parse_bool(s: &str) -> Result<bool, String> {
    let t = s.trim();
    match t.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        _ => Err(format!(
            "{:?} is not a boolean (true/false)",
            crate::mode::short(t)
        )),
    }
}

/// An Envoy worker count, `0` to [`MAX_CONCURRENCY`].
pub fn parse_concurrency(s: &str) -> Result<u32, String> {
    let t = s.trim();
    t.parse::<u32>()
        .ok()
        .filter(|c| *c <= MAX_CONCURRENCY)
        .ok_or_else(|| {
            format!(
                "{:?} is not a number from 0 to {MAX_CONCURRENCY}",
                crate::mode::short(t)
            )
        })
}
