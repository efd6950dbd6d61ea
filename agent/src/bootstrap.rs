//! Envoy's bootstrap, generated from the agent's configuration.
//!
//! Static mode: one INBOUND listener per `--inbound` (HTTP, so that a drain
//! answers with `connection: close`) and one OUTBOUND TCP listener per
//! `--outbound` (its cluster originating mTLS with `--outbound-tls`). An
//! inbound listener takes mTLS only with `--inbound-tls`; with the workload
//! CA and without it, it is permissive: a TLS ClientHello offering the
//! mesh's ALPN ([`remora_contract::mesh::MTLS_ALPN`], which only a Remora
//! client's sidecar sends) gets the mesh's mTLS, anything else the plain
//! HTTP chain as before, so clients without a sidecar keep working.
//! Discovery mode (`--discovery-address`): LDS and CDS over ADS through the
//! agent's proxy socket ([`crate::xds`]), and no static inbound or outbound
//! listener: the server sends both (its inbound listeners have the shape of
//! [`remora_contract::inbound`], as the static ones here, and follow the
//! pod's `remora.dev/inbound` live; Envoy could not replace a static
//! listener by a served one of the same name). `--inbound` and
//! `--outbound` still reserve their ports: a clash is refused at start.
//! Both modes get the admin interface on 127.0.0.1 only and a Prometheus
//! listener.
//! `--bootstrap-override` is merged over the result (RFC 7386 merge patch).

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::config::RunConfig;
use crate::envoy::admin::PROMETHEUS_STAT_PREFIX;
use crate::envoy::idle_close;
use remora_contract::discovery::NodeId;
use remora_contract::pod::HCM_DELAYED_CLOSE_TIMEOUT;

/// Name of the ADS cluster in xDS mode.
pub use crate::xds::bootstrap::XDS_CLUSTER;
const PROMETHEUS_CLUSTER: &str = "remora-prometheus-stats";

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("cannot read --bootstrap-override {path}: {source}")]
    ReadOverride {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--bootstrap-override {path} is neither JSON nor YAML: {reason}")]
    ParseOverride { path: PathBuf, reason: String },
    #[error("--bootstrap-override {path} must hold a mapping at the top level")]
    OverrideNotObject { path: PathBuf },
    #[error("the bootstrap would expose Envoy's admin interface on {0}; only loopback is allowed")]
    AdminNotLoopback(String),
    #[error("--discovery-address {0:?} is not HOST:PORT")]
    DiscoveryAddress(String),
    #[error("the node id: {0}")]
    NodeId(String),
    #[error("two listeners on port {0}")]
    DuplicatePort(u16),
    #[error("cannot write the bootstrap to {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Extra pieces other modules add to the bootstrap (the SDS cluster, TLS on
/// inbound listeners), kept apart so this module stays independent of them.
#[derive(Debug, Clone, Default)]
pub struct Extras {
    /// Clusters appended to `static_resources.clusters`.
    pub clusters: Vec<Value>,
    /// A `transport_socket` put on every inbound listener's filter chain.
    pub inbound_transport_socket: Option<Value>,
    /// Without `inbound_transport_socket`: the `transport_socket` of a
    /// second filter chain on every inbound listener, for the mesh's mTLS
    /// (matched by ALPN), the plain chain kept (permissive).
    pub inbound_mesh_transport_socket: Option<Value>,
    /// A `transport_socket` put on the upstream cluster of the outbound
    /// listener on each port (upstream mTLS).
    pub outbound_transport_sockets: std::collections::BTreeMap<u16, Value>,
}

/// Read the override file, if any: JSON, or YAML (a superset of JSON).
pub fn read_override(path: &Path) -> Result<Value, BootstrapError> {
    let text = std::fs::read_to_string(path).map_err(|source| BootstrapError::ReadOverride {
        path: path.to_path_buf(),
        source,
    })?;
    parse_override(path, &text)
}

/// Parse an override file's text (read from `path`, named in errors). Apart
/// from [`read_override`] so the parsing can be tested and fuzzed without files.
pub fn parse_override(path: &Path, text: &str) -> Result<Value, BootstrapError> {
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(json_err) => {
            serde_saphyr::from_str(text).map_err(|yaml_err| BootstrapError::ParseOverride {
                path: path.to_path_buf(),
                reason: format!("as JSON: {json_err}; as YAML: {yaml_err}"),
            })?
        }
    };
    if !value.is_object() {
        return Err(BootstrapError::OverrideNotObject {
            path: path.to_path_buf(),
        });
    }
    Ok(value)
}

