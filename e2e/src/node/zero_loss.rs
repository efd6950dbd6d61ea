//! Zero loss on the real node: one workload per contender (plain Envoy,
//! Remora with the chart's defaults, ...) behind a ClusterIP Service, loaded
//! through the Service (kube-proxy, conntrack pinning keep-alive connections)
//! and through an ingress that lags behind the EndpointSlices, by clients
//! that never retry, while the Deployment rolls or pods are deleted. What the
//! lifecycle bench (`lifecycle-bench`) and the CI test (`node_zero_loss.rs`)
//! both run.

use super::*;
use crate::node::ingress::{EndpointFeed, LaggingIngress};
use crate::traffic::{Kind, Load, LoadSummary, Traffic};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::api::{Patch, PatchParams};
use remora_contract::annotations::{INBOUND, MODE};
use remora_contract::pod::{INBOUND_PORT, PROXY_CONTAINER};
use serde::Serialize;
use serde_json::json;
use std::net::{IpAddr, SocketAddr};

use super::istio;
use super::kube_proxy::{self, ProgrammingSummary};
use super::workloads::{Recording, container_status};

/// The app's port inside the pod.
pub const APP_PORT: u16 = 8080;
/// The Envoy image every Envoy-based contender runs (`scripts/images.sh`).
pub const ENVOY_IMAGE: &str = "localhost/remora/envoy:v1.40.0-local";
const PLAIN_ENVOY_CONFIG: &str = "plain-envoy";

/// Who manages the sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Contender {
    /// Envoy next to the app and nothing else: no hold, no drain; SIGTERM
    /// stops it at once. The baseline that shows the harness can lose.
    PlainEnvoy,
    /// Remora injected with the chart's defaults, only the mode chosen.
    RemoraLegacy,
    RemoraNative,
    /// Remora Native with a shorter quiet period (1 s): stops sooner where
    /// clients send often, at the risk of a sparse client's next request.
    RemoraTuned,
    /// Istio 1.31's real pilot-agent, injected as its template does
    /// ([`istio::Profile`]): its defaults here (a native sidecar), with
    /// holdApplicationUntilProxyStarts and exit-on-zero, and the non-native
    /// shapes.
    IstioDefaults,
    IstioNativeHold,
    IstioLegacyDefaults,
    IstioLegacyHold,
    /// Istio's defaults plus its documented remedy for endpoint lag: the
    /// app keeps serving through a preStop `sleep` of the lag plus Remora's
    /// default quiet period, so the lagging ingress has moved
    /// on before the app stops and the native sidecar drains after it.
    IstioTunedForLag,
}

/// How much longer than the ingress lag the tuned Istio app sleeps: Remora's
/// default quiet period.
fn istio_sleep_margin() -> Duration {
    remora_contract::duration::parse(remora_contract::defaults::QUIET_PERIOD)
        .unwrap_or(Duration::from_secs(5))
}

impl Contender {
    pub const ALL: [Self; 9] = [
        Self::PlainEnvoy,
        Self::RemoraLegacy,
        Self::RemoraNative,
        Self::RemoraTuned,
        Self::IstioDefaults,
        Self::IstioNativeHold,
        Self::IstioLegacyDefaults,
        Self::IstioLegacyHold,
        Self::IstioTunedForLag,
    ];

