//! Remora installed by helm on the real node, as a user installs it:
//! `helm install` (two operator replicas, the leader elected, the API server
//! calling the webhook through the Service with the self-managed
//! certificate), `helm upgrade` (the caBundle kept, no pod refused during
//! the rollout), the leader pod deleted (leadership moves), `helm
//! uninstall` (no webhook left to block pods), and a reinstall.
//!
//! One test: every node test shares the one release in `remora-system`, so
//! what changes it runs in sequence here, and leaves it installed for the
//! other node test binaries. Runs with `REMORA_NODE_TESTS=1` (see
//! `e2e::node`); timings are printed, not asserted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use e2e::node::{
    self, INJECT_LABEL, Node, PROXY_IMAGE, RELEASE_NAMESPACE, Remora, TestNamespace, report,
};
use e2e::webhook::sidecar;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use remora_test_support::wait::wait_until;

/// Leadership after the leader's pod is deleted: its preStop sleep (5 s),
/// the Lease release on SIGTERM, the standby's next try (retryPeriod 2 s);
/// a crashed leader would take leaseDuration (15 s) more.
const FAILOVER_DEADLINE: Duration = Duration::from_secs(60);
const DEADLINE: Duration = Duration::from_secs(60);

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// Both webhooks carry the same non-empty caBundle, and it is the CA in the
/// operator's Secret (the one its serving certificate is signed by).
async fn wait_ca_bundle(client: &Client, remora: &Remora) -> anyhow::Result<Vec<u8>> {
    let bundle = wait_until(DEADLINE, "caBundle patched into both webhooks", || async {
        let bundles = remora.ca_bundles(client).await?.unwrap_or_default();
        let ca = remora.secret_ca(client).await?.unwrap_or_default();
        Ok::<_, anyhow::Error>(
            if bundles.len() == 2 && !ca.is_empty() && bundles.iter().all(|b| *b == ca) {
                node::Check::Done(ca)
            } else {
                node::Check::NotYet(format!(
                    "{} webhooks, caBundle lengths {:?}, Secret ca.crt {} bytes",
                    bundles.len(),
                    bundles.iter().map(Vec::len).collect::<Vec<_>>(),
                    ca.len()
                ))
            },
        )
    })
    .await?;
    ensure!(
        String::from_utf8_lossy(&bundle).starts_with("-----BEGIN CERTIFICATE-----"),
        "caBundle is not a PEM certificate"
    );
    Ok(bundle)
}

/// The sidecar the webhook put into `pod` is the locally built agent image.
fn check_injected(pod: &Pod) -> anyhow::Result<()> {
    let (place, c) = sidecar(pod).context("no remora-proxy container")?;
    let want = format!("{PROXY_IMAGE}:{}", node::image_tag());
    ensure!(
        c.image.as_deref() == Some(want.as_str()),
        "sidecar image {:?}, want {want}",
        c.image
    );
    ensure!(c.image_pull_policy.as_deref() == Some("Never"));
    ensure!(
        pod.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key("remora.dev/status")),
        "no remora.dev/status annotation"
    );
    report(&format!("  sidecar in {place}, image {want}"));
    Ok(())
}

