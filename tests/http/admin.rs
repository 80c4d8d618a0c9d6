//! The operator's routes (`admin_router`) over real stores, next to the layer whose records
//! they show: the scope and key in the path name the record the layer wrote.

use std::{sync::Arc, sync::atomic::Ordering, time::Duration};

use axum::body::Body;
use http_body_util::BodyExt;
use idempotency_core::{Begin, IdempotencyKey, RecordId, Scope, Store};
use idempotency_test::block_on;
use idempotency_tower::admin_router;
use tower::ServiceExt;

use crate::support::{app, layer};

struct Answer {
    status: u16,
    content_type: String,
    json: serde_json::Value,
}

async fn call(router: &axum::Router, method: &str, uri: &str, headers: &[(&str, &str)]) -> Answer {
    let mut request = axum::http::Request::builder().method(method).uri(uri);
    for (n, v) in headers {
        request = request.header(*n, *v);
    }
    let body = if method == "POST" {
        Body::from(r#"{"amount":1000}"#)
    } else {
        Body::empty()
    };
    let response = router
        .clone()
        .oneshot(request.body(body).expect("request"))
        .await
        .expect("infallible");
    answer_of(response).await
}

async fn answer_of(response: axum::response::Response) -> Answer {
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().expect("ascii").to_owned())
        .unwrap_or_default();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let json = if bytes.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::String(
            String::from_utf8_lossy(&bytes).into_owned(),
        ))
    };
    Answer {
        status,
        content_type,
        json,
    }
}

fn problem(answer: &Answer, status: u16, kind: &str) {
    assert_eq!(answer.status, status, "{}", answer.json);
    assert_eq!(answer.content_type, "application/problem+json");
    assert_eq!(answer.json["type"], kind, "{}", answer.json);
}

