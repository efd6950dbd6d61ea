//! EDS convergence on the real node: a server pod deleted → every client
//! Envoy subscribed to its Service no longer holds the pod's endpoint.
//!
//! An Envoy applies an EDS response before it ACKs it, so the endpoint gone
//! from the cluster in its admin's `/clusters` is the observable form of
//! "ACKed a version without it". Each watched Envoy is read through one
//! kept-alive HTTP/1.1 connection over the API server's port-forward to its
//! admin port (bound to the pod's loopback), all of them concurrently, every
//! `poll`; a sample is the time from the delete request to the first answer
//! without the endpoint (an upper bound; the answer before it, which still
//! had it, bounds it from below, and that gap is kept as the resolution).
//!
//! The measurement ([`Watchers`], [`delete_and_measure`]) knows nothing of
//! Remora: a watched Envoy is a pod, an admin port and a cluster name, so
//! the same code measures Istio's sidecars (admin 15000, cluster
//! `outbound|80||edge.<ns>.svc.cluster.local`). [`RemoraMesh`] stands up
//! Remora's side: a Service of server pods and a Deployment of client pods
//! naming it in `remora.dev/outbound`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use http_body_util::{BodyExt as _, Empty};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams,
};
use kube::{Api, Client};
use remora_contract::annotations::{INBOUND, MODE, OUTBOUND, QUIET_PERIOD};
use remora_contract::discovery::cluster_name;
use remora_contract::pod::{ENVOY_ADMIN_PORT, INBOUND_PORT};
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

use crate::node::{self, Check, Node, TestNamespace, pods, workloads};
use crate::stats::Summary;
use remora_test_support::wait::wait_until;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Node(#[from] node::Error),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{what}: {detail}")]
    Admin { what: String, detail: String },
    #[error("{what}: {detail}")]
    Setup { what: String, detail: String },
    #[error("timed out after {timeout:?}: {pending} of the watched Envoys still {what}")]
    Timeout {
        what: String,
        timeout: Duration,
        pending: usize,
    },
}

/// One client Envoy to watch: its pod, its admin port (on the pod's
/// loopback) and the cluster that holds the Service's endpoints.
#[derive(Debug, Clone)]
pub struct Watched {
    pub namespace: String,
    pub pod: String,
    pub admin_port: u16,
    pub cluster: String,
}

/// Every host (`IP:port`) of `cluster` in Envoy's `/clusters` text (lines
/// `CLUSTER::IP:PORT::stat::value`), whatever its health.
pub fn cluster_hosts(clusters: &str, cluster: &str) -> BTreeSet<String> {
    clusters
        .lines()
        .filter_map(|l| l.strip_prefix(cluster)?.strip_prefix("::"))
        .filter_map(|rest| Some(rest.split_once("::")?.0.to_owned()))
        .filter(|h| h.parse::<std::net::SocketAddr>().is_ok())
        .collect()
}

/// A kept-alive connection to one Envoy's admin.
struct Admin {
    watched: Watched,
    conn: Option<(SendRequest<Empty<Bytes>>, tokio::task::JoinHandle<()>)>,
}

impl Admin {
    fn fail(&self, detail: impl std::fmt::Display) -> Error {
        Error::Admin {
            what: format!(
                "GET /clusters of {}/{}:{}",
                self.watched.namespace, self.watched.pod, self.watched.admin_port
            ),
            detail: detail.to_string(),
        }
    }

