//! A tenant who may create pods anywhere must not be able to grow the
//! leader's memory by what the pods carry (issue 27, item 1). On the real
//! API server (no kubelet: the pods stay Pending), in a namespace outside
//! the mesh: pods with 100 labels each, then as many with a 200 KiB
//! `remora.dev/pad` annotation too. The real `remora-operator serve` leads
//! (its pod watch runs for the Jobs controller); its RSS is read from /proc
//! before and after each, and from a second operator that takes over and
//! lists them all. Each 1,000 pods may cost at most 10 MiB: the allocator
//! alone moves RSS by a few MiB either way over such a run, where keeping
//! the pads cost 267 MiB.
//!
//! `REMORA_BLOAT_PODS` sets how many pods of each (default 1,000: 200 MiB
//! of annotations written to etcd).

use std::time::{Duration, Instant};

use e2e::controlplane::ControlPlane;
use e2e::operator::{Operator, Options};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use remora_test_support::wait::wait_until;
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(120);
/// Growth of the leader's RSS allowed per 1,000 pods.
const MAX_GROWTH_KIB: u64 = 10 << 10;
const PAD: usize = 200 << 10;
const LABELS: usize = 100;

/// Pod `i`: Pending for good, carrying the labels (each value as long as
/// the API allows) and, when `pad`, the pad; distinct from every other pod.
fn bloated(i: usize, pad: bool) -> anyhow::Result<Pod> {
    let pad = if pad { "x".repeat(PAD) } else { String::new() };
    let labels: serde_json::Map<String, serde_json::Value> = (0..LABELS)
        .map(|l| {
            let mut v = format!("{i}-{l}-{}", "v".repeat(63));
            v.truncate(63);
            (format!("example.com/label-{l:03}"), v.into())
        })
        .collect();
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("bloat-{i:05}"),
            "labels": labels,
            "annotations": {"remora.dev/pad": format!("{i}-{pad}")},
        },
        "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    }))?)
}

/// `(VmRSS, VmHWM)` of process `pid`, in KiB.
fn memory_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("no {name} in /proc/{pid}/status"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// A counter of the operator's /metrics (`name` with its labels and the
/// trailing space), over its own TLS; `None` when it cannot be read.
async fn counter(inj: &Operator, name: &str) -> Option<u64> {
    let mut c = remora_test_support::webhook_client::connect(inj.addr(), "localhost", inj.ca_pem())
        .await
        .ok()?;
    let (status, body) = c
        .request(http::Method::GET, "/metrics", Vec::new())
        .await
        .ok()?;
    if status != 200 {
        return None;
    }
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
}

/// Waits until `inj`'s pod watch has read `n` pods over its label bounds:
/// every bloated pod, once.
async fn read_by_watch(inj: &Operator, n: u64) -> anyhow::Result<()> {
    const TRIMMED: &str = "remora_operator_pod_watch_trimmed_total{what=\"labels\"} ";
    wait_until(
        DEADLINE,
        &format!("the leader's pod watch to read {n} bloated pods"),
        || async { Ok::<_, anyhow::Error>(counter(inj, TRIMMED).await.filter(|seen| *seen >= n)) },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn bloated_pending_pods_do_not_grow_the_leader() -> anyhow::Result<()> {
    let pods: usize = std::env::var("REMORA_BLOAT_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    e2e::chart::install_crds(&client).await?;
    let operator_ns = cp.create_namespace(&client, "bloat-operator").await?;
    let ns = cp.create_namespace(&client, "bloat").await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pp = PostParams::default();

    // A first bloated pod: once the leader's watch has read it, the watch
    // has listed and runs; the baseline is taken then.
    api.create(&pp, &bloated(0, true)?).await?;
    let mut first =
        Operator::start(cp.kubeconfig(), Options::fast_leader(&operator_ns, "first")).await?;
    read_by_watch(&first, 1).await?;
    let (base, _) = memory_kib(first.pid())?;
    let create = |range: std::ops::RangeInclusive<usize>, pad: bool| {
        let (api, pp) = (api.clone(), pp.clone());
        futures::stream::iter(range)
            .map(move |i| {
                let (api, pp) = (api.clone(), pp.clone());
                async move { anyhow::Ok(api.create(&pp, &bloated(i, pad)?).await?) }
            })
            .buffer_unordered(8)
            .try_for_each(|_| async { Ok(()) })
    };
    create(1..=pods, false).await?;
    read_by_watch(&first, pods as u64 + 1).await?;
    let (unpadded, _) = memory_kib(first.pid())?;

    let started = Instant::now();
    create(pods + 1..=2 * pods, true).await?;
    let created = started.elapsed();
    read_by_watch(&first, 2 * pods as u64 + 1).await?;
    let (watched, watched_peak) = memory_kib(first.pid())?;

    // A new leader lists them all at once (in pages of `LIST_PAGE` pods).
    first.stop(Duration::from_secs(10));
    let second = Operator::start(
        cp.kubeconfig(),
        Options::fast_leader(&operator_ns, "second"),
    )
    .await?;
    read_by_watch(&second, 2 * pods as u64 + 1).await?;
    let (listed, listed_peak) = memory_kib(second.pid())?;

    eprintln!(
        "leader RSS {base} KiB; {unpadded} KiB after {pods} pods of {LABELS} labels; \
         {watched} KiB (peak {watched_peak} KiB) after {pods} more with a {} KiB pad \
         (created in {created:.1?}); a new leader listing them all: {listed} KiB (peak \
         {listed_peak} KiB)",
        PAD >> 10
    );
    // Per 1,000 pods, each phase on its own: the labels (dropped, over the
    // bounds), then the pads (never read).
    let per_phase = MAX_GROWTH_KIB * pods.max(1_000) as u64 / 1_000;
    assert!(
        unpadded.saturating_sub(base) <= per_phase,
        "{pods} pods of {LABELS} labels grew the leader from {base} KiB to {unpadded} KiB"
    );
    assert!(
        watched.saturating_sub(unpadded) <= per_phase,
        "{pods} padded pods grew the leader from {unpadded} KiB to {watched} KiB"
    );
    assert!(
        listed.saturating_sub(base) <= 2 * per_phase,
        "a new leader holds {listed} KiB, the first held {base} KiB before the pods"
    );
    cp.delete_namespace(&client, &ns).await?;
    cp.delete_namespace(&client, &operator_ns).await?;
    Ok(())
}