async fn admin_routes(store: Arc<dyn Store>) {
    let (charges, calls, _) = app(layer(store.clone()));
    let router = charges.nest("/admin", admin_router(store.clone()));
    let account = idempotency_test::unique("acct");
    let key = idempotency_test::unique("order");
    let path = format!("/admin/idempotency/scopes/{account}/keys/{key}");
    let charge = [
        ("idempotency-key", key.as_str()),
        ("x-account-id", account.as_str()),
    ];

    // Nothing yet.
    problem(
        &call(&router, "GET", &path, &[]).await,
        404,
        "urn:idempotency:problem:record-not-found",
    );
    problem(
        &call(&router, "DELETE", &path, &[]).await,
        404,
        "urn:idempotency:problem:record-not-found",
    );

    // The layer's record, found under the scope and key of the request.
    assert_eq!(call(&router, "POST", "/charges", &charge).await.status, 201);
    let view = call(&router, "GET", &path, &[]).await;
    assert_eq!(view.status, 200, "{}", view.json);
    assert_eq!(view.content_type, "application/json");
    assert_eq!(view.json["state"], "completed", "{}", view.json);
    assert_eq!(view.json["status"], 201);
    assert_eq!(view.json["scope"], account.as_str());
    assert_eq!(view.json["key"], key.as_str());
    let id = RecordId::new(
        &Scope::new(account.clone()),
        &IdempotencyKey::new(key.clone()).expect("key"),
    );
    assert_eq!(view.json["record_id"], id.to_hex());
    assert_eq!(view.json["fingerprint"].as_str().map(str::len), Some(64));
    assert!(
        view.json["expires_at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{}",
        view.json
    );

    // A completed record stays unless asked for; then the key runs again.
    problem(
        &call(&router, "DELETE", &path, &[]).await,
        409,
        "urn:idempotency:problem:record-completed",
    );
    assert_eq!(call(&router, "POST", "/charges", &charge).await.status, 201);
    assert_eq!(calls.0.load(Ordering::SeqCst), 1, "the retry replayed");
    problem(
        &call(&router, "DELETE", &format!("{path}?completed=maybe"), &[]).await,
        400,
        "urn:idempotency:problem:invalid-request",
    );
    assert_eq!(
        call(&router, "DELETE", &format!("{path}?completed=true"), &[])
            .await
            .status,
        204
    );
    problem(
        &call(&router, "GET", &path, &[]).await,
        404,
        "urn:idempotency:problem:record-not-found",
    );
    assert_eq!(call(&router, "POST", "/charges", &charge).await.status, 201);
    assert_eq!(
        calls.0.load(Ordering::SeqCst),
        2,
        "deleted, the key ran again"
    );

    // A stuck attempt (claimed, never finished): seen in flight; its live lease kept unless
    // asked for (its holder may still be running); released with `?live=true`, and its owner
    // fenced off; the next request runs.
    let stuck_key = idempotency_test::unique("stuck");
    let stuck = RecordId::new(
        &Scope::new(account.clone()),
        &IdempotencyKey::new(stuck_key.clone()).expect("key"),
    );
    let fp = idempotency_core::Fingerprint::of(b"whatever the owner sent");
    let Begin::Execute(token) = store
        .begin(&stuck, &fp, Duration::from_secs(60))
        .await
        .expect("begin")
    else {
        panic!("a fresh key executes");
    };
    let stuck_path = format!("/admin/idempotency/scopes/{account}/keys/{stuck_key}");
    let view = call(&router, "GET", &stuck_path, &[]).await;
    assert_eq!(view.json["state"], "in_flight", "{}", view.json);
    let left = view.json["lease_remaining_ms"]
        .as_u64()
        .expect("lease left");
    assert!(left > 30_000 && left <= 60_000, "{}", view.json);
    problem(
        &call(&router, "DELETE", &stuck_path, &[]).await,
        409,
        "urn:idempotency:problem:lease-live",
    );
    problem(
        &call(&router, "DELETE", &format!("{stuck_path}?live=maybe"), &[]).await,
        400,
        "urn:idempotency:problem:invalid-request",
    );
    assert_eq!(
        call(&router, "DELETE", &format!("{stuck_path}?live=true"), &[])
            .await
            .status,
        204
    );
    assert!(matches!(
        store
            .complete(
                &stuck,
                token,
                &idempotency_core::Outcome::new(201),
                Duration::from_secs(60)
            )
            .await,
        Err(idempotency_core::Error::LeaseLost)
    ));
    let retry = [
        ("idempotency-key", stuck_key.as_str()),
        ("x-account-id", account.as_str()),
    ];
    assert_eq!(call(&router, "POST", "/charges", &retry).await.status, 201);
    assert_eq!(calls.0.load(Ordering::SeqCst), 3);

    // The global scope (the layer's default) has no scope segment.
    let global_key = idempotency_test::unique("global");
    let global = RecordId::new(
        &Scope::global(),
        &IdempotencyKey::new(global_key.clone()).expect("key"),
    );
    let Begin::Execute(_) = store
        .begin(&global, &fp, Duration::from_secs(60))
        .await
        .expect("begin")
    else {
        panic!("a fresh key executes");
    };
    let global_path = format!("/admin/idempotency/keys/{global_key}");
    let view = call(&router, "GET", &global_path, &[]).await;
    assert_eq!(view.json["state"], "in_flight", "{}", view.json);
    assert_eq!(view.json["scope"], "");
    assert_eq!(
        call(&router, "DELETE", &format!("{global_path}?live=true"), &[])
            .await
            .status,
        204
    );
    problem(
        &call(&router, "GET", &global_path, &[]).await,
        404,
        "urn:idempotency:problem:record-not-found",
    );

    // A path that does not decode is a problem too.
    problem(
        &call(
            &router,
            "GET",
            &format!("/admin/idempotency/scopes/{account}/keys/%FF"),
            &[],
        )
        .await,
        400,
        "urn:idempotency:problem:invalid-request",
    );

    // A key the layer would refuse is refused here too.
    let long = "k".repeat(300);
    problem(
        &call(
            &router,
            "GET",
            &format!("/admin/idempotency/scopes/{account}/keys/{long}"),
            &[],
        )
        .await,
        400,
        "urn:idempotency:problem:invalid-key",
    );
}

/// A key may hold `/`. Sent unencoded, a global key `a/b` must not name key `b` of scope `a`:
/// a `?live=true` release of it released that other record's live lease, and its next request
/// ran while the holder still ran. It is a 400 now; encoded, it names the global key.
#[test]
fn a_key_with_a_slash_left_unencoded_names_no_other_record() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let router = axum::Router::new().nest("/admin", admin_router(store.clone()));
        let fp = idempotency_core::Fingerprint::of(b"the holder's request");
        let key = |k: &str| IdempotencyKey::new(k).expect("key");
        let scoped = RecordId::new(&Scope::new("a"), &key("b"));
        let global = RecordId::new(&Scope::global(), &key("a/b"));
        for id in [&scoped, &global] {
            let begun = store.begin(id, &fp, Duration::from_secs(60)).await;
            assert!(matches!(begun, Ok(Begin::Execute(_))), "{begun:?}");
        }
        for method in ["GET", "DELETE"] {
            problem(
                &call(
                    &router,
                    method,
                    "/admin/idempotency/keys/a/b?live=true",
                    &[],
                )
                .await,
                400,
                "urn:idempotency:problem:invalid-request",
            );
        }
        let held = store.inspect(&scoped).await.expect("inspect");
        let held = held.map(|r| r.state);
        assert!(
            matches!(held, Some(idempotency_core::RecordState::InFlight { lease_remaining })
                if lease_remaining > Duration::from_secs(30)),
            "released: {held:?}"
        );
        let view = call(&router, "GET", "/admin/idempotency/scopes/a/keys/b", &[]).await;
        assert_eq!(
            (view.json["scope"].as_str(), view.json["key"].as_str()),
            (Some("a"), Some("b"))
        );
        let view = call(&router, "GET", "/admin/idempotency/keys/a%2Fb", &[]).await;
        assert_eq!(
            (view.json["scope"].as_str(), view.json["key"].as_str()),
            (Some(""), Some("a/b"))
        );
        problem(
            &call(&router, "GET", "/admin/idempotency/scopes/a/keys/b/c", &[]).await,
            400,
            "urn:idempotency:problem:invalid-request",
        );
    });
}

