//! Confirmed removal's convergence (issue 30, "Measured"), Remora beside
//! istiod on the same API server, the same proxies and the same writes.
//!
//! Each phase (a contender, N, a rollout): `--rollout-pods` callee pods
//! (`rollout`'s endpoints: real pods, bound to a node that does not exist,
//! their status written Ready at a fresh address; the slice written by the
//! bench with a `targetRef` to each) are served to N subscribed simulated
//! proxies, all of which declare `rollout`. Then the rollout deletes them
//! one at a time, `--rollout-step-ms` apart, each with a grace period (so
//! it stays deleting: no kubelet ever finishes it), and right after each
//! deletion the bench writes the slice as the EndpointSlice controller
//! would (that pod's endpoint not ready, serving, terminating). Per pod,
//! from the same instant for every contender (just before the deletion's
//! API call):
//! - Remora: deletion → the pod's own subscriber (the agent's `Withdrawal`
//!   subscription, [`super::confirmation`]) is told the withdrawal is done:
//!   every proxy that routed to the pod has ACKed an EDS version without
//!   it. The server withdraws the pod from its pod watch.
//! - Both: deletion → the last of the N proxies ACKed an EDS response
//!   after which it no longer routes to the pod (the clients' own board:
//!   for Remora a cross-check of the confirmation; for istiod, which has
//!   no confirmation, the number compared).
//!
//! What istiod's number covers: the deletion, the bench's slice write
//! right after it (one API round trip), istiod's watch, its debounce
//! (Istio's defaults: 100 ms quiet, EDS debounce on) and push, the
//! proxies' ACKs; if istiod acts on the pod's deletion timestamp itself,
//! whichever comes first. What it does not cover: the real EndpointSlice
//! controller's lag between the deletion and its write (its queue and
//! batching; none runs here), which on a cluster comes on top of istiod's
//! figure and not of Remora's. So istiod's figure here is a lower bound of
//! what it takes on a cluster. Remora's does not depend on that write.
//!
//! The operator's memory for the tracking (Remora): its child's live heap
//! (the allocator's count, [`super::remora::RemoraProcess::heap_bytes`])
//! and RSS just before the rollout, once every pod of it is withdrawn and
//! confirmed (the pods still deleting: their withdrawals are kept until
//! they leave the watch), and once they are gone (force-deleted). The
//! difference also holds what else changed meanwhile (smaller EDS
//! snapshots, the pushes' buffers): an upper bound of the tracking's own.
//!
//! Not covered, beyond the push measurement's list ([`super`]): Envoy's
//! apply time (the proxies ACK at once); replacement pods during the
//! rollout (the next phase's pods come before it).

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::cluster::{self, SliceEndpoint};
use super::confirmation::{self, Confirmations};
use super::proxy::{self, Board, Identity};
use super::usage::Usage;
use super::{Contender, ProxyTask, ROLLOUT, Run, ms, plan, wait_subscribed};
use crate::stats::Summary;

/// The callee pods' grace period: longer than any phase's wait, so they
/// stay deleting until the bench force-deletes them.
const GRACE_SECONDS: u32 = 300;
/// How long a phase waits for every proxy (and every confirmation).
const CONVERGE_LIMIT: Duration = Duration::from_secs(120);
/// The child writes its heap every 200 ms: a reading waits this long to be
/// one taken after what it follows.
const HEAP_SETTLE: Duration = Duration::from_millis(600);

/// Remora's memory around one rollout.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Memory {
    pub heap_bytes_before: u64,
    /// Every pod of the rollout withdrawn and confirmed, still deleting.
    pub heap_bytes_withdrawn: u64,
    /// The pods gone from the watch.
    pub heap_bytes_gone: u64,
    pub rss_mib_before: f64,
    pub rss_mib_withdrawn: f64,
    /// (withdrawn − before) / pods.
    pub heap_bytes_per_withdrawn_pod: f64,
}

/// What one phase (a contender, N, a rollout) measured.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub contender: Contender,
    pub proxies: usize,
    pub rollout: usize,
    pub pods: usize,
    /// Per pod: deletion → the last proxy ACKed a version without it (ms).
    pub acked_ms: Vec<f64>,
    pub acked: Summary,
    /// Remora, per pod: deletion → its subscriber told the withdrawal is
    /// done (ms).
    pub confirmed_ms: Vec<f64>,
    pub confirmed: Option<Summary>,
    /// Remora, per pod: the server's own withdrawal → last confirmation (ms).
    pub server_ms: Vec<f64>,
    /// Remora: proxies the server waited for, per pod (the median), and
    /// withdrawals it gave up on at the pod's withdrawal timeout.
    pub expected_p50: f64,
    pub timed_out: usize,
    /// The rollout's writes (deletions and slices) took this long.
    pub write_seconds: f64,
    pub cpu_seconds_rollout: f64,
    pub memory: Option<Memory>,
}

