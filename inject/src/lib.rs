//! remora-inject: what the operator adds to a pod, as pure functions.
//!
//! - [`resolve`]: a pod's effective sidecar configuration from its layers
//!   (chart < cluster < namespace < workload < pod).
//! - [`patch`]: whether a pod is injected and the JSON patch that does it.
//! - [`container`]: the sidecar container and the volumes it needs.
//! - [`traffic`]: the sidecar's listeners and mTLS, from the pod's
//!   annotations; what would turn it against itself is refused.
//! - [`review`]: an AdmissionReview read, decided and answered.
//! - [`offline`]: the same injection over manifests (GitOps).

pub mod container;
pub mod offline;
pub mod patch;
pub mod resolve;
pub mod review;
pub mod traffic;
