//! The sidecar as it sits in the pod: its container, user, ports and paths.

use std::time::Duration;

/// The sidecar container's name.
pub const PROXY_CONTAINER: &str = "remora-proxy";
/// The sidecar's user and group (non-root).
pub const PROXY_UID: i64 = 1337;

pub const ENVOY_ADMIN_PORT: u16 = 15000;
/// The default static-mode inbound listener; Services target it by number or
/// by the port name [`INBOUND_PORT_NAME`].
pub const INBOUND_PORT: u16 = 15006;
pub const INBOUND_PORT_NAME: &str = "remora-inbound";
/// The agent's admin (metrics, quitquitquit, drain, debug), on 127.0.0.1.
pub const AGENT_ADMIN_PORT: u16 = 15020;
/// The agent's health port (`/healthz/ready`, `/healthz/live`).
pub const HEALTH_PORT: u16 = 15021;
pub const HEALTH_PORT_NAME: &str = "remora-health";
/// Envoy's Prometheus stats listener.
pub const STATS_PORT: u16 = 15090;
pub const STATS_PORT_NAME: &str = "remora-stats";
pub const READY_PATH: &str = "/healthz/ready";
pub const LIVE_PATH: &str = "/healthz/live";
/// On the health port: the app containers' preStop hook (`httpGet`). Starts
/// the drain if it has not started and answers once inbound traffic has gone
/// quiet, so the kubelet sends the app SIGTERM only when the load balancer
/// has stopped sending. Needs [`DRAIN_TOKEN_HEADER`].
pub const APP_PRESTOP_PATH: &str = "/drain/app-prestop";
pub const DRAIN_TOKEN_HEADER: &str = "x-remora-drain-token";

/// Every port the sidecar binds in the pod's network namespace, and what for.
pub const SIDECAR_PORTS: [(u16, &str); 5] = [
    (ENVOY_ADMIN_PORT, "Envoy admin"),
    (INBOUND_PORT, "the inbound listener"),
    (AGENT_ADMIN_PORT, "the agent's admin"),
    (HEALTH_PORT, "health checks"),
    (STATS_PORT, "Envoy's Prometheus stats"),
];

/// What the sidecar uses `port` for, if it is one of [`SIDECAR_PORTS`]: a
/// static listener may neither bind it nor forward to it on loopback (that
/// would publish Envoy's admin API, or loop through the sidecar).
pub fn sidecar_port_use(port: u16) -> Option<&'static str> {
    SIDECAR_PORTS
        .iter()
        .find(|(p, _)| *p == port)
        .map(|(_, use_)| *use_)
}

/// The run directory (bootstrap, SDS socket), an emptyDir.
pub const RUN_DIR: &str = "/var/run/remora";
pub const RUN_VOLUME: &str = "remora-run";
/// Where the downward-API volume with the pod's annotations is mounted.
pub const PODINFO_DIR: &str = "/etc/remora/podinfo";
pub const PODINFO_VOLUME: &str = "remora-podinfo";
/// The file in [`PODINFO_DIR`] holding `metadata.annotations`.
pub const ANNOTATIONS_FILE_NAME: &str = "annotations";
/// [`PODINFO_DIR`]/[`ANNOTATIONS_FILE_NAME`], the agent's default.
pub const ANNOTATIONS_FILE: &str = "/etc/remora/podinfo/annotations";
/// Mounted workload certificates (file mode).
pub const CERT_DIR: &str = "/etc/certs";

/// The drain deadline of a pod with this `terminationGracePeriodSeconds`:
/// the grace period less a margin (a sixth, 1 to 5 s) for stopping Envoy and
/// the kubelet's own work. Saturates: negative is zero, huge is
/// [`crate::duration::MAX`].
pub fn drain_deadline(grace_seconds: i64) -> Duration {
    let grace = crate::duration::from_secs_saturating(grace_seconds);
    let margin = (grace / 6).clamp(Duration::from_secs(1), Duration::from_secs(5));
    grace.saturating_sub(margin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_saturates() {
        assert_eq!(drain_deadline(30), Duration::from_secs(25));
        assert_eq!(drain_deadline(0), Duration::ZERO);
        assert_eq!(drain_deadline(-1), Duration::ZERO);
        assert_eq!(drain_deadline(6), Duration::from_secs(5));
        let huge = drain_deadline(i64::MAX);
        assert!(huge <= crate::duration::MAX);
        assert_eq!(
            crate::duration::parse(&crate::duration::format(huge)),
            Ok(huge),
            "the injector's env value is one the agent accepts"
        );
        assert_eq!(
            format!("{PODINFO_DIR}/{ANNOTATIONS_FILE_NAME}"),
            ANNOTATIONS_FILE
        );
    }
}
