//! The discovery server's handling of one ADS stream, as
//! `remora_operator::discovery::server` runs it, short of a socket and a
//! runtime: the stream's requests decoded as tonic's prost codec decodes
//! them (a message over [`MAX_REQUEST_BYTES`] never gets that far), the
//! first one admitted or refused ([`server::entitled_now`]), then each one
//! through the stream's [`Session`], then a push after a registry change.
//!
//! # Input
//!
//! The requests of one stream, each length-delimited (a varint length, then
//! the encoded `DiscoveryRequest`, as `prost::Message::encode_length_delimited`
//! writes it); the first is the stream's first. Bytes that do not decode end
//! the stream, as tonic ends it on a message it cannot decode.
//!
//! # The fixed world
//!
//! Namespace `shop`: pod `web-0` (10.0.0.7, ServiceAccount `web`, calling
//! `cart.shop:80` (HTTP), `db.shop:5432` (TCP) and `example.org:443`
//! (static)), pod `db-0` (ServiceAccount `db`), pod `cart-0` (10.0.1.1,
//! ServiceAccount `cart`, meshed: reached over mTLS, the workload CA being
//! on); the caller holds `web`'s token, not bound to a pod. Nonces are
//! `fuzz-<n>`, so seeds can ACK.
//!
//! # What is checked
//!
//! Nothing panics; a refusal is a gRPC status of the right code whose
//! message is bounded; an ACK or NACK is recognised exactly when the request
//! answers the last response sent of its type; each response carries the
//! snapshot's version for its type, the next nonce, and only resources of
//! the proxy's scope, each at most once (a request cannot make a response
//! larger than the proxy's scope).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, OnceLock};

use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use remora_contract::discovery::{MAX_REQUEST_BYTES, ServiceHost};
use remora_operator::discovery::push::{Debounce, Discovery};
use remora_operator::discovery::registry::{
    PodKey, Protocol, ProxyInfo, ServiceInfo, ServicePort, SliceInfo,
};
use remora_operator::discovery::resources::{self, Snapshot};
use remora_operator::discovery::server;
use remora_operator::discovery::session::{MAX_NACK_DETAIL, Reply, Session};
use remora_operator::pki::workload_ca::authn::Caller;

/// The nonce prefix of the fuzzed stream (random per stream in the server).
pub const NONCE_PREFIX: &str = "fuzz";
/// The most a refusal's message may weigh: it goes back as a trailer, and
/// into the log.
const MAX_STATUS_MESSAGE: usize = 1024;

/// The world the stream is served in.
pub struct World {
    pub discovery: Arc<Discovery>,
    pub caller: Caller,
    pub pod: PodKey,
    /// `pod`'s resources now, and after one change to the registry
    /// (`cart` gains an endpoint, the pod an annotation).
    pub before: Snapshot,
    pub after: Snapshot,
}

fn host(name: &str) -> ServiceHost {
    ServiceHost {
        name: name.into(),
        namespace: "shop".into(),
    }
}

fn pod(name: &str) -> PodKey {
    PodKey {
        namespace: "shop".into(),
        name: name.into(),
    }
}

fn slice(service: &str, port: u16, ips: &[&str]) -> SliceInfo {
    SliceInfo {
        service: Some(host(service)),
        ports: BTreeMap::from([(String::new(), port)]),
        ready: ips.iter().filter_map(|ip| ip.parse().ok()).collect(),
        ..SliceInfo::default()
    }
}

fn web(stop: Option<&str>) -> ProxyInfo {
    ProxyInfo {
        ip: Some("10.0.0.7".into()),
        service_account: "web".into(),
        outbound: Some("15001:cart.shop:80,15002:db.shop:5432,15003:example.org:443".into()),
        agent_annotations: stop
            .map(|s| {
                (
                    remora_contract::annotations::STOP.to_string(),
                    s.to_string(),
                )
            })
            .into_iter()
            .collect(),
        ..ProxyInfo::default()
    }
}

