//! remora-inject: what the operator adds to a pod, as pure functions.
//!
//! - [`resolve`]: a pod's effective sidecar configuration from its layers
//!   (chart < cluster < namespace < workload < pod).
//! - [`patch`]: whether a pod is injected and the JSON patch that does it.
//! - [`review`]: an AdmissionReview read, decided and answered.
//! - [`offline`]: the same injection over manifests (GitOps).

pub mod offline;
pub mod patch;
pub mod resolve;
pub mod review;
