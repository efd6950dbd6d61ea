//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's
//! semantics: every replica is a candidate; the holder renews every
//! `retry_period` and steps down when it could not renew for
//! `renew_deadline`; a candidate takes the Lease when it is free, or when it
//! has not changed for the holder's `leaseDurationSeconds` *as measured by
//! the candidate's own clock since it last saw it change* (renewTime is
//! written for people, never compared across nodes: clocks skew). Writes are
//! replaces with the resourceVersion read, so of two racing candidates one
//! gets 409 Conflict and stays a candidate.
//!
//! The leader runs the `lead` closure's future; it is cancelled (and awaited,
//! for a bounded time) when leadership is lost or shutdown begins. On
//! shutdown the holder releases the Lease (empty holder), so a standby takes
//! over within its `retry_period` instead of after `lease_duration`.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The Lease's name when none is given.
pub const DEFAULT_LEASE_NAME: &str = "remora-operator";

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("leader election settings: {0}")]
    Config(String),
    /// Someone else wrote the Lease since we read it (HTTP 409).
    #[error("the Lease was changed by someone else")]
    Conflict,
    #[error("Lease API call: {0}")]
    Api(#[source] kube::Error),
    /// A store other than the API server failed (the test double).
    #[error("Lease store: {0}")]
    Store(String),
    #[error("the Lease call did not finish in time")]
    Timeout,
}

/// How to elect.
#[derive(Debug, Clone)]
pub struct LeaderConfig {
    pub lease_name: String,
    pub namespace: String,
    /// Unique per replica: the pod name, else hostname and a random suffix.
    pub identity: String,
    /// How long a Lease that stopped changing is respected by candidates.
    pub lease_duration: Duration,
    /// How long the holder keeps leading without a successful renewal.
    pub renew_deadline: Duration,
    /// Pause between attempts to acquire or renew.
    pub retry_period: Duration,
    /// How long the leader-only work gets to stop once cancelled, before it
    /// is aborted.
    pub stop_timeout: Duration,
}

impl LeaderConfig {
    /// client-go's defaults (15s / 10s / 2s).
    pub fn new(lease_name: &str, namespace: &str, identity: &str) -> Self {
        Self {
            lease_name: lease_name.to_owned(),
            namespace: namespace.to_owned(),
            identity: identity.to_owned(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            stop_timeout: Duration::from_secs(5),
        }
    }

    /// The holder must give up (renew deadline) before candidates may take
    /// over (lease duration), and must get more than one try in between.
    pub fn validate(&self) -> Result<(), LeaderError> {
        let bad = |m: &str| Err(LeaderError::Config(m.to_owned()));
        if self.identity.is_empty() {
            return bad("the identity is empty");
        }
        if self.lease_name.is_empty() || self.namespace.is_empty() {
            return bad("the Lease name and namespace must not be empty");
        }
        if self.retry_period.is_zero() {
            return bad("the retry period must be positive");
        }
        if self.renew_deadline >= self.lease_duration {
            return bad("the renew deadline must be shorter than the lease duration");
        }
        if self.retry_period >= self.renew_deadline {
            return bad("the retry period must be shorter than the renew deadline");
        }
        if self.lease_duration > Duration::from_secs(i32::MAX as u64) {
            return bad("the lease duration is too long");
        }
        Ok(())
    }

    /// `leaseDurationSeconds` is whole seconds: round up, at least 1.
    fn lease_duration_seconds(&self) -> i32 {
        let s = self.lease_duration.as_secs() + u64::from(self.lease_duration.subsec_nanos() > 0);
        i32::try_from(s.max(1)).unwrap_or(i32::MAX)
    }
}

/// Where the Lease lives: the API server, or an in-memory test double.
pub trait LeaseStore: Send + Sync + 'static {
    /// The Lease, `None` when it does not exist.
    fn get(&self) -> impl Future<Output = Result<Option<Lease>, LeaderError>> + Send;
    /// Create it; [`LeaderError::Conflict`] when it already exists.
    fn create(&self, lease: Lease) -> impl Future<Output = Result<Lease, LeaderError>> + Send;
    /// Replace it if its resourceVersion is still `lease`'s;
    /// [`LeaderError::Conflict`] otherwise.
    fn replace(&self, lease: Lease) -> impl Future<Output = Result<Lease, LeaderError>> + Send;
}

