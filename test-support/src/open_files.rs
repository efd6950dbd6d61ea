//! Raising this process's open-file limit for benches that hold tens of
//! thousands of sockets (two per simulated proxy in one process). Raising
//! the hard limit needs CAP_SYS_RESOURCE (root here) and stays under the
//! kernel's `fs.nr_open`; children started afterwards inherit the limit.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

#[derive(Debug, thiserror::Error)]
#[error("the open-file limit stays {current} (hard {maximum}), {wanted} wanted: {source}")]
pub struct OpenFilesError {
    pub current: u64,
    pub maximum: u64,
    pub wanted: u64,
    source: std::io::Error,
}

/// Raise `RLIMIT_NOFILE` to at least `wanted` (soft and, when needed,
/// hard). Returns the soft limit now in force.
pub fn raise_open_files(wanted: u64) -> Result<u64, OpenFilesError> {
    let now = getrlimit(Resource::Nofile);
    let current = now.current.unwrap_or(u64::MAX);
    let maximum = now.maximum.unwrap_or(u64::MAX);
    if current >= wanted {
        return Ok(current);
    }
    let raised = Rlimit {
        current: Some(wanted),
        maximum: Some(maximum.max(wanted)),
    };
    setrlimit(Resource::Nofile, raised).map_err(|e| OpenFilesError {
        current,
        maximum,
        wanted,
        source: e.into(),
    })?;
    Ok(wanted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_already_high_enough_is_left_alone() {
        let now = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
        assert_eq!(raise_open_files(1).expect("nothing to raise"), now);
        assert_eq!(getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX), now);
    }
}
