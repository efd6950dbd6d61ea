//! What the proxy remembers of one delta Envoy stream, apart from any
//! connection: pure, as [`super::session`] is for state of the world (whose
//! [`Reply`] and [`SessionError`] it shares), and fuzzed with it (fuzz/,
//! target `xds_response`).
//!
//! # What is replayed on a new upstream stream
//!
//! Delta requests are differences, so the proxy keeps, per type URL (in the
//! order Envoy first asked), what they add up to:
//! - the subscription: the wildcard (a first request naming nothing, or
//!   `*`) and the names Envoy subscribed and has not unsubscribed;
//! - what Envoy holds: each resource's version as of the responses Envoy
//!   ACKed (a NACKed response changed nothing; a response not answered yet
//!   is applied when its ACK comes, whichever stream it came on).
//!
//! A new upstream stream gets, per type, one request subscribing to that
//! subscription with `initial_resource_versions` set to what Envoy holds,
//! so the server sends only what changed meanwhile (and removes what went),
//! and nothing when nothing did; `node` on the first. Requests Envoy sends
//! while no upstream stream is up change this state, which the replay then
//! carries.
//!
//! # The agent's own subscriptions
//!
//! As with state of the world: [`DeltaSession::own_subscriptions`] once per
//! upstream stream after the node, with the versions of the pod's
//! annotations and withdrawal the agent holds; responses of those types
//! never reach Envoy.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prost::Message as _;
use remora_proto::remora::v1::{PodAnnotations, Withdrawal};

use super::session::{MAX_TYPES, OWN_TYPES, POD_ANNOTATIONS_TYPE, Reply, SessionError};
use crate::withdrawal::Told;

/// The wildcard subscription's name.
pub const WILDCARD: &str = "*";
/// The most names one type may have subscribed: Envoy names the clusters'
/// load assignments, a few per Service the pod declared.
pub const MAX_NAMES: usize = 4096;
/// Responses of one type awaiting Envoy's answer that are remembered.
pub const MAX_PENDING: usize = 16;

/// What a response changes: name → the new version, `None` for removed.
type Changes = Vec<(String, Option<String>)>;

#[derive(Debug, Default)]
struct TypeState {
    wildcard: bool,
    names: BTreeSet<String>,
    /// What Envoy holds (ACKed): name → version.
    held: BTreeMap<String, String>,
    /// Responses sent down and not answered yet: nonce, the server's
    /// version of the type, what they change.
    pending: VecDeque<(String, String, Changes)>,
}

impl TypeState {
    fn apply(held: &mut BTreeMap<String, String>, changes: Changes) {
        for (name, version) in changes {
            match version {
                Some(v) => held.insert(name, v),
                None => held.remove(&name),
            };
        }
    }
}

fn changes(resp: &DeltaDiscoveryResponse) -> Changes {
    resp.resources
        .iter()
        .map(|r| (r.name.clone(), Some(r.version.clone())))
        .chain(resp.removed_resources.iter().map(|n| (n.clone(), None)))
        .collect()
}

#[derive(Debug, Default)]
pub struct DeltaSession {
    node: Option<Node>,
    /// Type URLs in the order Envoy first asked for them.
    order: Vec<String>,
    types: HashMap<String, TypeState>,
    /// Whether the current upstream stream has had a node yet.
    node_sent: bool,
    /// Whether the agent's own subscriptions went up on the current stream.
    own_sent: bool,
    /// Per own type, its resources as the agent last applied them.
    own_held: HashMap<&'static str, BTreeMap<String, String>>,
}

