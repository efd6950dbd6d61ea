//! Pods a tenant writes to be as large as the API server stores them, read
//! as the leader's pod watch reads them (its JSON parse, then `Slim`): what
//! stays allocated per pod is bounded whatever the pods carry. Counted by
//! the allocator, in a test binary of its own (one test: nothing else
//! allocates meanwhile).

use std::sync::Arc;

use remora_operator::cluster::live_pod::{
    LivePod, MAX_CONTAINERS, MAX_LABEL_BYTES, MAX_LABELS, MAX_LIFECYCLE, MAX_SETTING, MAX_STATUS,
    Metrics, Slim,
};
use serde_json::json;

#[global_allocator]
static ALLOC: cap::Cap<std::alloc::System> = cap::Cap::new(std::alloc::System, usize::MAX);

const PODS: usize = 200;

/// Pod `i` of a tenant's namespace outside the mesh, with `meta` merged
/// into its metadata and `spec` as its spec.
fn pod(i: usize, meta: serde_json::Value, spec: serde_json::Value) -> String {
    let mut m = json!({
        "name": format!("bloat-{i:05}"), "namespace": "tenant", "uid": format!("uid-{i:08}"),
        "resourceVersion": "1", "creationTimestamp": "2026-11-22T10:00:00Z",
    });
    if let (Some(m), Some(extra)) = (m.as_object_mut(), meta.as_object()) {
        m.extend(extra.clone());
    }
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": m, "spec": spec,
        "status": {"phase": "Pending"}})
    .to_string()
}

/// An ordinary pod: two labels, no annotations.
fn plain(i: usize) -> String {
    pod(
        i,
        json!({"labels": {"app": format!("web-{i}"), "tier": "front"}}),
        json!({"containers": [{"name": "app", "image": "app:1"}]}),
    )
}

/// What the attack writes: a 200 KiB `remora.dev/pad`, a 50 KiB annotation
/// of another tool, 1,000 labels, 1,000 ownerReferences and containers.
fn bloated(i: usize) -> String {
    let labels: serde_json::Map<String, serde_json::Value> = (0..1_000)
        .map(|l| {
            (
                format!("example.com/label-{l:04}"),
                format!("{i}-{l}-{}", "v".repeat(50)).into(),
            )
        })
        .collect();
    let owners: Vec<_> = (0..1_000)
        .map(|o| {
            json!({"apiVersion": "v1", "kind": "ConfigMap", "name": format!("cm-{o}"),
            "uid": format!("{i}-{o}")})
        })
        .collect();
    let containers: Vec<_> = (0..1_000)
        .map(|c| json!({"name": format!("c{c}"), "image": "app:1"}))
        .collect();
    pod(
        i,
        json!({
            "labels": labels,
            "annotations": {
                "remora.dev/pad": format!("{i}{}", "x".repeat(200 << 10)),
                "example.com/config": format!("{i}{}", "y".repeat(50 << 10)),
            },
            "ownerReferences": owners,
        }),
        json!({"restartPolicy": "Never", "containers": containers}),
    )
}

/// The most a pod keeps: one that claims to be injected (anyone may write
/// `remora.dev/status`) with every kept field at its bound.
fn at_the_bounds(i: usize) -> String {
    let per_label = MAX_LABEL_BYTES / MAX_LABELS;
    let labels: serde_json::Map<String, serde_json::Value> = (0..MAX_LABELS)
        .map(|l| {
            let k = format!("k{l:02}-{i:06}");
            let v = "v".repeat(per_label - k.len());
            (k, v.into())
        })
        .collect();
    let mut annotations = serde_json::Map::new();
    let source = "s".repeat(MAX_STATUS / 4 - 16);
    annotations.insert(
        "remora.dev/status".into(),
        json!({"sources": [format!("{i}{source}"), format!("a{source}"), format!("b{source}")]})
            .to_string()
            .into(),
    );
    annotations.insert(
        "remora.dev/lifecycle".into(),
        format!("{i}{}", "l".repeat(MAX_LIFECYCLE - 8)).into(),
    );
    for k in remora_contract::annotations::PER_FIELD {
        annotations.insert(
            k.into(),
            format!("{i}{}", "s".repeat(MAX_SETTING - 8)).into(),
        );
    }
    let containers: Vec<_> = (0..MAX_CONTAINERS)
        .map(|c| json!({"name": format!("c{c:02}-{}", "n".repeat(59))}))
        .collect();
    pod(
        i,
        json!({"labels": labels, "annotations": annotations,
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": format!("job-{i}"),
                "uid": format!("{i}"), "controller": true}]}),
        json!({"restartPolicy": "Never", "containers": containers}),
    )
}

/// Bytes that stay allocated per pod, the pods read from `jsons` through
/// one watch's `Slim` and held as the store holds them.
fn kept_per_pod(jsons: &[String]) -> usize {
    let mut slim = Slim::new(Metrics::default());
    let before = ALLOC.allocated();
    let mut pods = Vec::with_capacity(jsons.len());
    for j in jsons {
        let mut p: LivePod = serde_json::from_str(j).expect("a pod reads as a LivePod");
        slim.slim(&mut p);
        pods.push(Arc::new(p));
    }
    let after = ALLOC.allocated();
    drop(pods);
    drop(slim);
    after.saturating_sub(before) / jsons.len()
}

#[test]
fn bloated_pods_keep_no_more_than_plain_ones() {
    let plain: Vec<String> = (0..PODS).map(plain).collect();
    let bloated: Vec<String> = (0..PODS).map(bloated).collect();
    let bounds: Vec<String> = (0..PODS).map(at_the_bounds).collect();
    let json_per_pod = bloated[0].len();
    assert!(
        json_per_pod > 300 << 10,
        "the attack's pods are big: {json_per_pod} B"
    );
    let (plain, bloated, bounds) = (
        kept_per_pod(&plain),
        kept_per_pod(&bloated),
        kept_per_pod(&bounds),
    );
    eprintln!(
        "kept per pod: plain {plain} B, bloated ({json_per_pod} B of JSON) {bloated} B, \
         every field at its bound {bounds} B"
    );
    assert!(
        bloated <= plain,
        "a bloated pod keeps {bloated} B, a plain one {plain} B"
    );
    // The sum of the bounds (labels, status, lifecycle, settings, container
    // names) and the allocations holding them.
    assert!(bounds <= 24 << 10, "a pod at the bounds keeps {bounds} B");
}
