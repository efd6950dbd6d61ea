//! The trust bundle, distributed: the leader keeps the ConfigMap
//! [`TRUST_BUNDLE_CONFIGMAP`] (key [`TRUST_BUNDLE_KEY`]) in every injected
//! namespace equal to the CA's bundle (every root to trust: old and new
//! during a rotation), by server-side apply with the operator's field
//! manager. A namespace is injected when it carries the injection label, or
//! holds a pod the webhook injected. It writes only what changed, and every
//! [`REASSERT`] all of it again.
//!
//! Anyone who may write ConfigMaps in a namespace can edit this one, so the
//! leader watches every ConfigMap of that name (one watch, by a field
//! selector on the name) and writes back at once one that someone else
//! changed or deleted. Sidecars trust for their peers only the roots the CA
//! gives them over its verified connection; the ConfigMap verifies the CA
//! and tells them when to ask again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use remora_contract::workload_ca::{TRUST_BUNDLE_CONFIGMAP, TRUST_BUNDLE_KEY};
use sha2::{Digest, Sha256};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cluster::watch::{Change, SharedWatch};
use crate::pki::workload_ca::AuthorityRx;

/// How often every namespace's ConfigMap is written again regardless.
pub const REASSERT: Duration = Duration::from_secs(600);

/// The ConfigMap for `bundle` in `namespace`.
pub fn config_map(namespace: &str, bundle: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(TRUST_BUNDLE_CONFIGMAP.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_string(),
                "remora".to_string(),
            )])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            TRUST_BUNDLE_KEY.to_string(),
            bundle.to_string(),
        )])),
        ..Default::default()
    }
}

/// The key under which a watched ConfigMap keeps only [`digest`] of its
/// bundle: the leader's memory does not grow with what others write there.
const DIGEST_KEY: &str = "sha256";

/// What the watch keeps of a ConfigMap's bundle key: its SHA-256, or
/// `absent` (none, or one in `binaryData`, which the kubelet would mount).
pub fn digest(cm: &ConfigMap) -> String {
    let in_binary = cm
        .binary_data
        .as_ref()
        .is_some_and(|b| b.contains_key(TRUST_BUNDLE_KEY));
    match cm.data.as_ref().and_then(|d| d.get(TRUST_BUNDLE_KEY)) {
        Some(v) if !in_binary => format!("{:x}", Sha256::digest(v.as_bytes())),
        _ => "absent".into(),
    }
}

fn digest_of_bundle(bundle: &str) -> String {
    format!("{:x}", Sha256::digest(bundle.as_bytes()))
}

/// Trims a watched ConfigMap to its name, namespace and [`digest`].
fn slim(cm: &mut ConfigMap) {
    let d = digest(cm);
    let meta = &mut cm.metadata;
    meta.managed_fields = None;
    meta.annotations = None;
    meta.labels = None;
    meta.owner_references = None;
    cm.binary_data = None;
    cm.data = Some(BTreeMap::from([(DIGEST_KEY.to_string(), d)]));
}

/// Namespace → the digest its ConfigMap was seen with since the last pass
/// (`None`: deleted), filled by the watch and emptied by [`run`].
type Seen = Arc<Mutex<HashMap<String, Option<String>>>>;

/// Watch every ConfigMap named [`TRUST_BUNDLE_CONFIGMAP`] until `token`,
/// noting each change in `seen` and waking `wake`.
fn watch_bundles(client: kube::Client, seen: Seen, wake: Arc<Notify>, token: CancellationToken) {
    let w = SharedWatch::start(
        "trust-bundle configmaps",
        Api::<ConfigMap>::all(client),
        watcher::Config::default().fields(&format!("metadata.name={TRUST_BUNDLE_CONFIGMAP}")),
        slim,
        token,
    );
    w.observe(move |change| {
        let cm = change.object();
        let Some(ns) = cm.metadata.namespace.clone() else {
            return true;
        };
        let d = match change {
            Change::Applied(_) => cm.data.as_ref().and_then(|d| d.get(DIGEST_KEY)).cloned(),
            Change::Deleted(_) => None,
        };
        seen.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(ns, d);
        wake.notify_one();
        true
    });
}

/// The signing Secret, on which the leader records that every bundle
/// carries the staged root (the switch to it waits for that record).
#[derive(Debug, Clone)]
pub struct SigningSecret {
    pub namespace: String,
    pub name: String,
}

