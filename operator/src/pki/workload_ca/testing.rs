//! A workload CA for tests and benchmarks, set up the way the operator sets
//! up its own on a first start: fresh roots (created a minute ago, valid an
//! hour) and a serving certificate for `names`. The operator never calls it.

use std::time::{Duration, SystemTime};

use super::Authority;
use super::roots::{self, Policy, Step};

/// The authority, or why it could not be made.
pub fn authority(names: &[&str]) -> Result<Authority, String> {
    let policy = Policy {
        validity: Duration::from_secs(3600),
        settle: Duration::from_secs(60),
        overlap: Duration::from_secs(120),
    };
    let now = SystemTime::now();
    let stored = roots::apply(None, Step::Create, &policy, now - Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    Authority::new(&stored, &names, now)
}