/// The fixed world (see the module docs).
pub fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        // The debounce task is not run: nothing here waits for a batch.
        // With the workload CA, as the operator's discovery always runs.
        let (d, _debounce) =
            Discovery::new("cluster.local", Some("cluster.local"), Debounce::default());
        let port = |port, protocol| ServicePort {
            port,
            name: String::new(),
            protocol,
        };
        d.update(|r| {
            let mut t = Vec::new();
            t.extend(r.apply_service(
                host("cart"),
                ServiceInfo {
                    ports: vec![port(80, Protocol::Http)],
                    ..ServiceInfo::default()
                },
            ));
            t.extend(r.apply_service(
                host("db"),
                ServiceInfo {
                    ports: vec![port(5432, Protocol::Tcp)],
                    ..ServiceInfo::default()
                },
            ));
            t.extend(r.apply_proxy(pod("web-0"), web(None)));
            t.extend(r.apply_proxy(
                pod("db-0"),
                ProxyInfo {
                    ip: Some("10.0.0.9".into()),
                    service_account: "db".into(),
                    ..ProxyInfo::default()
                },
            ));
            // 10.0.1.1 is a meshed pod's: reached over mTLS.
            t.extend(r.apply_proxy(
                pod("cart-0"),
                ProxyInfo {
                    ip: Some("10.0.1.1".into()),
                    service_account: "cart".into(),
                    mtls_ports: [8080].into(),
                    ..ProxyInfo::default()
                },
            ));
            let mut cart = slice("cart", 8080, &["10.0.1.1", "10.0.1.2"]);
            cart.pods = [("10.0.1.1".parse().expect("ip"), "cart-0".to_string())].into();
            t.extend(r.apply_slice(("shop".into(), "cart-1".into()), cart));
            t.extend(r.apply_slice(
                ("shop".into(), "db-1".into()),
                slice("db", 5432, &["10.0.2.1"]),
            ));
            t
        });
        let web0 = pod("web-0");
        let before = d.snapshot(&web0).expect("web-0 is known");
        d.update(|r| {
            r.apply_slice(
                ("shop".into(), "cart-1".into()),
                slice("cart", 8080, &["10.0.1.1", "10.0.1.2", "10.0.1.3"]),
            )
            .into_iter()
            .chain(r.apply_proxy(web0.clone(), web(Some("true"))))
            .collect::<Vec<_>>()
        });
        let after = d.snapshot(&web0).expect("web-0 is known");
        assert_ne!(before, after, "the change changes web-0's resources");
        World {
            discovery: d,
            caller: Caller {
                namespace: "shop".into(),
                service_account: "web".into(),
                pod: None,
            },
            pod: web0,
            before,
            after,
        }
    })
}

/// The next request of `data`, as tonic would hand it over; `None` ends
/// the stream.
fn next_request(data: &mut &[u8]) -> Option<DiscoveryRequest> {
    crate::message(data, MAX_REQUEST_BYTES)
}

/// What the stream sent last of each type, to tell which request answers it.
#[derive(Default)]
struct Model {
    /// Type → (nonce, version) of the last response.
    sent: BTreeMap<String, (String, String)>,
    nonces: u64,
}

impl Model {
    /// A response went out: check it against `snapshot` and the names
    /// asked for (`None`: the session's, unknown here), then remember it.
    fn sent(
        &mut self,
        push: &remora_operator::discovery::session::Push,
        snapshot: &Snapshot,
        names: Option<&BTreeSet<String>>,
    ) {
        let r = &push.response;
        let typed = snapshot
            .of_type(&r.type_url)
            .unwrap_or_else(|| panic!("a response of a type not served: {:?}", r.type_url));
        assert_eq!(r.version_info, typed.version, "the snapshot's version");
        self.nonces += 1;
        assert_eq!(
            r.nonce,
            format!("{NONCE_PREFIX}-{}", self.nonces),
            "the next nonce"
        );
        let distinct: BTreeSet<&[u8]> = r.resources.iter().map(|a| a.value.as_slice()).collect();
        assert_eq!(distinct.len(), r.resources.len(), "a resource sent twice");
        let scope: BTreeSet<&[u8]> = typed
            .resources
            .values()
            .map(|a| a.value.as_slice())
            .collect();
        assert!(distinct.is_subset(&scope), "a resource outside the scope");
        match names {
            Some(names) if names.is_empty() => {
                assert_eq!(r.resources.len(), scope.len(), "all, for no names");
                assert_eq!(push.out_of_scope, 0);
            }
            Some(names) => {
                let named: BTreeSet<&[u8]> = names
                    .iter()
                    .filter_map(|n| typed.resources.get(n))
                    .map(|a| a.value.as_slice())
                    .collect();
                assert_eq!(distinct, named, "exactly the named resources in scope");
                assert_eq!(
                    push.out_of_scope,
                    names.len()
                        - names
                            .iter()
                            .filter(|n| typed.resources.contains_key(*n))
                            .count(),
                    "names outside the scope counted"
                );
            }
            None => {}
        }
        self.sent.insert(
            r.type_url.clone(),
            (r.nonce.clone(), r.version_info.clone()),
        );
    }
}