/// Build the bootstrap for `cfg`, with `extras` and the override applied.
/// With `idle_close`, Envoy gets the monitor that closes idle connections in
/// a drain ([`idle_close`]): only when a drain can wait, because its inotify
/// watch costs Envoy's exit a kernel grace period (about 10 ms).
pub fn generate(
    cfg: &RunConfig,
    extras: &Extras,
    override_doc: Option<&Value>,
    idle_close: bool,
) -> Result<Value, BootstrapError> {
    let mut listeners = Vec::new();
    let mut clusters = vec![prometheus_cluster(cfg.envoy_admin_port)];
    let mut ports = std::collections::BTreeSet::from([cfg.stats_port]);
    listeners.push(prometheus_listener(cfg.stats_port));

    let inbound = remora_contract::inbound::resolve(&cfg.inbound, cfg.inbound_port)
        .map_err(BootstrapError::DuplicatePort)?;
    for i in &inbound {
        if !ports.insert(i.port) {
            return Err(BootstrapError::DuplicatePort(i.port));
        }
        // With a discovery server, the inbound listeners are served too
        // (so a change of `remora.dev/inbound` applies live): Envoy cannot
        // replace a static listener by a dynamic one of the same name.
        if cfg.discovery().is_some() {
            continue;
        }
        let mut app = static_cluster(
            &i.cluster(),
            remora_contract::inbound::APP_ADDRESS,
            i.app_port,
        );
        // The app gets the protocol its client spoke: h2c and gRPC pass
        // through, and HTTP/1.1 stays HTTP/1.1.
        app["typed_extension_protocol_options"] = downstream_protocol_options();
        clusters.push(app);
        let tls = match (
            &extras.inbound_transport_socket,
            &extras.inbound_mesh_transport_socket,
        ) {
            (Some(ts), _) => InboundTls::Required(ts),
            (None, Some(ts)) => InboundTls::Permissive(ts),
            (None, None) => InboundTls::None,
        };
        listeners.push(inbound_listener(i, tls));
    }
    // With a discovery server, outbound listeners come from it (only the
    // listeners that exist whatever the server says stay static), but their
    // ports are still the pod's: one that clashes with a sidecar port is
    // refused here, not left for Envoy to reject.
    for spec in &cfg.outbound {
        if !ports.insert(spec.port) {
            return Err(BootstrapError::DuplicatePort(spec.port));
        }
        if cfg.discovery().is_some() {
            continue;
        }
        let cluster = format!(
            "outbound|{}|{}|{}",
            spec.port, spec.host, spec.upstream_port
        );
        let mut upstream = upstream_cluster(&cluster, &spec.host, spec.upstream_port);
        if let Some(ts) = extras.outbound_transport_sockets.get(&spec.port) {
            upstream["transport_socket"] = ts.clone();
        }
        clusters.push(upstream);
        listeners.push(outbound_listener(spec.port, &cluster));
    }
    clusters.extend(extras.clusters.iter().cloned());

    // A bound on downstream connections (Envoy warns at start without one).
    let mut monitors = vec![json!({
        "name": "envoy.resource_monitors.global_downstream_max_connections",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
            "max_active_downstream_connections": 100000
        }
    })];
    let mut actions = Vec::new();
    if idle_close {
        let (monitor, action) = idle_close::overload(&cfg.drain_pressure_path());
        monitors.push(monitor);
        actions.push(action);
    }
    let mut bootstrap = json!({
        "node": node(cfg)?,
        "admin": {
            "address": socket_address("127.0.0.1", cfg.envoy_admin_port),
        },
        "static_resources": {
            "listeners": listeners,
            "clusters": clusters,
        },
        "overload_manager": {
            "refresh_interval": idle_close::refresh_interval(),
            "resource_monitors": monitors,
            "actions": actions,
        }
    });

    if let Some(addr) = cfg.discovery() {
        // Checked here so a bad address fails at start, not at the first dial.
        split_host_port(addr).ok_or_else(|| BootstrapError::DiscoveryAddress(addr.to_string()))?;
        if let Some(c) = bootstrap["static_resources"]["clusters"].as_array_mut() {
            c.push(crate::xds::bootstrap::ads_cluster(&cfg.xds_socket_path()));
        }
        bootstrap["dynamic_resources"] =
            crate::xds::bootstrap::dynamic_resources(cfg.discovery_delta);
    }

    if let Some(patch) = override_doc {
        json_patch::merge(&mut bootstrap, patch);
    }
    check_admin_loopback(&bootstrap)?;
    Ok(bootstrap)
}

