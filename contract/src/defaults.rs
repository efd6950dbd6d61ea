//! The built-in lifecycle defaults: the chart's weakest layer and the
//! agent's flag defaults, in the duration grammar (a test parses each).

pub const MODE: crate::SidecarMode = crate::SidecarMode::Auto;
pub const HOLD_APPLICATION_UNTIL_PROXY_STARTS: bool = true;
pub const STARTUP_TIMEOUT: &str = "60s";
pub const DRAIN_DURATION: &str = "45s";
pub const TERMINATION_DRAIN_DURATION: &str = "5s";
pub const EXIT_ON_ZERO_ACTIVE_CONNECTIONS: bool = false;
pub const MINIMUM_DRAIN_DURATION: &str = "5s";
pub const DRAIN_MODE: crate::DrainMode = crate::DrainMode::Adaptive;
/// Adaptive drain: how long no new connection or request must arrive before
/// the pod counts as no longer used. Longer than kube-proxy takes to stop
/// sending new connections to a deleted pod: clients with keep-alive
/// connections open new ones rarely, so silence can come before kube-proxy
/// has caught up, and a new connection after the app's exit is lost. On
/// the node under a rolling update its `network_programming_duration`
/// (deletion → rules written) reached 2-3 s (14 of 228 changes), and a 3 s
/// default lost a request about once in a few CI runs; 5 s leaves 2 s
/// above that (and is Istio's termination drain default).
pub const QUIET_PERIOD: &str = "5s";
/// Discovery mode: how long a drain waits for every proxy that routed to
/// the pod to confirm it no longer does (confirmed removal), and how long
/// the discovery server waits for each before naming it. A healthy proxy
/// confirms in milliseconds (the server pushes a withdrawal at once,
/// without the debounce); 5 s is above the slowest convergence reported of
/// a loaded Istio mesh (p90 4.5 s), so only a stuck, partitioned or
/// NACKing proxy meets it, and it still leaves a 25 s drain deadline room
/// for the quiet period that follows.
pub const WITHDRAWAL_TIMEOUT: &str = "5s";
/// The agent's drain deadline when nothing derives one (25 s fits Kubernetes'
/// default 30 s grace period with [`crate::pod::drain_deadline`]'s margin).
pub const DRAIN_DEADLINE: &str = "25s";
pub const CONCURRENCY: u32 = 2;
pub const LOG_LEVEL: crate::LogLevel = crate::LogLevel::Warning;
/// terminationGracePeriodSeconds when a pod does not say (Kubernetes' own default).
pub const GRACE_PERIOD_SECONDS: i64 = 30;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_default_is_in_the_grammar() {
        for d in [
            STARTUP_TIMEOUT,
            DRAIN_DURATION,
            TERMINATION_DRAIN_DURATION,
            MINIMUM_DRAIN_DURATION,
            QUIET_PERIOD,
            WITHDRAWAL_TIMEOUT,
            DRAIN_DEADLINE,
        ] {
            assert!(crate::duration::parse(d).is_ok(), "{d}");
        }
        assert_eq!(
            crate::duration::format(crate::pod::drain_deadline(GRACE_PERIOD_SECONDS)),
            DRAIN_DEADLINE
        );
    }
}
