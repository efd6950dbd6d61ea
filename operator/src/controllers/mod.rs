//! What the leader reconciles: SidecarLifecycle resources and their pods,
//! Jobs whose apps have finished, the workload CA's trust bundle, and the
//! status of ExternalServices.

pub mod external_status;
pub mod jobs;
pub mod lifecycle;
pub mod trust_bundle;
