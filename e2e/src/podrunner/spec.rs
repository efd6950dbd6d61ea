//! The parts of a pod spec the runner acts on, read from the JSON/YAML that
//! `remora-operator inject` writes (a Pod, or a workload's pod template).

use std::time::Duration;

use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("not YAML or JSON: {0}")]
    Parse(String),
    #[error("no pod spec in a {0:?} document")]
    NoPodSpec(String),
    #[error("container #{index} has no name")]
    NoName { index: usize },
    #[error("container {container}: {reason}")]
    Container { container: String, reason: String },
}

/// An HTTP probe (`httpGet`); exec and TCP probes are not emulated.
#[derive(Debug, Clone)]
pub struct Probe {
    /// The port inside the pod (remapped by the runner).
    pub port: u16,
    pub path: String,
    pub period: Duration,
    pub timeout: Duration,
    pub failure_threshold: u32,
}

#[derive(Debug, Clone)]
pub enum EnvValue {
    Literal(String),
    /// `valueFrom.fieldRef.fieldPath`.
    Field(String),
}

#[derive(Debug, Clone)]
pub struct ContainerSpec {
    pub name: String,
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub env: Vec<(String, EnvValue)>,
    pub ports: Vec<u16>,
    pub readiness: Option<Probe>,
    pub startup: Option<Probe>,
    pub post_start: Option<Vec<String>>,
    pub pre_stop: Option<Vec<String>>,
    /// An init container with `restartPolicy: Always` (a native sidecar).
    pub sidecar: bool,
    /// `volumeMounts`: `(volume name, mountPath)`.
    pub mounts: Vec<(String, String)>,
}

/// The pod's `restartPolicy`, for its regular containers (a native sidecar
/// is always restarted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RestartPolicy {
    #[default]
    Always,
    OnFailure,
    Never,
}

#[derive(Debug, Clone)]
pub struct PodSpec {
    pub name: String,
    pub namespace: String,
    pub annotations: Vec<(String, String)>,
    pub init_containers: Vec<ContainerSpec>,
    pub containers: Vec<ContainerSpec>,
    pub grace: Duration,
    /// Secret volumes: `(volume name, secretName)`. Other volume types are
    /// not materialized (an `emptyDir` is the pod directory).
    pub secret_volumes: Vec<(String, String)>,
    pub restart_policy: RestartPolicy,
}

impl PodSpec {
    /// The first Pod, or pod template of a workload, in a YAML stream.
    pub fn from_yaml(text: &str) -> Result<Self, SpecError> {
        for doc in text.split("\n---") {
            if doc.trim().trim_start_matches("---").trim().is_empty() {
                continue;
            }
            let v: Value =
                serde_saphyr::from_str(doc).map_err(|e| SpecError::Parse(e.to_string()))?;
            return Self::from_value(&v);
        }
        Err(SpecError::Parse("empty input".into()))
    }

