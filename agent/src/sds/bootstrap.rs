//! Envoy bootstrap snippets for SDS, as JSON values the bootstrap generator
//! splices in.

use std::path::Path;

use serde_json::{Value, json};

use super::store::{ROOT_CA, WORKLOAD_CERT};
use crate::bootstrap::Extras;
use crate::config::RunConfig;

/// Name of the static cluster that reaches the agent's SDS socket (the
/// discovery server's clusters name it too).
pub const SDS_CLUSTER: &str = remora_contract::mesh::SDS_CLUSTER;

/// The static cluster `sds-grpc`: HTTP/2 (gRPC) to the Unix socket `socket`.
/// Goes into `static_resources.clusters`.
pub fn sds_cluster(socket: &Path) -> Value {
    json!({
        "name": SDS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": { "http2_protocol_options": {} }
            }
        },
        "load_assignment": {
            "cluster_name": SDS_CLUSTER,
            "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": {
                "pipe": { "path": socket.to_string_lossy() }
            }}}]}]
        }
    })
}

/// What SDS adds to the generated bootstrap: the `sds-grpc` cluster always
/// (xDS-delivered configs may use its secrets), with `--inbound-tls`
/// mTLS from `default`/`ROOTCA` on every inbound listener, else with the
/// workload CA (`--ca-address`) the mesh's mTLS beside plain text on
/// them (permissive), and with `--outbound-tls` mTLS on the named outbound
/// listeners' clusters.
pub fn extras(cfg: &RunConfig, socket: &Path) -> Extras {
    use remora_contract::inbound::InboundTls;
    let tls = InboundTls::of(
        cfg.inbound_tls.then(|| cfg.inbound_tls_san.clone()),
        cfg.ca_address.is_some(),
    );
    let (inbound_transport_socket, inbound_mesh_transport_socket) = match tls {
        InboundTls::Required { sans } => (Some(inbound_tls_transport_socket(&sans)), None),
        InboundTls::Permissive => (None, Some(inbound_tls_transport_socket(&[]))),
        InboundTls::None => (None, None),
    };
    Extras {
        clusters: vec![sds_cluster(socket)],
        inbound_transport_socket,
        inbound_mesh_transport_socket,
        outbound_transport_sockets: cfg
            .outbound_tls
            .iter()
            .map(|s| (s.port, outbound_tls_transport_socket(&s.spiffe_id)))
            .collect(),
    }
}

/// An `SdsSecretConfig` for `name` served over the `sds-grpc` cluster.
/// `initial_fetch_timeout: 0s` keeps a listener warming until the secret
/// arrives, instead of starting without TLS material.
pub fn sds_secret_config(name: &str) -> Value {
    json!({
        "name": name,
        "sds_config": {
            "api_config_source": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{ "envoy_grpc": { "cluster_name": SDS_CLUSTER } }],
                "set_node_on_first_message_only": true
            },
            "resource_api_version": "V3",
            "initial_fetch_timeout": "0s"
        }
    })
}

/// SAN matchers: `spiffe://…` and other URIs match the URI SAN, anything else a DNS SAN.
fn san_matchers(sans: &[String]) -> Vec<Value> {
    sans.iter()
        .map(|s| {
            let ty = if s.contains("://") { "URI" } else { "DNS" };
            json!({ "san_type": ty, "matcher": { "exact": s } })
        })
        .collect()
}

/// A `CommonTlsContext` presenting `default` and verifying the peer
/// against `ROOTCA` (both from SDS); with `sans`, the peer must carry one of
/// them. Both directions of mTLS use it.
fn workload_tls_context(sans: &[String]) -> Value {
    let mut default_ctx = json!({});
    if !sans.is_empty() {
        default_ctx["match_typed_subject_alt_names"] = Value::Array(san_matchers(sans));
    }
    json!({
        "tls_certificate_sds_secret_configs": [sds_secret_config(WORKLOAD_CERT)],
        "combined_validation_context": {
            "default_validation_context": default_ctx,
            "validation_context_sds_secret_config": sds_secret_config(ROOT_CA)
        }
    })
}

/// The inbound mTLS transport socket: a `DownstreamTlsContext` presenting
/// `default` and verifying clients against `ROOTCA` (both from SDS),
/// requiring a client certificate; with `sans`, a client must carry one of them.
/// Goes into each inbound filter chain's `transport_socket` (`--inbound-tls`),
/// or into the mesh's filter chain of a permissive inbound listener, where
/// any certificate of the mesh is admitted (who may call is not the
/// server's sidecar's to say; which server is called is the client's,
/// secure naming).
pub fn inbound_tls_transport_socket(sans: &[String]) -> Value {
    json!({
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": true,
            "common_tls_context": workload_tls_context(sans)
        }
    })
}

