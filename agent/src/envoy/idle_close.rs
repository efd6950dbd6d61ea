//! Closing the idle keep-alive connections of a draining Envoy.
//!
//! Envoy tells an HTTP/1.1 client to leave only on a response
//! (`connection: close`). A connection idle in a client's pool hears
//! nothing, and the client may pick it again after the app has stopped:
//! that request is lost. Envoy has no admin call that closes idle
//! connections, but its overload manager can cut the downstream idle
//! timeout under pressure, and the injected-resource monitor reads that
//! pressure from a file. The agent writes full pressure there when a drain
//! starts, so every connection idle for [`IDLE_AFTER`] is closed
//! [`CLOSE_GRACE`] later (the HCM's drain timeout), well within a quiet
//! period: a client sees the close before it would reuse the connection.
//! The close is a FIN at once because the HCMs have no delayed close
//! ([`remora_contract::pod::HCM_DELAYED_CLOSE_TIMEOUT`]); only a request
//! sent as the FIN travels can still meet it.
//!
//! The action is Envoy-wide: HTTP listeners the discovery server sends
//! (outbound) close their idle connections during a drain too. Static
//! outbound listeners are TCP proxies and are not touched.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

/// The pressure file, in the run directory.
pub const FILE: &str = "drain-pressure";
/// A connection idle this long during a drain is closed.
pub const IDLE_AFTER: Duration = Duration::from_millis(500);
/// Between the decision to close an idle connection and the close (the
/// inbound HCM's `drain_timeout`; for HTTP/2 the gap between the two GOAWAYs).
pub const CLOSE_GRACE: Duration = remora_contract::inbound::DRAIN_TIMEOUT;
/// How often Envoy's overload manager reads the pressure.
pub const REFRESH: Duration = Duration::from_millis(250);

const MONITOR: &str = "envoy.resource_monitors.injected_resource";

/// The resource monitor and the action for the bootstrap's `overload_manager`.
pub fn overload(path: &Path) -> (Value, Value) {
    let monitor = json!({
        "name": MONITOR,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.resource_monitors.injected_resource.v3.InjectedResourceConfig",
            "filename": path.display().to_string(),
        }
    });
    let action = json!({
        "name": "envoy.overload_actions.reduce_timeouts",
        "triggers": [{"name": MONITOR, "threshold": {"value": 0.5}}],
        "typed_config": {
            "@type": "type.googleapis.com/envoy.config.overload.v3.ScaleTimersOverloadActionConfig",
            "timer_scale_factors": [{
                "timer": "HTTP_DOWNSTREAM_CONNECTION_IDLE",
                "min_timeout": format!("{}s", IDLE_AFTER.as_secs_f64()),
            }]
        }
    });
    (monitor, action)
}

/// Whether Envoy's monitor can start: it takes an inotify instance of its
/// own, and Envoy aborts at start when it gets none (every sidecar on a
/// node runs as the same user, and the kernel caps instances per user:
/// `fs.inotify.max_user_instances`, 128 by default). Tried by opening one
/// and closing it at once (without watches, the close waits for nothing).
/// Without the monitor Envoy starts (said at each start), and a drain no
/// longer closes idle keep-alive connections before Envoy stops.
pub fn monitor_can_start() -> bool {
    match inotify::Inotify::init() {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!(
                error = %e,
                "no inotify instance to spare for Envoy's idle-close monitor (raise fs.inotify.max_user_instances on the node): \
                 Envoy starts without it, and a drain no longer closes idle keep-alive connections before Envoy stops"
            );
            false
        }
    }
}

/// The overload manager's refresh interval.
pub fn refresh_interval() -> Value {
    json!(format!("{}s", REFRESH.as_secs_f64()))
}

/// Say whether Envoy is draining. Written by rename: the monitor reacts to a
/// file moved into place, and never reads half of one.
pub fn set(path: &Path, draining: bool) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, if draining { "1\n" } else { "0\n" })?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_replaces_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE);
        set(&path, false).expect("write");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "0\n");
        set(&path, true).expect("write");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "1\n");
        assert!(!path.with_extension("tmp").exists());
    }

    #[test]
    fn the_action_cuts_only_the_downstream_idle_timeout() {
        let (monitor, action) = overload(Path::new("/run/remora/drain-pressure"));
        assert_eq!(
            monitor["typed_config"]["filename"],
            "/run/remora/drain-pressure"
        );
        let timers = action["typed_config"]["timer_scale_factors"]
            .as_array()
            .expect("timers");
        assert_eq!(timers.len(), 1);
        assert_eq!(timers[0]["timer"], "HTTP_DOWNSTREAM_CONNECTION_IDLE");
        assert_eq!(timers[0]["min_timeout"], "0.5s");
    }
}
