//! What one proxy may see, pure: from its `remora.dev/outbound` and the
//! [`Registry`], its listeners (LDS), clusters (CDS) and load assignments
//! (EDS), for the Services it declared and nothing else.
//!
//! - A host that names a Service the registry knows (`cart.shop:80`, see
//!   [`ServiceHost::parse`]): a listener on `127.0.0.1:<port>` with an HTTP
//!   connection manager (codec AUTO: HTTP/1.1, h2c and gRPC) routing to the
//!   Service port's EDS cluster, balanced per request; a TCP proxy instead
//!   when the port's `appProtocol` or name says TCP ([`Protocol::of`]).
//! - A host an ExternalService holds ([`super::external`]; a Service of
//!   that name wins): the same listener and an EDS cluster of its
//!   endpoints' addresses, by the protocol of its port (TCP for a port it
//!   does not declare). Addresses only: a DNS name stays a static upstream
//!   (below), so no external endpoint needs a DNS cluster. With the
//!   workload CA, an endpoint that declares a ServiceAccount runs
//!   remora-agent and is reached over mTLS accepting only that identity
//!   ([`external_reach`]); the others in plain text (or the app's own TLS).
//! - Any other host: a TCP proxy to a STRICT_DNS cluster, named and shaped
//!   as the agent's static mode makes it (agent/src/bootstrap.rs), so a pod
//!   moving to discovery keeps its static upstreams as they were. That
//!   includes a host of Service shape with no such Service (`example.org`
//!   reads as Service `example` of namespace `org`): it stays what it was
//!   until that Service exists, and the proxy depends on it meanwhile, so
//!   it moves to EDS when the Service appears.
//!
//! With the workload CA (the server knows the mesh's trust domain), a
//! Service port's cluster originates mTLS to its meshed endpoints and
//! plain text to the others, per endpoint ([`reach`], secure naming):
//!
//! - each endpoint of the load assignment is marked in its
//!   `envoy.transport_socket_match` metadata, `tlsMode: mtls` or
//!   `tlsMode: plaintext`, and the cluster's `transport_socket_matches`
//!   pick mTLS (presenting SDS `default`, verifying with `ROOTCA`, offering
//!   ALPN [`MTLS_ALPN`] so the server's sidecar terminates it) or a raw
//!   socket by that mark. The cluster's default transport socket is the
//!   same mTLS, so an endpoint without a mark is never reached in plain text;
//! - the mTLS accepts only the SPIFFE identities of [`accepted`]: the
//!   ServiceAccounts the Service declares (`remora.dev/identities`), else
//!   those of the meshed pods behind it. An endpoint whose pod runs under
//!   a ServiceAccount the Service does not declare is not sent at all, and
//!   if one is reached anyway (a stale load assignment, an address reused
//!   by another pod) its certificate fails the check.
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
    AggregatedConfigSource, ApiVersion, ConfigSource, Metadata, TrafficDirection, TransportSocket,
    config_source, transport_socket,
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
use envoy_types::pb::envoy::extensions::transport_sockets::raw_buffer::v3::RawBuffer;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    SubjectAltNameMatcher, UpstreamTlsContext, subject_alt_name_matcher,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher};
use envoy_types::pb::google::protobuf::{Any, Duration, Struct, UInt32Value, Value, value};
use envoy_types::util::pack_any;
use prost::Message;
use remora_contract::discovery::{ServiceHost, cluster_name};
use remora_contract::mesh::MTLS_ALPN;
use remora_contract::pod::HCM_DELAYED_CLOSE_TIMEOUT;
use remora_contract::traffic::OutboundSpec;
use remora_contract::workload_ca::spiffe_id;
use sha2::{Digest, Sha256};

use super::external::{EndpointMeta, external_key};
use super::inbound::ServedInbound;
use super::proto::{downstream_protocol_options, mesh_tls_context, socket};
use super::registry::{Backend, Protocol, Registry};
use super::withdrawal::{EndpointAddresses, Progress};

pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINTS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// The pod's annotations, for its agent (which keeps them from Envoy).
pub const POD_ANNOTATIONS: &str = remora_contract::discovery::POD_ANNOTATIONS_TYPE;

/// How the withdrawal of the pod's endpoints stands, for its agent
/// ([`super::withdrawal`]).
pub const WITHDRAWAL: &str = remora_contract::discovery::WITHDRAWAL_TYPE;

/// The types served, in the order they are pushed: the agent's first (a
/// Job's stop request should not wait for Envoy's), then as Envoy wants
/// them (clusters before their endpoints and before the listeners that use
/// them).
pub const TYPES: [&str; 5] = [POD_ANNOTATIONS, WITHDRAWAL, CLUSTER, ENDPOINTS, LISTENER];

