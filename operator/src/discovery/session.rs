//! What the server remembers of one proxy's stream, and what each request
//! does to it: pure (no runtime, no socket), so [`super::server`] runs these
//! rules and the fuzz target `discovery_request` (fuzz/) drives the very
//! same ones with untrusted requests.
//!
//! Per type (the agent's pod annotations, CDS, EDS, LDS):
//! - each response has the type's version (a digest of its content) and a
//!   nonce, random per stream then counting;
//! - a request whose nonce is not the last one sent of its type is stale and
//!   ignored (a newer response is on its way);
//! - an ACK records the version; a NACK (an `error_detail`) is reported
//!   with Envoy's message, bounded, and nothing is re-sent until the content
//!   or the names asked for change (Envoy keeps its last good configuration);
//! - until the last response of a type is answered (ACK or NACK), the
//!   stream is awaiting ([`StreamSession::awaiting`]): the server holds its
//!   pushes meanwhile ([`super::push::Coalesce`]);
//! - the names asked for are a set (empty: all): each named resource is
//!   sent once however often it is named, and names outside the proxy's
//!   scope are not returned, only counted;
//! - any other type is refused ([`SessionError::UnknownType`]): Remora's
//!   sidecars ask only for these, so another is a misconfigured client,
//!   told so rather than left waiting.
//!
//! Delta xDS ([`super::delta`]) keeps its own state per type but shares
//! these rules' parts: the types served, the nonces, what a reply is, the
//! NACK detail's bound, and [`StreamSession`], which the server drives.

use std::collections::BTreeSet;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};

use super::resources::{self, Snapshot};

/// The most of an unknown type URL echoed back, in characters.
const MAX_ECHOED_TYPE: usize = 128;
/// The most of Envoy's error detail a NACK reports (log, Event), in bytes:
/// the detail is the proxy's to write, up to a whole request.
pub const MAX_NACK_DETAIL: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error(
        "type {0:?} is not served: only listeners, clusters, cluster load assignments and the agent's pod annotations and withdrawal"
    )]
    UnknownType(String),
    #[error(
        "more than {max} resource names subscribed to one type (or a name over {max_len} bytes)"
    )]
    TooManyNames { max: usize, max_len: usize },
}

impl SessionError {
    /// The metrics label of the refusal.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::UnknownType(_) => "unknown_type",
            Self::TooManyNames { .. } => "too_many_names",
        }
    }

    /// The gRPC status that ends the stream.
    pub fn status(&self) -> tonic::Status {
        match self {
            Self::UnknownType(_) => tonic::Status::invalid_argument(self.to_string()),
            Self::TooManyNames { .. } => tonic::Status::resource_exhausted(self.to_string()),
        }
    }
}

/// Type `type_url` as served, or the refusal that ends the stream.
pub fn served_type(type_url: &str) -> Result<&'static str, SessionError> {
    resources::TYPES
        .into_iter()
        .find(|t| *t == type_url)
        .ok_or_else(|| SessionError::UnknownType(type_url.chars().take(MAX_ECHOED_TYPE).collect()))
}

/// A stream's state per type, for the few types served: a vector holds
/// them in one allocation of their own size, where a `BTreeMap`'s first
/// node has room for 11 (1.7 KiB per delta stream, on every proxy).
#[derive(Debug)]
pub struct ByType<T>(Vec<(&'static str, T)>);

impl<T> Default for ByType<T> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<T> ByType<T> {
    pub fn get(&self, t: &str) -> Option<&T> {
        self.0.iter().find(|(k, _)| *k == t).map(|(_, v)| v)
    }

    pub fn get_mut(&mut self, t: &str) -> Option<&mut T> {
        self.0.iter_mut().find(|(k, _)| *k == t).map(|(_, v)| v)
    }

    pub fn contains_key(&self, t: &str) -> bool {
        self.get(t).is_some()
    }

    /// Every type's state.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|(_, v)| v)
    }

    /// Type `t`'s state, made if it has none yet.
    pub fn or_default(&mut self, t: &'static str) -> &mut T
    where
        T: Default,
    {
        let i = match self.0.iter().position(|(k, _)| *k == t) {
            Some(i) => i,
            None => {
                if self.0.capacity() == 0 {
                    self.0.reserve_exact(resources::TYPES.len());
                }
                self.0.push((t, T::default()));
                self.0.len() - 1
            }
        };
        &mut self.0[i].1
    }
}

impl<T> std::ops::Index<&str> for ByType<T> {
    type Output = T;

    fn index(&self, t: &str) -> &T {
        self.get(t).expect("a type of the stream")
    }
}

/// A stream's nonces: a prefix random per stream (see [`Session::new`]),
/// then counting.
#[derive(Debug)]
pub struct Nonces {
    prefix: String,
    n: u64,
}

impl Nonces {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            n: 0,
        }
    }

    pub fn fresh(&mut self) -> String {
        self.n += 1;
        format!("{}-{}", self.prefix, self.n)
    }
}