impl DeltaSession {
    /// A request from Envoy: its changes kept, and returned (to forward,
    /// unchanged but for a node the new upstream has not seen) with what it
    /// says about the response it answers.
    pub fn from_envoy(
        &mut self,
        mut req: DeltaDiscoveryRequest,
    ) -> Result<(DeltaDiscoveryRequest, Reply), SessionError> {
        if req.type_url.is_empty() {
            return Err(SessionError::NoTypeUrl);
        }
        let first = !self.types.contains_key(&req.type_url);
        if first && self.order.len() >= MAX_TYPES {
            return Err(SessionError::TooManyTypes);
        }
        let mut state = self.types.remove(&req.type_url).unwrap_or_default();
        let result = Self::track(&mut state, &req, first);
        self.types.insert(req.type_url.clone(), state);
        if first {
            self.order.push(req.type_url.clone());
        }
        let reply = result?;
        if self.node.is_none() {
            self.node.clone_from(&req.node);
        }
        if !self.node_sent && req.node.is_none() {
            req.node.clone_from(&self.node);
        }
        self.node_sent |= req.node.is_some();
        Ok((req, reply))
    }

    fn track(
        state: &mut TypeState,
        req: &DeltaDiscoveryRequest,
        first: bool,
    ) -> Result<Reply, SessionError> {
        if first {
            state.wildcard = req.resource_names_subscribe.is_empty();
            // What Envoy says it holds, when it (re)connects to the proxy.
            state.held = req
                .initial_resource_versions
                .iter()
                .take(MAX_NAMES)
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect();
        }
        for n in &req.resource_names_subscribe {
            if n == WILDCARD {
                state.wildcard = true;
            } else if !state.names.contains(n) {
                if state.names.len() >= MAX_NAMES {
                    return Err(SessionError::TooManyNames(MAX_NAMES));
                }
                state.names.insert(n.clone());
            }
        }
        for n in &req.resource_names_unsubscribe {
            if n == WILDCARD {
                state.wildcard = false;
                let names = &state.names;
                state.held.retain(|k, _| names.contains(k));
            } else if state.names.remove(n) && !state.wildcard {
                state.held.remove(n);
            }
        }
        if req.response_nonce.is_empty() {
            return Ok(Reply::Request);
        }
        let Some(i) = state
            .pending
            .iter()
            .position(|(n, _, _)| *n == req.response_nonce)
        else {
            return Ok(Reply::Request);
        };
        let Some((_, version, changes)) = state.pending.remove(i) else {
            return Ok(Reply::Request);
        };
        Ok(match &req.error_detail {
            None => {
                TypeState::apply(&mut state.held, changes);
                Reply::Ack { version }
            }
            Some(e) => Reply::Nack {
                version,
                code: e.code,
                message: e.message.clone(),
            },
        })
    }

    /// A response from the server, about to go down to Envoy.
    pub fn from_server(&mut self, resp: &DeltaDiscoveryResponse) {
        // A type Envoy never asked for: Envoy will ignore it; nothing to track.
        if let Some(state) = self.types.get_mut(&resp.type_url) {
            state.pending.push_back((
                resp.nonce.clone(),
                resp.system_version_info.clone(),
                changes(resp),
            ));
            if state.pending.len() > MAX_PENDING {
                state.pending.pop_front();
            }
        }
    }

    /// What Envoy holds of `type_url` (name → version), as the proxy knows.
    pub fn held(&self, type_url: &str) -> Option<&BTreeMap<String, String>> {
        Some(&self.types.get(type_url)?.held)
    }

    /// The agent's subscriptions to its own types ([`OWN_TYPES`]), once
    /// per upstream stream, as soon as the node has gone up on it.
    pub fn own_subscriptions(&mut self) -> Vec<DeltaDiscoveryRequest> {
        if self.own_sent || !self.node_sent {
            return Vec::new();
        }
        self.own_sent = true;
        OWN_TYPES
            .iter()
            .map(|t| DeltaDiscoveryRequest {
                type_url: (*t).into(),
                initial_resource_versions: self
                    .own_held
                    .get(t)
                    .map(|h| h.iter().map(|(n, v)| (n.clone(), v.clone())).collect())
                    .unwrap_or_default(),
                ..Default::default()
            })
            .collect()
    }

