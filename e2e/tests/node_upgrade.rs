//! The chart's mesh defaults on the real node: `workloadCA.enabled` and
//! `discovery.enabled` are "auto", on for a new install and kept from the
//! running operator on `helm upgrade`. A release installed as before (both
//! off) with an injected Deployment serving through its Service is upgraded
//! with the chart's defaults: the operator still runs without the CA and
//! discovery, no pod is restarted, a pod injected now gets the restart hash
//! the running ones have (so no rollout is asked for), and the Service
//! still answers. Then a fresh install with the chart's defaults: the
//! operator serves the CA and discovery, a pod injected now is wired to
//! both, and the Deployment restarted under them serves its callers
//! (without a sidecar: the permissive inbound) through the Service.
//!
//! One test, as node_install: it uninstalls and reinstalls the one shared
//! release, and leaves it installed as the other node tests install it.
//! Runs with `REMORA_NODE_TESTS=1` (see `e2e::node`); timings are printed,
//! not asserted.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use e2e::node::workloads::{sidecar_status, wait_deployment_rolled_out};
use e2e::node::{self, Node, RELEASE_NAMESPACE, Remora, TestNamespace, pods, report};
use e2e::webhook::sidecar;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use remora_contract::annotations::{INBOUND, MODE};
use remora_contract::env::{CA_ADDRESS, DISCOVERY_ADDRESS};
use remora_contract::pod::INBOUND_PORT;
use remora_test_support::wait::wait_until;

const APP: &str = "web";
const APP_PORT: u16 = 8080;
const DEADLINE: Duration = Duration::from_secs(120);

/// The chart's values before the defaults became "auto": both off.
fn old_defaults() -> Vec<String> {
    vec![
        "workloadCA.enabled=false".to_owned(),
        "discovery.enabled=false".to_owned(),
    ]
}

/// (workload CA, discovery) as the operator Deployment runs them.
async fn operator_mesh(client: &Client, remora: &Remora) -> anyhow::Result<(bool, bool)> {
    let deploy = Api::<Deployment>::namespaced(client.clone(), &remora.namespace)
        .get(&remora.operator())
        .await?;
    let env: BTreeMap<String, String> = deploy
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers)
        .unwrap_or_default()
        .into_iter()
        .flat_map(|c| c.env.unwrap_or_default())
        .filter_map(|e| Some((e.name, e.value?)))
        .collect();
    let on = |k: &str| env.get(k).is_some_and(|v| v == "true");
    Ok((on("REMORA_WORKLOAD_CA"), on("REMORA_DISCOVERY")))
}

/// The test app's pod template, as the Deployment has it.
fn deployment() -> anyhow::Result<Deployment> {
    let inbound = format!("{INBOUND_PORT}:{APP_PORT}");
    let port = APP_PORT.to_string();
    Ok(pods::test_app_deployment(
        APP,
        2,
        &[(MODE, "Legacy"), (INBOUND, &inbound)],
        &["--port", &port],
    )?)
}

/// A pod of the Deployment's template admitted now (dry run): what the
/// webhook injects into the next pod of that workload.
async fn injected_now(client: &Client, ns: &str) -> anyhow::Result<Pod> {
    let template = deployment()?.spec.context("no spec")?.template;
    let pod = Pod {
        metadata: kube::api::ObjectMeta {
            name: Some("probe".to_owned()),
            ..template.metadata.unwrap_or_default()
        },
        spec: template.spec,
        ..Pod::default()
    };
    let (injected, _) = node::wait_injected(client, ns, DEADLINE).await?;
    ensure!(sidecar(&injected).is_some(), "the webhook does not inject");
    Ok(node::dry_run_create(client, ns, &pod).await?)
}

fn restart_hash(pod: &Pod) -> anyhow::Result<String> {
    sidecar_status(pod)
        .and_then(|s| s.restart_hash)
        .with_context(|| format!("{:?}: no restart hash", pod.metadata.name))
}

fn sidecar_env(pod: &Pod) -> BTreeMap<String, String> {
    sidecar(pod)
        .map(|(_, c)| c.env.clone().unwrap_or_default())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|e| Some((e.name, e.value?)))
        .collect()
}

