//! The operator's API-writing parts against small fake API servers over
//! HTTP on 127.0.0.1:0: the self-managed CA (the first replica creates the
//! Secret, a racing one adopts the winner's; the `caBundle` keeper watches,
//! so it is tested on the real API server in `e2e/tests/envtest/chart.rs` and
//! `e2e/tests/envtest/ca_rotation.rs`) and the
//! status controller (status subresource, live lifecycle annotation).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use remora_operator::pki::webhook_cert as ca;
use remora_test_support::wait::Wait;
use serde_json::{Value, json};

const SECRET_PATH: &str = "/api/v1/namespaces/remora-system/secrets/remora-operator-tls";

#[derive(Default)]
struct Fake {
    secret: Option<Value>,
    /// Answer the next create with 409 and store this secret instead.
    race_with: Option<Value>,
}

type Shared = Arc<Mutex<Fake>>;

fn status(code: u16, reason: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": reason, "reason": reason, "code": code});
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        axum::Json(body),
    )
        .into_response()
}

async fn get_secret(State(s): State<Shared>) -> Response {
    let fake = s.lock().map(|f| f.secret.clone()).unwrap_or_default();
    match fake {
        Some(v) => axum::Json(v).into_response(),
        None => status(404, "NotFound"),
    }
}

async fn create_secret(State(s): State<Shared>, body: Bytes) -> Response {
    let Ok(mut f) = s.lock() else {
        return status(500, "poisoned");
    };
    if let Some(other) = f.race_with.take() {
        f.secret = Some(other);
        return status(409, "AlreadyExists");
    }
    let v: Value = serde_json::from_slice(&body).unwrap_or_default();
    f.secret = Some(v.clone());
    (StatusCode::CREATED, axum::Json(v)).into_response()
}

async fn start(fake: Fake) -> anyhow::Result<(kube::Client, Shared)> {
    let shared: Shared = Arc::new(Mutex::new(fake));
    let app = Router::new()
        .route(SECRET_PATH, get(get_secret))
        .route(
            "/api/v1/namespaces/remora-system/secrets",
            axum::routing::post(create_secret),
        )
        .with_state(Arc::clone(&shared));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let config = kube::Config::new(format!("http://{addr}").parse()?);
    Ok((kube::Client::try_from(config)?, shared))
}

#[tokio::test]
async fn first_replica_creates_the_secret_and_later_ones_reuse_it() -> anyhow::Result<()> {
    let (client, shared) = start(Fake::default()).await?;
    let first = ca::ensure_secret(
        &client,
        "remora-system",
        "remora-operator-tls",
        "remora-operator",
        ca::Validity::default(),
    )
    .await?;
    assert!(shared.lock().map(|f| f.secret.is_some()).unwrap_or(false));
    let second = ca::ensure_secret(
        &client,
        "remora-system",
        "remora-operator-tls",
        "remora-operator",
        ca::Validity::default(),
    )
    .await?;
    assert_eq!(first, second, "a second replica reads the same bundle");
    Ok(())
}

#[tokio::test]
async fn losing_the_create_race_adopts_the_winner() -> anyhow::Result<()> {
    let winner = ca::generate(&ca::service_names("remora-operator", "remora-system"))?;
    let secret = serde_json::to_value(ca::to_secret(
        "remora-operator-tls",
        "remora-system",
        &winner,
    ))?;
    let (client, _) = start(Fake {
        race_with: Some(secret),
        ..Fake::default()
    })
    .await?;
    let got = ca::ensure_secret(
        &client,
        "remora-system",
        "remora-operator-tls",
        "remora-operator",
        ca::Validity::default(),
    )
    .await?;
    assert_eq!(got, winner);
    Ok(())
}

