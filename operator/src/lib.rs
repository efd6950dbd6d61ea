//! remora-operator: the cluster side of Remora. On every replica, the
//! mutating webhook that injects the sidecar and, when enabled, the workload
//! CA; on the elected leader, the SidecarLifecycle and Jobs controllers, the
//! trust-bundle distributor and the webhook certificate's rotation.

pub mod alloc;
pub mod app;
pub mod cluster;
pub mod controllers;
pub mod discovery;
pub mod flags;
pub mod grpc_server;
pub mod identity;
pub mod leader;
pub mod pki;
pub mod pod_events;
pub mod runtime;
pub mod webhook;
