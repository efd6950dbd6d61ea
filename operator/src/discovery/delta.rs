//! Delta (incremental) xDS for one proxy's stream: what the server
//! remembers and what each request does to it, pure as [`super::session`]
//! is (which holds the parts both share: the types served, nonces, replies,
//! the NACK detail's bound), and fuzzed the same way (fuzz/, target
//! `discovery_delta`).
//!
//! Per type (the agent's pod annotations, CDS, EDS, LDS):
//! - the subscription is a wildcard (every resource of the proxy's scope),
//!   named resources, or both: a first request of a type that subscribes to
//!   nothing is a wildcard (as Envoy asks for CDS and LDS), `*` subscribes
//!   to or unsubscribes from it, other names are subscribed and
//!   unsubscribed one by one (EDS). At most [`MAX_NAMES`] names of at most
//!   [`MAX_NAME_BYTES`] each: a stream's memory stays bounded however many
//!   requests it sends ([`SessionError::TooManyNames`] ends it otherwise);
//! - each resource has its own version ([`super::resources::Typed::versions`],
//!   a digest of its encoding); the session keeps which version of each the
//!   proxy holds, and a response carries only the resources whose version
//!   the proxy does not hold and, in `removed_resources`, those it holds
//!   that left its subscription or its scope;
//! - `initial_resource_versions` on a stream's first request of a type is
//!   what the proxy holds already (a reconnect): only what differs is sent,
//!   and nothing at all when nothing does ([`Reply::Resumed`]);
//! - each response has a nonce; a request naming one of the last
//!   [`MAX_PENDING`] sent of its type ACKs it or, with an `error_detail`,
//!   NACKs it (reported as the state-of-the-world NACK is, detail bounded);
//!   any other nonce is [`Reply::Stale`]. Until the last one sent of a type is
//!   answered, the stream is awaiting, as a state-of-the-world one is
//!   (an older one may go unanswered: Envoy answers in order); Unlike state of the world, a
//!   stale request's subscription changes still apply: they are
//!   differences, and one lost would never come again;
//! - what is sent counts as held once sent: after a NACK nothing is re-sent
//!   until it changes (Envoy keeps its last good configuration, as with
//!   state of the world);
//! - names outside the proxy's scope are never returned, only counted.
//!
//! A first request of a type is answered even when nothing is to be sent
//! (Envoy waits for a first response of each type before it is ready),
//! and so is a request that subscribes to new names; other requests are
//! answered only when something changed.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
};

use super::resources::{self, Snapshot};
use super::session::{
    ByType, MAX_NACK_DETAIL, Nonces, Outcome, Push, Reply, SessionError, StreamSession, bounded,
    served_type,
};

/// The wildcard subscription's name.
pub const WILDCARD: &str = "*";
/// The most names one type may have subscribed (or held, on a resume): a
/// proxy's scope is the few Services it declared, far below this.
pub const MAX_NAMES: usize = 4096;
/// The longest name (or version) taken: the server's names are a Service
/// host and a port, under 300 bytes.
pub const MAX_NAME_BYTES: usize = 1024;
/// Responses of one type awaiting their ACK that are remembered: the
/// stream's queue holds fewer, so an older one was answered or lost.
pub const MAX_PENDING: usize = 16;
// The withdrawal tracker remembers as many EDS sends per stream.
const _: () = assert!(MAX_PENDING == super::withdrawal::MAX_UNANSWERED);

/// One type's state on one delta stream.
#[derive(Debug, Default)]
struct TypeState {
    wildcard: bool,
    /// Names subscribed one by one.
    names: BTreeSet<String>,
    /// What the proxy holds, as far as this stream knows: name → version.
    held: BTreeMap<String, String>,
    /// Responses sent and not answered yet: (nonce, the type's version).
    pending: VecDeque<(String, String)>,
    /// The last response sent has not been answered yet (older ones may
    /// stay unanswered: Envoy answers in order, so it applied them).
    unanswered: bool,
    acked: Option<String>,
    /// The type's version `held` was last brought to, the subscription
    /// unchanged since: nothing to compare while it holds.
    synced: Option<String>,
    /// A response is owed even if nothing is to be sent.
    owed: bool,
}