/// Write the bootstrap atomically (temp file + rename), so Envoy never reads half of it.
pub fn write(path: &Path, bootstrap: &Value) -> Result<(), BootstrapError> {
    let err = |source| BootstrapError::Write {
        path: path.to_path_buf(),
        source,
    };
    let text = serde_json::to_vec_pretty(bootstrap).map_err(|e| err(std::io::Error::other(e)))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Envoy's node id: Istio's shape, so an istiod-compatible xDS server
/// recognises it (the agent's own streams to other discovery replicas
/// name the same node).
pub fn node_id(cfg: &RunConfig) -> String {
    NodeId {
        ip: non_empty(&cfg.instance_ip, "127.0.0.1").into(),
        pod: non_empty(&cfg.pod_name, "remora").into(),
        namespace: non_empty(&cfg.pod_namespace, "default").into(),
        domain: cfg.trust_domain.clone(),
    }
    .to_string()
}

fn node(cfg: &RunConfig) -> Result<Value, BootstrapError> {
    let ns = non_empty(&cfg.pod_namespace, "default");
    let pod = non_empty(&cfg.pod_name, "remora");
    let id = node_id(cfg);
    // What the discovery server will parse must parse here first (a pod
    // name or domain with a `~` would not).
    if cfg.discovery().is_some() {
        id.parse::<NodeId>().map_err(BootstrapError::NodeId)?;
    }
    let cluster = if cfg.service_account.is_empty() {
        format!("{pod}.{ns}")
    } else {
        format!("{}.{ns}", cfg.service_account)
    };
    Ok(json!({
        "id": id,
        "cluster": cluster,
        "metadata": {
            "POD_NAME": cfg.pod_name,
            "NAMESPACE": cfg.pod_namespace,
            "SERVICE_ACCOUNT": cfg.service_account,
            "INSTANCE_IPS": cfg.instance_ip,
            "REMORA_VERSION": env!("CARGO_PKG_VERSION"),
        }
    }))
}

fn non_empty<'a>(s: &'a str, fallback: &'a str) -> &'a str {
    if s.is_empty() { fallback } else { s }
}

fn socket_address(address: &str, port: u16) -> Value {
    json!({"socket_address": {"address": address, "port_value": port}})
}

fn split_host_port(addr: &str) -> Option<(String, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    (!host.is_empty()).then(|| (host.to_string(), port))
}

fn downstream_protocol_options() -> Value {
    json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "use_downstream_protocol_config": {
                "http_protocol_options": {},
                "http2_protocol_options": {}
            }
        }
    })
}

fn static_cluster(name: &str, ip: &str, port: u16) -> Value {
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": format!("{}s", remora_contract::inbound::CONNECT_TIMEOUT.as_secs()),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(ip, port)}}]}]
        }
    })
}

/// An upstream by IP (static) or by name (DNS).
fn upstream_cluster(name: &str, host: &str, port: u16) -> Value {
    let mut c = static_cluster(name, host, port);
    if host.parse::<IpAddr>().is_err() {
        c["type"] = json!("STRICT_DNS");
        c["dns_lookup_family"] = json!("V4_PREFERRED");
    }
    c
}

fn router_filter() -> Value {
    json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
    })
}