/// Record on the signing Secret that every bundle carries the staged root
/// of fingerprint `fp`, unless the Secret stages another root by now.
/// Conditional on the resourceVersion read. `Ok(true)`: recorded (now or
/// before).
async fn record_distributed(
    secrets: &Api<Secret>,
    name: &str,
    fp: &str,
) -> Result<bool, kube::Error> {
    let Some(s) = secrets.get_opt(name).await? else {
        return Ok(false);
    };
    let Some(r) = crate::pki::workload_ca::roots::from_secret(&s) else {
        return Ok(false);
    };
    let staged = r
        .roots
        .next
        .as_ref()
        .and_then(|n| crate::pki::workload_ca::roots::fingerprint(&n.cert_pem));
    if staged.as_deref() != Some(fp) {
        return Ok(false);
    }
    if r.distributed.as_ref().is_some_and(|(f, _)| f == fp) {
        return Ok(true);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let recorded = crate::pki::workload_ca::roots::Stored {
        distributed: Some((fp.to_string(), now)),
        ..r
    };
    secrets
        .replace(
            name,
            &PostParams::default(),
            &crate::pki::workload_ca::roots::to_secret(&recorded, s.metadata),
        )
        .await?;
    Ok(true)
}

/// Keep the bundle in every namespace `targets` names, checking every
/// `period`, at once when the bundle changes, and at once when someone else
/// changes or deletes one, until `token`. Once every one carries a staged
/// root, record it on `signing`.
pub async fn run(
    client: kube::Client,
    mut authority: AuthorityRx,
    targets: impl Fn() -> BTreeSet<String> + Send,
    period: Duration,
    signing: SigningSecret,
    token: CancellationToken,
) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &signing.namespace);
    // The staged root recorded last.
    let mut recorded: Option<String> = None;
    let params = PatchParams::apply(crate::identity::FIELD_MANAGER).force();
    let seen: Seen = Arc::default();
    let wake = Arc::new(Notify::new());
    // The watch ends with this task, however it ends.
    let watching = token.child_token();
    let _stop_watching = watching.clone().drop_guard();
    watch_bundles(
        client.clone(),
        Arc::clone(&seen),
        Arc::clone(&wake),
        watching,
    );
    // Namespace → the bundle last written there.
    let mut written: HashMap<String, String> = HashMap::new();
    let mut since_reassert = Instant::now();
    loop {
        let current = authority
            .borrow_and_update()
            .as_ref()
            .map(|a| (a.bundle.clone(), a.staged.clone()));
        if let Some((bundle, staged)) = current {
            if since_reassert.elapsed() >= REASSERT {
                written.clear();
                since_reassert = Instant::now();
            }
            let want = digest_of_bundle(&bundle);
            let changed: Vec<(String, Option<String>)> = seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .drain()
                .collect();
            for (ns, d) in changed {
                if d.as_deref() != Some(want.as_str()) && written.remove(&ns).is_some() {
                    tracing::warn!(namespace = %ns, "workload CA: the trust bundle was changed or deleted by someone else; writing it back");
                }
            }
            let wanted = targets();
            written.retain(|ns, _| wanted.contains(ns));
            // Namespaces being deleted: they take no bundle, and need none.
            let mut terminating: BTreeSet<&str> = BTreeSet::new();
            for ns in &wanted {
                if written.get(ns) == Some(&bundle) {
                    continue;
                }
                let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
                match api
                    .patch(
                        TRUST_BUNDLE_CONFIGMAP,
                        &params,
                        &Patch::Apply(config_map(ns, &bundle)),
                    )
                    .await
                {
                    Ok(_) => {
                        tracing::info!(namespace = %ns, "workload CA: trust bundle written");
                        written.insert(ns.clone(), bundle.clone());
                    }
                    // Someone put the key in `binaryData`, which the apply
                    // cannot take over (a key may not be in both): drop it
                    // there; the next pass applies.
                    Err(kube::Error::Api(e)) if e.code == 422 => {
                        tracing::warn!(namespace = %ns, error = %e.message, "workload CA: the trust bundle's key is in binaryData; removing it there");
                        let drop_binary =
                            serde_json::json!({"binaryData": {TRUST_BUNDLE_KEY: null}});
                        if let Err(e) = api
                            .patch(
                                TRUST_BUNDLE_CONFIGMAP,
                                &PatchParams::default(),
                                &Patch::Merge(drop_binary),
                            )
                            .await
                        {
                            tracing::warn!(namespace = %ns, error = %e, "workload CA: cannot write the trust bundle");
                        }
                        wake.notify_one();
                    }
                    // A namespace being deleted refuses new objects; the
                    // next pass tries again while it is still wanted.
                    Err(kube::Error::Api(e))
                        if e.code == 403 && e.message.contains("being terminated") =>
                    {
                        tracing::debug!(namespace = %ns, "workload CA: the namespace is being deleted; no trust bundle");
                        terminating.insert(ns);
                    }
                    Err(e) => {
                        tracing::warn!(namespace = %ns, error = %e, "workload CA: cannot write the trust bundle");
                    }
                }
                if token.is_cancelled() {
                    return;
                }
            }
            let everywhere = wanted
                .iter()
                .all(|ns| written.get(ns) == Some(&bundle) || terminating.contains(ns.as_str()));
            if let Some(fp) = staged.filter(|fp| everywhere && recorded.as_ref() != Some(fp)) {
                match record_distributed(&secrets, &signing.name, &fp).await {
                    Ok(true) => {
                        tracing::info!(namespaces = wanted.len(), fingerprint = %fp,
                            "workload CA: every trust bundle carries the staged root; recorded on the signing Secret");
                        recorded = Some(fp);
                    }
                    Ok(false) => {}
                    // A conflict or an outage: the next pass tries again.
                    Err(e) => {
                        tracing::warn!(error = %e, "workload CA: cannot record that every trust bundle carries the staged root");
                    }
                }
            }
        }
        tokio::select! {
            () = token.cancelled() => return,
            r = authority.changed() => if r.is_err() { return token.cancelled().await },
            () = wake.notified() => {}
            () = tokio::time::sleep(period) => {}
        }
    }
}
