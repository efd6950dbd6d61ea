//! Label and annotation maps written inline in tests.

use std::collections::BTreeMap;

/// `[("k", "v"), ...]` as the `BTreeMap<String, String>` Kubernetes labels
/// and annotations are everywhere in Remora.
pub fn string_map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
