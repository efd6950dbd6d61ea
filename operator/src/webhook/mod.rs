//! The mutating webhook: the admission handler, its HTTPS server and the
//! serving certificate it reloads.

pub mod handler;
pub mod server;
pub mod tls;
