//! Envoy's admin API, as the agent uses it: readiness, stats, draining.

use std::time::Duration;

use crate::http_client::{HttpClient, HttpError};

/// Listener stat prefix of the Prometheus listener the bootstrap adds: named so
/// that its scrapes are never counted as the workload's connections.
pub const PROMETHEUS_STAT_PREFIX: &str = "remora_prometheus";

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("Envoy admin {path} answered {status}: {body}")]
    Status {
        path: String,
        status: u16,
        body: String,
    },
}

/// Envoy's `server.state` gauge values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerState {
    Live,
    Draining,
    PreInitializing,
    Initializing,
    Unknown(u64),
}

impl ServerState {
    fn from_gauge(v: u64) -> Self {
        match v {
            0 => Self::Live,
            1 => Self::Draining,
            2 => Self::PreInitializing,
            3 => Self::Initializing,
            n => Self::Unknown(n),
        }
    }
}

/// What readiness needs to know about Envoy, read in one stats call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerStatus {
    pub state: ServerState,
    pub workers_started: bool,
    pub lds_updates: u64,
    pub cds_updates: u64,
    /// `--restart-epoch` of the Envoy that answered: after a hot restart the
    /// admin port belongs to the new epoch once it has started, and to nobody
    /// in between (the parent closes its admin when the child begins).
    pub hot_restart_epoch: Option<u32>,
}

impl ServerStatus {
    /// Read the stats [`EnvoyAdmin::server_status`] asks for; missing ones
    /// leave the state unknown, counters at 0, the epoch unknown.
    pub fn parse(body: &str) -> Self {
        let mut status = Self {
            state: ServerState::Unknown(u64::MAX),
            workers_started: false,
            lds_updates: 0,
            cds_updates: 0,
            hot_restart_epoch: None,
        };
        for (name, value) in parse_stats(body) {
            match name {
                "server.state" => status.state = ServerState::from_gauge(value),
                "server.hot_restart_epoch" => status.hot_restart_epoch = u32::try_from(value).ok(),
                "listener_manager.workers_started" => status.workers_started = value == 1,
                "listener_manager.lds.update_success" => status.lds_updates = value,
                "cluster_manager.cds.update_success" => status.cds_updates = value,
                _ => {}
            }
        }
        status
    }
}

#[derive(Clone, Debug)]
pub struct EnvoyAdmin {
    base: String,
    http: HttpClient,
}

impl EnvoyAdmin {
    pub fn new(port: u16) -> Self {
        Self {
            base: format!("http://127.0.0.1:{port}"),
            // Envoy's admin port changes hands at each hot restart, and the
            // old epoch keeps serving connections made before: a loopback
            // connection per call is cheap, and always asks the right Envoy.
            http: HttpClient::without_keep_alive(Duration::from_secs(1)),
        }
    }

    /// Call the admin API; anything but 200 is an error.
    async fn call(&self, method: hyper::Method, path: &str) -> Result<String, AdminError> {
        let r = self
            .http
            .request(method, &format!("{}{path}", self.base))
            .await?;
        if r.status != 200 {
            return Err(AdminError::Status {
                path: path.to_string(),
                status: r.status,
                body: r.body,
            });
        }
        Ok(r.body)
    }

    pub async fn server_status(&self) -> Result<ServerStatus, AdminError> {
        let body = self
            .call(
                hyper::Method::GET,
                "/stats?filter=^(server\\.state|server\\.hot_restart_epoch|\
                 listener_manager\\.workers_started|listener_manager\\.lds\\.update_success|\
                 cluster_manager\\.cds\\.update_success)$",
            )
            .await?;
        Ok(ServerStatus::parse(&body))
    }

    /// Sum of the workload's active downstream connections (see
    /// [`count_active_connections`]).
    pub async fn active_connections(&self) -> Result<u64, AdminError> {
        let body = self
            .call(
                hyper::Method::GET,
                "/stats?usedonly&filter=downstream_cx_active$",
            )
            .await?;
        Ok(count_active_connections(&body))
    }

