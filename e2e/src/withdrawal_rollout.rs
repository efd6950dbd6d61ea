//! Confirmed removal (issue 30) under rollouts on the real node: the
//! callee of an [`eds_convergence::RemoraMesh`] rolled (maxSurge 25%,
//! maxUnavailable 0) or several of its pods deleted at once, and how each
//! old pod went: its agent's withdrawal outcome and when, since its
//! deletion, the agent learned every subscriber had confirmed, the app was
//! let go, the drain ended, and the pod stopped. The node test
//! (`node_discovery.rs`) asserts on it; node-bench `--only withdrawal`
//! publishes it.
//!
//! Clocks: a pod's deletion is the delete request (pods deleted here) or
//! the pod watch first showing its deletion timestamp (the ReplicaSet's);
//! the agent's moments are its log lines' runtime timestamps; the stop is
//! the pod watch first showing every container terminated (the kubelet
//! reports that after its next relist, up to a second) or the pod gone.
//! All on this host's clock.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client};
use remora_contract::pod::PROXY_CONTAINER;
use serde::Serialize;
use serde_json::{Value, json};

use crate::eds_convergence::{RemoraMesh, SERVER};
use crate::node;
use crate::node::pods::{LogFollower, LogLine};
use crate::node::workloads::{self, Recording};
use crate::stats::Summary;
use crate::traffic::{Kind, Load};

/// What the agent logs (agent/src): its drain starting (drain.rs, with or
/// without connections), the withdrawal confirmed (withdrawal.rs), the app
/// let go (drain.rs), the drain's report (supervisor).
pub const DRAIN_START_LOGS: [&str; 2] = ["draining inbound listeners", "nothing to drain for"];
pub const CONFIRMED_LOG: &str = "every proxy that routed to the pod confirmed it no longer does";
pub const RELEASED_LOG: &str = "the app may stop";
pub const DRAIN_LOG: &str = "drain finished";

/// The mesh clients of the confirmed-removal runs, each `rate` calls/s
/// into `target` (a client pod's outbound listener): HTTP/1.1 keep-alive,
/// h2c on one connection, gRPC unary on one channel, and gRPC
/// server-streaming at a quarter of the rate, each stream held 500 ms so
/// an old pod's in-flight wait stays short. None retries.
pub fn mesh_clients(target: SocketAddr, rate: f64) -> Vec<Load> {
    vec![
        Load::new(Kind::Http1KeepAlive, target, rate),
        Load::new(Kind::H2c { connections: 1 }, target, rate),
        Load::new(Kind::GrpcUnary, target, rate),
        Load::new(
            Kind::GrpcStream {
                hold: Duration::from_millis(500),
            },
            target,
            rate / 4.0,
        ),
    ]
}

/// How often the API is asked whether an old pod is gone.
const POLL: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Node(#[from] node::Error),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{what}: {detail}")]
    Rollout { what: String, detail: String },
}

/// How the callee's pods are replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "pods")]
pub enum Disruption {
    /// A template change rolled out (`kubectl rollout restart`).
    Rolling,
    /// This many pods deleted in one go; the ReplicaSet replaces them.
    DeleteAtOnce(usize),
}

impl Disruption {
    pub fn label(&self) -> String {
        match self {
            Self::Rolling => "rolling".into(),
            Self::DeleteAtOnce(n) => format!("{n}-at-once"),
        }
    }
}

