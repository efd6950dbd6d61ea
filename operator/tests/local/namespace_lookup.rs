//! A namespace the cache has not seen yet (created a moment before its
//! first pod) is looked up, not taken as unlabelled: a pod that should get
//! a sidecar never silently goes without one.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::future::BoxFuture;
use remora_inject::resolve::{ChartDefaults, LifecycleEntry};
use remora_operator::webhook::handler::{AdmissionOutcome, Injector};
use remora_operator::webhook::view::{
    ClusterView, LookingUpView, Lookup, LookupError, NAMESPACE_LOOKUP_TIMEOUT, StaticView,
    bounded_lookup,
};
use serde_json::{Value, json};

/// What the lookup of a namespace the cache does not know gives.
#[derive(Clone, Copy)]
enum Source {
    /// The API server has it, labelled for injection.
    Enabled,
    /// The API server does not answer in time.
    Hangs,
    /// The API server answers with an error.
    Fails,
}

/// A view whose cache knows no namespace, and which counts its lookups.
struct Lagging {
    source: Source,
    lookups: AtomicUsize,
}

impl ClusterView for Lagging {
    fn lifecycles_in(&self, _: &[&str]) -> Vec<LifecycleEntry> {
        Vec::new()
    }
    fn namespace_labels(&self, _: &str) -> Option<BTreeMap<String, String>> {
        None
    }
    fn native_sidecars(&self) -> bool {
        true
    }
    fn lookup_namespace_labels<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Lookup> {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        let source = self.source;
        Box::pin(async move {
            match source {
                Source::Enabled => Ok(Some(BTreeMap::from([(
                    "remora.dev/inject".to_string(),
                    "enabled".to_string(),
                )]))),
                Source::Hangs => {
                    bounded_lookup(namespace, NAMESPACE_LOOKUP_TIMEOUT, std::future::pending())
                        .await
                }
                Source::Fails => Err(LookupError::Timeout {
                    namespace: namespace.to_string(),
                    timeout: Duration::ZERO,
                }),
            }
        })
    }
}

fn injector(source: Source) -> (Injector, Arc<Lagging>) {
    let view = Arc::new(Lagging {
        source,
        lookups: AtomicUsize::new(0),
    });
    let inj = Injector {
        chart: ChartDefaults::default(),
        operator_namespace: "remora-system".into(),
        view: view.clone(),
    };
    (inj, view)
}

fn review(namespace: &str, pod_labels: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "7f7c3c55-0d7e-4a53-9d0e-2b3c1a0f0e01",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "test"},
            "object": {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "web", "namespace": namespace, "labels": pod_labels},
                "spec": {"containers": [{"name": "app", "image": "a", "ports": [{"containerPort": 8080}]}]},
            },
        }
    }))
    .unwrap_or_default()
}

fn response(rev: &impl serde::Serialize) -> Value {
    serde_json::to_value(rev).unwrap_or_default()["response"].clone()
}

#[tokio::test]
async fn a_namespace_not_yet_in_the_cache_is_looked_up_and_its_pod_injected() {
    let (inj, view) = injector(Source::Enabled);
    let (rev, outcome) = inj.review(&review("fresh", json!({"app": "web"}))).await;
    assert_eq!(outcome, AdmissionOutcome::Injected, "{}", response(&rev));
    assert_eq!(view.lookups.load(Ordering::SeqCst), 1);

    // The pod's own label decides alone: no lookup.
    for label in ["true", "false"] {
        let (_, outcome) = inj
            .review(&review("fresh", json!({"remora.dev/inject": label})))
            .await;
        let want = if label == "true" {
            AdmissionOutcome::Injected
        } else {
            AdmissionOutcome::Skipped
        };
        assert_eq!(outcome, want);
    }
    assert_eq!(view.lookups.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_failed_lookup_refuses_the_pod_with_the_reason() {
    let (inj, _) = injector(Source::Fails);
    let (rev, outcome) = inj.review(&review("fresh", json!({"app": "web"}))).await;
    assert_eq!(outcome, AdmissionOutcome::Refused);
    let resp = response(&rev);
    assert_eq!(resp["uid"], "7f7c3c55-0d7e-4a53-9d0e-2b3c1a0f0e01");
    assert_eq!(resp["allowed"], false, "{resp}");
    let msg = resp["status"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.starts_with("remora: refused:") && msg.contains("\"fresh\""),
        "{msg:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lookup_that_never_answers_is_given_up_after_the_timeout() {
    let (inj, _) = injector(Source::Hangs);
    let start = tokio::time::Instant::now();
    let (rev, outcome) = inj.review(&review("fresh", json!({"app": "web"}))).await;
    assert_eq!(start.elapsed(), NAMESPACE_LOOKUP_TIMEOUT);
    assert_eq!(outcome, AdmissionOutcome::Refused);
    let resp = response(&rev);
    assert_eq!(resp["allowed"], false);
    let msg = resp["status"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("did not answer within 2s"), "{msg:?}");
}

/// A fake API server that knows namespace "fresh" (labelled enabled), says
/// 404 for "absent" and 500 for anything else.
async fn fake_api() -> anyhow::Result<kube::Client> {
    async fn namespace(Path(name): Path<String>) -> Response {
        match name.as_str() {
            "fresh" => axum::Json(json!({
                "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                "metadata": {"name": "fresh", "labels": {"remora.dev/inject": "enabled"}},
            }))
            .into_response(),
            "absent" => (
                StatusCode::NOT_FOUND,
                axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "reason": "NotFound", "code": 404,
                    "message": "namespaces \"absent\" not found"})),
            )
                .into_response(),
            _ => (
                StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "reason": "InternalError", "code": 500,
                    "message": "etcd is down"})),
            )
                .into_response(),
        }
    }
    let app = Router::new().route("/api/v1/namespaces/{name}", get(namespace));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(kube::Client::try_from(kube::Config::new(
        format!("http://{addr}").parse()?,
    ))?)
}

#[tokio::test]
async fn the_operators_view_reads_unknown_namespaces_from_the_api() -> anyhow::Result<()> {
    let view = LookingUpView::new(
        StaticView::default(),
        fake_api().await?,
        NAMESPACE_LOOKUP_TIMEOUT,
    );
    let labels = view.lookup_namespace_labels("fresh").await?;
    assert_eq!(
        labels
            .as_ref()
            .and_then(|l| l.get("remora.dev/inject"))
            .map(String::as_str),
        Some("enabled")
    );
    assert_eq!(view.lookup_namespace_labels("absent").await?, None);
    let err = view.lookup_namespace_labels("broken").await;
    assert!(
        matches!(&err, Err(LookupError::Api { namespace, .. }) if namespace == "broken"),
        "{err:?}"
    );

    // Through the handler: injected on the first pod of a namespace the
    // cache has not seen.
    let inj = Injector {
        chart: ChartDefaults::default(),
        operator_namespace: "remora-system".into(),
        view: Arc::new(view),
    };
    let (_, outcome) = inj.review(&review("fresh", json!({"app": "web"}))).await;
    assert_eq!(outcome, AdmissionOutcome::Injected);
    let (_, outcome) = inj.review(&review("broken", json!({"app": "web"}))).await;
    assert_eq!(outcome, AdmissionOutcome::Refused);
    Ok(())
}
