//! Envoy's aggregated discovery service, state of the world and delta, for
//! one proxy per stream.
//!
//! A stream is served only once its caller is known and entitled: its
//! bearer token (the pod's projected token for
//! [`remora_contract::discovery::TOKEN_AUDIENCE`]) passes the workload
//! CA's [`Gate`], its first request carries a node id
//! ([`NodeId`]) naming an injected pod in the caller's namespace, running
//! under the caller's ServiceAccount (and the token's own pod, when the
//! token is bound to one). Otherwise the stream ends at once with
//! UNAUTHENTICATED, INVALID_ARGUMENT or PERMISSION_DENIED saying why
//! ([`entitled_now`], pure, is that rule).
//!
//! Then each request goes through the stream's session (pure: versions,
//! nonces, ACK/NACK, scope, refused types): a [`Session`] for state of the
//! world ([`super::session`]), a [`DeltaSession`] for delta
//! ([`super::delta`]); this module does what either decides, the same way: sends, counts, logs a NACK with Envoy's
//! message and raises it as a Warning Event on the proxy's pod, or ends
//! the stream with the session's status.
//!
//! Each EDS response sent, and each ACK or NACK of one, is told to the
//! withdrawal tracker ([`super::withdrawal`]), which raises an Event on a
//! withdrawn pod once every proxy that held it has confirmed.
//!
//! Pushes follow the debounced batches ([`super::push`]): a batch that
//! concerns the proxy recomputes its resources, and only the types whose
//! version changed are sent (EDS alone when only endpoints changed; over
//! delta, only the resources that changed). Pushes wait for a place in the
//! [`super::push::Throttle`], across all streams, and, per stream, for the
//! proxy's answer to the last response ([`super::push::Coalesce`]): what
//! concerns it meanwhile goes out as one push once it answers (or at the
//! debounce's max delay at the latest), so a burst of withdrawals costs a
//! proxy a push per round trip, not one each.

use crate::pod_events::{PodEvents, Warning};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryService;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use futures::future::{BoxFuture, OptionFuture};
use futures::{FutureExt, Stream, StreamExt};
use remora_contract::discovery::NodeId;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use super::Metrics;
use super::delta::DeltaSession;
use super::push::{Batch, Coalesce, Discovery};
use super::registry::PodKey;
use super::resources::{self, Snapshot};
use super::session::{AdsRequest, Push, Reply, Session, StreamSession};
use super::withdrawal::{self, Changed, StreamId};
use crate::grpc_server::Peer;
use crate::pki::workload_ca::authn::{AuthError, Authenticate, Caller, Gate, bearer};

/// How long an authenticated stream may take to send its first request
/// (Envoy sends it as it opens the stream).
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Responses queued for one stream before the stream waits for its proxy.
/// Each is boxed in the queue: tokio's channel allocates its slots 32 at a
/// time whatever its bound, and 32 unboxed responses are ~5 KiB per stream
/// that sits idle on every one of a replica's thousands of proxies.
const QUEUE: usize = 4;
/// How long a stream waits for its proxy to take a response: one that
/// reads nothing for this long is cut, rather than holding its task.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a stream was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error("the first request carries no node")]
    NoNode,
    #[error("no request within {0:?}")]
    Silent(Duration),
    /// The first request could not be read (too large, say): its status is
    /// said back as it is.
    #[error("the first request could not be read: {}", .0.message())]
    Unreadable(Status),
    #[error("{0}")]
    BadNode(String),
    #[error("no injected pod {0}/{1} is known (yet)")]
    UnknownPod(String, String),
    #[error("the node names a pod in namespace {node:?}, the caller is of namespace {caller:?}")]
    OtherNamespace { node: String, caller: String },
    #[error(
        "pod {pod} runs under ServiceAccount {pod_sa:?}, the caller is ServiceAccount {caller:?}"
    )]
    OtherServiceAccount {
        pod: String,
        pod_sa: String,
        caller: String,
    },
    #[error("the caller's token is bound to pod {token:?}, the node names pod {node:?}")]
    OtherPod { token: String, node: String },
    #[error("the node's IP {node} is not pod {pod}'s ({actual})")]
    OtherIp {
        node: String,
        pod: String,
        actual: String,
    },
}