    /// Istio's profile, for the Istio contenders.
    pub fn istio(self) -> Option<istio::Profile> {
        match self {
            Self::IstioDefaults | Self::IstioTunedForLag => Some(istio::Profile::Defaults),
            Self::IstioNativeHold => Some(istio::Profile::NativeHold),
            Self::IstioLegacyDefaults => Some(istio::Profile::LegacyDefaults),
            Self::IstioLegacyHold => Some(istio::Profile::LegacyHold),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::PlainEnvoy => "plain-envoy",
            Self::RemoraLegacy => "remora-legacy-defaults",
            Self::RemoraNative => "remora-native-defaults",
            Self::RemoraTuned => "remora-native-tuned",
            Self::IstioTunedForLag => "istio-tuned-for-lag",
            c => c.istio().map_or("?", istio::Profile::name),
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Remora's webhook injects it.
    fn injected(self) -> bool {
        matches!(
            self,
            Self::RemoraLegacy | Self::RemoraNative | Self::RemoraTuned
        )
    }

    /// The container that is the proxy, to read its exit.
    fn proxy_container(self) -> &'static str {
        match self {
            Self::PlainEnvoy => "envoy",
            c if c.istio().is_some() => istio::PROXY_CONTAINER,
            _ => PROXY_CONTAINER,
        }
    }
}

/// What happens to the workload under load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// A rolling update, maxSurge 25%, maxUnavailable 0%.
    Rolling,
    /// A rolling update, maxSurge 25%, maxUnavailable 25%.
    RollingUnavailable,
    /// Five pods deleted at once, as a node drain does; the Deployment
    /// replaces them.
    DeleteFive,
}

impl Scenario {
    pub const ALL: [Self; 3] = [Self::Rolling, Self::RollingUnavailable, Self::DeleteFive];

    pub fn name(self) -> &'static str {
        match self {
            Self::Rolling => "rolling-update",
            Self::RollingUnavailable => "rolling-update-unavailable-25",
            Self::DeleteFive => "delete-5-at-once",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }

    fn max_unavailable(self) -> &'static str {
        match self {
            Self::RollingUnavailable => "25%",
            _ => "0%",
        }
    }
}

/// Which clients load the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Clients {
    /// HTTP/1.1 keep-alive (90 s idle pool), through the lagging ingress and
    /// straight to the ClusterIP.
    KeepAlive,
    /// Those, plus h2c, POST with a 16 KiB body, requests of 2-20 s, gRPC
    /// unary and server streaming, all to the ClusterIP.
    All,
}

/// One run: a contender, a scenario, a lag, the clients.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub contender: Contender,
    pub scenario: Scenario,
    pub replicas: i32,
    /// How far the ingress lags behind the EndpointSlices.
    #[serde(serialize_with = "secs")]
    pub ingress_lag: Duration,
    pub clients: Clients,
    /// Requests per second of each HTTP/1.1 client.
    pub rate: f64,
    /// Traffic before the scenario starts and after it has settled.
    #[serde(serialize_with = "secs")]
    pub settle: Duration,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl Run {
    /// What CI checks: the rolling update of 10 replicas, keep-alive
    /// clients, 2 s of ingress lag.
    pub fn ci(contender: Contender) -> Self {
        Self {
            contender,
            scenario: Scenario::Rolling,
            replicas: 10,
            ingress_lag: Duration::from_secs(2),
            clients: Clients::KeepAlive,
            rate: 50.0,
            settle: Duration::from_secs(3),
        }
    }
}

/// How one old pod stopped.
#[derive(Debug, Clone, Serialize)]
pub struct PodStop {
    pub pod: String,
    /// Deletion → the pod object gone.
    pub stop_seconds: Option<f64>,
    pub app_exit: Option<i32>,
    pub proxy_exit: Option<i32>,
}

/// What one run saw.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub run: Run,
    /// Per client (load name), what was sent and how it failed.
    pub loads: Vec<LoadSummary>,
    pub sent: usize,
    pub failed: usize,
    /// Failures of every client, by class (`traffic::Outcome::class`).
    pub failures: BTreeMap<&'static str, usize>,
    /// Up to 3 failures per (client, class): when (since the scenario
    /// started), which client, what.
    pub examples: Vec<String>,
    pub stops: Vec<PodStop>,
    pub stop_p50_seconds: f64,
    pub stop_max_seconds: f64,
    /// How the old pods' containers ended: "app 0, proxy 0" → count.
    pub endings: BTreeMap<String, usize>,
    /// Scenario start → the Deployment rolled out (or the pods replaced).
    pub scenario_seconds: f64,
    /// What kube-proxy programmed from the scenario's start to the end of
    /// the traffic, and how long each change took (None: unreadable).
    pub kube_proxy: Option<ProgrammingSummary>,
}

