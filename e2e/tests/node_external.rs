//! Services outside the cluster on the real node: Remora installed with
//! its workload CA and discovery (as node_discovery), the chart's CRDs
//! applied (ExternalService, ExternalWorkload). The "external" service is
//! the test app in a namespace Remora does not inject (no sidecar, plain
//! HTTP on its pod IP, all on this machine); an ExternalService names it
//! `api.external.test`, and an injected caller's `remora.dev/outbound`
//! names that host. Shown:
//! - the caller's Envoy gets an EDS cluster for the host with the pod's
//!   address, and a real HTTP/1.1 keep-alive client reaches the external
//!   service through the caller's sidecar (every answer from it); the
//!   ExternalService reports Accepted and Resolved;
//! - the hijack rule: an ExternalService claiming another namespace's
//!   Service name is refused (Accepted False, HostNotOwned) and the caller
//!   naming that host gets no cluster of its endpoints;
//! - a NACK: the ExternalService's connectTimeout set to 0s (the CRD's
//!   duration grammar takes it, Envoy takes only more than 0s): the
//!   caller's Envoy refuses the clusters, keeps serving its previous
//!   configuration (calls still answered), a Warning Event on the caller's
//!   pod names Envoy's error, and the operator's NACK metric counts it.
//!
//! Runs with `REMORA_NODE_TESTS=1` (see `e2e::node`).

use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::node::port_forward::PortForward;
use e2e::node::workload_ca as ca;
use e2e::node::workloads::wait_deployment_rolled_out;
use e2e::node::{self, Check, Node, Remora, TestNamespace, pods, report};
use e2e::traffic::{Kind, Load, Sample, Traffic};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{
    ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Api, Client};
use remora_contract::annotations::OUTBOUND;
use remora_contract::discovery::cluster_name;
use remora_contract::pod::ENVOY_ADMIN_PORT;
use remora_test_support::wait::wait_until;
use serde_json::{Value, json};
use tokio::time::Instant;

const DEADLINE: Duration = Duration::from_secs(120);
const VALUES: [&str; 2] = ["workloadCA.enabled=true", "discovery.enabled=true"];
const HOST: &str = "api.external.test";
const PORT: u16 = 80;
const APP_PORT: u16 = 8080;
const OUTBOUND_PORT: u16 = 15001;
const HIJACK_PORT: u16 = 15002;
const ANSWERS: usize = 60;

async fn install(node: &Node, client: &Client) -> anyhow::Result<&'static Remora> {
    static INSTALLED: tokio::sync::OnceCell<Remora> = tokio::sync::OnceCell::const_new();
    let values: Vec<String> = VALUES.iter().map(|s| s.to_string()).collect();
    INSTALLED
        .get_or_try_init(|| async {
            // The CRDs first: helm applies a chart's CRDs on first install
            // only, and the operator watches them if they are served when
            // it starts.
            e2e::chart::install_crds(client).await?;
            let remora = node
                .install_remora(client, node::RELEASE_NAMESPACE, &values)
                .await?;
            restart_operator(client, &remora).await?;
            Ok::<_, anyhow::Error>(remora)
        })
        .await
}

/// A rolling restart of the operator (an install that changed nothing
/// restarts nothing), waited for.
async fn restart_operator(client: &Client, remora: &Remora) -> anyhow::Result<()> {
    let api = Api::<Deployment>::namespaced(client.clone(), &remora.namespace);
    let at = k8s_openapi::jiff::Timestamp::now().to_string();
    api.patch(
        &remora.operator(),
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"template": {"metadata": {"annotations": {
            "remora.dev/e2e-restarted-at": at
        }}}}})),
    )
    .await?;
    wait_deployment_rolled_out(client, &remora.namespace, &remora.operator(), DEADLINE).await?;
    Ok(())
}

fn external_services(client: &Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("remora.dev", "v1alpha1", "ExternalService");
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

fn external_service(name: &str, spec: Value) -> anyhow::Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "remora.dev/v1alpha1",
        "kind": "ExternalService",
        "metadata": {"name": name},
        "spec": spec,
    }))?)
}

