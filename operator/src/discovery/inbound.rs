//! A proxy's INBOUND listeners and their app clusters, served over LDS and
//! CDS so that a change of `remora.dev/inbound` (or `remora.dev/inbound-tls`)
//! applies live, without restarting Envoy.
//!
//! Which listeners: [`remora_inject::traffic::live_inbound`], the
//! injection's own rule (the annotation, checked as the webhook checks it,
//! else the listeners the pod was injected with, the default one included,
//! recorded in `remora.dev/status`). Their shape:
//! [`remora_contract::inbound`], the one the agent's static bootstrap
//! renders as JSON (agent/src/bootstrap.rs), rendered here as protobuf:
//! `inbound_<port>` on `0.0.0.0`, direction INBOUND (what the agent's
//! `drain_listeners?inboundonly` drains), an HTTP connection manager to
//! `inbound|<app port>` on `127.0.0.1`, which speaks upstream what the
//! client spoke downstream; mTLS with the agent's SDS secrets when asked,
//! permissive (the mesh's mTLS by ALPN beside plain text) when the pod has
//! the workload CA.

use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::{Cluster, cluster};
use envoy_types::pb::envoy::config::core::v3::{HttpProtocolOptions, TrafficDirection};
use envoy_types::pb::envoy::config::core::v3::{TransportSocket, transport_socket};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter, filter, listener_filter,
};
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route, route_action,
    route_match,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    DownstreamTlsContext, SubjectAltNameMatcher, subject_alt_name_matcher,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher};
use envoy_types::pb::google::protobuf::{BoolValue, Duration};
use envoy_types::util::pack_any;
use remora_contract::inbound::{self as shape, Inbound, InboundTls};
use remora_contract::mesh::MTLS_ALPN;
use remora_contract::pod::{HCM_DELAYED_CLOSE_TIMEOUT, INBOUND_PORT};

use super::proto::{downstream_protocol_options, mesh_tls_context, socket};
use crate::cluster::live_pod::LivePod;

/// What a pod's sidecar is served inbound.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ServedInbound {
    pub listeners: Vec<Inbound>,
    pub tls: InboundTls,
    /// What of its annotations was not used, and why.
    pub skipped: Vec<String>,
}

impl ServedInbound {
    /// From the pod as the watch keeps it.
    pub fn read(pod: &LivePod) -> Arc<Self> {
        // A pod injected before its inbound listeners were recorded runs
        // an agent that writes them into Envoy's bootstrap: served
        // listeners of the same names would have Envoy refuse the whole
        // LDS update, its outbound ones included.
        let Some((injected, recorded)) = pod
            .injected()
            .and_then(|i| Some((i, i.inbound.as_deref()?)))
        else {
            return Arc::default();
        };
        let mut skipped = Vec::new();
        let specs = remora_inject::traffic::live_inbound(pod.annotations(), recorded, &mut skipped);
        let mut listeners = match shape::resolve(&specs, INBOUND_PORT) {
            Ok(l) => l,
            // The injection's check refuses a port twice: not reached.
            Err(port) => {
                skipped.push(format!("inbound port {port} is listed twice"));
                Vec::new()
            }
        };
        let required = match pod.inbound_tls().map(remora_inject::traffic::inbound_tls) {
            None => None,
            Some(Ok(r)) => r,
            // Fails closed: a pod that asked for mTLS it cannot be given
            // is served no inbound listener rather than plain text.
            Some(Err(e)) => {
                skipped.push(format!("{e}: no inbound listener is served"));
                listeners.clear();
                None
            }
        };
        // The sidecar has the workload certificate only when the CA was
        // wired at injection (then its inbound ports are recorded).
        let ca_wired = !injected.mtls_ports.is_empty();
        Arc::new(Self {
            listeners,
            tls: InboundTls::of(required, ca_wired),
            skipped,
        })
    }
}

fn duration(d: std::time::Duration) -> Duration {
    Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or_default(),
    }
}

