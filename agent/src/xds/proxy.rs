//! The Envoy side: a tonic `AggregatedDiscoveryService` on the proxy socket,
//! state of the world and delta (whichever Envoy's bootstrap chose, see
//! [`super::bootstrap`]). Each Envoy stream gets one upstream stream of
//! the same kind ([`super::upstream`]); both directions are forwarded
//! unchanged, except what resuming needs (see [`super::session`] and
//! [`super::delta`]; a [`Flavor`] is what the two kinds differ in). When the upstream stream fails, Envoy's stream stays
//! open (Envoy keeps serving its last configuration) while the proxy
//! reconnects with jittered exponential backoff.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;

use backon::{BackoffBuilder, ExponentialBuilder};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryService;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use futures::Stream;
use futures::future::BoxFuture;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

/// How long an upstream stream must last before its responses reset the
/// reconnect backoff.
const STABLE_STREAM: std::time::Duration = std::time::Duration::from_secs(5);
use tonic::{Request, Response, Status, Streaming};

use super::delta::DeltaSession;
use super::session::{
    CLUSTER_TYPE, LISTENER_TYPE, MAX_TYPES, Reply, Session, SessionError, WITHDRAWAL_TYPE, is_own,
};
use super::upstream::{UpstreamConfig, UpstreamError};
use super::{FirstAcks, XdsMetrics};
use crate::pod_annotations::StreamCopy;
use crate::withdrawal::{Told, Upstream as UpstreamView};

/// Requests queued towards the upstream stream; more than a whole replay
/// ([`MAX_TYPES`], and the agent's own few). A full queue counts as a failed upstream: the session
/// keeps Envoy's latest requests, so a reconnect loses nothing.
const UP_QUEUE: usize = 2 * MAX_TYPES;
/// Responses queued towards Envoy.
const DOWN_QUEUE: usize = 16;

pub(super) struct Shared {
    pub upstream: UpstreamConfig,
    pub metrics: XdsMetrics,
    pub acked: watch::Sender<FirstAcks>,
    /// The pod's annotations as the server pushes them; `None` while the
    /// upstream stream is down (the agent reads the downward-API file then).
    pub pod_annotations: watch::Sender<StreamCopy>,
    /// Whether the upstream stream is open, and the pod's withdrawal as
    /// the server last told it (for the drain, [`crate::withdrawal`]).
    pub withdrawal: watch::Sender<UpstreamView>,
    pub streams: Arc<Semaphore>,
    pub cancel: CancellationToken,
}

impl Shared {
    /// Count and log what Envoy said about the last response of a type.
    fn observe(&self, type_url: &str, reply: &Reply) {
        match reply {
            Reply::Request => {}
            Reply::Ack { version } => {
                tracing::debug!(%type_url, %version, "Envoy accepted a discovery response");
                self.acked.send_if_modified(|a| {
                    let before = *a;
                    match type_url {
                        LISTENER_TYPE => a.listeners = true,
                        CLUSTER_TYPE => a.clusters = true,
                        _ => {}
                    }
                    *a != before
                });
            }
            Reply::Nack {
                version,
                code,
                message,
            } => {
                self.metrics.nacks.inc();
                tracing::warn!(%type_url, kept_version = %version, code, error = %message,
                    "Envoy rejected a discovery response (NACK); it keeps its previous configuration");
            }
        }
    }

    /// A response of the agent's own type: the pod's annotations, applied
    /// when they decode (the next read of a setting sees them); one that
    /// carries none changes nothing.
    fn apply_pod_annotations(
        &self,
        carried: Result<Option<BTreeMap<String, String>>, String>,
    ) -> Result<(), String> {
        if let Some(annotations) = carried? {
            tracing::debug!(
                count = annotations.len(),
                "the pod's annotations, from the discovery server"
            );
            self.pod_annotations
                .send_replace(Some(Arc::new(annotations)));
        }
        Ok(())
    }

    /// A response of the withdrawal type: the pod's withdrawal, published
    /// when it decodes.
    fn apply_withdrawal(&self, told: Result<Told, String>) -> Result<(), String> {
        let withdrawal = match told? {
            Told::Unchanged => return Ok(()),
            Told::Absent => None,
            Told::Withdrawn(p) => {
                tracing::debug!(
                    expected = p.expected,
                    confirmed = p.confirmed,
                    gone = p.gone,
                    done = p.done,
                    timed_out = p.timed_out,
                    "the pod's withdrawal, from the discovery server"
                );
                Some(p)
            }
        };
        self.withdrawal.send_modify(|u| u.withdrawal = withdrawal);
        Ok(())
    }

