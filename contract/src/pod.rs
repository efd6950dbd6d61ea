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
/// The `delayed_close_timeout` of every HTTP connection manager in the
/// sidecar (the agent's inbound, the discovery server's outbound): none.
/// With Envoy's default (1 s), a connection Envoy has decided to close stays
/// open to the client, unread, for that long before the FIN, and a
/// keep-alive client that reuses it meanwhile has its request reset. A
/// drain closes every idle connection, so that window would lose requests.
pub const HCM_DELAYED_CLOSE_TIMEOUT: Duration = Duration::ZERO;
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
/// On the agent's admin port (loopback): the app containers' preStop hook,
/// run by [`HOOK_HELPER`]. Starts the drain if it has not started and
/// answers once inbound traffic has gone quiet, so the kubelet sends the app
/// SIGTERM only when the load balancer has stopped sending. Needs the hook
/// token of [`HOOK_ENDPOINT_FILE`] as a bearer token.
pub const APP_PRESTOP_PATH: &str = "/drain/app-prestop";

/// The hook volume: an emptyDir the sidecar fills at start with
/// [`HOOK_HELPER`] and [`HOOK_ENDPOINT_FILE`], mounted read-only into the app
/// containers whose preStop execs the helper. Nothing secret is in the pod
/// spec: the token exists only in this volume, inside the pod.
pub const HOOK_DIR: &str = "/var/run/remora-hook";
pub const HOOK_VOLUME: &str = "remora-hook";
/// The static helper the app containers' preStop execs (std only, so it runs
/// in any app image), file name in [`HOOK_DIR`] and in the agent's image.
pub const HOOK_HELPER: &str = "remora-prestop";
/// [`HOOK_DIR`]/[`HOOK_HELPER`]: the app containers' preStop command.
pub const HOOK_HELPER_PATH: &str = "/var/run/remora-hook/remora-prestop";
/// The file in [`HOOK_DIR`] telling the helper where the agent listens and
/// which token to present: `addr=127.0.0.1:PORT` and `token=HEX` lines.
pub const HOOK_ENDPOINT_FILE: &str = "endpoint";
/// The file in the run dir (mode 0600, the sidecar's user only) holding the
/// token the agent's admin actions (`/quitquitquit`, `/drain`, `/logging`)
/// require, so an app with an SSRF that can POST to loopback cannot stop the
/// sidecar; `remora-agent drain` (the sidecar's own preStop) reads it.
pub const ADMIN_TOKEN_FILE: &str = "admin-token";

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

/// The shortest grace period whose [`drain_deadline`] is `deadline` (its
/// inverse, where one exists; never less than `deadline`): once that long
/// has passed since a pod's deletion, the kubelet has killed its containers.
pub fn grace_of_deadline(deadline: Duration) -> Duration {
    let (one, five) = (Duration::from_secs(1), Duration::from_secs(5));
    if deadline.is_zero() {
        return Duration::ZERO;
    }
    // Up to 6 s of grace the margin is 1 s; from 30 s it is 5 s; between,
    // a sixth (so the deadline is five sixths of the grace).
    if deadline <= five {
        deadline.saturating_add(one)
    } else if deadline >= Duration::from_secs(25) {
        deadline.saturating_add(five)
    } else {
        (deadline * 6).div_f64(5.0)
    }
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
            "the operator's env value is one the agent accepts"
        );
        assert_eq!(
            format!("{PODINFO_DIR}/{ANNOTATIONS_FILE_NAME}"),
            ANNOTATIONS_FILE
        );
        assert_eq!(format!("{HOOK_DIR}/{HOOK_HELPER}"), HOOK_HELPER_PATH);
    }

    #[test]
    fn grace_of_deadline_inverts_drain_deadline() {
        for grace in (0u64..=120).chain([3600, 86_400]) {
            let g = Duration::from_secs(grace);
            let grace = i64::try_from(grace).expect("small");
            let d = drain_deadline(grace);
            let back = grace_of_deadline(d);
            assert!(back >= d, "{grace}");
            if grace >= 2 {
                // Within a rounding step of the real grace period, never short of it by more.
                assert!(
                    back + Duration::from_millis(1) >= g && back <= g + Duration::from_millis(1),
                    "grace {grace}s: deadline {d:?}, back {back:?}"
                );
            }
        }
        assert_eq!(
            grace_of_deadline(Duration::from_secs(1)),
            Duration::from_secs(2)
        );
        assert_eq!(
            grace_of_deadline(crate::duration::MAX),
            crate::duration::MAX + Duration::from_secs(5)
        );
    }
}
