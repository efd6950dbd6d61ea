//! Tests of real processes on loopback, with no API server: Envoy, the agent,
//! the operator's discovery server, the test app and the traffic library.
//! One binary, one module per subject.

mod cert_rotation;
mod contract_agreement;
mod delta_xds;
mod demo;
mod grpc_drain;
mod images;
mod inbound_xds;
mod scale;
mod secure_naming;
mod test_app;
mod traffic;
mod withdrawal;