/// The outbound mTLS transport socket: an `UpstreamTlsContext` presenting
/// `default` and accepting only an upstream whose certificate, verified
/// against `ROOTCA`, carries the URI SAN `spiffe_id`. Goes into an outbound
/// cluster's `transport_socket` (`--outbound-tls`).
pub fn outbound_tls_transport_socket(spiffe_id: &str) -> Value {
    json!({
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": workload_tls_context(&[spiffe_id.to_string()])
        }
    })
}

/// Which of the workload secrets (`default`, `ROOTCA`) a configuration
/// makes Envoy fetch from this agent's SDS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsedSecrets {
    pub workload: bool,
    pub root_ca: bool,
}

impl UsedSecrets {
    pub const BOTH: Self = Self {
        workload: true,
        root_ca: true,
    };

    pub fn any(&self) -> bool {
        self.workload || self.root_ca
    }

    /// What the bootstrap's static listeners and clusters (generated, or from
    /// `--bootstrap-override`) fetch from the `sds-grpc` cluster: Envoy asks
    /// for exactly those while it starts. Listeners and clusters an xDS
    /// server sends later are not known here; Envoy is not LIVE before the
    /// first ones have warmed, secrets included (within the `sds_config`'s
    /// `initial_fetch_timeout`, the server's choice), so the `envoy` guard
    /// covers them, and one that sends no TLS listener adds nothing to wait for.
    pub fn of_bootstrap(bootstrap: &Value) -> Self {
        let mut used = Self::default();
        let statics = field(bootstrap, "static_resources");
        for kind in ["listeners", "clusters"] {
            if let Some(Value::Array(items)) = statics.and_then(|s| field(s, kind)) {
                for item in items {
                    used.collect(item);
                }
            }
        }
        used
    }

    fn collect(&mut self, v: &Value) {
        match v {
            Value::Object(map) => {
                if let (Some(Value::String(name)), Some(cfg)) =
                    (map.get("name"), field(v, "sds_config"))
                    && uses_sds_cluster(cfg)
                {
                    match name.as_str() {
                        WORKLOAD_CERT => self.workload = true,
                        ROOT_CA => self.root_ca = true,
                        _ => {}
                    }
                }
                map.values().for_each(|c| self.collect(c));
            }
            Value::Array(items) => items.iter().for_each(|c| self.collect(c)),
            _ => {}
        }
    }
}

impl std::fmt::Display for UsedSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = [(self.workload, WORKLOAD_CERT), (self.root_ca, ROOT_CA)]
            .into_iter()
            .filter_map(|(on, n)| on.then_some(n))
            .collect();
        f.write_str(&names.join(" and "))
    }
}

/// A field by its proto name, in either JSON spelling Envoy accepts
/// (`sds_config` or `sdsConfig`): an override may use either.
fn field<'a>(v: &'a Value, snake: &str) -> Option<&'a Value> {
    let map = v.as_object()?;
    map.get(snake).or_else(|| {
        let mut camel = String::with_capacity(snake.len());
        let mut up = false;
        for c in snake.chars() {
            if c == '_' {
                up = true;
            } else if up {
                camel.extend(c.to_uppercase());
                up = false;
            } else {
                camel.push(c);
            }
        }
        map.get(&camel)
    })
}

