//! Workload identity on the real node, from Remora's own CA (no Istio):
//! two injected workloads with service accounts of their own, client →
//! server through a ClusterIP Service, talk mTLS with no application
//! change (the client's sidecar originates it on an outbound listener and
//! accepts only the server's SPIFFE identity; the server's sidecar accepts
//! only the client's). Under steady load from the client app (a fresh
//! connection per call, no retry) the certificates (2-minute lifetime) are
//! renewed at half life and the CA's signing root is rotated (staged,
//! switched, retired): no call may fail, no TLS handshake may fail, and
//! Envoy is never restarted. Then the CA goes away (the operator scaled to
//! 0) until each sidecar has failed a renewal, and comes back: the calls go
//! on with the certificate in hand, and both sidecars renew again. A
//! workload outside the mesh is refused.
//! The bad-input test calls the CA itself from the host.
//!
//! Runs with `REMORA_NODE_TESTS=1` (see `e2e::node`).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use e2e::node::pods::{self, LogFollower};
use e2e::node::workload_ca::{
    self as ca, CaClient, EnvoyCerts, envoy_certs, serials, signing_roots, sum_matching, sum_series,
};
use e2e::node::workloads::wait_deployment_rolled_out;
use e2e::node::{self, Check, Node, Remora, TestNamespace, report};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::TokenReview;
use k8s_openapi::api::core::v1::{Pod, Secret, Service, ServiceAccount};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use remora_contract::annotations::{INBOUND, INBOUND_TLS, MODE, OUTBOUND, OUTBOUND_TLS};
use remora_contract::pod::{AGENT_ADMIN_PORT, INBOUND_PORT, STATS_PORT};
use remora_contract::workload_ca::{SIGNING_SECRET, TOKEN_AUDIENCE, spiffe_id};
use remora_test_support::wait::wait_until;
use tokio::time::Instant;

const APP_PORT: u16 = 8080;
const OUTBOUND_PORT: u16 = 15001;
const DEADLINE: Duration = Duration::from_secs(120);
/// The CA's settings for these tests: 2-minute certificates (renewed at
/// about 1 minute), and 90 s for a trust-bundle change to reach every pod
/// (the kubelet refreshes ConfigMap volumes within about a minute).
const CA_VALUES: [&str; 4] = [
    "workloadCA.enabled=true",
    "workloadCA.certTTL=2m",
    "workloadCA.maxCertTTL=2m",
    "workloadCA.settle=90s",
];
/// Stage → switch (settle) → retire (max TTL + settle), plus pickup.
const ROTATION_DEADLINE: Duration = Duration::from_secs(600);

/// Remora with [`CA_VALUES`], installed once for this binary's tests.
async fn install(node: &Node, client: &Client) -> anyhow::Result<&'static Remora> {
    static INSTALLED: tokio::sync::OnceCell<Remora> = tokio::sync::OnceCell::const_new();
    let values: Vec<String> = CA_VALUES.iter().map(|s| s.to_string()).collect();
    Ok(INSTALLED
        .get_or_try_init(|| node.install_remora(client, node::RELEASE_NAMESPACE, &values))
        .await?)
}

fn spiffe(ns: &str, sa: &str) -> String {
    spiffe_id("cluster.local", ns, sa)
}

async fn service_account(ns: &TestNamespace, name: &str) -> anyhow::Result<()> {
    let sa: ServiceAccount =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
    ns.api::<ServiceAccount>()
        .create(&PostParams::default(), &sa)
        .await?;
    Ok(())
}

/// A Deployment of the test app under ServiceAccount `name`.
fn deployment(
    name: &str,
    annotations: &[(&str, &str)],
    args: &[&str],
) -> anyhow::Result<Deployment> {
    let mut d = pods::test_app_deployment(name, 1, annotations, args)?;
    if let Some(spec) = d.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
        spec.service_account_name = Some(name.to_string());
    }
    Ok(d)
}

async fn one_pod(client: &Client, ns: &str, app: &str) -> anyhow::Result<Pod> {
    let running = wait_deployment_rolled_out(client, ns, app, DEADLINE).await?;
    running
        .into_iter()
        .next()
        .with_context(|| format!("no pod of {app}"))
}

fn pod_ip(p: &Pod) -> anyhow::Result<IpAddr> {
    Ok(p.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .context("pod has no IP")?
        .parse()?)
}

