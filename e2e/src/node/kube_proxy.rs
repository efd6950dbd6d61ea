//! How far kube-proxy lags, in its own words: its
//! `kubeproxy_network_programming_duration_seconds` histogram (an endpoint
//! change's trigger time, e.g. a pod's deletion, → the rules written), read
//! from its metrics port, the `metricsBindAddress` of the kube-proxy.yaml
//! that `scripts/cluster.sh` writes. The adaptive drain's quiet period must
//! outlast it: a client that rarely opens connections can leave a deleted
//! pod silent while kube-proxy would still send it the next one.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;

use super::{Error, cluster_dir, pods};

const SERIES: &str = "kubeproxy_network_programming_duration_seconds_bucket";
/// The bucket bounds read (kube-proxy's, as its `le` labels spell them), up
/// to 5 s; the summary's `+Inf` holds the rest.
const BOUNDS: [&str; 8] = ["0.25", "0.5", "1", "2", "3", "4", "5", "+Inf"];
/// The buckets a summary reports.
const WITHIN: [f64; 4] = [1.0, 2.0, 3.0, 5.0];

/// The histogram's cumulative counts, per bound of [`BOUNDS`] (0 when absent).
#[derive(Debug, Clone, Default)]
pub struct Programming {
    buckets: Vec<(f64, u64)>,
}

/// The changes kube-proxy programmed between two readings.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ProgrammingSummary {
    pub changes: u64,
    /// Of those, how many took at most 1, 2, 3 and 5 s.
    pub within_seconds: Vec<(f64, u64)>,
    /// The smallest bucket bound that holds them all (None: no change, or
    /// some beyond 5 s).
    pub at_most_seconds: Option<f64>,
}

impl Programming {
    /// The IPv4 family's buckets in a Prometheus text exposition.
    pub fn parse(text: &str) -> Self {
        let buckets = BOUNDS
            .iter()
            .map(|le| {
                let series = format!("{SERIES}{{ip_family=\"IPv4\",le=\"{le}\"}}");
                let bound = if *le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::NAN)
                };
                // Counts are whole numbers written as floats.
                let count = pods::prometheus_value(text, &series).unwrap_or(0.0);
                (bound, count as u64)
            })
            .collect();
        Self { buckets }
    }

    fn count_within(&self, le: f64) -> u64 {
        self.buckets
            .iter()
            .find(|(b, _)| *b == le)
            .map_or(0, |(_, c)| *c)
    }

    /// What was programmed since `before`.
    pub fn since(&self, before: &Self) -> ProgrammingSummary {
        let delta = |le: f64| {
            self.count_within(le)
                .saturating_sub(before.count_within(le))
        };
        let changes = delta(f64::INFINITY);
        let at_most_seconds = self
            .buckets
            .iter()
            .filter(|(le, _)| le.is_finite())
            .find(|(le, _)| changes > 0 && delta(*le) == changes)
            .map(|(le, _)| *le);
        ProgrammingSummary {
            changes,
            within_seconds: WITHIN.iter().map(|&le| (le, delta(le))).collect(),
            at_most_seconds,
        }
    }
}

impl std::fmt::Display for ProgrammingSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} changes", self.changes)?;
        for (le, n) in &self.within_seconds {
            write!(f, ", {n} <= {le} s")?;
        }
        match self.at_most_seconds {
            Some(s) => write!(f, ", all <= {s} s"),
            None => Ok(()),
        }
    }
}

/// kube-proxy's metrics address, from the node's kube-proxy.yaml.
fn metrics_addr() -> Result<SocketAddr, Error> {
    let path = cluster_dir().join("kube-proxy.yaml");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    text.lines()
        .find_map(|l| l.trim().strip_prefix("metricsBindAddress:"))
        .and_then(|a| a.trim().parse().ok())
        .ok_or_else(|| Error::Failed {
            what: format!("kube-proxy's metrics address in {}", path.display()),
            detail: "no metricsBindAddress".into(),
        })
}

/// Read the histogram now.
pub async fn programming() -> Result<Programming, Error> {
    let r = pods::http_get(metrics_addr()?, "/metrics", Duration::from_secs(5)).await?;
    Ok(Programming::parse(r.body()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposition(counts: &[(&str, u64)]) -> String {
        counts
            .iter()
            .map(|(le, n)| format!("{SERIES}{{ip_family=\"IPv4\",le=\"{le}\"}} {n}\n"))
            .chain(std::iter::once(format!(
                "{SERIES}{{ip_family=\"IPv6\",le=\"+Inf\"}} 99\n"
            )))
            .collect()
    }

    #[test]
    fn a_summary_counts_the_changes_between_two_readings() {
        let before = Programming::parse(&exposition(&[
            ("1", 10),
            ("2", 10),
            ("3", 10),
            ("4", 10),
            ("5", 10),
            ("+Inf", 10),
        ]));
        let after = Programming::parse(&exposition(&[
            ("1", 70),
            ("2", 200),
            ("3", 214),
            ("4", 214),
            ("5", 214),
            ("+Inf", 214),
        ]));
        let s = after.since(&before);
        assert_eq!(s.changes, 204);
        assert_eq!(
            s.within_seconds,
            vec![(1.0, 60), (2.0, 190), (3.0, 204), (5.0, 204)]
        );
        assert_eq!(s.at_most_seconds, Some(3.0));
        assert_eq!(
            s.to_string(),
            "204 changes, 60 <= 1 s, 190 <= 2 s, 204 <= 3 s, 204 <= 5 s, all <= 3 s"
        );
        assert_eq!(after.since(&after).at_most_seconds, None);
        assert_eq!(Programming::parse("garbage").since(&before).changes, 0);
    }
}
