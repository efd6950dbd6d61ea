//! The discovery server's handling of one delta ADS stream, as
//! `remora_operator::discovery::server` runs it, short of a socket and a
//! runtime: as [`super::discovery`] does for state of the world, in the
//! same fixed world ([`super::discovery::world`]), with each request
//! through the stream's [`DeltaSession`].
//!
//! # Input
//!
//! The requests of one stream, each length-delimited (a varint length, then
//! the encoded `DeltaDiscoveryRequest`); the first is the stream's first.
//! Bytes that do not decode end the stream. Nonces are `fuzz-<n>`.
//!
//! # What is checked
//!
//! Nothing panics; a refusal is a gRPC status of the right code whose
//! message is bounded; an ACK or NACK is recognised exactly when the
//! request names one of the last [`MAX_PENDING`] responses of its type not
//! answered yet; each response carries the snapshot's version for its type,
//! the next nonce, and only resources of the proxy's scope at their current
//! versions, each at most once, none also removed; after each response,
//! what the session says the proxy holds of that type is all in its scope at
//! the current versions; and once the registry changed, one push brings
//! every type up to date (a second sends nothing).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use remora_contract::discovery::MAX_REQUEST_BYTES;
use remora_operator::discovery::delta::{DeltaSession, MAX_PENDING};
use remora_operator::discovery::resources::{self, Snapshot};
use remora_operator::discovery::server;
use remora_operator::discovery::session::{MAX_NACK_DETAIL, Push, Reply};

use super::discovery::{NONCE_PREFIX, world};

/// The most a refusal's message may weigh.
const MAX_STATUS_MESSAGE: usize = 1024;

fn next_request(data: &mut &[u8]) -> Option<DeltaDiscoveryRequest> {
    crate::message(data, MAX_REQUEST_BYTES)
}

/// What the stream sent, to tell which request answers what.
#[derive(Default)]
struct Model {
    /// Type → (nonce, type version) of the responses not answered yet.
    pending: BTreeMap<String, VecDeque<(String, String)>>,
    nonces: u64,
}

impl Model {
    fn sent(
        &mut self,
        push: &Push<envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryResponse>,
        snapshot: &Snapshot,
        session: &DeltaSession,
    ) {
        let r = &push.response;
        assert_eq!(r.type_url, push.type_url);
        let typed = snapshot
            .of_type(&r.type_url)
            .unwrap_or_else(|| panic!("a response of a type not served: {:?}", r.type_url));
        assert_eq!(
            r.system_version_info, typed.version,
            "the snapshot's version"
        );
        self.nonces += 1;
        assert_eq!(
            r.nonce,
            format!("{NONCE_PREFIX}-{}", self.nonces),
            "the next nonce"
        );
        let mut names = BTreeSet::new();
        for res in &r.resources {
            assert!(names.insert(res.name.as_str()), "{} sent twice", res.name);
            assert_eq!(
                typed.versions.get(&res.name),
                Some(&res.version),
                "{} outside the scope or not at its version",
                res.name
            );
            assert_eq!(res.resource.as_ref(), typed.resources.get(&res.name));
        }
        assert!(r.resources.len() <= typed.resources.len());
        for n in &r.removed_resources {
            assert!(!names.contains(n.as_str()), "{n} both sent and removed");
        }
        held_in_scope(session, push.type_url, snapshot);
        let q = self.pending.entry(r.type_url.clone()).or_default();
        q.push_back((r.nonce.clone(), r.system_version_info.clone()));
        if q.len() > MAX_PENDING {
            q.pop_front();
        }
    }

    /// The response `nonce` of type `t` answers, forgotten once answered.
    fn answers(&mut self, t: &str, nonce: &str) -> Option<String> {
        let q = self.pending.get_mut(t)?;
        let i = q.iter().position(|(n, _)| n == nonce)?;
        q.remove(i).map(|(_, v)| v)
    }
}

/// What the session says the proxy holds of `t` is in `snapshot`'s scope,
/// at its versions.
fn held_in_scope(session: &DeltaSession, t: &str, snapshot: &Snapshot) {
    let (Some(held), Some(typed)) = (session.held(t), snapshot.of_type(t)) else {
        return;
    };
    for (n, v) in held {
        assert_eq!(
            typed.versions.get(n),
            Some(v),
            "held {n} at {v}, not the scope's"
        );
    }
}