/// As the agent's static clusters.
const CONNECT_TIMEOUT: Duration = Duration {
    seconds: 1,
    nanos: 0,
};

/// The endpoint metadata key Envoy matches `transport_socket_matches` on,
/// the field and its two values.
const TRANSPORT_SOCKET_MATCH: &str = "envoy.transport_socket_match";
const TLS_MODE: &str = "tlsMode";
const MTLS: &str = "mtls";
const PLAINTEXT: &str = "plaintext";

/// How a client's sidecar reaches one endpoint of a Service: the secure
/// naming rule, in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// mTLS, accepting only the Service's identities ([`accepted`]).
    Mtls,
    /// Plain text: the endpoint has no meshed sidecar on that port, and
    /// the Service declares no identities.
    Plaintext,
    /// Not sent: the Service declares identities and this endpoint is not
    /// a meshed pod running under one of them.
    Withheld,
}

/// How an endpoint behind `backend` is reached, `declared` being the
/// Service's `remora.dev/identities` (`None`: not declared). Called only
/// with the workload CA on; without it every endpoint is plain text.
pub fn reach(declared: Option<&BTreeSet<String>>, backend: &Backend) -> Reach {
    match (backend, declared) {
        (Backend::Meshed { service_account }, Some(ids)) if !ids.contains(service_account) => {
            Reach::Withheld
        }
        (Backend::Meshed { .. }, _) => Reach::Mtls,
        (Backend::Plain, Some(_)) => Reach::Withheld,
        (Backend::Plain, None) => Reach::Plaintext,
    }
}

/// The ServiceAccounts whose certificates a client accepts for a Service
/// port: the declared ones, else those of its meshed endpoints (Istio's
/// rule). A change to this set is a cluster change.
pub fn accepted<'a>(
    declared: Option<&BTreeSet<String>>,
    backends: impl IntoIterator<Item = &'a Backend>,
) -> BTreeSet<String> {
    match declared {
        Some(ids) => ids.clone(),
        None => backends
            .into_iter()
            .filter_map(|b| match b {
                Backend::Meshed { service_account } => Some(service_account.clone()),
                Backend::Plain => None,
            })
            .collect(),
    }
}

/// The mesh's mTLS for one Service port's cluster: the SPIFFE IDs it accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mtls {
    spiffe_ids: Vec<String>,
}

/// Resources of one type by name, and their version: a digest of their
/// content, so an unchanged type keeps its version and is not re-sent.
/// Each resource has a version of its own too (a digest of its encoding),
/// which delta xDS compares resource by resource.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Typed {
    pub version: String,
    pub resources: BTreeMap<String, Any>,
    /// Each resource's version, by name (the names of `resources`).
    pub versions: BTreeMap<String, String>,
}

impl Typed {
    pub fn new(resources: BTreeMap<String, Any>) -> Self {
        let digest = |bytes: &[u8]| -> String {
            Sha256::digest(bytes)[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        };
        let versions: BTreeMap<String, String> = resources
            .iter()
            .map(|(name, any)| (name.clone(), digest(&any.value)))
            .collect();
        // The type's version from the resources' own: each byte is hashed once.
        let mut h = Sha256::new();
        for (name, version) in &versions {
            h.update((name.len() as u64).to_be_bytes());
            h.update(name.as_bytes());
            h.update(version.as_bytes());
        }
        let d = h.finalize();
        let version = d[..8].iter().map(|b| format!("{b:02x}")).collect();
        Self {
            version,
            resources,
            versions,
        }
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
    /// How its pod's withdrawal stands, for its agent: one resource named
    /// after the pod while it is withdrawn, none otherwise.
    pub withdrawal: Typed,
    /// The addresses of each of its load assignments: what a proxy holding
    /// them may route to ([`super::withdrawal`]).
    pub addresses: Arc<EndpointAddresses>,
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
            WITHDRAWAL => Some(&self.withdrawal),
            _ => None,
        }
    }
}

