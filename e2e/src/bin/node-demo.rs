//! The whole system on the real node, as a user runs it: Remora installed by
//! helm, an injected Deployment of the test app behind a ClusterIP Service,
//! steady traffic through the Service, a rolling restart, and a short report
//! (requests, lost, how each old pod stopped). `scripts/demo.sh` builds
//! everything, starts the node, imports the images, runs this, and takes the
//! node down again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use e2e::node::{Check, INJECT_LABEL, Node, RELEASE_NAMESPACE, test_app_container};
use e2e::traffic::{Kind, Load, LoadSummary, Outcome, Traffic};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStatus, Namespace, Pod, Service};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use remora_contract::annotations::{INBOUND, MODE};
use remora_contract::pod::{INBOUND_PORT, PROXY_CONTAINER};
use remora_test_support::wait::wait_until;
use serde_json::json;
use tokio::time::Instant;

const NAMESPACE: &str = "remora-demo";
const APP: &str = "web";
const APP_PORT: u16 = 8080;

#[derive(Parser, Debug)]
#[command(
    about = "Remora on the real node: helm install, an injected app under load, a rolling restart"
)]
struct Args {
    /// Replicas of the demo Deployment.
    #[arg(long, default_value_t = 3)]
    replicas: i32,
    /// Requests per second through the Service.
    #[arg(long, default_value_t = 100)]
    rate: u32,
    /// Sidecar mode of the demo pods: Auto (the chart's default: Native on
    /// this kubelet), Legacy or Native.
    #[arg(long, default_value = "Auto")]
    mode: String,
    /// Traffic before and after the rolling restart.
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "5s")]
    settle: Duration,
}

/// What the watcher saw of one pod.
#[derive(Debug, Default, Clone)]
struct Seen {
    deleted_at: Option<Duration>,
    gone_at: Option<Duration>,
    grace: Option<i64>,
    /// Container name → (exit code, reason, first seen terminated at).
    exits: BTreeMap<String, (i32, String, Duration)>,
}

fn record(seen: &mut Seen, statuses: &[ContainerStatus], at: Duration) {
    for s in statuses {
        if let Some(t) = s.state.as_ref().and_then(|st| st.terminated.as_ref()) {
            seen.exits.entry(s.name.clone()).or_insert((
                t.exit_code,
                t.reason.clone().unwrap_or_default(),
                at,
            ));
        }
    }
}

fn manifests(replicas: i32, mode: &str) -> Result<(Deployment, Service)> {
    let deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": APP},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": APP}},
            "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": {"app": APP},
                    "annotations": {MODE: mode, INBOUND: format!("{INBOUND_PORT}:{APP_PORT}")}
                },
                "spec": {
                    "terminationGracePeriodSeconds": 30,
                    "securityContext": {"runAsNonRoot": true, "runAsUser": 65532},
                    // An app that does nothing for the load balancer: on
                    // SIGTERM it closes its port and finishes what is in
                    // flight. The sidecar's preStop hook on it holds the
                    // SIGTERM until traffic has stopped coming.
                    "containers": [test_app_container("app", &[
                        "--port", &APP_PORT.to_string(), "--delay", "5ms",
                    ])]
                }
            }
        }
    }))?;
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": APP},
        "spec": {
            "selector": {"app": APP},
            "ports": [{"name": "http", "port": 80, "targetPort": INBOUND_PORT}]
        }
    }))?;
    Ok((deploy, svc))
}

async fn fresh_namespace(client: &kube::Client) -> Result<()> {
    let nss: Api<Namespace> = Api::all(client.clone());
    if nss.get_opt(NAMESPACE).await?.is_some() {
        nss.delete(NAMESPACE, &DeleteParams::default()).await?;
        wait_until(
            Duration::from_secs(120),
            "the previous demo namespace to go",
            || {
                let nss = nss.clone();
                async move {
                    Ok::<_, anyhow::Error>(match nss.get_opt(NAMESPACE).await? {
                        None => Check::Done(()),
                        Some(_) => Check::NotYet("still terminating".into()),
                    })
                }
            },
        )
        .await?;
    }
    let ns: Namespace = serde_json::from_value(json!({
        "metadata": {"name": NAMESPACE, "labels": {INJECT_LABEL.0: INJECT_LABEL.1}}
    }))?;
    nss.create(&PostParams::default(), &ns).await?;
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(client.clone(), NAMESPACE);
    wait_until(
        Duration::from_secs(30),
        "the namespace's default ServiceAccount",
        || {
            let sas = sas.clone();
            async move {
                Ok::<_, anyhow::Error>(match sas.get_opt("default").await? {
                    Some(_) => Check::Done(()),
                    None => Check::NotYet("not yet".into()),
                })
            }
        },
    )
    .await?;
    Ok(())
}

