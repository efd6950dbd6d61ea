//! End-to-end harness: a test app, a load generator, and (later) the control
//! plane and the kubelet-emulating pod runner.

pub mod controlplane;
pub mod envoy;
pub mod load;
pub mod podrunner;
