//! Envoy: its admin API and its processes.

pub mod admin;
pub mod process;
