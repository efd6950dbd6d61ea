//! Istio's real pilot-discovery run on the host against the node's API
//! server, as /work/shared/PEERS.md found it works: plaintext xDS on
//! loopback, no cloud probing, no CA. Its debounce stays at Istio's
//! defaults unless the caller passes its environment variables; its
//! connection-rate guard is lifted (see [`Istiod::start`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::controlplane::process::{Janitor, Proc};
use crate::node::pods::http_get;

#[derive(Debug, thiserror::Error)]
pub enum IstiodError {
    #[error(
        "pilot-discovery not found at {0}: run scripts/build-pilot-discovery.sh (or pass --pilot-discovery)"
    )]
    Missing(PathBuf),
    #[error("writing {0}: {1}")]
    Write(PathBuf, std::io::Error),
    #[error("starting pilot-discovery: {0}")]
    Start(crate::controlplane::Error),
    #[error("pilot-discovery exited ({0}); its log ends with:\n{1}")]
    Exited(String, String),
    #[error("pilot-discovery not ready in {0:?}; its log ends with:\n{1}")]
    NotReady(Duration, String),
    #[error("reading its metrics: {0}")]
    Metrics(String),
}

/// Where it listens (all loopback).
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    pub grpc: u16,
    pub http: u16,
    pub monitoring: u16,
}

pub struct Istiod {
    proc: Proc,
    pub xds: SocketAddr,
    monitoring: SocketAddr,
    http: SocketAddr,
}

impl Istiod {
    /// Start it (its log and mesh config in `dir`; `janitor` kills it if
    /// this process dies) and wait until `/ready` answers 200.
    pub async fn start(
        bin: &Path,
        kubeconfig: &Path,
        dir: &Path,
        ports: Ports,
        env: &[(String, String)],
        janitor: &mut Janitor,
    ) -> Result<Self, IstiodError> {
        if !bin.is_file() {
            return Err(IstiodError::Missing(bin.to_path_buf()));
        }
        let ip = std::net::Ipv4Addr::LOCALHOST;
        let xds = SocketAddr::from((ip, ports.grpc));
        let mesh = dir.join("mesh.yaml");
        std::fs::write(
            &mesh,
            format!("defaultConfig:\n  discoveryAddress: {xds}\n"),
        )
        .map_err(|e| IstiodError::Write(mesh.clone(), e))?;
        let args: Vec<String> = [
            "discovery",
            "--kubeconfig",
            &kubeconfig.display().to_string(),
            "--meshConfig",
            &mesh.display().to_string(),
            "--grpcAddr",
            &xds.to_string(),
            "--httpAddr",
            &format!("{ip}:{}", ports.http),
            "--monitoringAddr",
            &format!("{ip}:{}", ports.monitoring),
            "--secureGRPCAddr",
            "",
        ]
        .map(str::to_string)
        .to_vec();
        // Never let it probe cloud metadata or reach outside the machine
        // (PEERS.md); no CA (the bench's proxies are plaintext), so it
        // writes no root-certificate ConfigMaps into other namespaces.
        let mut vars: Vec<(&str, &str)> = vec![
            ("CLOUD_PLATFORM", "none"),
            ("POD_NAMESPACE", "istio-system"),
            ("POD_NAME", "istiod-local"),
            ("REVISION", "default"),
            ("ENABLE_CA_SERVER", "false"),
            ("PILOT_ENABLE_ANALYSIS", "false"),
            // Its guard against reconnect storms admits 25 new streams a
            // second on 2 cores and refuses (RESOURCE_EXHAUSTED) a stream
            // that would wait over 1 s; Envoy retries with backoff, the
            // bench's clients never retry. Off so N proxies subscribe at
            // once, as Remora's do: it bounds admission, not pushes. Off is
            // x/time/rate's `Inf`, which is f64::MAX (100,000/s still
            // refused a stream when 1,000 subscribed at once on these 2
            // cores; "+Inf" parses but is not `Inf` and refuses too).
            ("PILOT_MAX_REQUESTS_PER_SECOND", "1.7976931348623157e308"),
        ];
        vars.extend(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let proc = Proc::spawn_with_env("pilot-discovery", bin, &args, &vars, dir)
            .map_err(IstiodError::Start)?;
        janitor.watch(proc.pid()).map_err(IstiodError::Start)?;
        let mut me = Self {
            proc,
            xds,
            monitoring: SocketAddr::from((ip, ports.monitoring)),
            http: SocketAddr::from((ip, ports.http)),
        };
        me.ready(Duration::from_secs(120)).await?;
        Ok(me)
    }

    async fn ready(&mut self, limit: Duration) -> Result<(), IstiodError> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.proc.exited() {
                return Err(IstiodError::Exited(
                    status.to_string(),
                    self.proc.log_tail(),
                ));
            }
            if http_get(self.http, "/ready", Duration::from_secs(2))
                .await
                .is_ok_and(|r| r.status() == 200)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(IstiodError::NotReady(limit, self.proc.log_tail()));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// Its Prometheus text (`:15014/metrics`).
    pub async fn metrics(&self) -> Result<String, IstiodError> {
        let r = http_get(self.monitoring, "/metrics", Duration::from_secs(10))
            .await
            .map_err(|e| IstiodError::Metrics(e.to_string()))?;
        Ok(r.into_body())
    }

    /// Lines of its log with `error` in them, for the record.
    pub fn error_lines(&self) -> usize {
        crate::controlplane::process::log_tail(&self.proc.log, 64 << 20)
            .lines()
            .filter(|l| l.contains("\terror\t"))
            .count()
    }

    pub fn stop(&mut self) {
        self.proc.stop(Duration::from_secs(10));
    }
}

impl Drop for Istiod {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A Prometheus histogram's cumulative buckets, sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// (upper bound in seconds, cumulative count).
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// `name`'s series in `text`, summed over label sets other than `le`.
    pub fn read(text: &str, name: &str) -> Self {
        let mut h = Self::default();
        let mut by_le: std::collections::BTreeMap<String, f64> = Default::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = value.parse::<f64>() else {
                continue;
            };
            let metric = series.split('{').next().unwrap_or(series);
            if metric == format!("{name}_sum") {
                h.sum += v;
            } else if metric == format!("{name}_count") {
                h.count += v;
            } else if metric == format!("{name}_bucket")
                && let Some(le) = series
                    .split("le=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
            {
                *by_le.entry(le.to_string()).or_default() += v;
            }
        }
        h.buckets = by_le
            .into_iter()
            .map(|(le, c)| (le.parse::<f64>().unwrap_or(f64::INFINITY), c))
            .collect();
        h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        h
    }