/// Waits until ExternalService `name`'s condition `type_` has `status` and
/// `reason` for its current generation; returns its message.
async fn wait_condition(
    api: &Api<DynamicObject>,
    name: &str,
    type_: &str,
    status: &str,
    reason: &str,
) -> anyhow::Result<String> {
    wait_until(
        DEADLINE,
        &format!("ExternalService {name}: {type_}={status} ({reason})"),
        || async {
            let o = api.get(name).await?;
            let generation = o.metadata.generation;
            let status_v = &o.data["status"];
            let c = status_v["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == type_);
            Ok::<_, anyhow::Error>(match c {
                Some(c)
                    if c["status"] == status
                        && c["reason"] == reason
                        && status_v["observedGeneration"].as_i64() == generation =>
                {
                    Check::Done(c["message"].as_str().unwrap_or_default().to_owned())
                }
                _ => Check::NotYet(format!("status {status_v}")),
            })
        },
    )
    .await
}

/// The caller's Envoy's `/clusters` text.
async fn envoy_clusters(client: &Client, ns: &str, pod: &str) -> anyhow::Result<String> {
    let (_, clusters) = node::pod_http_get(client, ns, pod, ENVOY_ADMIN_PORT, "/clusters").await?;
    Ok(clusters)
}

/// An HTTP/1.1 keep-alive client (no retries) through the caller's
/// listener until it has [`ANSWERS`] samples.
async fn calls(client: &Client, ns: &str, pod: &str) -> anyhow::Result<Vec<Sample>> {
    let forward = PortForward::start(client, ns, pod, OUTBOUND_PORT).await?;
    let load = Load::new(Kind::Http1KeepAlive, forward.local_addr(), 20.0);
    let traffic = Traffic::start(vec![load], Instant::now());
    let waited = wait_until(DEADLINE, &format!("{ANSWERS} answers"), || {
        let got = traffic.samples().len();
        async move {
            Ok::<_, anyhow::Error>(if got >= ANSWERS {
                Check::Done(())
            } else {
                Check::NotYet(format!("{got}/{ANSWERS}"))
            })
        }
    })
    .await;
    let samples = traffic.stop().await;
    waited?;
    Ok(samples)
}

/// Every sample answered, and by `backend`.
fn all_from(samples: &[Sample], backend: &str) -> anyhow::Result<()> {
    let bad: Vec<&Sample> = samples
        .iter()
        .filter(|s| !s.outcome.is_ok() || s.pod.as_deref() != Some(backend))
        .collect();
    ensure!(
        bad.is_empty(),
        "{} of {} calls failed or came from elsewhere than {backend}; first: {:?}",
        bad.len(),
        samples.len(),
        bad.iter().take(3).collect::<Vec<_>>()
    );
    Ok(())
}

/// The operator replicas' NACK counts of type `ty`, summed (each read
/// through the API server's proxy to its metrics).
async fn operator_nacks(client: &Client, remora: &Remora, ty: &str) -> anyhow::Result<u64> {
    let needle = format!("remora_operator_xds_nacks_total{{type=\"{ty}\"}} ");
    let mut total = 0;
    for p in remora.operator_pods(client).await? {
        // The webhook server's port (named `https`), by number: the API
        // server's proxy did not take the name.
        let port = p
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .find(|cp| cp.name.as_deref() == Some("https"))
            .map(|cp| cp.container_port);
        let (Some(name), Some(port)) = (p.metadata.name, port) else {
            continue;
        };
        let path = format!(
            "/api/v1/namespaces/{}/pods/https:{name}:{port}/proxy/metrics",
            remora.namespace
        );
        let req = http::Request::get(path).body(Vec::new())?;
        let Ok(text) = client.request_text(req).await else {
            continue;
        };
        total += text
            .lines()
            .filter_map(|l| l.strip_prefix(&needle))
            .filter_map(|v| v.trim().parse::<f64>().ok())
            .map(|v| v as u64)
            .sum::<u64>();
    }
    Ok(total)
}

#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_external -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn an_external_service_is_reached_by_its_host_and_a_nacked_change_keeps_the_last_config()
-> anyhow::Result<()> {
    let node = Node::for_test("node_external").await?;
    let t0 = Instant::now();
    let client = node.client()?;
    let remora = install(node, &client).await?;
    report(&format!(
        "  Remora (CRDs, discovery) ready after {} ms",
        t0.elapsed().as_millis()
    ));

    // The external service: the test app where Remora injects nothing.
    let outside = TestNamespace::create(node, &client, "outside", &[]).await?;
    let port = APP_PORT.to_string();
    outside
        .api::<Deployment>()
        .create(
            &PostParams::default(),
            &pods::test_app_deployment("api", 1, &[], &["--port", &port])?,
        )
        .await?;
    let backend: Pod = wait_deployment_rolled_out(&client, outside.name(), "api", DEADLINE)
        .await?
        .into_iter()
        .next()
        .context("no pod of the external service")?;
    let backend_name = backend.metadata.name.clone().unwrap_or_default();
    let backend_ip = backend
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("the external service's pod has no IP")?;

    let ns = TestNamespace::injected(node, &client, "external").await?;
    let n = ns.name().to_string();
    node::wait_injected(&client, &n, DEADLINE).await?;
    ca::wait_trust_bundle(&client, &n, DEADLINE).await?;
    let services = external_services(&client, &n);
    services
        .create(
            &PostParams::default(),
            &external_service(
                "api",
                json!({
                    "hosts": [HOST],
                    "ports": [{"number": PORT, "name": "http", "protocol": "HTTP"}],
                    "endpoints": [{"address": backend_ip, "ports": {"http": APP_PORT}}],
                }),
            )?,
        )
        .await?;
    // The attack: this namespace claims a Service name of `outside`.
    let hijacked = format!("api.{}", outside.name());
    services
        .create(
            &PostParams::default(),
            &external_service(
                "hijack",
                json!({
                    "hosts": [hijacked],
                    "ports": [{"number": PORT, "name": "http", "protocol": "HTTP"}],
                    "endpoints": [{"address": "127.0.0.1", "ports": {"http": APP_PORT}}],
                }),
            )?,
        )
        .await?;
    let outbound = format!("{OUTBOUND_PORT}:{HOST}:{PORT},{HIJACK_PORT}:{hijacked}:{PORT}");
    ns.api::<Deployment>()
        .create(
            &PostParams::default(),
            &pods::test_app_deployment("caller", 1, &[(OUTBOUND, &outbound)], &["--port", &port])?,
        )
        .await?;
    let caller = wait_deployment_rolled_out(&client, &n, "caller", DEADLINE)
        .await?
        .into_iter()
        .next()
        .context("no pod of the caller")?;
    let cp = caller.metadata.name.clone().unwrap_or_default();

    let cluster = cluster_name(HOST, PORT);
    let want = format!("{cluster}::{backend_ip}:{APP_PORT}::health_flags::healthy");
    wait_until(
        DEADLINE,
        "the caller's Envoy to hold the external host",
        || async {
            let c = envoy_clusters(&client, &n, &cp)
                .await
                .map_err(|e| node::Error::Failed {
                    what: "reading the caller's Envoy clusters".into(),
                    detail: format!("{e:#}"),
                })?;
            Ok::<_, anyhow::Error>(if c.contains(&want) {
                Check::Done(())
            } else {
                Check::NotYet(format!("no {want}"))
            })
        },
    )
    .await?;
    report(&format!(
        "  {cp}'s Envoy: {cluster} → {backend_ip}:{APP_PORT} after {} ms",
        t0.elapsed().as_millis()
    ));
    let samples = calls(&client, &n, &cp).await?;
    all_from(&samples, &backend_name)?;
    report(&format!(
        "  {} calls to {HOST}:{PORT} through the sidecar, all answered by {backend_name}",
        samples.len()
    ));
    let m = wait_condition(&services, "api", "Resolved", "True", "EndpointsFound").await?;
    wait_condition(&services, "api", "Accepted", "True", "Accepted").await?;
    report(&format!("  ExternalService api: Accepted, Resolved ({m})"));

    // The hijack refused: status says why, and the caller has no cluster
    // of its endpoints (the host stays a static upstream).
    let why = wait_condition(&services, "hijack", "Accepted", "False", "HostNotOwned").await?;
    let clusters = envoy_clusters(&client, &n, &cp).await?;
    ensure!(
        !clusters.contains(&cluster_name(&hijacked, PORT)),
        "the caller got a cluster for the hijacked host {hijacked}"
    );
    report(&format!("  hijack of {hijacked} refused: {why}"));

    // The NACK: a connect timeout of 0s.
    let nacks_before = operator_nacks(&client, remora, "cds").await?;
    let t_nack = Instant::now();
    services
        .patch(
            "api",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"connectTimeout": "0s"}})),
        )
        .await?;
    let events: Api<Event> = Api::namespaced(client.clone(), &n);
    let by_pod = format!("involvedObject.name={cp}");
    let note = wait_until(
        DEADLINE,
        "a ConfigurationRefused Warning on the caller's pod",
        || async {
            let list = events
                .list(&ListParams::default().fields(&by_pod))
                .await?
                .items;
            Ok::<_, anyhow::Error>(
                match list.iter().find(|e| {
                    e.reason.as_deref() == Some("ConfigurationRefused")
                        && e.type_.as_deref() == Some("Warning")
                }) {
                    Some(e) => Check::Done(e.message.clone().unwrap_or_default()),
                    None => Check::NotYet(format!("{} events", list.len())),
                },
            )
        },
    )
    .await?;
    ensure!(
        note.contains("ConnectTimeout"),
        "the Warning does not name Envoy's error: {note}"
    );
    report(&format!(
        "  NACK → Warning on {cp} after {} ms: {}",
        t_nack.elapsed().as_millis(),
        note.lines().next().unwrap_or_default()
    ));
    let nacks = wait_until(DEADLINE, "the operator's NACK metric", || async {
        let n = operator_nacks(&client, remora, "cds")
            .await
            .map_err(|e| node::Error::Failed {
                what: "reading the operators' metrics".into(),
                detail: format!("{e:#}"),
            })?;
        Ok::<_, anyhow::Error>(if n > nacks_before {
            Check::Done(n)
        } else {
            Check::NotYet(format!("{n} (before: {nacks_before})"))
        })
    })
    .await?;
    // Still served from the previous configuration.
    let samples = calls(&client, &n, &cp).await?;
    all_from(&samples, &backend_name)?;
    report(&format!(
        "  after the NACK: {} calls all answered by {backend_name}; remora_operator_xds_nacks_total{{type=\"cds\"}} {nacks_before} → {nacks}",
        samples.len()
    ));
    ns.delete().await?;
    outside.delete().await?;
    report(&format!(
        "  node_external: {} ms in all",
        t0.elapsed().as_millis()
    ));
    assert_eq!(
        node.guard_drops().await?,
        0,
        "the egress guard dropped packets: something left the machine"
    );
    Ok(())
}
