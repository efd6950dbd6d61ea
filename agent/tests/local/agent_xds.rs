//! `remora-agent run --discovery-address` end to end: the generated bootstrap
//! sends Envoy's ADS through the agent's proxy to a discovery server double,
//! the agent is ready once the first listeners and clusters are in, and the
//! listener the server sent carries traffic.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::support::{Agent, free_port};
use remora_test_support::pki::Ca;
use remora_test_support::wait::wait_until;
use remora_test_support::xds_double::{
    CLUSTER_TYPE, LISTENER_TYPE, XdsDouble, static_cluster, tcp_listener,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_mode_gets_its_listener_through_the_agents_proxy() {
    let root = Ca::new("mesh-root");
    let serving = root
        .issue()
        .names(&["discovery.remora.test"])
        .server_auth()
        .sign();
    let double = XdsDouble::start(&serving.chain, &serving.key, &root.pem)
        .await
        .unwrap();
    let backend = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_port = backend.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = backend.accept().await {
            let _ = s.write_all(b"backend").await;
            let _ = s.shutdown().await;
        }
    });
    let port = free_port();
    double.set(
        CLUSTER_TYPE,
        "1",
        vec![static_cluster("backend", backend_port)],
    );
    double.set(
        LISTENER_TYPE,
        "1",
        vec![tcp_listener("out", port, "backend")],
    );

    let files = tempfile::tempdir().unwrap();
    let roots = files.path().join("root.pem");
    std::fs::write(&roots, &root.pem).unwrap();
    let token = files.path().join("token");
    std::fs::write(&token, "tok\n").unwrap();
    let addr = double.addr.to_string();
    let mut agent = tokio::task::spawn_blocking(move || {
        let mut agent = Agent::builder()
            .arg(format!("--discovery-address={addr}"))
            // The double serves state of the world only.
            .arg("--discovery-delta=false")
            .arg("--discovery-server-name=discovery.remora.test")
            .arg(format!("--ca-root-cert={}", roots.display()))
            .arg(format!("--discovery-token-path={}", token.display()))
            .args([
                "--pod-name=web-1",
                "--pod-namespace=shop",
                "--instance-ip=127.0.0.1",
            ])
            .spawn();
        agent.wait_ready();
        agent
    })
    .await
    .unwrap();

    let answer = wait_until(DEADLINE, "the served listener to answer", || async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        (!out.is_empty()).then_some(out)
    })
    .await
    .unwrap();
    assert_eq!(answer, "backend");

    let requests = double.requests();
    assert_eq!(
        requests[0].request.node.as_ref().map(|n| n.id.as_str()),
        Some("sidecar~127.0.0.1~web-1.shop~shop.svc.cluster.local")
    );
    assert!(
        requests
            .iter()
            .all(|r| r.authorization.as_deref() == Some("Bearer tok") && !r.client_cert)
    );
    // The outbound listener is the server's; the static one is not written.
    let bootstrap: serde_json::Value = serde_json::from_slice(
        &std::fs::read(agent.dir.path().join("run").join("envoy-bootstrap.json")).unwrap(),
    )
    .unwrap();
    let names: Vec<&str> = bootstrap["static_resources"]["listeners"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l["name"].as_str())
        .collect();
    assert!(
        names.iter().all(|n| !n.starts_with("outbound_")),
        "{names:?}"
    );
    let metrics = tokio::task::spawn_blocking({
        let port = agent.ports.admin;
        move || crate::support::get(port, "/metrics").unwrap().body
    })
    .await
    .unwrap();
    assert!(metrics.contains("remora_agent_xds_streams 1"), "{metrics}");
    let _ = agent.child.kill();
    double.stop().await;
}