/// The resources of a proxy whose pod carries `outbound`
/// (`remora.dev/outbound`, comma-separated `PORT:HOST:PORT`) and is served
/// `inbound` ([`super::inbound`]: its own listeners, which depend on no
/// Service).
///
/// `trust_domain`: the workload CA's, when it is on (meshed endpoints are
/// then reached over mTLS, see the module doc); `None`, plain text.
pub fn generate(
    registry: &Registry,
    outbound: Option<&str>,
    inbound: &ServedInbound,
    domain: &str,
    trust_domain: Option<&str>,
) -> Snapshot {
    let mut listeners = BTreeMap::new();
    let mut clusters = BTreeMap::new();
    let mut endpoints = BTreeMap::new();
    let mut addresses = EndpointAddresses::new();
    let mut services = BTreeSet::new();
    let mut skipped = inbound.skipped.clone();
    for i in &inbound.listeners {
        listeners.insert(
            i.name(),
            pack_any(super::inbound::listener(i, &inbound.tls)),
        );
        clusters.insert(i.cluster(), pack_any(super::inbound::cluster(i)));
    }
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
                let eps = registry.endpoints(&host, spec.upstream_port);
                let (mtls, eps) = match trust_domain {
                    Some(td) => {
                        let declared = registry.service(&host).and_then(|s| s.identities.as_ref());
                        let ids = accepted(declared, eps.values());
                        // None accepted: a SAN no certificate carries (an
                        // empty ServiceAccount name), never "any of the
                        // mesh", which an empty list would mean to Envoy.
                        let none = [String::new()];
                        let ids = if ids.is_empty() {
                            none.iter().collect::<Vec<_>>()
                        } else {
                            ids.iter().collect()
                        };
                        let mtls = Mtls {
                            spiffe_ids: ids
                                .into_iter()
                                .map(|sa| spiffe_id(td, &host.namespace, sa))
                                .collect(),
                        };
                        let eps: BTreeMap<std::net::SocketAddr, Reach> = eps
                            .iter()
                            .map(|(a, b)| (*a, reach(declared, b)))
                            .filter(|(_, r)| *r != Reach::Withheld)
                            .collect();
                        (Some(mtls), eps)
                    }
                    None => (None, eps.keys().map(|a| (*a, Reach::Plaintext)).collect()),
                };
                clusters.insert(
                    cluster.clone(),
                    pack_any(eds_cluster(&cluster, protocol, mtls.as_ref())),
                );
                let marked = mtls.is_some();
                addresses.insert(cluster.clone(), eps.keys().map(|a| a.ip()).collect());
                endpoints.insert(
                    cluster.clone(),
                    pack_any(load_assignment(&cluster, &eps, marked)),
                );
            }
            None => {
                // A host an ExternalService holds, else a static upstream;
                // either way the proxy depends on who holds it.
                let ext = spec.host.trim_end_matches('.').to_ascii_lowercase();
                services.insert(external_key(&ext));
                match registry.externals().holder(&ext) {
                    Some((key, info)) => {
                        let cluster = cluster_name(&ext, spec.upstream_port);
                        // A port it does not declare has no endpoints.
                        let protocol = match info.port(spec.upstream_port) {
                            Some(p) if p.protocol.is_http() => Protocol::Http,
                            _ => Protocol::Tcp,
                        };
                        let filter = match protocol {
                            Protocol::Http => http_filter_chain(&name, &cluster),
                            Protocol::Tcp => tcp_filter(&name, &cluster),
                        };
                        listeners
                            .insert(name.clone(), pack_any(listener(&name, spec.port, filter)));
                        let eps = registry.externals().endpoints(key, spec.upstream_port);
                        let (mtls, eps) = external_reach(&key.0, &eps, trust_domain);
                        let mut c = eds_cluster(&cluster, protocol, mtls.as_ref());
                        if let Some(t) = info.connect_timeout {
                            // Whatever it says: Envoy judges it (a NACK
                            // keeps the proxy's previous configuration).
                            c.connect_timeout = Some(Duration {
                                seconds: i64::try_from(t.as_secs()).unwrap_or(i64::MAX),
                                nanos: i32::try_from(t.subsec_nanos()).unwrap_or_default(),
                            });
                        }
                        clusters.insert(cluster.clone(), pack_any(c));
                        endpoints.insert(
                            cluster.clone(),
                            pack_any(weighted_load_assignment(&cluster, eps, mtls.is_some())),
                        );
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
        }
    }
    Snapshot {
        listeners: Arc::new(Typed::new(listeners)),
        clusters: Arc::new(Typed::new(clusters)),
        endpoints: Arc::new(Typed::new(endpoints)),
        pod: Typed::default(),
        withdrawal: Typed::default(),
        addresses: Arc::new(addresses),
        services: Arc::new(services),
        skipped,
    }
}

/// Endpoints, how each is reached and its weight.
type Weighted = BTreeMap<std::net::SocketAddr, (Reach, Option<u32>)>;

