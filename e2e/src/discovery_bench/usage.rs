//! A contender's CPU seconds and memory, read from /proc/<pid>: the
//! process alone, not the bench's clients.

/// One reading of a process.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Usage {
    /// utime + stime since it started.
    pub cpu_seconds: f64,
    pub rss_mib: f64,
    /// Peak RSS since it started (VmHWM).
    pub peak_rss_mib: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error("reading /proc/{0}: {1}")]
    Read(u32, std::io::Error),
    #[error("/proc/{0}/{1} has no field {2}")]
    Field(u32, &'static str, &'static str),
}

/// Clock ticks per second of /proc's times (USER_HZ, 100 on Linux).
const TICKS: f64 = 100.0;

impl Usage {
    pub fn of(pid: u32) -> Result<Self, UsageError> {
        let read = |f: &str| {
            std::fs::read_to_string(format!("/proc/{pid}/{f}"))
                .map_err(|e| UsageError::Read(pid, e))
        };
        let stat = read("stat")?;
        // Fields after the command name (which may hold spaces): utime is the 14th field overall.
        let f: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, r)| r.split_whitespace().collect())
            .unwrap_or_default();
        let tick = |k: usize| f.get(k).and_then(|v| v.parse::<f64>().ok());
        let (Some(u), Some(s)) = (tick(11), tick(12)) else {
            return Err(UsageError::Field(pid, "stat", "utime/stime"));
        };
        let status = read("status")?;
        let kib = |name: &'static str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
                .ok_or(UsageError::Field(pid, "status", name))
        };
        Ok(Self {
            cpu_seconds: (u + s) / TICKS,
            rss_mib: kib("VmRSS:")? / 1024.0,
            peak_rss_mib: kib("VmHWM:")? / 1024.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let u = Usage::of(std::process::id()).expect("readable");
        assert!(u.rss_mib > 0.0 && u.peak_rss_mib >= u.rss_mib, "{u:?}");
        assert!(Usage::of(u32::MAX).is_err());
    }
}
