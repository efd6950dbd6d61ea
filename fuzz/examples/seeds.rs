//! Writes the seed inputs of the `discovery_request`, `discovery_delta`
//! and `xds_response` fuzz targets (fuzz/src/discovery.rs,
//! fuzz/src/discovery_delta.rs and fuzz/src/xds_proxy.rs say what an input
//! is) under the directory given, by default fuzz/corpus:
//! `cargo run -p remora-fuzz --example seeds`. The versions in the
//! discovery seeds are the fixed world's, so ACKs and resumes reach past
//! the nonce check.

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::rpc::Status;
use std::path::{Path, PathBuf};

use prost::Message;
use remora_fuzz::discovery::{NONCE_PREFIX, world};
use remora_operator::discovery::resources::{CLUSTER, ENDPOINTS, LISTENER, POD_ANNOTATIONS};

const WEB0: &str = "sidecar~10.0.0.7~web-0.shop~shop.svc.cluster.local";
const CART: &str = "outbound|80||cart.shop.svc.cluster.local";

fn req(t: &str, version: &str, nonce: u64, names: &[&str]) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: t.into(),
        version_info: version.into(),
        response_nonce: if nonce == 0 {
            String::new()
        } else {
            format!("{NONCE_PREFIX}-{nonce}")
        },
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    }
}

fn first(node: &str, r: DiscoveryRequest) -> DiscoveryRequest {
    DiscoveryRequest {
        node: Some(Node {
            id: node.into(),
            cluster: "web.shop".into(),
            ..Default::default()
        }),
        ..r
    }
}

fn stream(reqs: &[DiscoveryRequest]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in reqs {
        r.encode_length_delimited(&mut out).expect("a Vec grows");
    }
    out
}

fn write(dir: &Path, seeds: Vec<(&str, Vec<u8>)>) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, bytes) in seeds {
        let path = dir.join(name);
        std::fs::write(&path, bytes)?;
        println!("{}", path.display());
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let dir = std::env::args().nth(1).map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus"),
        PathBuf::from,
    );
    write(&dir.join("discovery_request"), discovery_request())?;
    write(&dir.join("discovery_delta"), discovery_delta())?;
    write(&dir.join("xds_response"), xds_response())
}

fn delta(t: &str, sub: &[&str], unsub: &[&str], nonce: u64) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: t.into(),
        resource_names_subscribe: sub.iter().map(|n| n.to_string()).collect(),
        resource_names_unsubscribe: unsub.iter().map(|n| n.to_string()).collect(),
        response_nonce: if nonce == 0 {
            String::new()
        } else {
            format!("{NONCE_PREFIX}-{nonce}")
        },
        ..Default::default()
    }
}

fn delta_first(node: &str, r: DeltaDiscoveryRequest) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: Some(Node {
            id: node.into(),
            cluster: "web.shop".into(),
            ..Default::default()
        }),
        ..r
    }
}

