//! Envoy bootstrap snippets for SDS, as JSON values the bootstrap generator
//! splices in.

use std::path::Path;

use serde_json::{Value, json};

use super::store::{ROOT_CA, WORKLOAD_CERT};

/// Name of the static cluster that reaches the agent's SDS socket.
pub const SDS_CLUSTER: &str = "sds-grpc";

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

/// The inbound mTLS transport socket: a `DownstreamTlsContext` presenting
/// `default` and verifying clients against `ROOTCA` (both from SDS),
/// requiring a client certificate; with `sans`, a client must carry one of them.
/// Goes into each inbound filter chain's `transport_socket`.
pub fn inbound_tls_transport_socket(sans: &[String]) -> Value {
    let mut default_ctx = json!({});
    if !sans.is_empty() {
        default_ctx["match_typed_subject_alt_names"] = Value::Array(san_matchers(sans));
    }
    json!({
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": true,
            "common_tls_context": {
                "tls_certificate_sds_secret_configs": [sds_secret_config(WORKLOAD_CERT)],
                "combined_validation_context": {
                    "default_validation_context": default_ctx,
                    "validation_context_sds_secret_config": sds_secret_config(ROOT_CA)
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