    /// A response of one of the agent's own types: the reply to send up,
    /// an ACK when `applied` (what it carries is now the agent's), else a
    /// NACK.
    pub fn own_ack(
        &mut self,
        resp: &DeltaDiscoveryResponse,
        applied: Result<(), String>,
    ) -> DeltaDiscoveryRequest {
        let own = OWN_TYPES
            .iter()
            .find(|t| **t == resp.type_url)
            .copied()
            .unwrap_or(POD_ANNOTATIONS_TYPE);
        let error_detail = match applied {
            Ok(()) => {
                TypeState::apply(self.own_held.entry(own).or_default(), changes(resp));
                None
            }
            Err(message) => Some(RpcStatus {
                code: tonic::Code::InvalidArgument as i32,
                message,
                details: Vec::new(),
            }),
        };
        DeltaDiscoveryRequest {
            type_url: own.into(),
            response_nonce: resp.nonce.clone(),
            error_detail,
            ..Default::default()
        }
    }

    /// A new upstream stream starts: the requests that resume it (see the
    /// module docs).
    pub fn resume(&mut self) -> Vec<DeltaDiscoveryRequest> {
        self.node_sent = false;
        self.own_sent = false;
        let mut out: Vec<DeltaDiscoveryRequest> = self
            .order
            .iter()
            .filter_map(|t| Some((t, self.types.get(t)?)))
            .map(|(t, s)| {
                let mut subscribe: Vec<String> = s.names.iter().cloned().collect();
                // Named alongside other names; alone, the legacy wildcard
                // (nothing named), which every server knows.
                if s.wildcard && !subscribe.is_empty() {
                    subscribe.push(WILDCARD.into());
                }
                DeltaDiscoveryRequest {
                    type_url: t.clone(),
                    resource_names_subscribe: subscribe,
                    initial_resource_versions: s
                        .held
                        .iter()
                        .map(|(n, v)| (n.clone(), v.clone()))
                        .collect(),
                    ..Default::default()
                }
            })
            .collect();
        if let Some(first) = out.first_mut() {
            first.node.clone_from(&self.node);
            self.node_sent = first.node.is_some();
        }
        out
    }
}

/// The pod's annotations a delta response of [`POD_ANNOTATIONS_TYPE`]
/// carries: `None` when it carries none (nothing changed), else exactly one
/// `remora.v1.PodAnnotations`, or why not (the NACK's message).
pub fn pod_annotations(
    resp: &DeltaDiscoveryResponse,
) -> Result<Option<BTreeMap<String, String>>, String> {
    let any = match resp.resources.as_slice() {
        [] => return Ok(None),
        [one] => one
            .resource
            .as_ref()
            .ok_or("the pod's annotations resource is empty")?,
        more => {
            return Err(format!(
                "{} resources of the pod's annotations, not 1",
                more.len()
            ));
        }
    };
    let msg = PodAnnotations::decode(any.value.as_slice())
        .map_err(|e| format!("the pod's annotations do not decode: {e}"))?;
    Ok(Some(msg.annotations.into_iter().collect()))
}

