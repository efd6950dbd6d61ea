//! Renders `charts/remora` with the real `helm` (built by `scripts/setup.sh`
//! from the Go module proxy) into JSON objects, for tests that hand them to
//! the API server.

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::Value;

use crate::controlplane::wait_until;

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

/// [`render`], and with a kubeconfig `--dry-run=server`: helm then talks to
/// that cluster, so the templates' `lookup` sees what is installed (as on
/// `helm upgrade`).
pub fn render_with(
    release: &str,
    namespace: &str,
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
        cmd.arg("--dry-run=server").arg("--kubeconfig").arg(k);
    }
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    let what = format!("helm template {release} (--set {})", sets.join(" --set "));
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
/// `remora-injector crds` and held to it by a drift test in `crds/`).
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
pub async fn install_crds(client: &kube::Client) -> Result<Vec<String>, Error> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut names = Vec::new();
    for crd in crds()? {
        let name = crd.metadata.name.clone().unwrap_or_default();
        api.patch(
            &name,
            &PatchParams::apply("remora-e2e").force(),
            &Patch::Apply(&crd),
        )
        .await?;
        names.push(name);
    }
    for name in &names {
        wait_until(
            &format!("CRD {name} Established"),
            std::time::Duration::from_secs(30),
            || async {
                let crd = api.get(name).await?;
                let established = crd
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True");
                Ok::<_, kube::Error>(established.then_some(()))
            },
        )
        .await?;
    }
    Ok(names)
}
