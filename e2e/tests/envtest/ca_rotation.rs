//! The self-managed CA rotates while the API server keeps calling: two
//! operator replicas share one Secret, the webhook configuration sends every
//! pod creation through both (failurePolicy Fail), and the CA lives 60 s
//! (staged at 40 s, switched once the caBundle holds both roots, the old
//! root retired 10 s later). No pod creation may be refused; both replicas
//! end serving certificates of the new CA and the caBundle holds its root.
//! Then a corrupted Secret is repaired and a blanked caBundle restored.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::controlplane::ControlPlane;
use e2e::operator::Operator;
use e2e::webhook::{SelfManagedPair, label_namespace, pod};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::PostParams;
use remora_operator::pki::webhook_cert::{NEXT_CA_KEY, PREVIOUS_CA_KEY, bundle_has_root};
use remora_test_support::wait::{Check, Wait, wait_until};
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
async fn both_serve(replicas: &[&Operator], root: &str) -> bool {
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
        Duration::from_secs(30),
        "both webhooks trust the first CA",
        || async {
            let m = mwcs.get(mwc_name).await?;
            let all = bundles(&m).iter().all(|b| bundle_has_root(b, &first_ca));
            Ok::<_, anyhow::Error>(all.then_some(()))
        },
    )
    .await
    .with_context(logs)?;

    // Pods created all along, through both replicas.
    let stop = Arc::new(AtomicBool::new(false));
    let created = Arc::new(AtomicUsize::new(0));
    let creator = {
        let pods = Api::<Pod>::namespaced(client.clone(), &ns);
        let (stop, created) = (stop.clone(), created.clone());
        tokio::spawn(async move {
            let start = Instant::now();
            let mut refused = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                match pods
                    .create(&PostParams::default(), &pod(&format!("p{i}"), &[], &[]))
                    .await
                {
                    Ok(p) if e2e::webhook::sidecar(&p).is_some() => {
                        created.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => refused.push(format!("p{i}: not injected")),
                    Err(e) => refused.push(format!("p{i} at {:?}: {e}", start.elapsed())),
                }
                // The pace of the stream of creations, not a wait.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            refused
        })
    };

    // The rotation: staged with both roots published, switched, retired.
    let start = Instant::now();
    let saw_both = Cell::new(false);
    let new_ca = Wait::new(Duration::from_secs(90), "a completed CA rotation")
        .every(Duration::from_millis(250))
        .until(|| async {
            let s = secrets.get(SECRET).await?;
            let m = bundles(&mwcs.get(mwc_name).await?);
            if let Some(next) = text(&s, NEXT_CA_KEY) {
                let both = m
                    .iter()
                    .all(|b| bundle_has_root(b, &first_ca) && bundle_has_root(b, &next));
                saw_both.set(saw_both.get() || both);
            }
            let Some(ca) = text(&s, "ca.crt") else {
                return Ok::<_, anyhow::Error>(Check::NotYet("no ca.crt".into()));
            };
            let settled = ca != first_ca
                && text(&s, PREVIOUS_CA_KEY).is_none()
                && text(&s, NEXT_CA_KEY).is_none()
                && m.iter()
                    .all(|b| bundle_has_root(b, &ca) && !bundle_has_root(b, &first_ca))
                && both_serve(&[a, b], &ca).await;
            Ok(if settled {
                Check::Done(ca)
            } else {
                Check::NotYet(format!(
                    "not settled (both roots seen published: {})",
                    saw_both.get()
                ))
            })
        })
        .await
        .with_context(logs)?;
    let saw_both = saw_both.get();
    let rotated_after = start.elapsed();
    // Creations go on on the new CA alone.
    let at_rotation = created.load(Ordering::Relaxed);
    wait_until(
        Duration::from_secs(30),
        "10 more pods created on the new CA alone",
        || async { created.load(Ordering::Relaxed) >= at_rotation + 10 },
    )
    .await
    .with_context(logs)?;
    stop.store(true, Ordering::Relaxed);
    let refused = creator.await?;
    let created = created.load(Ordering::Relaxed);
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
                Duration::from_secs(10),
                &format!("a {reason} Event on the Secret"),
                || async {
                    let list = events.list(&Default::default()).await?;
                    let seen = list.items.iter().any(|e| {
                        e.reason.as_deref() == Some(reason)
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(SECRET)
                    });
                    Ok::<_, anyhow::Error>(seen.then_some(()))
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
        Duration::from_secs(30),
        "the corrupted Secret repaired and served",
        || async {
            let s = secrets.get(SECRET).await?;
            let (Some(key), Some(ca)) = (text(&s, "tls.key"), text(&s, "ca.crt")) else {
                return Ok::<_, anyhow::Error>(None);
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
        Duration::from_secs(5),
        "the blanked caBundle restored",
        || async {
            let m = mwcs.get(mwc_name).await?;
            let all = bundles(&m).iter().all(|b| bundle_has_root(b, &repaired));
            Ok::<_, anyhow::Error>(all.then_some(()))
        },
    )
    .await
    .with_context(logs)?;

    mwcs.delete(mwc_name, &Default::default()).await?;
    drop(pair);
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

/// The trust-bundle attack against the workload CA (issue 27, item 5), on
/// the real API server: a user with the rights `edit` gives on ConfigMaps
/// in a namespace adds their own root to its `remora-ca-root-cert`, moves
/// it to `binaryData`, or deletes it. The leader, which watches the
/// ConfigMap, writes the CA's bundle back within seconds. The CA,
/// over its real TLS, returns the same bundle with every certificate it
/// issues, which is what sidecars trust for their peers. Then a rotation:
/// the leader records on the signing Secret that every bundle carries the
/// staged root, and the switch comes `settle` after that record (item 10).
#[tokio::test]
async fn a_foreign_edit_of_the_workload_trust_bundle_is_reverted_at_once() -> anyhow::Result<()> {
    use e2e::node::workload_ca::{CaClient, csr, token};
    use e2e::operator::Options;
    use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    use remora_contract::workload_ca::{TOKEN_AUDIENCE, TRUST_BUNDLE_CONFIGMAP, TRUST_BUNDLE_KEY};
    use serde_json::json;

    let cp = ControlPlane::shared().await?;
    let admin = cp.client()?;
    let op = cp.create_namespace(&admin, "tb-op").await?;
    let work = cp.create_namespace(&admin, "tb-work").await?;
    label_namespace(&admin, &work, "remora.dev/inject", "enabled").await?;
    let ca_port = remora_test_support::ports::free_port();
    let mut options = Options::new(&op);
    options.args = [
        "--leader-elect=false",
        "--workload-ca",
        "--workload-ca-listen",
        &format!("127.0.0.1:{ca_port}"),
        "--workload-ca-settle",
        "60s",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let operator = Operator::start(cp.kubeconfig(), options).await?;
    let logs = || operator.log_tail();

    let cms = Api::<ConfigMap>::namespaced(admin.clone(), &work);
    // The bundle key, when it is in `data` alone.
    let bundle_now = || async {
        let cm = cms.get_opt(TRUST_BUNDLE_CONFIGMAP).await?;
        let in_binary = cm
            .as_ref()
            .and_then(|c| c.binary_data.as_ref())
            .is_some_and(|b| b.contains_key(TRUST_BUNDLE_KEY));
        Ok::<_, anyhow::Error>(
            cm.and_then(|c| c.data)
                .and_then(|d| d.get(TRUST_BUNDLE_KEY).cloned())
                .filter(|_| !in_binary),
        )
    };
    let bundle = wait_until(
        Duration::from_secs(30),
        "the trust bundle in the injected namespace",
        || async { bundle_now().await },
    )
    .await
    .with_context(logs)?;

    // The attacker: a ServiceAccount with what `edit` grants on ConfigMaps.
    let pp = PostParams::default();
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "gitops"}}))?;
    Api::<ServiceAccount>::namespaced(admin.clone(), &work)
        .create(&pp, &sa)
        .await?;
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "configmaps"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                   "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}]}))?;
    Api::<Role>::namespaced(admin.clone(), &work)
        .create(&pp, &role)
        .await?;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "gitops"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmaps"},
        "subjects": [{"kind": "ServiceAccount", "name": "gitops", "namespace": work}]}))?;
    Api::<RoleBinding>::namespaced(admin.clone(), &work)
        .create(&pp, &binding)
        .await?;
    let attacker = cp.client_with_token(
        &e2e::controlplane::service_account_token(&admin, &work, "gitops").await?,
    )?;
    let theirs = Api::<ConfigMap>::namespaced(attacker, &work);
    let evil_root = remora_test_support::pki::Ca::new("attacker root").pem;

    // Their root added: written back within seconds.
    let mut cm = wait_until(
        Duration::from_secs(10),
        "the attacker may write it",
        || async { Ok::<_, anyhow::Error>(theirs.get(TRUST_BUNDLE_CONFIGMAP).await.ok()) },
    )
    .await?;
    cm.data = Some(std::collections::BTreeMap::from([(
        TRUST_BUNDLE_KEY.to_string(),
        format!("{bundle}{evil_root}"),
    )]));
    theirs.replace(TRUST_BUNDLE_CONFIGMAP, &pp, &cm).await?;
    let edited = Instant::now();
    wait_until(Duration::from_secs(5), "the edit reverted", || async {
        Ok::<_, anyhow::Error>(
            (bundle_now().await?.as_deref() == Some(bundle.as_str())).then_some(()),
        )
    })
    .await
    .with_context(logs)?;
    let reverted_in = edited.elapsed();

    // Deleted: back within seconds.
    theirs
        .delete(TRUST_BUNDLE_CONFIGMAP, &Default::default())
        .await?;
    let deleted = Instant::now();
    wait_until(
        Duration::from_secs(5),
        "the deleted bundle restored",
        || async {
            Ok::<_, anyhow::Error>(
                (bundle_now().await?.as_deref() == Some(bundle.as_str())).then_some(()),
            )
        },
    )
    .await
    .with_context(logs)?;
    let restored_in = deleted.elapsed();

    // Moved to `binaryData` with their root (the kubelet mounts either):
    // written back too.
    let mut cm = theirs.get(TRUST_BUNDLE_CONFIGMAP).await?;
    cm.data = None;
    cm.binary_data = Some(std::collections::BTreeMap::from([(
        TRUST_BUNDLE_KEY.to_string(),
        k8s_openapi::ByteString(format!("{bundle}{evil_root}").into_bytes()),
    )]));
    theirs.replace(TRUST_BUNDLE_CONFIGMAP, &pp, &cm).await?;
    wait_until(
        Duration::from_secs(5),
        "the binaryData edit reverted",
        || async {
            Ok::<_, anyhow::Error>(
                (bundle_now().await?.as_deref() == Some(bundle.as_str())).then_some(()),
            )
        },
    )
    .await
    .with_context(logs)?;
    eprintln!("foreign edit reverted in {reverted_in:?}, deletion restored in {restored_in:?}");

    // The CA over its TLS (verified by the bundle, under the Service's
    // name): the certificate comes with the same bundle, not the attacker's.
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "app"}}))?;
    Api::<ServiceAccount>::namespaced(admin.clone(), &work)
        .create(&pp, &sa)
        .await?;
    let tok = token(&admin, &work, "app", TOKEN_AUDIENCE, None).await?;
    let ca = CaClient::connect_addr(
        std::net::SocketAddr::from(([127, 0, 0, 1], ca_port)),
        &format!("remora-operator.{op}.svc"),
        &bundle,
    )?;
    let id = remora_contract::workload_ca::spiffe_id("cluster.local", &work, "app");
    let (chain, sent) = ca
        .create_with_trust_bundle(Some(&tok), csr(&id)?, Duration::from_secs(600))
        .await
        .with_context(logs)?;
    assert_eq!(chain.len(), 2);
    assert_eq!(sent.as_deref(), Some(bundle.as_str()), "{}", logs());
    assert!(!bundle.contains(evil_root.trim()));
    assert!(
        operator
            .log_text()
            .contains("changed or deleted by someone else"),
        "{}",
        logs()
    );

    // A rotation asked for: staged at once; recorded once the namespace's
    // bundle carries the staged root; switched `settle` after the record.
    use remora_operator::pki::workload_ca::roots::{
        DISTRIBUTED, DISTRIBUTED_AT, ROTATE, fingerprint,
    };
    let secrets = Api::<Secret>::namespaced(admin.clone(), &op);
    let name = remora_contract::workload_ca::SIGNING_SECRET;
    secrets
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"annotations": {ROTATE: "now"}}})),
        )
        .await?;
    let (staged, recorded_at) = wait_until(
        Duration::from_secs(30),
        "the staged root recorded as in every bundle",
        || async {
            let s = secrets.get(name).await?;
            let ann = s.metadata.annotations.clone().unwrap_or_default();
            let Some(next) = text(&s, "next-cert.pem") else {
                return Ok::<_, anyhow::Error>(None);
            };
            let recorded = ann.get(DISTRIBUTED).cloned() == fingerprint(&next);
            let at = ann.get(DISTRIBUTED_AT).and_then(|t| t.parse::<u64>().ok());
            Ok(at.filter(|_| recorded).map(|at| (next, at)))
        },
    )
    .await
    .with_context(logs)?;
    let carried = bundle_now().await?.unwrap_or_default();
    assert!(
        carried.contains(staged.trim()),
        "recorded before the bundle carries it"
    );
    let switched_at = wait_until(Duration::from_secs(120), "the switch", || async {
        let s = secrets.get(name).await?;
        let switched = text(&s, "root-cert.pem").is_some_and(|r| r.trim() == staged.trim());
        let at = s
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("remora.dev/switched-at"))
            .and_then(|t| t.parse::<u64>().ok());
        Ok::<_, anyhow::Error>(at.filter(|_| switched))
    })
    .await
    .with_context(logs)?;
    assert!(
        switched_at >= recorded_at + 60,
        "switched at {switched_at}, {}s after the record",
        switched_at.saturating_sub(recorded_at)
    );

    drop(operator);
    cp.delete_namespace(&admin, &work).await?;
    cp.delete_namespace(&admin, &op).await?;
    Ok(())
}