/// The Lease on the API server.
#[derive(Clone)]
pub struct KubeLeaseStore {
    api: Api<Lease>,
    name: String,
}

impl KubeLeaseStore {
    pub fn new(client: Client, namespace: &str, name: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
        }
    }
}

fn kube_err(e: kube::Error) -> LeaderError {
    match &e {
        kube::Error::Api(s) if s.code == 409 => LeaderError::Conflict,
        _ => LeaderError::Api(e),
    }
}

impl LeaseStore for KubeLeaseStore {
    async fn get(&self) -> Result<Option<Lease>, LeaderError> {
        self.api.get_opt(&self.name).await.map_err(LeaderError::Api)
    }

    async fn create(&self, lease: Lease) -> Result<Lease, LeaderError> {
        self.api
            .create(&PostParams::default(), &lease)
            .await
            .map_err(kube_err)
    }

    async fn replace(&self, lease: Lease) -> Result<Lease, LeaderError> {
        // The body carries metadata.resourceVersion: the API server answers
        // 409 when the Lease changed since we read it.
        self.api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
            .map_err(kube_err)
    }
}

/// `remora_operator_leader` and `remora_operator_leader_transitions_total`.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    leader: Gauge,
    transitions: Counter,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let me = Self::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease, else 0",
            me.leader.clone(),
        );
        registry.register(
            "leader_transitions",
            "Times this replica became or stopped being the leader",
            me.transitions.clone(),
        );
        me
    }

    fn set(&self, leading: bool) {
        self.leader.set(i64::from(leading));
        self.transitions.inc();
    }
}

/// What one attempt to acquire or renew found.
#[derive(Debug)]
enum Attempt {
    Leading,
    /// Held by another identity, not yet expired in our eyes.
    HeldBy(String),
    Failed(LeaderError),
}

/// Why the leader stopped leading.
enum StepDown {
    Shutdown,
    Lost,
}

/// One candidate.
pub struct Elector<S> {
    store: S,
    cfg: LeaderConfig,
    /// The Lease's spec as last seen changed, and when (our monotonic clock).
    observed: Option<(LeaseSpec, Instant)>,
    /// The Lease as we last wrote it (its resourceVersion guards the release).
    written: Option<Lease>,
    leading: watch::Sender<bool>,
    metrics: Option<Metrics>,
}

impl<S: LeaseStore> Elector<S> {
    pub fn new(store: S, cfg: LeaderConfig) -> Result<Self, LeaderError> {
        cfg.validate()?;
        Ok(Self {
            store,
            cfg,
            observed: None,
            written: None,
            leading: watch::Sender::new(false),
            metrics: None,
        })
    }

