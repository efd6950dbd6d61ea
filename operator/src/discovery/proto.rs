//! Envoy protobuf pieces the discovery server's resources share: the
//! outbound side ([`super::resources`]) and the inbound side
//! ([`super::inbound`]) build their listeners and clusters from these, so
//! an address, the protocol a cluster speaks upstream and how a secret is
//! fetched from the agent's SDS are written once.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{
    Address, ApiConfigSource, ApiVersion, ConfigSource, GrpcService, Http1ProtocolOptions,
    Http2ProtocolOptions, SocketAddress, address, api_config_source, config_source, grpc_service,
    socket_address,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::SubjectAltNameMatcher;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, SdsSecretConfig, common_tls_context,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    HttpProtocolOptions, http_protocol_options,
};
use envoy_types::pb::google::protobuf::{Any, Duration};
use envoy_types::util::pack_any;
use remora_contract::mesh::{ROOT_SECRET, SDS_CLUSTER, WORKLOAD_SECRET};

/// `ip:port` as an Envoy address.
pub fn socket(ip: &str, port: u16) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: ip.to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(port))),
            ..Default::default()
        })),
    }
}

/// A cluster's `typed_extension_protocol_options`: speak upstream what the
/// client spoke downstream (HTTP/1.1 or HTTP/2).
pub fn downstream_protocol_options() -> HashMap<String, Any> {
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
    HashMap::from([(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".to_string(),
        pack_any(o),
    )])
}

/// The agent's SDS secret `name`, waited for (no initial fetch timeout):
/// the cluster warms until its certificate is there, as the agent's own
/// static listeners do (agent/src/sds/bootstrap.rs).
pub fn sds_secret(name: &str) -> SdsSecretConfig {
    SdsSecretConfig {
        name: name.to_string(),
        sds_config: Some(ConfigSource {
            resource_api_version: ApiVersion::V3 as i32,
            initial_fetch_timeout: Some(Duration::default()),
            config_source_specifier: Some(config_source::ConfigSourceSpecifier::ApiConfigSource(
                ApiConfigSource {
                    api_type: api_config_source::ApiType::Grpc as i32,
                    transport_api_version: ApiVersion::V3 as i32,
                    grpc_services: vec![GrpcService {
                        target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                            grpc_service::EnvoyGrpc {
                                cluster_name: SDS_CLUSTER.into(),
                                ..Default::default()
                            },
                        )),
                        ..Default::default()
                    }],
                    set_node_on_first_message_only: true,
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
    }
}

/// The mesh's side of a TLS handshake, either way: the workload certificate
/// and the mesh roots from the agent's SDS, the peer checked against `sans`.
pub fn mesh_tls_context(sans: Vec<SubjectAltNameMatcher>, alpn: Vec<String>) -> CommonTlsContext {
    CommonTlsContext {
        alpn_protocols: alpn,
        tls_certificate_sds_secret_configs: vec![sds_secret(WORKLOAD_SECRET)],
        validation_context_type: Some(
            common_tls_context::ValidationContextType::CombinedValidationContext(
                common_tls_context::CombinedCertificateValidationContext {
                    default_validation_context: Some(CertificateValidationContext {
                        match_typed_subject_alt_names: sans,
                        ..Default::default()
                    }),
                    validation_context_sds_secret_config: Some(sds_secret(ROOT_SECRET)),
                    ..Default::default()
                },
            ),
        ),
        ..Default::default()
    }
}