/// TLS on an inbound listener.
#[derive(Debug, Clone, Copy)]
enum InboundTls<'a> {
    /// Plain text only.
    None,
    /// Every connection through this transport socket (`--inbound-tls`).
    Required(&'a Value),
    /// The mesh's mTLS through this transport socket when the ClientHello
    /// offers [`remora_contract::mesh::MTLS_ALPN`], plain text otherwise.
    Permissive(&'a Value),
}

/// The listener of [`remora_contract::inbound`]'s shape, as JSON; the
/// discovery server renders the same shape as protobuf
/// (operator/src/discovery/inbound.rs).
fn inbound_listener(i: &remora_contract::inbound::Inbound, tls: InboundTls<'_>) -> Value {
    use remora_contract::inbound as shape;
    let name = i.name();
    let mut chain = json!({
        "filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": name,
                "codec_type": "AUTO",
                // Envoy's default, stated: the drain cuts it (see `idle_close`).
                "common_http_protocol_options": {"idle_timeout": format!("{}s", shape::IDLE_TIMEOUT.as_secs())},
                "drain_timeout": format!("{}s", shape::DRAIN_TIMEOUT.as_secs_f64()),
                "delayed_close_timeout": format!("{}s", HCM_DELAYED_CLOSE_TIMEOUT.as_secs_f64()),
                "route_config": {
                    "name": name,
                    "virtual_hosts": [{
                        "name": shape::VIRTUAL_HOST,
                        "domains": ["*"],
                        // No route timeout: the sidecar must not cut the app's long requests.
                        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": i.cluster(), "timeout": "0s"}}]
                    }]
                },
                "http_filters": [router_filter()]
            }
        }]
    });
    let mut listener = json!({
        "name": name,
        "address": socket_address(shape::LISTEN_ADDRESS, i.port),
        // INBOUND is what `drain_listeners?inboundonly` drains.
        "traffic_direction": "INBOUND",
    });
    match tls {
        InboundTls::None => listener["filter_chains"] = json!([chain]),
        InboundTls::Required(ts) => {
            chain["transport_socket"] = ts.clone();
            listener["filter_chains"] = json!([chain]);
        }
        InboundTls::Permissive(ts) => {
            let mut mesh = chain.clone();
            mesh["name"] = json!(shape::MESH_CHAIN);
            mesh["filter_chain_match"] = json!({
                "transport_protocol": "tls",
                "application_protocols": [remora_contract::mesh::MTLS_ALPN]
            });
            mesh["transport_socket"] = ts.clone();
            chain["name"] = json!(shape::PLAINTEXT_CHAIN);
            listener["filter_chains"] = json!([mesh, chain]);
            // Reads the ClientHello (SNI, ALPN) for the chain match; a
            // plain-text client's first bytes end it at once (HTTP speaks
            // first, so nothing waits on the listener filter's timeout).
            listener["listener_filters"] = json!([{
                "name": "envoy.filters.listener.tls_inspector",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"}
            }]);
        }
    }
    listener
}

fn outbound_listener(port: u16, cluster: &str) -> Value {
    let name = format!("outbound_{port}");
    json!({
        "name": name,
        // The app reaches its sidecar on loopback only.
        "address": socket_address("127.0.0.1", port),
        // OUTBOUND listeners keep serving while inbound drains.
        "traffic_direction": "OUTBOUND",
        "filter_chains": [{
            "filters": [{
                "name": "envoy.filters.network.tcp_proxy",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                    "stat_prefix": name,
                    "cluster": cluster
                }
            }]
        }]
    })
}

fn prometheus_cluster(admin_port: u16) -> Value {
    static_cluster(PROMETHEUS_CLUSTER, "127.0.0.1", admin_port)
}

/// `0.0.0.0:<stats-port>/stats/prometheus`, proxied to the loopback-only admin
/// interface; nothing else of the admin API is reachable through it.
fn prometheus_listener(port: u16) -> Value {
    json!({
        "name": PROMETHEUS_STAT_PREFIX,
        "stat_prefix": PROMETHEUS_STAT_PREFIX,
        "address": socket_address("0.0.0.0", port),
        "filter_chains": [{
            "filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": PROMETHEUS_STAT_PREFIX,
                    "codec_type": "AUTO",
                    "route_config": {
                        "virtual_hosts": [{
                            "name": "stats",
                            "domains": ["*"],
                            "routes": [{
                                "match": {"path": "/stats/prometheus"},
                                "route": {"cluster": PROMETHEUS_CLUSTER}
                            }]
                        }]
                    },
                    "http_filters": [router_filter()]
                }
            }]
        }]
    })
}