/// The app's cluster of `i`: static, on loopback.
pub fn cluster(i: &Inbound) -> Cluster {
    let name = i.cluster();
    Cluster {
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Static as i32,
        )),
        connect_timeout: Some(duration(shape::CONNECT_TIMEOUT)),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: name.clone(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![LbEndpoint {
                    host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                        address: Some(socket(shape::APP_ADDRESS, i.app_port)),
                        ..Default::default()
                    })),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }),
        // The app gets the protocol its client spoke: h2c and gRPC pass
        // through, and HTTP/1.1 stays HTTP/1.1.
        typed_extension_protocol_options: downstream_protocol_options(),
        name,
        ..Default::default()
    }
}

/// The listener of `i` with `tls`.
pub fn listener(i: &Inbound, tls: &InboundTls) -> Listener {
    let name = i.name();
    let chain = FilterChain {
        filters: vec![hcm(&name, &i.cluster())],
        ..Default::default()
    };
    let (filter_chains, listener_filters) = match tls {
        InboundTls::None => (vec![chain], Vec::new()),
        InboundTls::Required { sans } => (
            vec![FilterChain {
                transport_socket: Some(mtls_socket(sans)),
                ..chain
            }],
            Vec::new(),
        ),
        InboundTls::Permissive => {
            let mesh = FilterChain {
                name: shape::MESH_CHAIN.into(),
                filter_chain_match: Some(FilterChainMatch {
                    transport_protocol: "tls".into(),
                    application_protocols: vec![MTLS_ALPN.into()],
                    ..Default::default()
                }),
                transport_socket: Some(mtls_socket(&[])),
                ..chain.clone()
            };
            let plain = FilterChain {
                name: shape::PLAINTEXT_CHAIN.into(),
                ..chain
            };
            // Reads the ClientHello (ALPN) for the chain match; a
            // plain-text client's first bytes end it at once.
            let inspector = ListenerFilter {
                name: "envoy.filters.listener.tls_inspector".into(),
                config_type: Some(listener_filter::ConfigType::TypedConfig(pack_any(
                    TlsInspector::default(),
                ))),
                ..Default::default()
            };
            (vec![mesh, plain], vec![inspector])
        }
    };
    Listener {
        address: Some(socket(shape::LISTEN_ADDRESS, i.port)),
        // INBOUND is what `drain_listeners?inboundonly` drains.
        traffic_direction: TrafficDirection::Inbound as i32,
        filter_chains,
        listener_filters,
        name,
        ..Default::default()
    }
}