/// The plain-Envoy bootstrap: the same inbound listener Remora's static mode
/// gives (15006 → the app), nothing about lifecycle.
fn plain_envoy_config() -> serde_json::Value {
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "static_resources": {
            "listeners": [{
                "name": "inbound",
                "address": {"socket_address": {"address": "0.0.0.0", "port_value": INBOUND_PORT}},
                "traffic_direction": "INBOUND",
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "inbound",
                        "codec_type": "AUTO",
                        "route_config": {"virtual_hosts": [{
                            "name": "app", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "app", "timeout": "0s"}}]
                        }]},
                        "http_filters": [{
                            "name": "envoy.filters.http.router",
                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
                        }]
                    }
                }]}]
            }],
            "clusters": [{
                "name": "app",
                "type": "STATIC",
                // As Remora's inbound cluster: the app gets the client's protocol.
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "use_downstream_protocol_config": {"http_protocol_options": {}, "http2_protocol_options": {}}
                    }
                },
                "load_assignment": {"cluster_name": "app", "endpoints": [{"lb_endpoints": [{
                    "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": APP_PORT}}}
                }]}]}
            }]
        }
    })
}

fn failed(what: impl Into<String>, e: impl std::fmt::Display) -> Error {
    Error::Failed {
        what: what.into(),
        detail: e.to_string(),
    }
}

/// The Deployment and Service of `contender`, named `name`. The app is not
/// cooperative: on SIGTERM it closes its listener at once (no shutdown
/// delay) and finishes what is in flight.
pub fn manifests(
    run: &Run,
    name: &str,
) -> Result<(Deployment, Service, Option<istio::Injected>), Error> {
    let mut app = test_app_container("app", &["--port", &APP_PORT.to_string(), "--delay", "5ms"]);
    if run.contender == Contender::IstioTunedForLag {
        let sleep = (run.ingress_lag + istio_sleep_margin())
            .as_secs_f64()
            .ceil();
        app["lifecycle"] = json!({"preStop": {"sleep": {"seconds": sleep as i64}}});
    }
    let mut annotations = serde_json::Map::new();
    let mut containers = vec![app];
    let mut volumes = vec![];
    let mode = match run.contender {
        Contender::RemoraLegacy => Some("Legacy"),
        Contender::RemoraNative | Contender::RemoraTuned => Some("Native"),
        _ => None,
    };
    if run.contender == Contender::RemoraTuned {
        annotations.insert(
            remora_contract::annotations::QUIET_PERIOD.into(),
            json!("1s"),
        );
    }
    match mode {
        None if run.contender.istio().is_some() => {}
        None => {
            containers.push(json!({
                "name": "envoy",
                "image": ENVOY_IMAGE,
                "imagePullPolicy": "Never",
                "args": ["-c", "/etc/plain-envoy/envoy.json", "--concurrency", "2",
                         "--disable-hot-restart", "--log-level", "warning"],
                "readinessProbe": {"httpGet": {"path": "/", "port": INBOUND_PORT},
                                   "periodSeconds": 2, "failureThreshold": 3},
                "volumeMounts": [{"name": "config", "mountPath": "/etc/plain-envoy", "readOnly": true}],
                "securityContext": {
                    "readOnlyRootFilesystem": true,
                    "allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"]}
                }
            }));
            volumes.push(json!({"name": "config", "configMap": {"name": PLAIN_ENVOY_CONFIG}}));
        }
        Some(mode) => {
            annotations.insert(MODE.into(), json!(mode));
            annotations.insert(INBOUND.into(), json!(format!("{INBOUND_PORT}:{APP_PORT}")));
        }
    }
    let mut deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": run.replicas,
            "selector": {"matchLabels": {"app": name}},
            "strategy": {"rollingUpdate": {
                "maxSurge": "25%", "maxUnavailable": run.scenario.max_unavailable()
            }},
            "template": {
                "metadata": {"labels": {"app": name}, "annotations": annotations},
                "spec": {
                    "terminationGracePeriodSeconds": 30,
                    "securityContext": {"runAsNonRoot": true, "runAsUser": 65532},
                    "containers": containers,
                    "volumes": volumes
                }
            }
        }
    }))
    .map_err(|e| failed(format!("building Deployment {name}"), e))?;
    let mut objects = None;
    if let (Some(profile), Some(spec)) = (run.contender.istio(), deploy.spec.as_mut()) {
        let injected = istio::inject(
            &spec.template,
            &istio::Sidecar::new(name, profile, APP_PORT),
        )
        .map_err(|e| failed("injecting Istio's sidecar", e))?;
        spec.template = injected.template.clone();
        objects = Some(injected);
    }
    let svc = super::pods::test_app_service(name, 80, INBOUND_PORT)?;
    Ok((deploy, svc, objects))
}

