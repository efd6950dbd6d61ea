//! Leadership: the Lease election ([`election`]) and what the elected
//! replica runs ([`tasks`]).

pub mod election;
pub mod tasks;

pub use election::{
    DEFAULT_LEASE_NAME, Elector, KubeLeaseStore, LeaderConfig, LeaderError, LeaseStore, Metrics,
    default_identity, run_elected,
};