    /// The counters the adaptive drain follows (see [`Traffic::parse`]).
    pub async fn traffic(&self) -> Result<Traffic, AdminError> {
        let body = self
            .call(
                hyper::Method::GET,
                "/stats?usedonly&filter=downstream_(cx_total|rq_total|rq_active)$",
            )
            .await?;
        Ok(Traffic::parse(&body))
    }

    /// Start a graceful drain of the inbound listeners only.
    pub async fn drain_inbound_listeners(&self) -> Result<(), AdminError> {
        self.call(hyper::Method::POST, "/drain_listeners?inboundonly&graceful")
            .await
            .map(drop)
    }
}

/// Parse Envoy's plain-text `/stats` output into (name, value) pairs; lines
/// that are not plain counters or gauges (histograms) are skipped.
pub fn parse_stats(body: &str) -> impl Iterator<Item = (&str, u64)> {
    body.lines().filter_map(|line| {
        let (name, value) = line.split_once(": ")?;
        Some((name.trim(), value.trim().parse().ok()?))
    })
}

/// Sum `listener.<addr>.downstream_cx_active` over the workload's listeners.
///
/// Left out: the admin listener (the stats request counting itself is one of
/// its connections), the agent's Prometheus listener, the per-worker copies
/// `listener.<addr>.worker_N.*`, and every `http.*` stat.
pub fn count_active_connections(body: &str) -> u64 {
    parse_stats(body)
        .filter_map(|(name, value)| {
            let middle = name
                .strip_prefix("listener.")?
                .strip_suffix(".downstream_cx_active")?;
            let listener = match middle.rsplit_once('.') {
                // Per-thread copies of a listener's stats: the total is already counted.
                Some((_, last)) if last == "main_thread" || is_worker(last) => return None,
                _ => middle,
            };
            if listener == "admin" || listener == PROMETHEUS_STAT_PREFIX {
                return None;
            }
            Some(value)
        })
        .sum()
}

/// What the workload's listeners have seen, from Envoy's own counters: enough
/// to tell whether the pod is still being used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Connections and requests that arrived on inbound listeners so far: HTTP
    /// connection managers and TCP proxies whose stat prefix starts with
    /// `inbound` (the agent's static listeners, and Istio-style xDS names).
    pub inbound_arrivals: u64,
    /// Connections on every workload listener (the app's outbound ones too)
    /// plus requests on every HTTP connection manager.
    pub arrivals: u64,
    /// Requests in flight on every HTTP connection manager.
    pub in_flight: u64,
    /// Of those, the ones on inbound HTTP connection managers (the app
    /// serves them).
    pub inbound_in_flight: u64,
}

impl Traffic {
    /// Read `downstream_cx_total`, `downstream_rq_total` and
    /// `downstream_rq_active` out of a `/stats` body. Left out, as in
    /// [`count_active_connections`]: the admin listener (the stats request
    /// itself), the agent's Prometheus listener, per-worker copies.
    pub fn parse(body: &str) -> Self {
        let mut t = Self::default();
        for (name, value) in parse_stats(body) {
            let Some((scope, rest)) = name.split_once('.') else {
                continue;
            };
            let Some((prefix, stat)) = rest.rsplit_once('.') else {
                continue;
            };
            if prefix == "admin" || prefix == PROMETHEUS_STAT_PREFIX {
                continue;
            }
            let inbound = prefix.starts_with("inbound");
            match (scope, stat) {
                ("listener", "downstream_cx_total") => {
                    let per_thread = prefix
                        .rsplit_once('.')
                        .is_some_and(|(_, last)| last == "main_thread" || is_worker(last));
                    if !per_thread {
                        t.arrivals = t.arrivals.saturating_add(value);
                    }
                }
                ("http", "downstream_rq_total") => {
                    t.arrivals = t.arrivals.saturating_add(value);
                    if inbound {
                        t.inbound_arrivals = t.inbound_arrivals.saturating_add(value);
                    }
                }
                ("http" | "tcp", "downstream_cx_total") if inbound => {
                    t.inbound_arrivals = t.inbound_arrivals.saturating_add(value);
                }
                ("http", "downstream_rq_active") => {
                    t.in_flight = t.in_flight.saturating_add(value);
                    if inbound {
                        t.inbound_in_flight = t.inbound_in_flight.saturating_add(value);
                    }
                }
                _ => {}
            }
        }
        t
    }
}

