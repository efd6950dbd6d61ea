//! Tests of the repository's own files: documentation that is generated or
//! quoted from code, and the freshness of `bench/results/`. One binary, one
//! module per subject.

mod docs;
mod results;