/// How one old pod went, ms since its deletion (None: not seen).
#[derive(Debug, Clone, Serialize)]
pub struct PodStop {
    pub pod: String,
    /// The drain report's `withdrawal` (`outcome`: confirmed, timed_out,
    /// fell_back, with its counts and names).
    pub withdrawal: Option<Value>,
    /// Deletion → the last subscriber confirmed: the pod watch here
    /// showing the deletion (the discovery server's watch sees it alike)
    /// plus the server's own withdrawal → last confirmation.
    pub confirmation_ms: Option<f64>,
    /// The discovery server's own withdrawal → last confirmation.
    pub server_confirmation_ms: Option<f64>,
    /// The agent's drain started (the kubelet ran its preStop hook).
    pub drain_started_ms: Option<f64>,
    /// The agent's drain saw the withdrawal confirmed (at once if it was
    /// by the time the drain started).
    pub agent_confirmed_ms: Option<f64>,
    /// The agent let the app stop.
    pub released_ms: Option<f64>,
    /// The agent's drain ended.
    pub drained_ms: Option<f64>,
    /// The agent's last log line (it exits right after).
    pub last_log_ms: Option<f64>,
    /// Every container terminated, or the pod gone (pod watch).
    pub stopped_ms: Option<f64>,
}

impl PodStop {
    pub fn outcome(&self) -> Option<&str> {
        self.withdrawal.as_ref()?.get("outcome")?.as_str()
    }
}

/// One disruption of the callee.
#[derive(Debug, Clone, Serialize)]
pub struct RolloutResult {
    pub disruption: Disruption,
    /// Start → the Deployment rolled out again with none of the old pods.
    pub took_ms: f64,
    pub pods: Vec<PodStop>,
}

impl RolloutResult {
    /// Per figure, p50/p99/max over the old pods.
    pub fn summary(&self) -> BTreeMap<&'static str, Summary> {
        let of = |f: fn(&PodStop) -> Option<f64>| {
            Summary::of(&self.pods.iter().filter_map(f).collect::<Vec<_>>())
        };
        BTreeMap::from([
            ("deletion_to_confirmation", of(|p| p.confirmation_ms)),
            ("server_confirmation", of(|p| p.server_confirmation_ms)),
            ("deletion_to_drain_start", of(|p| p.drain_started_ms)),
            ("deletion_to_agent_confirmed", of(|p| p.agent_confirmed_ms)),
            ("deletion_to_released", of(|p| p.released_ms)),
            ("deletion_to_drained", of(|p| p.drained_ms)),
            ("deletion_to_last_log", of(|p| p.last_log_ms)),
            ("deletion_to_stopped", of(|p| p.stopped_ms)),
        ])
    }

    /// The per-pod table with p50 and max rows.
    pub fn table(&self) -> String {
        const COLUMNS: [(&str, &str); 8] = [
            ("confirmed", "deletion_to_confirmation"),
            ("server", "server_confirmation"),
            ("drain", "deletion_to_drain_start"),
            ("agent", "deletion_to_agent_confirmed"),
            ("released", "deletion_to_released"),
            ("drained", "deletion_to_drained"),
            ("last log", "deletion_to_last_log"),
            ("stopped", "deletion_to_stopped"),
        ];
        let cell = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
        let width = self
            .pods
            .iter()
            .map(|p| p.pod.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let row = |name: &str, outcome: &str, cells: Vec<String>| {
            let mut line = format!("  {name:<width$} {outcome:>10}");
            for c in cells {
                line.push_str(&format!(" {c:>9}"));
            }
            line + "\n"
        };
        let mut out = row(
            "pod",
            "withdrawal",
            COLUMNS.iter().map(|(h, _)| (*h).to_owned()).collect(),
        );
        for p in &self.pods {
            let cells = [
                p.confirmation_ms,
                p.server_confirmation_ms,
                p.drain_started_ms,
                p.agent_confirmed_ms,
                p.released_ms,
                p.drained_ms,
                p.last_log_ms,
                p.stopped_ms,
            ];
            out.push_str(&row(
                &p.pod,
                p.outcome().unwrap_or("?"),
                cells.into_iter().map(cell).collect(),
            ));
        }
        let s = self.summary();
        for (name, pick) in [
            ("p50", (|s: &Summary| s.p50_ms) as fn(&Summary) -> f64),
            ("max", |s: &Summary| s.max_ms),
        ] {
            let cells = COLUMNS
                .iter()
                .map(|(_, k)| format!("{:.0}", s.get(k).map_or(0.0, pick)))
                .collect();
            out.push_str(&row(name, "", cells));
        }
        out.push_str(
            "  (ms since each pod's deletion. confirmed: the last subscriber confirmed (this host's pod watch saw the deletion + server); \
             server: the discovery server's withdrawal → last confirmation; drain: the agent's drain started (preStop); \
             agent: its drain saw the confirmation; released: the app let go; drained: the drain's end; \
             last log: the agent's last line; stopped: the pod watch showed every container terminated)\n",
        );
        out
    }
}

