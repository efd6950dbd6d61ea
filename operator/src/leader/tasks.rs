//! What only the leader runs: the SidecarLifecycle and Jobs controllers and
//! the trust-bundle distributor, over one pod watch, each restarted when it
//! dies, all on a thread and runtime of their own ([`lead_apart`]) so that
//! their CPU never holds the threads answering the webhook and the probes.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use remora_crds::SidecarLifecycle;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::cluster::live_pod::LivePod;
use crate::cluster::view::KubeView;
use crate::cluster::watch::SharedWatch;

/// What the leader-only work needs.
pub struct LeaderContext {
    /// The API server, for the leader's own client (see [`lead_apart`]).
    pub kube: kube::Config,
    /// `None`: the controller is off.
    pub controller: Option<crate::controllers::lifecycle::Settings>,
    pub controller_metrics: crate::controllers::lifecycle::Metrics,
    pub stop_completed_jobs: bool,
    pub jobs_metrics: crate::controllers::jobs::Metrics,
    pub pod_watch_metrics: crate::cluster::live_pod::Metrics,
    /// The process's pod watch when another part of the replica needs one
    /// on every replica (discovery); `None`: the leader watches pods only
    /// while it leads.
    pub pods: Option<SharedWatch<LivePod>>,
    /// Who publishes the Events.
    pub identity: String,
    /// The replica's SidecarLifecycle watch (the webhook's).
    pub lifecycles: SharedWatch<SidecarLifecycle>,
    /// With the workload CA: what the trust-bundle distributor needs.
    pub trust_bundle: Option<TrustBundle>,
    /// How often the trust bundle's namespaces are checked.
    pub trust_bundle_period: Duration,
    /// With discovery and the external-service CRDs: the registry and the
    /// ExternalService watch, whose statuses the leader writes.
    pub external_status: Option<ExternalStatus>,
}

/// What the leader needs to write ExternalServices' status.
#[derive(Clone)]
pub struct ExternalStatus {
    pub discovery: Arc<crate::discovery::push::Discovery>,
    pub services: SharedWatch<remora_crds::external::ExternalService>,
}

/// What the leader needs to distribute the workload CA's trust bundle.
#[derive(Clone)]
pub struct TrustBundle {
    /// The replica's roots.
    pub authority: crate::pki::workload_ca::AuthorityRx,
    /// The replica's namespace view: which namespaces get the bundle.
    pub view: KubeView,
    /// The Secret holding the roots.
    pub signing: crate::controllers::trust_bundle::SigningSecret,
}

/// Everything only the leader runs: the one place to add leader-only tasks.
/// Each gets `token`, cancelled when leadership ends or shutdown begins, and
/// must return soon after (the elector aborts it after --shutdown-grace).
async fn lead(ctx: Arc<LeaderContext>, token: CancellationToken) {
    if ctx.controller.is_none()
        && !ctx.stop_completed_jobs
        && ctx.trust_bundle.is_none()
        && ctx.external_status.is_none()
    {
        // Nothing to do is no reason to give up leadership, nor to watch.
        return token.cancelled().await;
    }
    let client = match Client::try_from(ctx.kube.clone()) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the leader's API client; leading idle");
            return token.cancelled().await;
        }
    };
    // One pod watch for all the leader's work: the process's, or its own
    // while it leads; a task started again subscribes again.
    let pods = match &ctx.pods {
        Some(pods) => pods.clone(),
        None => crate::cluster::live_pod::live_pods(
            client.clone(),
            ctx.pod_watch_metrics.clone(),
            token.clone(),
        ),
    };
    let mut tasks = JoinSet::new();
    if let Some(settings) = ctx.controller.clone() {
        let (ctx, pods, client) = (Arc::clone(&ctx), pods.clone(), client.clone());
        tasks.spawn(supervise("controller", token.clone(), move |token| {
            crate::controllers::lifecycle::run(
                client.clone(),
                settings.clone(),
                ctx.controller_metrics.clone(),
                ctx.lifecycles.clone(),
                pods.clone(),
                token,
            )
        }));
    }
    if ctx.stop_completed_jobs {
        let (ctx, pods, client) = (Arc::clone(&ctx), pods.clone(), client.clone());
        tasks.spawn(supervise("jobs", token.clone(), move |token| {
            let (client, identity, metrics, pods) = (
                client.clone(),
                ctx.identity.clone(),
                ctx.jobs_metrics.clone(),
                pods.clone(),
            );
            async move {
                if let Err(e) =
                    crate::controllers::jobs::run(client, identity, metrics, pods, token).await
                {
                    tracing::error!(error = %e, "the Jobs controller failed");
                }
            }
        }));
    }
    if let Some(TrustBundle {
        authority,
        view,
        signing,
    }) = ctx.trust_bundle.clone()
    {
        let (pods, client, period) = (pods.clone(), client.clone(), ctx.trust_bundle_period);
        tasks.spawn(supervise("trust-bundle", token.clone(), move |token| {
            let (authority, view, pods) = (authority.clone(), view.clone(), pods.clone());
            let targets = move || injected_namespaces(&view, &pods);
            let signing = signing.clone();
            crate::controllers::trust_bundle::run(
                client.clone(),
                authority,
                targets,
                period,
                signing,
                token,
            )
        }));
    }
    if let Some(ExternalStatus {
        discovery,
        services,
    }) = ctx.external_status.clone()
    {
        let client = client.clone();
        tasks.spawn(supervise("external-status", token.clone(), move |token| {
            crate::controllers::external_status::run(
                client.clone(),
                Arc::clone(&discovery),
                services.clone(),
                token,
            )
        }));
    }
    while tasks.join_next().await.is_some() {}
    // Nothing (left) to do is no reason to give up leadership.
    token.cancelled().await;
}

