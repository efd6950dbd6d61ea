//! End-to-end harness: a test app, a load generator, workload certificates,
//! remora-agent and pilot-agent side by side on the host, the control plane,
//! the operator as a process, the chart rendered by helm, and the real
//! single-node cluster with Remora installed by helm.

pub mod agentbench;
pub mod certs;
pub mod chart;
pub mod controlplane;
pub mod discovery_bench;
pub mod discovery_rig;
pub mod eds_convergence;
pub mod hostile;
pub mod node;
pub mod operator;
pub mod results_index;
pub mod results_tables;
pub mod scale;
pub mod scale_run;
pub mod stats;
pub mod traffic;
pub mod webhook;
pub mod withdrawal_rollout;