/// Every rollout of N proxies, the contenders in turn (rotated).
pub(super) async fn measure_n(run: &mut Run<'_>, n: usize) -> anyhow::Result<Vec<Phase>> {
    let args = run.args;
    let k = args.contenders.len();
    let mut phases = Vec::new();
    for rollout in 0..args.rollouts {
        for step in 0..k {
            let contender = args.contenders[(step + rollout) % k];
            let p = phase(run, contender, n, rollout, phases.len())
                .await
                .with_context(|| format!("{contender}, N={n}, rollout {rollout}"))?;
            super::report::print_withdrawal_phase(&p);
            phases.push(p);
        }
    }
    Ok(phases)
}

/// The callee pods of phase number `generation` (names unique in the run).
fn pod_name(generation: usize, k: usize) -> String {
    format!("callee-{generation}-{k}")
}

async fn phase(
    run: &mut Run<'_>,
    contender: Contender,
    n: usize,
    rollout: usize,
    generation: usize,
) -> anyhow::Result<Phase> {
    let args = run.args;
    let ns = args.namespace.clone();
    match contender {
        Contender::Istiod => run.sidecars(false, n).await?,
        Contender::IstiodSidecars => run.sidecars(true, n).await?,
        Contender::Remora => {}
    }
    let client = run.client.clone();
    let pods = args.rollout_pods;

    // The callee's pods, then its slice naming them.
    let mut callees: Vec<(String, Ipv4Addr)> = Vec::with_capacity(pods);
    for k in 0..pods {
        let (name, ip) = (pod_name(generation, k), run.endpoints.fresh());
        cluster::create_callee_pod(&client, &ns, &name, super::remora::SERVICE_ACCOUNT, ip).await?;
        callees.push((name, ip));
    }
    let mut slice: Vec<SliceEndpoint> = callees
        .iter()
        .map(|(pod, ip)| SliceEndpoint {
            ip: *ip,
            pod: Some(pod.clone()),
            terminating: false,
        })
        .collect();
    cluster::apply_slice_of(&client, &ns, ROLLOUT, &slice).await?;
    run.endpoints
        .current
        .insert(ROLLOUT.into(), callees.iter().map(|(_, ip)| *ip).collect());

    // N proxies, every one holding every callee.
    let pid = run.pid(contender)?;
    let target = run.target(contender)?;
    let proxies = plan(&ns, n, args.services);
    let identities: Vec<Identity> = proxies.iter().map(|(w, _)| w.clone()).collect();
    let board = Board::new(n);
    let stop = CancellationToken::new();
    let mut tasks = proxy::start_all(&target, args.protocol, &identities, &board, &stop).await;
    let measured = async {
        wait_subscribed(
            &board,
            &proxies,
            &run.endpoints,
            &mut tasks,
            Duration::from_secs(300),
        )
        .await?;
        // Remora: each pod's agent subscribes to its withdrawal.
        let told = Arc::new(Confirmations::default());
        if contender == Contender::Remora {
            for (k, (pod, ip)) in callees.iter().enumerate() {
                let local = Identity {
                    index: n + k,
                    ip: subscriber_ip(k),
                    namespace: ns.clone(),
                    workload: "callee".into(),
                };
                tasks.push(tokio::spawn(confirmation::subscribe(
                    target.clone(),
                    local,
                    pod.clone(),
                    *ip,
                    Arc::clone(&told),
                    stop.clone(),
                )));
            }
            wait_for(&mut tasks, "every callee's subscriber served", || {
                callees
                    .iter()
                    .all(|(p, _)| told.get(p).is_some_and(|t| t.answered))
            })
            .await?;
        }
        let heap_before = heap(run, contender).await?;

        // The rollout: delete each pod, then mark its endpoint terminating.
        let u0 = Usage::of(pid)?;
        let t0 = Instant::now();
        let mut deleted = Vec::with_capacity(pods);
        for (k, (pod, _)) in callees.iter().enumerate() {
            let at = Instant::now();
            cluster::delete_pod(&client, &ns, pod, GRACE_SECONDS).await?;
            deleted.push(at);
            slice[k].terminating = true;
            cluster::apply_slice_of(&client, &ns, ROLLOUT, &slice).await?;
            tokio::time::sleep(Duration::from_millis(args.rollout_step_ms)).await;
        }
        let write_seconds = t0.elapsed().as_secs_f64();
        // The premise: bound to no kubelet, a deleted pod stays deleting.
        let first = &callees[0].0;
        anyhow::ensure!(
            cluster::is_deleting(&client, &ns, first).await?,
            "pod {first} is not deleting after its graceful delete: nothing here measures a withdrawal"
        );
        let all: Vec<usize> = (0..n).collect();
        wait_for(&mut tasks, "every proxy stopped routing to every callee", || {
            callees
                .iter()
                .all(|(_, ip)| board.all_acked_without(&all, *ip).is_some())
        })
        .await?;
        if contender == Contender::Remora {
            wait_for(&mut tasks, "every callee's withdrawal done", || {
                callees
                    .iter()
                    .all(|(p, _)| told.get(p).is_some_and(|t| t.done_at.is_some()))
            })
            .await?;
        }
        let u1 = Usage::of(pid)?;
        let since = |k: usize, t: Instant| ms(t.saturating_duration_since(deleted[k]));
        let acked_ms: Vec<f64> = callees
            .iter()
            .enumerate()
            .filter_map(|(k, (_, ip))| Some(since(k, board.all_acked_without(&all, *ip)?)))
            .collect();
        let told_all: Vec<(usize, confirmation::Told)> = callees
            .iter()
            .enumerate()
            .filter_map(|(k, (p, _))| Some((k, told.get(p)?)))
            .collect();
        let confirmed_ms: Vec<f64> = told_all
            .iter()
            .filter_map(|(k, t)| Some(since(*k, t.done_at?)))
            .collect();
        let server_ms: Vec<f64> = told_all
            .iter()
            .map(|(_, t)| t.last_confirmation_ms as f64)
            .collect();
        let expected: Vec<f64> = told_all.iter().map(|(_, t)| f64::from(t.expected)).collect();

        // Memory: withdrawn (the pods still deleting), then gone.
        let memory = match heap_before {
            Some((heap_bytes_before, rss_mib_before)) => {
                let (withdrawn, rss_withdrawn) =
                    heap(run, contender).await?.context("the heap")?;
                force_delete(&client, &ns, &callees).await?;
                let (gone, _) = heap(run, contender).await?.context("the heap")?;
                Some(Memory {
                    heap_bytes_before,
                    heap_bytes_withdrawn: withdrawn,
                    heap_bytes_gone: gone,
                    rss_mib_before,
                    rss_mib_withdrawn: rss_withdrawn,
                    heap_bytes_per_withdrawn_pod: (withdrawn as f64 - heap_bytes_before as f64)
                        / pods as f64,
                })
            }
            None => None,
        };
        anyhow::Ok(Phase {
            contender,
            proxies: n,
            rollout,
            pods,
            acked: Summary::of(&acked_ms),
            acked_ms,
            confirmed: (!confirmed_ms.is_empty()).then(|| Summary::of(&confirmed_ms)),
            confirmed_ms,
            server_ms,
            expected_p50: if expected.is_empty() {
                f64::NAN
            } else {
                Summary::of(&expected).p50_ms
            },
            timed_out: told_all.iter().filter(|(_, t)| t.timed_out).count(),
            write_seconds,
            cpu_seconds_rollout: u1.cpu_seconds - u0.cpu_seconds,
            memory,
        })
    }
    .await;
    stop.cancel();
    // Whatever happened: the next phase's pods replace these.
    force_delete(&client, &ns, &callees).await?;
    let p = match measured {
        Ok(p) => p,
        Err(e) => {
            // A task whose end was read already must not be awaited again.
            tasks.drain(..).for_each(|t| t.abort());
            return Err(e);
        }
    };
    for t in tasks.drain(..) {
        if let Ok(Err(e)) = t.await {
            anyhow::bail!("{contender}: {e}");
        }
    }
    Ok(p)
}