/// `t - from` in ms, negative when `t` came first (the pod watch here can
/// show a deletion after the agent already acted on it).
fn ms_since(t: SystemTime, from: SystemTime) -> f64 {
    let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
    match t.duration_since(from) {
        Ok(d) => ms(d),
        Err(e) => -ms(e.duration()),
    }
}

fn wall(at: Instant, anchor: (Instant, SystemTime)) -> SystemTime {
    let (i, s) = anchor;
    if at >= i { s + (at - i) } else { s - (i - at) }
}

fn log_time(lines: &[LogLine], message: &str) -> Option<SystemTime> {
    lines
        .iter()
        .find(|l| l.is_event(message))
        .map(|l| SystemTime::from(l.at))
}

/// The `drain finished` report an agent logged.
pub fn drain_report(lines: &[LogLine]) -> Option<Value> {
    lines
        .iter()
        .filter(|l| l.is_event(DRAIN_LOG))
        .filter_map(LogLine::json)
        .find_map(|j| serde_json::from_str(j.get("report")?.as_str()?).ok())
}

fn stopped(p: &Pod) -> bool {
    let statuses: Vec<_> = p
        .status
        .iter()
        .flat_map(|s| {
            s.container_statuses
                .iter()
                .flatten()
                .chain(s.init_container_statuses.iter().flatten())
        })
        .collect();
    !statuses.is_empty()
        && statuses
            .iter()
            .all(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_some()))
}

/// The callee's Ready, not terminating pods.
pub async fn serving(client: &Client, ns: &str) -> Result<Vec<String>, Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut v: Vec<String> = pods
        .list(&ListParams::default().labels(&format!("app={SERVER}")))
        .await?
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && node::is_ready(p))
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    v.sort();
    Ok(v)
}

