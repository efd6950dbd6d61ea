//! Envoy bootstrap snippets for discovery mode, as JSON values the bootstrap
//! generator splices in.

use std::path::Path;

use serde_json::{Value, json};

/// Name of the static cluster that reaches the agent's xDS proxy socket.
pub const XDS_CLUSTER: &str = "xds-grpc";

/// The static cluster `xds-grpc`: HTTP/2 (gRPC) to the proxy's Unix socket,
/// as `sds-grpc` reaches the SDS socket. Goes into `static_resources.clusters`.
pub fn ads_cluster(socket: &Path) -> Value {
    json!({
        "name": XDS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": { "http2_protocol_options": {} }
            }
        },
        "load_assignment": {
            "cluster_name": XDS_CLUSTER,
            "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": {
                "pipe": { "path": socket.to_string_lossy() }
            }}}]}]
        }
    })
}

/// `dynamic_resources`: state-of-the-world ADS over `xds-grpc`, LDS and CDS
/// from it (RDS and EDS, when the server uses them, name ADS themselves).
pub fn dynamic_resources() -> Value {
    json!({
        "ads_config": {
            "api_type": "GRPC",
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
            "set_node_on_first_message_only": true
        },
        "lds_config": {"ads": {}, "resource_api_version": "V3"},
        "cds_config": {"ads": {}, "resource_api_version": "V3"}
    })
}