/// Namespaces with the injection label, and those holding a pod the
/// webhook injected (a pod may opt in by its own label).
fn injected_namespaces(view: &KubeView, pods: &SharedWatch<LivePod>) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = view
        .namespaces_labelled(remora_contract::annotations::INJECT_LABEL, "enabled")
        .into_iter()
        .collect();
    for p in pods.store().state() {
        if p.injected().is_some()
            && let Some(ns) = &p.metadata.namespace
            && !out.contains(ns)
        {
            out.insert(ns.clone());
        }
    }
    out
}

/// The leader thread's nice value (0 is the webhook's): under contention
/// it gets about a tenth of the CPU the webhook's threads get.
const LEADER_NICE: i32 = 10;
/// The name of the leader's thread (and of its blocking pool's).
const LEADER_THREAD: &str = "remora-leader";

/// Run [`lead`] on a runtime of its own, on one thread ([`apart`]): the CPU
/// of the leader's work (a cluster default's reconcile reads every pod;
/// every pod event is parsed) then never holds the workers that answer the
/// webhook and the probes. Its API client is its own too (built in
/// [`lead`]), so that its connections and their TLS run on that thread.
/// Dropping this future (the elector aborts the leader's work when it steps
/// down) stops all of that work.
pub async fn lead_apart(ctx: Arc<LeaderContext>, token: CancellationToken) {
    match apart(lead(Arc::clone(&ctx), token.clone())) {
        Ok(work) => work.await,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the leader's thread; leading on the shared runtime");
            return lead(ctx, token).await;
        }
    }
    // The work ended early (its runtime failed to start): lead idle.
    token.cancelled().await;
}

/// Run `work` on a thread of its own ([`LEADER_THREAD`], at [`LEADER_NICE`])
/// with a runtime of its own. The returned future ends when `work` does;
/// dropping it drops that runtime, and with it every task `work` started.
fn apart(
    work: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<impl std::future::Future<Output = ()>> {
    let (done_tx, done) = tokio::sync::oneshot::channel::<()>();
    // Its sender is dropped with the returned future: stop at once.
    let (abort, aborted) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name(LEADER_THREAD.into())
        .spawn(move || {
            // Below the webhook's threads when the cores are contended: a
            // pod's creation waits on its review, a retune can wait a
            // moment. Threads this one starts (the runtime's blocking
            // pool) inherit it.
            let me = Some(rustix::thread::gettid());
            let nice = rustix::process::getpriority_process(me).unwrap_or_default();
            if nice < LEADER_NICE
                && let Err(e) = rustix::process::setpriority_process(me, LEADER_NICE)
            {
                tracing::warn!(error = %e, "cannot lower the leader thread's priority");
            }
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .thread_name(LEADER_THREAD)
                .build()
            {
                Ok(rt) => rt.block_on(async {
                    tokio::select! {
                        () = work => {}
                        _ = aborted => {}
                    }
                }),
                Err(e) => tracing::error!(error = %e, "cannot start the leader's runtime"),
            }
            let _ = done_tx.send(());
        })?;
    Ok(async move {
        let _abort = abort;
        let _ = done.await;
    })
}

/// Run `task` until `token` is cancelled, starting it again (after a
/// doubling delay, 1 s up to 60 s) when it ends or panics before that: a
/// leader whose work died would otherwise hold the Lease doing nothing.
async fn supervise<F, Fut>(name: &'static str, token: CancellationToken, task: F)
where
    F: Fn(CancellationToken) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut delay = Duration::from_secs(1);
    loop {
        let ended = tokio::spawn(task(token.clone())).await;
        if token.is_cancelled() {
            return;
        }
        match ended {
            Err(e) => tracing::error!(task = name, error = %e, retry_in = ?delay,
                "a leader-only task panicked; starting it again"),
            Ok(()) => tracing::warn!(task = name, retry_in = ?delay,
                "a leader-only task ended early; starting it again"),
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = token.cancelled() => return,
        }
        delay = (delay * 2).min(Duration::from_secs(60));
    }
}

#[cfg(test)]
mod tests;
