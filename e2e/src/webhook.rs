//! The operator registered as the API server's mutating webhook, for tests
//! on the shared control plane.
//!
//! The webhook configuration is the chart's own (`helm template`), with
//! `clientConfig.service` swapped for `clientConfig.url` to the operator
//! running as a local process (no Service network here) and, so that tests
//! running in parallel on one API server do not see each other's webhooks,
//! one more namespaceSelector term: the test's own namespaces.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use crate::controlplane::ControlPlane;
use crate::operator::{Operator, Options};
use remora_test_support::wait::wait_until;

pub const DEADLINE: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    ControlPlane(#[from] crate::controlplane::Error),
    #[error(transparent)]
    Operator(#[from] crate::operator::Error),
    #[error(transparent)]
    Chart(#[from] crate::chart::Error),
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("temporary directory: {0}")]
    TempDir(#[from] std::io::Error),
    #[error("the chart's MutatingWebhookConfiguration: {0}")]
    Webhooks(&'static str),
    #[error("{source}; the operator's log ends with:\n{log}")]
    NotEffective {
        source: crate::controlplane::Error,
        log: String,
    },
}
pub const PROXY: &str = "remora-proxy";

/// The sidecar, wherever the mode put it.
pub fn sidecar(pod: &Pod) -> Option<(&'static str, &Container)> {
    let spec = pod.spec.as_ref()?;
    if let Some(c) = spec.containers.iter().find(|c| c.name == PROXY) {
        return Some(("containers", c));
    }
    spec.init_containers
        .iter()
        .flatten()
        .find(|c| c.name == PROXY)
        .map(|c| ("initContainers", c))
}

pub fn pod(name: &str, labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Pod {
    let map = |kv: &[(&str, &str)]| {
        (!kv.is_empty()).then(|| {
            kv.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>()
        })
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: map(labels),
            annotations: map(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "app".into(),
                image: Some("registry.invalid/app:1".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// Whether every webhook of `mwc` has exactly `ca` as its caBundle.
pub fn every_ca_bundle_is(mwc: &MutatingWebhookConfiguration, ca: &ByteString) -> bool {
    mwc.webhooks
        .iter()
        .flatten()
        .all(|w| w.client_config.ca_bundle.as_ref() == Some(ca))
}

pub async fn label_namespace(
    client: &Client,
    ns: &str,
    key: &str,
    value: &str,
) -> Result<(), SetupError> {
    Api::<Namespace>::all(client.clone())
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {key: value}}})),
        )
        .await?;
    Ok(())
}

/// The chart's MutatingWebhookConfiguration, pointed at `operator` and
/// limited to `namespaces`.
pub fn webhook_config(
    name: &str,
    operator: &Operator,
    namespaces: &[&str],
    failure_policy: &str,
) -> Result<MutatingWebhookConfiguration, SetupError> {
    let objects = crate::chart::render(
        "remora",
        "remora-system",
        &[&format!("webhook.failurePolicy={failure_policy}")],
    )?;
    let rendered = crate::chart::find(&objects, "MutatingWebhookConfiguration", None)
        .ok_or(SetupError::Webhooks("not rendered"))?;
    let mut mwc: MutatingWebhookConfiguration = serde_json::from_value(rendered.clone())?;
    mwc.metadata.name = Some(name.to_owned());
    if mwc.webhooks.as_ref().is_none_or(|w| w.len() != 2) {
        return Err(SetupError::Webhooks("not two webhooks"));
    }
    for w in mwc.webhooks.iter_mut().flatten() {
        w.client_config.service = None;
        w.client_config.url = Some(operator.url());
        w.client_config.ca_bundle = Some(ByteString(operator.ca_pem().as_bytes().to_vec()));
        let sel = w.namespace_selector.get_or_insert_with(Default::default);
        sel.match_expressions
            .get_or_insert_with(Vec::new)
            .push(LabelSelectorRequirement {
                key: "kubernetes.io/metadata.name".into(),
                operator: "In".into(),
                values: Some(namespaces.iter().map(|s| (*s).to_owned()).collect()),
            });
    }
    Ok(mwc)
}

/// Two operator replicas with a self-managed CA sharing the Secret
/// `secret` in `ns`, behind one webhook configuration (failurePolicy Fail)
/// whose first webhook calls `a` and second calls `b`: every pod creation
/// in `ns` passes through both. `lifetimes` are the extra flags (certificate
/// validities, resync and reload intervals).
pub struct SelfManagedPair {
    pub a: Operator,
    pub b: Operator,
    pub mwc_name: String,
    _dirs: tempfile::TempDir,
}

impl SelfManagedPair {
    pub async fn start(
        cp: &ControlPlane,
        client: &Client,
        ns: &str,
        secret: &str,
        lifetimes: &[&str],
    ) -> Result<Self, SetupError> {
        let mwc_name = format!("remora-e2e-{ns}");
        let dirs = tempfile::tempdir()?;
        let replica = |n: &str| {
            let mut o = Options::new(ns);
            let dir = dirs.path().join(n).display().to_string();
            o.args = [
                "--self-signed",
                "--tls-secret",
                secret,
                // The API server calls https://127.0.0.1:<port>: the
                // certificate names that address.
                "--service-name",
                "127.0.0.1",
                "--webhook-config",
                &mwc_name,
                "--leader-elect=false",
                "--self-signed-dir",
                &dir,
            ]
            .iter()
            .chain(lifetimes)
            .map(|s| s.to_string())
            .collect();
            o
        };
        let a = Operator::start(cp.kubeconfig(), replica("a")).await?;
        let b = Operator::start(cp.kubeconfig(), replica("b")).await?;
        let mut mwc = webhook_config(&mwc_name, &a, &[ns], "Fail")?;
        if let Some(second) = mwc.webhooks.as_mut().and_then(|w| w.get_mut(1)) {
            second.client_config.url = Some(b.url());
        }
        Api::<MutatingWebhookConfiguration>::all(client.clone())
            .create(&PostParams::default(), &mwc)
            .await?;
        Ok(Self {
            a,
            b,
            mwc_name,
            _dirs: dirs,
        })
    }

    /// The tails of both replicas' logs, for a failure's context.
    pub fn logs(&self) -> String {
        format!(
            "replica a:\n{}\nreplica b:\n{}",
            self.a.log_tail(),
            self.b.log_tail()
        )
    }
}

/// A test's world: namespaces (the first labelled `remora.dev/inject=enabled`,
/// the second not), the operator, the chart's webhook configuration.
pub struct Setup {
    pub client: Client,
    pub enabled: String,
    pub plain: String,
    pub operator: Operator,
    pub mwc: String,
}

impl Setup {
    pub async fn new(prefix: &str, failure_policy: &str) -> Result<Self, SetupError> {
        Self::with(prefix, failure_policy, |_| {}).await
    }

    /// As [`Setup::new`], with the operator's options adjusted by `customize`
    /// (they start as `Options::new(<enabled namespace>)`).
    pub async fn with(
        prefix: &str,
        failure_policy: &str,
        customize: impl FnOnce(&mut Options),
    ) -> Result<Self, SetupError> {
        let cp = ControlPlane::shared().await?;
        let client = cp.client()?;
        crate::chart::install_crds(&client).await?;
        let enabled = cp
            .create_namespace(&client, &format!("{prefix}-on"))
            .await?;
        let plain = cp
            .create_namespace(&client, &format!("{prefix}-off"))
            .await?;
        // Before the operator starts: its first listing then has the label.
        label_namespace(&client, &enabled, "remora.dev/inject", "enabled").await?;
        // Its operator namespace is the test's, so a cluster default
        // SidecarLifecycle of another test never reaches it.
        let mut options = Options::new(&enabled);
        customize(&mut options);
        let operator = Operator::start(cp.kubeconfig(), options).await?;
        let mwc = format!("remora-e2e-{enabled}");
        let config = webhook_config(&mwc, &operator, &[&enabled, &plain], failure_policy)?;
        Api::<MutatingWebhookConfiguration>::all(client.clone())
            .create(&PostParams::default(), &config)
            .await?;
        let me = Self {
            client,
            enabled,
            plain,
            operator,
            mwc,
        };
        me.wait_effective().await?;
        Ok(me)
    }

    /// The API server picks a new webhook configuration up asynchronously:
    /// dry-run creates (which run mutating webhooks; the configuration says
    /// sideEffects None) until one comes back injected.
    pub async fn wait_effective(&self) -> Result<(), SetupError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.enabled);
        let dry = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let probe = pod("probe", &[], &[]);
        let res = wait_until(DEADLINE, "the webhook configuration in force", || async {
            let p = api.create(&dry, &probe).await?;
            Ok::<_, crate::controlplane::Error>(sidecar(&p).map(|_| ()))
        })
        .await;
        res.map(|_| ()).map_err(|source| SetupError::NotEffective {
            source,
            log: self.operator.log_tail(),
        })
    }

    pub fn pods(&self, ns: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), ns)
    }

    pub async fn cleanup(self) -> Result<(), SetupError> {
        Api::<MutatingWebhookConfiguration>::all(self.client.clone())
            .delete(&self.mwc, &DeleteParams::default())
            .await?;
        let cp = ControlPlane::shared().await?;
        cp.delete_namespace(&self.client, &self.enabled).await?;
        cp.delete_namespace(&self.client, &self.plain).await?;
        Ok(())
    }
}

/// SidecarLifecycles of `ns`, untyped (tests send what the CRD may refuse).
pub fn lifecycles(client: &Client, ns: &str) -> Api<kube::api::DynamicObject> {
    let gvk = kube::api::GroupVersionKind::gvk("remora.dev", "v1alpha1", "SidecarLifecycle");
    Api::namespaced_with(client.clone(), ns, &kube::api::ApiResource::from_gvk(&gvk))
}

/// A SidecarLifecycle named `name` with `spec`.
pub fn lifecycle(
    name: &str,
    spec: serde_json::Value,
) -> Result<kube::api::DynamicObject, serde_json::Error> {
    serde_json::from_value(json!({
        "apiVersion": "remora.dev/v1alpha1",
        "kind": "SidecarLifecycle",
        "metadata": {"name": name},
        "spec": spec,
    }))
}

/// A Pod CREATE review of `pod` (a pod object as a client submits it).
pub fn pod_create_review(pod: &serde_json::Value, namespace: &str, uid: &str) -> serde_json::Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"],
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                         "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": pod,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        }
    })
}