fn discovery_delta() -> Vec<(&'static str, Vec<u8>)> {
    let w = world();
    // What web-0 holds of type `t`, as the world's snapshot has it.
    let held = |t: &str| {
        w.before
            .of_type(t)
            .expect("served")
            .versions
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect()
    };
    let nack = DeltaDiscoveryRequest {
        error_detail: Some(Status {
            code: 3,
            message: "Proto constraint validation failed: cluster outbound|80: bad".into(),
            details: vec![],
        }),
        ..delta(CLUSTER, &[], &[], 1)
    };
    let names: Vec<String> = (0..=remora_operator::discovery::delta::MAX_NAMES)
        .map(|i| format!("n{i}"))
        .collect();
    let too_many: Vec<&str> = names.iter().map(String::as_str).collect();
    let seeds: Vec<(&str, Vec<DeltaDiscoveryRequest>)> = vec![
        (
            "first-request.bin",
            vec![delta_first(WEB0, delta(CLUSTER, &[], &[], 0))],
        ),
        (
            // As Envoy and its agent subscribe, each response ACKed.
            "ack.bin",
            vec![
                delta_first(WEB0, delta(CLUSTER, &[], &[], 0)),
                delta(POD_ANNOTATIONS, &[], &[], 0),
                delta(CLUSTER, &[], &[], 1),
                delta(POD_ANNOTATIONS, &[], &[], 2),
                delta(ENDPOINTS, &[CART], &[], 0),
                delta(ENDPOINTS, &[], &[], 3),
                delta(LISTENER, &[], &[], 0),
                delta(LISTENER, &[], &[], 4),
            ],
        ),
        (
            "nack.bin",
            vec![delta_first(WEB0, delta(CLUSTER, &[], &[], 0)), nack],
        ),
        (
            // A reconnecting agent names what Envoy holds: one stale.
            "resume.bin",
            vec![
                delta_first(
                    WEB0,
                    DeltaDiscoveryRequest {
                        initial_resource_versions: held(CLUSTER),
                        ..delta(CLUSTER, &[], &[], 0)
                    },
                ),
                DeltaDiscoveryRequest {
                    initial_resource_versions: held(ENDPOINTS),
                    ..delta(ENDPOINTS, &[CART], &[], 0)
                },
                DeltaDiscoveryRequest {
                    initial_resource_versions: [(
                        "outbound_15001".to_string(),
                        "stale".to_string(),
                    )]
                    .into(),
                    ..delta(LISTENER, &[], &[], 0)
                },
            ],
        ),
        (
            // Names in and out of the scope, then the wildcard dropped.
            "unsubscribe.bin",
            vec![
                delta_first(WEB0, delta(ENDPOINTS, &[CART, "zz", "*"], &[], 0)),
                delta(ENDPOINTS, &[], &[CART], 1),
                delta(ENDPOINTS, &[CART], &["*", "zz"], 0),
                delta(ENDPOINTS, &["*"], &[], 0),
            ],
        ),
        (
            // Answers to responses never sent, or answered already.
            "stale.bin",
            vec![
                delta_first(WEB0, delta(CLUSTER, &[], &[], 0)),
                delta(CLUSTER, &[], &[], 1),
                delta(CLUSTER, &[], &[], 1),
            ],
        ),
        (
            "too-many-names.bin",
            vec![
                delta_first(WEB0, delta(CLUSTER, &[], &[], 0)),
                delta(ENDPOINTS, &too_many, &[], 0),
            ],
        ),
        (
            "unknown-type.bin",
            vec![delta_first(
                WEB0,
                delta(
                    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
                    &[],
                    &[],
                    0,
                ),
            )],
        ),
        (
            "other-pod.bin",
            vec![delta_first(
                "sidecar~10.0.0.9~db-0.shop~shop.svc.cluster.local",
                delta(CLUSTER, &[], &[], 0),
            )],
        ),
    ];
    seeds
        .into_iter()
        .map(|(name, reqs)| {
            let mut out = Vec::new();
            for r in &reqs {
                r.encode_length_delimited(&mut out).expect("a Vec grows");
            }
            (name, out)
        })
        .chain([("empty", Vec::new())])
        .collect()
}

