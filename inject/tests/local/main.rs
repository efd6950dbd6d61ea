//! The injector's integration tests, one binary: `mutate` (selection, the
//! patched pod, warnings, idempotency), offline injection against golden
//! files, and property tests that nothing panics.

mod fuzz;
mod offline;
mod patch;
