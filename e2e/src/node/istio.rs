//! Istio's real sidecar (pilot-agent and the same Envoy 1.40.0 as Remora's,
//! image `localhost/remora/istio-proxy`, `scripts/images.sh istio-proxy`)
//! added to an app's pod template the way Istio 1.31's operator adds it,
//! and run without istiod: the peer contender of the lifecycle benchmark
//! (issue 12, `../shared/PEERS.md`).
//!
//! The sidecar is what Istio's injection template
//! (`manifests/charts/istio-control/istio-discovery/files/injection-template.yaml`
//! at the pinned `istio.io/istio` version) and `pkg/kube/inject/webhook.go`
//! (`reorderPod`, `DetectNativeSidecar`) produce with the chart's default
//! values, for every field that plays in a pod's start and stop: where the
//! container goes, its args, env, probes, hooks, ProxyConfig, security
//! context, resources and volumes. Left out, because nothing here uses
//! them: the `istio-init` iptables container (the app calls the outbound
//! listener by address, as with Remora's static mode), the istiod token
//! and CA ConfigMap volumes, app-probe rewriting (the test app has no
//! probes), labels and annotations other than the default container.
//!
//! Without istiod, Envoy reads its listeners and clusters from files the
//! image's bootstrap template points at (`images/istio-proxy/file-xds.sed`),
//! written by [`inject`] into a ConfigMap: an INBOUND HTTP listener in front
//! of the app and OUTBOUND TCP listeners, the port convention of Remora's
//! static mode. The workload certificate comes as files from a Secret
//! (pilot-agent then skips its CA). No address in the config is a host
//! name: nothing resolves DNS, and `CLOUD_PLATFORM=none` stops pilot-agent's
//! cloud metadata probes, so the sidecar talks to nothing off the machine.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, PodTemplateSpec, Secret};
use kube::Client;
use kube::api::{ObjectMeta, PostParams};
use serde_json::{Value, json};

use super::pods::{PodProcess, pod_processes};
use super::workloads::container_status;

/// The image `scripts/images.sh istio-proxy` builds and imports.
pub const IMAGE: &str = "localhost/remora/istio-proxy";
/// The sidecar container's name, Istio's.
pub const PROXY_CONTAINER: &str = "istio-proxy";
/// The inbound listener a Service targets (Istio's and Remora's).
pub const INBOUND_PORT: u16 = 15006;
/// The usual outbound listener port (Istio's virtualOutbound).
pub const OUTBOUND_PORT: u16 = 15001;
/// Envoy's admin, on the pod's loopback.
pub const ADMIN_PORT: u16 = 15000;
/// pilot-agent's status server (`/drain`, `/quitquitquit`, app probes).
pub const STATUS_PORT: u16 = 15020;
/// Envoy's health listener, proxied to the agent's readiness: the probes'.
pub const HEALTH_PORT: u16 = 15021;
/// Envoy's Prometheus listener.
pub const PROMETHEUS_PORT: u16 = 15090;
/// Where the image's bootstrap template reads LDS/CDS from
/// (`images/istio-proxy/file-xds.sed`: keep them in step).
const XDS_DIR: &str = "/etc/istio/xds";
const LDS_FILE: &str = "lds.json";
const CDS_FILE: &str = "cds.json";
/// Where pilot-agent looks for file-mounted certificates, relative to its
/// working directory `/` (`pkg/security`: WorkloadIdentityCredentialsPath).
const CREDENTIALS_DIR: &str = "/var/run/secrets/workload-spiffe-credentials";
/// Istio's ProxyUID/ProxyGID.
const PROXY_UID: i64 = 1337;
/// Istio's own default discovery and CA address is
/// `istiod.istio-system.svc:15012`, a name: loopback instead, where nothing
/// listens, so that nothing resolves or dials out. Envoy never asks (no
/// ADS in the template) and file certificates make the agent skip its CA.
const NO_ISTIOD: &str = "127.0.0.1:15012";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the pod template {0}")]
    Template(String),
    #[error("building {what}: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Node(#[from] super::Error),
    #[error(
        "image {0} is not in the node's containerd: run `scripts/images.sh istio-proxy` (it builds pilot-agent with scripts/build-pilot-agent.sh, ~2 min cold)"
    )]
    NoImage(String),
    #[error("pod {pod}: {detail}")]
    Pod { pod: String, detail: String },
}

