//! The layer behind axum's `Router::nest`, built with the facade's `tower` feature alone (run
//! it so: `cargo test -p idempotency --features tower --test nested`; a workspace run turns
//! every feature on). The layer on a nested router sees the path without the nest's prefix:
//! unless it reads axum's `OriginalUri`, one key reused on another account's path replays the
//! first account's charge instead of answering 422.
#![cfg(feature = "tower")]

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{Router, body::Body, http::Request, routing::post};
use idempotency::{MemoryStore, tower::IdempotencyLayer};
use tower::ServiceExt;

#[tokio::test]
async fn a_key_reused_on_another_nested_path_is_422() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let charges = Router::new()
        .route(
            "/charges",
            post(move || async move {
                counted.fetch_add(1, Ordering::SeqCst);
                (axum::http::StatusCode::CREATED, "charged")
            }),
        )
        // One principal (a platform acting for its accounts): the account is in the path only.
        .route_layer(
            IdempotencyLayer::new(Arc::new(MemoryStore::new()))
                .scope_fn(|_| idempotency::Scope::new("platform")),
        );
    let app = Router::new().nest("/accounts/{account}", charges);
    let charge = |account: &str| {
        Request::post(format!("/accounts/{account}/charges"))
            .header("idempotency-key", "k")
            .body(Body::from("{}"))
            .expect("request")
    };
    let first = app.clone().oneshot(charge("a")).await.expect("answered");
    assert_eq!(first.status(), 201);
    let other = app.oneshot(charge("b")).await.expect("answered");
    assert_eq!(
        other.status(),
        422,
        "account b was answered with account a's charge"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
