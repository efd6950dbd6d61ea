//! The name the operator writes under.

/// The operator as the API server records who wrote what: the field manager
/// of its patches and the reporting controller of its Events. Server-side
/// apply ties field ownership to it, so every apply that may meet fields
/// written under another name (`remora-injector` before the rename) forces.
pub const FIELD_MANAGER: &str = "remora-operator";