/// Which sidecar Istio 1.31 would inject, and with which lifecycle settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// Istio 1.31's defaults on this cluster. `ENABLE_NATIVE_SIDECARS`
    /// defaults to `auto`, which injects a native sidecar when every
    /// kubelet is 1.33 or later (`DetectNativeSidecar`): here (1.36) an
    /// init container with `restartPolicy: Always`, a startupProbe, and a
    /// preStop hook `pilot-agent request POST drain`; drainDuration 45 s,
    /// terminationDrainDuration 5 s, Envoy's `--drain-strategy immediate`.
    Defaults,
    /// Istio's lifecycle options for startup and exit on top of the native
    /// sidecar of [`Profile::Defaults`]: `holdApplicationUntilProxyStarts` and
    /// `EXIT_ON_ZERO_ACTIVE_CONNECTIONS=true` (MINIMUM_DRAIN_DURATION left
    /// at its default, 5 s). For a native sidecar the hold changes nothing
    /// in the pod (the startupProbe holds the app already; the template
    /// adds the postStart hook only to a regular container), and the
    /// preStop drain makes the agent exit at once on its SIGTERM, so
    /// exit-on-zero never runs (`pkg/envoy/agent.go`, `terminate`).
    NativeHold,
    /// What 1.31 injects with native sidecars off (`ENABLE_NATIVE_SIDECARS=false`,
    /// or a kubelet older than 1.33): a regular container, last, no hooks;
    /// on SIGTERM the agent drains and stops Envoy after
    /// terminationDrainDuration (5 s).
    LegacyDefaults,
    /// A regular container with holdApplicationUntilProxyStarts (first in
    /// the pod, postStart `pilot-agent wait`) and exit-on-zero: the
    /// lifecycle options Istio documents for a regular-container sidecar.
    /// Neither hold profile is tuned for ingress lag: that is
    /// `zero_loss::Contender::IstioTunedForLag`.
    LegacyHold,
}

impl Profile {
    pub const ALL: [Self; 4] = [
        Self::Defaults,
        Self::NativeHold,
        Self::LegacyDefaults,
        Self::LegacyHold,
    ];

    /// A short name for reports and object names.
    pub fn name(self) -> &'static str {
        match self {
            Self::Defaults => "istio-defaults",
            Self::NativeHold => "istio-native-hold",
            Self::LegacyDefaults => "istio-legacy-defaults",
            Self::LegacyHold => "istio-legacy-hold",
        }
    }

    /// A native sidecar (an init container that keeps running).
    pub fn native(self) -> bool {
        matches!(self, Self::Defaults | Self::NativeHold)
    }

    /// `holdApplicationUntilProxyStarts` in the ProxyConfig.
    pub fn hold(self) -> bool {
        matches!(self, Self::NativeHold | Self::LegacyHold)
    }

    /// `EXIT_ON_ZERO_ACTIVE_CONNECTIONS=true` (a proxyMetadata env).
    pub fn exit_on_zero(self) -> bool {
        matches!(self, Self::NativeHold | Self::LegacyHold)
    }
}

/// An outbound listener: the app connects to `127.0.0.1:port`, Envoy
/// proxies (TCP, as Remora's outbound listeners) to `host:upstream_port`.
/// An IP, never a name: no DNS (see the module doc).
#[derive(Debug, Clone)]
pub struct Outbound {
    pub port: u16,
    pub host: IpAddr,
    pub upstream_port: u16,
}

/// The sidecar to add: its profile, the app port behind the inbound
/// listener, the outbound listeners.
#[derive(Debug, Clone)]
pub struct Sidecar {
    /// Prefix of the ConfigMap and Secret; also the workload name Istio
    /// takes from the Deployment.
    pub name: String,
    pub profile: Profile,
    /// The app's port, on the pod's loopback.
    pub app_port: u16,
    /// The inbound listener's port ([`INBOUND_PORT`] by default).
    pub inbound_port: u16,
    pub outbound: Vec<Outbound>,
}

impl Sidecar {
    pub fn new(name: &str, profile: Profile, app_port: u16) -> Self {
        Self {
            name: name.to_owned(),
            profile,
            app_port,
            inbound_port: INBOUND_PORT,
            outbound: Vec::new(),
        }
    }

