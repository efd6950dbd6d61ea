//! The operator's integration tests, one binary: its command line, the
//! webhook and its server, the workload CA, the discovery server, the
//! API-writing parts against fake API servers, and its module graph. The
//! memory tests are binaries of their own (nothing else allocates or runs
//! meanwhile).

mod cli;
mod discovery;
mod drain;
mod fake_api;
mod namespace_lookup;
mod rooms;
mod webhook;
mod workload_ca;
