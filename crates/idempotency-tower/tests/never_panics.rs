//! Arbitrary `Idempotency-Key` bytes and bodies never panic the key parser or the
//! fingerprint: every request gets a protocol answer.

use std::sync::Arc;

use axum::{Router, body::Body, http::Request, routing::post};
use idempotency_core::{MemoryStore, Store};
use idempotency_tower::IdempotencyLayer;
use proptest::prelude::*;
use tower::ServiceExt;

fn router() -> Router {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    Router::new()
        .route(
            "/charges",
            post(|body: axum::body::Bytes| async move { body }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .require_key(true)
                .canonical_json()
                .max_request_body(4096),
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_key_and_body_gets_a_protocol_answer(
        key in proptest::collection::vec(any::<u8>(), 0..300),
        second_key in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..20)),
        body in proptest::collection::vec(any::<u8>(), 0..6000),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let status = runtime.block_on(async {
            let mut request = Request::post("/charges");
            // Bytes a header value cannot hold (CR, LF, NUL…) never reach a server.
            if let Ok(value) = axum::http::HeaderValue::from_bytes(&key) {
                request = request.header("idempotency-key", value);
            }
            if let Some(Ok(value)) = second_key.map(|k| axum::http::HeaderValue::from_bytes(&k)) {
                request = request.header("idempotency-key", value);
            }
            let response = router().oneshot(request.body(Body::from(body.clone())).unwrap()).await.unwrap();
            response.status().as_u16()
        });
        prop_assert!([200, 400, 413].contains(&status), "status {}", status);
        if body.len() > 4096 {
            prop_assert!(status == 413 || status == 400);
        }
    }
}