/// The key in the path is read as the layer reads the header: an sf-string (`"k-1"`, the
/// IETF draft's form, quotes included, as an operator copies it from a request log) names
/// the same record as the bare `k-1`. Before, the quotes were taken as part of the key: a 404
/// for a record that exists, and an operator told there was nothing to resolve.
#[test]
fn a_key_in_the_path_is_read_as_the_header_is() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let (charges, _, _) = app(layer(store.clone()));
        let router = charges.nest("/admin", admin_router(store.clone()));
        let account = idempotency_test::unique("acct");
        let key = idempotency_test::unique("order");
        let quoted = format!("\"{key}\"");
        let charge = [
            ("idempotency-key", quoted.as_str()),
            ("x-account-id", account.as_str()),
        ];
        assert_eq!(call(&router, "POST", "/charges", &charge).await.status, 201);
        for named in [
            key.clone(),
            format!("%22{key}%22"),
            format!("%20%22{key}%22"),
        ] {
            let path = format!("/admin/idempotency/scopes/{account}/keys/{named}");
            let view = call(&router, "GET", &path, &[]).await;
            assert_eq!(view.status, 200, "{named}: {}", view.json);
            assert_eq!(view.json["key"], key.as_str(), "{named}");
        }
        // As in the header: a bare key holding a space or a comma, or a quoted one with a
        // parameter, is refused, not read as some other key.
        for refused in ["a%20b", "a,b", "%22a%22;p=1"] {
            let path = format!("/admin/idempotency/scopes/{account}/keys/{refused}");
            problem(
                &call(&router, "GET", &path, &[]).await,
                400,
                "urn:idempotency:problem:invalid-key",
            );
        }
    });
}

