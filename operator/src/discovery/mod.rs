//! The discovery server: Envoy's aggregated discovery service
//! (state-of-the-world; delta is a later step) for the sidecars, on every
//! replica, off by default (`--discovery`).
//!
//! - [`registry`]: Services, their ready endpoints and the proxies' pods,
//!   pure, fed from the shared watches;
//! - [`resources`]: what one proxy may see (LDS, CDS, EDS), only for the
//!   Services it declared in `remora.dev/outbound`;
//! - [`push`]: changes debounced into batches the streams follow;
//! - [`server`]: the ADS service (authentication, per-type versions,
//!   ACK/NACK), served by [`crate::grpc_server`].

pub mod registry;
pub mod resources;