impl Refusal {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Auth(e) => e.reason(),
            Self::NoNode | Self::BadNode(_) | Self::Silent(_) | Self::Unreadable(_) => "bad_node",
            Self::UnknownPod(..) => "unknown_pod",
            Self::OtherNamespace { .. }
            | Self::OtherServiceAccount { .. }
            | Self::OtherPod { .. }
            | Self::OtherIp { .. } => "not_its_pod",
        }
    }

    pub fn status(&self) -> Status {
        let msg = self.to_string();
        match self {
            Self::Auth(AuthError::Review(_) | AuthError::Throttled(_)) => Status::unavailable(msg),
            Self::Auth(_) => Status::unauthenticated(msg),
            Self::NoNode | Self::BadNode(_) => Status::invalid_argument(msg),
            Self::Silent(_) => Status::deadline_exceeded(msg),
            Self::Unreadable(status) => status.clone(),
            Self::UnknownPod(..)
            | Self::OtherNamespace { .. }
            | Self::OtherServiceAccount { .. }
            | Self::OtherPod { .. }
            | Self::OtherIp { .. } => Status::permission_denied(msg),
        }
    }
}

/// The ADS service.
pub struct AdsService<A> {
    pub auth: A,
    /// What a token must pass before `auth` is asked about it (its own,
    /// for the discovery audience).
    pub gate: Gate,
    pub discovery: Arc<Discovery>,
    pub metrics: Metrics,
    /// A Warning Event on a proxy's pod for each configuration it refuses.
    pub events: Option<PodEvents>,
    /// Ends every stream (UNAVAILABLE: the proxy reconnects elsewhere).
    pub shutdown: CancellationToken,
    /// How long a stream naming a pod the pod watch has not seen yet waits
    /// for it: a sidecar can dial before the watch brings its new pod.
    /// Keep it well under the request timeout (with the first request's).
    pub pod_wait: Duration,
}

/// [`AdsService::pod_wait`] in the operator.
pub const POD_WAIT: Duration = Duration::from_secs(3);

impl<A: Authenticate> AdsService<A> {
    /// Who may be served on a stream whose first request is `first`.
    pub async fn admit(
        &self,
        authorization: Option<&str>,
        source: Option<std::net::IpAddr>,
        first: &impl AdsRequest,
    ) -> Result<PodKey, Refusal> {
        let caller = self.caller(authorization, source).await?;
        self.entitle(&caller, first).await
    }

    /// Who holds the stream's token: asked before its first request is
    /// awaited, so a stream without a valid token holds no place meanwhile.
    pub async fn caller(
        &self,
        authorization: Option<&str>,
        source: Option<std::net::IpAddr>,
    ) -> Result<Caller, Refusal> {
        let token = bearer(authorization)?;
        Ok(self.gate.authenticate(&self.auth, token, source).await?)
    }

    /// Which pod `caller` is served as, from the node of its first request.
    pub async fn entitle(
        &self,
        caller: &Caller,
        first: &impl AdsRequest,
    ) -> Result<PodKey, Refusal> {
        let id = node_id(first)?;
        let caller = caller.clone();
        let deadline = tokio::time::Instant::now() + self.pod_wait;
        // Subscribed before the first look: a batch after it is seen.
        let mut batches = self.discovery.batches();
        loop {
            match entitled(&self.discovery, &caller, &id) {
                Err(Refusal::UnknownPod(..))
                    if tokio::time::timeout_at(deadline, batches.changed())
                        .await
                        .is_ok_and(|c| c.is_ok()) => {}
                r => return r,
            }
        }
    }
}

/// The node id of a stream's first request.
fn node_id(first: &impl AdsRequest) -> Result<NodeId, Refusal> {
    let node = first.node().ok_or(Refusal::NoNode)?;
    node.id.parse().map_err(Refusal::BadNode)
}

/// Which pod `caller` is served as, from the node of its first request
/// `first`, as the registry of `d` stands now (a pod it does not know yet
/// is [`Refusal::UnknownPod`]; [`AdsService::entitle`] waits a little for it).
pub fn entitled_now(
    d: &Discovery,
    caller: &Caller,
    first: &impl AdsRequest,
) -> Result<PodKey, Refusal> {
    entitled(d, caller, &node_id(first)?)
}