    async fn open(&mut self, client: &Client) -> Result<(), Error> {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &self.watched.namespace);
        let port = self.watched.admin_port;
        let mut forwarder = pods.portforward(&self.watched.pod, &[port]).await?;
        let stream = forwarder
            .take_stream(port)
            .ok_or_else(|| self.fail("no port-forward stream for the port"))?;
        let (sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| self.fail(e))?;
        // The connection and its forward live as long as this task.
        let task = tokio::spawn(async move {
            let _ = conn.await;
            forwarder.abort();
        });
        self.conn = Some((sender, task));
        Ok(())
    }

    fn close(&mut self) {
        if let Some((_, task)) = self.conn.take() {
            task.abort();
        }
    }

    /// One `GET /clusters` on the kept connection: the cluster's hosts.
    async fn hosts_once(&mut self) -> Result<BTreeSet<String>, String> {
        let (sender, _) = self.conn.as_mut().ok_or("not connected")?;
        sender.ready().await.map_err(|e| e.to_string())?;
        let req = http::Request::get("/clusters")
            .header(http::header::HOST, "localhost")
            .body(Empty::new())
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("status {}", resp.status()));
        }
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok(cluster_hosts(
            &String::from_utf8_lossy(&body),
            &self.watched.cluster,
        ))
    }

    /// The cluster's hosts now; a broken connection is reopened once (the
    /// API server or the kubelet may close an idle forward). Returns whether
    /// it reopened.
    async fn hosts(&mut self, client: &Client) -> Result<(BTreeSet<String>, bool), Error> {
        if self.conn.is_some() {
            match self.hosts_once().await {
                Ok(h) => return Ok((h, false)),
                Err(_) => self.close(),
            }
        }
        self.open(client).await?;
        let h = self.hosts_once().await.map_err(|e| self.fail(e))?;
        Ok((h, true))
    }
}

impl Drop for Admin {
    fn drop(&mut self) {
        self.close();
    }
}

/// When one watched Envoy first answered with the condition holding.
#[derive(Debug, Clone, Copy)]
pub struct Seen {
    /// From the start to the first answer for which it held (an upper
    /// bound of when the Envoy changed).
    pub at: Duration,
    /// From the request before it (whose answer did not hold; or the
    /// start) to that answer: the window the change happened in.
    pub resolution: Duration,
}

/// The watched Envoys, each behind its own kept connection.
pub struct Watchers {
    client: Client,
    admins: Vec<Admin>,
    reopened: usize,
}

impl Watchers {
    /// Opens a connection to every watched Envoy's admin.
    pub async fn connect(client: &Client, watched: Vec<Watched>) -> Result<Self, Error> {
        let mut admins: Vec<Admin> = watched
            .into_iter()
            .map(|w| Admin {
                watched: w,
                conn: None,
            })
            .collect();
        for a in &mut admins {
            a.open(client).await?;
        }
        Ok(Self {
            client: client.clone(),
            admins,
            reopened: 0,
        })
    }

    pub fn len(&self) -> usize {
        self.admins.len()
    }

    pub fn is_empty(&self) -> bool {
        self.admins.is_empty()
    }

    /// Connections reopened so far (each is one extra forward's setup in
    /// a poll, so that poll was late).
    pub fn reopened(&self) -> usize {
        self.reopened
    }

    /// Polls every watched Envoy concurrently, each every `poll`, until
    /// `done` holds for its cluster's hosts; returns, per Envoy in order,
    /// when (since `t0`). Fails after `timeout` saying how many never did.
    pub async fn wait_all(
        &mut self,
        what: &str,
        t0: Instant,
        poll: Duration,
        timeout: Duration,
        done: impl Fn(&BTreeSet<String>) -> bool,
    ) -> Result<Vec<Seen>, Error> {
        let deadline = t0 + timeout;
        let client = &self.client;
        let done = &done;
        let results = futures::future::join_all(self.admins.iter_mut().map(|a| async move {
            let (mut reopened, mut prev) = (0, t0);
            loop {
                let asked = Instant::now();
                let (hosts, again) = a.hosts(client).await?;
                reopened += usize::from(again);
                if done(&hosts) {
                    let answered = Instant::now();
                    return Ok::<_, Error>((
                        Some(Seen {
                            at: answered.saturating_duration_since(t0),
                            resolution: answered.saturating_duration_since(prev),
                        }),
                        reopened,
                    ));
                }
                if Instant::now() > deadline {
                    return Ok((None, reopened));
                }
                prev = asked;
                tokio::time::sleep(poll).await;
            }
        }))
        .await;
        let mut seen = Vec::with_capacity(results.len());
        let mut pending = 0;
        for r in results {
            let (s, reopened) = r?;
            self.reopened += reopened;
            match s {
                Some(s) => seen.push(s),
                None => pending += 1,
            }
        }
        if pending > 0 {
            return Err(Error::Timeout {
                what: what.to_owned(),
                timeout,
                pending,
            });
        }
        Ok(seen)
    }
}