/// The pod's withdrawal a delta response of
/// [`super::session::WITHDRAWAL_TYPE`] carries: removed (absent: the pod is
/// not withdrawn), nothing (unchanged), or exactly one
/// `remora.v1.Withdrawal`, or why not (the NACK's message).
pub fn withdrawal(resp: &DeltaDiscoveryResponse) -> Result<Told, String> {
    let any = match resp.resources.as_slice() {
        [] if resp.removed_resources.is_empty() => return Ok(Told::Unchanged),
        [] => return Ok(Told::Absent),
        [one] => one
            .resource
            .as_ref()
            .ok_or("the pod's withdrawal resource is empty")?,
        more => {
            return Err(format!(
                "{} resources of the pod's withdrawal, not 1",
                more.len()
            ));
        }
    };
    Withdrawal::decode(any.value.as_slice())
        .map(|w| Told::Withdrawn(w.into()))
        .map_err(|e| format!("the pod's withdrawal does not decode: {e}"))
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::service::discovery::v3::Resource;

    use super::*;
    use crate::xds::session::{CLUSTER_TYPE, LISTENER_TYPE};

    const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

    fn req(ty: &str, sub: &[&str], unsub: &[&str], nonce: &str) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: ty.into(),
            resource_names_subscribe: sub.iter().map(|s| s.to_string()).collect(),
            resource_names_unsubscribe: unsub.iter().map(|s| s.to_string()).collect(),
            response_nonce: nonce.into(),
            ..Default::default()
        }
    }

    fn resp(
        ty: &str,
        nonce: &str,
        set: &[(&str, &str)],
        removed: &[&str],
    ) -> DeltaDiscoveryResponse {
        DeltaDiscoveryResponse {
            type_url: ty.into(),
            system_version_info: format!("sv-{nonce}"),
            nonce: nonce.into(),
            resources: set
                .iter()
                .map(|(n, v)| Resource {
                    name: n.to_string(),
                    version: v.to_string(),
                    ..Default::default()
                })
                .collect(),
            removed_resources: removed.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn node() -> Node {
        Node {
            id: "sidecar~1~p.ns~ns.svc.cluster.local".into(),
            ..Default::default()
        }
    }

    fn held(s: &DeltaSession, t: &str) -> Vec<(String, String)> {
        s.held(t)
            .map(|h| h.iter().map(|(n, v)| (n.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn what_envoy_holds_follows_its_acks_not_its_nacks() {
        let mut s = DeltaSession::default();
        s.from_envoy(DeltaDiscoveryRequest {
            node: Some(node()),
            ..req(CLUSTER_TYPE, &[], &[], "")
        })
        .expect("ok");
        s.from_server(&resp(CLUSTER_TYPE, "n1", &[("a", "1"), ("b", "1")], &[]));
        s.from_server(&resp(CLUSTER_TYPE, "n2", &[("a", "2")], &["b"]));
        // Not answered yet: Envoy holds nothing so far.
        assert!(held(&s, CLUSTER_TYPE).is_empty());
        let (_, r) = s.from_envoy(req(CLUSTER_TYPE, &[], &[], "n1")).expect("ok");
        assert_eq!(
            r,
            Reply::Ack {
                version: "sv-n1".into()
            }
        );
        assert_eq!(held(&s, CLUSTER_TYPE), pairs(&[("a", "1"), ("b", "1")]));
        let (_, r) = s
            .from_envoy(DeltaDiscoveryRequest {
                error_detail: Some(RpcStatus {
                    code: 3,
                    message: "bad a".into(),
                    details: vec![],
                }),
                ..req(CLUSTER_TYPE, &[], &[], "n2")
            })
            .expect("ok");
        assert_eq!(
            r,
            Reply::Nack {
                version: "sv-n2".into(),
                code: 3,
                message: "bad a".into()
            }
        );
        assert_eq!(
            held(&s, CLUSTER_TYPE),
            pairs(&[("a", "1"), ("b", "1")]),
            "unchanged by a NACK"
        );
        // An answer to a response this proxy did not send down.
        let (_, r) = s.from_envoy(req(CLUSTER_TYPE, &[], &[], "n2")).expect("ok");
        assert_eq!(r, Reply::Request);
        let (_, r) = s
            .from_envoy(req(LISTENER_TYPE, &[], &[], "n1"))
            .expect("ok");
        assert_eq!(r, Reply::Request, "a nonce of another type");
    }

    #[test]
    fn resume_subscribes_as_envoy_did_naming_what_it_holds() {
        let mut s = DeltaSession::default();
        s.from_envoy(DeltaDiscoveryRequest {
            node: Some(node()),
            ..req(CLUSTER_TYPE, &[], &[], "")
        })
        .expect("ok");
        s.from_server(&resp(CLUSTER_TYPE, "n1", &[("a", "1")], &[]));
        s.from_envoy(req(CLUSTER_TYPE, &[], &[], "n1")).expect("ok");
        s.from_envoy(req(EDS, &["a", "b"], &[], "")).expect("ok");
        s.from_server(&resp(EDS, "n2", &[("a", "e1"), ("b", "e1")], &[]));
        s.from_envoy(req(EDS, &[], &[], "n2")).expect("ok");
        // While the upstream is down, Envoy drops b and asks for c.
        s.from_envoy(req(EDS, &["c"], &["b"], "")).expect("ok");
        s.from_envoy(req(LISTENER_TYPE, &[], &[], "")).expect("ok");

        let replay = s.resume();
        // (type, names subscribed, versions held, node?)
        type Shape<'a> = (&'a str, Vec<String>, Vec<(String, String)>, bool);
        let shape: Vec<Shape> = replay
            .iter()
            .map(|r| {
                let mut held: Vec<(String, String)> = r
                    .initial_resource_versions
                    .iter()
                    .map(|(n, v)| (n.clone(), v.clone()))
                    .collect();
                held.sort();
                (
                    r.type_url.as_str(),
                    r.resource_names_subscribe.clone(),
                    held,
                    r.node.is_some(),
                )
            })
            .collect();
        assert_eq!(
            shape,
            [
                (CLUSTER_TYPE, vec![], pairs(&[("a", "1")]), true),
                (
                    EDS,
                    vec!["a".to_string(), "c".to_string()],
                    pairs(&[("a", "e1")]),
                    false
                ),
                (LISTENER_TYPE, vec![], vec![], false),
            ]
        );
        assert!(
            replay
                .iter()
                .all(|r| r.response_nonce.is_empty() && r.error_detail.is_none())
        );
        // The agent's own subscriptions follow, once.
        assert_eq!(s.own_subscriptions().len(), OWN_TYPES.len());
        assert!(s.own_subscriptions().is_empty());
        // Envoy ACKs a response of the old stream late: it is applied.
        s.from_server(&resp(EDS, "x1", &[("c", "e1")], &[]));
        let (fwd, r) = s.from_envoy(req(EDS, &[], &[], "x1")).expect("ok");
        assert!(matches!(r, Reply::Ack { .. }));
        assert!(fwd.node.is_none(), "the replay carried the node");
        assert_eq!(held(&s, EDS), pairs(&[("a", "e1"), ("c", "e1")]));
    }

    #[test]
    fn an_explicit_wildcard_is_replayed_beside_the_names() {
        let mut s = DeltaSession::default();
        s.from_envoy(req(CLUSTER_TYPE, &["x"], &[], ""))
            .expect("ok");
        assert_eq!(s.resume()[0].resource_names_subscribe, ["x"]);
        s.from_envoy(req(CLUSTER_TYPE, &["*"], &[], ""))
            .expect("ok");
        assert_eq!(s.resume()[0].resource_names_subscribe, ["x", "*"]);
        s.from_envoy(req(CLUSTER_TYPE, &[], &["*", "x"], ""))
            .expect("ok");
        assert!(
            s.resume()[0].resource_names_subscribe.is_empty() && !s.types[CLUSTER_TYPE].wildcard
        );
    }

    #[test]
    fn the_own_subscriptions_resume_from_what_was_applied() {
        use crate::xds::session::WITHDRAWAL_TYPE;
        let mut s = DeltaSession::default();
        assert!(s.own_subscriptions().is_empty(), "no node yet");
        s.from_envoy(DeltaDiscoveryRequest {
            node: Some(node()),
            ..req(CLUSTER_TYPE, &[], &[], "")
        })
        .expect("ok");
        let own = s.own_subscriptions();
        let types: Vec<&str> = own.iter().map(|r| r.type_url.as_str()).collect();
        assert_eq!(types, OWN_TYPES, "after the node");
        assert!(own.iter().all(|r| r.initial_resource_versions.is_empty()));
        let ack = s.own_ack(
            &resp(POD_ANNOTATIONS_TYPE, "o1", &[("ns/p", "a1")], &[]),
            Ok(()),
        );
        assert_eq!(ack.response_nonce, "o1");
        assert!(ack.error_detail.is_none());
        let nack = s.own_ack(
            &resp(POD_ANNOTATIONS_TYPE, "o2", &[("ns/p", "a2")], &[]),
            Err("garbage".into()),
        );
        assert_eq!(
            nack.error_detail.map(|e| e.message).as_deref(),
            Some("garbage")
        );
        let w = s.own_ack(&resp(WITHDRAWAL_TYPE, "o3", &[("ns/p", "w1")], &[]), Ok(()));
        assert_eq!(w.type_url, WITHDRAWAL_TYPE);
        s.resume();
        let own = s.own_subscriptions();
        let held: Vec<Option<&str>> = own
            .iter()
            .map(|r| r.initial_resource_versions.get("ns/p").map(String::as_str))
            .collect();
        assert_eq!(held, [Some("a1"), Some("w1")], "each type its own");
        // Removed: absent; nothing: unchanged.
        let removed = resp(WITHDRAWAL_TYPE, "o4", &[], &["ns/p"]);
        assert_eq!(withdrawal(&removed), Ok(Told::Absent));
        let nothing = resp(WITHDRAWAL_TYPE, "o5", &[], &[]);
        assert_eq!(withdrawal(&nothing), Ok(Told::Unchanged));
        s.own_ack(&removed, Ok(()));
        s.resume();
        let own = s.own_subscriptions();
        assert!(own[1].initial_resource_versions.is_empty(), "removed");
    }

    #[test]
    fn bad_requests_are_refused_and_state_stays_bounded() {
        let mut s = DeltaSession::default();
        assert_eq!(
            s.from_envoy(req("", &[], &[], "")).map(|_| ()),
            Err(SessionError::NoTypeUrl)
        );
        let names: Vec<String> = (0..=MAX_NAMES).map(|i| format!("n{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        assert_eq!(
            s.from_envoy(req(EDS, &refs, &[], "")).map(|_| ()),
            Err(SessionError::TooManyNames(MAX_NAMES))
        );
        for i in 0..MAX_TYPES - 1 {
            s.from_envoy(req(&format!("t/{i}"), &[], &[], ""))
                .expect("ok");
        }
        assert_eq!(
            s.from_envoy(req("t/one-too-many", &[], &[], ""))
                .map(|_| ()),
            Err(SessionError::TooManyTypes)
        );
        for i in 0..MAX_PENDING + 5 {
            s.from_server(&resp(EDS, &format!("n{i}"), &[], &[]));
        }
        assert_eq!(s.types[EDS].pending.len(), MAX_PENDING);
    }

    #[test]
    fn pod_annotations_are_one_message_none_or_refused_saying_why() {
        use envoy_types::pb::google::protobuf::Any;
        let one = Any {
            type_url: POD_ANNOTATIONS_TYPE.into(),
            value: PodAnnotations {
                annotations: [("remora.dev/stop".to_string(), "true".to_string())].into(),
            }
            .encode_to_vec(),
        };
        let with = |rs: Vec<Option<Any>>| DeltaDiscoveryResponse {
            resources: rs
                .into_iter()
                .map(|resource| Resource {
                    name: "ns/p".into(),
                    resource,
                    ..Default::default()
                })
                .collect(),
            ..resp(POD_ANNOTATIONS_TYPE, "o1", &[], &[])
        };
        assert_eq!(pod_annotations(&with(vec![])), Ok(None));
        assert_eq!(
            pod_annotations(&with(vec![Some(one.clone())])),
            Ok(Some(BTreeMap::from([(
                "remora.dev/stop".into(),
                "true".into()
            )])))
        );
        let garbage = Any {
            value: vec![0x0a, 0xff, 0xff],
            ..one.clone()
        };
        for (rs, why) in [
            (vec![None], "empty"),
            (vec![Some(one.clone()), Some(one)], "2 resources"),
            (vec![Some(garbage)], "do not decode"),
        ] {
            let e = pod_annotations(&with(rs)).expect_err("refused");
            assert!(e.contains(why), "{e}");
        }
    }
}