/// What a stream's requests carry that the server reads before a session
/// has them: the node (on the first).
pub trait AdsRequest: Send + 'static {
    fn node(&self) -> Option<&Node>;
}

impl AdsRequest for DiscoveryRequest {
    fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }
}

impl AdsRequest for envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest {
    fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }
}

/// One stream's session, state of the world ([`Session`]) or delta
/// ([`super::delta::DeltaSession`]): what the server drives.
pub trait StreamSession: Send + 'static {
    type Request: AdsRequest;
    type Response: Send + 'static;

    /// A request from the proxy, against the proxy's current `snapshot`.
    fn on_request(
        &mut self,
        req: Self::Request,
        snapshot: &Snapshot,
    ) -> Result<Outcome<Self::Response>, SessionError>;

    /// The proxy's resources changed to `snapshot`: what to send, in
    /// [`resources::TYPES`] order.
    fn push(&mut self, snapshot: &Snapshot) -> Vec<Push<Self::Response>>;

    /// Whether the proxy holds resource `name` of type `t` once it applies
    /// what was last sent of that type.
    fn holds(&self, t: &str, name: &str) -> bool;

    /// Whether a response sent has not been answered (ACKed or NACKed)
    /// yet: the proxy has not applied it, and a push meanwhile is held
    /// ([`super::push::Coalesce`]).
    fn awaiting(&self) -> bool;
}

impl StreamSession for Session {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;

    fn on_request(
        &mut self,
        req: DiscoveryRequest,
        snapshot: &Snapshot,
    ) -> Result<Outcome, SessionError> {
        Session::on_request(self, req, snapshot)
    }

    fn push(&mut self, snapshot: &Snapshot) -> Vec<Push> {
        Session::push(self, snapshot)
    }

    fn holds(&self, t: &str, name: &str) -> bool {
        // The last response held every name asked for (none: all).
        self.types
            .get(t)
            .and_then(|s| s.sent.as_ref())
            .is_some_and(|(_, names, _)| names.is_empty() || names.contains(name))
    }

    fn awaiting(&self) -> bool {
        self.types.values().any(|s| s.unanswered)
    }
}

/// What a request said about the last response of its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A first request of its type, or new names, without a nonce.
    Request,
    /// An answer to a response other than the last one sent of its type,
    /// or to none this stream sent: ignored.
    Stale,
    /// The proxy applied the last response: `version` is now its.
    Ack { version: String },
    /// The proxy refused the last response, of version `version`, saying
    /// `detail` (cut to [`MAX_NACK_DETAIL`]).
    Nack { version: String, detail: String },
    /// A proxy on a new stream holds `version`, which is what this stream
    /// would send: taken as sent and accepted, so a reconnect costs no resend.
    Resumed { version: String },
}

/// A response to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Push<R = DiscoveryResponse> {
    /// Its type, as served.
    pub type_url: &'static str,
    pub response: R,
    /// Names asked for that the proxy's scope does not hold (not returned).
    pub out_of_scope: usize,
}