/// Deletes pod `namespace/pod` (its grace period as set) and waits until
/// every watched Envoy's cluster no longer holds `host` (`IP:port` as the
/// Envoys list it). Per Envoy, in the watchers' order: since the delete
/// request was sent.
pub async fn delete_and_measure(
    client: &Client,
    watchers: &mut Watchers,
    namespace: &str,
    pod: &str,
    host: &str,
    poll: Duration,
    timeout: Duration,
) -> Result<Vec<Seen>, Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let t0 = Instant::now();
    pods.delete(pod, &DeleteParams::default()).await?;
    watchers
        .wait_all(&format!("hold {host}"), t0, poll, timeout, |hosts| {
            !hosts.contains(host)
        })
        .await
}

/// One size's figures: one sample per (deletion, client) and one per
/// deletion (the last client).
#[derive(Debug, Clone, Serialize)]
pub struct SizeResult {
    pub clients: usize,
    pub deletions: usize,
    /// Delete request → the last of the clients no longer holds the
    /// endpoint: one sample per deletion.
    pub to_every_client: Summary,
    /// Delete request → that client no longer holds it: one sample per
    /// (deletion, client).
    pub per_client: Summary,
    /// The same per deletion from below: the delete request → the last
    /// client's poll that still saw the endpoint was sent (it changed
    /// after that).
    pub to_every_client_lower_bound: Summary,
    /// How precisely each per-client sample places the change (from the
    /// poll before, which still saw the endpoint, to the answer without it).
    pub resolution: Summary,
    /// Every deletion's per-client samples, ms, in client order.
    pub samples_ms: Vec<Vec<f64>>,
    /// Kept connections to an admin that had to be reopened meanwhile.
    pub reopened_connections: usize,
    /// The clients' Deployment scaled to this size → every client Ready.
    pub scale_to_ready_ms: f64,
}