    #[must_use]
    pub fn outbound(mut self, port: u16, host: IpAddr, upstream_port: u16) -> Self {
        self.outbound.push(Outbound {
            port,
            host,
            upstream_port,
        });
        self
    }

    /// The ConfigMap with the LDS/CDS files.
    pub fn config_map_name(&self) -> String {
        format!("{}-istio-xds", self.name)
    }

    /// The Secret with the certificate files.
    pub fn secret_name(&self) -> String {
        format!("{}-istio-certs", self.name)
    }
}

/// A pod template with the sidecar, and the objects it mounts (create them
/// first: [`Injected::create_objects`]).
#[derive(Debug, Clone)]
pub struct Injected {
    pub template: PodTemplateSpec,
    pub config_map: ConfigMap,
    pub secret: Secret,
}

impl Injected {
    /// Creates the ConfigMap and the Secret in `namespace`.
    pub async fn create_objects(&self, client: &Client, namespace: &str) -> Result<(), Error> {
        let pp = PostParams::default();
        kube::Api::<ConfigMap>::namespaced(client.clone(), namespace)
            .create(&pp, &self.config_map)
            .await?;
        kube::Api::<Secret>::namespaced(client.clone(), namespace)
            .create(&pp, &self.secret)
            .await?;
        Ok(())
    }
}

fn json_err(what: &str) -> impl FnOnce(serde_json::Error) -> Error + '_ {
    move |source| Error::Json {
        what: what.to_owned(),
        source,
    }
}

/// `template` with Istio's sidecar per `sidecar`, and its ConfigMap and
/// Secret. The template is otherwise untouched (the app's own containers,
/// grace period and security context stay as they are).
pub fn inject(template: &PodTemplateSpec, sidecar: &Sidecar) -> Result<Injected, Error> {
    let mut pod = serde_json::to_value(template).map_err(json_err("the pod template"))?;
    let spec = pod
        .get_mut("spec")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| Error::Template("has no spec".into()))?;
    let containers = spec
        .get("containers")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let app_names: Vec<String> = containers
        .iter()
        .filter_map(|c| c.get("name").and_then(Value::as_str))
        .filter(|n| *n != PROXY_CONTAINER)
        .map(str::to_owned)
        .collect();
    let first_app = app_names
        .first()
        .ok_or_else(|| Error::Template("has no app container".into()))?
        .clone();
    let pod_ports: Vec<Value> = containers
        .iter()
        .flat_map(|c| c.get("ports").and_then(Value::as_array).cloned())
        .flatten()
        .collect();
    let proxy = proxy_container(sidecar, &app_names, &pod_ports)?;

    // Placement (`reorderPod`): a native sidecar first among the init
    // containers; a regular one last, or first with the hold.
    let key = if sidecar.profile.native() {
        "initContainers"
    } else {
        "containers"
    };
    let list = spec
        .entry(key)
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or_else(|| Error::Template(format!("has a {key} that is not a list")))?;
    if sidecar.profile.native() || sidecar.profile.hold() {
        list.insert(0, proxy);
    } else {
        list.push(proxy);
    }
    let volumes = spec
        .entry("volumes")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or_else(|| Error::Template("has volumes that are not a list".into()))?;
    volumes.extend(proxy_volumes(sidecar));

    let annotations = pod
        .as_object_mut()
        .and_then(|m| {
            m.entry("metadata")
                .or_insert_with(|| json!({}))
                .as_object_mut()
        })
        .map(|m| m.entry("annotations").or_insert_with(|| json!({})));
    if let Some(Value::Object(a)) = annotations {
        // As the template sets them: kubectl picks the app, not the proxy.
        for k in [
            "kubectl.kubernetes.io/default-container",
            "kubectl.kubernetes.io/default-logs-container",
        ] {
            a.entry(k).or_insert_with(|| json!(first_app));
        }
    }

    Ok(Injected {
        template: serde_json::from_value(pod).map_err(json_err("the injected pod template"))?,
        config_map: xds_config_map(sidecar)?,
        secret: cert_secret(sidecar),
    })
}

