//! Renders `charts/remora` with the real `helm` (built by `scripts/setup.sh`
//! from the Go module proxy) into JSON objects, for tests that hand them to
//! the API server.

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Discovery, Scope};
use kube::{Api, Client};
use remora_test_support::wait::wait_until;
use serde_json::Value;

/// The field manager the harness installs the chart under, as a user's
/// `kubectl apply --server-side` would.
pub const FIELD_MANAGER: &str = "remora-e2e";
/// The helm release `scripts/setup.sh` installs; keep the two in step.
pub const HELM_VERSION: &str = "v3.22.0";
/// Names another helm binary.
pub const ENV_HELM_BIN: &str = "REMORA_HELM_BIN";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "helm not found at {0}: run scripts/setup.sh (it builds helm {HELM_VERSION}), or set {ENV_HELM_BIN}"
    )]
    MissingHelm(PathBuf),
    #[error("neither REMORA_CACHE nor HOME is set: cannot find helm")]
    NoCacheDir,
    #[error("running {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} failed ({status}):\n{stderr}")]
    Helm {
        what: String,
        status: String,
        stderr: String,
    },
    #[error("parsing YAML: {0}")]
    Yaml(String),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    ControlPlane(#[from] crate::controlplane::Error),
    #[error("rendered object: {0}")]
    Object(String),
}

/// `$REMORA_HELM_BIN`, else `${REMORA_CACHE:-$HOME/.cache/remora}/helm/<version>/helm`.
pub fn helm_bin() -> Result<PathBuf, Error> {
    let p = match std::env::var_os(ENV_HELM_BIN).filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => {
            let cache = match std::env::var_os("REMORA_CACHE").filter(|v| !v.is_empty()) {
                Some(c) => PathBuf::from(c),
                None => PathBuf::from(std::env::var_os("HOME").ok_or(Error::NoCacheDir)?)
                    .join(".cache/remora"),
            };
            cache.join("helm").join(HELM_VERSION).join("helm")
        }
    };
    if p.is_file() {
        Ok(p)
    } else {
        Err(Error::MissingHelm(p))
    }
}

/// `charts/remora` of this repository.
pub fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/remora")
}

/// `helm template <release> charts/remora --namespace <ns> --include-crds
/// --set k=v...`, as one JSON value per rendered object (in helm's order:
/// CRDs first).
pub fn render(release: &str, namespace: &str, sets: &[&str]) -> Result<Vec<Value>, Error> {
    render_with(release, namespace, sets, None)
}

/// `values-local.yaml`: the chart on a node without a registry (the local
/// images, never pulled), as the README, the demo and the node tests
/// install it.
pub fn local_values_file() -> PathBuf {
    chart_dir().join("values-local.yaml")
}

/// [`render`] with `-f values-local.yaml` before the `--set`s.
pub fn render_local(release: &str, namespace: &str, sets: &[&str]) -> Result<Vec<Value>, Error> {
    render_files(release, namespace, &[local_values_file()], sets, None)
}

/// [`render`], and with a kubeconfig `--dry-run=server --is-upgrade`: helm
/// then talks to that cluster, so the templates' `lookup` sees what is
/// installed, and renders as `helm upgrade` does.
pub fn render_with(
    release: &str,
    namespace: &str,
    sets: &[&str],
    kubeconfig: Option<&Path>,
) -> Result<Vec<Value>, Error> {
    render_files(release, namespace, &[], sets, kubeconfig)
}

fn render_files(
    release: &str,
    namespace: &str,
    files: &[PathBuf],
    sets: &[&str],
    kubeconfig: Option<&Path>,
) -> Result<Vec<Value>, Error> {
    let helm = helm_bin()?;
    let mut cmd = Command::new(&helm);
    cmd.arg("template")
        .arg(release)
        .arg(chart_dir())
        .arg("--namespace")
        .arg(namespace)
        .arg("--include-crds");
    if let Some(k) = kubeconfig {
        cmd.arg("--dry-run=server")
            .arg("--is-upgrade")
            .arg("--kubeconfig")
            .arg(k);
    }
    for f in files {
        cmd.arg("-f").arg(f);
    }
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    let what = format!(
        "helm template {release} ({}--set {})",
        files
            .iter()
            .map(|f| format!("-f {} ", f.display()))
            .collect::<String>(),
        sets.join(" --set ")
    );
    let out = cmd.output().map_err(|source| Error::Io {
        what: what.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(Error::Helm {
            what,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&text).map_err(|e| Error::Yaml(e.to_string()))?;
    // Empty documents (a template rendered to nothing) come back as null.
    Ok(docs.into_iter().filter(|d| d.is_object()).collect())
}

/// The rendered object of `kind`, named `name` when given.
pub fn find<'a>(objects: &'a [Value], kind: &str, name: Option<&str>) -> Option<&'a Value> {
    objects.iter().find(|o| {
        o["kind"] == kind && name.is_none_or(|n| o["metadata"]["name"].as_str() == Some(n))
    })
}

/// The generated CRD files of the chart (`charts/remora/crds/`, written by
/// `remora-operator crds` and held to it by a drift test in `crds/`).
pub fn crds() -> Result<Vec<CustomResourceDefinition>, Error> {
    let dir = chart_dir().join("crds");
    let mut out = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .map_err(|source| Error::Io {
            what: format!("listing {}", dir.display()),
            source,
        })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    entries.sort();
    for p in entries {
        let text = std::fs::read_to_string(&p).map_err(|source| Error::Io {
            what: format!("reading {}", p.display()),
            source,
        })?;
        let docs: Vec<CustomResourceDefinition> = serde_saphyr::from_multiple(&text)
            .map_err(|e| Error::Yaml(format!("{}: {e}", p.display())))?;
        out.extend(docs);
    }
    Ok(out)
}

/// Installs (server-side apply, idempotent, so parallel tests may all call
/// it) the chart's CRDs for real and waits until the API server serves them.
pub async fn install_crds(client: &Client) -> Result<Vec<String>, Error> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut names = Vec::new();
    for crd in crds()? {
        let name = crd.metadata.name.clone().unwrap_or_default();
        api.patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await?;
        names.push(name);
    }
    for name in &names {
        wait_until(
            std::time::Duration::from_secs(30),
            &format!("CRD {name} Established"),
            || async {
                let crd = api.get(name).await?;
                let established = crd
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True");
                Ok::<_, crate::controlplane::Error>(established.then_some(()))
            },
        )
        .await?;
    }
    Ok(names)
}