/// Whether an SDS `ConfigSource` points at the `sds-grpc` cluster.
fn uses_sds_cluster(cfg: &Value) -> bool {
    match cfg {
        Value::Object(map) => {
            field(cfg, "cluster_name").and_then(Value::as_str) == Some(SDS_CLUSTER)
                || map.values().any(uses_sds_cluster)
        }
        Value::Array(items) => items.iter().any(uses_sds_cluster),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn cfg(args: &[&str]) -> RunConfig {
        let mut argv = vec!["remora-agent", "run"];
        argv.extend_from_slice(args);
        match crate::config::Cli::try_parse_from(argv)
            .expect("parses")
            .command
        {
            crate::config::Command::Run(c) => *c,
            _ => unreachable!("a run command"),
        }
    }

    /// What the agent's readiness waits for, per configuration.
    fn used(args: &[&str], override_doc: Option<Value>) -> UsedSecrets {
        let c = cfg(args);
        let b = crate::bootstrap::generate(
            &c,
            &extras(&c, Path::new("/run/sds.sock")),
            override_doc.as_ref(),
            true,
        )
        .expect("bootstrap");
        UsedSecrets::of_bootstrap(&b)
    }

    #[test]
    fn used_secrets_follow_the_listeners_of_the_bootstrap() {
        let none = UsedSecrets::default();
        // Certificates configured, but no listener uses them.
        assert_eq!(
            used(&["--inbound", "15006:8080", "--cert-dir", "/c"], None),
            none
        );
        assert_eq!(
            used(
                &["--ca-address", "ca:15012", "--outbound", "15001:x:80"],
                None
            ),
            none
        );
        // xDS mode: what the control plane sends later is not counted.
        assert_eq!(
            used(
                &["--discovery-address", "xds:15010", "--cert-dir", "/c"],
                None
            ),
            none
        );
        // `--inbound-tls`: both in static mode; in xDS mode the server
        // sends the inbound listeners, so the bootstrap fetches none.
        let tls = ["--inbound", "15006:8080", "--inbound-tls"];
        assert_eq!(used(&tls, None), UsedSecrets::BOTH);
        let xds_tls = [&tls[..], &["--discovery-address", "xds:15010"]].concat();
        assert_eq!(used(&xds_tls, None), none);
        assert_eq!(UsedSecrets::BOTH.to_string(), "default and ROOTCA");

        // An override's listener, in the proto's camelCase JSON, using only
        // `default` from this agent and a root from elsewhere.
        let ov = json!({"static_resources": {"listeners": [{
            "name": "custom",
            "filterChains": [{"transportSocket": {"typedConfig": {"commonTlsContext": {
                "tlsCertificateSdsSecretConfigs": [{
                    "name": "default",
                    "sdsConfig": {"apiConfigSource": {"grpcServices": [
                        {"envoyGrpc": {"clusterName": "sds-grpc"}}
                    ]}}
                }],
                "validationContextSdsSecretConfig": {
                    "name": "ROOTCA", "sdsConfig": {"ads": {}}
                }
            }}}}]
        }]}});
        assert_eq!(
            used(&["--cert-dir", "/c"], Some(ov)),
            UsedSecrets {
                workload: true,
                root_ca: false
            }
        );
        // A cluster that uses ROOTCA (upstream mTLS) counts too.
        let ov = json!({"static_resources": {"clusters": [{
            "name": "up",
            "transport_socket": {"typed_config": {"common_tls_context": {
                "validation_context_sds_secret_config": sds_secret_config("ROOTCA")
            }}}
        }]}});
        assert_eq!(
            used(&["--cert-dir", "/c"], Some(ov)),
            UsedSecrets {
                workload: false,
                root_ca: true
            }
        );
        assert_eq!(UsedSecrets::of_bootstrap(&json!([1, {"a": null}])), none);
        // The workload CA wired: the permissive inbound listener uses both.
        assert_eq!(
            used(
                &["--inbound", "15006:8080", "--ca-address", "ca:15012"],
                None
            ),
            UsedSecrets::BOTH
        );
        // `--outbound-tls`: the outbound cluster uses both, with no inbound TLS.
        assert_eq!(
            used(
                &[
                    "--outbound",
                    "15001:x:80",
                    "--outbound-tls",
                    "15001=spiffe://cluster.local/ns/a/sa/b",
                ],
                None
            ),
            UsedSecrets::BOTH
        );
    }

    #[test]
    fn outbound_tls_goes_on_the_named_outbound_cluster_only() {
        let id = "spiffe://cluster.local/ns/shop/sa/cart";
        let c = cfg(&[
            "--outbound",
            "15001:cart.shop:80,15002:10.0.0.9:5432",
            "--outbound-tls",
            &format!("15001={id}"),
        ]);
        let b = crate::bootstrap::generate(&c, &extras(&c, Path::new("/run/sds.sock")), None, true)
            .expect("bootstrap");
        let cluster = |name: &str| {
            b["static_resources"]["clusters"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["name"] == name))
                .cloned()
                .unwrap_or_else(|| panic!("cluster {name}"))
        };
        let tls = cluster("outbound|15001|cart.shop|80");
        let ts = &tls["transport_socket"];
        assert_eq!(ts["name"], "envoy.transport_sockets.tls");
        assert_eq!(
            ts["typed_config"]["@type"],
            "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
        );
        let ctx = &ts["typed_config"]["common_tls_context"];
        assert_eq!(
            ctx["tls_certificate_sds_secret_configs"],
            json!([sds_secret_config("default")])
        );
        assert_eq!(
            ctx["combined_validation_context"],
            json!({
                "default_validation_context": {"match_typed_subject_alt_names": [
                    {"san_type": "URI", "matcher": {"exact": id}}
                ]},
                "validation_context_sds_secret_config": sds_secret_config("ROOTCA")
            })
        );
        assert!(
            cluster("outbound|15002|10.0.0.9|5432")
                .get("transport_socket")
                .is_none()
        );
        // The listeners stay plain TCP for the app.
        let listeners = b["static_resources"]["listeners"]
            .as_array()
            .expect("listeners");
        assert!(
            listeners
                .iter()
                .all(|l| l["filter_chains"][0].get("transport_socket").is_none())
        );
    }

    #[test]
    fn snippets_have_the_contract_names() {
        let c = sds_cluster(Path::new("/var/run/remora/sds.sock"));
        assert_eq!(c["name"], "sds-grpc");
        assert_eq!(
            c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]
                ["path"],
            "/var/run/remora/sds.sock"
        );
        let t = inbound_tls_transport_socket(&[
            "spiffe://cluster.local/ns/a/sa/b".into(),
            "x.example".into(),
        ]);
        let ctx = &t["typed_config"]["common_tls_context"];
        assert_eq!(
            ctx["tls_certificate_sds_secret_configs"][0]["name"],
            "default"
        );
        let cvc = &ctx["combined_validation_context"];
        assert_eq!(
            cvc["validation_context_sds_secret_config"]["name"],
            "ROOTCA"
        );
        let m = &cvc["default_validation_context"]["match_typed_subject_alt_names"];
        assert_eq!(m[0]["san_type"], "URI");
        assert_eq!(m[1]["san_type"], "DNS");
        let t = inbound_tls_transport_socket(&[]);
        assert!(
            t["typed_config"]["common_tls_context"]["combined_validation_context"]["default_validation_context"]
                .get("match_typed_subject_alt_names")
                .is_none()
        );
    }

    /// The inbound listener of `args`' bootstrap.
    fn inbound(args: &[&str]) -> Value {
        let c = cfg(args);
        let b = crate::bootstrap::generate(&c, &extras(&c, Path::new("/run/sds.sock")), None, true)
            .expect("bootstrap");
        b["static_resources"]["listeners"]
            .as_array()
            .and_then(|ls| ls.iter().find(|l| l["name"] == "inbound_15006"))
            .cloned()
            .expect("inbound listener")
    }

    #[test]
    fn the_workload_ca_makes_the_inbound_listener_permissive() {
        let l = inbound(&["--inbound", "15006:8080", "--ca-address", "ca:15012"]);
        assert_eq!(
            l["listener_filters"][0]["name"],
            "envoy.filters.listener.tls_inspector"
        );
        let chains = l["filter_chains"].as_array().expect("chains");
        assert_eq!(chains.len(), 2);
        let (mesh, plain) = (&chains[0], &chains[1]);
        // Only a ClientHello offering the mesh's ALPN is terminated here.
        assert_eq!(
            mesh["filter_chain_match"],
            json!({"transport_protocol": "tls", "application_protocols": ["remora-mtls"]})
        );
        let tls = &mesh["transport_socket"]["typed_config"];
        assert_eq!(tls["require_client_certificate"], true);
        // Any certificate of the mesh: which server is called is the
        // client's check (secure naming), not who calls.
        assert!(
            tls["common_tls_context"]["combined_validation_context"]["default_validation_context"]
                .get("match_typed_subject_alt_names")
                .is_none()
        );
        // Everything else: the plain HTTP chain as before, same routes.
        assert!(plain.get("filter_chain_match").is_none());
        assert!(plain.get("transport_socket").is_none());
        assert_eq!(mesh["filters"], plain["filters"]);

        // `--inbound-tls` stays mTLS only; without the CA, plain text only.
        let strict = inbound(&[
            "--inbound",
            "15006:8080",
            "--ca-address",
            "ca:15012",
            "--inbound-tls",
        ]);
        assert_eq!(strict["filter_chains"].as_array().map(Vec::len), Some(1));
        assert!(strict["filter_chains"][0]["transport_socket"].is_object());
        assert!(strict.get("listener_filters").is_none());
        for args in [
            &["--inbound", "15006:8080"][..],
            &["--inbound", "15006:8080", "--cert-dir", "/c"],
        ] {
            let plain = inbound(args);
            assert_eq!(
                plain["filter_chains"].as_array().map(Vec::len),
                Some(1),
                "{args:?}"
            );
            assert!(plain["filter_chains"][0].get("transport_socket").is_none());
            assert!(plain.get("listener_filters").is_none());
        }
    }
}