fn check_admin_loopback(bootstrap: &Value) -> Result<(), BootstrapError> {
    let sa = &bootstrap["admin"]["address"]["socket_address"];
    let address = sa["address"].as_str().unwrap_or("");
    let loopback = address
        .parse::<IpAddr>()
        .map(|ip| ip.is_loopback())
        .unwrap_or(address == "localhost");
    // A pipe (Unix socket) admin address is local as well.
    let pipe = bootstrap["admin"]["address"]["pipe"].is_object();
    if loopback || pipe {
        Ok(())
    } else {
        Err(BootstrapError::AdminNotLoopback(format!(
            "{address}:{}",
            sa["port_value"]
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn cfg(args: &[&str]) -> RunConfig {
        let mut argv = vec!["remora-agent", "run"];
        argv.extend_from_slice(args);
        let cli = crate::config::Cli::try_parse_from(argv).expect("parses");
        match cli.command {
            crate::config::Command::Run(c) => *c,
            _ => unreachable!(),
        }
    }

    #[test]
    fn static_mode_listeners_have_directions() {
        let c = cfg(&[
            "--inbound",
            "15006:8080",
            "--outbound",
            "15001:example.org:80",
        ]);
        let b = generate(&c, &Extras::default(), None, true).expect("generates");
        let listeners = b["static_resources"]["listeners"]
            .as_array()
            .expect("array");
        let dir = |name: &str| {
            listeners
                .iter()
                .find(|l| l["name"] == name)
                .map(|l| l["traffic_direction"].clone())
        };
        assert_eq!(dir("inbound_15006"), Some(json!("INBOUND")));
        assert_eq!(dir("outbound_15001"), Some(json!("OUTBOUND")));
        assert_eq!(dir(PROMETHEUS_STAT_PREFIX), Some(Value::Null));
        assert_eq!(
            b["admin"]["address"]["socket_address"]["address"],
            "127.0.0.1"
        );
        assert!(b.get("dynamic_resources").is_none());
        let outbound = b["static_resources"]["clusters"]
            .as_array()
            .expect("clusters")
            .iter()
            .find(|c| c["name"] == "outbound|15001|example.org|80")
            .expect("outbound cluster");
        assert_eq!(outbound["type"], "STRICT_DNS");
    }

    #[test]
    fn idle_close_monitor_only_when_asked() {
        let c = cfg(&["--inbound", "15006:8080"]);
        let monitors = |idle_close| {
            let b = generate(&c, &Extras::default(), None, idle_close).expect("generates");
            let om = &b["overload_manager"];
            let names: Vec<Value> = om["resource_monitors"]
                .as_array()
                .expect("monitors")
                .iter()
                .map(|m| m["name"].clone())
                .collect();
            (names, om["actions"].as_array().expect("actions").len())
        };
        let (with, actions) = monitors(true);
        assert!(with.contains(&json!("envoy.resource_monitors.injected_resource")));
        assert_eq!(actions, 1);
        let (without, actions) = monitors(false);
        assert_eq!(
            without,
            [json!(
                "envoy.resource_monitors.global_downstream_max_connections"
            )]
        );
        assert_eq!(actions, 0);
    }

    #[test]
    fn xds_mode_has_ads() {
        let c = cfg(&[
            "--discovery-address",
            "istiod.istio-system.svc:15010",
            "--run-dir",
            "/r",
            "--inbound",
            "15006:8080",
            "--outbound",
            "15001:example.org:80",
            "--pod-name",
            "web-1",
            "--pod-namespace",
            "shop",
            "--instance-ip",
            "10.0.0.7",
        ]);
        let b = generate(&c, &Extras::default(), None, true).expect("generates");
        assert_eq!(
            b["dynamic_resources"]["ads_config"]["grpc_services"][0]["envoy_grpc"]["cluster_name"],
            XDS_CLUSTER
        );
        assert_eq!(b["dynamic_resources"]["lds_config"]["ads"], json!({}));
        assert_eq!(b["dynamic_resources"]["cds_config"]["ads"], json!({}));
        // Delta by default; state of the world on request.
        assert_eq!(
            b["dynamic_resources"]["ads_config"]["api_type"],
            "DELTA_GRPC"
        );
        let sotw = cfg(&[
            "--discovery-address",
            "istiod.istio-system.svc:15010",
            "--discovery-delta=false",
        ]);
        let sotw = generate(&sotw, &Extras::default(), None, true).expect("generates");
        assert_eq!(sotw["dynamic_resources"]["ads_config"]["api_type"], "GRPC");
        let clusters = b["static_resources"]["clusters"]
            .as_array()
            .expect("clusters");
        let ads = clusters
            .iter()
            .find(|c| c["name"] == XDS_CLUSTER)
            .expect("ADS cluster");
        assert_eq!(
            ads["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]
                ["path"],
            "/r/xds.sock"
        );
        // Inbound and outbound come from the server; only stats stays static.
        let names: Vec<&str> = b["static_resources"]["listeners"]
            .as_array()
            .expect("listeners")
            .iter()
            .filter_map(|l| l["name"].as_str())
            .collect();
        assert_eq!(names, [PROMETHEUS_STAT_PREFIX]);
        assert!(
            !clusters.iter().any(
                |c| c["name"] == "outbound|15001|example.org|80" || c["name"] == "inbound|8080"
            )
        );
        // Its inbound ports are still the pod's: a clash is refused at start.
        let twice = cfg(&[
            "--discovery-address",
            "x:1",
            "--inbound",
            "8080",
            "--inbound",
            "15006:8081",
        ]);
        assert!(matches!(
            generate(&twice, &Extras::default(), None, true),
            Err(BootstrapError::DuplicatePort(15006))
        ));
        assert_eq!(
            b["node"]["id"],
            "sidecar~10.0.0.7~web-1.shop~shop.svc.cluster.local"
        );
        // The server binds the outbound ports, but one that is a sidecar
        // port is still refused at start.
        let clash = cfg(&[
            "--discovery-address",
            "x:1",
            "--inbound",
            "15006:8080",
            "--outbound",
            "15006:cart.shop:80",
        ]);
        assert!(matches!(
            generate(&clash, &Extras::default(), None, true),
            Err(BootstrapError::DuplicatePort(15006))
        ));
        let bad_node = cfg(&["--discovery-address", "x:1", "--pod-name", "a~b"]);
        assert!(matches!(
            generate(&bad_node, &Extras::default(), None, true),
            Err(BootstrapError::NodeId(_))
        ));
        let bad = cfg(&["--discovery-address", "nohost"]);
        assert!(matches!(
            generate(&bad, &Extras::default(), None, true),
            Err(BootstrapError::DiscoveryAddress(_))
        ));
    }

    #[test]
    fn override_merges_and_admin_stays_loopback() {
        let c = cfg(&[]);
        let patch = json!({"node": {"cluster": "custom"}, "stats_flush_interval": "10s"});
        let b = generate(&c, &Extras::default(), Some(&patch), true).expect("generates");
        assert_eq!(b["node"]["cluster"], "custom");
        assert_eq!(b["stats_flush_interval"], "10s");
        assert!(
            b["node"]["id"]
                .as_str()
                .expect("id")
                .starts_with("sidecar~")
        );

        let expose = json!({"admin": {"address": {"socket_address": {"address": "0.0.0.0"}}}});
        assert!(matches!(
            generate(&c, &Extras::default(), Some(&expose), true),
            Err(BootstrapError::AdminNotLoopback(_))
        ));
    }

    #[test]
    fn duplicate_ports_are_refused() {
        let c = cfg(&["--inbound", "15090:8080"]);
        assert!(matches!(
            generate(&c, &Extras::default(), None, true),
            Err(BootstrapError::DuplicatePort(15090))
        ));
    }

    #[test]
    fn override_file_formats() {
        let dir = tempfile::tempdir().expect("tempdir");
        let yaml = dir.path().join("o.yaml");
        std::fs::write(&yaml, "node:\n  cluster: from-yaml\n").expect("write");
        assert_eq!(
            read_override(&yaml).expect("yaml")["node"]["cluster"],
            "from-yaml"
        );
        let list = dir.path().join("l.yaml");
        std::fs::write(&list, "- 1\n- 2\n").expect("write");
        assert!(matches!(
            read_override(&list),
            Err(BootstrapError::OverrideNotObject { .. })
        ));
        let bad = dir.path().join("b.json");
        std::fs::write(&bad, "{: [").expect("write");
        assert!(matches!(
            read_override(&bad),
            Err(BootstrapError::ParseOverride { .. })
        ));
        assert!(matches!(
            read_override(&dir.path().join("missing")),
            Err(BootstrapError::ReadOverride { .. })
        ));
    }
}
