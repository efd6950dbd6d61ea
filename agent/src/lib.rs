//! remora-agent: generates Envoy's bootstrap, starts and supervises Envoy,
//! serves workload certificates over SDS, reports readiness, and drains
//! Envoy gracefully on termination.

pub mod app;
pub mod bootstrap;
pub mod certs;
pub mod cli;
pub mod config;
pub mod drain;
pub mod envoy;
pub mod hook;
pub mod http_client;
pub mod lifecycle;
pub mod metrics;
pub mod mounted_wake;
pub mod pod_annotations;
pub mod readiness;
pub mod sds;
pub mod servers;
pub mod supervisor;
pub mod telemetry;
pub mod token;
pub mod unix_socket;
pub mod withdrawal;
pub mod xds;