/// Istio's `PROXY_CONFIG` (ProxyConfig as JSON): the mesh defaults
/// (`pkg/config/mesh.DefaultProxyConfig`) written out, istiod pointed at
/// loopback, and the hold when the profile has it. Concurrency is left
/// unset, as Istio leaves it: the agent takes the CPU limit (2).
fn proxy_config(profile: Profile) -> Value {
    let mut pc = json!({
        "configPath": "./etc/istio/proxy",
        "binaryPath": "/usr/local/bin/envoy",
        "serviceCluster": "istio-proxy",
        "drainDuration": "45s",
        "terminationDrainDuration": "5s",
        "discoveryAddress": NO_ISTIOD,
        // Envoy has no ADS to secure: nothing to authenticate.
        "controlPlaneAuthPolicy": "NONE",
        "proxyAdminPort": ADMIN_PORT,
        "statNameLength": 189,
        "statusPort": STATUS_PORT
    });
    if profile.hold() {
        pc["holdApplicationUntilProxyStarts"] = json!(true);
    }
    pc
}

fn env(name: &str, value: &str) -> Value {
    json!({"name": name, "value": value})
}

fn field_env(name: &str, path: &str) -> Value {
    json!({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}})
}

fn resource_env(name: &str, resource: &str) -> Value {
    json!({"name": name, "valueFrom": {"resourceFieldRef": {"resource": resource, "divisor": "1"}}})
}

fn ready_probe(period: i32, failure_threshold: i32) -> Value {
    json!({
        "httpGet": {"path": "/healthz/ready", "port": HEALTH_PORT},
        "initialDelaySeconds": 0,
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failure_threshold
    })
}

fn proxy_container(
    sidecar: &Sidecar,
    app_names: &[String],
    pod_ports: &[Value],
) -> Result<Value, Error> {
    let profile = sidecar.profile;
    let pod_ports = serde_json::to_string(pod_ports).map_err(json_err("ISTIO_META_POD_PORTS"))?;
    let proxy_config =
        serde_json::to_string(&proxy_config(profile)).map_err(json_err("PROXY_CONFIG"))?;
    let mut envs = vec![
        env("PILOT_CERT_PROVIDER", "istiod"),
        env("CA_ADDR", NO_ISTIOD),
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
        field_env("INSTANCE_IP", "status.podIP"),
        field_env("SERVICE_ACCOUNT", "spec.serviceAccountName"),
        field_env("HOST_IP", "status.hostIP"),
        resource_env("ISTIO_CPU_LIMIT", "limits.cpu"),
        env("PROXY_CONFIG", &proxy_config),
        env("ISTIO_META_POD_PORTS", &pod_ports),
        env("ISTIO_META_APP_CONTAINERS", &app_names.join(",")),
        resource_env("GOMEMLIMIT", "limits.memory"),
        resource_env("GOMAXPROCS", "limits.cpu"),
        env("ISTIO_META_CLUSTER_ID", "Kubernetes"),
        field_env("ISTIO_META_NODE_NAME", "spec.nodeName"),
        env("ISTIO_META_INTERCEPTION_MODE", "REDIRECT"),
        env("ISTIO_META_WORKLOAD_NAME", &sidecar.name),
        env("ISTIO_META_MESH_ID", "cluster.local"),
        env("TRUST_DOMAIN", "cluster.local"),
        // Not Istio's: no cloud metadata probes, no DNS proxy (PEERS.md).
        env("CLOUD_PLATFORM", "none"),
        env("ISTIO_META_DNS_CAPTURE", "false"),
    ];
    if profile.exit_on_zero() {
        // A proxyMetadata entry, which the template turns into env.
        envs.push(env("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true"));
    }

    let mut c = json!({
        "name": PROXY_CONTAINER,
        "image": format!("{IMAGE}:{}", super::image_tag()),
        "imagePullPolicy": "Never",
        "ports": [{"containerPort": PROMETHEUS_PORT, "protocol": "TCP", "name": "http-envoy-prom"}],
        "args": [
            "proxy", "sidecar",
            "--domain", "$(POD_NAMESPACE).svc.cluster.local",
            "--proxyLogLevel=warning",
            "--proxyComponentLogLevel=misc:error",
            "--log_output_level=default:info"
        ],
        "env": envs,
        // The chart's startupProbe is on in both placements (1 s polls,
        // 10 min); readiness every 15 s, 4 failures.
        "startupProbe": ready_probe(1, 600),
        "readinessProbe": ready_probe(15, 4),
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"]},
            "privileged": false,
            "readOnlyRootFilesystem": true,
            "runAsNonRoot": true,
            "runAsUser": PROXY_UID,
            "runAsGroup": PROXY_UID
        },
        // global.proxy.resources; the CPU limit is also the concurrency (2).
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"cpu": "2000m", "memory": "1024Mi"}
        },
        "volumeMounts": [
            {"name": "workload-socket", "mountPath": "/var/run/secrets/workload-spiffe-uds"},
            {"name": "credential-socket", "mountPath": "/var/run/secrets/credential-uds"},
            {"name": "workload-certs", "mountPath": CREDENTIALS_DIR, "readOnly": true},
            {"name": "istio-data", "mountPath": "/var/lib/istio/data"},
            {"name": "istio-envoy", "mountPath": "/etc/istio/proxy"},
            {"name": "istio-podinfo", "mountPath": "/etc/istio/pod"},
            {"name": "istio-xds", "mountPath": XDS_DIR, "readOnly": true}
        ]
    });
    if profile.native() {
        c["restartPolicy"] = json!("Always");
        // "preStop is called when the pod starts shutdown. Initialize
        // drain. We will get SIGTERM once applications are torn down."
        c["lifecycle"] = json!({"preStop": {"exec": {"command": [
            "pilot-agent", "request", format!("--debug-port={STATUS_PORT}"), "POST", "drain"
        ]}}});
    } else if profile.hold() {
        c["lifecycle"] = json!({"postStart": {"exec": {"command": ["pilot-agent", "wait"]}}});
    }
    Ok(c)
}