/// Every answer of the admin routes is problem+json, the paths and methods they do not serve
/// included: a scope with an unencoded `/` is a 400 that says to encode it (it names no other
/// record), a path under them that names nothing is a 404, and a method they do not take is
/// a 405 that lists those they do. Before, these were axum's plain, empty 404 and 405.
#[test]
fn paths_and_methods_the_admin_routes_do_not_serve_are_problems() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        // Merged into an application with a fallback of its own, it does not take it over
        // (two fallbacks panic), and the application's other paths stay the application's.
        let merged = axum::Router::new()
            .fallback(|| async { "the application's own 404" })
            .merge(admin_router(store.clone()));
        let other = call(&merged, "GET", "/elsewhere", &[]).await;
        assert_eq!(other.json, "the application's own 404");
        let router = axum::Router::new().nest("/admin", admin_router(store));
        for uri in [
            "/admin/idempotency/scopes/a/b/keys/k",
            "/admin/idempotency/scopes/a",
        ] {
            let answer = call(&router, "GET", uri, &[]).await;
            problem(&answer, 400, "urn:idempotency:problem:invalid-request");
            let detail = answer.json["detail"].as_str().unwrap_or_default();
            assert!(detail.contains("%2F"), "{detail}");
        }
        for uri in [
            "/admin/idempotency",
            "/admin/idempotency/",
            "/admin/idempotency/records/k",
        ] {
            let answer = call(&router, "GET", uri, &[]).await;
            problem(&answer, 404, "urn:idempotency:problem:no-such-route");
        }
        for uri in [
            "/admin/idempotency/keys/k",
            "/admin/idempotency/scopes/a/keys/k",
        ] {
            let request = axum::http::Request::post(uri)
                .body(Body::empty())
                .expect("request");
            let response = router.clone().oneshot(request).await.expect("infallible");
            assert_eq!(response.status(), 405);
            assert_eq!(response.headers()["allow"], "GET,HEAD,DELETE,PUT");
            assert_eq!(
                response.headers()["content-type"],
                "application/problem+json"
            );
        }
    });
}

#[test]
fn admin_routes_on_the_memory_store() {
    block_on(admin_routes(Arc::new(idempotency_core::MemoryStore::new())));
}

#[test]
fn admin_routes_on_postgres() {
    block_on(async {
        let Some(store) = idempotency_test::stores::postgres().await else {
            return;
        };
        admin_routes(store).await;
    });
}

#[test]
fn admin_routes_on_the_hybrid_store() {
    block_on(async {
        let (Some(pg), Some(redis)) = (
            idempotency_test::stores::postgres().await,
            idempotency_test::services::redis().await,
        ) else {
            return;
        };
        let redis = idempotency_redis::RedisStore::builder(redis.url())
            .prefix(idempotency_test::unique("admin"));
        let store = idempotency_hybrid::HybridStore::connect((*pg).clone(), redis)
            .await
            .expect("hybrid");
        admin_routes(Arc::new(store)).await;
    });
}

/// A `PUT` whose body is larger than the routes take (axum's 2 MB default) is a 413 saying
/// so, not a 400 "could not be read": the operator is told it is the size, not the shape.
#[test]
fn a_resolution_too_large_for_the_routes_is_413() {
    block_on(async {
        let router = admin_router(Arc::new(idempotency_core::MemoryStore::new()));
        let body = format!(r#"{{"status": 201, "body": "{}"}}"#, "x".repeat(3 << 20));
        let request = axum::http::Request::builder()
            .method("PUT")
            .uri("/idempotency/scopes/acct/keys/k-1")
            .header("content-type", "application/json")
            .body(Body::from(body))
            .expect("request");
        let response = router.oneshot(request).await.expect("infallible");
        let answer = answer_of(response).await;
        problem(&answer, 413, "urn:idempotency:problem:payload-too-large");
    });
}