/// The clients of `run`, aimed at the ingress and the ClusterIP.
fn loads(run: &Run, ingress: SocketAddr, service: SocketAddr) -> Vec<Load> {
    let mut v = vec![
        Load::new(Kind::Http1KeepAlive, ingress, run.rate).named("ingress-http1"),
        Load::new(Kind::Http1KeepAlive, service, run.rate).named("service-http1"),
    ];
    if run.clients == Clients::All {
        let quarter = (run.rate / 4.0).max(1.0);
        v.extend([
            Load::new(Kind::H2c { connections: 2 }, service, quarter).named("service-h2c"),
            Load::new(
                Kind::Post {
                    body_bytes: 16 * 1024,
                },
                service,
                quarter,
            )
            .named("service-post"),
            Load::new(
                Kind::Long {
                    min: Duration::from_secs(2),
                    max: Duration::from_secs(20),
                },
                service,
                1.0,
            )
            .named("service-long"),
            Load::new(Kind::GrpcUnary, service, quarter).named("service-grpc-unary"),
            Load::new(
                Kind::GrpcStream {
                    hold: Duration::from_secs(5),
                },
                service,
                1.0,
            )
            .named("service-grpc-stream"),
        ]);
    }
    v
}

/// Run `run` in a namespace of its own (deleted afterwards): the workload,
/// the clients, the scenario; what every client saw and how every old pod
/// stopped.
pub async fn run(node: &Node, client: &Client, run: &Run) -> Result<RunResult, Error> {
    if run.contender.injected() {
        node.remora(client).await?;
    }
    let ns = if run.contender.injected() {
        TestNamespace::injected(node, client, run.contender.name()).await?
    } else {
        TestNamespace::create(node, client, run.contender.name(), &[]).await?
    };
    let result = run_in(&ns, client, run).await;
    ns.delete().await?;
    result
}

