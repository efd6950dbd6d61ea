//! Envoy: its admin API, its processes, and waiting for it to be up.

pub mod admin;
pub mod idle_close;
pub mod process;
pub mod ready;
