//! What one proxy may see, pure: from its `remora.dev/outbound` and the
//! [`Registry`], its listeners (LDS), clusters (CDS) and load assignments
//! (EDS), for the Services it declared and nothing else.
//!
//! - A host that names a Service the registry knows (`cart.shop:80`, see
//!   [`ServiceHost::parse`]): a listener on `127.0.0.1:<port>` with an HTTP
//!   connection manager (codec AUTO: HTTP/1.1, h2c and gRPC) routing to the
//!   Service port's EDS cluster, balanced per request; a TCP proxy instead
//!   when the port's `appProtocol` or name says TCP ([`Protocol::of`]).
//! - Any other host: a TCP proxy to a STRICT_DNS cluster, named and shaped
//!   as the agent's static mode makes it (agent/src/bootstrap.rs), so a pod
//!   moving to discovery keeps its static upstreams as they were. That
//!   includes a host of Service shape with no such Service (`example.org`
//!   reads as Service `example` of namespace `org`): it stays what it was
//!   until that Service exists, and the proxy depends on it meanwhile, so
//!   it moves to EDS when the Service appears.
//!
//! The HTTP clusters speak upstream what the client spoke downstream
//! (`use_downstream_protocol_config`), as the agent's inbound cluster does:
//! gRPC and h2c stay HTTP/2 and HTTP/1.1 stays HTTP/1.1 without trusting
//! `appProtocol` to be declared, and an HTTP/1.1 client of a gRPC-only port
//! fails as it would without the mesh.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::{Cluster, cluster};
use envoy_types::pb::envoy::config::core::v3::{
    Address, AggregatedConfigSource, ApiVersion, ConfigSource, Http1ProtocolOptions,
    Http2ProtocolOptions, SocketAddress, TrafficDirection, address, config_source, socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::config::listener::v3::{Filter, FilterChain, Listener, filter};
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route, route_action,
    route_match,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    HttpProtocolOptions, http_protocol_options,
};
use envoy_types::pb::google::protobuf::{Any, Duration};
use envoy_types::util::pack_any;
use prost::Message;
use remora_contract::discovery::{ServiceHost, cluster_name};
use remora_contract::pod::HCM_DELAYED_CLOSE_TIMEOUT;
use remora_contract::traffic::OutboundSpec;
use sha2::{Digest, Sha256};

use super::registry::{Protocol, Registry};

pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINTS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// The pod's annotations, for its agent (which keeps them from Envoy).
pub const POD_ANNOTATIONS: &str = remora_contract::discovery::POD_ANNOTATIONS_TYPE;

/// The types served, in the order they are pushed: the agent's first (a
/// Job's stop request should not wait for Envoy's), then as Envoy wants
/// them (clusters before their endpoints and before the listeners that use
/// them).
pub const TYPES: [&str; 4] = [POD_ANNOTATIONS, CLUSTER, ENDPOINTS, LISTENER];

/// As the agent's static clusters.
const CONNECT_TIMEOUT: Duration = Duration {
    seconds: 1,
    nanos: 0,
};

/// Resources of one type by name, and their version: a digest of their
/// content, so an unchanged type keeps its version and is not re-sent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Typed {
    pub version: String,
    pub resources: BTreeMap<String, Any>,
}

impl Typed {
    fn new(resources: BTreeMap<String, Any>) -> Self {
        let mut h = Sha256::new();
        for (name, any) in &resources {
            h.update((name.len() as u64).to_be_bytes());
            h.update(name.as_bytes());
            h.update((any.value.len() as u64).to_be_bytes());
            h.update(&any.value);
        }
        let d = h.finalize();
        let version = d[..8].iter().map(|b| format!("{b:02x}")).collect();
        Self { version, resources }
    }
}

/// Everything one proxy may see.
#[derive(Debug, Clone, Default, PartialEq)]
/// What comes from the outbound annotation is shared (`Arc`): proxies with
/// the same annotation share one copy (see [`super::push::Discovery::snapshot`]).
pub struct Snapshot {
    pub listeners: Arc<Typed>,
    pub clusters: Arc<Typed>,
    pub endpoints: Arc<Typed>,
    /// Its pod's annotations, for its agent: one resource named after the pod.
    pub pod: Typed,
    /// The Services it declared (known or not yet): a change to any other
    /// does not concern it.
    pub services: Arc<BTreeSet<ServiceHost>>,
    /// Entries of its annotation that were not used, and why.
    pub skipped: Vec<String>,
}