fn proxy_volumes(sidecar: &Sidecar) -> Vec<Value> {
    vec![
        json!({"name": "workload-socket", "emptyDir": {}}),
        json!({"name": "credential-socket", "emptyDir": {}}),
        // Istio's is an emptyDir the agent fills from its CA; here the
        // files come ready-made.
        json!({"name": "workload-certs", "secret": {"secretName": sidecar.secret_name()}}),
        json!({"name": "istio-envoy", "emptyDir": {"medium": "Memory"}}),
        json!({"name": "istio-data", "emptyDir": {}}),
        json!({"name": "istio-podinfo", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}
        ]}}),
        json!({"name": "istio-xds", "configMap": {"name": sidecar.config_map_name()}}),
    ]
}

fn socket_address(address: &str, port: u16) -> Value {
    json!({"socket_address": {"address": address, "port_value": port}})
}

fn static_cluster(name: &str, ip: &str, port: u16) -> Value {
    json!({
        "@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster",
        "name": name,
        "type": "STATIC",
        // Istio's default connectTimeout.
        "connect_timeout": "10s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(ip, port)}}]}]
        }
    })
}

/// The LDS and CDS files (discovery responses, JSON).
pub fn xds_files(sidecar: &Sidecar) -> (Value, Value) {
    let inbound_cluster = format!("inbound|{}||", sidecar.app_port);
    let mut inbound = static_cluster(&inbound_cluster, "127.0.0.1", sidecar.app_port);
    // HTTP/1.1 in, HTTP/1.1 to the app; h2c (gRPC) in, h2c to the app.
    inbound["typed_extension_protocol_options"] = json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "use_downstream_protocol_config": {
                "http_protocol_options": {},
                "http2_protocol_options": {}
            }
        }
    });
    let name = format!("inbound_{}", sidecar.inbound_port);
    let mut listeners = vec![json!({
        "@type": "type.googleapis.com/envoy.config.listener.v3.Listener",
        "name": name,
        "address": socket_address("0.0.0.0", sidecar.inbound_port),
        // What pilot-agent's drain (`drain_listeners?inboundonly`) drains.
        "traffic_direction": "INBOUND",
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": name,
                "codec_type": "AUTO",
                "route_config": {
                    "name": name,
                    "virtual_hosts": [{
                        "name": "app",
                        "domains": ["*"],
                        // Istio's default: no route timeout.
                        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": inbound_cluster, "timeout": "0s"}}]
                    }]
                },
                "http_filters": [{
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
                }]
            }
        }]}]
    })];
    let mut clusters = vec![inbound];
    for o in &sidecar.outbound {
        let cluster = format!("outbound|{}||{}", o.upstream_port, o.host);
        clusters.push(static_cluster(
            &cluster,
            &o.host.to_string(),
            o.upstream_port,
        ));
        let name = format!("outbound_{}", o.port);
        listeners.push(json!({
            "@type": "type.googleapis.com/envoy.config.listener.v3.Listener",
            "name": name,
            "address": socket_address("127.0.0.1", o.port),
            "traffic_direction": "OUTBOUND",
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.tcp_proxy",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                    "stat_prefix": name,
                    "cluster": cluster
                }
            }]}]
        }));
    }
    (
        json!({"version_info": "1", "resources": listeners}),
        json!({"version_info": "1", "resources": clusters}),
    )
}