fn hcm(name: &str, cluster: &str) -> Filter {
    let route = Route {
        r#match: Some(RouteMatch {
            path_specifier: Some(route_match::PathSpecifier::Prefix("/".into())),
            ..Default::default()
        }),
        action: Some(route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster.into())),
            // No route timeout: the sidecar must not cut the app's long requests.
            timeout: Some(Duration::default()),
            ..Default::default()
        })),
        ..Default::default()
    };
    let hcm = HttpConnectionManager {
        stat_prefix: name.to_string(),
        codec_type: http_connection_manager::CodecType::Auto as i32,
        // Envoy's default, stated: the drain cuts it.
        common_http_protocol_options: Some(HttpProtocolOptions {
            idle_timeout: Some(duration(shape::IDLE_TIMEOUT)),
            ..Default::default()
        }),
        drain_timeout: Some(duration(shape::DRAIN_TIMEOUT)),
        delayed_close_timeout: Some(duration(HCM_DELAYED_CLOSE_TIMEOUT)),
        route_specifier: Some(http_connection_manager::RouteSpecifier::RouteConfig(
            RouteConfiguration {
                name: name.to_string(),
                virtual_hosts: vec![VirtualHost {
                    name: shape::VIRTUAL_HOST.into(),
                    domains: vec!["*".into()],
                    routes: vec![route],
                    ..Default::default()
                }],
                ..Default::default()
            },
        )),
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

/// The inbound mTLS: the workload certificate presented, a client
/// certificate required and verified with the mesh's roots (both the
/// agent's SDS secrets); with `sans`, the client must carry one of them
/// (`spiffe://…` and other URIs as URI SAN, anything else as DNS SAN, as
/// the agent's `--inbound-tls-san`).
fn mtls_socket(sans: &[String]) -> TransportSocket {
    let matchers = sans
        .iter()
        .map(|s| SubjectAltNameMatcher {
            san_type: if s.contains("://") {
                subject_alt_name_matcher::SanType::Uri
            } else {
                subject_alt_name_matcher::SanType::Dns
            } as i32,
            matcher: Some(StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::Exact(s.clone())),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    let tls = DownstreamTlsContext {
        require_client_certificate: Some(BoolValue { value: true }),
        common_tls_context: Some(mesh_tls_context(matchers, Vec::new())),
        ..Default::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(pack_any(tls))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::push::{Debounce, Discovery};
    use crate::discovery::registry::{PodKey, ProxyInfo};
    use crate::discovery::resources::{CLUSTER, LISTENER, decode};
    use envoy_types::pb::envoy::config::core::v3::address;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context;
    use remora_contract::annotations::{INBOUND, INBOUND_TLS, OUTBOUND, STATUS};
    use remora_contract::mesh::{ROOT_SECRET, WORKLOAD_SECRET};

    /// A pod as the pod watch keeps it.
    fn pod(name: &str, annotations: &[(&str, &str)]) -> LivePod {
        let pod = k8s_openapi::api::core::v1::Pod {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("shop".into()),
                annotations: Some(
                    annotations
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        };
        crate::cluster::live_pod::read(&pod)
    }

    fn served(annotations: &[(&str, &str)]) -> ServedInbound {
        (*ServedInbound::read(&pod("web-0", annotations))).clone()
    }

    fn ports(s: &ServedInbound) -> Vec<(u16, u16)> {
        s.listeners.iter().map(|i| (i.port, i.app_port)).collect()
    }

    const INJECTED: (&str, &str) = (STATUS, r#"{"inbound":["15006:8080"]}"#);

    #[test]
    fn the_annotation_wins_else_what_was_injected() {
        // Not injected, or injected before the record (its agent writes
        // its inbound listeners itself): nothing.
        assert_eq!(served(&[(INBOUND, "8080")]), ServedInbound::default());
        assert_eq!(
            served(&[(STATUS, r#"{"mtlsPorts":[15006]}"#), (INBOUND, "8080")]),
            ServedInbound::default()
        );
        // Injected with no inbound listener, one added later: served.
        let s = served(&[(STATUS, r#"{"inbound":[]}"#), (INBOUND, "8080")]);
        assert_eq!(ports(&s), [(15006, 8080)]);
        // Injected with the default listener and no annotation.
        let s = served(&[INJECTED]);
        assert_eq!(ports(&s), [(15006, 8080)]);
        assert_eq!((s.tls.clone(), s.skipped.len()), (InboundTls::None, 0));
        // The annotation, read as the webhook reads it.
        let s = served(&[INJECTED, (INBOUND, "8081, 9000:9090")]);
        assert_eq!(ports(&s), [(15006, 8081), (9000, 9090)]);
        // An entry the agent would refuse is dropped, with the reason.
        let s = served(&[INJECTED, (INBOUND, "8081,x:1")]);
        assert_eq!(ports(&s), [(15006, 8081)]);
        assert_eq!(s.skipped.len(), 1, "{:?}", s.skipped);
        // What the webhook refuses (the sidecar's admin port, an outbound
        // listener's port, a port twice) keeps what was injected.
        for bad in [
            &[INJECTED, (INBOUND, "15000:8081")][..],
            &[
                INJECTED,
                (INBOUND, "15001:8081"),
                (OUTBOUND, "15001:cart.shop:80"),
            ],
            &[INJECTED, (INBOUND, "8081,15006:8082")],
        ] {
            let s = served(bad);
            assert_eq!(ports(&s), [(15006, 8080)], "{bad:?}");
            assert!(
                s.skipped
                    .iter()
                    .any(|w| w.contains("keeps the inbound listeners")),
                "{:?}",
                s.skipped
            );
        }
    }

    #[test]
    fn tls_follows_the_annotation_and_the_workload_ca() {
        let ca = (STATUS, r#"{"inbound":["8080"],"mtlsPorts":[15006]}"#);
        assert_eq!(served(&[ca]).tls, InboundTls::Permissive);
        assert_eq!(
            served(&[ca, (INBOUND_TLS, "true")]).tls,
            InboundTls::Required { sans: vec![] }
        );
        assert_eq!(
            served(&[INJECTED, (INBOUND_TLS, "spiffe://td/ns/a/sa/b")]).tls,
            InboundTls::Required {
                sans: vec!["spiffe://td/ns/a/sa/b".into()]
            }
        );
        assert_eq!(
            served(&[ca, (INBOUND_TLS, "false")]).tls,
            InboundTls::Permissive
        );
        // mTLS asked in a way that cannot be honoured: closed, not plain text.
        let s = served(&[ca, (INBOUND_TLS, "spiffe://td/../x")]);
        assert!(s.listeners.is_empty());
        assert_eq!(s.skipped.len(), 1, "{:?}", s.skipped);
    }

    fn hcm_of(chain: &FilterChain) -> HttpConnectionManager {
        match &chain.filters[0].config_type {
            Some(filter::ConfigType::TypedConfig(any)) => decode(any).expect("an HCM"),
            other => panic!("{other:?}"),
        }
    }

    fn downstream_tls(chain: &FilterChain) -> DownstreamTlsContext {
        match &chain.transport_socket.as_ref().expect("TLS").config_type {
            Some(transport_socket::ConfigType::TypedConfig(any)) => decode(any).expect("TLS"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_listener_and_cluster_have_the_static_shape() {
        let i = Inbound {
            port: 15006,
            app_port: 8080,
        };
        let l = listener(&i, &InboundTls::None);
        assert_eq!(l.name, "inbound_15006");
        assert_eq!(l.traffic_direction, TrafficDirection::Inbound as i32);
        let Some(address::Address::SocketAddress(a)) =
            l.address.as_ref().and_then(|a| a.address.clone())
        else {
            panic!("{:?}", l.address)
        };
        assert_eq!(a.address, "0.0.0.0");
        assert_eq!(l.filter_chains.len(), 1);
        let h = hcm_of(&l.filter_chains[0]);
        assert_eq!(h.stat_prefix, "inbound_15006");
        assert_eq!(
            h.codec_type,
            http_connection_manager::CodecType::Auto as i32
        );
        assert_eq!(h.drain_timeout, Some(duration(shape::DRAIN_TIMEOUT)));
        assert_eq!(
            h.common_http_protocol_options.and_then(|o| o.idle_timeout),
            Some(Duration {
                seconds: 3600,
                nanos: 0
            })
        );
        let Some(http_connection_manager::RouteSpecifier::RouteConfig(rc)) = h.route_specifier
        else {
            panic!("inline routes")
        };
        let Some(route::Action::Route(ra)) = rc.virtual_hosts[0].routes[0].action.clone() else {
            panic!("a route")
        };
        assert_eq!(
            ra.cluster_specifier,
            Some(route_action::ClusterSpecifier::Cluster(
                "inbound|8080".into()
            ))
        );
        assert_eq!(ra.timeout, Some(Duration::default()), "no route timeout");

        let c = cluster(&i);
        assert_eq!(c.name, "inbound|8080");
        assert!(
            c.typed_extension_protocol_options
                .contains_key("envoy.extensions.upstreams.http.v3.HttpProtocolOptions")
        );
        let ep = &c.load_assignment.expect("endpoints").endpoints[0].lb_endpoints[0];
        assert!(format!("{ep:?}").contains("127.0.0.1"), "{ep:?}");

        // Permissive: the mesh's mTLS by ALPN first, then plain text.
        let p = listener(&i, &InboundTls::Permissive);
        let names: Vec<&str> = p.filter_chains.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["mesh-mtls", "plaintext"]);
        let m = p.filter_chains[0]
            .filter_chain_match
            .clone()
            .expect("match");
        assert_eq!(
            (m.transport_protocol.as_str(), m.application_protocols),
            ("tls", vec![MTLS_ALPN.to_string()])
        );
        assert_eq!(
            p.listener_filters[0].name,
            "envoy.filters.listener.tls_inspector"
        );
        let tls = downstream_tls(&p.filter_chains[0]);
        assert_eq!(
            tls.require_client_certificate,
            Some(BoolValue { value: true })
        );
        let ctx = tls.common_tls_context.expect("context");
        assert_eq!(
            ctx.tls_certificate_sds_secret_configs[0].name,
            WORKLOAD_SECRET
        );
        assert!(p.filter_chains[1].transport_socket.is_none());

        // Required: one chain, mTLS, the client's SAN checked.
        let r = listener(
            &i,
            &InboundTls::Required {
                sans: vec!["spiffe://td/ns/a/sa/b".into()],
            },
        );
        assert_eq!(r.filter_chains.len(), 1);
        let ctx = downstream_tls(&r.filter_chains[0])
            .common_tls_context
            .expect("context");
        let Some(common_tls_context::ValidationContextType::CombinedValidationContext(v)) =
            ctx.validation_context_type
        else {
            panic!("combined validation")
        };
        assert_eq!(
            v.validation_context_sds_secret_config.expect("roots").name,
            ROOT_SECRET
        );
        let sans = v
            .default_validation_context
            .expect("SANs")
            .match_typed_subject_alt_names;
        assert_eq!(
            sans[0].san_type,
            subject_alt_name_matcher::SanType::Uri as i32
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_inbound_change_is_pushed_to_its_pod_only() {
        let (d, debounce) = Discovery::new("cluster.local", None, Debounce::default());
        tokio::spawn(debounce);
        let mut batches = d.batches();
        let apply = |p: LivePod| {
            let (key, info) = ProxyInfo::read(&p).expect("injected");
            d.update(|r| r.apply_proxy(key, info));
        };
        let web = |name: &str, inbound: &str| {
            pod(
                name,
                &[
                    INJECTED,
                    (INBOUND, inbound),
                    (OUTBOUND, "15001:example.org:80"),
                ],
            )
        };
        apply(web("web-0", "8080"));
        apply(web("web-1", "8080"));
        batches.changed().await.expect("first batch");
        batches.borrow_and_update();
        let key = |name: &str| PodKey {
            namespace: "shop".into(),
            name: name.into(),
        };
        let before = d.snapshot(&key("web-1")).expect("known");
        assert_eq!(
            before.listeners.resources.keys().collect::<Vec<_>>(),
            ["inbound_15006", "outbound_15001"]
        );
        assert!(before.clusters.resources.contains_key("inbound|8080"));

        // web-0 gets a second inbound port.
        apply(web("web-0", "8080,9000:9090"));
        batches.changed().await.expect("a batch");
        let b = batches.borrow_and_update().clone();
        assert_eq!(b.pods, [key("web-0")].into(), "that pod only");
        assert!(b.services.is_empty());
        let mine = d.snapshot(&key("web-0")).expect("known");
        assert_eq!(
            mine.listeners.resources.keys().collect::<Vec<_>>(),
            ["inbound_15006", "inbound_9000", "outbound_15001"]
        );
        assert!(mine.clusters.resources.contains_key("inbound|9090"));
        assert_ne!(mine.of_type(LISTENER), before.of_type(LISTENER));
        assert_ne!(mine.of_type(CLUSTER), before.of_type(CLUSTER));
        // The other pod, with the same outbound annotation, keeps its own.
        let other = d.snapshot(&key("web-1")).expect("known");
        assert_eq!(other.listeners.version, before.listeners.version);
        assert_eq!(other.clusters.version, before.clusters.version);
        // The same annotation again: nothing to push.
        apply(web("web-0", "8080,9000:9090"));
        tokio::time::sleep(Debounce::default().max_delay * 2).await;
        assert!(!batches.has_changed().expect("open"));
    }
}