impl Snapshot {
    pub fn of_type(&self, type_url: &str) -> Option<&Typed> {
        match type_url {
            LISTENER => Some(self.listeners.as_ref()),
            CLUSTER => Some(self.clusters.as_ref()),
            ENDPOINTS => Some(self.endpoints.as_ref()),
            POD_ANNOTATIONS => Some(&self.pod),
            _ => None,
        }
    }
}

/// The resources of a proxy whose pod carries `outbound`
/// (`remora.dev/outbound`, comma-separated `PORT:HOST:PORT`).
pub fn generate(registry: &Registry, outbound: Option<&str>, domain: &str) -> Snapshot {
    let mut listeners = BTreeMap::new();
    let mut clusters = BTreeMap::new();
    let mut endpoints = BTreeMap::new();
    let mut services = BTreeSet::new();
    let mut skipped = Vec::new();
    let entries = outbound
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty());
    for entry in entries {
        let spec: OutboundSpec = match entry.parse() {
            Ok(s) => s,
            Err(e) => {
                skipped.push(e);
                continue;
            }
        };
        let name = format!("outbound_{}", spec.port);
        if listeners.contains_key(&name) {
            skipped.push(format!("{entry:?}: port {} is used twice", spec.port));
            continue;
        }
        let host = ServiceHost::parse(&spec.host, domain);
        // A change to the Service (its creation included) concerns it.
        services.extend(host.clone());
        match host.filter(|h| registry.service(h).is_some()) {
            Some(host) => {
                let fqdn = host.fqdn(domain);
                let cluster = cluster_name(&fqdn, spec.upstream_port);
                // A port the Service does not declare has no endpoints.
                let protocol = registry
                    .service(&host)
                    .and_then(|s| s.port(spec.upstream_port))
                    .map_or(Protocol::Http, |p| p.protocol);
                let filter = match protocol {
                    Protocol::Http => http_filter_chain(&name, &cluster),
                    Protocol::Tcp => tcp_filter(&name, &cluster),
                };
                listeners.insert(name.clone(), pack_any(listener(&name, spec.port, filter)));
                clusters.insert(cluster.clone(), pack_any(eds_cluster(&cluster, protocol)));
                let eps = registry.endpoints(&host, spec.upstream_port);
                endpoints.insert(cluster.clone(), pack_any(load_assignment(&cluster, &eps)));
            }
            None => {
                let cluster = format!(
                    "outbound|{}|{}|{}",
                    spec.port, spec.host, spec.upstream_port
                );
                listeners.insert(
                    name.clone(),
                    pack_any(listener(&name, spec.port, tcp_filter(&name, &cluster))),
                );
                clusters.insert(
                    cluster.clone(),
                    pack_any(dns_cluster(&cluster, &spec.host, spec.upstream_port)),
                );
            }
        }
    }
    Snapshot {
        listeners: Arc::new(Typed::new(listeners)),
        clusters: Arc::new(Typed::new(clusters)),
        endpoints: Arc::new(Typed::new(endpoints)),
        pod: Typed::default(),
        services: Arc::new(services),
        skipped,
    }
}

/// The [`POD_ANNOTATIONS`] resource of pod `namespace/name`.
pub fn pod_annotations(
    namespace: &str,
    name: &str,
    annotations: &BTreeMap<String, String>,
) -> Typed {
    let msg = remora_proto::remora::v1::PodAnnotations {
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    };
    let any = Any {
        type_url: POD_ANNOTATIONS.into(),
        value: msg.encode_to_vec(),
    };
    Typed::new(BTreeMap::from([(format!("{namespace}/{name}"), any)]))
}

fn socket(ip: &str, port: u16) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: ip.to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(port))),
            ..Default::default()
        })),
    }
}