/// Dry-run pod creates in `ns` every 200 ms until `stop`: (attempts,
/// refused or not injected, first problem).
fn admission_probe(
    client: Client,
    ns: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(usize, usize, Option<String>)> {
    tokio::spawn(async move {
        let mut bad = 0;
        let mut first = None;
        let mut n = 0;
        let probe = node::pause_pod("upgrade-probe");
        while !stop.load(Ordering::Relaxed) {
            n += 1;
            let problem = match node::dry_run_create(&client, &ns, &probe).await {
                Ok(p) if sidecar(&p).is_some() => None,
                Ok(_) => Some("admitted without a sidecar".to_owned()),
                Err(e) => Some(e.to_string()),
            };
            if let Some(p) = problem {
                bad += 1;
                first.get_or_insert(p);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        (n, bad, first)
    })
}

#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_install -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn helm_install_upgrade_failover_uninstall() -> anyhow::Result<()> {
    let node = Node::for_test("node_install").await?;
    let client = node.client()?;
    let total = Instant::now();

    // 1. helm install.
    let t = Instant::now();
    let remora = node.install_remora(&client, RELEASE_NAMESPACE, &[]).await?;
    let helm_took = t.elapsed();
    let replicas = remora.wait_ready(&client, 2).await?;
    report(&format!(
        "1. helm upgrade --install: {} ms (helm --wait {} ms), Ready: {replicas:?}",
        ms(t.elapsed()),
        ms(helm_took)
    ));
    let leader = remora.wait_leader(&client, None, DEADLINE).await?;
    ensure!(
        replicas.contains(&leader),
        "leader {leader} is not a replica"
    );
    report(&format!("1. leader Lease {}: {leader}", remora.operator()));
    let ca = wait_ca_bundle(&client, &remora).await?;
    report(&format!(
        "1. caBundle set on both webhooks ({} bytes, = Secret ca.crt)",
        ca.len()
    ));

    let injected = TestNamespace::injected(node, &client, "install").await?;
    let plain = TestNamespace::create(node, &client, "install-plain", &[]).await?;
    let (pod, took) = node::wait_injected(&client, injected.name(), DEADLINE).await?;
    check_injected(&pod)?;
    report(&format!(
        "1. the API server called the webhook through Service {}/{}: pod injected ({} ms)",
        remora.namespace,
        remora.operator(),
        ms(took)
    ));
    let uninjected = node::dry_run_create(&client, plain.name(), &node::pause_pod("p")).await?;
    ensure!(
        sidecar(&uninjected).is_none(),
        "a pod in an unlabelled namespace got a sidecar"
    );

    // 2. helm upgrade, with a pod annotation that rolls the operator; pods
    // keep being admitted (and injected) throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let probe = admission_probe(client.clone(), injected.name().to_owned(), stop.clone());
    let t = Instant::now();
    let rollout = format!(
        "operator.podAnnotations.e2e-rollout=t{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs()
    );
    let helm_took = remora.upgrade(&client, &[rollout]).await?;
    let upgraded = remora.wait_ready(&client, 2).await?;
    stop.store(true, Ordering::Relaxed);
    let (attempts, bad, first) = probe.await?;
    ensure!(
        upgraded.iter().all(|p| !replicas.contains(p)),
        "helm upgrade did not replace the operator pods: before {replicas:?}, after {upgraded:?}"
    );
    report(&format!(
        "2. helm upgrade rolled the operator in {} ms (helm --wait {} ms, then the old pods gone): {upgraded:?}; {attempts} pod admissions during it, {bad} refused or uninjected",
        ms(t.elapsed()),
        ms(helm_took)
    ));
    ensure!(
        bad == 0,
        "{bad} of {attempts} admissions failed during helm upgrade; first: {first:?}"
    );
    let after = wait_ca_bundle(&client, &remora).await?;
    ensure!(after == ca, "helm upgrade changed the caBundle");
    let (pod, _) = node::wait_injected(&client, injected.name(), DEADLINE).await?;
    check_injected(&pod)?;
    report("2. caBundle unchanged, webhook still injects");

    // 3. Delete the leader's pod: the other replica takes the Lease.
    let leader = remora.wait_leader(&client, None, DEADLINE).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &remora.namespace);
    let t = Instant::now();
    pods.delete(&leader, &DeleteParams::default()).await?;
    let next = remora
        .wait_leader(&client, Some(&leader), FAILOVER_DEADLINE)
        .await?;
    let failover = t.elapsed();
    ensure!(next != leader);
    report(&format!(
        "3. deleted leader {leader}: {next} holds the Lease after {} ms",
        ms(failover)
    ));
    let replaced = remora.wait_ready(&client, 2).await?;
    ensure!(!replaced.contains(&leader));

    // 4. helm uninstall: no webhook configuration of Remora is left, and a
    // pod in a labelled namespace is admitted, without a sidecar.
    let t = Instant::now();
    remora.uninstall(&client).await?;
    report(&format!("4. helm uninstall: {} ms", ms(t.elapsed())));
    let left: Vec<String> = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .list(&ListParams::default().labels("app.kubernetes.io/part-of=remora"))
        .await?
        .items
        .into_iter()
        .filter_map(|m| m.metadata.name)
        .collect();
    ensure!(left.is_empty(), "webhook configurations left: {left:?}");
    ensure!(remora.webhook_config(&client).await?.is_none());
    // The API server drops a deleted webhook configuration asynchronously.
    let t = Instant::now();
    let probe = node::pause_pod("after-uninstall");
    wait_until(DEADLINE, "a pod admitted after helm uninstall", || async {
        Ok::<_, anyhow::Error>(
            match node::dry_run_create(&client, injected.name(), &probe).await {
                Ok(p) => node::Check::Done(p),
                Err(kube::Error::Api(s)) => node::Check::NotYet(s.message),
                Err(e) => return Err(e.into()),
            },
        )
    })
    .await?;
    let admitted_after = t.elapsed();
    let created = injected
        .api::<Pod>()
        .create(&PostParams::default(), &probe)
        .await
        .context("creating a pod in a labelled namespace after helm uninstall")?;
    ensure!(
        sidecar(&created).is_none(),
        "a pod created after helm uninstall got a sidecar"
    );
    report(&format!(
        "4. no Remora webhook left; a pod in namespace {} (label {}={}) created uninjected ({} ms after uninstall)",
        injected.name(),
        INJECT_LABEL.0,
        INJECT_LABEL.1,
        ms(admitted_after)
    ));

    // 5. Reinstall for the other node tests; the node kept its traffic in.
    let t = Instant::now();
    let remora = node.install_remora(&client, RELEASE_NAMESPACE, &[]).await?;
    remora.wait_ready(&client, 2).await?;
    remora.wait_leader(&client, None, DEADLINE).await?;
    wait_ca_bundle(&client, &remora).await?;
    let (pod, _) = node::wait_injected(&client, injected.name(), DEADLINE).await?;
    check_injected(&pod)?;
    report(&format!(
        "5. reinstalled in {} ms, injecting",
        ms(t.elapsed())
    ));

    injected.delete().await?;
    plain.delete().await?;
    let drops = node.guard_drops().await?;
    ensure!(drops == 0, "the egress guard dropped {drops} packets");
    report(&format!(
        "5. egress guard dropped 0 packets; whole test {} ms",
        ms(total.elapsed())
    ));
    Ok(())
}