    pub fn from_value(doc: &Value) -> Result<Self, SpecError> {
        let kind = doc["kind"].as_str().unwrap_or("").to_string();
        let (meta, spec) = if kind == "Pod" {
            (&doc["metadata"], &doc["spec"])
        } else if doc["spec"]["jobTemplate"].is_object() {
            let t = &doc["spec"]["jobTemplate"]["spec"]["template"];
            (&t["metadata"], &t["spec"])
        } else {
            let t = &doc["spec"]["template"];
            (&t["metadata"], &t["spec"])
        };
        if !spec["containers"].is_array() {
            return Err(SpecError::NoPodSpec(kind));
        }
        let name = meta["name"]
            .as_str()
            .or(doc["metadata"]["name"].as_str())
            .unwrap_or("pod")
            .to_string();
        let namespace = doc["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let annotations = meta["annotations"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default();
        let list = |key: &str| -> Result<Vec<ContainerSpec>, SpecError> {
            spec[key]
                .as_array()
                .map(|a| a.as_slice())
                .unwrap_or_default()
                .iter()
                .enumerate()
                .map(|(i, c)| container(i, c))
                .collect()
        };
        let grace = spec["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
        let restart_policy = match spec["restartPolicy"].as_str() {
            None | Some("Always") => RestartPolicy::Always,
            Some("OnFailure") => RestartPolicy::OnFailure,
            Some("Never") => RestartPolicy::Never,
            Some(other) => {
                return Err(SpecError::Parse(format!("unknown restartPolicy {other:?}")));
            }
        };
        let secret_volumes = spec["volumes"]
            .as_array()
            .map(|a| a.as_slice())
            .unwrap_or_default()
            .iter()
            .filter_map(|v| {
                let name = v["name"].as_str()?;
                let secret = v["secret"]["secretName"].as_str()?;
                Some((name.to_string(), secret.to_string()))
            })
            .collect();
        Ok(Self {
            name,
            namespace,
            annotations,
            init_containers: list("initContainers")?,
            containers: list("containers")?,
            grace: Duration::from_secs(grace),
            secret_volumes,
            restart_policy,
        })
    }

    /// Native mode: some init container is a restartable sidecar.
    pub fn native(&self) -> bool {
        self.init_containers.iter().any(|c| c.sidecar)
    }

    /// Every port the pod uses: declared container ports and probe ports.
    pub fn ports(&self) -> Vec<u16> {
        let mut out: Vec<u16> = self
            .init_containers
            .iter()
            .chain(&self.containers)
            .flat_map(|c| {
                c.ports
                    .iter()
                    .copied()
                    .chain(c.readiness.as_ref().map(|p| p.port))
                    .chain(c.startup.as_ref().map(|p| p.port))
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| match s {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect()
        })
        .unwrap_or_default()
}

fn port_of(v: &Value, ports: &[(String, u16)]) -> Option<u16> {
    match v {
        Value::Number(n) => n.as_u64().and_then(|p| u16::try_from(p).ok()),
        Value::String(s) => s.parse().ok().or_else(|| {
            ports
                .iter()
                .find(|(name, _)| name == s)
                .map(|(_, port)| *port)
        }),
        _ => None,
    }
}

fn probe(v: &Value, ports: &[(String, u16)], name: &str) -> Result<Option<Probe>, SpecError> {
    if v.is_null() {
        return Ok(None);
    }
    let get = &v["httpGet"];
    if !get.is_object() {
        return Err(SpecError::Container {
            container: name.into(),
            reason: "only httpGet probes are emulated".into(),
        });
    }
    let port = port_of(&get["port"], ports).ok_or_else(|| SpecError::Container {
        container: name.into(),
        reason: format!("probe port {} is not a port", get["port"]),
    })?;
    let secs = |key: &str, default: u64| Duration::from_secs(v[key].as_u64().unwrap_or(default));
    Ok(Some(Probe {
        port,
        path: get["path"].as_str().unwrap_or("/").to_string(),
        period: secs("periodSeconds", 10),
        timeout: secs("timeoutSeconds", 1),
        failure_threshold: u32::try_from(v["failureThreshold"].as_u64().unwrap_or(3))
            .unwrap_or(u32::MAX),
    }))
}

fn container(index: usize, c: &Value) -> Result<ContainerSpec, SpecError> {
    let name = c["name"]
        .as_str()
        .ok_or(SpecError::NoName { index })?
        .to_string();
    let named_ports: Vec<(String, u16)> = c["ports"]
        .as_array()
        .map(|a| a.as_slice())
        .unwrap_or_default()
        .iter()
        .filter_map(|p| {
            let port = u16::try_from(p["containerPort"].as_u64()?).ok()?;
            Some((p["name"].as_str().unwrap_or("").to_string(), port))
        })
        .collect();
    let env = c["env"]
        .as_array()
        .map(|a| a.as_slice())
        .unwrap_or_default()
        .iter()
        .filter_map(|e| {
            let key = e["name"].as_str()?.to_string();
            let val = if let Some(path) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                EnvValue::Field(path.to_string())
            } else {
                EnvValue::Literal(e["value"].as_str().unwrap_or_default().to_string())
            };
            Some((key, val))
        })
        .collect();
    let hook = |which: &str| {
        let cmd = strings(&c["lifecycle"][which]["exec"]["command"]);
        (!cmd.is_empty()).then_some(cmd)
    };
    Ok(ContainerSpec {
        image: c["image"].as_str().unwrap_or_default().to_string(),
        command: strings(&c["command"]),
        args: strings(&c["args"]),
        env,
        ports: named_ports.iter().map(|(_, p)| *p).collect(),
        readiness: probe(&c["readinessProbe"], &named_ports, &name)?,
        startup: probe(&c["startupProbe"], &named_ports, &name)?,
        post_start: hook("postStart"),
        pre_stop: hook("preStop"),
        sidecar: c["restartPolicy"].as_str() == Some("Always"),
        mounts: c["volumeMounts"]
            .as_array()
            .map(|a| a.as_slice())
            .unwrap_or_default()
            .iter()
            .filter_map(|m| {
                Some((
                    m["name"].as_str()?.to_string(),
                    m["mountPath"].as_str()?.to_string(),
                ))
            })
            .collect(),
        name,
    })
}