fn listener(name: &str, port: u16, filter: Filter) -> Listener {
    Listener {
        name: name.to_string(),
        // The app reaches its sidecar on loopback only.
        address: Some(socket("127.0.0.1", port)),
        // OUTBOUND listeners keep serving while inbound drains.
        traffic_direction: TrafficDirection::Outbound as i32,
        filter_chains: vec![FilterChain {
            filters: vec![filter],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn tcp_filter(name: &str, cluster: &str) -> Filter {
    let proxy = TcpProxy {
        stat_prefix: name.to_string(),
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(cluster.to_string())),
        ..Default::default()
    };
    Filter {
        name: "envoy.filters.network.tcp_proxy".into(),
        config_type: Some(filter::ConfigType::TypedConfig(pack_any(proxy))),
    }
}

fn http_filter_chain(name: &str, cluster: &str) -> Filter {
    let route = Route {
        r#match: Some(RouteMatch {
            path_specifier: Some(route_match::PathSpecifier::Prefix("/".into())),
            ..Default::default()
        }),
        action: Some(route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster.into())),
            // No route timeout: the sidecar must not cut the app's long
            // requests (gRPC streams included), as inbound.
            timeout: Some(Duration::default()),
            ..Default::default()
        })),
        ..Default::default()
    };
    let hcm = HttpConnectionManager {
        stat_prefix: name.to_string(),
        codec_type: http_connection_manager::CodecType::Auto as i32,
        route_specifier: Some(http_connection_manager::RouteSpecifier::RouteConfig(
            RouteConfiguration {
                name: name.to_string(),
                virtual_hosts: vec![VirtualHost {
                    name: "upstream".into(),
                    domains: vec!["*".into()],
                    routes: vec![route],
                    ..Default::default()
                }],
                ..Default::default()
            },
        )),
        // The drain's idle close reaches these listeners too (it is
        // Envoy-wide): no window in which a closing connection looks open.
        delayed_close_timeout: Some(Duration {
            seconds: HCM_DELAYED_CLOSE_TIMEOUT.as_secs() as i64,
            nanos: HCM_DELAYED_CLOSE_TIMEOUT.subsec_nanos() as i32,
        }),
        http_filters: vec![HttpFilter {
            name: "envoy.filters.http.router".into(),
            config_type: Some(http_filter::ConfigType::TypedConfig(pack_any(
                Router::default(),
            ))),
            ..Default::default()
        }],
        ..Default::default()
    };
    Filter {
        name: "envoy.filters.network.http_connection_manager".into(),
        config_type: Some(filter::ConfigType::TypedConfig(pack_any(hcm))),
    }
}

fn eds_cluster(name: &str, protocol: Protocol) -> Cluster {
    let mut options = HashMap::new();
    if protocol == Protocol::Http {
        let o = HttpProtocolOptions {
            upstream_protocol_options: Some(
                http_protocol_options::UpstreamProtocolOptions::UseDownstreamProtocolConfig(
                    http_protocol_options::UseDownstreamHttpConfig {
                        http_protocol_options: Some(Http1ProtocolOptions::default()),
                        http2_protocol_options: Some(Http2ProtocolOptions::default()),
                        ..Default::default()
                    },
                ),
            ),
            ..Default::default()
        };
        options.insert(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".to_string(),
            pack_any(o),
        );
    }
    Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ConfigSource {
                resource_api_version: ApiVersion::V3 as i32,
                config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
                    AggregatedConfigSource {},
                )),
                ..Default::default()
            }),
            ..Default::default()
        }),
        connect_timeout: Some(CONNECT_TIMEOUT),
        typed_extension_protocol_options: options,
        ..Default::default()
    }
}

fn dns_cluster(name: &str, host: &str, port: u16) -> Cluster {
    Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::StrictDns as i32,
        )),
        dns_lookup_family: cluster::DnsLookupFamily::V4Preferred as i32,
        connect_timeout: Some(CONNECT_TIMEOUT),
        load_assignment: Some(load_assignment_of(name, [(host.to_string(), port)])),
        ..Default::default()
    }
}

fn load_assignment(name: &str, eps: &BTreeSet<std::net::SocketAddr>) -> ClusterLoadAssignment {
    load_assignment_of(name, eps.iter().map(|a| (a.ip().to_string(), a.port())))
}

fn load_assignment_of(
    name: &str,
    eps: impl IntoIterator<Item = (String, u16)>,
) -> ClusterLoadAssignment {
    let lb_endpoints: Vec<LbEndpoint> = eps
        .into_iter()
        .map(|(ip, port)| LbEndpoint {
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                address: Some(socket(&ip, port)),
                ..Default::default()
            })),
            ..Default::default()
        })
        .collect();
    ClusterLoadAssignment {
        cluster_name: name.to_string(),
        endpoints: if lb_endpoints.is_empty() {
            Vec::new()
        } else {
            vec![LocalityLbEndpoints {
                lb_endpoints,
                ..Default::default()
            }]
        },
        ..Default::default()
    }
}