/// (uid, restarts of every container) of each running pod of the app.
async fn pod_lives(client: &Client, ns: &str) -> anyhow::Result<BTreeMap<String, i32>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let list = pods
        .list(&kube::api::ListParams::default().labels(&format!("app={APP}")))
        .await?;
    Ok(list
        .items
        .into_iter()
        .map(|p| {
            let restarts = p
                .status
                .as_ref()
                .into_iter()
                .flat_map(|s| {
                    s.container_statuses
                        .iter()
                        .flatten()
                        .chain(s.init_container_statuses.iter().flatten())
                })
                .map(|c| c.restart_count)
                .sum();
            (p.metadata.uid.unwrap_or_default(), restarts)
        })
        .collect())
}

/// `n` GETs through the Service's ClusterIP from the host (no sidecar on
/// this side), each on a fresh connection; all must answer 200.
async fn served(addr: SocketAddr, n: usize) -> anyhow::Result<()> {
    for i in 0..n {
        let r = pods::http_get(addr, "/", Duration::from_secs(10))
            .await
            .with_context(|| format!("GET {i} of {n} through {addr}"))?;
        ensure!(
            r.status() == http::StatusCode::OK,
            "GET {i} of {n} through {addr}: {}",
            r.status()
        );
    }
    Ok(())
}

