//! One request's record ([`Sample`]) and the one summary of many
//! ([`LoadSummary`]): what every runner of this module returns and every
//! report counts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Serialize, Serializer};

use super::Outcome;
use crate::stats;

/// One request (or stream) and how it ended.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// The load's name.
    #[serde(serialize_with = "as_str")]
    pub load: Arc<str>,
    /// The client kind's label.
    pub kind: &'static str,
    /// When it was sent, since the run's epoch.
    #[serde(rename = "at_ms", serialize_with = "millis")]
    pub at: Duration,
    /// Until the outcome was known; for a stream, until its first message
    /// (or its failure).
    #[serde(rename = "latency_ms", serialize_with = "millis")]
    pub latency: Duration,
    pub outcome: Outcome,
    /// The replica that answered (the test app's `x-pod`), or for a
    /// balanced load the endpoint the request was sent to.
    pub pod: Option<String>,
    /// Over TLS: the [`super::fingerprint`] of the certificate the server
    /// presented on the request's connection.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer: Option<u64>,
}

fn as_str<S: Serializer>(v: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v)
}

fn millis<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

/// How many were sent, how they ended, latency of the good ones.
#[derive(Debug, Clone, Serialize)]
pub struct LoadSummary {
    pub load: String,
    pub kind: &'static str,
    pub sent: usize,
    pub ok: usize,
    pub failed: usize,
    /// Failures by [`Outcome::class`].
    pub failures: BTreeMap<&'static str, usize>,
    /// Latency of the successful samples.
    pub latency: stats::Summary,
}

impl LoadSummary {
    /// Every sample as one load (named after the first one's load).
    pub fn of<'a>(samples: impl IntoIterator<Item = &'a Sample>) -> Self {
        let v: Vec<&Sample> = samples.into_iter().collect();
        let ok: Vec<f64> = v
            .iter()
            .filter(|s| s.outcome.is_ok())
            .map(|s| s.latency.as_secs_f64() * 1e3)
            .collect();
        let mut failures = BTreeMap::new();
        for s in v.iter().filter(|s| !s.outcome.is_ok()) {
            *failures.entry(s.outcome.class()).or_insert(0) += 1;
        }
        LoadSummary {
            load: v.first().map(|s| s.load.to_string()).unwrap_or_default(),
            kind: v.first().map_or("", |s| s.kind),
            sent: v.len(),
            ok: ok.len(),
            failed: v.len() - ok.len(),
            failures,
            latency: stats::Summary::of(&ok),
        }
    }
}

/// One [`LoadSummary`] per load name, by name.
pub fn summarize(samples: &[Sample]) -> Vec<LoadSummary> {
    let mut by_load: BTreeMap<&str, Vec<&Sample>> = Default::default();
    for s in samples {
        by_load.entry(&s.load).or_default().push(s);
    }
    by_load.into_values().map(LoadSummary::of).collect()
}
