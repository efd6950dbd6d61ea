//! The self-managed serving certificate is renewed from the stored CA while
//! the API server keeps calling: two operator replicas share one Secret,
//! the webhook configuration sends every pod creation through both, and
//! the serving certificate lives 30 s (renewed at 20 s), so the run sees
//! two renewals. No pod creation may be refused.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::controlplane::ControlPlane;
use e2e::webhook::{SelfManagedPair, every_ca_bundle_is, label_namespace, pod};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::Api;
use kube::api::PostParams;
use remora_test_support::wait::wait_until;

const DEADLINE: Duration = Duration::from_secs(60);
const SECRET: &str = "renewal-tls";

fn data(s: &Secret, key: &str) -> Option<ByteString> {
    s.data.as_ref()?.get(key).cloned()
}

#[tokio::test]
async fn serving_certificate_renewals_refuse_no_admission() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    e2e::chart::install_crds(&client).await?;
    let ns = cp.create_namespace(&client, "renewal").await?;
    label_namespace(&client, &ns, "remora.dev/inject", "enabled").await?;
    // Every pod creation goes through both replicas, with failurePolicy Fail.
    let pair = SelfManagedPair::start(
        cp,
        &client,
        &ns,
        SECRET,
        &[
            "--serving-cert-validity",
            "30s",
            "--tls-secret-resync",
            "2s",
            "--cert-reload-interval",
            "1s",
        ],
    )
    .await?;
    let (a, b, mwc_name) = (&pair.a, &pair.b, &pair.mwc_name);
    let logs = || pair.logs();
    let mwcs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let ca = data(&secrets.get(SECRET).await?, "ca.crt").context("no ca.crt")?;
    wait_until(DEADLINE, "both webhooks trust the Secret's CA", || async {
        let m = mwcs.get(mwc_name).await?;
        Ok::<_, anyhow::Error>(every_ca_bundle_is(&m, &ca).then_some(()))
    })
    .await
    .with_context(logs)?;

    // Create pods for 50 s: two renewals at 20 s and 40 s of each
    // certificate's life.
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let mut certs = BTreeSet::new();
    let (mut created, mut refused) = (0, Vec::new());
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < Duration::from_secs(50) {
        i += 1;
        match pods
            .create(&PostParams::default(), &pod(&format!("p{i}"), &[], &[]))
            .await
        {
            Ok(p) => {
                anyhow::ensure!(e2e::webhook::sidecar(&p).is_some(), "p{i} not injected");
                created += 1;
            }
            Err(e) => refused.push(format!("p{i} at {:?}: {e}", start.elapsed())),
        }
        if let Some(c) = data(&secrets.get(SECRET).await?, "tls.crt") {
            certs.insert(c.0);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "{created} pods created through both replicas in 50 s, {} refused; {} serving certificates in the Secret",
        refused.len(),
        certs.len()
    );
    assert!(refused.is_empty(), "{refused:#?}\n{}", logs());
    assert!(
        certs.len() >= 3,
        "renewed {} times\n{}",
        certs.len() - 1,
        logs()
    );
    // The CA did not change (no caBundle change was needed), and both
    // replicas loaded renewals (one wrote each, the other adopted it).
    assert_eq!(data(&secrets.get(SECRET).await?, "ca.crt"), Some(ca));
    for (name, log) in [("a", a.log_tail()), ("b", b.log_tail())] {
        assert!(
            log.contains("serving certificate updated from the Secret"),
            "replica {name} never loaded a renewal:\n{log}"
        );
    }
    mwcs.delete(mwc_name, &Default::default()).await?;
    drop(pair);
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}
