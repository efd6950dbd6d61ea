//! Helpers shared by Remora's tests, benchmarks and the e2e harness, so each
//! exists once: free ports, a test PKI, JWT-shaped tokens, the kubelet's
//! atomic volume writer, locating Envoy and sibling binaries, waiting with
//! a deadline, inline label/annotation maps, an app that names itself, the webhook's HTTPS client,
//! an HTTP/2-over-TLS connection from a chosen source address, an xDS
//! server double and the ADS requests of a simulated Envoy, a raised open-file limit for benches,
//! and a process's inotify instances.
//!
//! Only ever a dev-dependency (or a dependency of the unpublished e2e
//! crate): it sits below `remora-agent` and `remora-operator` and must not
//! depend on them. Helpers panic with a clear message where a test could do
//! nothing but fail; those a harness recovers from return errors.

pub mod ads_requests;
pub mod bins;
pub mod h2_client;
pub mod inotify;
pub mod jwt;
pub mod kubelet;
pub mod maps;
pub mod named_backend;
pub mod open_files;
pub mod pki;
pub mod ports;
pub mod results;
pub mod wait;
pub mod webhook_client;
pub mod xds_double;
