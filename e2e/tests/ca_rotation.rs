//! The self-managed CA rotates while the API server keeps calling: two
//! injector replicas share one Secret, the webhook configuration sends every
//! pod creation through both (failurePolicy Fail), and the CA lives 60 s
//! (staged at 40 s, switched once the caBundle holds both roots, the old
//! root retired 10 s later). No pod creation may be refused; both replicas
//! end serving certificates of the new CA and the caBundle holds its root.
//! Then a corrupted Secret is repaired and a blanked caBundle restored.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::controlplane::{ControlPlane, wait_until};
use e2e::injector::Injector;
use e2e::webhook::{SelfManagedPair, label_namespace, pod};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::PostParams;
use remora_injector::ca::{NEXT_CA_KEY, PREVIOUS_CA_KEY, bundle_has_root};
use remora_test_support::webhook_client::connect;

const SECRET: &str = "rotation-tls";

fn text(s: &Secret, key: &str) -> Option<String> {
    let b = s.data.as_ref()?.get(key)?;
    Some(String::from_utf8_lossy(&b.0).into_owned())
}

fn bundles(m: &MutatingWebhookConfiguration) -> Vec<Vec<u8>> {
    m.webhooks
        .iter()
        .flatten()
        .map(|w| {
            w.client_config
                .ca_bundle
                .clone()
                .map(|b| b.0)
                .unwrap_or_default()
        })
        .collect()
}

/// Whether both replicas serve a certificate `root` signed (a handshake
/// that trusts only `root`).
async fn both_serve(replicas: &[&Injector], root: &str) -> bool {
    for r in replicas {
        if connect(r.addr(), "127.0.0.1", root).await.is_err() {
            return false;
        }
    }
    true
}

#[tokio::test]
async fn ca_rotation_with_two_replicas_refuses_no_admission() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    e2e::chart::install_crds(&client).await?;
    let ns = cp.create_namespace(&client, "carotation").await?;
    label_namespace(&client, &ns, "remora.dev/inject", "enabled").await?;
    let pair = SelfManagedPair::start(
        cp,
        &client,
        &ns,
        SECRET,
        &[
            "--ca-validity",
            "60s",
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
    let first_ca = text(&secrets.get(SECRET).await?, "ca.crt").context("no ca.crt")?;
    wait_until(
        "both webhooks trust the first CA",
        Duration::from_secs(30),
        || async {
            let m = mwcs.get(mwc_name).await?;
            let all = bundles(&m).iter().all(|b| bundle_has_root(b, &first_ca));
            Ok::<_, kube::Error>(all.then_some(()))
        },
    )
    .await
    .with_context(logs)?;

    // Pods created all along, through both replicas.
    let stop = Arc::new(AtomicBool::new(false));
    let creator = {
        let (pods, stop) = (Api::<Pod>::namespaced(client.clone(), &ns), stop.clone());
        tokio::spawn(async move {
            let start = Instant::now();
            let (mut created, mut refused) = (0usize, Vec::new());
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                match pods
                    .create(&PostParams::default(), &pod(&format!("p{i}"), &[], &[]))
                    .await
                {
                    Ok(p) if e2e::webhook::sidecar(&p).is_some() => created += 1,
                    Ok(_) => refused.push(format!("p{i}: not injected")),
                    Err(e) => refused.push(format!("p{i} at {:?}: {e}", start.elapsed())),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (created, refused)
        })
    };

    // The rotation: staged with both roots published, switched, retired.
    let start = Instant::now();
    let mut saw_both = false;
    let new_ca = loop {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(90),
            "no completed CA rotation within 90 s (saw both roots published: {saw_both})\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        let s = secrets.get(SECRET).await?;
        let m = bundles(&mwcs.get(mwc_name).await?);
        if let Some(next) = text(&s, NEXT_CA_KEY) {
            saw_both |= m
                .iter()
                .all(|b| bundle_has_root(b, &first_ca) && bundle_has_root(b, &next));
        }
        let Some(ca) = text(&s, "ca.crt") else {
            continue;
        };
        let settled = ca != first_ca
            && text(&s, PREVIOUS_CA_KEY).is_none()
            && text(&s, NEXT_CA_KEY).is_none()
            && m.iter()
                .all(|b| bundle_has_root(b, &ca) && !bundle_has_root(b, &first_ca))
            && both_serve(&[a, b], &ca).await;
        if settled {
            break ca;
        }
    };
    let rotated_after = start.elapsed();
    // Keep creating for a few seconds on the new CA alone.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let (created, refused) = creator.await?;
    eprintln!(
        "CA rotated and old root retired after {rotated_after:?}; {created} pods created, {} refused",
        refused.len()
    );
    assert!(refused.is_empty(), "{refused:#?}\n{}", logs());
    assert!(created > 20, "only {created} pods created");
    assert!(saw_both, "the caBundle never held both roots\n{}", logs());
    let l = logs();
    assert!(l.contains("switched to the new CA"), "{l}");
    let events = Api::<Event>::namespaced(client.clone(), &ns);
    // Waits (10 s at most) for an Event with `reason` about the Secret.
    let event_on_secret = |reason: &'static str| {
        let events = &events;
        async move {
            wait_until(
                &format!("a {reason} Event on the Secret"),
                Duration::from_secs(10),
                || async {
                    let list = events.list(&Default::default()).await?;
                    let seen = list.items.iter().any(|e| {
                        e.reason.as_deref() == Some(reason)
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(SECRET)
                    });
                    Ok::<_, kube::Error>(seen.then_some(()))
                },
            )
            .await
        }
    };
    event_on_secret("CARotated").await?;

    // A corrupted Secret (garbage key): repaired, served by both.
    let mut s = secrets.get(SECRET).await?;
    if let Some(d) = s.data.as_mut() {
        d.insert("tls.key".into(), ByteString(b"garbage".to_vec()));
    }
    secrets.replace(SECRET, &PostParams::default(), &s).await?;
    let repaired = wait_until(
        "the corrupted Secret repaired and served",
        Duration::from_secs(30),
        || async {
            let s = secrets.get(SECRET).await?;
            let (Some(key), Some(ca)) = (text(&s, "tls.key"), text(&s, "ca.crt")) else {
                return Ok::<_, kube::Error>(None);
            };
            let ok = key != "garbage" && both_serve(&[a, b], &ca).await;
            Ok(ok.then_some(ca))
        },
    )
    .await
    .with_context(logs)?;
    assert_ne!(repaired, new_ca);
    event_on_secret("CertificateRepaired").await?;

    // A GitOps apply that blanks caBundle: restored within seconds.
    let mut blank = mwcs.get(mwc_name).await?;
    for w in blank.webhooks.iter_mut().flatten() {
        w.client_config.ca_bundle = None;
    }
    mwcs.replace(mwc_name, &PostParams::default(), &blank)
        .await?;
    wait_until(
        "the blanked caBundle restored",
        Duration::from_secs(5),
        || async {
            let m = mwcs.get(mwc_name).await?;
            let all = bundles(&m).iter().all(|b| bundle_has_root(b, &repaired));
            Ok::<_, kube::Error>(all.then_some(()))
        },
    )
    .await
    .with_context(logs)?;

    mwcs.delete(mwc_name, &Default::default()).await?;
    drop(pair);
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}
