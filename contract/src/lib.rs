//! The pod contract between `remora-operator` and `remora-agent`.
//!
//! Everything that crosses the process boundary lives here, once: the
//! `remora.dev/*` annotation keys and their JSON shapes, the sidecar's
//! container name, ports, paths and user, the `REMORA_*` environment (and
//! Istio's aliases), the static-mode listener specs, the one duration
//! grammar, the downward-API file format, and the per-field annotation
//! overlay. The operator writes what the agent reads; both read annotations
//! through [`overlay::Overlay`], so they cannot disagree on a value.

pub mod annotations;
pub mod defaults;
pub mod discovery;
pub mod downward;
pub mod duration;
pub mod env;
pub mod inbound;
pub mod lifecycle;
pub mod mesh;
pub mod mode;
pub mod mounted;
pub mod overlay;
pub mod pod;
pub mod traffic;
pub mod value;
pub mod workload_ca;

pub use duration::DurationError;
pub use mode::{DrainMode, LogLevel, SidecarMode};
pub use overlay::{DrainFields, Overlay};