fn name(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

/// Envoy's Prometheus stats, straight from the pod's stats port.
async fn envoy_stats(ip: IpAddr) -> Result<String, node::Error> {
    let r = pods::http_get(
        SocketAddr::new(ip, STATS_PORT),
        "/stats/prometheus",
        Duration::from_secs(5),
    )
    .await?;
    Ok(r.into_body())
}

/// TLS trouble and restarts in one Envoy's stats.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TlsCounts {
    handshakes: f64,
    errors: f64,
    hot_restart_epoch: f64,
}

fn tls_counts(stats: &str, side: &str) -> TlsCounts {
    let errors: f64 = [
        "connection_error",
        "fail_verify_error",
        "fail_verify_san",
        "fail_verify_no_cert",
        "fail_verify_cert_hash",
    ]
    .iter()
    .map(|s| sum_matching(stats, &format!("envoy_{side}_"), &format!("_ssl_{s}")))
    .sum();
    TlsCounts {
        handshakes: sum_matching(stats, &format!("envoy_{side}_"), "_ssl_handshake"),
        errors,
        hot_restart_epoch: sum_series(stats, "envoy_server_hot_restart_epoch"),
    }
}

/// The agent's certificate counters: (bundles published, failed CA calls).
async fn agent_certs(client: &Client, ns: &str, pod: &str) -> Result<(f64, f64), node::Error> {
    let (_, body) = node::pod_http_get(client, ns, pod, AGENT_ADMIN_PORT, "/metrics").await?;
    Ok((
        sum_series(&body, "remora_agent_cert_updates_total"),
        sum_series(&body, "remora_agent_cert_failures_total"),
    ))
}

async fn scale_operator(client: &Client, remora: &Remora, replicas: i32) -> anyhow::Result<()> {
    Api::<Deployment>::namespaced(client.clone(), &remora.namespace)
        .patch(
            &remora.operator(),
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"replicas": replicas}})),
        )
        .await?;
    Ok(())
}

/// The client app's own count, logged when it stops: `N ok, M failed`.
fn outbound_counts(lines: &[pods::LogLine]) -> Option<(u64, u64)> {
    lines.iter().find_map(|l| {
        let rest = l.text.split("outbound calls: ").nth(1)?;
        let (ok, rest) = rest.split_once(" ok, ")?;
        let (failed, _) = rest.split_once(" failed")?;
        Some((ok.trim().parse().ok()?, failed.trim().parse().ok()?))
    })
}

/// Scale `app` to 0 and return its app container's whole log.
async fn stop_and_log(
    client: &Client,
    ns: &str,
    app: &str,
    pod: &str,
) -> anyhow::Result<Vec<pods::LogLine>> {
    let follower = LogFollower::start(client, ns, pod, "app").await?;
    Api::<Deployment>::namespaced(client.clone(), ns)
        .patch(
            app,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"replicas": 0}})),
        )
        .await?;
    Ok(follower.finish(Duration::from_secs(120)).await?)
}

