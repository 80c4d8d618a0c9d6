//! `canonical_json()` over the memory store: a body that only looks equal once its numbers
//! go through `f64` is another request (422), never a replay of the first one's outcome.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{
    Router,
    body::Body,
    http::{Request, Response, StatusCode},
    routing::post,
};
use http_body_util::BodyExt;
use idempotency_core::{MemoryStore, Store};
use idempotency_tower::IdempotencyLayer;
use tower::ServiceExt;

fn router(calls: Arc<AtomicUsize>) -> Router {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    Router::new()
        .route(
            "/charges",
            post(move |body: axum::body::Bytes| async move {
                calls.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, body)
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .require_key(true)
                .canonical_json(),
        )
}

async fn post_charge(router: &Router, key: &str, body: &str) -> Response<Body> {
    let request = Request::post("/charges")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .expect("request");
    router.clone().oneshot(request).await.expect("infallible")
}

async fn problem_type(response: Response<Body>) -> String {
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).expect("problem JSON");
    problem["type"].as_str().expect("type").to_owned()
}

#[tokio::test]
async fn numbers_equal_only_as_f64_are_another_request() {
    let calls = Arc::new(AtomicUsize::new(0));
    let router = router(calls.clone());

    let first = post_charge(
        &router,
        "k",
        r#"{"amount": 9007199254740993, "currency": "eur"}"#,
    )
    .await;
    assert_eq!(first.status(), StatusCode::CREATED);

    // 2^53 + 1 and 2^53 are one f64: the old RFC 8785 form replayed the first charge here.
    let other = post_charge(
        &router,
        "k",
        r#"{"amount": 9007199254740992, "currency": "eur"}"#,
    )
    .await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(other.headers().get("idempotent-replayed").is_none());
    assert_eq!(
        problem_type(other).await,
        "urn:idempotency:problem:key-reused"
    );

    // The same request, members reordered and spaced differently, is still a replay.
    let retry = post_charge(
        &router,
        "k",
        r#"{ "currency":"eur","amount":9007199254740993 }"#,
    )
    .await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn numbers_as_sent_and_duplicate_keys_make_another_request() {
    let calls = Arc::new(AtomicUsize::new(0));
    let router = router(calls.clone());
    let mut answers = Vec::new();
    for (key, first, second) in [
        (
            "decimal",
            r#"{"rate":0.1}"#,
            r#"{"rate":0.10000000000000000001}"#,
        ),
        ("zero", r#"{"amount":0}"#, r#"{"amount":-0}"#),
        ("exponent", r#"{"amount":100}"#, r#"{"amount":1e2}"#),
        ("duplicate", r#"{"amount":2}"#, r#"{"amount":1,"amount":2}"#),
        // Go's encoding/json, Jackson and .NET can match keys ignoring case, the last one
        // winning: 100 in the first body, 1 in the second. Sorted apart ("A" before "a"),
        // the two had one canonical form and the second replayed the first's charge.
        (
            "case",
            r#"{"amount":1,"Amount":100}"#,
            r#"{"Amount":100,"amount":1}"#,
        ),
        // Go folds `ſ` (U+017F) to `s`; lowercasing leaves it.
        (
            "fold",
            r#"{"deſtination":"acct_B","destination":"acct_A"}"#,
            r#"{"destination":"acct_A","deſtination":"acct_B"}"#,
        ),
        // Go (and Jackson, lowercasing) read `ß` and `ẞ` (U+1E9E) as one key; a full
        // uppercase then lowercase folds them apart (`ss`, `ß`).
        (
            "sharp-s",
            r#"{"straße":"Main 1","STRAẞE":"Evil 2"}"#,
            r#"{"STRAẞE":"Evil 2","straße":"Main 1"}"#,
        ),
        // Jackson under a Turkish or Azeri default locale lowercases `İ` (U+0130) to `i`;
        // Unicode's full lowercasing gives `i` and a combining dot, which parted them.
        (
            "dotted-i",
            r#"{"customer_id":"alice","customer_İd":"mallory"}"#,
            r#"{"customer_İd":"mallory","customer_id":"alice"}"#,
        ),
        // And `I` followed by a combining dot above, which that lowercasing drops.
        (
            "dotted-I",
            "{\"customer_id\":\"alice\",\"customer_I\u{307}d\":\"mallory\"}",
            "{\"customer_I\u{307}d\":\"mallory\",\"customer_id\":\"alice\"}",
        ),
        // The same with another combining mark between (a cedilla), as Java drops that dot.
        (
            "dotted-I-cedilla",
            "{\"customer_i\u{327}d\":\"alice\",\"customer_I\u{327}\u{307}d\":\"mallory\"}",
            "{\"customer_I\u{327}\u{307}d\":\"mallory\",\"customer_i\u{327}d\":\"alice\"}",
        ),
    ] {
        let response = post_charge(&router, key, first).await;
        assert_eq!(response.status(), StatusCode::CREATED, "{key}");
        let response = post_charge(&router, key, second).await;
        answers.push((key, response.status().as_u16()));
    }
    assert_eq!(
        answers,
        [
            ("decimal", 422),
            ("zero", 422),
            ("exponent", 422),
            ("duplicate", 422),
            ("case", 422),
            ("fold", 422),
            ("sharp-s", 422),
            ("dotted-i", 422),
            ("dotted-I", 422),
            ("dotted-I-cedilla", 422)
        ]
    );
    assert_eq!(calls.load(Ordering::SeqCst), 10);
}