fn discovery_request() -> Vec<(&'static str, Vec<u8>)> {
    let w = world();
    let v = |t: &str| w.before.of_type(t).expect("served").version.clone();
    let (cds, eds, lds, pod) = (v(CLUSTER), v(ENDPOINTS), v(LISTENER), v(POD_ANNOTATIONS));
    let nack = DiscoveryRequest {
        error_detail: Some(Status {
            code: 3,
            message: "Proto constraint validation failed: cluster outbound|80: bad".into(),
            details: vec![],
        }),
        ..req(CLUSTER, "", 1, &[])
    };
    let mut many = vec![CART; 1_000];
    many.extend(["outbound|81||cart.shop.svc.cluster.local", "*", ""]);
    let seeds: Vec<(&str, Vec<DiscoveryRequest>)> = vec![
        (
            "first-request.bin",
            vec![first(WEB0, req(CLUSTER, "", 0, &[]))],
        ),
        (
            // As Envoy and its agent subscribe, each response ACKed.
            "ack.bin",
            vec![
                first(WEB0, req(CLUSTER, "", 0, &[])),
                req(POD_ANNOTATIONS, "", 0, &[]),
                req(CLUSTER, &cds, 1, &[]),
                req(POD_ANNOTATIONS, &pod, 2, &[]),
                req(ENDPOINTS, "", 0, &[CART]),
                req(ENDPOINTS, &eds, 3, &[CART]),
                req(LISTENER, "", 0, &[]),
                req(LISTENER, &lds, 4, &[]),
            ],
        ),
        (
            "nack.bin",
            vec![first(WEB0, req(CLUSTER, "", 0, &[])), nack.clone()],
        ),
        (
            // Answers to responses never sent, or not the last one.
            "stale.bin",
            vec![
                first(WEB0, req(CLUSTER, "", 0, &[])),
                req(CLUSTER, &cds, 7, &[]),
                req(ENDPOINTS, "", 1, &[CART]),
                req(CLUSTER, &cds, 1, &[]),
                req(CLUSTER, &cds, 1, &[]),
            ],
        ),
        (
            // A reconnecting agent replays what Envoy holds.
            "resume.bin",
            vec![
                first(WEB0, req(CLUSTER, &cds, 0, &[])),
                req(ENDPOINTS, &eds, 0, &[CART]),
                req(LISTENER, "stale-version", 0, &[]),
            ],
        ),
        (
            "other-pod.bin",
            vec![first(
                "sidecar~10.0.0.9~db-0.shop~shop.svc.cluster.local",
                req(CLUSTER, "", 0, &[]),
            )],
        ),
        (
            "other-namespace.bin",
            vec![first(
                "sidecar~10.0.0.7~web-0.evil~evil.svc.cluster.local",
                req(CLUSTER, "", 0, &[]),
            )],
        ),
        (
            "other-ip.bin",
            vec![first(
                "sidecar~10.0.0.8~web-0.shop~shop.svc.cluster.local",
                req(CLUSTER, "", 0, &[]),
            )],
        ),
        (
            "unknown-pod.bin",
            vec![first(
                "sidecar~10.0.0.7~web-9.shop~shop.svc.cluster.local",
                req(CLUSTER, "", 0, &[]),
            )],
        ),
        (
            "bad-node.bin",
            vec![first(
                "router~10.0.0.7~web-0.shop~shop",
                req(CLUSTER, "", 0, &[]),
            )],
        ),
        ("no-node.bin", vec![req(CLUSTER, "", 0, &[])]),
        (
            "unknown-type.bin",
            vec![first(
                WEB0,
                req(
                    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
                    "",
                    0,
                    &[],
                ),
            )],
        ),
        (
            "unknown-type-later.bin",
            vec![
                first(WEB0, req(CLUSTER, "", 0, &[])),
                req(
                    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
                    "",
                    0,
                    &["default"],
                ),
            ],
        ),
        (
            // One name 1,000 times, names outside the scope, the wildcard.
            "many-names.bin",
            vec![first(WEB0, req(ENDPOINTS, "", 0, &many))],
        ),
    ];
    seeds
        .into_iter()
        .map(|(name, reqs)| (name, stream(&reqs)))
        .chain([("empty", Vec::new())])
        .collect()
}

/// xds_response events: tag 0 a request from Envoy, 1 a response from
/// the server, 2 a reconnect, each message length-delimited.
fn tagged(tag: u8, m: &impl Message) -> Vec<u8> {
    let mut out = vec![tag];
    m.encode_length_delimited(&mut out).expect("a Vec grows");
    out
}

fn envoy(r: DiscoveryRequest) -> Vec<u8> {
    tagged(0, &r)
}

fn server(r: DiscoveryResponse) -> Vec<u8> {
    tagged(1, &r)
}

fn reconnect() -> Vec<u8> {
    vec![2]
}