/// Disrupts the callee of `mesh` as `how` says and waits until it has
/// rolled out again without the old pods and each of them is gone; how
/// each went. The callee must be fully rolled out when called.
pub async fn disrupt(
    client: &Client,
    mesh: &RemoraMesh,
    how: Disruption,
    timeout: Duration,
) -> Result<RolloutResult, Error> {
    let ns = mesh.ns.name().to_owned();
    let current = serving(client, &ns).await?;
    let old: Vec<String> = match how {
        Disruption::Rolling => current,
        Disruption::DeleteAtOnce(n) => current.into_iter().take(n).collect(),
    };
    let seen = Recording::<Pod>::start(mesh.ns.api(), Some(&format!("app={SERVER}"))).await?;
    let mut followers = Vec::new();
    for p in &old {
        followers.push((
            p.clone(),
            LogFollower::start(client, &ns, p, PROXY_CONTAINER).await?,
        ));
    }
    let anchor = (Instant::now(), SystemTime::now());
    let t0 = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let mut requested = BTreeMap::new();
    match how {
        Disruption::Rolling => {
            let restart = json!({"spec": {"template": {"metadata": {"annotations": {
                "e2e.remora.dev/restarted-at": format!("{:?}", SystemTime::now())
            }}}}});
            mesh.ns
                .api::<Deployment>()
                .patch(SERVER, &PatchParams::default(), &Patch::Merge(&restart))
                .await?;
        }
        Disruption::DeleteAtOnce(_) => {
            let deletes = old.iter().map(|p| {
                let pods = pods.clone();
                async move {
                    let at = SystemTime::now();
                    pods.delete(p, &DeleteParams::default()).await.map(|_| at)
                }
            });
            for (p, at) in old.iter().zip(futures::future::join_all(deletes).await) {
                requested.insert(p.clone(), at?);
            }
        }
    }
    let fresh = workloads::wait_deployment_rolled_out(client, &ns, SERVER, timeout).await?;
    let took = t0.elapsed();
    if let Some(p) = fresh
        .iter()
        .filter_map(|p| p.metadata.name.as_ref())
        .find(|p| old.contains(p))
    {
        return Err(Error::Rollout {
            what: format!("{} of {SERVER}", how.label()),
            detail: format!("old pod {p} still runs once rolled out"),
        });
    }

    let versions = seen.versions();
    let uids: Vec<(String, String)> = old
        .iter()
        .filter_map(|p| {
            let uid = versions
                .iter()
                .find(|(_, v)| v.metadata.name.as_deref() == Some(p.as_str()))?
                .1
                .metadata
                .uid
                .clone()?;
            Some((p.clone(), uid))
        })
        .collect();
    let mut out = Vec::new();
    for (p, follower) in followers {
        let mine: Vec<&(Instant, Pod)> = versions
            .iter()
            .filter(|(_, v)| v.metadata.name.as_deref() == Some(p.as_str()))
            .collect();
        let seen_deleted = mine
            .iter()
            .find(|(_, v)| v.metadata.deletion_timestamp.is_some())
            .map(|(t, _)| wall(*t, anchor));
        let deleted = requested.get(&p).copied().or(seen_deleted);
        // The log ends with the container; the pod watch saw it stop by now.
        let lines = follower
            .finish(timeout)
            .await
            .unwrap_or_else(|_| Vec::new());
        let report = drain_report(&lines);
        let withdrawal = report.as_ref().map(|r| r["withdrawal"].clone());
        let stop = mine
            .iter()
            .find(|(_, v)| stopped(v))
            .or(mine.last())
            .map(|(t, _)| wall(*t, anchor));
        let since = |t: Option<SystemTime>| deleted.zip(t).map(|(d, t)| ms_since(t, d));
        let server_confirmation_ms = withdrawal
            .as_ref()
            .and_then(|w| w.get("last_confirmation_ms")?.as_f64());
        let drain_started = DRAIN_START_LOGS
            .iter()
            .filter_map(|m| log_time(&lines, m))
            .min();
        out.push(PodStop {
            confirmation_ms: since(seen_deleted)
                .zip(server_confirmation_ms)
                .map(|(a, b)| a + b),
            server_confirmation_ms,
            drain_started_ms: since(drain_started),
            agent_confirmed_ms: since(log_time(&lines, CONFIRMED_LOG)),
            last_log_ms: since(lines.last().map(|l| SystemTime::from(l.at))),
            released_ms: since(log_time(&lines, RELEASED_LOG)),
            drained_ms: since(log_time(&lines, DRAIN_LOG)),
            stopped_ms: since(stop),
            withdrawal,
            pod: p,
        });
    }
    // Every old pod gone (a stopped pod lingers until the kubelet's
    // cleanup; the next disruption must not count it).
    for (p, uid) in &uids {
        node::wait_pod_gone(&pods, p, uid, Instant::now(), POLL, timeout).await?;
    }
    Ok(RolloutResult {
        disruption: how,
        took_ms: took.as_secs_f64() * 1e3,
        pods: out,
    })
}

/// The Events of `reason` on pod `pod` of `ns`: their messages.
pub async fn pod_events(
    client: &Client,
    ns: &str,
    pod: &str,
    reason: &str,
) -> Result<Vec<String>, Error> {
    // The operator's recorder writes events.k8s.io/v1 Events.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod))
        .filter_map(|e| e.note)
        .collect())
}
