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
    MAX_TYPES, POD_ANNOTATIONS_TYPE, Reply, Session, SessionError, pod_annotations,
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
    /// Whether the agent's own subscription went up on the current stream.
    own_sent: bool,
    /// The version of the pod's annotations last applied.
    applied: String,
}

impl Model {
    /// The session's own subscription, checked: once per upstream stream,
    /// naming the version last applied.
    fn own(&mut self, own: Option<DiscoveryRequest>) {
        if let Some(own) = own {
            assert!(!self.own_sent, "the own subscription twice on one stream");
            assert!(self.node, "the own subscription before any node");
            assert_eq!(own.type_url, POD_ANNOTATIONS_TYPE);
            assert_eq!(own.version_info, self.applied);
            self.own_sent = true;
        }
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
                m.own(session.own_subscription());
            }
            Event::Server(resp) => {
                if resp.type_url == POD_ANNOTATIONS_TYPE {
                    let applied = pod_annotations(&resp).map(|_| ());
                    let ok = applied.is_ok();
                    let ack = session.own_ack(&resp, applied);
                    if ok {
                        m.applied.clone_from(&resp.version_info);
                    }
                    assert_eq!(ack.type_url, POD_ANNOTATIONS_TYPE);
                    assert_eq!(ack.response_nonce, resp.nonce);
                    assert_eq!(ack.version_info, m.applied, "the version last applied");
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
                m.own(session.own_subscription());
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