fn meta(name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        ..ObjectMeta::default()
    }
}

fn xds_config_map(sidecar: &Sidecar) -> Result<ConfigMap, Error> {
    let (lds, cds) = xds_files(sidecar);
    let text = |v: &Value, what| serde_json::to_string_pretty(v).map_err(json_err(what));
    Ok(ConfigMap {
        metadata: meta(sidecar.config_map_name()),
        data: Some(BTreeMap::from([
            (LDS_FILE.to_owned(), text(&lds, "the LDS file")?),
            (CDS_FILE.to_owned(), text(&cds, "the CDS file")?),
        ])),
        ..ConfigMap::default()
    })
}

/// `cert-chain.pem`, `key.pem`, `root-cert.pem` from a fresh test root,
/// valid for an hour: a sidecar that serves plain HTTP only needs them to
/// exist (pilot-agent exits without a certificate source).
fn cert_secret(sidecar: &Sidecar) -> Secret {
    let pki = crate::certs::Pki::new(
        "remora-istio-peer-root",
        "spiffe://cluster.local/ns/remora-e2e/sa/client",
    );
    let key = remora_test_support::pki::new_key();
    let id = format!("spiffe://cluster.local/ns/remora-e2e/sa/{}", sidecar.name);
    let serving = pki.serving(1, &key, &[], &id);
    Secret {
        metadata: meta(sidecar.secret_name()),
        data: Some(
            serving
                .files
                .into_iter()
                .map(|(k, v)| (k, ByteString(v)))
                .collect(),
        ),
        ..Secret::default()
    }
}

/// The `istio.io/istio` pseudo-version `scripts/build-pilot-agent.sh`
/// builds (`$ISTIO_VERSION`, else the default `scripts/lib/istio-module.sh`
/// sets), for results files.
pub fn version() -> String {
    if let Ok(v) = std::env::var("ISTIO_VERSION") {
        return v;
    }
    let script = super::repo_root().join(VERSION_SCRIPT);
    std::fs::read_to_string(&script)
        .ok()
        .and_then(|s| default_version(&s))
        .unwrap_or_else(|| format!("unknown (no default in {})", script.display()))
}

const VERSION_SCRIPT: &str = "scripts/lib/istio-module.sh";

fn default_version(script: &str) -> Option<String> {
    script.lines().find_map(|l| {
        l.strip_prefix("ISTIO_VERSION=\"${ISTIO_VERSION:-")
            .and_then(|rest| rest.strip_suffix("}\""))
            .map(str::to_owned)
    })
}

/// Fails with how to build it when the image is not in the node's
/// containerd (asked with `ctr`, as `scripts/images.sh` imports).
pub async fn require_image() -> Result<(), Error> {
    let image = format!("{IMAGE}:{}", super::image_tag());
    let env = super::run(
        "scripts/build-k8s.sh --print-env",
        tokio::process::Command::new("bash")
            .args(["scripts/build-k8s.sh", "--print-env"])
            .current_dir(super::repo_root()),
    )
    .await?;
    let bin_dir = env
        .lines()
        .find_map(|l| l.strip_prefix("REMORA_CONTAINERD_BIN_DIR="))
        .ok_or_else(|| {
            Error::Node(super::Error::Failed {
                what: "scripts/build-k8s.sh --print-env".into(),
                detail: format!("no REMORA_CONTAINERD_BIN_DIR in {env:?}"),
            })
        })?;
    let socket = super::cluster_dir().join("containerd/containerd.sock");
    let listed = super::run(
        "ctr images ls",
        tokio::process::Command::new(format!("{bin_dir}/ctr"))
            .arg("--address")
            .arg(&socket)
            .args(["-n", "k8s.io", "images", "ls", "-q"])
            .arg(format!("name=={image}")),
    )
    .await?;
    if listed.lines().any(|l| l.trim() == image) {
        Ok(())
    } else {
        Err(Error::NoImage(image))
    }
}

