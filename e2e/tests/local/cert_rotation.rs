//! Certificate rotation under mTLS load: the workload certificate of two
//! sidecars (the real agent and Envoy, the test app behind each, no node)
//! is replaced four times, alternately with a new key pair (cert-manager's
//! `rotationPolicy: Always`) and a renewal that keeps the key (`Never`),
//! each time written into the sidecar's `--cert-dir` the way the kubelet
//! updates a Secret volume (`..data` swapped, `atomic_write`). Meanwhile a
//! balanced mTLS load (keep-alive, no retries) runs over both sidecars.
//!
//! After each swap, fresh handshakes to each sidecar go on until one is
//! served the new certificate. Asserted: no request lost (the load's nor a
//! handshake's), every swap served, no certificate older than one already
//! served on a fresh handshake afterwards, and Envoy never restarted (the
//! agent hands the new certificate over SDS to the same epoch 0).
//!
//! The swap → served time is printed, not asserted; agent-microbench's
//! cert row measures it. The agent binary must be built (`cargo build -p
//! remora-agent`, or set `REMORA_AGENT_BIN`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::certs::{Pki, Serving};
use e2e::discovery_rig::{Reviewer, Rig, Sidecar, Upstreams};
use e2e::traffic::{
    LoadSummary, Sample, TlsClient, TlsConnector, fresh_tls_client, run_balanced_tls,
};
use remora_test_support::kubelet::atomic_write;
use remora_test_support::pki::{KeyPair, new_key};
use remora_test_support::ports::free_port;
use remora_test_support::wait::{Check, Wait, wait_until};
use tokio::time::Instant;

use crate::test_app::App;

/// What the client verifies the served certificate against (the endpoints
/// are addresses; the certificate names the Service).
const SERVER_NAME: &str = "web.shop.svc";
const SERVER_ID: &str = "spiffe://cluster.local/ns/shop/sa/web";
/// The load's identity, the only one the sidecars admit.
const CLIENT_ID: &str = "spiffe://cluster.local/ns/shop/sa/load";
const ROTATIONS: u64 = 4;
/// Requests a second of the steady load, over both sidecars.
const RATE: u32 = 200;
/// Requests the steady load sends across each swap before the next one:
/// a fifth of a second of load.
const LOAD_PER_SWAP: usize = RATE as usize / 5;
/// A swap not served to a fresh handshake within this fails the test.
const SERVED_DEADLINE: Duration = Duration::from_secs(10);
/// Fresh handshakes after the first one served the new certificate, which
/// must be served it too.
const CONFIRM: usize = 3;

/// One sidecar with its app, and the cert dir it reads.
struct Pod {
    name: String,
    sidecar: Sidecar,
    /// The sidecar's inbound mTLS listener.
    addr: SocketAddr,
    certs: tempfile::TempDir,
    _app: App,
}

impl Pod {
    async fn start(rig: &Rig, name: &str, first: &Serving) -> anyhow::Result<Self> {
        let app = App::start(name, &[]).await?;
        let certs = tempfile::tempdir()?;
        swap(certs.path(), first)?;
        let inbound = free_port();
        let mut sidecar = Sidecar::start(
            rig,
            &Upstreams::default(),
            name,
            "web",
            1,
            &[
                format!("--inbound={inbound}:{}", app.addr.port()),
                "--inbound-tls".into(),
                format!("--cert-dir={}", certs.path().display()),
                format!("--inbound-tls-san={CLIENT_ID}"),
            ],
        )?;
        sidecar.ready(name).await?;
        Ok(Self {
            name: name.to_owned(),
            sidecar,
            addr: SocketAddr::from(([127, 0, 0, 1], inbound)),
            certs,
            _app: app,
        })
    }

    /// Envoy's epoch, pid and restart counts, as the agent shows them.
    async fn envoy(&self) -> anyhow::Result<serde_json::Value> {
        let mut e = self
            .sidecar
            .envoy_state()
            .await
            .with_context(|| format!("{}: no /debug/config", self.name))?;
        e.as_object_mut()
            .context("Envoy's state is not an object")?
            .retain(|k, _| {
                ["epoch", "pid", "crash_restarts", "hot_restarts"].contains(&k.as_str())
            });
        Ok(e)
    }
}

/// Writes `cert` into `dir` as the kubelet updates a Secret volume.
fn swap(dir: &Path, cert: &Serving) -> anyhow::Result<()> {
    let changed = atomic_write(dir, &cert.files)?;
    ensure!(changed, "{}: the volume did not change", dir.display());
    Ok(())
}

/// Fresh handshakes to `pod` (each recorded in `probes`) until one is
/// served `want`, then [`CONFIRM`] more; the time from `swapped` to the
/// first that was served it.
async fn served(
    client: &TlsClient,
    pod: &Pod,
    want: u64,
    swapped: Instant,
    epoch: Instant,
    probes: &Mutex<Vec<Sample>>,
) -> anyhow::Result<Duration> {
    let probe = move || async move {
        let s = e2e::traffic::get(client, "https", &pod.name, pod.addr, epoch).await;
        let check = if s.outcome.is_ok() && s.peer == Some(want) {
            Check::Done(epoch + s.at)
        } else {
            Check::NotYet(format!("{} (certificate {:?})", s.outcome, s.peer))
        };
        probes.lock().unwrap_or_else(|p| p.into_inner()).push(s);
        check
    };
    let what = format!("{} to serve certificate {want:x}", pod.name);
    let first = Wait::new(SERVED_DEADLINE, &what)
        .every(Duration::from_millis(5))
        .until(probe)
        .await?;
    for _ in 0..CONFIRM {
        probe().await;
    }
    Ok(first.saturating_duration_since(swapped))
}

