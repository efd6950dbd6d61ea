//! The agent's streams to the other discovery replicas, for its pod's
//! withdrawal alone ([`crate::withdrawal::AskReplicas`]): while the pod
//! drains, each replica the main stream's withdrawal names is asked, on a
//! state-of-the-world stream of its own that subscribes to
//! [`WITHDRAWAL_TYPE`] only (the server never sends it EDS, so never waits
//! for it), with the main stream's credentials and node, the server's
//! certificate verified under the Service's name although the pod's
//! address is dialled ([`UpstreamConfig::for_replica`]). A stream that
//! fails is dialled again after a short backoff, for as long as the drain
//! waits: the receiver dropped (or the agent stopping) ends it.

use std::net::SocketAddr;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::session::{WITHDRAWAL_TYPE, withdrawal};
use super::upstream::UpstreamConfig;
use crate::withdrawal::{AskReplicas, Replica, ReplicaView, Told};

/// First and longest wait before dialling a replica again: its answer is
/// waited for within the pod's withdrawal timeout, seconds.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// Requests queued up one stream: the subscription and an ACK or two.
const QUEUE: usize = 4;

/// Dials the other replicas as the main stream dials the Service.
pub struct Dialer {
    pub upstream: UpstreamConfig,
    /// The main stream's node id.
    pub node_id: String,
    pub cancel: CancellationToken,
}

impl AskReplicas for Dialer {
    fn ask(&self, replica: &Replica) -> watch::Receiver<ReplicaView> {
        let (tx, rx) = watch::channel(ReplicaView::default());
        let cfg = replica
            .address
            .parse::<SocketAddr>()
            .map_err(|_| format!("address {:?} is not IP:port", replica.address))
            .and_then(|a| self.upstream.for_replica(a).map_err(|e| e.to_string()));
        let cfg = match cfg {
            Ok(c) => c,
            Err(e) => {
                tx.send_replace(ReplicaView {
                    withdrawal: None,
                    error: Some(e),
                });
                // Kept: a closed sender reads as a replica that ended.
                tokio::spawn(async move { tx.closed().await });
                return rx;
            }
        };
        let node = Node {
            id: self.node_id.clone(),
            ..Default::default()
        };
        let (cancel, name) = (self.cancel.clone(), replica.name.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = tx.closed() => {}
                () = cancel.cancelled() => {}
                () = follow(&cfg, &node, &tx, &name) => {}
            }
        });
        rx
    }
}

/// Follow the replica's word until cancelled, dialling again on failure.
async fn follow(cfg: &UpstreamConfig, node: &Node, tx: &watch::Sender<ReplicaView>, name: &str) {
    let mut backoff = ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(MIN_BACKOFF)
        .with_max_delay(MAX_BACKOFF)
        .without_max_times()
        .build();
    loop {
        let error = once(cfg, node, tx).await;
        tracing::info!(replica = %name, address = %cfg.address, %error,
            "the stream to another discovery replica for the pod's withdrawal failed");
        tx.send_modify(|v| v.error = Some(error));
        tokio::time::sleep(backoff.next().unwrap_or(MAX_BACKOFF)).await;
    }
}

/// One stream: subscribe, publish and ACK each answer; why it ended.
async fn once(cfg: &UpstreamConfig, node: &Node, tx: &watch::Sender<ReplicaView>) -> String {
    let (up, rx) = mpsc::channel(QUEUE);
    let subscribe = DiscoveryRequest {
        node: Some(node.clone()),
        type_url: WITHDRAWAL_TYPE.into(),
        ..Default::default()
    };
    // Fits: the queue is empty.
    let _ = up.try_send(subscribe);
    let mut stream = match cfg.open(rx).await {
        Ok(s) => s,
        Err(e) => return e.to_string(),
    };
    tx.send_modify(|v| v.error = None);
    let mut version = String::new();
    loop {
        let resp = match stream.message().await {
            Ok(Some(r)) => r,
            Ok(None) => return "the replica closed the stream".into(),
            Err(s) => return format!("{:?}: {}", s.code(), s.message()),
        };
        let error_detail = match withdrawal(&resp) {
            Ok(told) => {
                match told {
                    Told::Withdrawn(p) => tx.send_modify(|v| v.withdrawal = Some(p)),
                    Told::Absent => tx.send_modify(|v| v.withdrawal = None),
                    Told::Unchanged => {}
                }
                version.clone_from(&resp.version_info);
                None
            }
            Err(message) => Some(RpcStatus {
                code: tonic::Code::InvalidArgument as i32,
                message,
                details: Vec::new(),
            }),
        };
        let ack = DiscoveryRequest {
            type_url: WITHDRAWAL_TYPE.into(),
            version_info: version.clone(),
            response_nonce: resp.nonce.clone(),
            error_detail,
            ..Default::default()
        };
        if up.send(ack).await.is_err() {
            return "the stream's requests ended".into();
        }
    }
}