/// One proxy's delta stream, apart from its connection.
#[derive(Debug)]
pub struct DeltaSession {
    types: ByType<TypeState>,
    nonces: Nonces,
}

impl DeltaSession {
    /// A new stream whose nonces start with `nonce_prefix` (random per
    /// stream, as [`super::session::Session::new`]'s).
    pub fn new(nonce_prefix: impl Into<String>) -> Self {
        Self {
            types: ByType::default(),
            nonces: Nonces::new(nonce_prefix),
        }
    }

    /// The version (the type's) the proxy last ACKed of type `t`.
    pub fn acked(&self, t: &str) -> Option<&str> {
        self.types.get(t)?.acked.as_deref()
    }

    /// What the proxy holds of type `t` (name → version), as far as this
    /// stream knows.
    pub fn held(&self, t: &str) -> Option<&BTreeMap<String, String>> {
        Some(&self.types.get(t)?.held)
    }

    /// A request from the proxy, against the proxy's current `snapshot`.
    pub fn on_request(
        &mut self,
        req: DeltaDiscoveryRequest,
        snapshot: &Snapshot,
    ) -> Result<Outcome<DeltaDiscoveryResponse>, SessionError> {
        let t = served_type(&req.type_url)?;
        let first = !self.types.contains_key(t);
        let state = self.types.or_default(t);
        let too_many = SessionError::TooManyNames {
            max: MAX_NAMES,
            max_len: MAX_NAME_BYTES,
        };

        let mut reply = Reply::Request;
        if !req.response_nonce.is_empty() {
            let at = state
                .pending
                .iter()
                .position(|(n, _)| *n == req.response_nonce);
            if at.is_some_and(|i| i + 1 == state.pending.len()) {
                state.unanswered = false;
            }
            reply = match at.and_then(|i| state.pending.remove(i)) {
                Some((_, version)) => match &req.error_detail {
                    Some(e) => Reply::Nack {
                        version,
                        detail: bounded(&e.message, MAX_NACK_DETAIL),
                    },
                    None => {
                        state.acked = Some(version.clone());
                        Reply::Ack { version }
                    }
                },
                None => Reply::Stale,
            };
            if state.pending.is_empty() {
                // All answered, as is usual between pushes: its room goes
                // back rather than staying with every idle stream.
                state.pending = VecDeque::new();
            }
        }

        let mut subscribed = false;
        let mut changed = false;
        if first && req.resource_names_subscribe.is_empty() {
            state.wildcard = true;
            subscribed = true;
        }
        for n in req.resource_names_subscribe {
            if n == WILDCARD {
                subscribed |= !std::mem::replace(&mut state.wildcard, true);
            } else if !state.names.contains(&n) {
                if n.len() > MAX_NAME_BYTES || state.names.len() >= MAX_NAMES {
                    return Err(too_many);
                }
                state.names.insert(n);
                subscribed = true;
            }
        }
        for n in req.resource_names_unsubscribe {
            if n == WILDCARD {
                if std::mem::replace(&mut state.wildcard, false) {
                    // The proxy drops what only the wildcard gave it.
                    let names = &state.names;
                    state.held.retain(|k, _| names.contains(k));
                    changed = true;
                }
            } else if state.names.remove(&n) {
                if !state.wildcard {
                    state.held.remove(&n);
                }
                changed = true;
            }
        }

        let resuming = first && !req.initial_resource_versions.is_empty();
        if resuming {
            if req.initial_resource_versions.len() > MAX_NAMES
                || req
                    .initial_resource_versions
                    .iter()
                    .any(|(n, v)| n.len() > MAX_NAME_BYTES || v.len() > MAX_NAME_BYTES)
            {
                return Err(too_many);
            }
            state.held = req.initial_resource_versions.into_iter().collect();
        }
        if subscribed || changed || resuming {
            state.synced = None;
        }
        // A first request is answered, and so is a new name; not a resume,
        // which is answered only with what differs.
        state.owed |= !resuming && (first || subscribed);

        let push = self.diff(t, snapshot);
        if resuming && push.is_none() {
            reply = Reply::Resumed {
                version: snapshot
                    .of_type(t)
                    .map(|typed| typed.version.clone())
                    .unwrap_or_default(),
            };
        }
        Ok(Outcome {
            type_url: t,
            reply,
            push,
        })
    }