#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_upgrade -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn upgrade_keeps_the_mesh_off_and_a_new_install_turns_it_on() -> anyhow::Result<()> {
    let node = Node::for_test("node_upgrade").await?;
    let client = node.client()?;
    let total = Instant::now();
    let drops_before = node.guard_drops().await?;

    // 1. An install as the chart made it before "auto": both off.
    let remora = node.remora_release(RELEASE_NAMESPACE);
    remora.uninstall(&client).await?;
    let t = Instant::now();
    let remora = node
        .install_remora_with(&client, RELEASE_NAMESPACE, &old_defaults())
        .await?;
    remora.wait_ready(&client, 2).await?;
    ensure!(
        operator_mesh(&client, &remora).await? == (false, false),
        "installed with both off, the operator runs {:?}",
        operator_mesh(&client, &remora).await?
    );
    report(&format!(
        "1. installed with workloadCA and discovery off in {} ms",
        t.elapsed().as_millis()
    ));

    let ns = TestNamespace::injected(node, &client, "upgrade").await?;
    node::wait_injected(&client, ns.name(), DEADLINE).await?;
    ns.api::<Deployment>()
        .create(&PostParams::default(), &deployment()?)
        .await?;
    let svc = ns
        .api::<Service>()
        .create(
            &PostParams::default(),
            &pods::test_app_service(APP, 80, INBOUND_PORT)?,
        )
        .await?;
    let running = wait_deployment_rolled_out(&client, ns.name(), APP, DEADLINE).await?;
    pods::wait_service_endpoints(&client, ns.name(), APP, 2, DEADLINE).await?;
    let ip: IpAddr = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .context("Service has no ClusterIP")?
        .parse()?;
    // Nothing goes to the ClusterIP before kube-proxy knows it (the egress
    // guard would count it).
    pods::wait_kube_proxy(ip, 80, DEADLINE).await?;
    let addr = SocketAddr::new(ip, 80);
    served(addr, 10).await?;
    let hashes: Vec<String> = running.iter().map(restart_hash).collect::<Result<_, _>>()?;
    let hash = hashes.first().context("no pod")?.clone();
    ensure!(hashes.iter().all(|h| *h == hash), "{hashes:?}");
    ensure!(
        restart_hash(&injected_now(&client, ns.name()).await?)? == hash,
        "before the upgrade, a new pod's restart hash already differs"
    );
    let lives = pod_lives(&client, ns.name()).await?;
    ensure!(lives.len() == 2, "{lives:?}");
    report(&format!(
        "1. Deployment {}/{APP} (2 replicas, no CA) serving through {addr}, restart hash {hash}",
        ns.name()
    ));

    // 2. helm upgrade with this chart's defaults: what ran is kept.
    let t = Instant::now();
    let before = remora.ready_operators(&client).await?;
    // A pod annotation rolls the operator, as a chart upgrade with a new
    // image would: the new pods must come up with the same settings.
    let roll = format!(
        "operator.podAnnotations.e2e-upgrade=t{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs()
    );
    remora.upgrade_with(&client, &[roll]).await?;
    let after = remora.wait_ready(&client, 2).await?;
    ensure!(
        after.iter().all(|p| !before.contains(p)),
        "the operator was not rolled: before {before:?}, after {after:?}"
    );
    let mesh = operator_mesh(&client, &remora).await?;
    ensure!(
        mesh == (false, false),
        "helm upgrade with the defaults turned on (CA, discovery) = {mesh:?}"
    );
    let probe = injected_now(&client, ns.name()).await?;
    let env = sidecar_env(&probe);
    ensure!(
        !env.contains_key(CA_ADDRESS) && !env.contains_key(DISCOVERY_ADDRESS),
        "a pod injected after the upgrade is wired to the CA or discovery: {env:?}"
    );
    let now = restart_hash(&probe)?;
    ensure!(
        now == hash,
        "after the upgrade a new pod's restart hash is {now}, the running pods' {hash}: every injected pod would be asked to restart"
    );
    served(addr, 10).await?;
    let lives_after = pod_lives(&client, ns.name()).await?;
    ensure!(
        lives_after == lives,
        "pods restarted or replaced by the upgrade: before {lives:?}, after {lives_after:?}"
    );
    report(&format!(
        "2. helm upgrade with the chart's defaults: {} ms; the operator still runs without the CA and discovery, a new pod's restart hash unchanged, the same 2 pods with 0 restarts serve 10 of 10 GETs",
        t.elapsed().as_millis()
    ));

    // 3. A new install with the chart's defaults: both on.
    let t = Instant::now();
    remora.uninstall(&client).await?;
    let remora = node
        .install_remora_with(&client, RELEASE_NAMESPACE, &[])
        .await?;
    remora.wait_ready(&client, 2).await?;
    let mesh = operator_mesh(&client, &remora).await?;
    ensure!(
        mesh == (true, true),
        "a new install with the defaults runs (CA, discovery) = {mesh:?}"
    );
    let probe = injected_now(&client, ns.name()).await?;
    let env = sidecar_env(&probe);
    ensure!(
        env.contains_key(CA_ADDRESS) && env.contains_key(DISCOVERY_ADDRESS),
        "a pod injected after a new install is not wired to both: {env:?}"
    );
    ensure!(restart_hash(&probe)? != hash);
    report(&format!(
        "3. new install with the chart's defaults in {} ms: CA and discovery on, new pods wired to both",
        t.elapsed().as_millis()
    ));

    // The workload restarted under them: ready (its certificate served,
    // its listeners from discovery) and reached by callers without a
    // sidecar through the permissive inbound.
    let t = Instant::now();
    let restart = serde_json::json!({"spec": {"template": {"metadata": {"annotations": {
        "e2e/restarted": format!("{:?}", std::time::SystemTime::now())}}}}});
    ns.api::<Deployment>()
        .patch(APP, &PatchParams::default(), &Patch::Merge(&restart))
        .await?;
    let meshed = wait_deployment_rolled_out(&client, ns.name(), APP, DEADLINE).await?;
    let wired = meshed
        .iter()
        .filter(|p| {
            let env = sidecar_env(p);
            env.contains_key(CA_ADDRESS) && env.contains_key(DISCOVERY_ADDRESS)
        })
        .count();
    ensure!(
        meshed.len() == 2 && wired == 2,
        "{} pods running, {wired} wired to the CA and discovery",
        meshed.len()
    );
    pods::wait_service_endpoints(&client, ns.name(), APP, 2, DEADLINE).await?;
    // kube-proxy may still hold the old endpoints a moment; then every GET
    // must answer.
    wait_until(
        DEADLINE,
        "the meshed pods serve through the Service",
        || async {
            Ok::<_, anyhow::Error>(match served(addr, 10).await {
                Ok(()) => node::Check::Done(()),
                Err(e) => node::Check::NotYet(e.to_string()),
            })
        },
    )
    .await?;
    report(&format!(
        "3. the Deployment restarted onto 2 meshed pods (Ready: certificate served, listeners from discovery) in {} ms; 10 of 10 GETs from the host (no sidecar) answered through the permissive inbound",
        t.elapsed().as_millis()
    ));
    ns.delete().await?;

    // 4. Left installed as the other node tests install it.
    node.install_remora(&client, RELEASE_NAMESPACE, &[]).await?;
    let drops = node.guard_drops().await?;
    ensure!(
        drops == drops_before,
        "the egress guard dropped {} packets",
        drops - drops_before
    );
    report(&format!(
        "4. release back to the node tests' values; egress guard untouched; whole test {} ms",
        total.elapsed().as_millis()
    ));
    Ok(())
}