    /// Whether the upstream stream is open, for the drain.
    fn set_connected(&self, connected: bool) {
        self.withdrawal.send_if_modified(|u| {
            let changed = u.connected != connected;
            u.connected = connected;
            changed
        });
    }

    fn backoff(&self) -> impl Iterator<Item = std::time::Duration> + use<> {
        ExponentialBuilder::default()
            .with_jitter()
            .with_min_delay(self.upstream.min_backoff)
            .with_max_delay(self.upstream.max_backoff)
            .without_max_times()
            .build()
    }
}

/// The tonic service.
#[derive(Clone)]
pub struct AdsProxy {
    shared: Arc<Shared>,
}

impl AdsProxy {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for AdsProxy {
    type StreamAggregatedResourcesStream = BoxStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = BoxStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        // One Envoy, two during a hot restart: more is not ours.
        let permit = self
            .shared
            .streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| Status::resource_exhausted("too many ADS streams on the proxy"))?;
        let (tx, rx) = mpsc::channel(DOWN_QUEUE);
        tokio::spawn(run_stream::<Session>(
            self.shared.clone(),
            request.into_inner(),
            tx,
            permit,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let permit = self
            .shared
            .streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| Status::resource_exhausted("too many ADS streams on the proxy"))?;
        let (tx, rx) = mpsc::channel(DOWN_QUEUE);
        tokio::spawn(run_stream::<DeltaSession>(
            self.shared.clone(),
            request.into_inner(),
            tx,
            permit,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

type Opening<R> = BoxFuture<'static, Result<Streaming<R>, UpstreamError>>;

/// What state of the world and delta differ in, for the proxy: their
/// messages, their sessions, and how the upstream stream opens.
pub(super) trait Flavor: Default + Send + 'static {
    type Request: Send + 'static;
    type Response: Send + 'static;
    fn response_type(resp: &Self::Response) -> &str;
    fn on_envoy(
        &mut self,
        req: Self::Request,
    ) -> Result<(Self::Request, Reply, String), SessionError>;
    fn on_server(&mut self, resp: &Self::Response);
    fn own_subscriptions(&mut self) -> Vec<Self::Request>;
    fn own_ack(&mut self, resp: &Self::Response, applied: Result<(), String>) -> Self::Request;
    fn resume(&mut self) -> Vec<Self::Request>;
    /// The pod's annotations a response of the agent's own type carries
    /// (`None`: no change).
    fn pod_annotations(resp: &Self::Response) -> Result<Option<BTreeMap<String, String>>, String>;
    /// What a response of the withdrawal type says.
    fn withdrawal(resp: &Self::Response) -> Result<Told, String>;
    fn open(
        cfg: UpstreamConfig,
        requests: mpsc::Receiver<Self::Request>,
    ) -> Opening<Self::Response>;
}

impl Flavor for Session {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;
    fn response_type(resp: &DiscoveryResponse) -> &str {
        &resp.type_url
    }
    fn on_envoy(
        &mut self,
        req: DiscoveryRequest,
    ) -> Result<(DiscoveryRequest, Reply, String), SessionError> {
        let (fwd, reply) = Session::from_envoy(self, req)?;
        let t = fwd.type_url.clone();
        Ok((fwd, reply, t))
    }
    fn on_server(&mut self, resp: &DiscoveryResponse) {
        Session::from_server(self, resp);
    }
    fn own_subscriptions(&mut self) -> Vec<DiscoveryRequest> {
        Session::own_subscriptions(self)
    }
    fn own_ack(
        &mut self,
        resp: &DiscoveryResponse,
        applied: Result<(), String>,
    ) -> DiscoveryRequest {
        Session::own_ack(self, resp, applied)
    }
    fn resume(&mut self) -> Vec<DiscoveryRequest> {
        Session::resume(self)
    }
    fn pod_annotations(
        resp: &DiscoveryResponse,
    ) -> Result<Option<BTreeMap<String, String>>, String> {
        super::session::pod_annotations(resp).map(Some)
    }
    fn withdrawal(resp: &DiscoveryResponse) -> Result<Told, String> {
        super::session::withdrawal(resp)
    }
    fn open(
        cfg: UpstreamConfig,
        requests: mpsc::Receiver<DiscoveryRequest>,
    ) -> Opening<DiscoveryResponse> {
        Box::pin(async move { cfg.open(requests).await })
    }
}

impl Flavor for DeltaSession {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;
    fn response_type(resp: &DeltaDiscoveryResponse) -> &str {
        &resp.type_url
    }
    fn on_envoy(
        &mut self,
        req: DeltaDiscoveryRequest,
    ) -> Result<(DeltaDiscoveryRequest, Reply, String), SessionError> {
        let (fwd, reply) = DeltaSession::from_envoy(self, req)?;
        let t = fwd.type_url.clone();
        Ok((fwd, reply, t))
    }
    fn on_server(&mut self, resp: &DeltaDiscoveryResponse) {
        DeltaSession::from_server(self, resp);
    }
    fn own_subscriptions(&mut self) -> Vec<DeltaDiscoveryRequest> {
        DeltaSession::own_subscriptions(self)
    }
    fn own_ack(
        &mut self,
        resp: &DeltaDiscoveryResponse,
        applied: Result<(), String>,
    ) -> DeltaDiscoveryRequest {
        DeltaSession::own_ack(self, resp, applied)
    }
    fn resume(&mut self) -> Vec<DeltaDiscoveryRequest> {
        DeltaSession::resume(self)
    }
    fn pod_annotations(
        resp: &DeltaDiscoveryResponse,
    ) -> Result<Option<BTreeMap<String, String>>, String> {
        super::delta::pod_annotations(resp)
    }
    fn withdrawal(resp: &DeltaDiscoveryResponse) -> Result<Told, String> {
        super::delta::withdrawal(resp)
    }
    fn open(
        cfg: UpstreamConfig,
        requests: mpsc::Receiver<DeltaDiscoveryRequest>,
    ) -> Opening<DeltaDiscoveryResponse> {
        Box::pin(async move { cfg.open_delta(requests).await })
    }
}

/// Where the upstream stream is.
enum Upstream<F: Flavor> {
    /// Waiting out the backoff before the next attempt.
    Waiting(Pin<Box<tokio::time::Sleep>>),
    Connecting(Opening<F::Response>),
    Streaming(Box<Streaming<F::Response>>),
}

// Transient: one at a time, handled at once.
#[allow(clippy::large_enum_variant)]
enum Event<F: Flavor> {
    Envoy(Result<Option<F::Request>, Status>),
    Retry,
    Connected(Result<Streaming<F::Response>, UpstreamError>),
    Response(Result<Option<F::Response>, Status>),
}

impl<F: Flavor> Upstream<F> {
    /// The next thing that happens upstream. Cancel-safe: the sleep and the
    /// connection live in `self`, and `Streaming::message` is cancel-safe.
    async fn next(&mut self) -> Event<F> {
        match self {
            Self::Waiting(s) => {
                s.as_mut().await;
                Event::Retry
            }
            Self::Connecting(f) => Event::Connected(f.as_mut().await),
            Self::Streaming(s) => Event::Response(s.message().await),
        }
    }
}

/// Start an attempt: a fresh queue, primed with the session's replay.
fn connect<F: Flavor>(
    shared: &Arc<Shared>,
    session: &mut F,
    up: &mut Option<mpsc::Sender<F::Request>>,
) -> Upstream<F> {
    let (tx, rx) = mpsc::channel(UP_QUEUE);
    for r in session
        .resume()
        .into_iter()
        .chain(session.own_subscriptions())
    {
        // Fits: a replay has at most MAX_TYPES requests, and a few of ours.
        let _ = tx.try_send(r);
    }
    *up = Some(tx);
    Upstream::Connecting(F::open(shared.upstream.clone(), rx))
}

async fn run_stream<F: Flavor>(
    shared: Arc<Shared>,
    envoy: Streaming<F::Request>,
    down: mpsc::Sender<Result<F::Response, Status>>,
    _permit: OwnedSemaphorePermit,
) {
    shared.metrics.streams.inc();
    proxy_stream::<F>(&shared, envoy, down).await;
    shared.metrics.streams.dec();
    // No Envoy stream left, so no upstream one either.
    if shared.metrics.streams.get() == 0 {
        shared.set_connected(false);
    }
}

async fn proxy_stream<F: Flavor>(
    shared: &Arc<Shared>,
    mut envoy: Streaming<F::Request>,
    down: mpsc::Sender<Result<F::Response, Status>>,
) {
    let mut session = F::default();
    let mut backoff = shared.backoff();
    let mut up = None;
    let mut upstream = connect(shared, &mut session, &mut up);
    let mut failures = 0u64;
    // When the current upstream stream opened: the backoff starts over only
    // once a stream has lasted, so a server that answers and then ends every
    // stream is not dialled (and its TokenReviews spent) every 200 ms.
    let mut opened_at: Option<tokio::time::Instant> = None;
    let address = &shared.upstream.address;
    loop {
        let event = tokio::select! {
            _ = shared.cancel.cancelled() => return,
            m = envoy.message() => Event::Envoy(m),
            e = upstream.next() => e,
        };
        let failed: Option<String> = match event {
            Event::Envoy(Ok(Some(req))) => match session.on_envoy(req) {
                Ok((fwd, reply, type_url)) => {
                    shared.observe(&type_url, &reply);
                    // Ours go up right after the first request with the node.
                    let own = session.own_subscriptions();
                    match &up {
                        Some(tx)
                            if std::iter::once(fwd)
                                .chain(own)
                                .any(|r| tx.try_send(r).is_err()) =>
                        {
                            Some("the upstream stream does not keep up".into())
                        }
                        // Down: the session has it; the replay carries it.
                        _ => None,
                    }
                }
                Err(e) => {
                    let _ = down
                        .send(Err(Status::invalid_argument(e.to_string())))
                        .await;
                    return;
                }
            },
            // Envoy's stream ended: returning drops the upstream stream.
            Event::Envoy(Ok(None)) => return,
            Event::Envoy(Err(status)) => {
                tracing::debug!(%status, "Envoy's ADS stream ended with an error");
                return;
            }
            Event::Retry => {
                shared.metrics.reconnects.inc();
                upstream = connect(shared, &mut session, &mut up);
                None
            }
            Event::Connected(Ok(stream)) => {
                tracing::info!(%address, "ADS stream to the discovery server open");
                shared.set_connected(true);
                upstream = Upstream::Streaming(Box::new(stream));
                opened_at = Some(tokio::time::Instant::now());
                None
            }
            Event::Connected(Err(e)) => Some(e.to_string()),
            Event::Response(Ok(Some(resp))) => {
                if opened_at.is_some_and(|t| t.elapsed() >= STABLE_STREAM) {
                    if failures > 0 {
                        tracing::info!(%address, "the discovery server answers again");
                    }
                    failures = 0;
                    backoff = shared.backoff();
                }
                let t = F::response_type(&resp);
                if is_own(t) {
                    let applied = if t == WITHDRAWAL_TYPE {
                        shared.apply_withdrawal(F::withdrawal(&resp))
                    } else {
                        shared.apply_pod_annotations(F::pod_annotations(&resp))
                    };
                    if let Err(e) = &applied {
                        tracing::warn!(error = %e, r#type = %t, "refused a resource of the agent's own from the discovery server");
                    }
                    let reply = session.own_ack(&resp, applied);
                    match &up {
                        Some(tx) if tx.try_send(reply).is_err() => {
                            Some("the upstream stream does not keep up".into())
                        }
                        _ => None,
                    }
                } else {
                    session.on_server(&resp);
                    if down.send(Ok(resp)).await.is_err() {
                        return;
                    }
                    None
                }
            }
            Event::Response(Ok(None)) => Some("the server closed the stream".into()),
            Event::Response(Err(status)) => Some(format!(
                "the stream failed: {:?}: {}",
                status.code(),
                status.message()
            )),
        };
        if let Some(reason) = failed {
            failures += 1;
            let delay = backoff.next().unwrap_or(shared.upstream.max_backoff);
            // The first failure of a run at warn; the retries after it quieter.
            if failures == 1 {
                tracing::warn!(%address, %reason, retry_in = ?delay,
                    "ADS upstream lost; Envoy keeps serving its last configuration");
            } else {
                tracing::info!(%address, %reason, retry_in = ?delay, failures, "ADS upstream still down");
            }
            up = None;
            // The pod's annotations come from the file until the stream is back.
            shared.pod_annotations.send_replace(None);
            shared.set_connected(false);
            upstream = Upstream::Waiting(Box::pin(tokio::time::sleep(delay)));
        }
    }
}