/// The chart's objects that make up the operator's identity and its
/// admission wiring: its ServiceAccount and RBAC, its webhook
/// configuration, the admission policy that holds it to Remora's fields.
pub const IDENTITY_KINDS: [&str; 8] = [
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "MutatingWebhookConfiguration",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
];

/// A cluster-scoped object [`apply`] made: its API and name, to delete it.
pub type ClusterScoped = (Api<DynamicObject>, String);

/// Server-side applies (field manager `remora-e2e`, forced) the rendered
/// objects of the given kinds, namespaced ones into `namespace`. A
/// MutatingWebhookConfiguration is first narrowed to `namespace`, which the
/// chart excludes, so the API server never calls it: tests that need the
/// chart's webhook configuration as an object do not make pods elsewhere
/// wait on an operator that is not there. Returns the cluster-scoped objects.
pub async fn apply(
    client: &Client,
    namespace: &str,
    objects: &[Value],
    kinds: &[&str],
) -> Result<Vec<ClusterScoped>, Error> {
    let discovery = Discovery::new(client.clone()).run().await?;
    let mut cluster_scoped = Vec::new();
    for obj in objects {
        let field = |o: &Value, f: &str| {
            o[f].as_str()
                .map(str::to_owned)
                .ok_or_else(|| Error::Object(format!("no {f} in {o}")))
        };
        let kind = field(obj, "kind")?;
        if !kinds.contains(&kind.as_str()) {
            continue;
        }
        let mut obj = obj.clone();
        if kind == "MutatingWebhookConfiguration" {
            for w in obj["webhooks"].as_array_mut().into_iter().flatten() {
                if let Some(exprs) = w["namespaceSelector"]["matchExpressions"].as_array_mut() {
                    exprs.push(serde_json::json!({
                        "key": "kubernetes.io/metadata.name", "operator": "In",
                        "values": [namespace]}));
                }
            }
        }
        let api_version = field(&obj, "apiVersion")?;
        let name = field(&obj["metadata"], "name")?;
        let (group, version) = api_version
            .split_once('/')
            .unwrap_or(("", api_version.as_str()));
        let (ar, caps) = discovery
            .resolve_gvk(&GroupVersionKind::gvk(group, version, &kind))
            .ok_or_else(|| Error::Object(format!("{api_version} {kind} is not served")))?;
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Namespaced => Api::namespaced_with(client.clone(), namespace, &ar),
            Scope::Cluster => Api::all_with(client.clone(), &ar),
        };
        let dynobj: DynamicObject = serde_json::from_value(obj)
            .map_err(|e| Error::Object(format!("{kind}/{name}: {e}")))?;
        api.patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&dynobj),
        )
        .await?;
        if caps.scope == Scope::Cluster {
            cluster_scoped.push((api, name));
        }
    }
    Ok(cluster_scoped)
}

/// Whether `e` is the API server refusing a request because of the
/// ValidatingAdmissionPolicy `policy` (403, its message names the policy).
pub fn refused_by_policy(e: &kube::Error, policy: &str) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403
        && s.message.contains(&format!("ValidatingAdmissionPolicy '{policy}'")))
}

/// Waits until `attempt`, a write that RBAC allows and the policy `policy`
/// refuses, is refused by that policy: RBAC bindings and policies take
/// effect a moment after they are created. Make `attempt` a dry run: before
/// the policy applies, it goes through.
pub async fn wait_until_policy_refuses<T, F, Fut>(policy: &str, mut attempt: F) -> Result<(), Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = kube::Result<T>>,
{
    wait_until(
        std::time::Duration::from_secs(60),
        &format!("ValidatingAdmissionPolicy {policy} in effect"),
        || {
            let fut = attempt();
            async move {
                match fut.await {
                    Err(e) if refused_by_policy(&e, policy) => Ok(Some(())),
                    // RBAC not yet in effect, or the policy not yet.
                    Err(kube::Error::Api(s)) if s.code == 403 => Ok(None),
                    Ok(_) => Ok(None),
                    Err(e) => Err(crate::controlplane::Error::from(e)),
                }
            }
        },
    )
    .await?;
    Ok(())
}
