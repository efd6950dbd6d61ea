//! The leader's work: supervised tasks, and one watch per kind shared by
//! the controllers (against a fake API server that counts requests).

use std::sync::atomic::{AtomicU32, Ordering};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

use super::*;
use remora_contract::pod::PROXY_CONTAINER;
use remora_inject::patch::STATUS_ANNOTATION;

#[tokio::test(start_paused = true)]
async fn a_leader_task_that_dies_is_started_again_until_cancelled() {
    let token = CancellationToken::new();
    let starts = Arc::new(AtomicU32::new(0));
    let task = {
        let starts = Arc::clone(&starts);
        move |t: CancellationToken| {
            let n = starts.fetch_add(1, Ordering::SeqCst);
            async move {
                match n {
                    0 => {}                            // ends early
                    1 => panic!("test double panics"), // dies
                    _ => t.cancelled().await,          // behaves
                }
            }
        }
    };
    let run = tokio::spawn(supervise("test", token.clone(), task));
    // 1 s, then 2 s of backoff before the third start.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(starts.load(Ordering::SeqCst), 3);
    token.cancel();
    run.await.expect("supervise returns on cancel");
    assert_eq!(starts.load(Ordering::SeqCst), 3, "no start after cancel");
}

/// Every request the fake API server got: `METHOD path?query`.
type Seen = Arc<tokio::sync::watch::Sender<Vec<String>>>;

const SLC_STATUS: &str =
    "PATCH /apis/remora.dev/v1alpha1/namespaces/remora-system/sidecarlifecycles/default/status";
const POD_PATCH: &str = "PATCH /api/v1/namespaces/shop/pods/job-1";

fn slc() -> Value {
    json!({"apiVersion": "remora.dev/v1alpha1", "kind": "SidecarLifecycle",
        "metadata": {"name": "default", "namespace": "remora-system", "resourceVersion": "1",
            "generation": 1, "uid": "slc-1", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"shutdown": {"terminationDrainDuration": "2s"}}})
}

/// A Legacy-injected Job pod whose app has exited: Jobs asks its sidecar to
/// stop.
fn job_pod() -> Value {
    let status = |name: &str, state: Value| json!({"name": name, "image": "", "imageID": "", "ready": false, "restartCount": 0, "state": state});
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "job-1", "namespace": "shop", "uid": "pod-1", "resourceVersion": "1",
            "annotations": {STATUS_ANNOTATION: "{}"}},
        "spec": {"restartPolicy": "Never", "containers": [{"name": PROXY_CONTAINER}, {"name": "app"}]},
        "status": {"phase": "Running", "containerStatuses": [
            status("app", json!({"terminated": {"exitCode": 0}})),
            status(PROXY_CONTAINER, json!({"running": {}}))]}})
}

fn list(kind: &str, items: Vec<Value>) -> Response {
    axum::Json(json!({"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": "1"}, "items": items}))
        .into_response()
}

/// Lists answer with fixed objects, watches stay open and silent, the
/// controllers' writes are answered with what they wrote about.
async fn fake(State(seen): State<Seen>, req: Request) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let query = req.uri().query().unwrap_or_default().to_owned();
    seen.send_modify(|v| v.push(format!("{method} {path}?{query}")));
    if query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1")
    {
        let never = futures::stream::pending::<Result<axum::body::Bytes, std::io::Error>>();
        return Response::new(Body::from_stream(never));
    }
    match (method, path.as_str()) {
        (Method::GET, "/version") => axum::Json(json!({"major": "1", "minor": "36",
            "gitVersion": "v1.36.0", "gitCommit": "", "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.26", "compiler": "gc",
            "platform": "linux/amd64"}))
        .into_response(),
        (Method::GET, "/apis/remora.dev/v1alpha1/sidecarlifecycles") => {
            list("SidecarLifecycleList", vec![slc()])
        }
        (Method::GET, "/api/v1/namespaces") => list("PartialObjectMetadataList", vec![]),
        (Method::GET, "/api/v1/nodes") => list("NodeList", vec![]),
        (Method::GET, "/api/v1/pods") => list("PodList", vec![job_pod()]),
        (Method::PATCH, p) if format!("PATCH {p}") == SLC_STATUS => {
            axum::Json(slc()).into_response()
        }
        (Method::PATCH, p) if format!("PATCH {p}") == POD_PATCH => axum::Json(json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": "job-1", "namespace": "shop"}}))
        .into_response(),
        _ => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"kind": "Status", "apiVersion": "v1",
            "metadata": {}, "status": "Failure", "reason": "NotFound", "code": 404})),
        )
            .into_response(),
    }
}