async fn run_in(ns: &TestNamespace, client: &Client, run: &Run) -> Result<RunResult, Error> {
    let name = "web";
    if run.contender == Contender::PlainEnvoy {
        let cm: ConfigMap = serde_json::from_value(json!({
            "metadata": {"name": PLAIN_ENVOY_CONFIG},
            "data": {"envoy.json": plain_envoy_config().to_string()}
        }))
        .map_err(|e| failed("building the plain Envoy ConfigMap", e))?;
        ns.api::<ConfigMap>()
            .create(&PostParams::default(), &cm)
            .await?;
    }
    let (deploy, svc, istio_objects) = manifests(run, name)?;
    if let Some(objects) = &istio_objects {
        istio::require_image()
            .await
            .map_err(|e| failed("the istio-proxy image", e))?;
        objects
            .create_objects(client, ns.name())
            .await
            .map_err(|e| failed("creating Istio's ConfigMap and Secret", e))?;
    }
    let deploys = ns.api::<Deployment>();
    deploys.create(&PostParams::default(), &deploy).await?;
    let svc = ns
        .api::<Service>()
        .create(&PostParams::default(), &svc)
        .await?;
    let replicas = usize::try_from(run.replicas).unwrap_or(0);
    super::pods::wait_service_endpoints(client, ns.name(), name, replicas, ROLLOUT_TIMEOUT).await?;
    let ip: IpAddr = svc
        .spec
        .as_ref()
        .and_then(|s| s.cluster_ip.as_deref())
        .and_then(|ip| ip.parse().ok())
        .ok_or_else(|| failed("reading the ClusterIP", "none"))?;
    super::pods::wait_kube_proxy(ip, 80, Duration::from_secs(60)).await?;
    let feed = EndpointFeed::from_slices(ns.api(), name, None, run.ingress_lag)
        .await
        .map_err(|e| failed("following the EndpointSlices", e))?;
    let ingress = LaggingIngress::start(feed.receiver())
        .await
        .map_err(|e| failed("starting the ingress", e))?;
    let pods = Recording::<Pod>::start(ns.api::<Pod>(), Some(&format!("app={name}"))).await?;
    let before: Vec<String> = pods
        .versions()
        .iter()
        .filter_map(|(_, p)| p.metadata.name.clone())
        .collect();

    let epoch = tokio::time::Instant::now();
    let traffic = Traffic::start(loads(run, ingress.addr(), SocketAddr::new(ip, 80)), epoch);
    tokio::time::sleep(run.settle).await;
    let programmed_before = programming_or_warn().await;
    let t0 = Instant::now();
    let pods_api = ns.api::<Pod>();
    match run.scenario {
        Scenario::Rolling | Scenario::RollingUnavailable => {
            let restart = json!({"spec": {"template": {"metadata": {"annotations": {
                "bench.remora.dev/restarted-at": format!("{:?}", std::time::SystemTime::now())
            }}}}});
            deploys
                .patch(name, &PatchParams::default(), &Patch::Merge(&restart))
                .await?;
            super::workloads::wait_deployment_rolled_out(client, ns.name(), name, ROLLOUT_TIMEOUT)
                .await?;
        }
        Scenario::DeleteFive => {
            for pod in before.iter().take(5) {
                pods_api.delete(pod, &DeleteParams::default()).await?;
            }
            super::pods::wait_service_endpoints(client, ns.name(), name, replicas, ROLLOUT_TIMEOUT)
                .await?;
        }
    }
    let scenario_seconds = t0.elapsed().as_secs_f64();
    // Every old pod gone, then the ingress's lag and the settle time: the
    // stragglers' requests are in the counts.
    let old: Vec<String> = match run.scenario {
        Scenario::DeleteFive => before.iter().take(5).cloned().collect(),
        _ => before.clone(),
    };
    wait_until(ROLLOUT_TIMEOUT, "the old pods to be gone", || async {
        let names: Vec<String> = pods_api
            .list(&ListParams::default().labels(&format!("app={name}")))
            .await?
            .items
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .collect();
        let left = old.iter().filter(|o| names.contains(o)).count();
        Ok::<_, Error>(if left == 0 {
            Check::Done(())
        } else {
            Check::NotYet(format!("{left} old pods left"))
        })
    })
    .await?;
    // The ingress applies the last endpoint change its lag later; requests
    // it sends meanwhile are in the counts. Then the settle time of traffic.
    let slices = ns.api::<EndpointSlice>();
    let service_label = format!("kubernetes.io/service-name={name}");
    wait_until(
        run.ingress_lag + ROLLOUT_TIMEOUT,
        "the ingress to apply the last endpoint change",
        || async {
            let mut want: Vec<SocketAddr> = slices
                .list(&ListParams::default().labels(&service_label))
                .await?
                .items
                .iter()
                .flat_map(|s| crate::node::ingress::ready_addresses(s, None))
                .collect();
            want.sort();
            want.dedup();
            let have = feed.current();
            Ok::<_, Error>(if have == want {
                Check::Done(())
            } else {
                Check::NotYet(format!(
                    "the ingress has {} endpoints, the slices {}",
                    have.len(),
                    want.len()
                ))
            })
        },
    )
    .await?;
    tokio::time::sleep(run.settle).await;
    let samples = traffic.stop().await;
    drop(ingress);
    let kube_proxy = match (programmed_before, programming_or_warn().await) {
        (Some(before), Some(after)) => Some(after.since(&before)),
        _ => None,
    };

    let loads = crate::traffic::summarize(&samples);
    let mut failures = BTreeMap::new();
    let mut examples = Vec::new();
    let since = tokio::time::Instant::from_std(t0).duration_since(epoch);
    let mut shown: BTreeMap<(String, &str), usize> = BTreeMap::new();
    for s in samples.iter().filter(|s| !s.outcome.is_ok()) {
        *failures.entry(s.outcome.class()).or_insert(0) += 1;
        let n = shown
            .entry((s.load.to_string(), s.outcome.class()))
            .or_insert(0);
        *n += 1;
        if *n <= 3 {
            examples.push(format!(
                "{:+.2}s {} {:?}",
                s.at.as_secs_f64() - since.as_secs_f64(),
                s.load,
                s.outcome
            ));
        }
    }
    let stops = stops_of(&pods, &old, run.contender);
    let mut secs: Vec<f64> = stops.iter().filter_map(|s| s.stop_seconds).collect();
    secs.sort_by(f64::total_cmp);
    let mut endings = BTreeMap::new();
    for s in &stops {
        let code = |c: Option<i32>| c.map_or("?".to_string(), |c| c.to_string());
        *endings
            .entry(format!(
                "app {}, proxy {}",
                code(s.app_exit),
                code(s.proxy_exit)
            ))
            .or_insert(0) += 1;
    }
    Ok(RunResult {
        run: run.clone(),
        sent: samples.len(),
        failed: failures.values().sum(),
        failures,
        examples,
        loads,
        stop_p50_seconds: crate::stats::percentile(&secs, 0.5),
        stop_max_seconds: secs.last().copied().unwrap_or(0.0),
        endings,
        stops,
        scenario_seconds,
        kube_proxy,
    })
}

