//! Inbound served over xDS, with the real Envoy and the operator's
//! discovery server in this process (the registry fed directly with the
//! pod as the pod watch reads it, a test double for TokenReview), no node:
//! a `remora-agent` in discovery mode, started with `--inbound` as the
//! webhook starts it, writes no static inbound listener; the server serves
//! the pod's `remora.dev/inbound`.
//!
//! Shown, on the same processes:
//! - the sidecar is ready only once Envoy holds the served listeners, and a
//!   call to the inbound port reaches the app through `inbound_<port>`,
//!   an INBOUND listener Envoy got over LDS (not from its bootstrap);
//! - the pod's annotation gains a port: the new listener serves, and a
//!   keep-alive connection opened before the change still answers on the
//!   first listener (Envoy was not restarted, that listener not replaced);
//! - the agent's drain (`drain_listeners?inboundonly`) drains both served
//!   listeners: it counts the open inbound connection, and responses on
//!   either port carry `connection: close` while it runs.
//!
//! The agent binary must be built (`cargo build -p remora-agent`, or set
//! `REMORA_AGENT_BIN`); Envoy is found as the other tests find it.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use e2e::discovery_rig::{NS, Reviewer, Rig, Sidecar, Upstreams, get, stat};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use remora_contract::annotations::{INBOUND, STATUS};
use remora_operator::cluster::live_pod::{LivePod, Slim};
use remora_operator::discovery::push::Discovery;
use remora_operator::discovery::registry::ProxyInfo;
use remora_operator::discovery::resources::LISTENER;
use remora_test_support::named_backend::{HEADER, NamedBackend};
use remora_test_support::ports::free_port;
use remora_test_support::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(30);

/// Pod `web-0` as the pod watch reads it: injected with the inbound
/// listener `injected`, carrying `remora.dev/inbound: inbound`.
fn pod(injected: &str, inbound: &str) -> anyhow::Result<LivePod> {
    let status = serde_json::json!({ "inbound": [injected] }).to_string();
    let mut p: LivePod = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": "web-0",
            "namespace": NS,
            "annotations": { STATUS: status, INBOUND: inbound },
        },
        "spec": { "serviceAccountName": "web", "containers": [] },
        "status": { "podIP": "127.0.0.1" },
    }))?;
    Slim::default().slim(&mut p);
    Ok(p)
}

fn apply(discovery: &Discovery, p: &LivePod) -> anyhow::Result<()> {
    let (key, info) = ProxyInfo::read(p).context("an injected pod")?;
    discovery.update(|r| r.apply_proxy(key, info));
    Ok(())
}

/// A keep-alive HTTP/1.1 connection to `127.0.0.1:port`.
async fn keep_alive(
    port: u16,
) -> anyhow::Result<hyper::client::conn::http1::SendRequest<Empty<Bytes>>> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(send)
}