impl SizeResult {
    pub fn of(
        clients: usize,
        deletions: &[Vec<Seen>],
        reopened_connections: usize,
        scale_to_ready: Duration,
    ) -> Self {
        let samples_ms: Vec<Vec<f64>> = deletions
            .iter()
            .map(|d| d.iter().map(|s| ms(s.at)).collect())
            .collect();
        let last: Vec<f64> = samples_ms
            .iter()
            .map(|d| d.iter().copied().fold(0.0, f64::max))
            .collect();
        let all: Vec<f64> = samples_ms.iter().flatten().copied().collect();
        let lower: Vec<f64> = deletions
            .iter()
            .map(|d| {
                d.iter()
                    .map(|s| ms(s.at.saturating_sub(s.resolution)))
                    .fold(0.0, f64::max)
            })
            .collect();
        let resolution: Vec<f64> = deletions
            .iter()
            .flatten()
            .map(|s| ms(s.resolution))
            .collect();
        Self {
            clients,
            deletions: deletions.len(),
            to_every_client: Summary::of(&last),
            per_client: Summary::of(&all),
            to_every_client_lower_bound: Summary::of(&lower),
            resolution: Summary::of(&resolution),
            samples_ms,
            reopened_connections,
            scale_to_ready_ms: ms(scale_to_ready),
        }
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// `deletions` deletions of `servers`' pods in turn, watched by
/// `watchers`: before each, every client must hold exactly the Ready
/// servers' hosts. Per deletion, per client: when it dropped the endpoint.
pub async fn measure_deletions(
    client: &Client,
    watchers: &mut Watchers,
    servers: &impl ServerSet,
    deletions: usize,
    poll: Duration,
    timeout: Duration,
) -> Result<Vec<Vec<Seen>>, Error> {
    let mut out = Vec::new();
    for d in 0..deletions {
        let ready = servers.ready(client, timeout).await?;
        let want: BTreeSet<String> = ready.values().cloned().collect();
        watchers
            .wait_all(
                &format!("do not hold exactly {want:?}"),
                Instant::now(),
                poll,
                timeout,
                |hosts| *hosts == want,
            )
            .await?;
        let Some((pod, host)) = ready.iter().nth(d % ready.len().max(1)) else {
            return Err(Error::Setup {
                what: "picking a server to delete".into(),
                detail: "no Ready server".into(),
            });
        };
        out.push(
            delete_and_measure(
                client,
                watchers,
                servers.namespace(),
                pod,
                host,
                poll,
                timeout,
            )
            .await?,
        );
    }
    Ok(out)
}

/// The server pods behind the Service the clients use.
pub trait ServerSet {
    fn namespace(&self) -> &str;
    /// Waits until the servers are all Ready again (a deleted one
    /// replaced); their pods and the hosts Envoys list them as.
    fn ready(
        &self,
        client: &Client,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<BTreeMap<String, String>, Error>> + Send;
}

/// Remora's side: in a namespace of its own, Deployment `edge` (the test
/// app, `replicas`) behind Service `edge` (port 80 → the sidecars'
/// inbound), and Deployment `client` (the test app, idle) whose pods name
/// `edge.<ns>:80` in `remora.dev/outbound`; a namespace-wide
/// SidecarLifecycle makes the sidecars small (Envoy 1 worker, 5m CPU and
/// 48Mi requested), so 50 clients fit on 2 cores' allocatable.
pub struct RemoraMesh {
    pub ns: TestNamespace,
    pub replicas: usize,
    /// The clients' cluster for `edge.<ns>:80`.
    pub cluster: String,
}

pub const SERVER: &str = "edge";
pub const CLIENT: &str = "client";
const APP_PORT: u16 = 8080;
const SERVICE_PORT: u16 = 80;
/// The clients' outbound listener for the Service, on their pods' loopback.
pub const OUTBOUND_PORT: u16 = 15001;

fn slc_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("remora.dev", "v1alpha1", "SidecarLifecycle");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "sidecarlifecycles");
    Api::namespaced_with(client.clone(), ns, &ar)
}

impl RemoraMesh {
    /// Remora must be installed with the workload CA and discovery on.
    /// `mode`: the sidecars' mode (Legacy or Native); `server_annotations`:
    /// more on the servers' template (e.g. a withdrawal timeout).
    pub async fn start(
        node: &Node,
        client: &Client,
        replicas: usize,
        mode: &str,
        server_annotations: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<Self, Error> {
        let ns = TestNamespace::injected(node, client, "eds-convergence").await?;
        let n = ns.name().to_owned();
        node::wait_injected(client, &n, timeout).await?;
        node::workload_ca::wait_trust_bundle(client, &n, timeout).await?;
        let slc: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "remora.dev/v1alpha1",
            "kind": "SidecarLifecycle",
            "metadata": {"name": "small"},
            "spec": {
                "mode": mode,
                "proxy": {
                    "concurrency": 1,
                    "resources": {"requests": {"cpu": "5m", "memory": "48Mi"}}
                }
            }
        }))
        .map_err(|e| Error::Setup {
            what: "building the SidecarLifecycle".into(),
            detail: e.to_string(),
        })?;
        slc_api(client, &n)
            .create(&PostParams::default(), &slc)
            .await?;
        workloads::wait_layer_in_force(
            client,
            &n,
            &[("app", CLIENT)],
            &format!("namespace:{n}/small"),
            4,
            timeout,
        )
        .await?;
        let port = APP_PORT.to_string();
        let inbound = format!("{INBOUND_PORT}:{APP_PORT}");
        // Deleted servers go at once: no quiet period to wait out between
        // deletions (the clients drop them on the EndpointSlice's
        // not-ready, before any drain).
        let mut annotations = vec![
            (INBOUND, inbound.as_str()),
            (MODE, mode),
            (QUIET_PERIOD, "0s"),
        ];
        annotations.extend_from_slice(server_annotations);
        let mut edge =
            pods::test_app_deployment(SERVER, replicas as i32, &annotations, &["--port", &port])?;
        if let Some(spec) = edge.spec.as_mut() {
            // A rollout never lowers the serving replicas (the zero-loss
            // tests' strategy), for `e2e::withdrawal_rollout`.
            spec.strategy = Some(
                serde_json::from_value(json!({
                    "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "0%"}
                }))
                .map_err(|e| Error::Setup {
                    what: "building the rollout strategy".into(),
                    detail: e.to_string(),
                })?,
            );
            if let Some(t) = spec.template.spec.as_mut() {
                t.termination_grace_period_seconds = Some(5);
            }
        }
        ns.api::<Deployment>()
            .create(&PostParams::default(), &edge)
            .await?;
        ns.api::<Service>()
            .create(
                &PostParams::default(),
                &pods::test_app_service(SERVER, SERVICE_PORT, INBOUND_PORT)?,
            )
            .await?;
        let outbound = format!("{OUTBOUND_PORT}:{SERVER}.{n}:{SERVICE_PORT}");
        let mut clients = pods::test_app_deployment(
            CLIENT,
            0,
            &[(OUTBOUND, &outbound), (MODE, mode)],
            &["--port", &port],
        )?;
        if let Some(t) = clients.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
            t.termination_grace_period_seconds = Some(1);
        }
        ns.api::<Deployment>()
            .create(&PostParams::default(), &clients)
            .await?;
        workloads::wait_deployment_rolled_out(client, &n, SERVER, timeout).await?;
        pods::wait_service_endpoints(client, &n, SERVER, replicas, timeout).await?;
        let cluster = cluster_name(&format!("{SERVER}.{n}.svc.cluster.local"), SERVICE_PORT);
        Ok(Self {
            ns,
            replicas,
            cluster,
        })
    }

    /// Scales the clients to `n` and waits until all are Ready (with
    /// discovery on, Ready waits for Envoy's first listeners and
    /// clusters); returns how long that took and the Envoys to watch.
    pub async fn scale_clients(
        &self,
        client: &Client,
        n: usize,
        timeout: Duration,
    ) -> Result<(Duration, Vec<Watched>), Error> {
        let t0 = Instant::now();
        self.ns
            .api::<Deployment>()
            .patch(
                CLIENT,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": n}})),
            )
            .await?;
        let pods =
            workloads::wait_deployment_rolled_out(client, self.ns.name(), CLIENT, timeout).await?;
        let took = t0.elapsed();
        let mut watched: Vec<Watched> = pods
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .map(|pod| Watched {
                namespace: self.ns.name().to_owned(),
                pod,
                admin_port: ENVOY_ADMIN_PORT,
                cluster: self.cluster.clone(),
            })
            .collect();
        watched.sort_by(|a, b| a.pod.cmp(&b.pod));
        Ok((took, watched))
    }
}