/// The status controller's loop against the same kind of fake: it writes
/// the status subresource and refreshes a stale lifecycle annotation.
/// A read-only fake for the reflectors: lists answer with fixed objects,
/// watches stay open and silent.
async fn start_lister(nodes: &[&str], apiserver_minor: &str) -> anyhow::Result<kube::Client> {
    use axum::extract::{Query, Request};
    use std::collections::HashMap;

    fn list_or_watch(q: &HashMap<String, String>, list: Value) -> Response {
        if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
            let never = futures::stream::pending::<Result<Bytes, std::io::Error>>();
            return Response::new(axum::body::Body::from_stream(never));
        }
        axum::Json(list).into_response()
    }
    let node_items: Vec<Value> = nodes
        .iter()
        .enumerate()
        .map(|(i, v)| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": format!("n{i}"), "resourceVersion": "1"},
            "status": {"nodeInfo": {"kubeletVersion": v, "architecture": "amd64", "bootID": "", "containerRuntimeVersion": "",
                "kernelVersion": "", "kubeProxyVersion": "", "machineID": "", "operatingSystem": "linux", "osImage": "", "systemUUID": ""}}}))
        .collect();
    let nodes_list = json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "1"}, "items": node_items});
    let ns_list = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": {"resourceVersion": "1"},
        "items": [{"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": "shop", "resourceVersion": "1", "labels": {"remora.dev/inject": "enabled"}}}]});
    let slc_list = json!({"apiVersion": "remora.dev/v1alpha1", "kind": "SidecarLifecycleList", "metadata": {"resourceVersion": "1"},
        "items": [{"apiVersion": "remora.dev/v1alpha1", "kind": "SidecarLifecycle",
            "metadata": {"name": "default", "namespace": "remora-system", "resourceVersion": "1", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"shutdown": {"terminationDrainDuration": "2s"}}}]});
    let version = json!({"major": "1", "minor": apiserver_minor, "gitVersion": format!("v1.{apiserver_minor}.0"),
        "gitCommit": "", "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24",
        "compiler": "gc", "platform": "linux/amd64"});
    let app = Router::new()
        .route("/version", get(move || async move { axum::Json(version) }))
        .route(
            "/api/v1/nodes",
            get(move |Query(q): Query<HashMap<String, String>>| async move {
                list_or_watch(&q, nodes_list)
            }),
        )
        .route(
            "/api/v1/namespaces",
            get(move |Query(q): Query<HashMap<String, String>>| async move {
                list_or_watch(&q, ns_list)
            }),
        )
        .route(
            "/apis/remora.dev/v1alpha1/sidecarlifecycles",
            get(move |Query(q): Query<HashMap<String, String>>| async move {
                list_or_watch(&q, slc_list)
            }),
        )
        .fallback(|r: Request| async move { status(404, &format!("NotFound {}", r.uri())) });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(kube::Client::try_from(kube::Config::new(
        format!("http://{addr}").parse()?,
    ))?)
}

async fn wait_native(view: &remora_operator::cluster::view::KubeView, want: bool) {
    use remora_operator::webhook::view::ClusterView;
    let what = format!("native_sidecars to become {want}");
    Wait::new(Duration::from_secs(10), &what)
        .every(Duration::from_millis(20))
        .until(|| async { view.native_sidecars() == want })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test]
async fn reflectors_feed_the_view_and_nodes_decide_auto() -> anyhow::Result<()> {
    use remora_operator::webhook::view::ClusterView;
    // New API server, but one old kubelet: Auto must mean Legacy.
    let client = start_lister(&["v1.31.2", "v1.28.9"], "31").await?;
    let view = remora_operator::cluster::view::start(
        client,
        Duration::from_secs(10),
        tokio_util::sync::CancellationToken::new(),
    )
    .await?;
    let entries = view.lifecycles_in(&["shop", "remora-system"]);
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].namespace, "remora-system");
    assert!(
        view.lifecycles_in(&["shop"]).is_empty(),
        "another namespace's resources are not copied"
    );
    assert_eq!(
        view.namespace_labels("shop")
            .and_then(|l| l.get("remora.dev/inject").cloned())
            .as_deref(),
        Some("enabled")
    );
    assert_eq!(view.namespace_labels("absent"), None);
    wait_native(&view, false).await;

    // Old API server, every kubelet new: the nodes win, Auto means Native.
    let client = start_lister(&["v1.30.0", "v1.29.1-eks-1"], "28").await?;
    let view = remora_operator::cluster::view::start(
        client,
        Duration::from_secs(10),
        tokio_util::sync::CancellationToken::new(),
    )
    .await?;
    wait_native(&view, true).await;
    Ok(())
}
