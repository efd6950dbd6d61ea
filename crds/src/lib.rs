//! Remora CRD types. Filled in by the injector issue.