    /// The proxy's resources changed to `snapshot`: what to send, for the
    /// types it subscribed to where it holds other than `snapshot`, in
    /// [`resources::TYPES`] order.
    pub fn push(&mut self, snapshot: &Snapshot) -> Vec<Push<DeltaDiscoveryResponse>> {
        resources::TYPES
            .into_iter()
            .filter_map(|t| self.diff(t, snapshot))
            .collect()
    }

    /// Type `t`'s response: what the proxy should hold of `snapshot` and
    /// does not, and what it holds and should not; `None` when that is
    /// nothing and no response is owed.
    fn diff(
        &mut self,
        t: &'static str,
        snapshot: &Snapshot,
    ) -> Option<Push<DeltaDiscoveryResponse>> {
        let typed = snapshot.of_type(t)?;
        let state = self.types.get_mut(t)?;
        if !state.owed && state.synced.as_deref() == Some(typed.version.as_str()) {
            return None;
        }
        state.synced = Some(typed.version.clone());
        let mut out_of_scope = 0;
        let mut wanted: BTreeMap<&str, &str> = BTreeMap::new();
        if state.wildcard {
            wanted.extend(typed.versions.iter().map(|(n, v)| (n.as_str(), v.as_str())));
        }
        for n in &state.names {
            match typed.versions.get_key_value(n) {
                Some((n, v)) => {
                    wanted.insert(n, v);
                }
                None => out_of_scope += 1,
            }
        }
        let resources: Vec<Resource> = wanted
            .iter()
            .filter(|(n, v)| state.held.get(**n).map(String::as_str) != Some(**v))
            .filter_map(|(n, v)| {
                Some(Resource {
                    name: (*n).to_string(),
                    version: (*v).to_string(),
                    resource: Some(typed.resources.get(*n)?.clone()),
                    ..Default::default()
                })
            })
            .collect();
        let removed: Vec<String> = state
            .held
            .keys()
            .filter(|n| !wanted.contains_key(n.as_str()))
            .cloned()
            .collect();
        if !std::mem::take(&mut state.owed) && resources.is_empty() && removed.is_empty() {
            return None;
        }
        for r in &resources {
            state.held.insert(r.name.clone(), r.version.clone());
        }
        for n in &removed {
            state.held.remove(n);
        }
        let nonce = self.nonces.fresh();
        state
            .pending
            .push_back((nonce.clone(), typed.version.clone()));
        state.unanswered = true;
        if state.pending.len() > MAX_PENDING {
            state.pending.pop_front();
        }
        Some(Push {
            type_url: t,
            response: DeltaDiscoveryResponse {
                system_version_info: typed.version.clone(),
                resources,
                type_url: t.to_string(),
                removed_resources: removed,
                nonce,
                ..Default::default()
            },
            out_of_scope,
        })
    }
}

impl StreamSession for DeltaSession {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;

    fn on_request(
        &mut self,
        req: DeltaDiscoveryRequest,
        snapshot: &Snapshot,
    ) -> Result<Outcome<DeltaDiscoveryResponse>, SessionError> {
        DeltaSession::on_request(self, req, snapshot)
    }

    fn push(&mut self, snapshot: &Snapshot) -> Vec<Push<DeltaDiscoveryResponse>> {
        DeltaSession::push(self, snapshot)
    }