/// pilot-agent and the Envoy it started, in the pod's sidecar container,
/// as the host sees them.
#[derive(Debug, Clone)]
pub struct SidecarProcesses {
    pub agent: PodProcess,
    pub envoy: PodProcess,
}

/// The sidecar's processes (pilot-agent's `proxy sidecar`, and Envoy);
/// Envoy's argv is the command line pilot-agent gave it.
pub fn sidecar_processes(pod: &Pod) -> Result<SidecarProcesses, Error> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let fail = |detail: String| Error::Pod {
        pod: name.clone(),
        detail,
    };
    let id = container_status(pod, PROXY_CONTAINER)
        .and_then(|s| s.container_id.clone())
        .ok_or_else(|| fail(format!("no containerID for {PROXY_CONTAINER}")))?;
    let uid = pod
        .metadata
        .uid
        .as_deref()
        .ok_or_else(|| fail("no uid".into()))?;
    let procs: Vec<PodProcess> = pod_processes(uid)?
        .into_iter()
        .filter(|p| p.in_container(&id))
        .collect();
    let pick = |what: &str, f: &dyn Fn(&PodProcess) -> bool| {
        let found: Vec<&PodProcess> = procs.iter().filter(|p| f(p)).collect();
        match found[..] {
            [p] => Ok(p.clone()),
            _ => Err(fail(format!(
                "want one {what} process in {PROXY_CONTAINER}, found {found:?} among {procs:?}"
            ))),
        }
    };
    Ok(SidecarProcesses {
        agent: pick("pilot-agent", &|p| p.program() == "pilot-agent")?,
        envoy: pick("envoy", &|p| p.program() == "envoy")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_read_from_the_build_script() {
        let script =
            std::fs::read_to_string(super::super::repo_root().join(VERSION_SCRIPT)).unwrap();
        let v = default_version(&script).expect("a default ISTIO_VERSION");
        assert!(v.starts_with("v0.0.0-2") && v.len() > 20, "{v}");
        assert_eq!(default_version("ISTIO_VERSION=1.0\n"), None);
    }

    fn app() -> PodTemplateSpec {
        serde_json::from_value(json!({
            "metadata": {"labels": {"app": "web"}},
            "spec": {"containers": [{"name": "app", "image": "x", "ports": [{"containerPort": 8080}]}]}
        }))
        .expect("template")
    }

    fn proxy(t: &PodTemplateSpec) -> (&'static str, usize, k8s_openapi::api::core::v1::Container) {
        let spec = t.spec.as_ref().expect("spec");
        for (place, list) in [
            (
                "initContainers",
                spec.init_containers.clone().unwrap_or_default(),
            ),
            ("containers", spec.containers.clone()),
        ] {
            if let Some(i) = list.iter().position(|c| c.name == PROXY_CONTAINER) {
                return (place, i, list[i].clone());
            }
        }
        panic!("no proxy in {t:?}");
    }

    fn env_of(c: &k8s_openapi::api::core::v1::Container, name: &str) -> Option<String> {
        c.env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    }

    #[test]
    fn placement_hooks_and_env_follow_the_profile() {
        let ip: IpAddr = "10.96.0.10".parse().expect("ip");
        for profile in Profile::ALL {
            let s = Sidecar::new("web", profile, 8080).outbound(OUTBOUND_PORT, ip, 80);
            let out = inject(&app(), &s).expect("inject");
            let (place, index, c) = proxy(&out.template);
            let hooks = c.lifecycle.clone().unwrap_or_default();
            let spec = out.template.spec.as_ref().expect("spec");
            match profile {
                Profile::Defaults | Profile::NativeHold => {
                    assert_eq!((place, index), ("initContainers", 0), "{profile:?}");
                    assert_eq!(c.restart_policy.as_deref(), Some("Always"));
                    let pre = hooks.pre_stop.and_then(|h| h.exec).and_then(|e| e.command);
                    assert_eq!(
                        pre.as_deref().and_then(|p| p.last()).map(String::as_str),
                        Some("drain")
                    );
                    assert!(hooks.post_start.is_none());
                }
                Profile::LegacyDefaults => {
                    assert_eq!((place, index), ("containers", 1));
                    assert!(c.lifecycle.is_none());
                }
                Profile::LegacyHold => {
                    assert_eq!((place, index), ("containers", 0));
                    let post = hooks
                        .post_start
                        .and_then(|h| h.exec)
                        .and_then(|e| e.command);
                    assert_eq!(
                        post,
                        Some(vec!["pilot-agent".to_owned(), "wait".to_owned()])
                    );
                }
            }
            assert!(c.startup_probe.is_some() && c.readiness_probe.is_some());
            assert_eq!(env_of(&c, "CLOUD_PLATFORM").as_deref(), Some("none"));
            assert_eq!(
                env_of(&c, "ISTIO_META_DNS_CAPTURE").as_deref(),
                Some("false")
            );
            assert_eq!(
                env_of(&c, "EXIT_ON_ZERO_ACTIVE_CONNECTIONS").is_some(),
                profile.exit_on_zero()
            );
            let pc: Value =
                serde_json::from_str(&env_of(&c, "PROXY_CONFIG").expect("PROXY_CONFIG"))
                    .expect("json");
            assert_eq!(pc["terminationDrainDuration"], "5s");
            assert_eq!(
                pc.get("holdApplicationUntilProxyStarts").is_some(),
                profile.hold()
            );
            assert_eq!(
                env_of(&c, "ISTIO_META_POD_PORTS").as_deref(),
                Some(r#"[{"containerPort":8080}]"#)
            );
            // The app is untouched.
            assert!(
                spec.containers
                    .iter()
                    .any(|c| c.name == "app" && c.env.is_none())
            );
            let volumes: Vec<String> = spec
                .volumes
                .iter()
                .flatten()
                .map(|v| v.name.clone())
                .collect();
            for m in c.volume_mounts.iter().flatten() {
                assert!(volumes.contains(&m.name), "{} has no volume", m.name);
            }
            let secret = out.secret.data.expect("data");
            assert_eq!(
                secret.keys().map(String::as_str).collect::<Vec<_>>(),
                ["cert-chain.pem", "key.pem", "root-cert.pem"]
            );
        }
    }

    #[test]
    fn xds_files_have_an_inbound_http_and_an_outbound_tcp_listener() {
        let ip: IpAddr = "10.96.0.10".parse().expect("ip");
        let s = Sidecar::new("web", Profile::Defaults, 8080).outbound(15001, ip, 80);
        let (lds, cds) = xds_files(&s);
        let listeners = lds["resources"].as_array().expect("listeners");
        let by_dir = |d: &str| {
            listeners
                .iter()
                .find(|l| l["traffic_direction"] == d)
                .cloned()
                .expect(d)
        };
        let inbound = by_dir("INBOUND");
        assert_eq!(inbound["address"]["socket_address"]["port_value"], 15006);
        let hcm = &inbound["filter_chains"][0]["filters"][0];
        assert_eq!(hcm["name"], "envoy.filters.network.http_connection_manager");
        assert_eq!(
            hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"],
            "inbound|8080||"
        );
        let outbound = by_dir("OUTBOUND");
        assert_eq!(
            outbound["address"]["socket_address"]["address"],
            "127.0.0.1"
        );
        assert_eq!(outbound["address"]["socket_address"]["port_value"], 15001);
        let clusters = cds["resources"].as_array().expect("clusters");
        let app = clusters
            .iter()
            .find(|c| c["name"] == "inbound|8080||")
            .expect("inbound cluster");
        assert!(
            app["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
                ["use_downstream_protocol_config"]
                .is_object()
        );
        let up = clusters
            .iter()
            .find(|c| c["name"] == "outbound|80||10.96.0.10")
            .expect("outbound cluster");
        assert_eq!(up["type"], "STATIC");
    }
}