    /// Keep these metrics current.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        metrics.leader.set(0);
        self.metrics = Some(metrics);
        self
    }

    /// `true` while this replica leads.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leading.subscribe()
    }

    fn set_leading(&self, leading: bool) {
        self.leading.send_replace(leading);
        if let Some(m) = &self.metrics {
            m.set(leading);
        }
    }

    /// Campaign until `shutdown`; while leading, run `lead(token)`, whose
    /// token is cancelled when leadership ends. Returns after shutdown, with
    /// the leader-only work stopped and the Lease released.
    ///
    /// A `lead` future that ends on its own does not give up leadership
    /// (as in client-go): leadership ends only by shutdown or a failed renewal.
    pub async fn run<F, Fut>(mut self, shutdown: CancellationToken, mut lead: F)
    where
        F: FnMut(CancellationToken) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let id = self.cfg.identity.clone();
        let lease = format!("{}/{}", self.cfg.namespace, self.cfg.lease_name);
        loop {
            // Candidate. An attempt is never abandoned half-way (a Lease
            // created but never known to be ours would block the others for
            // a lease duration); it is bounded by the renew deadline instead.
            let acquired_at = loop {
                let sent = Instant::now();
                match self.attempt(sent + self.cfg.renew_deadline).await {
                    Attempt::Leading => break sent,
                    Attempt::HeldBy(holder) => {
                        tracing::debug!(identity = %id, %lease, %holder, "Lease held by another replica")
                    }
                    Attempt::Failed(LeaderError::Conflict) => {
                        tracing::debug!(identity = %id, %lease, "lost a race for the Lease")
                    }
                    Attempt::Failed(e) => {
                        tracing::warn!(identity = %id, %lease, error = %e, "cannot acquire the Lease")
                    }
                }
                // At the next retry, or the moment the Lease we saw may be
                // taken if that is sooner: a standby takes over a dead
                // leader's Lease then, not up to a retry period later.
                let retry = Instant::now() + self.cfg.retry_period;
                let wake = self
                    .observed_expiry()
                    .filter(|e| *e > Instant::now())
                    .map_or(retry, |e| e.min(retry));
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep_until(wake) => {}
                }
            };

            tracing::info!(identity = %id, %lease, "acquired the leader Lease");
            if shutdown.is_cancelled() {
                // Acquired while shutting down: give it back untouched.
                self.release().await;
                return;
            }
            self.set_leading(true);
            let token = shutdown.child_token();
            let mut task = tokio::spawn(lead(token.clone()));
            let mut task_done = false;
            let mut renewed = acquired_at;
            let why = loop {
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => break StepDown::Shutdown,
                    r = &mut task, if !task_done => {
                        task_done = true;
                        match r {
                            Ok(()) => tracing::warn!(identity = %id, "the leader-only work ended; still leading"),
                            Err(e) => tracing::error!(identity = %id, error = %e, "the leader-only work failed; still leading"),
                        }
                        continue;
                    }
                    () = tokio::time::sleep(self.cfg.retry_period) => {}
                }
                let deadline = renewed + self.cfg.renew_deadline;
                // The write lands after we send it, so the others' clocks
                // start no earlier than this: count the lease from here.
                let sent = Instant::now();
                match self.attempt(deadline).await {
                    Attempt::Leading => renewed = sent,
                    Attempt::HeldBy(holder) => {
                        tracing::warn!(identity = %id, %lease, %holder, "the Lease was taken over");
                        break StepDown::Lost;
                    }
                    Attempt::Failed(e) => {
                        tracing::warn!(identity = %id, %lease, error = %e, "cannot renew the Lease")
                    }
                }
                if Instant::now() >= deadline {
                    tracing::warn!(identity = %id, %lease, deadline = ?self.cfg.renew_deadline,
                        "not renewed within the renew deadline");
                    break StepDown::Lost;
                }
            };

            // The leader-only work stops before the Lease is let go, so two
            // replicas' leader work never overlaps on a graceful handover.
            // When renewing failed, a candidate may take over a lease
            // duration after it saw our last renewal: the work must be gone
            // by then.
            let stop_timeout = match why {
                StepDown::Shutdown => self.cfg.stop_timeout,
                StepDown::Lost => self.cfg.stop_timeout.min(
                    (renewed + self.cfg.lease_duration).saturating_duration_since(Instant::now()),
                ),
            };
            token.cancel();
            if !task_done && tokio::time::timeout(stop_timeout, &mut task).await.is_err() {
                tracing::warn!(identity = %id, timeout = ?stop_timeout,
                    "the leader-only work did not stop in time; aborted");
                task.abort();
            }
            self.set_leading(false);
            match why {
                StepDown::Shutdown => {
                    self.release().await;
                    return;
                }
                StepDown::Lost => {
                    tracing::info!(identity = %id, %lease, "lost the leader Lease");
                    self.written = None;
                }
            }
        }
    }

    /// Acquire or renew once, giving up at `deadline`.
    async fn attempt(&mut self, deadline: Instant) -> Attempt {
        match tokio::time::timeout_at(deadline, self.try_acquire_or_renew()).await {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => Attempt::Failed(e),
            Err(_) => Attempt::Failed(LeaderError::Timeout),
        }
    }

    async fn try_acquire_or_renew(&mut self) -> Result<Attempt, LeaderError> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let mine = LeaseSpec {
            holder_identity: Some(self.cfg.identity.clone()),
            lease_duration_seconds: Some(self.cfg.lease_duration_seconds()),
            acquire_time: Some(now.clone()),
            renew_time: Some(now),
            lease_transitions: Some(0),
            ..LeaseSpec::default()
        };
        let Some(current) = self.store.get().await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.cfg.lease_name.clone()),
                    namespace: Some(self.cfg.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(mine),
            };
            let created = self.store.create(lease).await?;
            self.wrote(created);
            return Ok(Attempt::Leading);
        };
        let spec = current.spec.clone().unwrap_or_default();
        let now_mono = Instant::now();
        if self.observed.as_ref().is_none_or(|(s, _)| *s != spec) {
            self.observed = Some((spec.clone(), now_mono));
        }
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let ours = holder == self.cfg.identity;
        if !holder.is_empty() && !ours && !self.observed_expired(now_mono) {
            return Ok(Attempt::HeldBy(holder));
        }
        let next = if ours {
            LeaseSpec {
                acquire_time: spec.acquire_time.clone().or(mine.acquire_time),
                lease_transitions: spec.lease_transitions.or(Some(0)),
                ..mine
            }
        } else {
            LeaseSpec {
                lease_transitions: Some(spec.lease_transitions.unwrap_or(0).saturating_add(1)),
                ..mine
            }
        };
        let mut lease = current;
        lease.spec = Some(next);
        let replaced = self.store.replace(lease).await?;
        self.wrote(replaced);
        Ok(Attempt::Leading)
    }

    fn wrote(&mut self, lease: Lease) {
        self.observed = Some((lease.spec.clone().unwrap_or_default(), Instant::now()));
        self.written = Some(lease);
    }

    /// Whether the Lease we observed has stopped changing for its holder's
    /// lease duration (ours when it says none).
    fn observed_expired(&self, now: Instant) -> bool {
        self.observed.is_none() || self.observed_expiry().is_some_and(|e| now >= e)
    }

    /// When the Lease we observed may be taken if it does not change again;
    /// `None` when nothing was observed, or never (a duration too long to
    /// add).
    fn observed_expiry(&self) -> Option<Instant> {
        let (spec, seen) = self.observed.as_ref()?;
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(self.cfg.lease_duration, Duration::from_secs);
        seen.checked_add(duration)
    }

    /// Let the Lease go: no holder, so candidates take it at their next try.
    /// The replace carries the resourceVersion we wrote last: if someone
    /// else wrote since, it fails and nothing is clobbered.
    async fn release(&mut self) {
        let Some(mut lease) = self.written.take() else {
            return;
        };
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(now.clone());
            spec.acquire_time = Some(now);
        }
        let id = &self.cfg.identity;
        let lease_name = format!("{}/{}", self.cfg.namespace, self.cfg.lease_name);
        match tokio::time::timeout(self.cfg.renew_deadline, self.store.replace(lease)).await {
            Ok(Ok(_)) => {
                tracing::info!(identity = %id, lease = %lease_name, "released the leader Lease")
            }
            Ok(Err(LeaderError::Conflict)) => {
                tracing::info!(identity = %id, lease = %lease_name, "the Lease had already changed; nothing to release")
            }
            Ok(Err(e)) => {
                tracing::warn!(identity = %id, lease = %lease_name, error = %e, "cannot release the Lease; it expires by itself")
            }
            Err(_) => {
                tracing::warn!(identity = %id, lease = %lease_name, "releasing the Lease timed out; it expires by itself")
            }
        }
    }
}

/// Elect on the API server's Lease and run `lead` while leading; see
/// [`Elector::run`]. `leading` follows this replica's state.
pub async fn run_elected<F, Fut>(
    client: Client,
    cfg: LeaderConfig,
    metrics: Option<Metrics>,
    shutdown: CancellationToken,
    lead: F,
) -> Result<(), LeaderError>
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let store = KubeLeaseStore::new(client, &cfg.namespace, &cfg.lease_name);
    let mut elector = Elector::new(store, cfg)?;
    if let Some(m) = metrics {
        elector = elector.with_metrics(m);
    }
    elector.run(shutdown, lead).await;
    Ok(())
}

/// An identity unique to this process: the hostname and a random suffix
/// (for when no pod name is given).
pub fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "remora-operator".to_owned());
    format!("{host}_{:016x}", rand::random::<u64>())
}

#[cfg(test)]
mod tests;
