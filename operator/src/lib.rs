//! remora-operator: the mutating webhook that injects Remora's sidecar, its
//! effective-config resolution, and offline (GitOps) injection.

pub mod alloc;
pub mod app;
pub mod ca;
pub mod cluster;
pub mod controller;
pub mod flags;
pub mod interned;
pub mod jobs;
pub mod leader;
pub mod live_pod;
pub mod server;
pub mod status;
pub mod tls;
pub mod watch;
pub mod webhook;
pub mod workload_ca;