/// Fresh handshakes, per pod in the order sent, that were served a
/// certificate older than one that pod had already served.
fn stale_after_served(probes: &[Sample], generation: &HashMap<u64, u64>) -> Vec<String> {
    let mut newest: HashMap<&str, u64> = HashMap::new();
    let mut stale = Vec::new();
    for s in probes.iter().filter(|s| s.outcome.is_ok()) {
        let pod = s.pod.as_deref().unwrap_or_default();
        let Some(g) = s.peer.and_then(|p| generation.get(&p).copied()) else {
            stale.push(format!("{pod} at {:?}: an unknown certificate", s.at));
            continue;
        };
        let n = newest.entry(pod).or_insert(g);
        if g < *n {
            stale.push(format!("{pod} at {:?}: generation {g} after {n}", s.at));
        }
        *n = (*n).max(g);
    }
    stale
}

fn lost(samples: &[Sample]) -> String {
    let s = LoadSummary::of(samples);
    format!("{} of {} lost: {:?}", s.failed, s.sent, s.failures)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotations_under_mtls_load_are_served_without_a_lost_request_or_an_envoy_restart()
-> anyhow::Result<()> {
    let pki = Pki::new("remora rotation root", CLIENT_ID);
    let mut key: KeyPair = new_key();
    let first = pki.serving(0, &key, &[SERVER_NAME], SERVER_ID);
    let mut generation = HashMap::from([(first.fingerprint, 0)]);
    let rig = Rig::new(Reviewer::new(&[]), None)?;
    let pods = [
        Pod::start(&rig, "web-0", &first).await?,
        Pod::start(&rig, "web-1", &first).await?,
    ];
    let connector = TlsConnector::new(pki.client_config()?, SERVER_NAME)?;
    let fresh = fresh_tls_client(connector.clone());
    let epoch = Instant::now();
    let probes = Mutex::new(Vec::new());

    // Both serve the first certificate before the load starts.
    for pod in &pods {
        served(&fresh, pod, first.fingerprint, epoch, epoch, &probes).await?;
    }
    let mut before = Vec::new();
    for pod in &pods {
        before.push(pod.envoy().await?);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let endpoints: Vec<(String, SocketAddr)> =
        pods.iter().map(|p| (p.name.clone(), p.addr)).collect();
    let load = tokio::spawn(run_balanced_tls(
        {
            let sent = sent.clone();
            move || {
                sent.fetch_add(1, Ordering::SeqCst);
                endpoints.clone()
            }
        },
        RATE,
        Duration::from_secs(1),
        connector,
        epoch,
        stop.clone(),
    ));
    // The load is under way across every swap, and after the last.
    let load_past = |from: usize| {
        let sent = sent.clone();
        wait_until(
            SERVED_DEADLINE,
            "the load to send across the swap",
            move || {
                let n = sent.load(Ordering::SeqCst);
                std::future::ready(n >= from + LOAD_PER_SWAP)
            },
        )
    };
    load_past(0).await?;

    let mut times = Vec::new();
    for i in 1..=ROTATIONS {
        let kind = if i % 2 == 1 {
            key = new_key();
            "rekey"
        } else {
            "renew"
        };
        let next = pki.serving(i, &key, &[SERVER_NAME], SERVER_ID);
        generation.insert(next.fingerprint, i);
        let at_swap = sent.load(Ordering::SeqCst);
        let mut swapped = Vec::new();
        for pod in &pods {
            swap(pod.certs.path(), &next)?;
            swapped.push(Instant::now());
        }
        let waits = pods
            .iter()
            .zip(&swapped)
            .map(|(pod, at)| served(&fresh, pod, next.fingerprint, *at, epoch, &probes));
        for (pod, took) in pods.iter().zip(futures::future::try_join_all(waits).await?) {
            eprintln!(
                "rotation {i} ({kind}): {} served it {took:?} after the swap",
                pod.name
            );
            times.push(took);
        }
        load_past(at_swap).await?;
    }
    stop.store(true, Ordering::SeqCst);
    let steady = load.await?;

    let probes = probes.into_inner().unwrap_or_else(|p| p.into_inner());
    ensure!(
        !steady.is_empty() && steady.iter().all(|s| s.outcome.is_ok()),
        "the load: {}",
        lost(&steady)
    );
    ensure!(
        probes.iter().all(|s| s.outcome.is_ok()),
        "fresh handshakes: {}",
        lost(&probes)
    );
    ensure!(
        times.len() == pods.len() * ROTATIONS as usize,
        "served {} swaps of {}",
        times.len(),
        pods.len() * ROTATIONS as usize
    );
    let stale = stale_after_served(&probes, &generation);
    ensure!(stale.is_empty(), "stale certificates served: {stale:?}");
    for (pod, b) in pods.iter().zip(&before) {
        let after = pod.envoy().await?;
        ensure!(
            after == *b && after["epoch"] == 0,
            "{}: Envoy restarted: {b} -> {after}\n{}",
            pod.name,
            pod.sidecar.log()
        );
    }
    let max = times.iter().max().copied().unwrap_or_default();
    eprintln!(
        "{} requests and {} fresh handshakes, none lost; swap -> served at most {max:?}",
        steady.len(),
        probes.len()
    );
    Ok(())
}
