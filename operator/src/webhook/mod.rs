//! The mutating webhook: the admission handler over its view of the
//! cluster, its HTTPS server and the serving certificate it reloads. The
//! review itself (parse, decide, encode) is pure: `remora_inject::review`.

pub mod handler;
pub mod server;
pub mod tls;
pub mod view;