/// A GET on `send`: the backend that answered, and whether the response
/// closes the connection.
async fn call(
    send: &mut hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
) -> anyhow::Result<(String, bool)> {
    send.ready().await?;
    let req = http::Request::get("/")
        .header("host", "web")
        .body(Empty::new())?;
    let resp = tokio::time::timeout(Duration::from_secs(10), send.send_request(req)).await??;
    ensure!(resp.status() == 200, "status {}", resp.status());
    let backend = resp
        .headers()
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let closes = resp
        .headers()
        .get("connection")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
    resp.into_body().collect().await?;
    Ok((backend, closes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_is_served_changes_live_and_drains() -> anyhow::Result<()> {
    let rig = Rig::new(Reviewer::new(&[(1, "web")]), None)?;
    let (discovery, metrics) = (&rig.discovery, &rig.metrics);

    let (in1, in2) = (free_port(), free_port());
    let app1 = NamedBackend::start("127.0.0.1:0".parse()?, "app-1").await?;
    let app2 = NamedBackend::start("127.0.0.1:0".parse()?, "app-2").await?;
    let (p1, p2) = (app1.addr.port(), app2.addr.port());
    // Injected with one listener, the annotation saying the same.
    let first = format!("{in1}:{p1}");
    apply(discovery, &pod(&first, &first)?)?;

    let addr = format!("127.0.0.1:{}", free_port()).parse()?;
    let stop = CancellationToken::new();
    let server = rig.serve_discovery(addr, stop.clone()).await?;
    let upstreams = Upstreams {
        discovery: Some(addr),
        ca: None,
    };
    let mut agent = Sidecar::start(
        &rig,
        &upstreams,
        "web-0",
        "web",
        1,
        &[
            // As the webhook starts it: the inbound it was injected with.
            format!("--inbound={first}"),
            // A fixed drain of 2 s (responses carry `connection: close`
            // from its start: the immediate strategy, the default).
            "--termination-drain-duration=2s".to_owned(),
        ],
    )?;
    agent.ready("the sidecar").await?;
    let (admin, agent_admin) = (agent.envoy_admin, agent.agent_admin);
    // Ready means the served listener is there: the first call answers.
    let mut held = keep_alive(in1).await.context("the inbound port is bound")?;
    let (backend, closes) = call(&mut held).await?;
    ensure!(backend == "app-1" && !closes, "{backend} {closes}");
    // Served, not static: in Envoy's dynamic listeners, INBOUND.
    let dump = get(admin, "/config_dump?resource=dynamic_listeners")
        .await
        .map(|r| r.1)
        .unwrap_or_default();
    let name = format!("inbound_{in1}");
    ensure!(
        dump.contains(&format!("\"name\": \"{name}\""))
            && dump.contains("\"traffic_direction\": \"INBOUND\""),
        "{name} is not a dynamic INBOUND listener: {dump}"
    );
    let statics = get(admin, "/config_dump?resource=static_listeners")
        .await
        .map(|r| r.1)
        .unwrap_or_default();
    ensure!(
        !statics.contains("inbound_"),
        "a static inbound listener: {statics}"
    );
    let lds_updates = stat(admin, "listener_manager.lds.update_success").await;

    // The annotation gains a port: served without restarting Envoy.
    let lds_before = metrics.pushes_total(LISTENER);
    apply(discovery, &pod(&first, &format!("{first},{in2}:{p2}"))?)?;
    let added = wait_until(
        DEADLINE,
        "the new inbound port serves app-2",
        || async move {
            get(in2, "/")
                .await
                .filter(|(s, raw)| *s == 200 && raw.contains(&format!("{HEADER}: app-2")))
                .map(|_| ())
        },
    )
    .await;
    if added.is_err() {
        bail!("the new inbound listener never served:\n{}", agent.log());
    }
    ensure!(
        metrics.pushes_total(LISTENER) > lds_before,
        "no LDS push counted"
    );
    let (backend, closes) = call(&mut held)
        .await
        .context("the connection held across the change")?;
    ensure!(backend == "app-1" && !closes, "{backend} {closes}");
    let lds_after = stat(admin, "listener_manager.lds.update_success").await;
    ensure!(
        lds_after > lds_updates,
        "Envoy took no LDS update: {lds_updates} -> {lds_after}"
    );
    println!(
        "inbound over xDS: {name} served at start, inbound_{in2} added live (Envoy's LDS updates {lds_updates} -> {lds_after}), the connection held across it kept"
    );

    // The agent's drain takes both served listeners.
    let admin_token =
        std::fs::read_to_string(agent.run_dir().join(remora_contract::pod::ADMIN_TOKEN_FILE))
            .context("the agent's admin token")?;
    let drain = tokio::spawn(async move {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", agent_admin)).await?;
        let req = format!(
            "POST /drain HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            admin_token.trim()
        );
        s.write_all(req.as_bytes()).await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        anyhow::Ok(out)
    });
    // Responses on a fresh connection to the new port close it (the
    // request itself does not ask to).
    let closing = wait_until(DEADLINE, "responses on the new port close", || async move {
        let mut c = keep_alive(in2).await.ok()?;
        call(&mut c)
            .await
            .ok()
            .filter(|(b, closes)| b == "app-2" && *closes)
            .map(|_| ())
    })
    .await;
    if closing.is_err() {
        bail!("the drain did not reach inbound_{in2}:\n{}", agent.log());
    }
    let (backend, closes) = call(&mut held).await?;
    ensure!(
        backend == "app-1" && closes,
        "the held connection on {name} was not drained: {backend} {closes}"
    );
    let report = tokio::time::timeout(DEADLINE, drain).await???;
    println!(
        "drain report: {}",
        report.lines().last().unwrap_or_default()
    );
    let body = report.split("\r\n\r\n").nth(1).unwrap_or_default();
    let json: serde_json::Value =
        serde_json::from_str(body.trim()).with_context(|| format!("a drain report: {report}"))?;
    ensure!(
        json["active_at_start"].as_u64().is_some_and(|n| n >= 1),
        "the drain did not count the held inbound connection: {json}"
    );
    ensure!(metrics.nacks_total(LISTENER) == 0, "LDS NACKed");
    agent.child.start_kill()?;
    stop.cancel();
    server.await?;
    Ok(())
}