/// What one request did.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome<R = DiscoveryResponse> {
    /// Its type, as served.
    pub type_url: &'static str,
    pub reply: Reply,
    pub push: Option<Push<R>>,
}

/// One type's state on one stream.
#[derive(Debug, Default)]
struct TypeState {
    /// The names last asked for (empty: all).
    names: BTreeSet<String>,
    /// What was last sent: version, names, nonce.
    sent: Option<(String, BTreeSet<String>, String)>,
    /// What was last sent has not been answered yet.
    unanswered: bool,
    acked: Option<String>,
}

/// One proxy's stream, apart from its connection.
#[derive(Debug)]
pub struct Session {
    types: ByType<TypeState>,
    nonces: Nonces,
}

impl Session {
    /// A new stream whose nonces start with `nonce_prefix`: random per
    /// stream, so an answer to a nonce of an earlier stream of the same
    /// proxy (sent before a reconnect) never matches this one's.
    pub fn new(nonce_prefix: impl Into<String>) -> Self {
        Self {
            types: ByType::default(),
            nonces: Nonces::new(nonce_prefix),
        }
    }

    /// The version the proxy last ACKed of type `t`.
    pub fn acked(&self, t: &str) -> Option<&str> {
        self.types.get(t)?.acked.as_deref()
    }

    /// A request from the proxy, against the proxy's current `snapshot`.
    pub fn on_request(
        &mut self,
        req: DiscoveryRequest,
        snapshot: &Snapshot,
    ) -> Result<Outcome, SessionError> {
        let t = served_type(&req.type_url)?;
        let state = self.types.or_default(t);
        let mut reply = Reply::Request;
        if !req.response_nonce.is_empty() {
            match &state.sent {
                Some((version, _, nonce)) if *nonce == req.response_nonce => {
                    state.unanswered = false;
                    reply = match &req.error_detail {
                        Some(e) => Reply::Nack {
                            version: version.clone(),
                            detail: bounded(&e.message, MAX_NACK_DETAIL),
                        },
                        None => {
                            state.acked = Some(version.clone());
                            Reply::Ack {
                                version: version.clone(),
                            }
                        }
                    };
                }
                _ => {
                    return Ok(Outcome {
                        type_url: t,
                        reply: Reply::Stale,
                        push: None,
                    });
                }
            }
        }
        state.names = req.resource_names.into_iter().collect();
        if state.sent.is_none()
            && req.response_nonce.is_empty()
            && !req.version_info.is_empty()
            && snapshot
                .of_type(t)
                .is_some_and(|typed| typed.version == req.version_info)
        {
            state.sent = Some((req.version_info.clone(), state.names.clone(), String::new()));
            state.acked = Some(req.version_info.clone());
            return Ok(Outcome {
                type_url: t,
                reply: Reply::Resumed {
                    version: req.version_info,
                },
                push: None,
            });
        }
        let push = self.if_changed(t, snapshot);
        Ok(Outcome {
            type_url: t,
            reply,
            push,
        })
    }

    /// The proxy's resources changed to `snapshot`: what to send, for the
    /// types it asked for whose content changed, in [`resources::TYPES`] order.
    pub fn push(&mut self, snapshot: &Snapshot) -> Vec<Push> {
        let subscribed: Vec<&'static str> = resources::TYPES
            .into_iter()
            .filter(|t| self.types.contains_key(t))
            .collect();
        subscribed
            .into_iter()
            .filter_map(|t| self.if_changed(t, snapshot))
            .collect()
    }

    /// Type `t`'s response, unless it is what was last sent.
    fn if_changed(&mut self, t: &'static str, snapshot: &Snapshot) -> Option<Push> {
        let typed = snapshot.of_type(t)?;
        let state = self.types.or_default(t);
        if let Some((version, names, _)) = &state.sent
            && *version == typed.version
            && *names == state.names
        {
            return None;
        }
        let mut out_of_scope = 0;
        let resources = if state.names.is_empty() {
            typed.resources.values().cloned().collect()
        } else {
            let mut out = Vec::new();
            for n in &state.names {
                match typed.resources.get(n) {
                    Some(r) => out.push(r.clone()),
                    None => out_of_scope += 1,
                }
            }
            out
        };
        let nonce = self.nonces.fresh();
        state.sent = Some((typed.version.clone(), state.names.clone(), nonce.clone()));
        state.unanswered = true;
        Some(Push {
            type_url: t,
            response: DiscoveryResponse {
                version_info: typed.version.clone(),
                resources,
                type_url: t.to_string(),
                nonce,
                ..Default::default()
            },
            out_of_scope,
        })
    }
}