impl ServerSet for RemoraMesh {
    fn namespace(&self) -> &str {
        self.ns.name()
    }

    async fn ready(
        &self,
        client: &Client,
        timeout: Duration,
    ) -> Result<BTreeMap<String, String>, Error> {
        let pods: Api<Pod> = Api::namespaced(client.clone(), self.ns.name());
        let selector = format!("app={SERVER}");
        let want = self.replicas;
        Ok(
            wait_until(timeout, &format!("{want} Ready servers"), || async {
                let list = pods.list(&ListParams::default().labels(&selector)).await?;
                if let Some(why) = list.items.iter().find_map(node::cannot_start) {
                    return Err(node::Error::Failed {
                        what: "a server pod cannot start".into(),
                        detail: why,
                    });
                }
                let ready: BTreeMap<String, String> = list
                    .items
                    .iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_none() && node::is_ready(p))
                    .filter_map(|p| {
                        let ip = p.status.as_ref()?.pod_ip.clone()?;
                        Some((p.metadata.name.clone()?, format!("{ip}:{INBOUND_PORT}")))
                    })
                    .collect();
                Ok::<_, node::Error>(if ready.len() == want {
                    Check::Done(ready)
                } else {
                    Check::NotYet(format!("Ready: {:?}", ready.keys()))
                })
            })
            .await?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_of_one_cluster_only() {
        let text = "\
edge::observability_name::edge
edge::10.0.0.1:15006::cx_active::0
edge::10.0.0.1:15006::health_flags::healthy
edge::10.0.0.2:15006::health_flags::/failed_eds_health
edge-other::10.0.0.9:15006::cx_active::0
other::10.0.0.3:15006::cx_active::0
";
        let hosts = cluster_hosts(text, "edge");
        let want: BTreeSet<String> = ["10.0.0.1:15006", "10.0.0.2:15006"]
            .into_iter()
            .map(String::from)
            .collect();
        assert_eq!(hosts, want);
        assert!(cluster_hosts(text, "missing").is_empty());
        assert!(cluster_hosts("", "edge").is_empty());
    }
}