    fn holds(&self, t: &str, name: &str) -> bool {
        self.held(t).is_some_and(|h| h.contains_key(name))
    }

    fn awaiting(&self) -> bool {
        self.types.values().any(|s| s.unanswered)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use envoy_types::pb::google::protobuf::Any;
    use envoy_types::pb::google::rpc::Status as RpcStatus;

    use super::*;
    use crate::discovery::resources::{CLUSTER, ENDPOINTS, LISTENER, POD_ANNOTATIONS, Typed};

    fn any(v: &str) -> Any {
        Any {
            type_url: CLUSTER.into(),
            value: v.as_bytes().to_vec(),
        }
    }

    /// Clusters and load assignments named `name` holding `content`.
    fn snapshot(clusters: &[(&str, &str)], eds: &[(&str, &str)]) -> Snapshot {
        let typed = |rs: &[(&str, &str)]| {
            Arc::new(Typed::new(
                rs.iter().map(|(n, c)| (n.to_string(), any(c))).collect(),
            ))
        };
        Snapshot {
            clusters: typed(clusters),
            endpoints: typed(eds),
            ..Snapshot::default()
        }
    }

    fn req(t: &str, sub: &[&str], unsub: &[&str], nonce: &str) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: t.into(),
            resource_names_subscribe: sub.iter().map(|n| n.to_string()).collect(),
            resource_names_unsubscribe: unsub.iter().map(|n| n.to_string()).collect(),
            response_nonce: nonce.into(),
            ..Default::default()
        }
    }

    fn nack(t: &str, nonce: &str, detail: &str) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            error_detail: Some(RpcStatus {
                code: 3,
                message: detail.into(),
                details: vec![],
            }),
            ..req(t, &[], &[], nonce)
        }
    }

    /// (names sent, names removed) of a response.
    fn shape(r: &DeltaDiscoveryResponse) -> (Vec<&str>, Vec<&str>) {
        (
            r.resources.iter().map(|r| r.name.as_str()).collect(),
            r.removed_resources.iter().map(String::as_str).collect(),
        )
    }

    /// Awaiting until the last response sent is answered: an answer to an
    /// older one leaves it awaiting; a NACK is an answer.
    #[test]
    fn the_stream_awaits_the_answer_to_its_last_response() {
        let mut s = DeltaSession::new("p");
        assert!(!StreamSession::awaiting(&s), "nothing sent");
        let s1 = snapshot(&[("a", "1")], &[]);
        let first = s.on_request(req(CLUSTER, &[], &[], ""), &s1).expect("ok");
        let first = first.push.expect("sent").response;
        assert!(StreamSession::awaiting(&s));
        let second = s.push(&snapshot(&[("a", "2")], &[])).remove(0).response;
        let third = s.push(&snapshot(&[("a", "3")], &[])).remove(0).response;
        let s3 = snapshot(&[("a", "3")], &[]);
        s.on_request(req(CLUSTER, &[], &[], &first.nonce), &s3)
            .expect("ok");
        assert!(StreamSession::awaiting(&s), "an older one answered");
        s.on_request(nack(CLUSTER, &third.nonce, "no"), &s3)
            .expect("ok");
        assert!(!StreamSession::awaiting(&s), "the last one NACKed");
        // The one in between, answered late: stays answered.
        s.on_request(req(CLUSTER, &[], &[], &second.nonce), &s3)
            .expect("ok");
        assert!(!StreamSession::awaiting(&s));
    }

    #[test]
    fn a_wildcard_gets_everything_then_only_changes_and_removals() {
        let s1 = snapshot(&[("a", "a1"), ("b", "b1")], &[]);
        let mut s = DeltaSession::new("p");
        let o = s.on_request(req(CLUSTER, &[], &[], ""), &s1).expect("ok");
        assert_eq!(o.reply, Reply::Request);
        let r = o.push.expect("first response").response;
        assert_eq!(shape(&r), (vec!["a", "b"], vec![]));
        assert_eq!(r.nonce, "p-1");
        assert_eq!(r.system_version_info, s1.clusters.version);
        assert_eq!(r.resources[0].version, s1.clusters.versions["a"]);
        assert_eq!(r.resources[0].resource, Some(any("a1")));

        // a changes, b goes, c comes: a and c sent, b removed.
        let s2 = snapshot(&[("a", "a2"), ("c", "c1")], &[]);
        let pushed = s.push(&s2);
        assert_eq!(pushed.len(), 1);
        assert_eq!(shape(&pushed[0].response), (vec!["a", "c"], vec!["b"]));
        // Nothing changed: nothing sent, however often asked.
        assert!(s.push(&s2).is_empty());
        // Another type's change does not resend this one.
        let s3 = snapshot(&[("a", "a2"), ("c", "c1")], &[("x", "x1")]);
        assert!(s.push(&s3).is_empty());
    }

    #[test]
    fn acks_and_nacks_are_told_by_any_recent_nonce() {
        let s1 = snapshot(&[("a", "a1")], &[]);
        let s2 = snapshot(&[("a", "a2")], &[]);
        let s3 = snapshot(&[("a", "a3")], &[]);
        let mut s = DeltaSession::new("p");
        s.on_request(req(CLUSTER, &[], &[], ""), &s1).expect("ok");
        let p2 = s.push(&s2).remove(0).response;
        // Both responses in flight: each is answered on its own, in order.
        let o = s
            .on_request(req(CLUSTER, &[], &[], "p-1"), &s2)
            .expect("ok");
        assert_eq!(
            (o.reply, o.push),
            (
                Reply::Ack {
                    version: s1.clusters.version.clone()
                },
                None
            )
        );
        let o = s
            .on_request(nack(CLUSTER, &p2.nonce, "bad cluster a"), &s2)
            .expect("ok");
        assert_eq!(
            (o.reply, o.push),
            (
                Reply::Nack {
                    version: s2.clusters.version.clone(),
                    detail: "bad cluster a".into()
                },
                None
            ),
            "a NACK is not answered with the same content"
        );
        assert_eq!(s.acked(CLUSTER), Some(s1.clusters.version.as_str()));
        assert!(s.push(&s2).is_empty(), "unchanged: nothing re-sent");
        // An answer to no response of this stream, or answered already.
        for n in ["p-1", "other-1", "p-99"] {
            let o = s.on_request(req(CLUSTER, &[], &[], n), &s2).expect("ok");
            assert_eq!((o.reply, o.push), (Reply::Stale, None), "{n}");
        }
        // A change after the NACK is sent.
        let p3 = s.push(&s3);
        assert_eq!(shape(&p3[0].response), (vec!["a"], vec![]));
    }

    #[test]
    fn only_the_last_responses_are_remembered_for_their_ack() {
        let mut s = DeltaSession::new("p");
        let snap = |i: usize| snapshot(&[("a", &i.to_string())], &[]);
        s.on_request(req(CLUSTER, &[], &[], ""), &snap(0))
            .expect("ok");
        for i in 1..=MAX_PENDING + 4 {
            assert_eq!(s.push(&snap(i)).len(), 1);
        }
        let pending = &s.types[CLUSTER].pending;
        assert_eq!(pending.len(), MAX_PENDING);
        let o = s
            .on_request(req(CLUSTER, &[], &[], "p-1"), &snap(0))
            .expect("ok");
        assert_eq!(o.reply, Reply::Stale, "forgotten");
        let last = format!("p-{}", MAX_PENDING + 5);
        let o = s
            .on_request(req(CLUSTER, &[], &[], &last), &snap(0))
            .expect("ok");
        assert!(matches!(o.reply, Reply::Ack { .. }), "{:?}", o.reply);
    }

    #[test]
    fn names_are_subscribed_and_unsubscribed_one_by_one_within_the_scope() {
        let s1 = snapshot(&[], &[("a", "a1"), ("b", "b1"), ("c", "c1")]);
        let mut s = DeltaSession::new("p");
        let o = s
            .on_request(req(ENDPOINTS, &["a", "zz", "a"], &[], ""), &s1)
            .expect("ok");
        let p = o.push.expect("sent");
        assert_eq!(shape(&p.response), (vec!["a"], vec![]));
        assert_eq!(p.out_of_scope, 1, "zz is not the proxy's");
        // b added: only b sent.
        let o = s
            .on_request(req(ENDPOINTS, &["b"], &[], ""), &s1)
            .expect("ok");
        assert_eq!(shape(&o.push.expect("sent").response), (vec!["b"], vec![]));
        // a dropped by the proxy: nothing to send (it forgets a itself).
        let o = s
            .on_request(req(ENDPOINTS, &[], &["a"], ""), &s1)
            .expect("ok");
        assert!(o.push.is_none(), "{:?}", o.push);
        // a changes: not sent, it is not subscribed any more; b goes: removed.
        let s2 = snapshot(&[], &[("a", "a2"), ("c", "c1")]);
        let pushed = s.push(&s2);
        assert_eq!(shape(&pushed[0].response), (vec![], vec!["b"]));
        // Subscribing again gets it again, at its current version.
        let o = s
            .on_request(req(ENDPOINTS, &["a"], &[], ""), &s2)
            .expect("ok");
        assert_eq!(shape(&o.push.expect("sent").response), (vec!["a"], vec![]));
        // Subscribing to a name outside the scope is answered (Envoy waits
        // for an answer), with nothing.
        let o = s
            .on_request(req(ENDPOINTS, &["secret"], &[], ""), &s2)
            .expect("ok");
        let p = o.push.expect("answered");
        assert_eq!(shape(&p.response), (vec![], vec![]));
        assert_eq!(p.out_of_scope, 3, "zz, b (gone) and secret");
    }

    #[test]
    fn the_wildcard_is_taken_and_dropped_by_name() {
        let s1 = snapshot(&[("a", "a1"), ("b", "b1")], &[]);
        let mut s = DeltaSession::new("p");
        // A first request naming b only: b only.
        let o = s
            .on_request(req(CLUSTER, &["b"], &[], ""), &s1)
            .expect("ok");
        assert_eq!(shape(&o.push.expect("sent").response), (vec!["b"], vec![]));
        // `*` added: a as well.
        let o = s
            .on_request(req(CLUSTER, &["*"], &[], ""), &s1)
            .expect("ok");
        assert_eq!(shape(&o.push.expect("sent").response), (vec!["a"], vec![]));
        // `*` dropped: the proxy keeps b; a change of a is not sent.
        let o = s
            .on_request(req(CLUSTER, &[], &["*"], ""), &s1)
            .expect("ok");
        assert!(o.push.is_none());
        assert_eq!(
            s.held(CLUSTER)
                .map(|h| h.keys().cloned().collect::<Vec<_>>()),
            Some(vec!["b".to_string()])
        );
        let s2 = snapshot(&[("a", "a2"), ("b", "b1")], &[]);
        assert!(s.push(&s2).is_empty());
    }

    #[test]
    fn a_resuming_proxy_gets_only_what_differs_from_what_it_holds() {
        let s1 = snapshot(&[("a", "a1"), ("b", "b1")], &[]);
        let held = |pairs: &[(&str, &str)]| -> std::collections::HashMap<String, String> {
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect()
        };
        let va = s1.clusters.versions["a"].clone();
        let vb = s1.clusters.versions["b"].clone();
        // Holding exactly the current resources: nothing sent.
        let mut s = DeltaSession::new("p");
        let o = s
            .on_request(
                DeltaDiscoveryRequest {
                    initial_resource_versions: held(&[("a", &va), ("b", &vb)]),
                    ..req(CLUSTER, &[], &[], "")
                },
                &s1,
            )
            .expect("ok");
        assert_eq!(
            (o.reply, o.push),
            (
                Reply::Resumed {
                    version: s1.clusters.version.clone()
                },
                None
            )
        );
        // Holding an old a, a gone c, and no b: a and b sent, c removed.
        let mut s = DeltaSession::new("p");
        let o = s
            .on_request(
                DeltaDiscoveryRequest {
                    initial_resource_versions: held(&[("a", "old"), ("c", "c0")]),
                    ..req(CLUSTER, &[], &[], "")
                },
                &s1,
            )
            .expect("ok");
        assert_eq!(o.reply, Reply::Request);
        assert_eq!(
            shape(&o.push.expect("sent").response),
            (vec!["a", "b"], vec!["c"])
        );
        // Initial versions after the first request of a type mean nothing.
        let o = s
            .on_request(
                DeltaDiscoveryRequest {
                    initial_resource_versions: held(&[("a", "old")]),
                    ..req(CLUSTER, &[], &[], "")
                },
                &s1,
            )
            .expect("ok");
        assert!(o.push.is_none());
    }

    #[test]
    fn subscriptions_and_held_versions_are_bounded() {
        let s1 = snapshot(&[("a", "a1")], &[]);
        let mut s = DeltaSession::new("p");
        let names: Vec<String> = (0..MAX_NAMES).map(|i| format!("n{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        s.on_request(req(ENDPOINTS, &refs, &[], ""), &s1)
            .expect("at the bound");
        // Named again: no more than before.
        s.on_request(req(ENDPOINTS, &refs, &[], ""), &s1)
            .expect("the same names");
        let e = s
            .on_request(req(ENDPOINTS, &["one-more"], &[], ""), &s1)
            .expect_err("over the bound");
        assert_eq!(e.reason(), "too_many_names");
        assert_eq!(e.status().code(), tonic::Code::ResourceExhausted);

        let long = "x".repeat(MAX_NAME_BYTES + 1);
        let mut s = DeltaSession::new("p");
        let e = s
            .on_request(req(ENDPOINTS, &[&long], &[], ""), &s1)
            .expect_err("too long");
        assert_eq!(e.reason(), "too_many_names");
        let mut s = DeltaSession::new("p");
        let e = s
            .on_request(
                DeltaDiscoveryRequest {
                    initial_resource_versions: [("a".to_string(), long)].into(),
                    ..req(CLUSTER, &[], &[], "")
                },
                &s1,
            )
            .expect_err("too long a version");
        assert_eq!(e.reason(), "too_many_names");
    }

    #[test]
    fn every_type_is_served_and_others_refused() {
        let mut s = DeltaSession::new("p");
        let e = s
            .on_request(
                req("type.googleapis.com/x", &[], &[], ""),
                &Snapshot::default(),
            )
            .expect_err("refused");
        assert_eq!(e.reason(), "unknown_type");
        assert_eq!(e.status().code(), tonic::Code::InvalidArgument);
        for t in [LISTENER, CLUSTER, ENDPOINTS, POD_ANNOTATIONS] {
            // An empty scope is answered all the same: Envoy waits for it.
            let o = s
                .on_request(req(t, &[], &[], ""), &Snapshot::default())
                .expect("served");
            let p = o.push.expect("answered");
            assert_eq!(shape(&p.response), (vec![], vec![]), "{t}");
        }
    }

    #[test]
    fn a_nack_detail_is_bounded() {
        let s1 = snapshot(&[("a", "a1")], &[]);
        let mut s = DeltaSession::new("p");
        s.on_request(req(CLUSTER, &[], &[], ""), &s1).expect("ok");
        let o = s
            .on_request(nack(CLUSTER, "p-1", &"é".repeat(MAX_NACK_DETAIL)), &s1)
            .expect("ok");
        let Reply::Nack { detail, .. } = o.reply else {
            panic!("a NACK: {:?}", o.reply)
        };
        assert!(detail.len() <= MAX_NACK_DETAIL + '…'.len_utf8());
    }
}
