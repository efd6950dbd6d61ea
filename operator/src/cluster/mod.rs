//! The operator's view of the cluster: one shared watch per kind, the
//! webhook's view of namespaces and lifecycles, and the trimmed pods the
//! leader keeps.

pub mod interned;
pub mod live_pod;
pub mod view;
pub mod watch;
