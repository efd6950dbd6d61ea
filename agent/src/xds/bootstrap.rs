//! Envoy bootstrap snippets for discovery mode, as JSON values the bootstrap
//! generator splices in. In that mode only the stats listener and the
//! `xds-grpc`/`sds-grpc` clusters are static; every inbound and outbound
//! listener and its clusters come over LDS/CDS (see [`crate::bootstrap`]),
//! and readiness waits until Envoy has ACKed the first of them.

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

/// `dynamic_resources`: ADS over `xds-grpc`, delta (`DELTA_GRPC`) or state
/// of the world (`GRPC`), LDS and CDS from it (RDS and EDS, when the server
/// uses them, name ADS themselves).
///
/// Delta is the default (`--discovery-delta`): an endpoint change then
/// sends the one load assignment that changed, not every one the proxy
/// holds, and a reconnect resends only what changed, by resource, even
/// when the type's other resources moved on meanwhile (Istio made delta its
/// default for the same reasons). Remora's operator injects the agent of
/// its own release, so an agent meets a server without delta only in a
/// mixed rollout of the operator; it then retries (Envoy keeps serving)
/// until it reaches an upgraded replica, and `--discovery-delta=false`
/// keeps state of the world for a server that never will.
pub fn dynamic_resources(delta: bool) -> Value {
    json!({
        "ads_config": {
            "api_type": if delta { "DELTA_GRPC" } else { "GRPC" },
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
            "set_node_on_first_message_only": true
        },
        "lds_config": {"ads": {}, "resource_api_version": "V3"},
        "cds_config": {"ads": {}, "resource_api_version": "V3"}
    })
}