/// Whether `caller` may be served as node `id`.
fn entitled(d: &Discovery, caller: &Caller, id: &NodeId) -> Result<PodKey, Refusal> {
    if caller.namespace != id.namespace {
        return Err(Refusal::OtherNamespace {
            node: id.namespace.clone(),
            caller: caller.namespace.clone(),
        });
    }
    if let Some(pod) = &caller.pod
        && *pod != id.pod
    {
        return Err(Refusal::OtherPod {
            token: pod.clone(),
            node: id.pod.clone(),
        });
    }
    let key = PodKey {
        namespace: id.namespace.clone(),
        name: id.pod.clone(),
    };
    let proxy = d
        .read(|r| r.proxy(&key).cloned())
        .ok_or_else(|| Refusal::UnknownPod(key.namespace.clone(), key.name.clone()))?;
    let pod = format!("{}/{}", key.namespace, key.name);
    if proxy.service_account != caller.service_account {
        return Err(Refusal::OtherServiceAccount {
            pod,
            pod_sa: proxy.service_account,
            caller: caller.service_account.clone(),
        });
    }
    if let Some(ip) = proxy.ip
        && ip != id.ip
    {
        return Err(Refusal::OtherIp {
            node: id.ip.clone(),
            pod,
            actual: ip,
        });
    }
    Ok(key)
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl<A: Authenticate> AggregatedDiscoveryService for AdsService<A> {
    type StreamAggregatedResourcesStream = BoxStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = BoxStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        self.serve_stream(request, Session::new).await
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        self.serve_stream(request, DeltaSession::new).await
    }
}

impl<A: Authenticate> AdsService<A> {
    /// Admit a stream (state of the world or delta), then serve it with
    /// the session `session` makes from the stream's nonce prefix.
    async fn serve_stream<S: StreamSession>(
        &self,
        request: Request<Streaming<S::Request>>,
        session: impl FnOnce(String) -> S,
    ) -> Result<Response<BoxStream<S::Response>>, Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let source = request.extensions().get::<Peer>().map(|p| p.0);
        let mut inbound = request.into_inner();
        let admitted = async {
            let caller = self.caller(authorization.as_deref(), source).await?;
            let first = match tokio::time::timeout(FIRST_REQUEST_TIMEOUT, inbound.next()).await {
                Err(_) => return Err(Refusal::Silent(FIRST_REQUEST_TIMEOUT)),
                Ok(None) => return Err(Refusal::NoNode),
                Ok(Some(Err(status))) => return Err(Refusal::Unreadable(status)),
                Ok(Some(Ok(first))) => first,
            };
            let pod = self.entitle(&caller, &first).await?;
            Ok((pod, first))
        }
        .await;
        let (pod, first) = match admitted {
            Ok(a) => a,
            Err(e) => {
                self.metrics.refused(e.reason());
                tracing::info!(?source, error = %e, "discovery: stream refused");
                return Err(e.status());
            }
        };
        let (tx, rx) = mpsc::channel(QUEUE);
        let stream = ProxyStream {
            id: self.discovery.stream_id(),
            pod,
            discovery: Arc::clone(&self.discovery),
            metrics: self.metrics.clone(),
            events: self.events.clone(),
            session: session(format!("{:08x}", rand::random::<u32>())),
            snapshot: Snapshot::default(),
            tx,
        };
        tokio::spawn(stream.run(Box::new(first), inbound, self.shutdown.clone()));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx).map(|r| *r),
        )))
    }
}

/// One proxy's stream.
struct ProxyStream<S: StreamSession> {
    id: StreamId,
    pod: PodKey,
    discovery: Arc<Discovery>,
    metrics: Metrics,
    events: Option<PodEvents>,
    session: S,
    snapshot: Snapshot,
    tx: mpsc::Sender<Box<Result<S::Response, Status>>>,
}

/// Why a stream ended.
enum End {
    /// The proxy went, or its stream broke.
    Gone,
    Status(Status),
}