/// Decodes a resource of a snapshot (tests, and logs).
pub fn decode<M: Message + Default>(any: &Any) -> Option<M> {
    M::decode(any.value.as_slice()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::registry::{ServiceInfo, ServicePort, SliceInfo};

    const DOMAIN: &str = "cluster.local";

    fn registry() -> Registry {
        let mut r = Registry::default();
        for (name, port, protocol) in [("cart", 80, Protocol::Http), ("db", 5432, Protocol::Tcp)] {
            let host = ServiceHost {
                name: name.into(),
                namespace: "shop".into(),
            };
            r.apply_service(
                host.clone(),
                ServiceInfo {
                    ports: vec![ServicePort {
                        port,
                        name: "p".into(),
                        protocol,
                    }],
                },
            );
            r.apply_slice(
                ("shop".into(), name.into()),
                SliceInfo {
                    service: Some(host),
                    ports: [("p".to_string(), 8000)].into(),
                    ready: [
                        "10.0.0.1".parse().expect("ip"),
                        "10.0.0.2".parse().expect("ip"),
                    ]
                    .into(),
                },
            );
        }
        r
    }

    fn filter_name(l: &Any) -> String {
        let l: Listener = decode(l).expect("listener");
        l.filter_chains[0].filters[0].name.clone()
    }

    #[test]
    fn a_proxy_sees_only_what_it_declared() {
        let r = registry();
        let s = generate(
            &r,
            Some(
                "15001:cart.shop:80, 15002:db.shop.svc.cluster.local:5432,15003:api.example.com:443",
            ),
            DOMAIN,
        );
        assert_eq!(
            s.listeners.resources.keys().collect::<Vec<_>>(),
            ["outbound_15001", "outbound_15002", "outbound_15003"]
        );
        assert_eq!(
            filter_name(&s.listeners.resources["outbound_15001"]),
            "envoy.filters.network.http_connection_manager"
        );
        assert_eq!(
            filter_name(&s.listeners.resources["outbound_15002"]),
            "envoy.filters.network.tcp_proxy"
        );
        assert_eq!(
            s.clusters.resources.keys().collect::<Vec<_>>(),
            [
                "outbound|15003|api.example.com|443",
                "outbound|5432||db.shop.svc.cluster.local",
                "outbound|80||cart.shop.svc.cluster.local",
            ]
        );
        let dns: Cluster =
            decode(&s.clusters.resources["outbound|15003|api.example.com|443"]).expect("cluster");
        assert_eq!(
            dns.cluster_discovery_type,
            Some(cluster::ClusterDiscoveryType::Type(
                cluster::DiscoveryType::StrictDns as i32
            ))
        );
        let cart: Cluster =
            decode(&s.clusters.resources["outbound|80||cart.shop.svc.cluster.local"])
                .expect("cluster");
        assert!(cart.eds_cluster_config.is_some());
        assert!(
            cart.typed_extension_protocol_options
                .contains_key("envoy.extensions.upstreams.http.v3.HttpProtocolOptions")
        );
        let cla: ClusterLoadAssignment =
            decode(&s.endpoints.resources["outbound|80||cart.shop.svc.cluster.local"])
                .expect("cla");
        assert_eq!(cla.endpoints[0].lb_endpoints.len(), 2);
        assert_eq!(s.services.len(), 2);
        assert!(s.skipped.is_empty());

        // A host of Service shape with no such Service is a static upstream,
        // until the Service exists.
        let ext = generate(&r, Some("15001:example.org:443"), DOMAIN);
        assert_eq!(
            ext.clusters.resources.keys().collect::<Vec<_>>(),
            ["outbound|15001|example.org|443"]
        );
        assert!(ext.endpoints.resources.is_empty());
        assert_eq!(ext.services.len(), 1, "it depends on Service example.org");

        // Nothing declared, nothing seen.
        let none = generate(&r, None, DOMAIN);
        assert!(none.listeners.resources.is_empty() && none.clusters.resources.is_empty());
    }

    #[test]
    fn versions_follow_content_per_type() {
        let mut r = registry();
        let a = generate(&r, Some("15001:cart.shop:80"), DOMAIN);
        assert_eq!(
            a,
            generate(&r, Some("15001:cart.shop:80"), DOMAIN),
            "deterministic"
        );
        let host = ServiceHost {
            name: "cart".into(),
            namespace: "shop".into(),
        };
        r.apply_slice(
            ("shop".into(), "cart".into()),
            SliceInfo {
                service: Some(host),
                ports: [("p".to_string(), 8000)].into(),
                ready: ["10.0.0.9".parse().expect("ip")].into(),
            },
        );
        let b = generate(&r, Some("15001:cart.shop:80"), DOMAIN);
        assert_eq!(a.listeners.version, b.listeners.version);
        assert_eq!(a.clusters.version, b.clusters.version);
        assert_ne!(a.endpoints.version, b.endpoints.version, "only EDS changed");
    }

    #[test]
    fn bad_entries_are_skipped_not_fatal() {
        let s = generate(
            &registry(),
            Some("nonsense,15001:cart.shop:80,15001:db.shop:5432,99999:x:1"),
            DOMAIN,
        );
        assert_eq!(s.listeners.resources.len(), 1);
        assert_eq!(s.skipped.len(), 3, "{:?}", s.skipped);
    }
}
