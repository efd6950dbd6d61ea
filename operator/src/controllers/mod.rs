//! What the leader reconciles: SidecarLifecycle resources and their pods,
//! Jobs whose apps have finished, and the workload CA's trust bundle.

pub mod jobs;
pub mod lifecycle;
pub mod trust_bundle;
