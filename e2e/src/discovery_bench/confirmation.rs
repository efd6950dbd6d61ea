//! The callee pod's own agent, as far as confirmed removal goes: one ADS
//! stream per pod (state of the world), authenticated and named as the
//! pod's agent is, subscribed to the withdrawal of its endpoints
//! (`remora.v1.Withdrawal`, as the agent subscribes on its upstream
//! stream) and ACKing each response. It records when it was first told the
//! withdrawal is done, and what the server said of it. It never retries.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use futures::StreamExt;
use prost::Message;
use remora_contract::discovery::WITHDRAWAL_TYPE;
use remora_proto::remora::v1::Withdrawal;
use remora_test_support::ads_requests::request;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::proxy::{Identity, ProxyError, Target, open};

/// What one pod's subscriber was told.
#[derive(Debug, Clone, Default)]
pub struct Told {
    /// A first response came (the stream is served).
    pub answered: bool,
    /// When it was first told the withdrawal is done.
    pub done_at: Option<Instant>,
    /// The server's own count then: from the withdrawal to the last
    /// confirmation (ms), proxies waited for, and whether it gave up.
    pub last_confirmation_ms: u64,
    pub expected: u32,
    pub confirmed: u32,
    pub timed_out: bool,
}

/// Every pod's subscriber, by pod name.
#[derive(Default)]
pub struct Confirmations {
    told: Mutex<HashMap<String, Told>>,
}

impl Confirmations {
    pub fn get(&self, pod: &str) -> Option<Told> {
        self.lock().get(pod).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Told>> {
        self.told.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn record(&self, pod: &str, w: Option<Withdrawal>) {
        let at = Instant::now();
        let mut all = self.lock();
        let t = all.entry(pod.to_string()).or_default();
        t.answered = true;
        if let Some(w) = w.filter(|w| w.done)
            && t.done_at.is_none()
        {
            t.done_at = Some(at);
            t.last_confirmation_ms = w.last_confirmation_ms;
            t.expected = w.expected;
            t.confirmed = w.confirmed;
            t.timed_out = w.timed_out;
        }
    }
}

/// Subscribe as the agent of pod `pod` (of `namespace`, at `pod_ip`),
/// dialling from `local` (its index `index` names it in errors), until
/// `stop`.
pub async fn subscribe(
    target: Target,
    local: Identity,
    pod: String,
    pod_ip: Ipv4Addr,
    told: Arc<Confirmations>,
    stop: CancellationToken,
) -> Result<(), ProxyError> {
    let i = local.index;
    let ns = local.namespace.clone();
    let (tx, rx) = mpsc::unbounded_channel();
    let send = |r: DiscoveryRequest| tx.send(r).map_err(|_| ProxyError::Send(i));
    send(DiscoveryRequest {
        node: Some(Node {
            id: format!("sidecar~{pod_ip}~{pod}.{ns}~{ns}.svc.cluster.local"),
            cluster: "callee".into(),
            ..Default::default()
        }),
        ..request(WITHDRAWAL_TYPE, Vec::new(), None)
    })?;
    let mut stream = tokio::select! {
        _ = stop.cancelled() => return Ok(()),
        s = open(&target, &local, rx) => s?,
    };
    loop {
        let resp = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            r = stream.next() => match r {
                Some(r) => r.map_err(|s| ProxyError::Status(i, s))?,
                None => return Err(ProxyError::Ended(i)),
            },
        };
        send(request(&resp.type_url, Vec::new(), Some(&resp)))?;
        if resp.type_url == WITHDRAWAL_TYPE {
            let w = resp
                .resources
                .first()
                .and_then(|a| Withdrawal::decode(a.value.as_slice()).ok());
            told.record(&pod, w);
        }
    }
}
