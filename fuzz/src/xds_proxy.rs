//! The agent's xDS proxy (remora_agent::xds) between Envoy and the
//! discovery server, short of its sockets: what its [`Session`] does with
//! the discovery server's responses, interleaved with Envoy's requests (an
//! ACK is told by the nonces of the responses) and reconnects (which replay
//! Envoy's requests). A buggy or compromised operator must not make the
//! agent panic, nor make it take Envoy's answer to one response for an
//! answer to another.
//!
//! # Input
//!
//! Events of one Envoy stream, each one tag byte, then for a request or a
//! response the message length-delimited (a varint length, then the
//! encoding, as `prost::Message::encode_length_delimited` writes it). Tag
//! modulo 3: 0 a request from Envoy, 1 a response from the server, 2 the
//! upstream stream reconnected. Bytes that do not decode end the stream.
//!
//! The calls per event are the ones `proxy_stream` (agent/src/xds/proxy.rs)
//! makes, in its order.

use std::collections::HashMap;

use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use remora_agent::xds::session::{
    MAX_TYPES, OWN_TYPES, POD_ANNOTATIONS_TYPE, Reply, Session, SessionError, is_own,
    pod_annotations, withdrawal,
};
use remora_agent::xds::upstream::MAX_RESPONSE_BYTES;
use remora_contract::discovery::MAX_REQUEST_BYTES;

use crate::message;

enum Event {
    Envoy(Box<DiscoveryRequest>),
    Server(Box<DiscoveryResponse>),
    Reconnect,
}

fn next_event(data: &mut &[u8]) -> Option<Event> {
    let (&tag, rest) = data.split_first()?;
    *data = rest;
    match tag % 3 {
        0 => message(data, MAX_REQUEST_BYTES).map(|r| Event::Envoy(Box::new(r))),
        1 => message(data, MAX_RESPONSE_BYTES).map(|r| Event::Server(Box::new(r))),
        _ => Some(Event::Reconnect),
    }
}

/// What the proxy has done so far, to check the session against.
#[derive(Default)]
struct Model {
    /// Types Envoy asked for, in the order it first did.
    asked: Vec<String>,
    /// Per type Envoy asked for, the nonce of the last response sent down
    /// on the current upstream stream.
    sent: HashMap<String, String>,
    /// Whether Envoy has sent a node.
    node: bool,
    /// Whether the agent's own subscriptions went up on the current stream.
    own_sent: bool,
    /// Per own type, the version last applied.
    applied: HashMap<String, String>,
}

impl Model {
    /// The session's own subscriptions, checked: once per upstream stream,
    /// one per own type, each naming the version last applied.
    fn own(&mut self, own: Vec<DiscoveryRequest>) {
        if own.is_empty() {
            return;
        }
        assert!(!self.own_sent, "the own subscriptions twice on one stream");
        assert!(self.node, "the own subscriptions before any node");
        let types: Vec<&str> = own.iter().map(|r| r.type_url.as_str()).collect();
        assert_eq!(types, OWN_TYPES);
        for r in &own {
            assert_eq!(r.version_info, self.applied(&r.type_url));
        }
        self.own_sent = true;
    }

    fn applied(&self, type_url: &str) -> String {
        self.applied.get(type_url).cloned().unwrap_or_default()
    }
}

/// One Envoy stream's events (see the module docs).
pub fn xds_response(data: &[u8]) {
    run(data);
}

/// [`xds_response`], saying how many events were handled before the
/// stream ended (the input did, or the proxy refused a request).
pub fn run(data: &[u8]) -> usize {
    let mut handled = 0;
    let mut data = data;
    let mut session = Session::default();
    let mut m = Model::default();
    // The proxy opens its first upstream stream at once.
    assert!(session.resume().is_empty());
    while let Some(event) = next_event(&mut data) {
        match event {
            Event::Envoy(req) => {
                let new = !m.asked.contains(&req.type_url);
                let answers = m
                    .sent
                    .get(&req.type_url)
                    .is_some_and(|n| !req.response_nonce.is_empty() && *n == req.response_nonce);
                let (fwd, reply) = match session.from_envoy(DiscoveryRequest::clone(&req)) {
                    Ok(r) => r,
                    Err(SessionError::NoTypeUrl) => {
                        assert!(req.type_url.is_empty());
                        return handled;
                    }
                    Err(SessionError::TooManyTypes) => {
                        assert!(new && m.asked.len() >= MAX_TYPES);
                        return handled;
                    }
                    Err(e @ SessionError::TooManyNames(_)) => {
                        panic!("state of the world keeps no names to count: {e}")
                    }
                };
                if new {
                    m.asked.push(req.type_url.clone());
                }
                m.node |= req.node.is_some();
                assert_eq!(
                    DiscoveryRequest {
                        node: None,
                        ..fwd.clone()
                    },
                    DiscoveryRequest {
                        node: None,
                        ..DiscoveryRequest::clone(&req)
                    },
                    "forwarded changed"
                );
                match (reply, answers, &req.error_detail) {
                    (Reply::Request, false, _) => {}
                    (Reply::Ack { version }, true, None) => assert_eq!(version, req.version_info),
                    (Reply::Nack { version, .. }, true, Some(_)) => {
                        assert_eq!(version, req.version_info);
                    }
                    (reply, answers, detail) => {
                        panic!("{reply:?} for a request answering: {answers}, NACK: {detail:?}")
                    }
                }
                m.own(session.own_subscriptions());
            }
            Event::Server(resp) => {
                if is_own(&resp.type_url) {
                    let applied = if resp.type_url == POD_ANNOTATIONS_TYPE {
                        pod_annotations(&resp).map(|_| ())
                    } else {
                        withdrawal(&resp).map(|_| ())
                    };
                    let ok = applied.is_ok();
                    let ack = session.own_ack(&resp, applied);
                    if ok {
                        m.applied
                            .insert(resp.type_url.clone(), resp.version_info.clone());
                    }
                    assert_eq!(ack.type_url, resp.type_url);
                    assert_eq!(ack.response_nonce, resp.nonce);
                    assert_eq!(
                        ack.version_info,
                        m.applied(&resp.type_url),
                        "the version last applied"
                    );
                    assert_eq!(ack.error_detail.is_none(), ok);
                } else {
                    session.from_server(&resp);
                    if m.asked.contains(&resp.type_url) {
                        m.sent.insert(resp.type_url.clone(), resp.nonce.clone());
                    }
                }
            }
            Event::Reconnect => {
                let replay = session.resume();
                m.sent.clear();
                m.own_sent = false;
                let types: Vec<&str> = replay.iter().map(|r| r.type_url.as_str()).collect();
                assert_eq!(types, m.asked, "one request per type, in first-asked order");
                for (i, r) in replay.iter().enumerate() {
                    assert!(r.response_nonce.is_empty() && r.error_detail.is_none());
                    assert_eq!(
                        r.node.is_some(),
                        i == 0 && m.node,
                        "the node on the first only"
                    );
                }
                m.own(session.own_subscriptions());
            }
        }
        handled += 1;
    }
    handled
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds go as far as they are meant to.
    #[test]
    fn the_seeds_reach_their_part_of_the_proxy() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/xds_response");
        for (name, handled) in [
            ("empty", 0),
            ("subscribe-ack-nack.bin", 7),
            ("bad-pod-annotations.bin", 4),
            ("reconnect.bin", 8),
            ("unasked-type.bin", 4),
            ("too-many-types.bin", MAX_TYPES),
            ("no-type.bin", 0),
        ] {
            let data = std::fs::read(dir.join(name)).expect(name);
            assert_eq!(run(&data), handled, "{name}");
        }
    }
}