/// The requests of one ADS stream (see the module docs).
pub fn discovery_request(data: &[u8]) {
    serve(data);
}

/// How far a stream got: refused at once, or how many requests were
/// served, and whether it ended on a refused one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    Nothing,
    Refused,
    Requests { served: usize, refused: bool },
}

/// [`discovery_request`], saying how far the stream got.
pub fn serve(data: &[u8]) -> Served {
    let w = world();
    let mut data = data;
    let Some(first) = next_request(&mut data) else {
        return Served::Nothing;
    };
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
            assert!(
                status.message().len() <= MAX_STATUS_MESSAGE,
                "a refusal of {} bytes",
                status.message().len()
            );
            return Served::Refused;
        }
    }
    let mut session = Session::new(NONCE_PREFIX);
    let mut model = Model::default();
    let mut next = Some(first);
    let mut served = 0;
    while let Some(req) = next.take() {
        let type_url = req.type_url.clone();
        let names: BTreeSet<String> = req.resource_names.iter().cloned().collect();
        let answers = (!req.response_nonce.is_empty())
            .then(|| model.sent.get(&type_url))
            .flatten()
            .filter(|(nonce, _)| *nonce == req.response_nonce)
            .map(|(_, version)| version.clone());
        let nonce_given = !req.response_nonce.is_empty();
        let nack = req.error_detail.is_some();
        let outcome = match session.on_request(req, &w.before) {
            Ok(o) => o,
            Err(e) => {
                assert!(
                    !resources::TYPES.contains(&type_url.as_str()),
                    "a served type refused: {e}"
                );
                let status = e.status();
                assert_eq!(status.code(), tonic::Code::InvalidArgument);
                assert!(status.message().len() <= MAX_STATUS_MESSAGE);
                // The stream ends.
                return Served::Requests {
                    served,
                    refused: true,
                };
            }
        };
        assert_eq!(outcome.type_url, type_url);
        match (&outcome.reply, answers) {
            (Reply::Ack { version }, Some(sent)) if !nack => assert_eq!(*version, sent),
            (Reply::Nack { version, detail }, Some(sent)) if nack => {
                assert_eq!(*version, sent);
                assert!(detail.len() <= MAX_NACK_DETAIL + '…'.len_utf8());
            }
            (Reply::Stale, None) if nonce_given => {
                assert!(outcome.push.is_none(), "a stale request answered")
            }
            (Reply::Request | Reply::Resumed { .. }, None) if !nonce_given => {}
            (reply, answers) => panic!(
                "{reply:?} for a request answering {answers:?} (nonce given: {nonce_given}, error detail: {nack})"
            ),
        }
        if let Reply::Resumed { version } = &outcome.reply {
            assert!(outcome.push.is_none());
            let typed = w.before.of_type(&type_url).expect("served");
            assert_eq!(*version, typed.version, "resumed from another version");
        }
        if let Some(p) = &outcome.push {
            model.sent(p, &w.before, Some(&names));
        }
        served += 1;
        next = next_request(&mut data);
    }
    // The registry changes: what the stream pushes.
    let mut types = BTreeSet::new();
    for p in session.push(&w.after) {
        assert!(
            types.insert(p.response.type_url.clone()),
            "one response per type"
        );
        model.sent(&p, &w.after, None);
    }
    assert!(session.push(&w.after).is_empty(), "sent again, unchanged");
    Served::Requests {
        served,
        refused: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds reach what they are meant to: past admission, through
    /// every request, or refused where they should be.
    #[test]
    fn the_seeds_reach_their_part_of_the_server() {
        let served = |n, refused| Served::Requests { served: n, refused };
        for (name, expected) in [
            ("empty", Served::Nothing),
            ("first-request.bin", served(1, false)),
            ("ack.bin", served(8, false)),
            ("nack.bin", served(2, false)),
            ("stale.bin", served(5, false)),
            ("resume.bin", served(3, false)),
            ("many-names.bin", served(1, false)),
            ("unknown-type.bin", served(0, true)),
            ("unknown-type-later.bin", served(1, true)),
            ("other-pod.bin", Served::Refused),
            ("other-namespace.bin", Served::Refused),
            ("other-ip.bin", Served::Refused),
            ("unknown-pod.bin", Served::Refused),
            ("bad-node.bin", Served::Refused),
            ("no-node.bin", Served::Refused),
        ] {
            assert_eq!(
                serve(&crate::seed("discovery_request", name)),
                expected,
                "{name}"
            );
        }
    }
}