fn is_worker(segment: &str) -> bool {
    segment
        .strip_prefix("worker_")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traffic_counts_workload_listeners_and_splits_inbound() {
        let body = "\
http.admin.downstream_rq_total: 50
http.admin.downstream_rq_active: 1
http.inbound_15006.downstream_cx_total: 4
http.inbound_15006.downstream_rq_total: 40
http.inbound_15006.downstream_rq_active: 2
http.outbound_http.downstream_rq_total: 7
http.outbound_http.downstream_rq_active: 1
http.remora_prometheus.downstream_rq_total: 9
listener.0.0.0.0_15006.downstream_cx_total: 4
listener.0.0.0.0_15006.worker_0.downstream_cx_total: 3
listener.127.0.0.1_15001.downstream_cx_total: 5
listener.admin.downstream_cx_total: 60
listener.remora_prometheus.downstream_cx_total: 9
tcp.inbound_tcp_9000.downstream_cx_total: 2
tcp.outbound_15001.downstream_cx_total: 5
";
        assert_eq!(
            Traffic::parse(body),
            Traffic {
                inbound_arrivals: 4 + 40 + 2,
                arrivals: 4 + 5 + 40 + 7,
                in_flight: 2 + 1,
                inbound_in_flight: 2,
            }
        );
        assert_eq!(Traffic::parse("garbage\n"), Traffic::default());
    }

    #[test]
    fn counts_only_workload_listeners() {
        let body = "\
http.admin.downstream_cx_active: 1
http.inbound_15006.downstream_cx_active: 3
listener.0.0.0.0_15006.downstream_cx_active: 3
listener.0.0.0.0_15006.worker_0.downstream_cx_active: 2
listener.0.0.0.0_15006.worker_1.downstream_cx_active: 1
listener.127.0.0.1_15001.downstream_cx_active: 2
listener.127.0.0.1_15001.worker_0.downstream_cx_active: 2
listener.admin.downstream_cx_active: 1
listener.admin.main_thread.downstream_cx_active: 1
listener.remora_prometheus.downstream_cx_active: 4
listener.remora_prometheus.worker_0.downstream_cx_active: 4
listener.[__1]_15006.downstream_cx_active: 1
";
        assert_eq!(count_active_connections(body), 3 + 2 + 1);
    }

    #[test]
    fn server_status_reads_state_epoch_and_updates() {
        let body = "\
cluster_manager.cds.update_success: 2
listener_manager.lds.update_success: 1
listener_manager.workers_started: 1
server.hot_restart_epoch: 3
server.state: 0
";
        assert_eq!(
            ServerStatus::parse(body),
            ServerStatus {
                state: ServerState::Live,
                workers_started: true,
                lds_updates: 1,
                cds_updates: 2,
                hot_restart_epoch: Some(3),
            }
        );
        let unknown = ServerStatus::parse("server.hot_restart_epoch: 99999999999\n");
        assert_eq!(unknown.state, ServerState::Unknown(u64::MAX));
        assert_eq!(unknown.hot_restart_epoch, None, "out of range is unknown");
    }

    #[test]
    fn empty_and_odd_lines() {
        assert_eq!(count_active_connections(""), 0);
        assert_eq!(
            count_active_connections("garbage\nlistener.x.downstream_cx_active: nope\n"),
            0
        );
        let h = "cluster.x.upstream_rq_time: P0(nan,1) P25(nan,2)\nserver.state: 0\n";
        assert_eq!(
            parse_stats(h).collect::<Vec<_>>(),
            vec![("server.state", 0)]
        );
    }
}