async fn fake_api() -> anyhow::Result<(kube::Config, Seen)> {
    let seen: Seen = Arc::new(tokio::sync::watch::Sender::new(Vec::new()));
    let app = axum::Router::new()
        .fallback(fake)
        .with_state(Arc::clone(&seen));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let config = kube::Config::new(format!("http://{addr}").parse()?);
    Ok((config, seen))
}

#[tokio::test]
async fn the_webhook_and_the_leaders_controllers_share_one_watch_per_kind() -> anyhow::Result<()> {
    let (config, seen) = fake_api().await?;
    let client = Client::try_from(config.clone())?;
    let shutdown = CancellationToken::new();
    let view =
        crate::cluster::view::start(client.clone(), Duration::from_secs(10), shutdown.clone())
            .await?;
    let mut registry = Registry::default();
    let ctx = Arc::new(LeaderContext {
        controller: Some(crate::controllers::lifecycle::Settings {
            chart: remora_inject::resolve::ChartDefaults::default(),
            operator_namespace: "remora-system".into(),
            rollout_interval: Duration::from_secs(30),
            automatic_rollouts: true,
            identity: "test".into(),
            qps: crate::controllers::lifecycle::DEFAULT_QPS,
            burst: crate::controllers::lifecycle::DEFAULT_BURST,
        }),
        controller_metrics: crate::controllers::lifecycle::Metrics::register(&mut registry),
        stop_completed_jobs: true,
        pods: None,
        jobs_metrics: crate::controllers::jobs::Metrics::register(&mut registry),
        pod_watch_metrics: crate::cluster::live_pod::Metrics::default(),
        identity: "test".into(),
        lifecycles: view.lifecycle_watch(),
        trust_bundle: None,
        trust_bundle_period: Duration::from_secs(5),
        external_status: None,
        kube: config,
    });
    // On the leader's own runtime and client, as in the binary.
    let leading = tokio::spawn(lead_apart(ctx, shutdown.child_token()));

    // Both controllers have acted on what they were shown: every stream
    // they read was polled, so any watch of their own would be open by now.
    let mut requests = seen.subscribe();
    let acted = |v: &Vec<String>| {
        [SLC_STATUS, POD_PATCH]
            .iter()
            .all(|w| v.iter().any(|r| r.starts_with(&format!("{w}?"))))
    };
    // The guard `wait_for` returns is dropped here: the fake server writes.
    let in_time = matches!(
        tokio::time::timeout(Duration::from_secs(30), requests.wait_for(acted)).await,
        Ok(Ok(_))
    );
    let all = seen.borrow().clone();
    anyhow::ensure!(in_time, "the controllers never acted: {all:#?}");
    let lists = |path: &str| {
        all.iter()
            .filter(|r| r.starts_with(&format!("GET {path}?")) && !r.contains("watch=true"))
            .count()
    };
    assert_eq!(
        lists("/apis/remora.dev/v1alpha1/sidecarlifecycles"),
        1,
        "{all:#?}"
    );
    assert_eq!(lists("/api/v1/pods"), 1, "{all:#?}");

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), leading).await??;
    Ok(())
}

#[tokio::test]
async fn work_apart_runs_on_its_own_lower_priority_thread_and_stops_when_dropped()
-> anyhow::Result<()> {
    /// Tells when the work is dropped, wherever that happens.
    struct Dropped(Option<tokio::sync::oneshot::Sender<()>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }
    let (dropped_tx, dropped) = tokio::sync::oneshot::channel();
    let (where_tx, where_rx) = tokio::sync::oneshot::channel();
    let work = apart(async move {
        let _guard = Dropped(Some(dropped_tx));
        let thread = std::thread::current().name().map(str::to_owned);
        let nice = rustix::process::getpriority_process(Some(rustix::thread::gettid()));
        let _ = where_tx.send((thread, nice.ok()));
        std::future::pending::<()>().await
    })?;
    let running = tokio::spawn(work);
    let (thread, nice) = tokio::time::timeout(Duration::from_secs(10), where_rx).await??;
    assert_eq!(thread.as_deref(), Some(LEADER_THREAD));
    let nice = nice.expect("getpriority");
    assert!(nice >= LEADER_NICE, "nice {nice}");
    // As the elector does when leadership ends.
    running.abort();
    tokio::time::timeout(Duration::from_secs(10), dropped).await??;
    Ok(())
}