impl<S: StreamSession> ProxyStream<S> {
    /// The stream's task, which lives as long as its proxy's stream and
    /// mostly waits: every proxy pays for its future. So what only a
    /// request or a push needs is boxed for that moment (their futures hold
    /// a request, a response and a timer), and what it waits on in between
    /// is all that stays (see the test `an_idle_stream_holds_little`).
    ///
    /// A plain fn returning an `async move` block: an `async fn` keeps its
    /// arguments twice (as passed and as its body's bindings).
    #[allow(clippy::manual_async_fn)] // On purpose: see above.
    fn run(
        mut self,
        first: Box<S::Request>,
        mut inbound: Streaming<S::Request>,
        shutdown: CancellationToken,
    ) -> impl Future<Output = ()> + Send {
        async move {
            self.metrics.stream_opened();
            let mut batches = self.discovery.batches();
            let mut generation = batches.borrow_and_update().generation;
            self.recompute();
            // Made in a statement of its own (a temporary in the awaiting
            // statement would keep its room in the task), by a fn that
            // frees the request's box once it is moved into the future.
            let first = self.on_first(first);
            // Pushes held while the proxy has not answered, and the timer
            // of their bound (boxed: most streams hold none, most of the time).
            let mut coalesce = Coalesce::default();
            let mut bound: Option<Pin<Box<tokio::time::Sleep>>> = None;
            let end = match first.await {
                Err(end) => end,
                Ok(()) => loop {
                    // What a wake asks for is made inside `select!` and run
                    // after it, so nothing the wake brought (a request is
                    // ~600 bytes) stays in the task while it waits.
                    let work: Option<BoxFuture<'_, Result<(), End>>> = tokio::select! {
                        () = shutdown.cancelled() => {
                            break End::Status(Status::unavailable("the discovery server is shutting down"));
                        }
                        // Boxed: `select!`'s output has room for the largest.
                        r = inbound.next().map(|r| r.map(|r| r.map(Box::new))) => match r {
                            None => break End::Gone,
                            Some(Err(status)) => {
                                tracing::debug!(pod = ?self.pod, %status, "discovery: stream broke");
                                // A request the server refused to read (too
                                // large, say) is said back to the proxy.
                                break End::Status(status);
                            }
                            Some(Ok(req)) => Some(self.on_request(*req).boxed()),
                        },
                        c = batches.changed() => {
                            if c.is_err() {
                                break End::Status(Status::unavailable("the discovery server is stopping"));
                            }
                            let batch: Arc<Batch> = batches.borrow_and_update().clone();
                            let missed = batch.generation != generation + 1;
                            generation = batch.generation;
                            if !missed && !batch.concerns(&self.pod, &self.snapshot.services) {
                                continue;
                            }
                            let awaiting = self.session.awaiting();
                            coalesce
                                .change(awaiting, Instant::now(), self.discovery.debounce)
                                .then(|| self.push().boxed())
                        }
                        () = async {
                            match bound.as_mut() {
                                Some(t) => t.as_mut().await,
                                None => std::future::pending().await,
                            }
                        } => None,
                    };
                    if let Some(Err(end)) = OptionFuture::from(work).await {
                        break end;
                    }
                    // Answered (or the bound came): the held push goes.
                    if coalesce.due(self.session.awaiting(), Instant::now())
                        && let Err(end) = self.push().boxed().await
                    {
                        break end;
                    }
                    bound = match (coalesce.held_until(), bound.take()) {
                        (None, _) => None,
                        (Some(at), None) => Some(Box::pin(tokio::time::sleep_until(at))),
                        (Some(_), running) => running,
                    };
                },
            };
            if let End::Status(s) = end {
                let last = self.tx.send_timeout(Box::new(Err(s)), SEND_TIMEOUT).boxed();
                let _ = last.await;
            }
            let done = self.discovery.stream_ended(self.id);
            self.withdrawals_done(&done);
            self.metrics.stream_closed();
        }
    }

    /// The first request's work: it came boxed to keep it out of the
    /// task's future, and its box is freed here, not when the task ends.
    #[allow(clippy::boxed_local)] // On purpose: see above.
    fn on_first(&mut self, first: Box<S::Request>) -> BoxFuture<'_, Result<(), End>> {
        self.on_request(*first).boxed()
    }

    /// Recompute the proxy's resources; keep the last ones if its pod is
    /// gone (it is going away, and its proxy keeps what it has).
    fn recompute(&mut self) {
        if let Some(s) = self.discovery.snapshot(&self.pod) {
            if !s.skipped.is_empty() {
                tracing::debug!(pod = ?self.pod, skipped = ?s.skipped, "discovery: outbound entries not served");
            }
            self.snapshot = s;
        }
    }

    /// A push: recompute, then send what changed, holding a place in the
    /// throttle throughout (a proxy that takes nothing holds it until
    /// [`SEND_TIMEOUT`] cuts it).
    async fn push(&mut self) -> Result<(), End> {
        let discovery = Arc::clone(&self.discovery);
        let _place = discovery.throttle.acquire().await;
        self.recompute();
        for p in self.session.push(&self.snapshot) {
            self.send(p).await?;
        }
        Ok(())
    }

    async fn on_request(&mut self, req: S::Request) -> Result<(), End> {
        let outcome = match self.session.on_request(req, &self.snapshot) {
            Ok(o) => o,
            Err(e) => {
                self.metrics.refused(e.reason());
                return Err(End::Status(e.status()));
            }
        };
        if let Reply::Nack { version, detail } = &outcome.reply {
            self.nacked(outcome.type_url, version, detail);
        }
        if outcome.type_url == resources::ENDPOINTS {
            self.eds_answered(&outcome.reply);
        }
        match outcome.push {
            Some(p) => self.send(p).await,
            None => Ok(()),
        }
    }

    /// The proxy refused version `version` of type `t`: counted, logged and
    /// raised on its pod.
    fn nacked(&self, t: &'static str, version: &str, detail: &str) {
        self.metrics.nack(t);
        tracing::warn!(pod = ?self.pod, r#type = short_type(t), version,
            error = %detail, "discovery: the proxy refused the configuration (NACK)");
        if let Some(events) = &self.events {
            events.warn(Warning {
                namespace: self.pod.namespace.clone(),
                pod: self.pod.name.clone(),
                reason: "ConfigurationRefused",
                action: "PushConfiguration",
                note: format!(
                    "Envoy refused {} version {version} and keeps its last good one: {detail}",
                    short_type(t),
                ),
            });
        }
    }

    /// What the proxy said of an EDS response, for the withdrawal tracker.
    fn eds_answered(&self, reply: &Reply) {
        let d = &self.discovery;
        let done = match reply {
            Reply::Ack { version } => d.eds_answered(self.id, version, true),
            Reply::Nack { version, .. } => d.eds_answered(self.id, version, false),
            // It holds what it would be sent: as sent and ACKed.
            Reply::Resumed { version } => {
                let mut done = self.eds_sent();
                done.extend(d.eds_answered(self.id, version, true));
                done
            }
            Reply::Request | Reply::Stale => Vec::new(),
        };
        self.withdrawals_done(&done);
    }

    /// EDS of the snapshot sent: what the proxy holds once it applies it.
    fn eds_sent(&self) -> Vec<Changed> {
        self.discovery
            .eds_sent(self.id, &self.pod, &self.snapshot, |name| {
                self.session.holds(resources::ENDPOINTS, name)
            })
    }

    /// Withdrawals every proxy has confirmed: an Event on each pod.
    fn withdrawals_done(&self, done: &[Changed]) {
        for c in done {
            tracing::info!(pod = ?c.pod, confirmed = c.progress.confirmed, expected = c.progress.expected,
                gone = c.progress.gone, after = ?c.progress.last_confirmation, "discovery: withdrawal confirmed");
            if let Some(events) = &self.events {
                withdrawal::raise_done(events, &c.pod, &c.progress);
            }
        }
    }

    /// Send what the session decided, counting it.
    async fn send(&mut self, p: Push<S::Response>) -> Result<(), End> {
        if p.type_url == resources::ENDPOINTS {
            let done = self.eds_sent();
            self.withdrawals_done(&done);
        }
        if p.out_of_scope > 0 {
            self.metrics.out_of_scope(p.type_url, p.out_of_scope);
        }
        self.metrics.pushed(p.type_url);
        self.tx
            .send_timeout(Box::new(Ok(p.response)), SEND_TIMEOUT)
            .await
            .map_err(|e| match e {
                mpsc::error::SendTimeoutError::Timeout(_) => {
                    End::Status(Status::deadline_exceeded(format!(
                        "the proxy took no response for {SEND_TIMEOUT:?}"
                    )))
                }
                mpsc::error::SendTimeoutError::Closed(_) => End::Gone,
            })
    }
}

