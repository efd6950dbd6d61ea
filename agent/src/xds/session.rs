//! What the proxy remembers of one Envoy stream, apart from any connection:
//! Envoy's latest request per type URL (to resume on a new upstream stream)
//! and the nonces sent down (to tell ACKs from NACKs). Pure, so the resume
//! and ACK rules are tested without sockets, and fuzzed (fuzz/, target
//! `xds_response`) as the proxy runs them.
//!
//! # What is replayed on a new upstream stream
//!
//! For each type URL Envoy has asked for, in the order Envoy first asked
//! (CDS before EDS, LDS before RDS, as Envoy subscribes), exactly one
//! request: Envoy's latest request of that type, with
//! - `resource_names` and `version_info` as Envoy last sent them (Envoy
//!   puts the version it last accepted in every request, a NACK included, so
//!   a state-of-the-world server that still has that version need not
//!   resend it);
//! - `response_nonce` cleared (it named a response of the old stream, which
//!   the new server never sent and would take for stale) and `error_detail`
//!   cleared (a NACK was about a response of the old stream);
//! - `node` (Envoy sends it on its first message only) on the first one.
//!
//! Requests Envoy sends while no upstream stream is up are not queued: they
//! replace the latest of their type, which the replay then carries.
//!
//! # The agent's own subscriptions
//!
//! The agent subscribes to its pod's annotations
//! ([`POD_ANNOTATIONS_TYPE`]) and to the withdrawal of its endpoints
//! ([`WITHDRAWAL_TYPE`]) on every upstream stream, once the node has gone
//! up ([`Session::own_subscriptions`]), each naming the version it last
//! applied; responses of those types ([`OWN_TYPES`]) are the agent's and
//! never reach Envoy ([`pod_annotations`] and [`withdrawal`] read them,
//! [`Session::own_ack`] answers them).

use std::collections::{BTreeMap, HashMap};

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prost::Message as _;
pub use remora_contract::discovery::{POD_ANNOTATIONS_TYPE, WITHDRAWAL_TYPE};
use remora_proto::remora::v1::{PodAnnotations, Withdrawal};

use crate::withdrawal::Told;

pub const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

/// The agent's own types, subscribed to in this order; never sent to Envoy.
pub const OWN_TYPES: [&str; 2] = [POD_ANNOTATIONS_TYPE, WITHDRAWAL_TYPE];

/// Whether `type_url` is one of the agent's own types.
pub fn is_own(type_url: &str) -> bool {
    OWN_TYPES.contains(&type_url)
}

/// At most this many type URLs per stream: Envoy uses a handful, so more is
/// a broken client, and the session's memory stays bounded.
pub const MAX_TYPES: usize = 32;

