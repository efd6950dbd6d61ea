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

/// Raise `RLIMIT_NOFILE` to at least `wanted`: the hard limit too where
/// the process may (CAP_SYS_RESOURCE), otherwise the soft limit up to the
/// hard one. Returns the soft limit now in force; an error when it is
/// still below `wanted`.
pub fn raise_open_files(wanted: u64) -> Result<u64, OpenFilesError> {
    let now = getrlimit(Resource::Nofile);
    let current = now.current.unwrap_or(u64::MAX);
    let maximum = now.maximum.unwrap_or(u64::MAX);
    if current >= wanted {
        return Ok(current);
    }
    let set = |soft: u64, hard: u64| {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(soft),
                maximum: Some(hard),
            },
        )
    };
    if set(wanted, maximum.max(wanted)).is_ok() {
        return Ok(wanted);
    }
    // Without the capability the hard limit is the most there is.
    let error = |e: rustix::io::Errno| OpenFilesError {
        current,
        maximum,
        wanted,
        source: e.into(),
    };
    set(maximum, maximum).map_err(error)?;
    Err(error(rustix::io::Errno::PERM))
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