    /// What was observed between `before` and `self`.
    pub fn since(&self, before: &Self) -> Self {
        Self {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, c)| {
                    let b = before
                        .buckets
                        .iter()
                        .find(|(l, _)| *l == le)
                        .map_or(0.0, |(_, c)| *c);
                    (le, c - b)
                })
                .collect(),
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }

    /// The upper bound of the bucket holding quantile `q` (seconds).
    pub fn quantile_bound(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        self.buckets
            .iter()
            .find(|(_, c)| *c >= rank)
            .map(|(le, _)| *le)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x\n\
        pilot_proxy_convergence_time_bucket{le=\"0.1\"} 2\n\
        pilot_proxy_convergence_time_bucket{le=\"1\"} 9\n\
        pilot_proxy_convergence_time_bucket{le=\"+Inf\"} 10\n\
        pilot_proxy_convergence_time_sum 4.5\n\
        pilot_proxy_convergence_time_count 10\n";

    #[test]
    fn a_histogram_is_read_and_differenced() {
        let h = Histogram::read(TEXT, "pilot_proxy_convergence_time");
        assert_eq!(h.count, 10.0);
        assert_eq!(h.buckets.len(), 3);
        assert_eq!(h.quantile_bound(0.5), Some(1.0));
        assert_eq!(h.quantile_bound(0.1), Some(0.1));
        let d = h.since(&Histogram::read(
            "pilot_proxy_convergence_time_bucket{le=\"0.1\"} 2\npilot_proxy_convergence_time_count 2\n",
            "pilot_proxy_convergence_time",
        ));
        assert_eq!((d.count, d.quantile_bound(0.5)), (8.0, Some(1.0)));
        assert_eq!(Histogram::default().quantile_bound(0.5), None);
    }
}