#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_mtls -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn mtls_between_workloads_survives_renewal_and_root_rotation() -> anyhow::Result<()> {
    let node = Node::for_test("node_mtls").await?;
    let client = node.client()?;
    let remora = install(node, &client).await?;
    let ns = TestNamespace::injected(node, &client, "mtls").await?;
    let n = ns.name().to_string();
    // The leader writes the trust bundle into the new namespace; a pod
    // created before it waits on its volume.
    let t = Instant::now();
    ca::wait_trust_bundle(&client, &n, DEADLINE).await?;
    report(&format!(
        "  trust bundle in {n} after {} ms",
        t.elapsed().as_millis()
    ));
    service_account(&ns, "server").await?;
    service_account(&ns, "client").await?;
    let (client_id, server_id) = (spiffe(&n, "client"), spiffe(&n, "server"));

    // The server: inbound mTLS, only the client's identity admitted.
    let inbound = format!("{INBOUND_PORT}:{APP_PORT}");
    let port = APP_PORT.to_string();
    ns.api::<Deployment>()
        .create(
            &PostParams::default(),
            &deployment(
                "server",
                &[
                    (MODE, "Legacy"),
                    (INBOUND, &inbound),
                    (INBOUND_TLS, &client_id),
                ],
                &["--port", &port, "--delay", "1ms"],
            )?,
        )
        .await?;
    let svc = ns
        .api::<Service>()
        .create(
            &PostParams::default(),
            &pods::test_app_service("server", 80, INBOUND_PORT)?,
        )
        .await?;
    let ip: IpAddr = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .context("no ClusterIP")?
        .parse()?;
    let server = one_pod(&client, &n, "server").await?;
    pods::wait_service_endpoints(&client, &n, "server", 1, DEADLINE).await?;
    pods::wait_kube_proxy(ip, 80, DEADLINE).await?;

    // The client: its app calls its own sidecar in plain HTTP; the sidecar
    // originates mTLS to the Service and accepts only the server's identity.
    let outbound = format!("{OUTBOUND_PORT}:{ip}:80");
    let outbound_tls = format!("{OUTBOUND_PORT}={server_id}");
    let url = format!("http://127.0.0.1:{OUTBOUND_PORT}/");
    ns.api::<Deployment>()
        .create(
            &PostParams::default(),
            &deployment(
                "client",
                &[
                    (MODE, "Legacy"),
                    (OUTBOUND, &outbound),
                    (OUTBOUND_TLS, &outbound_tls),
                ],
                &[
                    "--port",
                    &port,
                    "--outbound-every",
                    "50ms",
                    "--outbound-url",
                    &url,
                ],
            )?,
        )
        .await?;
    let client_pod = one_pod(&client, &n, "client").await?;
    let (cp, sp) = (name(&client_pod), name(&server));
    let (cip, sip) = (pod_ip(&client_pod)?, pod_ip(&server)?);

    // Both identities, as each Envoy holds them.
    let c0 = envoy_certs(&client, &n, &cp).await?;
    let s0 = envoy_certs(&client, &n, &sp).await?;
    ensure!(
        c0.leaf_uris == vec![client_id.clone()],
        "client's certificate: {c0:?}"
    );
    ensure!(
        s0.leaf_uris == vec![server_id.clone()],
        "server's certificate: {s0:?}"
    );
    report(&format!(
        "  client {cp} is {client_id}; server {sp} is {server_id}"
    ));
    // The calls go through, over TLS on both sides.
    wait_until(DEADLINE, "mTLS handshakes on both sides", || async {
        let c = tls_counts(&envoy_stats(cip).await?, "cluster");
        let s = tls_counts(&envoy_stats(sip).await?, "listener");
        Ok::<_, anyhow::Error>(if c.handshakes.min(s.handshakes) >= 20.0 {
            Check::Done(())
        } else {
            Check::NotYet(format!("client {c:?}, server {s:?}"))
        })
    })
    .await?;

    // Rotate the signing root while the load runs.
    let roots0 = signing_roots(&client, remora)
        .await?
        .context("no signing roots")?;
    let old_root = serials(&roots0.current);
    Api::<Secret>::namespaced(client.clone(), &remora.namespace)
        .patch(
            SIGNING_SECRET,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {"remora.dev/rotate": "now"}}}),
            ),
        )
        .await?;
    let t_rot = Instant::now();
    let mut steps: Vec<(&str, u64)> = Vec::new();
    let mut leaves: [BTreeSet<String>; 2] = Default::default();
    let mut last: [EnvoyCerts; 2] = [c0.clone(), s0.clone()];
    let new_root = loop {
        ensure!(
            t_rot.elapsed() < ROTATION_DEADLINE,
            "rotation not done in {ROTATION_DEADLINE:?}: steps {steps:?}, client {:?}, server {:?}",
            last[0],
            last[1]
        );
        let r = signing_roots(&client, remora)
            .await?
            .context("signing roots gone")?;
        let step = match (&r.next, &r.previous, r.current == roots0.current) {
            (Some(_), _, true) => "staged",
            (None, Some(_), false) => "switched",
            (None, None, false) => "retired",
            _ => "before",
        };
        if steps.last().map(|s| s.0) != Some(step) {
            steps.push((step, t_rot.elapsed().as_secs()));
        }
        for (i, p) in [&cp, &sp].into_iter().enumerate() {
            let c = envoy_certs(&client, &n, p).await?;
            if let Some(s) = &c.leaf_serial {
                leaves[i].insert(s.clone());
            }
            last[i] = c;
        }
        let new = serials(&r.current);
        if step == "retired" && last.iter().all(|c| c.root_serials == new) {
            break new;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    report(&format!(
        "  root rotated {old_root:?} -> {new_root:?}: steps {steps:?} (s after the request); leaves seen: client {}, server {}",
        leaves[0].len(),
        leaves[1].len()
    ));
    // The leaves renewed (at half of 2 minutes) at least twice, and the last
    // ones are under the new root (only it is trusted now, and they work).
    ensure!(
        leaves.iter().all(|l| l.len() >= 3),
        "fewer than two renewals: {leaves:?}"
    );
    let updates = [
        agent_certs(&client, &n, &cp).await?.0,
        agent_certs(&client, &n, &sp).await?.0,
    ];
    let c = tls_counts(&envoy_stats(cip).await?, "cluster");
    let s = tls_counts(&envoy_stats(sip).await?, "listener");
    report(&format!(
        "  agent certificate updates: client {}, server {}; TLS: client {c:?}, server {s:?}",
        updates[0], updates[1]
    ));
    ensure!(
        c.errors == 0.0 && s.errors == 0.0,
        "TLS failures: client {c:?}, server {s:?}"
    );
    ensure!(
        c.hot_restart_epoch == 0.0 && s.hot_restart_epoch == 0.0,
        "Envoy was restarted: client {c:?}, server {s:?}"
    );

    // The CA down (both replicas gone): each sidecar fails to renew, keeps
    // serving the certificate it has, retries with backoff, and renews once
    // the CA is back; the calls keep going through all along.
    let before = [
        agent_certs(&client, &n, &cp).await?,
        agent_certs(&client, &n, &sp).await?,
    ];
    scale_operator(&client, remora, 0).await?;
    let t_down = Instant::now();
    wait_until(
        Duration::from_secs(180),
        "both sidecars to fail a renewal",
        || async {
            let now = [
                agent_certs(&client, &n, &cp).await?,
                agent_certs(&client, &n, &sp).await?,
            ];
            Ok::<_, anyhow::Error>(if now.iter().zip(&before).all(|(a, b)| a.1 > b.1) {
                Check::Done(())
            } else {
                Check::NotYet(format!("failures before {before:?}, now {now:?}"))
            })
        },
    )
    .await?;
    let down_for = t_down.elapsed().as_secs();
    scale_operator(&client, remora, 2).await?;
    remora.wait_ready(&client, 2).await?;
    let mid = [
        agent_certs(&client, &n, &cp).await?,
        agent_certs(&client, &n, &sp).await?,
    ];
    wait_until(
        Duration::from_secs(180),
        "both sidecars to renew from the CA again",
        || async {
            let now = [
                agent_certs(&client, &n, &cp).await?,
                agent_certs(&client, &n, &sp).await?,
            ];
            Ok::<_, anyhow::Error>(if now.iter().zip(&mid).all(|(a, b)| a.0 > b.0) {
                Check::Done(())
            } else {
                Check::NotYet(format!("updates when back {mid:?}, now {now:?}"))
            })
        },
    )
    .await?;
    report(&format!(
        "  CA down: both sidecars failed a renewal within {down_for} s, renewed {} s after the CA was gone",
        t_down.elapsed().as_secs()
    ));
    let c = tls_counts(&envoy_stats(cip).await?, "cluster");
    let s = tls_counts(&envoy_stats(sip).await?, "listener");
    ensure!(
        c.errors == 0.0 && s.errors == 0.0,
        "TLS failures around the CA's outage: client {c:?}, server {s:?}"
    );

    // Stop the client and read its own count of calls.
    let lines = stop_and_log(&client, &n, "client", &cp).await?;
    let (ok, failed) = outbound_counts(&lines).context("the client app's count")?;
    let failures: Vec<&str> = lines
        .iter()
        .filter(|l| l.text.contains(" failed:"))
        .map(|l| l.text.as_str())
        .take(5)
        .collect();
    report(&format!(
        "  client calls through mTLS: {ok} ok, {failed} failed over {} s {failures:?}",
        t_rot.elapsed().as_secs()
    ));
    ensure!(failed == 0, "{failed} calls failed: {failures:?}");
    ensure!(ok >= 1000, "too few calls to mean anything: {ok}");

    // Outside the mesh: plain HTTP from the host straight to the server's
    // inbound, and a pod without a sidecar through the Service.
    let plain = pods::http_get(
        SocketAddr::new(pod_ip(&server)?, INBOUND_PORT),
        "/",
        Duration::from_secs(5),
    )
    .await;
    ensure!(
        plain.as_ref().map_or(true, |r| r.status() != 200),
        "a plain client got an answer: {:?}",
        plain.map(|r| r.status())
    );
    let mut outsider = deployment(
        "outsider",
        &[],
        &[
            "--port",
            &port,
            "--outbound-every",
            "200ms",
            "--outbound-url",
            &format!("http://{ip}:80/"),
        ],
    )?;
    outsider
        .spec
        .as_mut()
        .and_then(|s| s.template.metadata.as_mut())
        .and_then(|m| m.labels.as_mut())
        .context("labels")?
        .insert("remora.dev/inject".into(), "false".into());
    service_account(&ns, "outsider").await?;
    ns.api::<Deployment>()
        .create(&PostParams::default(), &outsider)
        .await?;
    let op = one_pod(&client, &n, "outsider").await?;
    ensure!(
        op.spec.as_ref().is_some_and(|s| s.containers.len() == 1),
        "the outsider was injected"
    );
    let opn = name(&op);
    wait_until(DEADLINE, "the outsider's refused calls", || async {
        let log = pods::container_log(&client, &n, &opn, "app", false).await?;
        let refused = log.iter().filter(|l| l.text.contains(" failed:")).count();
        Ok::<_, anyhow::Error>(if refused >= 5 {
            Check::Done(())
        } else {
            Check::NotYet(format!("{refused} refused so far"))
        })
    })
    .await?;
    let lines = stop_and_log(&client, &n, "outsider", &opn).await?;
    let (ok, failed) = outbound_counts(&lines).context("the outsider's count")?;
    report(&format!("  outside the mesh: {ok} ok, {failed} refused"));
    ensure!(ok == 0 && failed > 0, "the outsider got {ok} answers");
    ensure!(
        node.guard_drops().await? == 0,
        "the egress guard dropped packets"
    );
    ns.delete().await?;
    Ok(())
}

#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_mtls -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn the_ca_refuses_bad_input_and_says_why() -> anyhow::Result<()> {
    let node = Node::for_test("node_mtls bad input").await?;
    let client = node.client()?;
    let remora = install(node, &client).await?;
    let ns = TestNamespace::injected(node, &client, "ca-input").await?;
    let n = ns.name().to_string();
    service_account(&ns, "alice").await?;
    service_account(&ns, "bob").await?;
    let bundle = ca::wait_trust_bundle(&client, &n, DEADLINE).await?;
    let operators = Api::<Pod>::namespaced(client.clone(), &remora.namespace)
        .list(&ListParams::default().labels("app.kubernetes.io/name=remora-operator"))
        .await?;
    let operator = operators
        .items
        .iter()
        // Not one the install's rollout is taking away.
        .find(|p| node::is_ready(p) && p.metadata.deletion_timestamp.is_none())
        .context("no ready operator pod")?;
    let server_name = format!("{}.{}.svc", remora.operator(), remora.namespace);
    let ca = CaClient::connect(pod_ip(operator)?, &server_name, &bundle)?;
    let alice = spiffe(&n, "alice");
    let ttl = Duration::from_secs(120);
    let alice_token = ca::token(&client, &n, "alice", TOKEN_AUDIENCE, None).await?;

    // The good case first, so that a refusal below is not a broken setup.
    let chain = wait_until(
        DEADLINE,
        "the CA to issue alice's own certificate",
        || async {
            Ok::<_, anyhow::Error>(
                match ca.create(Some(&alice_token), ca::csr(&alice)?, ttl).await {
                    Ok(chain) => Check::Done(chain),
                    Err(s) => Check::NotYet(format!("{:?}: {}", s.code(), s.message())),
                },
            )
        },
    )
    .await?;
    ensure!(chain.len() == 2, "chain {chain:?}");

    let bob_token = ca::token(&client, &n, "bob", TOKEN_AUDIENCE, None).await?;
    let api_token = ca::token(&client, &n, "alice", "https://kubernetes.default.svc", None).await?;
    // A token bound to a pod that is gone: the API server no longer accepts it.
    let doomed: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "doomed", "labels": {"remora.dev/inject": "false"}},
        "spec": {"serviceAccountName": "alice", "containers": [node::test_app_container("app", &["--port", "8080"])]}
    }))?;
    let doomed = ns
        .api::<Pod>()
        .create(&PostParams::default(), &doomed)
        .await?;
    let stale_token = ca::token(&client, &n, "alice", TOKEN_AUDIENCE, Some(&doomed)).await?;
    ns.api::<Pod>()
        .delete("doomed", &DeleteParams::default().grace_period(0))
        .await?;
    wait_until(DEADLINE, "the pod to be gone", || async {
        Ok::<_, anyhow::Error>(match ns.api::<Pod>().get_opt("doomed").await? {
            None => Check::Done(()),
            Some(_) => Check::NotYet("still there".into()),
        })
    })
    .await?;
    // The API server checks a bound token's pod through its own cache,
    // which can lag the deletion a moment (a CI run saw the token still
    // accepted): wait until the API server refuses it itself, so that the
    // CA is judged on what the API server says.
    let reviews = Api::<TokenReview>::all(client.clone());
    wait_until(
        DEADLINE,
        "the API server to refuse the deleted pod's token",
        || async {
            let review: TokenReview = serde_json::from_value(serde_json::json!({
                "spec": {"token": stale_token, "audiences": [TOKEN_AUDIENCE]}
            }))?;
            let got = reviews.create(&PostParams::default(), &review).await?;
            Ok::<_, anyhow::Error>(match got.status.and_then(|s| s.authenticated) {
                Some(true) => Check::NotYet("still authenticated".into()),
                _ => Check::Done(()),
            })
        },
    )
    .await?;

    let cases: Vec<(&str, Option<&str>, String, tonic::Code)> = vec![
        (
            "no token",
            None,
            ca::csr(&alice)?,
            tonic::Code::Unauthenticated,
        ),
        (
            "garbage token",
            Some("not-a-jwt"),
            ca::csr(&alice)?,
            tonic::Code::Unauthenticated,
        ),
        (
            "the API server's audience",
            Some(&api_token),
            ca::csr(&alice)?,
            tonic::Code::Unauthenticated,
        ),
        (
            "a token of a deleted pod",
            Some(&stale_token),
            ca::csr(&alice)?,
            tonic::Code::Unauthenticated,
        ),
        (
            "bob's token for alice's identity",
            Some(&bob_token),
            ca::csr(&alice)?,
            tonic::Code::PermissionDenied,
        ),
        (
            "another trust domain",
            Some(&alice_token),
            ca::csr(&format!("spiffe://evil.example/ns/{n}/sa/alice"))?,
            tonic::Code::PermissionDenied,
        ),
        (
            "a garbage CSR",
            Some(&alice_token),
            "garbage".into(),
            tonic::Code::InvalidArgument,
        ),
        (
            "a huge CSR",
            Some(&alice_token),
            "A".repeat(40_000),
            tonic::Code::InvalidArgument,
        ),
    ];
    for (what, token, csr, code) in cases {
        match ca.create(token, csr, ttl).await {
            Ok(chain) => bail!("{what}: issued {} certificates", chain.len()),
            Err(s) => {
                report(&format!("  {what}: {:?}: {}", s.code(), s.message()));
                ensure!(
                    s.code() == code,
                    "{what}: {:?} {}, wanted {code:?}",
                    s.code(),
                    s.message()
                );
                ensure!(
                    token.is_none_or(|t| !s.message().contains(t)),
                    "{what}: the refusal echoes the token"
                );
            }
        }
    }
    // Bytes that are not TLS, and a TLS client that speaks no HTTP/2: the
    // CA closes them and still serves.
    let addr = SocketAddr::new(pod_ip(operator)?, remora_contract::workload_ca::PORT);
    for junk in [&b"GET / HTTP/1.1\r\n\r\n"[..], &[0u8; 512][..]] {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        tokio::io::AsyncWriteExt::write_all(&mut s, junk).await?;
        let mut buf = [0u8; 64];
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::io::AsyncReadExt::read(&mut s, &mut buf),
        )
        .await
        .context("the CA held a garbage connection open")?;
    }
    ca.create(Some(&alice_token), ca::csr(&alice)?, ttl)
        .await
        .context("the CA after the garbage")?;
    ns.delete().await?;
    Ok(())
}