/// Subscriber `k`'s own loopback address (apart from the proxies').
fn subscriber_ip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 20, (k / 250) as u8, (k % 250 + 1) as u8)
}

async fn force_delete(
    client: &kube::Client,
    ns: &str,
    callees: &[(String, Ipv4Addr)],
) -> anyhow::Result<()> {
    for (pod, _) in callees {
        cluster::delete_pod(client, ns, pod, 0).await?;
    }
    Ok(())
}

/// Remora's live heap (bytes) and RSS (MiB) once the child has written a
/// count after now; none for istiod.
async fn heap(run: &Run<'_>, c: Contender) -> anyhow::Result<Option<(u64, f64)>> {
    let Some(r) = run.remora.as_ref().filter(|_| c == Contender::Remora) else {
        return Ok(None);
    };
    tokio::time::sleep(HEAP_SETTLE).await;
    let bytes = r.heap_bytes().context("the child's heap count")?;
    Ok(Some((bytes, Usage::of(r.pid())?.rss_mib)))
}

/// Until `done` holds, failing if a proxy or subscriber ends or
/// [`CONVERGE_LIMIT`] passes.
async fn wait_for(
    tasks: &mut [ProxyTask],
    what: &str,
    done: impl Fn() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + CONVERGE_LIMIT;
    while !done() {
        super::ended(tasks)?;
        anyhow::ensure!(
            Instant::now() < deadline,
            "not {what} within {CONVERGE_LIMIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscribers_and_proxies_dial_from_different_addresses() {
        assert_ne!(subscriber_ip(0), proxy::proxy_ip(0));
        assert_ne!(subscriber_ip(999), subscriber_ip(998));
    }
}
