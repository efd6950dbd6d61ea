//! remora-agent: generates Envoy's bootstrap, starts and supervises Envoy,
//! reports readiness, and drains Envoy gracefully on termination.

pub mod certs;
pub mod config;
pub mod lifecycle;
pub mod readiness;
pub mod sds;
