//! The operator's certificate authorities: the webhook's serving
//! certificate and the workload CA that signs every sidecar's identity,
//! whose roots rotate alike ([`rotation`]).

pub mod rotation;
pub mod webhook_cert;
pub mod workload_ca;