/// How a client's sidecar reaches the endpoints of an ExternalService of
/// namespace `namespace` (secure naming outside the cluster): with the
/// workload CA on, an endpoint that declares a ServiceAccount runs
/// remora-agent and is reached over the mesh's mTLS, accepting only the
/// identities of that namespace's declared ServiceAccounts; any other is
/// plain text (or the app's own TLS, which the sidecar passes through).
/// No endpoint declaring one: no mTLS at all. Each with its weight.
fn external_reach(
    namespace: &str,
    eps: &BTreeMap<std::net::SocketAddr, EndpointMeta>,
    trust_domain: Option<&str>,
) -> (Option<Mtls>, Weighted) {
    let ids: BTreeSet<&String> = eps
        .values()
        .filter_map(|m| m.service_account.as_ref())
        .collect();
    let mtls = trust_domain.filter(|_| !ids.is_empty()).map(|td| Mtls {
        spiffe_ids: ids
            .into_iter()
            .map(|sa| spiffe_id(td, namespace, sa))
            .collect(),
    });
    let eps = eps
        .iter()
        .map(|(a, m)| {
            let r = if mtls.is_some() && m.service_account.is_some() {
                Reach::Mtls
            } else {
                Reach::Plaintext
            };
            (*a, (r, m.weight))
        })
        .collect();
    (mtls, eps)
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

/// The [`WITHDRAWAL`] resource of pod `namespace/name`: none unless it is
/// withdrawn (`progress`); `replicas`, the other discovery replicas by pod
/// name, for the agent to ask as well.
pub fn withdrawal(
    namespace: &str,
    name: &str,
    progress: Option<&Progress>,
    replicas: &BTreeMap<String, std::net::SocketAddr>,
) -> Typed {
    let Some(p) = progress else {
        // Versioned all the same: "none" is an answer the agent can ACK.
        return Typed::new(BTreeMap::new());
    };
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let msg = remora_proto::remora::v1::Withdrawal {
        expected: count(p.expected),
        confirmed: count(p.confirmed),
        gone: count(p.gone),
        pending: p.pending.clone(),
        done: p.done,
        timed_out: p.timed_out,
        last_confirmation_ms: p
            .last_confirmation
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        replicas: replicas
            .iter()
            .map(
                |(name, address)| remora_proto::remora::v1::DiscoveryReplica {
                    name: name.clone(),
                    address: address.to_string(),
                },
            )
            .collect(),
    };
    let any = Any {
        type_url: WITHDRAWAL.into(),
        value: msg.encode_to_vec(),
    };
    Typed::new(BTreeMap::from([(format!("{namespace}/{name}"), any)]))
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

fn eds_cluster(name: &str, protocol: Protocol, mtls: Option<&Mtls>) -> Cluster {
    let options = if protocol == Protocol::Http {
        downstream_protocol_options()
    } else {
        HashMap::new()
    };
    let (transport_socket, transport_socket_matches) = match mtls {
        Some(m) => {
            let tls = mtls_socket(&m.spiffe_ids);
            let matches = vec![
                cluster::TransportSocketMatch {
                    name: MTLS.into(),
                    r#match: Some(tls_mode(MTLS)),
                    transport_socket: Some(tls.clone()),
                },
                cluster::TransportSocketMatch {
                    name: PLAINTEXT.into(),
                    r#match: Some(tls_mode(PLAINTEXT)),
                    transport_socket: Some(TransportSocket {
                        name: "envoy.transport_sockets.raw_buffer".into(),
                        config_type: Some(transport_socket::ConfigType::TypedConfig(pack_any(
                            RawBuffer::default(),
                        ))),
                    }),
                },
            ];
            // Unmarked endpoints get mTLS: never plain text by omission.
            (Some(tls), matches)
        }
        None => (None, Vec::new()),
    };
    Cluster {
        name: name.to_string(),
        transport_socket,
        transport_socket_matches,
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

/// `{tlsMode: mode}`: one field, so its encoding (a protobuf map) is the
/// same every time and the version follows content only.
fn tls_mode(mode: &str) -> Struct {
    Struct {
        fields: HashMap::from([(
            TLS_MODE.to_string(),
            Value {
                kind: Some(value::Kind::StringValue(mode.to_string())),
            },
        )]),
    }
}

/// The mesh's mTLS to an endpoint: the workload certificate presented,
/// the peer verified with the mesh's roots and accepted only if it carries
/// one of `spiffe_ids` (never empty) as URI SAN.
fn mtls_socket(spiffe_ids: &[String]) -> TransportSocket {
    let sans = spiffe_ids
        .iter()
        .map(|id| SubjectAltNameMatcher {
            san_type: subject_alt_name_matcher::SanType::Uri as i32,
            matcher: Some(StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::Exact(id.clone())),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    let tls = UpstreamTlsContext {
        common_tls_context: Some(mesh_tls_context(sans, vec![MTLS_ALPN.into()])),
        ..Default::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(pack_any(tls))),
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
        load_assignment: Some(load_assignment_of(
            name,
            [(host.to_string(), port, None, None)],
        )),
        ..Default::default()
    }
}

/// The endpoints and how each is reached; `marked`: with the mesh's
/// transport socket matches (a mark per endpoint).
fn load_assignment(
    name: &str,
    eps: &BTreeMap<std::net::SocketAddr, Reach>,
    marked: bool,
) -> ClusterLoadAssignment {
    weighted_load_assignment(name, eps.iter().map(|(a, r)| (*a, (*r, None))), marked)
}

/// As [`load_assignment`], each endpoint with its weight (`None`: Envoy's 1).
fn weighted_load_assignment(
    name: &str,
    eps: impl IntoIterator<Item = (std::net::SocketAddr, (Reach, Option<u32>))>,
    marked: bool,
) -> ClusterLoadAssignment {
    load_assignment_of(
        name,
        eps.into_iter().map(|(a, (r, weight))| {
            let mark = marked.then_some(if r == Reach::Mtls { MTLS } else { PLAINTEXT });
            (a.ip().to_string(), a.port(), mark, weight)
        }),
    )
}

fn load_assignment_of<'a>(
    name: &str,
    eps: impl IntoIterator<Item = (String, u16, Option<&'a str>, Option<u32>)>,
) -> ClusterLoadAssignment {
    let lb_endpoints: Vec<LbEndpoint> = eps
        .into_iter()
        .map(|(ip, port, mark, weight)| LbEndpoint {
            load_balancing_weight: weight.map(|value| UInt32Value { value }),
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                address: Some(socket(&ip, port)),
                ..Default::default()
            })),
            metadata: mark.map(|m| Metadata {
                filter_metadata: HashMap::from([(TRANSPORT_SOCKET_MATCH.to_string(), tls_mode(m))]),
                ..Default::default()
            }),
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
    use crate::discovery::registry::{PodKey, ProxyInfo, ServiceInfo, ServicePort, SliceInfo};
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::UpstreamTlsContext;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        CommonTlsContext, common_tls_context,
    };
    use remora_contract::mesh::WORKLOAD_SECRET;

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
                    ..Default::default()
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
                    ..Default::default()
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
            &ServedInbound::default(),
            DOMAIN,
            None,
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
        // Two Services, and who holds api.example.com (no one yet).
        assert_eq!(s.services.len(), 3);
        assert!(s.skipped.is_empty());

        // A host of Service shape with no such Service is a static upstream,
        // until the Service exists.
        let ext = generate(
            &r,
            Some("15001:example.org:443"),
            &ServedInbound::default(),
            DOMAIN,
            None,
        );
        assert_eq!(
            ext.clusters.resources.keys().collect::<Vec<_>>(),
            ["outbound|15001|example.org|443"]
        );
        assert!(ext.endpoints.resources.is_empty());
        assert_eq!(
            ext.services.len(),
            2,
            "it depends on Service example.org, and on who holds the host"
        );

        // Nothing declared, nothing seen.
        let none = generate(&r, None, &ServedInbound::default(), DOMAIN, None);
        assert!(none.listeners.resources.is_empty() && none.clusters.resources.is_empty());
    }

    #[test]
    fn versions_follow_content_per_type() {
        let mut r = registry();
        let a = generate(
            &r,
            Some("15001:cart.shop:80"),
            &ServedInbound::default(),
            DOMAIN,
            None,
        );
        assert_eq!(
            a,
            generate(
                &r,
                Some("15001:cart.shop:80"),
                &ServedInbound::default(),
                DOMAIN,
                None
            ),
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
                ..Default::default()
            },
        );
        let b = generate(
            &r,
            Some("15001:cart.shop:80"),
            &ServedInbound::default(),
            DOMAIN,
            None,
        );
        assert_eq!(a.listeners.version, b.listeners.version);
        assert_eq!(a.clusters.version, b.clusters.version);
        assert_ne!(a.endpoints.version, b.endpoints.version, "only EDS changed");
    }

    #[test]
    fn bad_entries_are_skipped_not_fatal() {
        let s = generate(
            &registry(),
            Some("nonsense,15001:cart.shop:80,15001:db.shop:5432,99999:x:1"),
            &ServedInbound::default(),
            DOMAIN,
            None,
        );
        assert_eq!(s.listeners.resources.len(), 1);
        assert_eq!(s.skipped.len(), 3, "{:?}", s.skipped);
    }

    #[test]
    fn reach_is_mtls_to_meshed_pods_and_withheld_outside_a_declared_set() {
        let meshed = |sa: &str| Backend::Meshed {
            service_account: sa.into(),
        };
        let declared: BTreeSet<String> = ["cart".to_string()].into();
        assert_eq!(reach(None, &meshed("cart")), Reach::Mtls);
        assert_eq!(reach(None, &meshed("other")), Reach::Mtls);
        assert_eq!(reach(None, &Backend::Plain), Reach::Plaintext);
        assert_eq!(reach(Some(&declared), &meshed("cart")), Reach::Mtls);
        assert_eq!(reach(Some(&declared), &meshed("other")), Reach::Withheld);
        // Declared: a pod that cannot prove an identity is never sent.
        assert_eq!(reach(Some(&declared), &Backend::Plain), Reach::Withheld);
        let backends = [meshed("b"), Backend::Plain, meshed("a"), meshed("b")];
        assert_eq!(
            accepted(None, &backends).into_iter().collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(accepted(Some(&declared), &backends), declared);
    }

    const TD: &str = "mesh.example";
    const CART_CLUSTER: &str = "outbound|80||cart.shop.svc.cluster.local";

    /// `cart` (port 80 → 8000) served by 10.0.0.1 (pod cart-0, meshed, SA
    /// cart), 10.0.0.2 (impostor-0, meshed, SA impostor) and 10.0.0.3
    /// (plain-0, injected without the CA); `identities` its annotation.
    fn served(identities: Option<&[&str]>) -> Registry {
        let mut r = registry();
        let host = ServiceHost {
            name: "cart".into(),
            namespace: "shop".into(),
        };
        r.apply_service(
            host.clone(),
            ServiceInfo {
                ports: vec![ServicePort {
                    port: 80,
                    name: "p".into(),
                    protocol: Protocol::Http,
                }],
                identities: identities.map(|ids| ids.iter().map(|i| i.to_string()).collect()),
            },
        );
        let eps = [
            ("10.0.0.1", "cart-0", "cart", true),
            ("10.0.0.2", "impostor-0", "impostor", true),
            ("10.0.0.3", "plain-0", "cart", false),
        ];
        r.apply_slice(
            ("shop".into(), "cart".into()),
            SliceInfo {
                service: Some(host),
                ports: [("p".to_string(), 8000)].into(),
                ready: eps.iter().map(|e| e.0.parse().expect("ip")).collect(),
                pods: eps
                    .iter()
                    .map(|e| (e.0.parse().expect("ip"), e.1.to_string()))
                    .collect(),
            },
        );
        for (ip, pod, sa, meshed) in eps {
            r.apply_proxy(
                PodKey {
                    namespace: "shop".into(),
                    name: pod.into(),
                },
                ProxyInfo {
                    ip: Some(ip.into()),
                    service_account: sa.into(),
                    mtls_ports: if meshed {
                        [8000].into()
                    } else {
                        BTreeSet::new()
                    },
                    ..Default::default()
                },
            );
        }
        r
    }

    /// The load assignment as `(address, mark)`.
    fn marks(s: &Snapshot) -> Vec<(String, Option<String>)> {
        let cla: ClusterLoadAssignment = decode(&s.endpoints.resources[CART_CLUSTER]).expect("cla");
        cla.endpoints
            .iter()
            .flat_map(|l| &l.lb_endpoints)
            .map(|e| {
                let Some(lb_endpoint::HostIdentifier::Endpoint(ep)) = &e.host_identifier else {
                    panic!("an endpoint");
                };
                let Some(
                    envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(a),
                ) = ep.address.as_ref().and_then(|a| a.address.as_ref())
                else {
                    panic!("a socket address");
                };
                let mark = e.metadata.as_ref().map(|m| {
                    match &m.filter_metadata[TRANSPORT_SOCKET_MATCH].fields[TLS_MODE].kind {
                        Some(value::Kind::StringValue(v)) => v.clone(),
                        other => panic!("{other:?}"),
                    }
                });
                (a.address.clone(), mark)
            })
            .collect()
    }

    /// The SANs a transport socket accepts, and its context.
    fn tls_of(ts: &TransportSocket) -> (Vec<String>, CommonTlsContext) {
        assert_eq!(ts.name, "envoy.transport_sockets.tls");
        let Some(transport_socket::ConfigType::TypedConfig(any)) = &ts.config_type else {
            panic!("typed config");
        };
        let tls: UpstreamTlsContext = decode(any).expect("tls");
        let ctx = tls.common_tls_context.expect("context");
        let Some(common_tls_context::ValidationContextType::CombinedValidationContext(v)) =
            &ctx.validation_context_type
        else {
            panic!("combined validation");
        };
        let sans = v
            .default_validation_context
            .as_ref()
            .expect("default context")
            .match_typed_subject_alt_names
            .iter()
            .map(|m| {
                assert_eq!(m.san_type, subject_alt_name_matcher::SanType::Uri as i32);
                match m.matcher.as_ref().and_then(|m| m.match_pattern.as_ref()) {
                    Some(string_matcher::MatchPattern::Exact(e)) => e.clone(),
                    other => panic!("{other:?}"),
                }
            })
            .collect();
        (sans, ctx)
    }

    fn cart_cluster(s: &Snapshot) -> Cluster {
        decode(&s.clusters.resources[CART_CLUSTER]).expect("cluster")
    }

    fn id(sa: &str) -> String {
        format!("spiffe://{TD}/ns/shop/sa/{sa}")
    }

    #[test]
    fn without_the_workload_ca_everything_is_plain_text() {
        let s = generate(
            &served(None),
            Some("15001:cart.shop:80"),
            &ServedInbound::default(),
            DOMAIN,
            None,
        );
        let c = cart_cluster(&s);
        assert!(c.transport_socket.is_none() && c.transport_socket_matches.is_empty());
        let m = marks(&s);
        assert_eq!(m.len(), 3);
        assert!(m.iter().all(|(_, mark)| mark.is_none()), "{m:?}");
    }

    #[test]
    fn meshed_endpoints_get_mtls_to_the_identities_behind_the_service() {
        let s = generate(
            &served(None),
            Some("15001:cart.shop:80"),
            &ServedInbound::default(),
            DOMAIN,
            Some(TD),
        );
        assert_eq!(
            marks(&s),
            [
                ("10.0.0.1".to_string(), Some(MTLS.to_string())),
                ("10.0.0.2".to_string(), Some(MTLS.to_string())),
                ("10.0.0.3".to_string(), Some(PLAINTEXT.to_string())),
            ]
        );
        let c = cart_cluster(&s);
        let names: Vec<&str> = c
            .transport_socket_matches
            .iter()
            .map(|m| m.name.as_str())
            .collect();
        assert_eq!(names, [MTLS, PLAINTEXT]);
        assert_eq!(
            c.transport_socket_matches[1]
                .transport_socket
                .as_ref()
                .map(|t| t.name.as_str()),
            Some("envoy.transport_sockets.raw_buffer")
        );
        let (sans, ctx) = tls_of(
            c.transport_socket_matches[0]
                .transport_socket
                .as_ref()
                .expect("mtls"),
        );
        // Istio's rule without a declaration: every meshed pod's identity.
        assert_eq!(sans, [id("cart"), id("impostor")]);
        assert_eq!(ctx.alpn_protocols, [MTLS_ALPN]);
        assert_eq!(
            ctx.tls_certificate_sds_secret_configs
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>(),
            [WORKLOAD_SECRET]
        );
        // An endpoint without a mark gets the same mTLS, not plain text.
        assert_eq!(
            c.transport_socket,
            c.transport_socket_matches[0].transport_socket
        );
        assert_eq!(
            s,
            generate(
                &served(None),
                Some("15001:cart.shop:80"),
                &ServedInbound::default(),
                DOMAIN,
                Some(TD)
            ),
            "deterministic, versions included"
        );
    }

    #[test]
    fn declared_identities_withhold_every_other_endpoint_and_pin_the_san() {
        let s = generate(
            &served(Some(&["cart"])),
            Some("15001:cart.shop:80"),
            &ServedInbound::default(),
            DOMAIN,
            Some(TD),
        );
        // The impostor (another ServiceAccount) and the plain pod (no
        // identity to prove) are not sent.
        assert_eq!(
            marks(&s),
            [("10.0.0.1".to_string(), Some(MTLS.to_string()))]
        );
        let c = cart_cluster(&s);
        let (sans, _) = tls_of(c.transport_socket.as_ref().expect("default"));
        assert_eq!(sans, [id("cart")]);

        // A declaration that does not parse (read as the empty set):
        // nothing sent, and the SAN no certificate carries.
        let none = generate(
            &served(Some(&[])),
            Some("15001:cart.shop:80"),
            &ServedInbound::default(),
            DOMAIN,
            Some(TD),
        );
        assert!(marks(&none).is_empty());
        let (sans, _) = tls_of(
            cart_cluster(&none)
                .transport_socket
                .as_ref()
                .expect("default"),
        );
        assert_eq!(sans, [format!("spiffe://{TD}/ns/shop/sa/")]);
    }

    /// `api.example.com` (443 TLS, 80 HTTP → 8080) served by 192.0.2.1
    /// (running remora-agent as ServiceAccount `api`, 443 on 8443) and
    /// 192.0.2.2 (plain, weight 3), and an ExternalService of namespace shop claiming
    /// `cart.shop`, the name of a Service that exists.
    fn with_externals() -> Registry {
        use crate::discovery::external::{ExternalEndpoint, ExternalInfo, ExternalPort, Source};
        let mut r = registry();
        let ep = |ip: &str, ports: &[(&str, u16)], sa: Option<&str>| ExternalEndpoint {
            ip: ip.parse().expect("ip"),
            ports: ports.iter().map(|(n, p)| (n.to_string(), *p)).collect(),
            service_account: sa.map(str::to_string),
            weight: None,
        };
        let ports = vec![
            ExternalPort {
                port: 443,
                name: "https".into(),
                protocol: remora_crds::external::ExternalProtocol::Tls,
                target: 443,
            },
            ExternalPort {
                port: 80,
                name: "http".into(),
                protocol: remora_crds::external::ExternalProtocol::Http,
                target: 8080,
            },
        ];
        let info = |hosts: &[&str], eps| ExternalInfo {
            created: 1,
            generation: Some(1),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            ports: ports.clone(),
            source: Source::Endpoints(eps),
            connect_timeout: None,
        };
        r.apply_external_service(
            ("shop".into(), "api".into()),
            info(
                &["api.example.com"],
                vec![
                    ep("192.0.2.1", &[("https", 8443)], Some("api")),
                    ExternalEndpoint {
                        weight: Some(3),
                        ..ep("192.0.2.2", &[], None)
                    },
                ],
            ),
        );
        r.apply_external_service(
            ("shop".into(), "cart".into()),
            info(&["cart.shop"], vec![ep("192.0.2.9", &[], None)]),
        );
        r
    }

    const API_TLS: &str = "outbound|443||api.example.com";

    #[test]
    fn an_external_host_gets_an_eds_cluster_of_its_endpoints() {
        let r = with_externals();
        let s = generate(
            &r,
            Some("15001:API.example.com.:443,15002:api.example.com:80,15003:cart.shop:80"),
            &ServedInbound::default(),
            DOMAIN,
            None,
        );
        assert!(s.skipped.is_empty(), "{:?}", s.skipped);
        assert_eq!(
            filter_name(&s.listeners.resources["outbound_15001"]),
            "envoy.filters.network.tcp_proxy"
        );
        assert_eq!(
            filter_name(&s.listeners.resources["outbound_15002"]),
            "envoy.filters.network.http_connection_manager"
        );
        let c: Cluster = decode(&s.clusters.resources[API_TLS]).expect("cluster");
        assert!(c.eds_cluster_config.is_some());
        assert!(c.transport_socket.is_none(), "no workload CA, no mTLS");
        let cla: ClusterLoadAssignment = decode(&s.endpoints.resources[API_TLS]).expect("cla");
        let weights: Vec<Option<u32>> = cla.endpoints[0]
            .lb_endpoints
            .iter()
            .map(|e| e.load_balancing_weight.as_ref().map(|w| w.value))
            .collect();
        assert_eq!(weights, [None, Some(3)]);
        let http: ClusterLoadAssignment =
            decode(&s.endpoints.resources["outbound|80||api.example.com"]).expect("cla");
        assert_eq!(http.endpoints[0].lb_endpoints.len(), 2);
        // A Service of that name wins over any ExternalService.
        assert!(
            s.clusters
                .resources
                .contains_key("outbound|80||cart.shop.svc.cluster.local")
        );
        // It depends on who holds each host (and on Service cart.shop).
        assert!(
            s.services
                .contains(&crate::discovery::external::external_key("api.example.com"))
        );
    }

    #[test]
    fn external_endpoints_running_the_agent_get_mtls_to_their_identity() {
        let s = generate(
            &with_externals(),
            Some("15001:api.example.com:443"),
            &ServedInbound::default(),
            DOMAIN,
            Some(TD),
        );
        let c: Cluster = decode(&s.clusters.resources[API_TLS]).expect("cluster");
        let (sans, _) = tls_of(c.transport_socket.as_ref().expect("mtls"));
        assert_eq!(sans, [id("api")]);
        let cla: ClusterLoadAssignment = decode(&s.endpoints.resources[API_TLS]).expect("cla");
        let marks: Vec<Option<String>> = cla.endpoints[0]
            .lb_endpoints
            .iter()
            .map(|e| {
                e.metadata.as_ref().and_then(|m| {
                    match &m.filter_metadata[TRANSPORT_SOCKET_MATCH].fields[TLS_MODE].kind {
                        Some(value::Kind::StringValue(v)) => Some(v.clone()),
                        _ => None,
                    }
                })
            })
            .collect();
        assert_eq!(marks, [Some(MTLS.into()), Some(PLAINTEXT.into())]);

        // No endpoint declares an identity: plain (the app's own TLS).
        let s = generate(
            &with_externals(),
            Some("15001:api.example.com:80"),
            &ServedInbound::default(),
            DOMAIN,
            Some(TD),
        );
        let c: Cluster =
            decode(&s.clusters.resources["outbound|80||api.example.com"]).expect("cluster");
        // 192.0.2.1 declares one on every port: mTLS there too.
        assert!(c.transport_socket.is_some());
        let mut r = with_externals();
        r.delete_external_service(&("shop".into(), "api".into()));
        let s = generate(
            &r,
            Some("15001:api.example.com:443"),
            &ServedInbound::default(),
            DOMAIN,
            Some(TD),
        );
        // Gone: a static upstream again, as before it existed.
        assert!(
            s.clusters
                .resources
                .contains_key("outbound|15001|api.example.com|443")
        );
    }
}