/// The metrics label of a type URL.
pub fn short_type(t: &str) -> &'static str {
    match t {
        resources::LISTENER => "lds",
        resources::CLUSTER => "cds",
        resources::ENDPOINTS => "eds",
        resources::POD_ANNOTATIONS => "pod",
        resources::WITHDRAWAL => "withdrawal",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::push::Debounce;
    use crate::discovery::registry::ProxyInfo;

    fn setup() -> Arc<Discovery> {
        let (d, _debounce) = Discovery::new("cluster.local", None, Debounce::default());
        d.update(|r| {
            r.apply_proxy(
                PodKey {
                    namespace: "shop".into(),
                    name: "web-0".into(),
                },
                ProxyInfo {
                    ip: Some("10.0.0.7".into()),
                    service_account: "web".into(),
                    outbound: None,
                    ..Default::default()
                },
            )
        });
        d
    }

    fn caller(ns: &str, sa: &str, pod: Option<&str>) -> Caller {
        Caller {
            namespace: ns.into(),
            service_account: sa.into(),
            pod: pod.map(str::to_string),
        }
    }

    #[test]
    fn only_the_pods_own_caller_is_entitled() {
        let d = setup();
        let id: NodeId = "sidecar~10.0.0.7~web-0.shop~shop.svc.cluster.local"
            .parse()
            .expect("id");
        assert!(entitled(&d, &caller("shop", "web", Some("web-0")), &id).is_ok());
        assert!(entitled(&d, &caller("shop", "web", None), &id).is_ok());
        for (c, id, reason) in [
            (caller("shop", "other", None), id.clone(), "not_its_pod"),
            (caller("evil", "web", None), id.clone(), "not_its_pod"),
            (
                caller("shop", "web", Some("web-1")),
                id.clone(),
                "not_its_pod",
            ),
            (
                caller("shop", "web", None),
                NodeId {
                    ip: "10.0.0.8".into(),
                    ..id.clone()
                },
                "not_its_pod",
            ),
            (
                caller("shop", "web", None),
                NodeId {
                    pod: "web-9".into(),
                    ..id.clone()
                },
                "unknown_pod",
            ),
        ] {
            let e = entitled(&d, &c, &id).expect_err("refused");
            assert_eq!(e.reason(), reason, "{e}");
            assert_eq!(e.status().code(), tonic::Code::PermissionDenied, "{e}");
        }
    }

    #[test]
    fn a_refusal_echoes_a_made_up_node_id_bounded() {
        let d = setup();
        let huge = "x".repeat(200_000);
        for (c, id) in [
            // Another namespace, another pod than the token's, an unknown
            // pod, another IP: each refusal would echo a part of the id.
            (
                caller("shop", "web", None),
                format!("sidecar~10.0.0.7~web-0.{huge}~{huge}.svc.cluster.local"),
            ),
            (
                caller("shop", "web", Some("web-0")),
                format!("sidecar~10.0.0.7~{huge}.shop~shop.svc.cluster.local"),
            ),
            (
                caller("shop", "web", None),
                format!("sidecar~10.0.0.7~{huge}.shop~shop.svc.cluster.local"),
            ),
            (
                caller("shop", "web", None),
                format!("sidecar~{huge}~web-0.shop~shop.svc.cluster.local"),
            ),
        ] {
            let first = DiscoveryRequest {
                node: Some(envoy_types::pb::envoy::config::core::v3::Node {
                    id,
                    ..Default::default()
                }),
                ..Default::default()
            };
            let e = entitled_now(&d, &c, &first).expect_err("refused");
            let status = e.status();
            // Refused as a bad node before any part of it is compared:
            // nothing longer than Kubernetes allows is kept to be echoed.
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{e}");
            assert!(
                status.message().len() < 1024,
                "{} bytes",
                status.message().len()
            );
        }
    }

    /// The size of the future `f` returns, without making one.
    fn future_size<F, A, B, C, D, Fut>(_: F) -> usize
    where
        F: FnOnce(A, B, C, D) -> Fut,
    {
        std::mem::size_of::<Fut>()
    }

    #[test]
    fn an_idle_stream_holds_little() {
        // Every proxy's task holds its stream's future for as long as the
        // stream lives (5 KiB before the request and push futures were
        // boxed; about 1 KiB after, most of it the stream's own state).
        for (what, bytes) in [
            ("delta", future_size(ProxyStream::<DeltaSession>::run)),
            ("sotw", future_size(ProxyStream::<Session>::run)),
        ] {
            assert!(bytes <= 1280, "{what}: {bytes} bytes");
        }
    }
}
