//! What the leader's pod watch keeps per pod (not run by `cargo test`):
//! pods shaped like scale-bench's (a Deployment's pod, injected: labels,
//! `remora.dev/status` with four layers, `remora.dev/lifecycle`, a
//! controlling ReplicaSet), read from their JSON and trimmed as the watch
//! does, with a workload's ten pods sharing labels, lifecycle and status.
//! Bytes are the allocator's count of what stays allocated: read through
//! one watch's `Slim`, each alone (nothing shared), and untrimmed (labels
//! and annotations left in `ObjectMeta`'s maps), the `Arc`s and the `Vec`
//! slot that hold each pod included. Not covered: the
//! store's and the index's keys, and the allocator's own overhead.
//!
//! `cargo bench -p remora-operator --bench pod_store` writes a table to
//! stdout and JSON to `bench/results/pod-store.json`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use remora_operator::cluster::live_pod::{LivePod, Slim};
use remora_operator::controllers::lifecycle::status::PodInfo;
use remora_test_support::results;
use serde_json::json;

#[global_allocator]
static ALLOC: cap::Cap<mimalloc::MiMalloc> = cap::Cap::new(mimalloc::MiMalloc, usize::MAX);

#[derive(Debug, Parser)]
#[command(name = "pod_store")]
struct Args {
    #[arg(long, default_value_t = 10_000)]
    pods: usize,
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/results/pod-store.json"))]
    out: PathBuf,
    /// What cargo passes to every bench.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Pod `i`, as the API server sends it; pods of one workload come in tens.
fn pod_json(i: usize) -> String {
    let w = i / 10;
    let ns = format!("scale-{:03}", w % 200);
    let owner = format!("deploy-{w}-7c9d8f6b5");
    let status = json!({
        "version": "0.1.0", "mode": "Legacy", "containers": ["remora-proxy"],
        "initContainers": [], "volumes": ["remora-run", "remora-podinfo"],
        "configHash": "sha256:6e093356015bc1d1", "restartHash": "sha256:8d94af282e58447e",
        "sources": ["defaults", "cluster:remora-system/scale-cluster-default",
            format!("namespace:{ns}/wide"), format!("workload:{ns}/sel-{w}")],
    });
    let lifecycle = json!({
        "mode": "Legacy",
        "startup": {"holdApplicationUntilProxyStarts": true, "timeout": "1m"},
        "shutdown": {"drainDuration": "45s", "terminationDrainDuration": "5s",
            "exitOnZeroActiveConnections": false, "minimumDrainDuration": "5s",
            "drainMode": "Adaptive", "quietPeriod": "3s"},
        "drainDeadline": "25s",
    });
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("{owner}-{i:05}"), "generateName": format!("{owner}-"),
            "namespace": ns, "uid": format!("6f1c2f9e-4b1a-4d2c-9e7f-{i:012}"),
            "resourceVersion": "123456", "creationTimestamp": "2026-11-22T10:00:00Z",
            "labels": {"app": format!("deploy-{w}"), "pod-template-hash": "7c9d8f6b5",
                "remora.dev/scale-run": "run-1"},
            "annotations": {"remora.dev/status": status.to_string(),
                "remora.dev/lifecycle": lifecycle.to_string()},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner,
                "uid": format!("0f1c2f9e-4b1a-4d2c-9e7f-{w:012}"), "controller": true,
                "blockOwnerDeletion": true}],
        },
        "spec": {"nodeName": "node-1", "restartPolicy": "Always",
            "containers": [{"name": "app", "image": "registry.invalid/app:1"},
                {"name": "remora-proxy", "image": "remora-agent:dev"}]},
        "status": {"phase": "Running"},
    })
    .to_string()
}

/// How the pods are kept.
enum How<'a> {
    /// Through one watch's `Slim`: a workload's pods share.
    Shared(&'a mut Slim),
    /// A `Slim` of its own for each pod: nothing shared.
    Alone,
    /// As parsed, labels and annotations left in `ObjectMeta`'s maps (what
    /// this layout replaced, less the copy of the status it parsed apart).
    Untrimmed,
}

/// Bytes a pod keeps allocated, read from `jsons` and kept as `how`.
fn bytes_per_pod(jsons: &[String], mut how: How) -> anyhow::Result<f64> {
    let before = ALLOC.allocated();
    let mut pods = Vec::with_capacity(jsons.len());
    for j in jsons {
        let mut p: LivePod = serde_json::from_str(j).context("a pod reads as a LivePod")?;
        match &mut how {
            How::Shared(slim) => slim.slim(&mut p),
            How::Alone => Slim::default().slim(&mut p),
            How::Untrimmed => {}
        }
        pods.push(Arc::new(PodInfo::of(Arc::new(p))));
    }
    let after = ALLOC.allocated();
    drop(pods);
    Ok(after.saturating_sub(before) as f64 / jsons.len().max(1) as f64)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let machine_before = results::machine();
    let jsons: Vec<String> = (0..args.pods).map(pod_json).collect();
    let json_bytes = jsons.iter().map(String::len).sum::<usize>() as f64 / args.pods.max(1) as f64;
    let mut slim = Slim::default();
    let shared = bytes_per_pod(&jsons, How::Shared(&mut slim))?;
    let alone = bytes_per_pod(&jsons, How::Alone)?;
    let untrimmed = bytes_per_pod(&jsons, How::Untrimmed)?;
    println!("{} pods, {json_bytes:.0} B of JSON each", args.pods);
    println!("{:<44} {:>10}", "kept per pod", "bytes");
    println!(
        "{:<44} {:>10.0}",
        "through one watch (a workload's shared)", shared
    );
    println!("{:<44} {:>10.0}", "each alone (nothing shared)", alone);
    println!(
        "{:<44} {:>10.0}",
        "untrimmed (labels, annotations in maps)", untrimmed
    );
    let out = json!({
        "pods": args.pods,
        "json_bytes_per_pod": json_bytes,
        "bytes_per_pod": shared,
        "bytes_per_pod_unshared": alone,
        "bytes_per_pod_untrimmed": untrimmed,
        "not_covered": "the reflector store's and the pod index's keys; the allocator's own overhead",
    });
    results::write(&args.out, &results::document(&machine_before, out))
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    Ok(())
}