/// `s` cut to at most `max` bytes, on a character boundary.
pub(super) fn bounded(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use envoy_types::pb::google::protobuf::Any;
    use envoy_types::pb::google::rpc::Status as RpcStatus;

    use super::*;
    use crate::discovery::resources::{CLUSTER, ENDPOINTS, LISTENER, Typed};

    fn any(v: &str) -> Any {
        Any {
            type_url: CLUSTER.into(),
            value: v.as_bytes().to_vec(),
        }
    }

    fn snapshot(version: &str, clusters: &[&str]) -> Snapshot {
        Snapshot {
            clusters: Arc::new(Typed {
                version: version.into(),
                ..Typed::new(clusters.iter().map(|c| (c.to_string(), any(c))).collect())
            }),
            ..Snapshot::default()
        }
    }

    fn req(t: &str, version: &str, nonce: &str, names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: t.into(),
            version_info: version.into(),
            response_nonce: nonce.into(),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            ..Default::default()
        }
    }

    fn nack(t: &str, version: &str, nonce: &str, detail: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            error_detail: Some(RpcStatus {
                code: 3,
                message: detail.into(),
                details: vec![],
            }),
            ..req(t, version, nonce, &[])
        }
    }

    #[test]
    fn acks_nacks_and_stale_answers_are_told_by_the_nonce() {
        let s1 = snapshot("v1", &["a", "b"]);
        let mut s = Session::new("p");
        let o = s
            .on_request(req(CLUSTER, "", "", &[]), &s1)
            .expect("served");
        assert_eq!(o.reply, Reply::Request);
        let r = o.push.expect("first response").response;
        assert_eq!((r.version_info.as_str(), r.nonce.as_str()), ("v1", "p-1"));
        assert_eq!(r.resources.len(), 2);

        let o = s
            .on_request(req(CLUSTER, "v1", "p-1", &[]), &s1)
            .expect("ok");
        assert_eq!(
            (o.reply, o.push),
            (
                Reply::Ack {
                    version: "v1".into()
                },
                None
            )
        );
        assert_eq!(s.acked(CLUSTER), Some("v1"));

        let s2 = snapshot("v2", &["a"]);
        let pushed = s.push(&s2);
        assert_eq!(pushed.len(), 1);
        assert_eq!(pushed[0].response.nonce, "p-2");
        // An answer to the older response: ignored.
        let o = s
            .on_request(req(CLUSTER, "v1", "p-1", &[]), &s2)
            .expect("ok");
        assert_eq!((o.reply, o.push), (Reply::Stale, None));
        // A NACK of v2 keeps v1 ACKed and sends nothing again.
        let o = s
            .on_request(nack(CLUSTER, "v1", "p-2", "bad cluster"), &s2)
            .expect("ok");
        assert_eq!(
            (o.reply, o.push),
            (
                Reply::Nack {
                    version: "v2".into(),
                    detail: "bad cluster".into()
                },
                None
            )
        );
        assert_eq!(s.acked(CLUSTER), Some("v1"));
        assert!(s.push(&s2).is_empty(), "unchanged: nothing re-sent");
    }

    /// Awaiting until the last response of each type is answered, ACK or
    /// NACK; an answer to an older one (stale) leaves it awaiting.
    #[test]
    fn the_stream_awaits_the_answer_to_its_last_response() {
        let s1 = snapshot("v1", &["a"]);
        let mut s = Session::new("p");
        assert!(!StreamSession::awaiting(&s), "nothing sent");
        s.on_request(req(CLUSTER, "", "", &[]), &s1).expect("ok");
        assert!(StreamSession::awaiting(&s));
        s.on_request(req(CLUSTER, "v1", "p-1", &[]), &s1)
            .expect("ok");
        assert!(!StreamSession::awaiting(&s), "ACKed");
        let s2 = snapshot("v2", &["b"]);
        assert_eq!(s.push(&s2).len(), 1);
        s.on_request(req(CLUSTER, "v1", "p-1", &[]), &s2)
            .expect("ok");
        assert!(StreamSession::awaiting(&s), "a stale answer");
        s.on_request(nack(CLUSTER, "v1", "p-2", "bad"), &s2)
            .expect("ok");
        assert!(!StreamSession::awaiting(&s), "NACKed");
        // A resumed type holds what it would be sent: nothing awaited.
        let mut s = Session::new("p");
        s.on_request(req(CLUSTER, "v1", "", &[]), &s1).expect("ok");
        assert!(!StreamSession::awaiting(&s));
    }

    #[test]
    fn names_are_a_set_and_names_outside_the_scope_are_counted_not_sent() {
        let s1 = snapshot("v1", &["a", "b"]);
        let mut s = Session::new("p");
        // A name repeated many times is sent once: the response is never
        // larger than the proxy's scope, whatever the request names.
        let mut names = vec!["a"; 10_000];
        names.extend(["zz", "zz", "b"]);
        let o = s
            .on_request(req(CLUSTER, "", "", &names), &s1)
            .expect("served");
        let p = o.push.expect("sent");
        assert_eq!(p.response.resources, vec![any("a"), any("b")]);
        assert_eq!(p.out_of_scope, 1);
        // The same set in another order is no change.
        let o = s
            .on_request(req(CLUSTER, "v1", "p-1", &["b", "zz", "a"]), &s1)
            .expect("ok");
        assert!(o.push.is_none());
    }

    #[test]
    fn a_resuming_proxy_holding_the_current_version_gets_no_resend() {
        let s1 = snapshot("v1", &["a"]);
        let mut s = Session::new("p");
        let o = s.on_request(req(CLUSTER, "v1", "", &[]), &s1).expect("ok");
        assert_eq!(
            (o.reply, o.push),
            (
                Reply::Resumed {
                    version: "v1".into()
                },
                None
            )
        );
        assert_eq!(s.acked(CLUSTER), Some("v1"));
        // Holding an older version: sent the current one.
        let mut s = Session::new("p");
        let o = s.on_request(req(CLUSTER, "v0", "", &[]), &s1).expect("ok");
        assert_eq!(o.push.expect("sent").response.version_info, "v1");
    }

    #[test]
    fn unknown_types_are_refused_and_echoed_bounded() {
        let mut s = Session::new("p");
        let long = format!("type.googleapis.com/{}", "x".repeat(100_000));
        let e = s
            .on_request(req(&long, "", "", &[]), &Snapshot::default())
            .expect_err("refused");
        assert_eq!(e.reason(), "unknown_type");
        let status = e.status();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().len() < 400, "{}", status.message());
        for t in [LISTENER, ENDPOINTS, resources::POD_ANNOTATIONS] {
            assert!(
                s.on_request(req(t, "", "", &[]), &Snapshot::default())
                    .is_ok()
            );
        }
    }

    #[test]
    fn a_nack_detail_is_cut_on_a_character_boundary() {
        let s1 = snapshot("v1", &["a"]);
        let mut s = Session::new("p");
        s.on_request(req(CLUSTER, "", "", &[]), &s1).expect("ok");
        let detail = "é".repeat(MAX_NACK_DETAIL);
        let o = s
            .on_request(nack(CLUSTER, "", "p-1", &detail), &s1)
            .expect("ok");
        let Reply::Nack { detail, .. } = o.reply else {
            panic!("a NACK: {:?}", o.reply)
        };
        assert!(detail.len() <= MAX_NACK_DETAIL + '…'.len_utf8());
        assert!(detail.ends_with('…'));
    }
}