async fn rollout_done(deploys: &Api<Deployment>, replicas: i32) -> Result<()> {
    wait_until(Duration::from_secs(180), "the Deployment rollout", || {
        let deploys = deploys.clone();
        async move {
            let d = deploys.get(APP).await?;
            let generation = d.metadata.generation.unwrap_or_default();
            let st = d.status.unwrap_or_default();
            let done = st.observed_generation.unwrap_or_default() >= generation
                && st.updated_replicas.unwrap_or_default() == replicas
                && st.available_replicas.unwrap_or_default() == replicas
                && st.replicas.unwrap_or_default() == replicas;
            Ok::<_, anyhow::Error>(if done {
                Check::Done(())
            } else {
                Check::NotYet(format!(
                    "updated {:?} available {:?} total {:?}",
                    st.updated_replicas, st.available_replicas, st.replicas
                ))
            })
        }
    })
    .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if !matches!(args.mode.as_str(), "Auto" | "Legacy" | "Native") {
        bail!("--mode must be Auto, Legacy or Native, not {:?}", args.mode);
    }
    let t0 = Instant::now();
    let node = Node::shared().await?;
    let client = node.client()?;
    println!(
        "demo: node up; installing Remora (helm upgrade --install remora charts/remora -n {RELEASE_NAMESPACE})"
    );
    node.install_remora(&client, RELEASE_NAMESPACE, &[]).await?;
    println!(
        "demo: Remora installed ({:.1} s); namespace {NAMESPACE} labelled {}={}",
        t0.elapsed().as_secs_f64(),
        INJECT_LABEL.0,
        INJECT_LABEL.1
    );

    fresh_namespace(&client).await?;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    let svcs: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let (deploy, svc) = manifests(args.replicas, &args.mode)?;
    deploys.create(&PostParams::default(), &deploy).await?;
    let svc = svcs.create(&PostParams::default(), &svc).await?;
    let ip = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .context("Service has no ClusterIP")?;
    rollout_done(&deploys, args.replicas).await?;
    let first: Vec<Pod> = pods.list(&ListParams::default()).await?.items;
    for p in &first {
        let proxy = p
            .spec
            .as_ref()
            .map(|s| {
                s.containers
                    .iter()
                    .chain(s.init_containers.iter().flatten())
                    .any(|c| c.name == PROXY_CONTAINER)
            })
            .unwrap_or(false);
        if !proxy {
            bail!(
                "pod {} has no {PROXY_CONTAINER} container: not injected",
                p.metadata.name.as_deref().unwrap_or("?")
            );
        }
    }
    println!(
        "demo: {} pods of {APP} Ready with a {} remora-proxy sidecar (real remora-agent + Envoy 1.40.0); Service {ip}:80 → sidecar :{INBOUND_PORT} → app :{APP_PORT}",
        first.len(),
        args.mode
    );
    // The Service answers before the load starts (kube-proxy has the rules).
    let url = format!("http://{ip}/");
    let probe = remora_agent::http_client::HttpClient::new(Duration::from_secs(1));
    wait_until(Duration::from_secs(30), "the Service to answer", || {
        let probe = probe.clone();
        let url = url.clone();
        async move {
            Ok::<_, anyhow::Error>(match probe.get(&url).await {
                Ok(r) if r.status == 200 => Check::Done(()),
                Ok(r) => Check::NotYet(format!("HTTP {}", r.status)),
                Err(e) => Check::NotYet(e.to_string()),
            })
        }
    })
    .await?;

    // Watch every pod (by polling the list) until the end.
    let epoch = Instant::now();
    let seen: Arc<std::sync::Mutex<BTreeMap<String, Seen>>> = Arc::default();
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (pods, seen, watching) = (pods.clone(), seen.clone(), watching.clone());
        tokio::spawn(async move {
            while watching.load(Ordering::SeqCst) {
                if let Ok(list) = pods.list(&ListParams::default()).await {
                    let at = epoch.elapsed();
                    let mut seen = seen
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let names: Vec<String> = list
                        .items
                        .iter()
                        .filter_map(|p| p.metadata.name.clone())
                        .collect();
                    for p in &list.items {
                        let Some(name) = p.metadata.name.clone() else {
                            continue;
                        };
                        let s = seen.entry(name).or_default();
                        if p.metadata.deletion_timestamp.is_some() && s.deleted_at.is_none() {
                            s.deleted_at = Some(at);
                            s.grace = p.metadata.deletion_grace_period_seconds;
                        }
                        if let Some(st) = &p.status {
                            record(s, st.container_statuses.as_deref().unwrap_or_default(), at);
                            record(
                                s,
                                st.init_container_statuses.as_deref().unwrap_or_default(),
                                at,
                            );
                        }
                    }
                    for (name, s) in seen.iter_mut() {
                        if !names.contains(name) && s.gone_at.is_none() {
                            s.gone_at = Some(at);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };

    let target = std::net::SocketAddr::new(
        ip.parse()
            .with_context(|| format!("ClusterIP {ip:?} is not an address"))?,
        80,
    );
    let load = Traffic::start(
        vec![Load::new(
            Kind::Http1KeepAlive,
            target,
            f64::from(args.rate),
        )],
        Instant::now(),
    );
    println!(
        "demo: {} req/s through the Service (HTTP/1.1 keep-alive, no client retries)",
        args.rate
    );
    tokio::time::sleep(args.settle).await;
    println!(
        "demo: +{:.1} s rolling restart (maxSurge 1, maxUnavailable 0)",
        epoch.elapsed().as_secs_f64()
    );
    let restart = json!({"spec": {"template": {"metadata": {"annotations": {
        "kubectl.kubernetes.io/restartedAt": format!("{:?}", std::time::SystemTime::now())
    }}}}});
    deploys
        .patch(APP, &PatchParams::default(), &Patch::Merge(&restart))
        .await?;
    rollout_done(&deploys, args.replicas).await?;
    println!(
        "demo: +{:.1} s rollout complete",
        epoch.elapsed().as_secs_f64()
    );
    let old: Vec<String> = first
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    wait_until(Duration::from_secs(120), "the old pods to be gone", || {
        let seen = seen.clone();
        let old = old.clone();
        async move {
            let seen = seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let left = old
                .iter()
                .filter(|n| seen.get(*n).is_none_or(|s| s.gone_at.is_none()))
                .count();
            Ok::<_, anyhow::Error>(if left == 0 {
                Check::Done(())
            } else {
                Check::NotYet(format!("{left} still there"))
            })
        }
    })
    .await?;
    println!(
        "demo: +{:.1} s old pods gone",
        epoch.elapsed().as_secs_f64()
    );
    tokio::time::sleep(args.settle).await;
    let samples = load.stop().await;
    watching.store(false, Ordering::SeqCst);
    watcher.await?;

    let sum = LoadSummary::of(&samples);
    println!();
    println!("== report ==");
    println!(
        "requests sent {}, ok {}, lost {} (p50 {:.1} ms, p99 {:.1} ms)",
        sum.sent, sum.ok, sum.failed, sum.latency.p50_ms, sum.latency.p99_ms
    );
    let mut causes: BTreeMap<String, usize> = BTreeMap::new();
    for s in samples.iter().filter(|s| !s.outcome.is_ok()) {
        let why = match &s.outcome {
            Outcome::Status { code, .. } => format!("HTTP {code}"),
            o => o.to_string(),
        };
        *causes.entry(why).or_default() += 1;
    }
    for (why, n) in &causes {
        println!("  lost {n}: {why}");
    }
    let lost_at: Vec<f64> = samples
        .iter()
        .filter(|s| !s.outcome.is_ok())
        .map(|s| s.at.as_secs_f64())
        .collect();
    if let (Some(first), Some(last)) = (lost_at.first(), lost_at.last()) {
        println!("  lost between +{first:.1} s and +{last:.1} s");
    }
    println!("how each old pod stopped (times since the load started):");
    let seen = seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    for name in &old {
        let s = seen.get(name).cloned().unwrap_or_default();
        let rel = |t: Option<Duration>| {
            t.map_or("?".to_owned(), |t| format!("+{:.1} s", t.as_secs_f64()))
        };
        let exits: Vec<String> = s
            .exits
            .iter()
            .map(|(c, (code, reason, at))| format!("{c} exit {code} ({reason}) {}", rel(Some(*at))))
            .collect();
        let took = match (s.deleted_at, s.gone_at) {
            (Some(d), Some(g)) => format!("{:.1} s", g.saturating_sub(d).as_secs_f64()),
            _ => "?".to_owned(),
        };
        println!(
            "  {name}: deleted {}, {}; gone {} — stopped in {took} of its {} s grace",
            rel(s.deleted_at),
            if exits.is_empty() {
                "no exit seen".to_owned()
            } else {
                exits.join(", ")
            },
            rel(s.gone_at),
            s.grace.map_or("?".to_owned(), |g| g.to_string())
        );
    }
    let guard = node.guard_drops().await?;
    println!(
        "egress guard dropped {guard} packets (pod and Service traffic stayed on this machine)"
    );
    println!("demo: done in {:.0} s", t0.elapsed().as_secs_f64());
    if sum.failed > 0 || guard > 0 {
        std::process::exit(1);
    }
    Ok(())
}
