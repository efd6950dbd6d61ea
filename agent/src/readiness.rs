//! The agent's readiness: named guards (shared with the operator's
//! `/readyz`, so it lives with the servers that report it).

pub use remora_serve::readiness::{Readiness, ReadinessGuard};
