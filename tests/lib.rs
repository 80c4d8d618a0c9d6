//! The integration suite lives in this package's test targets, one directory per area:
//! `memory/`, `services/`, … Run them all with `cargo test --workspace`.
