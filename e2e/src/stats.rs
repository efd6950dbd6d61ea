//! Summaries of benchmark samples: nearest-rank percentiles, so a p99 of 20
//! samples is the slowest one rather than an interpolation that never happened.

use serde::Serialize;

/// Count, p50, p99 and max of a set of samples in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Summary {
    pub n: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// The nearest-rank `p` percentile (0 < p <= 1) of `sorted`; 0 when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Summary {
    pub fn of(samples: &[f64]) -> Self {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        Self {
            n: v.len(),
            p50_ms: percentile(&v, 0.5),
            p99_ms: percentile(&v, 0.99),
            max_ms: v.last().copied().unwrap_or(0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        let s = Summary::of(&v);
        assert_eq!((s.n, s.p50_ms, s.p99_ms, s.max_ms), (20, 10.0, 20.0, 20.0));
        assert_eq!(Summary::of(&[]), Summary::default());
        assert_eq!(Summary::of(&[f64::NAN, 3.0]).p50_ms, 3.0);
    }
}