/// What a request from Envoy says about the last response of its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A first request, a subscription change, or a reply to a response this
    /// proxy did not send on the current upstream stream.
    Request,
    /// Envoy applied the response with this nonce; `version` is now its.
    Ack { version: String },
    /// Envoy refused the response with this nonce and keeps `version`.
    Nack {
        version: String,
        code: i32,
        message: String,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SessionError {
    #[error("a request without a type URL (only ADS requests name their type)")]
    NoTypeUrl,
    #[error("more than {MAX_TYPES} type URLs on one stream")]
    TooManyTypes,
    #[error("more than {0} resource names subscribed to one type")]
    TooManyNames(usize),
}

#[derive(Debug, Default)]
pub struct Session {
    node: Option<Node>,
    /// Type URLs in the order Envoy first asked for them.
    order: Vec<String>,
    latest: HashMap<String, DiscoveryRequest>,
    /// Per type, the nonce of the last response sent down on the current
    /// upstream stream.
    sent: HashMap<String, String>,
    /// Whether the current upstream stream has had a node yet.
    node_sent: bool,
    /// Whether the agent's own subscriptions went up on the current stream.
    own_sent: bool,
    /// Per own type, the version the agent last applied.
    own_versions: HashMap<&'static str, String>,
}

impl Session {
    /// A request from Envoy: remembered as the latest of its type, and
    /// returned (to forward, unchanged but for a node the new upstream has
    /// not seen) with what it says about the last response.
    pub fn from_envoy(
        &mut self,
        mut req: DiscoveryRequest,
    ) -> Result<(DiscoveryRequest, Reply), SessionError> {
        if req.type_url.is_empty() {
            return Err(SessionError::NoTypeUrl);
        }
        if !self.latest.contains_key(&req.type_url) {
            if self.order.len() >= MAX_TYPES {
                return Err(SessionError::TooManyTypes);
            }
            self.order.push(req.type_url.clone());
        }
        if self.node.is_none() {
            self.node.clone_from(&req.node);
        }
        let current = !req.response_nonce.is_empty()
            && self.sent.get(&req.type_url) == Some(&req.response_nonce);
        let reply = match (&req.error_detail, current) {
            (_, false) => Reply::Request,
            (None, true) => Reply::Ack {
                version: req.version_info.clone(),
            },
            (Some(e), true) => Reply::Nack {
                version: req.version_info.clone(),
                code: e.code,
                message: e.message.clone(),
            },
        };
        self.latest.insert(req.type_url.clone(), req.clone());
        if !self.node_sent && req.node.is_none() {
            req.node.clone_from(&self.node);
        }
        self.node_sent |= req.node.is_some();
        Ok((req, reply))
    }

    /// A response from the server, about to go down to Envoy.
    pub fn from_server(&mut self, resp: &DiscoveryResponse) {
        if self.latest.contains_key(&resp.type_url) {
            self.sent.insert(resp.type_url.clone(), resp.nonce.clone());
        }
        // A type Envoy never asked for: Envoy will ignore it; nothing to track.
    }

    /// The agent's subscriptions to its own types ([`OWN_TYPES`]), once
    /// per upstream stream, as soon as the node has gone up on it (the
    /// server reads the node on a stream's first request).
    pub fn own_subscriptions(&mut self) -> Vec<DiscoveryRequest> {
        if self.own_sent || !self.node_sent {
            return Vec::new();
        }
        self.own_sent = true;
        OWN_TYPES
            .iter()
            .map(|t| DiscoveryRequest {
                type_url: (*t).into(),
                version_info: self.own_versions.get(t).cloned().unwrap_or_default(),
                ..Default::default()
            })
            .collect()
    }

    /// A response of one of the agent's own types ([`is_own`]): the reply
    /// to send up, an ACK when `applied` (its version is now the agent's),
    /// else a NACK that keeps the last version and says why.
    pub fn own_ack(
        &mut self,
        resp: &DiscoveryResponse,
        applied: Result<(), String>,
    ) -> DiscoveryRequest {
        let own = OWN_TYPES
            .iter()
            .find(|t| **t == resp.type_url)
            .copied()
            .unwrap_or(POD_ANNOTATIONS_TYPE);
        let error_detail = match applied {
            Ok(()) => {
                self.own_versions.insert(own, resp.version_info.clone());
                None
            }
            Err(message) => Some(RpcStatus {
                code: tonic::Code::InvalidArgument as i32,
                message,
                details: Vec::new(),
            }),
        };
        DiscoveryRequest {
            type_url: own.into(),
            version_info: self.own_versions.get(own).cloned().unwrap_or_default(),
            response_nonce: resp.nonce.clone(),
            error_detail,
            ..Default::default()
        }
    }

    /// A new upstream stream starts: the requests that resume it (see the
    /// module docs), and forget the old stream's nonces.
    pub fn resume(&mut self) -> Vec<DiscoveryRequest> {
        self.sent.clear();
        self.node_sent = false;
        self.own_sent = false;
        let mut out: Vec<DiscoveryRequest> = self
            .order
            .iter()
            .filter_map(|t| self.latest.get(t))
            .map(|r| DiscoveryRequest {
                response_nonce: String::new(),
                error_detail: None,
                node: None,
                ..r.clone()
            })
            .collect();
        if let Some(first) = out.first_mut() {
            first.node.clone_from(&self.node);
            self.node_sent = first.node.is_some();
        }
        out
    }
}

/// The pod's annotations a response of [`POD_ANNOTATIONS_TYPE`] carries:
/// exactly one `remora.v1.PodAnnotations`, or why not (the NACK's message).
pub fn pod_annotations(resp: &DiscoveryResponse) -> Result<BTreeMap<String, String>, String> {
    let [any] = resp.resources.as_slice() else {
        return Err(format!(
            "{} resources of the pod's annotations, not 1",
            resp.resources.len()
        ));
    };
    let msg = PodAnnotations::decode(any.value.as_slice())
        .map_err(|e| format!("the pod's annotations do not decode: {e}"))?;
    Ok(msg.annotations.into_iter().collect())
}

/// The pod's withdrawal a response of [`WITHDRAWAL_TYPE`] carries: none
/// (absent: the pod is not withdrawn), or exactly one
/// `remora.v1.Withdrawal`, or why not (the NACK's message).
pub fn withdrawal(resp: &DiscoveryResponse) -> Result<Told, String> {
    match resp.resources.as_slice() {
        [] => Ok(Told::Absent),
        [any] => Withdrawal::decode(any.value.as_slice())
            .map(|w| Told::Withdrawn(w.into()))
            .map_err(|e| format!("the pod's withdrawal does not decode: {e}")),
        more => Err(format!(
            "{} resources of the pod's withdrawal, not 1",
            more.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ty: &str, version: &str, nonce: &str, names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: ty.into(),
            version_info: version.into(),
            response_nonce: nonce.into(),
            resource_names: names.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn resp(ty: &str, version: &str, nonce: &str) -> DiscoveryResponse {
        DiscoveryResponse {
            type_url: ty.into(),
            version_info: version.into(),
            nonce: nonce.into(),
            ..Default::default()
        }
    }

    fn node() -> Node {
        Node {
            id: "sidecar~1~p.ns~ns.svc.cluster.local".into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_own_subscriptions_go_up_once_per_stream_after_the_node() {
        let mut s = Session::default();
        assert_eq!(s.own_subscriptions(), [], "no node yet");
        s.from_envoy(DiscoveryRequest {
            node: Some(node()),
            ..req(CLUSTER_TYPE, "", "", &[])
        })
        .expect("ok");
        let own = s.own_subscriptions();
        let types: Vec<&str> = own.iter().map(|r| r.type_url.as_str()).collect();
        assert_eq!(types, OWN_TYPES, "after the node");
        assert!(own.iter().all(|r| r.version_info.is_empty()));
        assert_eq!(s.own_subscriptions(), [], "once a stream");

        // Applied: the ACK names it, and the next stream resumes from it.
        let ack = s.own_ack(&resp(POD_ANNOTATIONS_TYPE, "a1", "n1"), Ok(()));
        assert_eq!(
            (ack.version_info.as_str(), ack.response_nonce.as_str()),
            ("a1", "n1")
        );
        assert!(ack.error_detail.is_none());
        let nack = s.own_ack(
            &resp(POD_ANNOTATIONS_TYPE, "a2", "n2"),
            Err("garbage".into()),
        );
        assert_eq!(nack.version_info, "a1", "a NACK keeps the applied version");
        assert_eq!(
            nack.error_detail.map(|e| e.message).as_deref(),
            Some("garbage")
        );

        // The withdrawal's versions are its own.
        let w = s.own_ack(&resp(WITHDRAWAL_TYPE, "w1", "n3"), Ok(()));
        assert_eq!(
            (w.type_url.as_str(), w.version_info.as_str()),
            (WITHDRAWAL_TYPE, "w1")
        );

        let replay = s.resume();
        assert!(replay[0].node.is_some());
        let own = s.own_subscriptions();
        let versions: Vec<&str> = own.iter().map(|r| r.version_info.as_str()).collect();
        assert_eq!(versions, ["a1", "w1"], "on the new stream");
    }

    #[test]
    fn a_withdrawal_is_none_or_one_message_or_refused_saying_why() {
        use envoy_types::pb::google::protobuf::Any;
        let one = Any {
            type_url: WITHDRAWAL_TYPE.into(),
            value: Withdrawal {
                expected: 3,
                confirmed: 2,
                pending: vec!["shop/web-1".into()],
                ..Default::default()
            }
            .encode_to_vec(),
        };
        let with = |resources: Vec<Any>| DiscoveryResponse {
            resources,
            ..resp(WITHDRAWAL_TYPE, "w1", "n1")
        };
        assert_eq!(withdrawal(&with(vec![])), Ok(Told::Absent));
        let Ok(Told::Withdrawn(p)) = withdrawal(&with(vec![one.clone()])) else {
            panic!("one withdrawal")
        };
        assert_eq!((p.expected, p.confirmed, p.pending_count()), (3, 2, 1));
        let garbage = Any {
            value: vec![0x0a, 0xff, 0xff],
            ..one.clone()
        };
        for (resources, why) in [
            (vec![one.clone(), one], "2 resources"),
            (vec![garbage], "does not decode"),
        ] {
            let e = withdrawal(&with(resources)).expect_err("refused");
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn pod_annotations_are_one_message_or_refused_saying_why() {
        use envoy_types::pb::google::protobuf::Any;
        let one = Any {
            type_url: POD_ANNOTATIONS_TYPE.into(),
            value: PodAnnotations {
                annotations: [("remora.dev/stop".to_string(), "true".to_string())].into(),
            }
            .encode_to_vec(),
        };
        let with = |resources: Vec<Any>| DiscoveryResponse {
            resources,
            ..resp(POD_ANNOTATIONS_TYPE, "a1", "n1")
        };
        assert_eq!(
            pod_annotations(&with(vec![one.clone()])),
            Ok(BTreeMap::from([("remora.dev/stop".into(), "true".into())]))
        );
        let garbage = Any {
            value: vec![0x0a, 0xff, 0xff],
            ..one.clone()
        };
        for (resources, why) in [
            (vec![], "0 resources"),
            (vec![one.clone(), one], "2 resources"),
            (vec![garbage], "do not decode"),
        ] {
            let e = pod_annotations(&with(resources)).expect_err("refused");
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn acks_and_nacks_are_told_by_the_nonce_sent_down() {
        let mut s = Session::default();
        let first = DiscoveryRequest {
            node: Some(node()),
            ..req(CLUSTER_TYPE, "", "", &[])
        };
        let (fwd, reply) = s.from_envoy(first.clone()).expect("ok");
        assert_eq!((fwd, reply), (first, Reply::Request));
        s.from_server(&resp(CLUSTER_TYPE, "v1", "n1"));
        let (_, reply) = s
            .from_envoy(req(CLUSTER_TYPE, "v1", "n1", &[]))
            .expect("ok");
        assert_eq!(
            reply,
            Reply::Ack {
                version: "v1".into()
            }
        );

        s.from_server(&resp(CLUSTER_TYPE, "v2", "n2"));
        // A reply to an older response is no ACK of the newest.
        let (_, reply) = s
            .from_envoy(req(CLUSTER_TYPE, "v1", "n1", &[]))
            .expect("ok");
        assert_eq!(reply, Reply::Request);
        let nack = DiscoveryRequest {
            error_detail: Some(RpcStatus {
                code: 3,
                message: "bad listener".into(),
                details: vec![],
            }),
            ..req(CLUSTER_TYPE, "v1", "n2", &[])
        };
        let (_, reply) = s.from_envoy(nack).expect("ok");
        assert_eq!(
            reply,
            Reply::Nack {
                version: "v1".into(),
                code: 3,
                message: "bad listener".into()
            }
        );
        // The same nonce on another type is no ACK of it.
        let (_, reply) = s.from_envoy(req(LISTENER_TYPE, "", "n2", &[])).expect("ok");
        assert_eq!(reply, Reply::Request);
    }

    #[test]
    fn resume_replays_the_latest_per_type_in_first_asked_order() {
        let mut s = Session::default();
        let first = DiscoveryRequest {
            node: Some(node()),
            ..req(CLUSTER_TYPE, "", "", &[])
        };
        s.from_envoy(first).expect("ok");
        s.from_server(&resp(CLUSTER_TYPE, "c1", "n1"));
        s.from_envoy(req(CLUSTER_TYPE, "c1", "n1", &[]))
            .expect("ok");
        s.from_envoy(req(LISTENER_TYPE, "", "", &[])).expect("ok");
        s.from_server(&resp(LISTENER_TYPE, "l1", "n2"));
        // Envoy NACKs l2: it keeps l1, and l1 is what the replay carries.
        s.from_server(&resp(LISTENER_TYPE, "l2", "n3"));
        let nack = DiscoveryRequest {
            error_detail: Some(RpcStatus {
                code: 3,
                message: "no".into(),
                details: vec![],
            }),
            ..req(LISTENER_TYPE, "l1", "n3", &[])
        };
        s.from_envoy(nack).expect("ok");
        let eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
        s.from_envoy(req(eds, "", "", &["a", "b"])).expect("ok");
        // Asked while the upstream is down: replaces the latest of its type.
        s.from_envoy(req(eds, "", "", &["a"])).expect("ok");

        let replay = s.resume();
        // (type, version, nonce, names, error detail?, node?)
        type Shape<'a> = (&'a str, &'a str, &'a str, Vec<String>, bool, bool);
        let shape: Vec<Shape> = replay
            .iter()
            .map(|r| {
                (
                    r.type_url.as_str(),
                    r.version_info.as_str(),
                    r.response_nonce.as_str(),
                    r.resource_names.clone(),
                    r.error_detail.is_some(),
                    r.node.is_some(),
                )
            })
            .collect();
        assert_eq!(
            shape,
            [
                (CLUSTER_TYPE, "c1", "", vec![], false, true),
                (LISTENER_TYPE, "l1", "", vec![], false, false),
                (eds, "", "", vec!["a".to_string()], false, false),
            ]
        );
        // The old stream's nonces mean nothing on the new one.
        let (fwd, reply) = s
            .from_envoy(req(CLUSTER_TYPE, "c1", "n1", &[]))
            .expect("ok");
        assert_eq!(reply, Reply::Request);
        assert!(fwd.node.is_none(), "the replay carried the node already");
        s.from_server(&resp(CLUSTER_TYPE, "c2", "x1"));
        let (_, reply) = s
            .from_envoy(req(CLUSTER_TYPE, "c2", "x1", &[]))
            .expect("ok");
        assert_eq!(
            reply,
            Reply::Ack {
                version: "c2".into()
            }
        );
    }

    #[test]
    fn the_node_reaches_each_upstream_once_and_bad_requests_are_refused() {
        let mut s = Session::default();
        // Nothing asked yet: nothing to replay, and the first request
        // forwarded (which carries the node) is the new stream's first.
        assert!(s.resume().is_empty());
        let (fwd, _) = s
            .from_envoy(DiscoveryRequest {
                node: Some(node()),
                ..req(CLUSTER_TYPE, "", "", &[])
            })
            .expect("ok");
        assert!(fwd.node.is_some());
        let (fwd, _) = s.from_envoy(req(LISTENER_TYPE, "", "", &[])).expect("ok");
        assert!(fwd.node.is_none());

        assert_eq!(
            s.from_envoy(req("", "", "", &[])),
            Err(SessionError::NoTypeUrl)
        );
        for i in 0..MAX_TYPES - 2 {
            s.from_envoy(req(&format!("t/{i}"), "", "", &[]))
                .expect("ok");
        }
        assert_eq!(
            s.from_envoy(req("t/one-too-many", "", "", &[])),
            Err(SessionError::TooManyTypes)
        );
        // A known type still goes through.
        assert!(s.from_envoy(req("t/0", "", "", &[])).is_ok());
        // A response of a type Envoy never asked for is not tracked.
        s.from_server(&resp("t/never", "v", "n"));
        assert!(!s.sent.contains_key("t/never"));
    }
}
