//! The trust bundle, distributed: the leader keeps the ConfigMap
//! [`TRUST_BUNDLE_CONFIGMAP`] (key [`TRUST_BUNDLE_KEY`]) in every injected
//! namespace equal to the CA's bundle (every root to trust: old and new
//! during a rotation), by server-side apply with the operator's field
//! manager. A namespace is injected when it carries the injection label, or
//! holds a pod the webhook injected. It writes only what changed, and every
//! [`REASSERT`] all of it again (a ConfigMap deleted by hand comes back).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams};
use remora_contract::workload_ca::{TRUST_BUNDLE_CONFIGMAP, TRUST_BUNDLE_KEY};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::AuthorityRx;

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

/// Keep the bundle in every namespace `targets` names, checking every
/// `period` and at once when the bundle changes, until `token`.
pub async fn run(
    client: kube::Client,
    mut authority: AuthorityRx,
    targets: impl Fn() -> BTreeSet<String> + Send,
    period: Duration,
    token: CancellationToken,
) {
    let params = PatchParams::apply(crate::controller::FIELD_MANAGER).force();
    // Namespace → the bundle last written there.
    let mut written: HashMap<String, String> = HashMap::new();
    let mut since_reassert = Instant::now();
    loop {
        let bundle = authority
            .borrow_and_update()
            .as_ref()
            .map(|a| a.bundle.clone());
        if let Some(bundle) = bundle {
            if since_reassert.elapsed() >= REASSERT {
                written.clear();
                since_reassert = Instant::now();
            }
            let wanted = targets();
            written.retain(|ns, _| wanted.contains(ns));
            for ns in wanted {
                if written.get(&ns) == Some(&bundle) {
                    continue;
                }
                let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
                match api
                    .patch(
                        TRUST_BUNDLE_CONFIGMAP,
                        &params,
                        &Patch::Apply(config_map(&ns, &bundle)),
                    )
                    .await
                {
                    Ok(_) => {
                        tracing::info!(namespace = %ns, "workload CA: trust bundle written");
                        written.insert(ns, bundle.clone());
                    }
                    // A namespace being deleted refuses new objects; the
                    // next pass tries again while it is still wanted.
                    Err(e) => {
                        tracing::warn!(namespace = %ns, error = %e, "workload CA: cannot write the trust bundle");
                    }
                }
                if token.is_cancelled() {
                    return;
                }
            }
        }
        tokio::select! {
            () = token.cancelled() => return,
            r = authority.changed() => if r.is_err() { return token.cancelled().await },
            () = tokio::time::sleep(period) => {}
        }
    }
}
