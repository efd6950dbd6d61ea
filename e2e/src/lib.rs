//! End-to-end harness: a test app, a load generator, workload certificates,
//! the control plane, the injector as a process, and the chart rendered by helm.

pub mod certs;
pub mod chart;
pub mod controlplane;
pub mod injector;
pub mod jobpod;
pub mod load;
pub mod podrunner;
pub mod webhook;
