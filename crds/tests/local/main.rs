//! The CRDs' integration tests, one binary: the schema's CEL rules evaluated
//! locally, and the committed YAML and values schema matching the code.

mod cel_rules;
mod crd_golden;
