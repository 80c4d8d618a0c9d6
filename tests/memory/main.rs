//! The conformance suite against the in-process memory store.

use std::sync::Arc;

use idempotency_core::{MemoryStore, Store};

idempotency_test::conformance_tests!(async {
    // Cases use fresh keys, so one store serves them all, as a container does for the others.
    static STORE: std::sync::OnceLock<Arc<dyn Store>> = std::sync::OnceLock::new();
    Some(STORE.get_or_init(|| Arc::new(MemoryStore::new())).clone())
});