/// kube-proxy's programming histogram, or None (said on stderr): the
/// figure is reported, never needed.
async fn programming_or_warn() -> Option<kube_proxy::Programming> {
    kube_proxy::programming()
        .await
        .map_err(|e| eprintln!("kube-proxy's programming histogram: {e}"))
        .ok()
}

/// From a pod recording: for every pod of `before`, deletion → last event
/// (the watch's Delete), and how its containers exited.
fn stops_of(pods: &Recording<Pod>, before: &[String], contender: Contender) -> Vec<PodStop> {
    let versions = pods.versions();
    before
        .iter()
        .map(|name| {
            let mine: Vec<&(Instant, Pod)> = versions
                .iter()
                .filter(|(_, p)| p.metadata.name.as_deref() == Some(name))
                .collect();
            let deleted = mine
                .iter()
                .find(|(_, p)| p.metadata.deletion_timestamp.is_some())
                .map(|(t, _)| *t);
            let last = mine.last();
            let exit = |c: &str| {
                last.and_then(|(_, p)| container_status(p, c))
                    .and_then(|s| s.state.as_ref()?.terminated.as_ref())
                    .map(|t| t.exit_code)
            };
            PodStop {
                pod: name.clone(),
                stop_seconds: deleted
                    .zip(last.map(|(t, _)| *t))
                    .map(|(d, l)| l.duration_since(d).as_secs_f64()),
                app_exit: exit("app"),
                proxy_exit: exit(contender.proxy_container()),
            }
        })
        .collect()
}