/// The requests of one delta ADS stream (see the module docs).
pub fn discovery_delta(data: &[u8]) {
    serve(data);
}

/// How far a stream got: `None` refused at once (or empty), else how many
/// requests were served and whether it ended on a refused one.
pub fn serve(data: &[u8]) -> Option<(usize, bool)> {
    let w = world();
    let mut data = data;
    let first = next_request(&mut data)?;
    match server::entitled_now(&w.discovery, &w.caller, &first) {
        Ok(pod) => assert_eq!(pod, w.pod, "served as another pod than the caller's"),
        Err(refusal) => {
            let status = refusal.status();
            assert!(
                matches!(
                    status.code(),
                    tonic::Code::InvalidArgument | tonic::Code::PermissionDenied
                ),
                "{refusal}: {:?}",
                status.code()
            );
            assert!(status.message().len() <= MAX_STATUS_MESSAGE);
            return None;
        }
    }
    let mut session = DeltaSession::new(NONCE_PREFIX);
    let mut model = Model::default();
    let mut next = Some(first);
    let mut served = 0;
    while let Some(req) = next.take() {
        let type_url = req.type_url.clone();
        let nonce_given = !req.response_nonce.is_empty();
        let nack = req.error_detail.is_some();
        let answers = nonce_given
            .then(|| model.answers(&type_url, &req.response_nonce))
            .flatten();
        let outcome = match session.on_request(req, &w.before) {
            Ok(o) => o,
            Err(e) => {
                let status = e.status();
                if resources::TYPES.contains(&type_url.as_str()) {
                    assert_eq!(e.reason(), "too_many_names", "a served type refused: {e}");
                    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
                } else {
                    assert_eq!(status.code(), tonic::Code::InvalidArgument);
                }
                assert!(status.message().len() <= MAX_STATUS_MESSAGE);
                return Some((served, true));
            }
        };
        assert_eq!(outcome.type_url, type_url);
        match (&outcome.reply, answers) {
            (Reply::Ack { version }, Some(sent)) if !nack => assert_eq!(*version, sent),
            (Reply::Nack { version, detail }, Some(sent)) if nack => {
                assert_eq!(*version, sent);
                assert!(detail.len() <= MAX_NACK_DETAIL + '…'.len_utf8());
            }
            (Reply::Stale, None) if nonce_given => {}
            (Reply::Request | Reply::Resumed { .. }, None) if !nonce_given => {}
            (reply, answers) => panic!(
                "{reply:?} for a request answering {answers:?} (nonce given: {nonce_given}, error detail: {nack})"
            ),
        }
        if let Reply::Resumed { version } = &outcome.reply {
            assert!(outcome.push.is_none());
            let typed = w.before.of_type(&type_url).expect("served");
            assert_eq!(*version, typed.version);
        }
        match &outcome.push {
            Some(p) => model.sent(p, &w.before, &session),
            None => held_in_scope(&session, outcome.type_url, &w.before),
        }
        served += 1;
        next = next_request(&mut data);
    }
    // The registry changes: one push brings every type up to date.
    let mut types = BTreeSet::new();
    for p in session.push(&w.after) {
        assert!(types.insert(p.type_url), "one response per type");
        model.sent(&p, &w.after, &session);
    }
    for t in resources::TYPES {
        held_in_scope(&session, t, &w.after);
    }
    assert!(session.push(&w.after).is_empty(), "sent again, unchanged");
    Some((served, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds reach what they are meant to.
    #[test]
    fn the_seeds_reach_their_part_of_the_server() {
        for (name, expected) in [
            ("empty", None),
            ("first-request.bin", Some((1, false))),
            ("ack.bin", Some((8, false))),
            ("nack.bin", Some((2, false))),
            ("resume.bin", Some((3, false))),
            ("unsubscribe.bin", Some((4, false))),
            ("stale.bin", Some((3, false))),
            ("too-many-names.bin", Some((1, true))),
            ("unknown-type.bin", Some((0, true))),
            ("other-pod.bin", None),
        ] {
            assert_eq!(
                serve(&crate::seed("discovery_delta", name)),
                expected,
                "{name}"
            );
        }
    }
}