fn resp(t: &str, version: &str, nonce: &str, resources: Vec<Any>) -> DiscoveryResponse {
    DiscoveryResponse {
        type_url: t.into(),
        version_info: version.into(),
        nonce: nonce.into(),
        resources,
        ..Default::default()
    }
}

fn annotations(pairs: &[(&str, &str)]) -> Any {
    Any {
        type_url: POD_ANNOTATIONS.into(),
        value: remora_proto::remora::v1::PodAnnotations {
            annotations: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
        .encode_to_vec(),
    }
}

fn envoy_req(t: &str, version: &str, nonce: &str, names: &[&str]) -> DiscoveryRequest {
    DiscoveryRequest {
        response_nonce: nonce.into(),
        ..req(t, version, 0, names)
    }
}

fn xds_response() -> Vec<(&'static str, Vec<u8>)> {
    let nack = |t: &str, version: &str, nonce: &str| DiscoveryRequest {
        error_detail: Some(Status {
            code: 3,
            message: "refused".into(),
            details: vec![],
        }),
        ..envoy_req(t, version, nonce, &[])
    };
    let stop = annotations(&[("remora.dev/stop", "true")]);
    let seeds = vec![
        (
            // Envoy subscribes, the server answers, Envoy ACKs and NACKs,
            // the agent gets its pod's annotations.
            "subscribe-ack-nack.bin",
            vec![
                envoy(first(WEB0, envoy_req(CLUSTER, "", "", &[]))),
                server(resp(POD_ANNOTATIONS, "a1", "n1", vec![stop.clone()])),
                server(resp(CLUSTER, "c1", "n2", vec![])),
                envoy(envoy_req(CLUSTER, "c1", "n2", &[])),
                envoy(envoy_req(ENDPOINTS, "", "", &[CART])),
                server(resp(ENDPOINTS, "e1", "n3", vec![])),
                envoy(nack(ENDPOINTS, "", "n3")),
            ],
        ),
        (
            // Pod annotations the agent refuses: none, two, not a message.
            "bad-pod-annotations.bin",
            vec![
                envoy(first(WEB0, envoy_req(CLUSTER, "", "", &[]))),
                server(resp(POD_ANNOTATIONS, "a1", "n1", vec![])),
                server(resp(
                    POD_ANNOTATIONS,
                    "a2",
                    "n2",
                    vec![stop.clone(), stop.clone()],
                )),
                server(resp(
                    POD_ANNOTATIONS,
                    "a3",
                    "n3",
                    vec![Any {
                        type_url: POD_ANNOTATIONS.into(),
                        value: vec![0x0a, 0xff, 0xff],
                    }],
                )),
            ],
        ),
        (
            // The upstream reconnects: the replay, then answers to the old
            // stream's nonces.
            "reconnect.bin",
            vec![
                envoy(first(WEB0, envoy_req(CLUSTER, "", "", &[]))),
                server(resp(CLUSTER, "c1", "n1", vec![])),
                envoy(envoy_req(LISTENER, "", "", &[])),
                reconnect(),
                envoy(envoy_req(CLUSTER, "c1", "n1", &[])),
                server(resp(CLUSTER, "c2", "m1", vec![])),
                envoy(envoy_req(CLUSTER, "c2", "m1", &[])),
                reconnect(),
            ],
        ),
        (
            // Responses of types Envoy never asked for, or of none.
            "unasked-type.bin",
            vec![
                envoy(first(WEB0, envoy_req(CLUSTER, "", "", &[]))),
                server(resp(LISTENER, "l1", "n1", vec![])),
                server(resp("", "", "", vec![])),
                envoy(envoy_req(LISTENER, "l1", "n1", &[])),
            ],
        ),
        (
            "too-many-types.bin",
            (0..=32)
                .map(|i| envoy(envoy_req(&format!("type.googleapis.com/t{i}"), "", "", &[])))
                .collect(),
        ),
        ("no-type.bin", vec![envoy(envoy_req("", "", "", &[]))]),
    ];
    seeds
        .into_iter()
        .map(|(name, evs)| (name, evs.concat()))
        .chain([("empty", Vec::new())])
        .collect()
}
