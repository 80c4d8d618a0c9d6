//! The HTTP layer: protocol tests with `oneshot` on the memory store, then end-to-end tests
//! over real TCP sockets on the memory, Postgres, Redis and hybrid stores.

mod admin;
mod support;
mod unknown;

use std::{sync::Arc, time::Duration};

use axum::body::Body;
use http_body_util::BodyExt;
use idempotency_core::{MemoryStore, Store};
use idempotency_test::{block_on, services};
use support::{app, layer, post, post_and_hang_up, serve};
use tower::ServiceExt;

fn memory() -> Arc<dyn Store> {
    Arc::new(MemoryStore::new())
}

struct Answer {
    status: u16,
    headers: axum::http::HeaderMap,
    body: String,
    trailers: axum::http::HeaderMap,
}

impl Answer {
    fn problem_type(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "{}",
            self.body
        );
        let json: serde_json::Value = serde_json::from_str(&self.body).expect("problem JSON");
        assert_eq!(json["status"], self.status, "{json}");
        assert!(
            json["title"].is_string() && json["detail"].is_string(),
            "{json}"
        );
        json["type"].as_str().expect("type").to_owned()
    }
}

async fn send(
    router: &axum::Router,
    method: &str,
    key: Option<&str>,
    extra: &[(&str, &str)],
    body: impl Into<Body>,
) -> Answer {
    let mut request = axum::http::Request::builder()
        .method(method)
        .uri("/charges");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    for (n, v) in extra {
        request = request.header(*n, *v);
    }
    let response = router
        .clone()
        .oneshot(request.body(body.into()).expect("request"))
        .await
        .expect("infallible");
    answer(response).await
}

/// A response, read to its end.
async fn answer(response: axum::http::Response<Body>) -> Answer {
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let collected = response.into_body().collect().await.expect("body");
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let bytes = collected.to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
        trailers,
    }
}

#[test]
fn a_retry_replays_the_stored_response() {
    block_on(async {
        let (router, calls, metrics) = app(layer(memory()));
        let first = send(&router, "POST", Some("k1"), &[], "{}").await;
        assert_eq!(first.status, 201);
        assert!(first.headers.get("idempotent-replayed").is_none());
        let retry = send(&router, "POST", Some("k1"), &[], "{}").await;
        assert_eq!(retry.status, 201);
        assert_eq!(retry.body, first.body);
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(retry.headers["content-type"], "application/json");
        assert_eq!(first.headers.get_all("x-multi").iter().count(), 2);
        let multi: Vec<_> = retry.headers.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["one", "two"], "repeated headers replay in order");
        assert!(
            retry.headers.get("set-cookie").is_none(),
            "Set-Cookie is not stored by default"
        );
        assert_eq!(calls.get(), 1);
        let m = metrics.snapshot();
        assert_eq!((m.executions, m.replays), (1, 1));
    });
}

#[test]
fn quoted_and_bare_keys_name_the_same_record() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()));
        assert_eq!(
            send(&router, "POST", Some("\"abc-1\""), &[], "{}")
                .await
                .status,
            201
        );
        let retry = send(&router, "POST", Some("abc-1"), &[], "{}").await;
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(calls.get(), 1);
    });
}

/// The draft's key is an sf-string, which may hold spaces: `"order 42"` is a key (it was a
/// 400), replayed on retry; sent bare, a value with a space is no structured field (400).
#[test]
fn a_quoted_key_may_hold_spaces() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()));
        let first = send(&router, "POST", Some("\"order 42\""), &[], "{}").await;
        assert_eq!(first.status, 201);
        let retry = send(&router, "POST", Some("\"order 42\""), &[], "{}").await;
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(retry.body, first.body);
        let bare = send(&router, "POST", Some("order 42"), &[], "{}").await;
        assert_eq!(bare.status, 400);
        assert_eq!(bare.problem_type(), "urn:idempotency:problem:invalid-key");
        assert_eq!(calls.get(), 1);
    });
}

#[test]
fn bad_keys_are_400_problems() {
    block_on(async {
        let (router, calls, metrics) = app(layer(memory()));
        let missing = send(&router, "POST", None, &[], "{}").await;
        assert_eq!(missing.status, 400);
        assert_eq!(
            missing.problem_type(),
            "urn:idempotency:problem:missing-key"
        );
        let long = "x".repeat(256);
        for bad in [
            "",
            "\"\"",
            "a, b",
            "\"a\", \"b\"",
            "\"a\";p=1",
            "caf\u{e9}",
            long.as_str(),
        ] {
            let mut request = axum::http::Request::post("/charges");
            request = request.header(
                "idempotency-key",
                axum::http::HeaderValue::from_bytes(bad.as_bytes()).expect("value"),
            );
            let response = router
                .clone()
                .oneshot(request.body(Body::from("{}")).expect("req"))
                .await
                .expect("ok");
            assert_eq!(response.status(), 400, "key {bad:?}");
        }
        let twice = axum::http::Request::post("/charges")
            .header("idempotency-key", "a")
            .header("idempotency-key", "b")
            .body(Body::from("{}"))
            .expect("req");
        let response = router.clone().oneshot(twice).await.expect("ok");
        assert_eq!(response.status(), 400);
        assert_eq!(calls.get(), 0, "no handler ran");
        assert_eq!(metrics.snapshot().bad_keys, 9);
    });
}

/// The application's scope and fingerprint functions are caught if they panic: a 500
/// problem, nothing claimed, the handler not run, and the key free for a request once the
/// function is fixed. Before, the panic unwound through the server, and the client's
/// connection was reset without an answer.
#[test]
fn a_scope_or_fingerprint_function_that_panics_is_a_500_problem() {
    block_on(async {
        let store = memory();
        let panicking_scope = layer(store.clone()).try_scope_fn(|_| panic!("no tenant"));
        let panicking_fingerprint =
            layer(store.clone()).fingerprint_fn(|_, _| panic!("no fingerprint"));
        for layer in [panicking_scope, panicking_fingerprint] {
            let (router, calls, _) = app(layer);
            let answer = send(&router, "POST", Some("k"), &[], "{}").await;
            assert_eq!(answer.status, 500, "{}", answer.body);
            assert_eq!(answer.problem_type(), "urn:idempotency:problem:internal");
            assert_eq!(calls.get(), 0);
        }
        let (router, calls, _) = app(layer(store));
        let fixed = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(fixed.status, 201, "{}", fixed.body);
        assert_eq!(calls.get(), 1);
    });
}

#[test]
fn other_methods_pass_through_untouched() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()));
        for _ in 0..2 {
            let get = send(&router, "GET", Some("k"), &[], Body::empty()).await;
            assert_eq!((get.status, get.body.as_str()), (200, "list"));
            assert!(get.headers.get("idempotent-replayed").is_none());
            for (method, answer) in [("PUT", "put"), ("DELETE", "deleted")] {
                let request = axum::http::Request::builder()
                    .method(method)
                    .uri("/charges/1")
                    .header("idempotency-key", "k")
                    .body(Body::empty())
                    .expect("req");
                let response = router.clone().oneshot(request).await.expect("ok");
                assert_eq!(response.status(), 200);
                assert_eq!(
                    response
                        .into_body()
                        .collect()
                        .await
                        .expect("body")
                        .to_bytes(),
                    answer
                );
            }
        }
        assert_eq!(calls.get(), 6, "every pass-through request ran");
    });
}

#[test]
fn the_same_key_in_two_scopes_runs_twice_and_never_cross_replays() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()));
        let a = send(
            &router,
            "POST",
            Some("shared"),
            &[("x-account-id", "acct_a")],
            "{}",
        )
        .await;
        let b = send(
            &router,
            "POST",
            Some("shared"),
            &[("x-account-id", "acct_b")],
            "{}",
        )
        .await;
        assert_eq!((a.status, b.status), (201, 201));
        assert!(b.headers.get("idempotent-replayed").is_none());
        assert_ne!(a.body, b.body);
        assert_eq!(calls.get(), 2);
        let a_again = send(
            &router,
            "POST",
            Some("shared"),
            &[("x-account-id", "acct_a")],
            "{}",
        )
        .await;
        assert_eq!(a_again.body, a.body);
    });
}

#[test]
fn a_reused_key_with_another_body_is_422() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()));
        send(&router, "POST", Some("k"), &[], r#"{"amount":1}"#).await;
        let other = send(&router, "POST", Some("k"), &[], r#"{"amount":2}"#).await;
        assert_eq!(other.status, 422);
        assert_eq!(other.problem_type(), "urn:idempotency:problem:key-reused");
        assert_eq!(calls.get(), 1);
    });
}

/// The fingerprint earlier versions gave `POST …/charges` with body `{}` behind a nest: the
/// path without the prefix.
fn earlier_fingerprint() -> idempotency_core::Fingerprint {
    idempotency_core::Fingerprint::builder()
        .method("POST")
        .path_and_query("/charges")
        .body(b"{}")
        .finish()
}

/// `POST path` with key `k` and body `{}`: the status, and whether it was a replay.
async fn post_k(router: axum::Router, path: &str) -> (u16, bool) {
    let request = axum::http::Request::post(path)
        .header("idempotency-key", "k")
        .body(Body::from("{}"))
        .expect("request");
    let response = router.oneshot(request).await.expect("infallible");
    (
        response.status().as_u16(),
        response.headers().get("idempotent-replayed").is_some(),
    )
}

/// Behind axum's `nest`, the layer on the inner router sees the path without the prefix;
/// the fingerprint must still tell `/accounts/a/charges` from `/accounts/b/charges`, or the
/// same key and body on the second would replay the first's answer (and never charge `b`).
#[test]
fn a_reused_key_on_another_nested_path_is_422() {
    block_on(async {
        let (inner, calls, _) = app(layer(memory()));
        let router = axum::Router::new().nest("/accounts/{account}", inner);
        let at = |path: &'static str| post_k(router.clone(), path);
        assert_eq!(at("/accounts/a/charges").await, (201, false));
        assert_eq!(at("/accounts/b/charges").await, (422, false));
        assert_eq!(at("/accounts/a/charges").await, (201, true));
        assert_eq!(calls.get(), 1);
    });
}

/// A top-level route and a nested one over the same inner path: the top-level route's
/// records have exactly the fingerprint earlier versions gave the nested route. A key reused
/// on the nested route must still be 422, not a replay of the top-level route's answer
/// (account `b` never charged). The fallback to the earlier fingerprint is off by default.
#[test]
fn a_key_reused_from_a_top_level_route_on_a_nested_one_is_422() {
    block_on(async {
        let (inner, calls, _) = app(layer(memory()));
        let router = axum::Router::new()
            .nest("/accounts/{account}", inner.clone())
            .merge(inner);
        let at = |path: &'static str| post_k(router.clone(), path);
        assert_eq!(at("/charges").await, (201, false));
        assert_eq!(at("/accounts/b/charges").await, (422, false));
        assert_eq!(calls.get(), 1);
    });
}

/// A record stored behind `Router::nest` before the fingerprint took the nest's prefix (its
/// fingerprint has the path without it) still replays for the same request: a 422 would
/// tell the client to use a new key, and so to charge again.
#[test]
fn a_nested_record_stored_before_the_prefix_counted_still_replays() {
    block_on(async {
        let store = memory();
        let (inner, calls, _) = app(layer(store.clone()).replay_unprefixed_nested_records(true));
        let router = axum::Router::new().nest("/accounts/{account}", inner);
        let earlier = earlier_fingerprint();
        let id = record_id("k");
        let idempotency_core::Begin::Execute(token) = store
            .begin(&id, &earlier, Duration::from_secs(30))
            .await
            .expect("begin")
        else {
            panic!("a fresh key")
        };
        let stored = idempotency_core::Outcome::new(201).with_body("the earlier charge");
        store
            .complete(&id, token, &stored, Duration::from_secs(60))
            .await
            .expect("complete");
        let request = axum::http::Request::post("/accounts/a/charges")
            .header("idempotency-key", "k")
            .body(Body::from("{}"))
            .expect("request");
        let response = router.oneshot(request).await.expect("infallible");
        assert_eq!(response.status(), 201);
        assert_eq!(response.headers()["idempotent-replayed"], "true");
        assert_eq!(calls.get(), 0);
    });
}

/// `/accounts/a/charges` claims key `k` (directly on the inner store) and gives it back just
/// before the second `begin` from now: between a request's two asks.
async fn a_holds_k_then_gives_it_back_before_the_second_ask(
    store: &idempotency_test::late::LateBegin<MemoryStore>,
) {
    let (id, token) = hold_k(store, &charges_of("a")).await;
    store.release_before_begin(2, id, token);
}

/// Claims key `k` directly on the inner store, under `fp`, for 30 s.
async fn hold_k(
    store: &idempotency_test::late::LateBegin<MemoryStore>,
    fp: &idempotency_core::Fingerprint,
) -> (idempotency_core::RecordId, idempotency_core::LeaseToken) {
    let id = record_id("k");
    let idempotency_core::Begin::Execute(token) = store
        .inner()
        .begin(&id, fp, Duration::from_secs(30))
        .await
        .expect("begin")
    else {
        panic!("a fresh key")
    };
    (id, token)
}

/// The fallback to the earlier fingerprint only finds what was stored under it; it never runs
/// a request under it. Here `/accounts/b/charges` meets `a`'s live lease (a mismatch), and
/// `a` gives the key back just before `b` asks again with the earlier fingerprint: `b` must
/// run under its own. Run under the earlier one, its record then replayed for
/// `/accounts/c/charges` with the same key and body: `b`'s charge, answered to `c`.
#[test]
fn the_earlier_fingerprint_never_claims_a_key() {
    block_on(async {
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            Duration::ZERO,
        ));
        let (inner, calls, _) = app(layer(store.clone()).replay_unprefixed_nested_records(true));
        let router = axum::Router::new().nest("/accounts/{account}", inner);
        let at = |path: &'static str| post_k(router.clone(), path);
        a_holds_k_then_gives_it_back_before_the_second_ask(&store).await;
        assert_eq!(at("/accounts/b/charges").await, (201, false));
        assert_eq!(at("/accounts/c/charges").await, (422, false));
        assert_eq!(at("/accounts/b/charges").await, (201, true));
        assert_eq!(calls.get(), 1);
    });
}

/// During an upgrade, an old instance holds `k` under the earlier fingerprint; a request to
/// `/accounts/b/charges` mismatches it, and before it asks again with the earlier one, the
/// old attempt gives the key back and a duplicate of the same request claims it under its own
/// fingerprint. The earlier fingerprint then mismatches that live lease: asked once more
/// with its own, the request learns its duplicate runs (409). Before, it answered a final 422
/// "key reused for a different request" for its own key, and a client that took a new key
/// would have been charged twice.
#[test]
fn a_key_claimed_by_a_duplicate_between_the_two_asks_is_in_flight_not_reused() {
    block_on(async {
        let answered = during_an_upgrade(None, |store, id, token, own| {
            store.hand_over_before_begin(2, id, token, own);
        })
        .await;
        assert_eq!(answered, ((409, false), 0));
    });
}

/// The same, as often as the key changes hands while the request waits for an attempt in
/// flight: the duplicate that claimed it under the request's own fingerprint fails (its key
/// given back), and a retry on an old instance claims it under the earlier one. The request
/// goes on waiting (409 at the end of its wait), never a final 422 for its own key. Before,
/// only the first change of hands was asked about again.
#[test]
fn a_key_changing_hands_again_while_the_request_waits_is_not_reused() {
    block_on(async {
        let wait = Some(Duration::from_millis(300));
        let answered = during_an_upgrade(wait, |store, id, token, own| {
            // Asks: 1 own (mismatch), 2 earlier (handed to a duplicate: mismatch), 3 own (in
            // flight), 4 own (taken by an old instance under the earlier one: mismatch), 5 …
            // earlier (in flight until the wait ends).
            store.hand_over_before_begin(2, id, token, own);
            store.take_key_before_begin(4, id, earlier_fingerprint());
        })
        .await;
        assert_eq!(answered, ((409, false), 0));
    });
}

/// A key that keeps changing hands between a request's asks (each time to a duplicate of
/// it, under one fingerprint or the other) is asked about again a few times, then the request
/// is told to retry (409): not a final 422 for its own key once the detours run out.
#[test]
fn a_key_changing_hands_past_the_detours_is_busy_not_reused() {
    block_on(async {
        let wait = Some(Duration::from_secs(5));
        let answered = during_an_upgrade(wait, |store, id, _, own| {
            // Ask 1 (own) mismatches; then, four times over: the earlier one finds the key
            // handed to a duplicate under its own (mismatch), its own finds that duplicate
            // (in flight), and the next ask finds it handed back under the earlier one.
            for at in [2, 5, 8, 11] {
                store.take_key_before_begin(at, id, own);
            }
            for at in [4, 7, 10, 13] {
                store.take_key_before_begin(at, id, earlier_fingerprint());
            }
        })
        .await;
        assert_eq!(answered, ((409, false), 0));
    });
}

/// During an upgrade: an old instance holds `k` under the earlier fingerprint; `script` sets
/// what happens to the key between the asks of a request to `/accounts/b/charges` (given
/// the store, the key's record and the old holder's token, and the request's own
/// fingerprint), through the nested router with the earlier-fingerprint fallback (and a
/// wait for attempts in flight, if any). The request's answer, and how often it ran.
async fn during_an_upgrade(
    wait: Option<Duration>,
    script: impl FnOnce(
        &idempotency_test::late::LateBegin<MemoryStore>,
        idempotency_core::RecordId,
        idempotency_core::LeaseToken,
        idempotency_core::Fingerprint,
    ),
) -> ((u16, bool), usize) {
    let store = Arc::new(idempotency_test::late::LateBegin::new(
        MemoryStore::new(),
        Duration::ZERO,
    ));
    let mut layer = layer(store.clone()).replay_unprefixed_nested_records(true);
    if let Some(wait) = wait {
        layer = layer.wait_for_in_flight(wait);
    }
    let (inner, calls, _) = app(layer);
    let router = axum::Router::new().nest("/accounts/{account}", inner);
    let (id, token) = hold_k(&store, &earlier_fingerprint()).await;
    script(&store, id, token, charges_of("b"));
    let answer = post_k(router, "/accounts/b/charges").await;
    (answer, calls.get())
}

/// The fingerprint of `POST /accounts/{account}/charges` with body `{}`.
fn charges_of(account: &str) -> idempotency_core::Fingerprint {
    idempotency_core::Fingerprint::builder()
        .method("POST")
        .path_and_query(&format!("/accounts/{account}/charges"))
        .body(b"{}")
        .finish()
}

/// The same, when giving back the grant under the earlier fingerprint fails (a store blip):
/// `b` is told to retry (503), not that its key belongs to another request (a final 422);
/// the give-back goes on in the background, counted by `drain`, and `b`'s retry runs.
#[test]
fn a_grant_under_the_earlier_fingerprint_not_given_back_is_retried_not_refused() {
    block_on(async {
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            Duration::ZERO,
        ));
        let layer = layer(store.clone()).replay_unprefixed_nested_records(true);
        let (inner, calls, _) = app(layer.clone());
        let router = axum::Router::new().nest("/accounts/{account}", inner);
        let at = |path: &'static str| post_k(router.clone(), path);
        a_holds_k_then_gives_it_back_before_the_second_ask(&store).await;
        store.fail_releases(1);
        assert_eq!(at("/accounts/b/charges").await, (503, false));
        layer.drain().await; // the give-back, retried
        assert_eq!(at("/accounts/b/charges").await, (201, false));
        assert_eq!(at("/accounts/b/charges").await, (201, true));
        assert_eq!(calls.get(), 1);
    });
}

/// An attempt stored under the earlier fingerprint that never finished (killed at an upgrade)
/// stands for that request under every prefix: whose it was is unknown. A request that
/// finds it through the fallback runs nothing under it (run, `b`'s charge was stored there
/// and replayed to `a`): it answers 409 outcome-unknown, stores nothing, and the record
/// stays for an operator.
#[test]
fn an_unfinished_attempt_under_the_earlier_fingerprint_is_not_run_again() {
    block_on(async {
        let store = Arc::new(MemoryStore::with_manual_clock());
        let (inner, calls, _) = app(layer(store.clone()).replay_unprefixed_nested_records(true));
        let router = axum::Router::new().nest("/accounts/{account}", inner);
        let earlier = earlier_fingerprint();
        let id = record_id("k");
        let begun = store.begin(&id, &earlier, Duration::from_secs(1)).await;
        assert!(matches!(begun, Ok(idempotency_core::Begin::Execute(_))));
        store.advance(Duration::from_secs(2)); // killed: its lease ran out unfinished
        for account in ["/accounts/b/charges", "/accounts/a/charges"] {
            assert_eq!(
                post_k(router.clone(), account).await,
                (409, false),
                "{account}"
            );
        }
        assert_eq!(calls.get(), 0);
        let kept = store.inspect(&id).await.expect("inspect").expect("kept");
        assert_eq!(kept.fingerprint, earlier);
    });
}

#[test]
fn canonical_json_ignores_key_order_and_whitespace() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()).canonical_json());
        send(
            &router,
            "POST",
            Some("k"),
            &[],
            r#"{"amount":1,"currency":"eur"}"#,
        )
        .await;
        let same = send(
            &router,
            "POST",
            Some("k"),
            &[],
            r#"{ "currency": "eur", "amount": 1 }"#,
        )
        .await;
        assert_eq!(same.headers["idempotent-replayed"], "true");
        assert_eq!(calls.get(), 1);
    });
}

#[test]
fn a_live_duplicate_is_409_with_retry_after() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()));
        let first = {
            let router = router.clone();
            tokio::spawn(async move {
                send(&router, "POST", Some("k"), &[("x-delay-ms", "400")], "{}").await
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let dup = send(&router, "POST", Some("k"), &[("x-delay-ms", "400")], "{}").await;
        assert_eq!(dup.status, 409);
        assert_eq!(dup.problem_type(), "urn:idempotency:problem:in-flight");
        let retry_after: u64 = dup.headers["retry-after"]
            .to_str()
            .expect("ascii")
            .parse()
            .expect("seconds");
        assert!(retry_after >= 1);
        assert_eq!(first.await.expect("first").status, 201);
        assert_eq!(calls.get(), 1);
    });
}

/// A 409 says when the first request is likely done (what is left of the layer's mean run
/// time), not when its 30 s lease ends: before any run finished here, a second.
#[test]
fn retry_after_estimates_the_run_time_not_the_lease() {
    block_on(async {
        let (router, _, _) = app(layer(memory()));
        let duplicate_of = |key: &'static str| {
            let router = router.clone();
            async move {
                let first = {
                    let router = router.clone();
                    tokio::spawn(async move {
                        send(&router, "POST", Some(key), &[("x-delay-ms", "1200")], "{}").await
                    })
                };
                tokio::time::sleep(Duration::from_millis(100)).await;
                let dup = send(&router, "POST", Some(key), &[], "{}").await;
                assert_eq!(dup.status, 409);
                assert_eq!(first.await.expect("first").status, 201);
                dup.headers["retry-after"]
                    .to_str()
                    .expect("ascii")
                    .parse::<u64>()
                    .expect("seconds")
            }
        };
        // Nothing has run yet: no estimate, a second.
        assert_eq!(duplicate_of("first-ever").await, 1);
        // One 1.2 s run: what is left of it, far below the 30 s lease.
        let estimate = duplicate_of("after-one-run").await;
        assert!((1..=5).contains(&estimate), "Retry-After: {estimate}");
    });
}

/// `IdempotencyContext` is an extractor: behind the layer it carries the key; without the
/// layer it is a 500 problem+json (a server mistake, never a panic or a run without a
/// guard), and `Option<IdempotencyContext>` is `None`.
#[test]
fn the_context_extractor_needs_the_layer() {
    use axum::{Router, routing::post};
    use idempotency_tower::IdempotencyContext;
    async fn guarded(ctx: IdempotencyContext) -> String {
        ctx.key.as_str().to_owned()
    }
    async fn optional(ctx: Option<IdempotencyContext>) -> String {
        format!("{}", ctx.is_some())
    }
    block_on(async {
        let with = Router::new()
            .route("/charges", post(guarded))
            .layer(layer(memory()));
        let answer = send(&with, "POST", Some("k-extract"), &[], "{}").await;
        assert_eq!((answer.status, answer.body.as_str()), (200, "k-extract"));

        let without = Router::new().route("/charges", post(guarded));
        let answer = send(&without, "POST", Some("k"), &[], "{}").await;
        assert_eq!(answer.status, 500);
        assert_eq!(answer.problem_type(), "urn:idempotency:problem:internal");
        let optional = Router::new().route("/charges", post(optional));
        let answer = send(&optional, "POST", Some("k"), &[], "{}").await;
        assert_eq!((answer.status, answer.body.as_str()), (200, "false"));
    });
}

/// A layer told to read another header guards by it, and no longer reads `Idempotency-Key`.
#[test]
fn the_key_header_can_be_renamed() {
    block_on(async {
        let (router, calls, _) =
            app(layer(memory()).header_name(axum::http::HeaderName::from_static("x-request-key")));
        let first = send(&router, "POST", None, &[("x-request-key", "r-1")], "{}").await;
        let again = send(&router, "POST", None, &[("x-request-key", "r-1")], "{}").await;
        assert_eq!((first.status, again.status), (201, 201));
        assert_eq!(again.headers["idempotent-replayed"], "true");
        assert_eq!(calls.get(), 1);
        // The draft's header is not the key any more: with a key required, 400.
        let draft = send(&router, "POST", Some("r-2"), &[], "{}").await;
        assert_eq!(draft.status, 400);
        assert_eq!(calls.get(), 1);
    });
}

#[test]
fn wait_mode_returns_the_replay_instead_of_409() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()).wait_for_in_flight(Duration::from_secs(5)));
        let first = {
            let router = router.clone();
            tokio::spawn(async move {
                send(&router, "POST", Some("k"), &[("x-delay-ms", "300")], "{}").await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let waited = send(&router, "POST", Some("k"), &[("x-delay-ms", "300")], "{}").await;
        let first = first.await.expect("first");
        assert_eq!(waited.status, 201);
        assert_eq!(waited.headers["idempotent-replayed"], "true");
        assert_eq!(waited.body, first.body);
        assert_eq!(calls.get(), 1);
    });
}

/// A scope function that cannot find the principal refuses the request (fail closed)
/// instead of falling back to a scope others share: nothing is claimed and the handler
/// does not run.
#[test]
fn a_request_without_a_principal_is_refused_before_any_claim() {
    use axum::http::request::Parts;
    use idempotency_core::Scope;
    use idempotency_tower::NoScope;
    block_on(async {
        let layer = layer(memory()).try_scope_fn(|parts: &Parts| {
            match parts.headers.get("x-account-id").map(|v| v.to_str()) {
                Some(Ok(account)) if !account.is_empty() => Ok(Scope::new(account)),
                Some(_) => Err(NoScope::Invalid("X-Account-Id is not readable".into())),
                None => Err(NoScope::Unauthenticated("send X-Account-Id".into())),
            }
        });
        let (router, calls, metrics) = app(layer);
        let refused = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(refused.status, 401, "{}", refused.body);
        assert_eq!(refused.headers["content-type"], "application/problem+json");
        assert!(
            refused
                .body
                .contains("urn:idempotency:problem:unauthenticated")
        );
        let unreadable = send(&router, "POST", Some("k"), &[("x-account-id", "")], "{}").await;
        assert_eq!(unreadable.status, 400, "{}", unreadable.body);
        assert_eq!(calls.get(), 0);
        assert_eq!(metrics.snapshot().unscoped, 2, "refusals are counted");
        let charged = send(&router, "POST", Some("k"), &[("x-account-id", "a")], "{}").await;
        assert_eq!(charged.status, 201);
        let again = send(&router, "POST", Some("k"), &[("x-account-id", "a")], "{}").await;
        assert_eq!(again.headers["idempotent-replayed"], "true");
        assert_eq!(calls.get(), 1);
    });
}

/// "Wait as long as it takes" is a natural setting: it must not overflow the deadline.
#[test]
fn a_wait_for_ever_answers() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()).wait_for_in_flight(Duration::MAX));
        let first = send(&router, "POST", Some("k"), &[], "{}").await;
        let again = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!((first.status, again.status), (201, 201));
        assert_eq!(again.headers["idempotent-replayed"], "true");
        assert_eq!(calls.get(), 1);
    });
}

#[test]
fn a_5xx_is_not_stored_and_the_retry_runs_again() {
    block_on(async {
        let (router, calls, metrics) = app(layer(memory()));
        let failed = send(&router, "POST", Some("k"), &[("x-fail", "503")], "{}").await;
        assert_eq!(failed.status, 503);
        let retry = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(retry.status, 201);
        assert!(retry.headers.get("idempotent-replayed").is_none());
        assert_eq!(calls.get(), 2);
        // 429 is not stored either; 404 is.
        assert_eq!(
            send(&router, "POST", Some("k429"), &[("x-fail", "429")], "{}")
                .await
                .status,
            429
        );
        assert!(
            send(&router, "POST", Some("k429"), &[("x-fail", "429")], "{}")
                .await
                .headers
                .get("idempotent-replayed")
                .is_none()
        );
        send(&router, "POST", Some("k404"), &[("x-fail", "404")], "{}").await;
        assert_eq!(
            send(&router, "POST", Some("k404"), &[("x-fail", "404")], "{}")
                .await
                .headers["idempotent-replayed"],
            "true"
        );
        assert_eq!(metrics.snapshot().released, 3);
    });
}

/// A refusal that depends on headers the fingerprint leaves out is not stored, and nothing
/// ran: credentials or permission (401, 403, 407), `Accept` (406), a precondition (412, 428),
/// `Content-Type` (415), the request's framing or size of headers (411, 417, 431), the
/// connection it came on (421); nor is a resource locked for now (423). Stored, the client
/// that fixed its token (or its `If-Match`, its content type) and retried with the same key
/// was replayed the refusal for the whole retention, and the payment never made (407, 411,
/// 417, 421, 423 and 431 were stored until the review of 4 December).
#[test]
fn a_refusal_that_depends_on_headers_is_not_stored() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()));
        let refusals = [
            "401", "403", "406", "407", "411", "412", "415", "417", "421", "423", "428", "431",
        ];
        for status in refusals {
            let key = format!("refused-{status}");
            let refused = send(&router, "POST", Some(&key), &[("x-fail", status)], "{}").await;
            assert_eq!(refused.status.to_string(), status);
            let retry = send(&router, "POST", Some(&key), &[], "{}").await;
            assert_eq!(retry.status, 201, "after {status}: {}", retry.body);
            assert!(retry.headers.get("idempotent-replayed").is_none());
        }
        assert_eq!(
            calls.get(),
            2 * refusals.len(),
            "each refusal, then each retry, ran"
        );
    });
}

/// A release that fails (a store blip) after a 5xx is retried, not left to answer the retries
/// 409 for a whole lease.
#[test]
fn a_release_that_failed_is_retried() {
    block_on(async {
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            Duration::ZERO,
        ));
        let layer = layer(store.clone());
        let (router, calls, _) = app(layer.clone());
        store.fail_releases(1);
        let failed = send(&router, "POST", Some("k"), &[("x-fail", "503")], "{}").await;
        assert_eq!(failed.status, 503);
        layer.drain().await;
        let retry = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert_eq!(calls.get(), 2);
    });
}

/// A handler whose lease is lost while it runs (here an operator releases the live lease of
/// a holder thought stuck; so too a takeover after this attempt's renewals failed for a
/// lease) is stopped at its await, before the effect it had not reached: the attempt that
/// now holds the key runs it.
#[test]
fn a_handler_whose_lease_was_lost_is_stopped() {
    block_on(async {
        let store = memory();
        let lease = Duration::from_millis(600);
        let (router, calls, _) =
            app(layer(store.clone()).policy(idempotency_core::Policy::default().with_lease(lease)));
        let operator = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let id = record_id("k");
            let released = store
                .force_release(&id, idempotency_core::ReleaseScope::default().with_live())
                .await;
            assert!(released.is_ok(), "{released:?}");
        };
        let (stopped, ()) = tokio::join!(
            send(&router, "POST", Some("k"), &[("x-delay-ms", "1500")], "{}"),
            operator
        );
        assert_eq!(stopped.status, 503, "{}", stopped.body);
        tokio::time::sleep(Duration::from_millis(1600)).await; // past the handler's effect
        assert_eq!(
            calls.get(),
            0,
            "the handler ran on after its lease was lost"
        );
    });
}

/// A handler whose await completes while the renewal that hears the lease lost is in flight
/// is stopped there too: not polled once more to see whether it finished, which ran its next
/// step (here the effect) beside the attempt that now holds the key.
#[test]
fn a_handler_woken_while_its_lease_is_lost_is_not_polled_again() {
    use std::sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    };

    block_on(async {
        let store = Arc::new(support::Rigged::default());
        let (tell, told) = tokio::sync::oneshot::channel();
        *store.lose_next_renewal.lock().expect("lock") = Some(tell);
        let told = Arc::new(Mutex::new(Some(told)));
        let effects = Arc::new(AtomicUsize::new(0));
        let (handler_told, handler_effects) = (told.clone(), effects.clone());
        let handler = move || async move {
            let told = handler_told.lock().expect("lock").take().expect("one call");
            // The upstream answers just as the operator releases the key.
            let _ = told.await;
            handler_effects.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
            "charged"
        };
        let lease = Duration::from_millis(600);
        let router = axum::Router::new()
            .route("/charges", axum::routing::post(handler))
            .layer(layer(store).policy(idempotency_core::Policy::default().with_lease(lease)));
        let stopped = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(stopped.status, 503, "{}", stopped.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            effects.load(Ordering::SeqCst),
            0,
            "the handler was polled on after its lease was lost"
        );
    });
}

/// Runs `test` on a runtime of one thread, which a test can freeze whole (a blocking
/// sleep): no task runs meanwhile, as in a process stopped by `SIGSTOP`.
fn on_one_thread<F: std::future::Future>(test: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(test)
}

/// Takes `key`'s expired lease over on the memory store `store` (as another gateway would),
/// without yielding: the runtime's thread stays frozen meanwhile.
fn take_over_while_frozen(store: &dyn Store, key: &str, lease: Duration) {
    use futures::FutureExt as _;
    let id = record_id(key);
    let fp = store
        .inspect(&id)
        .now_or_never()
        .expect("a memory call")
        .expect("inspect")
        .expect("the record")
        .fingerprint;
    let taken = store
        .begin(&id, &fp, lease)
        .now_or_never()
        .expect("a memory call");
    assert!(
        matches!(taken, Ok(idempotency_core::Begin::TakeOver(_))),
        "{taken:?}"
    );
}

/// A handler stalled past its lease (the whole process frozen: SIGSTOP, a VM paused, a
/// starved host; here the runtime's one thread blocks) while another attempt takes the key
/// over does not go on with its effect when it wakes: the layer does not poll a handler
/// whose lease may have run out before a renewal says it still holds it. Before, the handler
/// and the overdue renewal woke together, and the handler went first about half the time
/// (and the lost renewal's check polled it once more): its effect ran a second time, beside
/// the attempt that took over.
#[test]
fn a_handler_stalled_past_its_lease_does_not_resume_after_a_takeover() {
    on_one_thread(async {
        let store = memory();
        let lease = Duration::from_millis(600);
        let (router, calls, _) =
            app(layer(store.clone()).policy(idempotency_core::Policy::default().with_lease(lease)));
        // The select between a handler and its overdue renewal is random: eight keys.
        for n in 0..8 {
            let key = format!("stalled-{n}");
            let request = {
                let (router, key) = (router.clone(), key.clone());
                tokio::spawn(async move {
                    send(&router, "POST", Some(&key), &[("x-delay-ms", "200")], "{}").await
                })
            };
            // The handler is asleep before its effect, its task waiting.
            tokio::time::sleep(Duration::from_millis(50)).await;
            // Frozen past the lease: no task runs, the handler's sleep and the renewals come due.
            std::thread::sleep(lease + Duration::from_millis(300));
            // Meanwhile (another gateway, on the same store) the key is taken over.
            take_over_while_frozen(&*store, &key, lease);
            let stopped = request.await.expect("task");
            assert_eq!(stopped.status, 503, "{}", stopped.body);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            calls.get(),
            0,
            "a handler stalled past its lease ran its effect after the key was taken over"
        );
    });
}

/// Clocks run at different rates: chrony slews a clock by up to a twelfth (its default
/// `maxslewrate`) to correct an offset, and `CLOCK_MONOTONIC` follows it. Here the store's
/// clock runs 15 % faster than the gateway's (a fifteenth fast on one host, slow on the
/// other), so the store ends a 4 s lease at 3.48 s by the gateway's clock; renewals cannot
/// reach it; another gateway takes the key over at 3.6 s; the handler's effect comes due at
/// 3.75 s. Its holder must not poll it: the lease it can count on ends before the store's
/// does. With a margin of a thousandth (a lease counted as held until 3.99 s) the handler
/// ran its effect beside the takeover.
#[test]
fn a_holder_whose_clock_runs_slow_against_the_stores_stops_before_a_takeover() {
    block_on(async {
        let store = Arc::new(support::Rigged {
            store_clock_rate: Some(1.15),
            ..Default::default()
        });
        store
            .renewals_unavailable
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let lease = Duration::from_secs(4);
        let (router, calls, _) =
            app(layer(store.clone()).policy(idempotency_core::Policy::default().with_lease(lease)));
        let first = {
            let router = router.clone();
            tokio::spawn(async move {
                send(&router, "POST", Some("k"), &[("x-delay-ms", "3750")], "{}").await
            })
        };
        // Counted from when the claim is seen (so from after it was granted): its lease in
        // the store is over by 3.6 s from then, the handler's effect not due before 3.75 s.
        let id = record_id("k");
        let fp = loop {
            if let Some(record) = store.inspect(&id).await.expect("inspect") {
                break record.fingerprint;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        tokio::time::sleep(Duration::from_millis(3600)).await;
        let taken = store.begin(&id, &fp, lease).await;
        assert!(
            matches!(taken, Ok(idempotency_core::Begin::TakeOver(_))),
            "{taken:?}"
        );
        store
            .renewals_unavailable
            .store(false, std::sync::atomic::Ordering::SeqCst);
        let first = first.await.expect("task");
        assert_eq!(
            calls.get(),
            0,
            "the handler ran its effect beside the takeover"
        );
        assert_eq!(first.status, 503, "{}", first.body);
    });
}

/// A renewal that panics (a store with a bug) is a failed renewal, as in the executor: the
/// handler it runs beside goes on to its end and its outcome is stored. Before, the panic
/// unwound the task that drove the handler, which was dropped mid-effect, and the retry
/// after its lease ran it again.
#[test]
fn a_renewal_that_panics_does_not_stop_the_handler() {
    block_on(async {
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            Duration::ZERO,
        ));
        store.panic_renewals(1);
        let lease = Duration::from_millis(600);
        let (router, calls, _) =
            app(layer(store.clone()).policy(idempotency_core::Policy::default().with_lease(lease)));
        let first = send(&router, "POST", Some("k"), &[("x-delay-ms", "700")], "{}").await;
        assert_eq!(first.status, 201, "{}", first.body);
        let retry = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(calls.get(), 1);
    });
}

/// A claim answered late (here 40 % of the lease after the store granted it: a slow store,
/// a starved runtime) leaves the handler as many renewals before its lease runs out as a
/// quick one, so one failed renewal does not lose it. The renewals were timed from the
/// handler's start, not from the ask the store counts the lease from: the first came at 73 %
/// of the lease and failed, the next after the lease had run out, and a retry in between
/// took the key over and ran the operation a second time while the first still ran.
#[tokio::test(start_paused = true)]
async fn a_slow_claim_leaves_its_handler_every_renewal() {
    {
        let lease = Duration::from_secs(6);
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            lease * 2 / 5,
        ));
        store.fail_renewals(1); // a blip, which a lease is meant to ride out
        let policy = idempotency_core::Policy::default().with_lease(lease);
        let (router, calls, _) = app(layer(store.clone()).policy(policy));
        let first = send(&router, "POST", Some("k"), &[("x-delay-ms", "5000")], "{}");
        let retry = async {
            // Just past the lease as first granted, and before the handler ends.
            tokio::time::sleep(lease + Duration::from_millis(200)).await;
            store.set_delay(Duration::ZERO);
            send(&router, "POST", Some("k"), &[], "{}").await
        };
        let (first, retry) = tokio::join!(first, retry);
        assert_eq!(
            retry.status, 409,
            "the retry took the key over: {}",
            retry.body
        );
        assert_eq!(first.status, 201, "{}", first.body);
        assert_eq!(calls.get(), 1);
    }
}

#[test]
fn a_panicking_handler_releases_its_lease() {
    block_on(async {
        let (router, calls, metrics) = app(layer(memory()));
        let panicked = send(&router, "POST", Some("k"), &[("x-panic", "1")], "{}").await;
        assert_eq!(panicked.status, 500);
        assert_eq!(panicked.problem_type(), "urn:idempotency:problem:internal");
        let retry = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(retry.status, 201, "the key was released, so the retry runs");
        assert_eq!(calls.get(), 1);
        assert_eq!(metrics.snapshot().panics, 1);
    });
}

#[test]
fn an_oversized_body_is_413_by_content_length_and_by_chunks() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()).max_request_body(1024));
        let declared = send(&router, "POST", Some("k1"), &[], "x".repeat(2048)).await;
        assert_eq!(declared.status, 413);
        assert_eq!(
            declared.problem_type(),
            "urn:idempotency:problem:payload-too-large"
        );
        let chunks = futures::stream::iter(
            (0..8).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'x'; 512]))),
        );
        let chunked = send(&router, "POST", Some("k2"), &[], Body::from_stream(chunks)).await;
        assert_eq!(chunked.status, 413);
        assert_eq!(calls.get(), 0);
    });
}

/// A body limit applied outside the layer (tower-http's `RequestBodyLimitLayer` wraps a body
/// of unknown length in `Limited`; axum boxes its error twice on the way to the route) is a
/// 413 too, not a 400 telling the client to resend what can never fit (over gRPC that 400 was
/// `UNAVAILABLE`, which retry policies retry).
#[test]
fn a_body_limit_applied_outside_the_layer_is_413_too() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()));
        let router = router.layer(axum::middleware::map_request(
            |request: axum::extract::Request| async move {
                request.map(|body| Body::new(http_body_util::Limited::new(body, 1024)))
            },
        ));
        let chunks = futures::stream::iter(
            (0..8).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'x'; 512]))),
        );
        let answer = send(&router, "POST", Some("k"), &[], Body::from_stream(chunks)).await;
        assert_eq!(answer.status, 413, "{}", answer.body);
        assert_eq!(
            answer.problem_type(),
            "urn:idempotency:problem:payload-too-large"
        );
        assert_eq!(calls.get(), 0);
        // Within the outer limit, the request runs.
        let small = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(small.status, 201, "{}", small.body);
        assert_eq!(calls.get(), 1);
    });
}

/// A request body that breaks off (a reset stream, an outer read timeout, a bad chunked
/// encoding) is a 400 problem saying to resend, not a 413 "too large", which clients take as
/// final; nothing runs.
#[test]
fn a_request_body_that_breaks_off_is_400_not_413() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()));
        let chunks = futures::stream::iter(vec![
            Ok(bytes::Bytes::from_static(b"{")),
            Err(std::io::Error::other("the client reset the stream")),
        ]);
        let broken = send(&router, "POST", Some("k"), &[], Body::from_stream(chunks)).await;
        assert_eq!(broken.status, 400, "{}", broken.body);
        assert_eq!(
            broken.problem_type(),
            "urn:idempotency:problem:invalid-request"
        );
        assert_eq!(calls.get(), 0);
        let resent = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(resent.status, 201, "{}", resent.body);
    });
}

#[test]
fn an_unavailable_store_is_503_and_the_handler_does_not_run() {
    block_on(async {
        // A real Postgres client with nothing listening on its port.
        let store = idempotency_postgres::PostgresStore::builder(
            "postgres://postgres@127.0.0.1:9/postgres",
        )
        .acquire_timeout(Duration::from_millis(300))
        .call_timeout(Duration::from_millis(500))
        .connect()
        .await
        .expect("lazy pool");
        let (router, calls, _) = app(layer(Arc::new(store)));
        let answer = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(answer.status, 503);
        assert_eq!(
            answer.problem_type(),
            "urn:idempotency:problem:store-unavailable"
        );
        assert!(answer.headers.contains_key("retry-after"));
        assert_eq!(calls.get(), 0);
    });
}

/// A Postgres store on a table of its own (its name begins with `prefix`), for a test that
/// changes the table; `None` when service tests are opted out.
async fn postgres_on_a_table_of_its_own(
    prefix: &str,
) -> Option<(idempotency_postgres::PostgresStore, String)> {
    let pg = services::postgres().await?;
    let table = format!(
        "{prefix}_{}",
        idempotency_test::unique("t").replace('-', "_")
    );
    let store = idempotency_postgres::PostgresStore::builder(pg.url())
        .table(&table)
        .connect()
        .await
        .expect("store");
    store.migrate().await.expect("migrate");
    Some((store, table))
}

/// A store that cannot renew the lease at all (here Postgres whose table was dropped while
/// the handler ran) stops the handler, and the request is answered 503. Before, the layer
/// asked for a renewal again and again once the lease may have run out, the handler held
/// unpolled, and the request never answered.
#[test]
fn a_store_that_cannot_renew_stops_the_handler() {
    block_on(async {
        let Some((store, table)) = postgres_on_a_table_of_its_own("gone").await else {
            return;
        };
        let lease = Duration::from_millis(500);
        let layer = layer(Arc::new(store.clone()))
            .policy(idempotency_core::Policy::default().with_lease(lease));
        let router = axum::Router::new()
            .route(
                "/charges",
                axum::routing::post(move || async move {
                    tokio::time::sleep(lease * 4).await;
                    axum::http::StatusCode::CREATED
                }),
            )
            .layer(layer);
        let asking = tokio::spawn(async move { send(&router, "POST", Some("k"), &[], "{}").await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let drop_table = format!("DROP TABLE {table}");
        sqlx::query(sqlx::AssertSqlSafe(drop_table))
            .execute(store.pool())
            .await
            .expect("drop");
        // Not a bound on its speed: without an answer at all, this ends the test.
        let answer = tokio::time::timeout(Duration::from_secs(60), asking).await;
        let answer = answer.expect("an answer").expect("the request's task");
        assert_eq!(answer.status, 503, "{}", answer.body);
        assert_eq!(
            answer.problem_type(),
            "urn:idempotency:problem:store-unavailable"
        );
    });
}

/// A renewal that meets the store's table gone for a moment (renamed and back: a table
/// swapped, a pooler's stale search path) while the lease lives is a blip: the handler goes
/// on, and its response is stored and answered. (A first version of the fix above took the
/// first such answer for a lost lease: 503, the handler stopped, its lease left to run out.)
#[test]
fn a_table_gone_for_a_moment_does_not_stop_the_handler() {
    block_on(async {
        let Some((store, table)) = postgres_on_a_table_of_its_own("away").await else {
            return;
        };
        let lease = Duration::from_millis(1500);
        let layer = layer(Arc::new(store.clone()))
            .policy(idempotency_core::Policy::default().with_lease(lease));
        let router = axum::Router::new()
            .route(
                "/charges",
                axum::routing::post(|| async {
                    tokio::time::sleep(Duration::from_millis(1200)).await;
                    axum::http::StatusCode::CREATED
                }),
            )
            .layer(layer);
        let asking = tokio::spawn(async move { send(&router, "POST", Some("k"), &[], "{}").await });
        // Away over the first renewal (a third of the lease in), back before the second.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let ddl = |sql: String| sqlx::query(sqlx::AssertSqlSafe(sql)).execute(store.pool());
        let away = format!("ALTER TABLE {table} RENAME TO {table}_away");
        ddl(away).await.expect("away");
        tokio::time::sleep(Duration::from_millis(700)).await;
        let back = format!("ALTER TABLE {table}_away RENAME TO {table}");
        ddl(back).await.expect("back");
        let answer = asking.await.expect("the request's task");
        assert_eq!(answer.status, 201, "{}", answer.body);
    });
}

/// A layer (lease 500 ms) on a Postgres table of its own that refuses, for good, every
/// response over 1,000 bytes (a `CHECK` constraint) and takes the smaller marker of an
/// outcome not stored.
async fn refusing_large_responses(prefix: &str) -> Option<idempotency_tower::IdempotencyLayer> {
    let (store, table) = postgres_on_a_table_of_its_own(prefix).await?;
    let small = format!("ALTER TABLE {table} ADD CHECK (octet_length(response) < 1000)");
    sqlx::query(sqlx::AssertSqlSafe(small))
        .execute(store.pool())
        .await
        .expect("constraint");
    let lease = Duration::from_millis(500);
    Some(layer(Arc::new(store)).policy(idempotency_core::Policy::default().with_lease(lease)))
}

/// A response the store refuses for good while it takes renewals (here Postgres, whose table
/// is given a constraint no response over 1,000 bytes meets): the client that made the
/// request gets it, and every retry is answered that it was carried out and its response not
/// stored (a 500 problem), never with a second run. Before, the layer's late write gave up,
/// the lease ran out, and the retry ran the handler again.
#[test]
fn a_response_the_store_refuses_for_good_is_not_run_again() {
    block_on(async {
        let Some(layer) = refusing_large_responses("small").await else {
            return;
        };
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = calls.clone();
        let router = axum::Router::new()
            .route(
                "/charges",
                axum::routing::post(move || async move {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    (axum::http::StatusCode::CREATED, "x".repeat(4000))
                }),
            )
            .layer(layer.clone());
        let first = send(&router, "POST", Some("big"), &[], "{}").await;
        assert_eq!(first.status, 201);
        assert_eq!(first.body.len(), 4000);
        layer.drain().await; // the late write, and the marker in its place
        let retry = send(&router, "POST", Some("big"), &[], "{}").await;
        assert_eq!(retry.status, 500, "{}", retry.body);
        assert_eq!(
            retry.problem_type(),
            "urn:idempotency:problem:outcome-not-stored"
        );
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    });
}

/// The same for a gRPC call: its retry is told as a gRPC status (`INTERNAL`, the marker's
/// detail in `grpc-message`). It was the marker's HTTP 500 problem, which a gRPC client
/// reads as `UNKNOWN` ("grpc-status header missing"), with nothing to say the call ran.
#[test]
fn a_grpc_call_whose_response_was_not_stored_is_told_so_as_a_status() {
    block_on(async {
        let Some(layer) = refusing_large_responses("small_grpc").await else {
            return;
        };
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = calls.clone();
        let router = axum::Router::new()
            .route(
                "/grpc",
                axum::routing::post(move || async move {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    (
                        [("content-type", "application/grpc"), ("grpc-status", "0")],
                        "x".repeat(4000),
                    )
                }),
            )
            .layer(layer.clone());
        let call = || unary_grpc(&router, "big");
        let first = call().await.expect("infallible");
        assert_eq!(first.headers()["grpc-status"], "0");
        layer.drain().await; // the late write, and the marker in its place
        let retry = call().await.expect("infallible");
        assert_eq!(retry.status(), 200, "gRPC travels in HTTP 200");
        assert_eq!(retry.headers()["grpc-status"], "13");
        let message = retry.headers()["grpc-message"].to_str().expect("ascii");
        assert!(message.contains("carried out"), "{message}");
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    });
}

/// An empty unary gRPC call to `router`'s `/grpc` with `key`.
async fn unary_grpc(
    router: &axum::Router,
    key: &str,
) -> Result<axum::http::Response<Body>, std::convert::Infallible> {
    let request = axum::http::Request::post("/grpc")
        .header("content-type", "application/grpc")
        .header("idempotency-key", key)
        .body(Body::empty())
        .expect("request");
    router.clone().oneshot(request).await
}

/// A response that carries the layer's marker header of an outcome not stored (forwarded
/// from another layered service that replayed its marker) is not that marker here: the
/// header is not stored, and a gRPC retry is replayed the call's own status. It was stored,
/// and every retry was told `INTERNAL` ("its response could not be stored").
#[test]
fn a_handlers_marker_header_is_not_the_layers_marker() {
    block_on(async {
        let router = axum::Router::new()
            .route(
                "/grpc",
                axum::routing::post(|| async {
                    (
                        [
                            ("content-type", "application/grpc"),
                            ("grpc-status", "0"),
                            (idempotency_core::OUTCOME_NOT_STORED, "1"),
                        ],
                        "ok",
                    )
                }),
            )
            .layer(layer(memory()));
        let call = || unary_grpc(&router, "forwarded");
        let first = call().await.expect("infallible");
        assert_eq!(first.headers()["grpc-status"], "0");
        let retry = call().await.expect("infallible");
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert_eq!(retry.headers()["grpc-status"], "0");
        assert!(
            !retry
                .headers()
                .contains_key(idempotency_core::OUTCOME_NOT_STORED)
        );
    });
}

/// The layer counts a lease from the ask: a claim answered with half its lease or less left
/// (the request future was held without being polled, its runtime starved) may already be
/// taken over by a retry that is running the handler. It is 503, the handler does not run,
/// and the lease is given back, so the retry runs it once, as a fresh execution.
#[test]
fn a_claim_answered_late_is_503_and_given_back() {
    block_on(async {
        let lease = Duration::from_millis(400);
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            lease,
        ));
        let policy = idempotency_core::Policy::default().with_lease(lease);
        // A `TakeOver` (a lease left to run out) would be 409 here, not a fresh run.
        let layer = layer(store.clone())
            .policy(policy)
            .on_outcome_unknown(idempotency_tower::OutcomeUnknown::Reject);
        let (router, calls, _) = app(layer);
        let late = send(&router, "POST", Some("late"), &[], "{}").await;
        assert_eq!(late.status, 503);
        assert_eq!(
            late.problem_type(),
            "urn:idempotency:problem:store-unavailable"
        );
        assert_eq!(calls.get(), 0);
        // Given back in a task of its own: wait for the record to go.
        let id = record_id("late");
        for _ in 0..500 {
            if store.inner().inspect(&id).await.expect("inspect").is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        store.set_delay(Duration::ZERO);
        let retry = send(&router, "POST", Some("late"), &[], "{}").await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert_eq!(calls.get(), 1);
    });
}

/// The record a key names under the test layer's scope (`x-account-id`, else `anonymous`).
fn record_id(key: &str) -> idempotency_core::RecordId {
    idempotency_core::RecordId::new(
        &idempotency_core::Scope::new("anonymous"),
        &idempotency_core::IdempotencyKey::new(key).expect("key"),
    )
}

/// A memory store whose `begin` answers `late` after it decided, and whose `release` takes
/// 300 ms: long enough to see who waits for a lease being given back.
fn slow_to_give_back(late: Duration) -> Arc<idempotency_test::late::LateBegin<MemoryStore>> {
    let store = idempotency_test::late::LateBegin::new(MemoryStore::new(), late);
    store.set_release_delay(Duration::from_millis(300));
    Arc::new(store)
}

async fn claimed(store: &idempotency_test::late::LateBegin<MemoryStore>, key: &str) -> bool {
    let id = record_id(key);
    store.inner().inspect(&id).await.expect("inspect").is_some()
}

#[test]
fn drain_waits_for_a_late_grant_to_be_given_back() {
    block_on(async {
        let lease = Duration::from_millis(400);
        let store = slow_to_give_back(lease);
        let policy = idempotency_core::Policy::default().with_lease(lease);
        let layer = layer(store.clone()).policy(policy);
        let (router, calls, _) = app(layer.clone());
        let late = send(&router, "POST", Some("late"), &[], "{}").await;
        assert_eq!(late.status, 503);
        assert!(claimed(&store, "late").await, "being given back");
        // A shutdown now: `drain` returns only once the lease is given back. Left claimed,
        // the key would come back as an attempt whose outcome is unknown (409 under
        // `Reject`) for an operation that never ran.
        layer.drain().await;
        assert!(!claimed(&store, "late").await, "drain returned first");
        assert_eq!(store.drains(), 1, "the layer's drain drains its store");
        assert_eq!(calls.get(), 0);
    });
}

#[test]
fn drain_waits_for_the_claim_of_a_request_that_went_away() {
    block_on(async {
        // Answered late enough for the request to be gone, early enough to be acted on.
        let store = slow_to_give_back(Duration::from_millis(200));
        let layer = layer(store.clone());
        let (router, calls, _) = app(layer.clone());
        let request = send(&router, "POST", Some("gone"), &[], "{}");
        let gone = tokio::time::timeout(Duration::from_millis(50), request).await;
        assert!(gone.is_err(), "the claim was still out");
        assert!(claimed(&store, "gone").await, "the claim reached the store");
        // The claim finishes in a task of its own and gives its lease back; `drain` waits
        // for both.
        layer.drain().await;
        assert!(!claimed(&store, "gone").await, "drain returned first");
        assert_eq!(calls.get(), 0);
        let retry = send(&router, "POST", Some("gone"), &[], "{}").await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert_eq!(calls.get(), 1);
    });
}

#[test]
fn an_oversized_response_still_completes_the_record() {
    block_on(async {
        let (router, calls, _) = app(layer(memory()).max_stored_body(8));
        assert_eq!(
            send(&router, "POST", Some("k"), &[], "{}").await.status,
            201
        );
        let retry = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(retry.status, 201);
        assert_eq!(retry.headers["idempotent-replay-body"], "omitted");
        assert_eq!(retry.body, "");
        assert_eq!(calls.get(), 1, "a retry never runs again");
    });
}

/// A response streamed through the layer (over the stored-body limit) whose body has an
/// exact size keeps it: hyper frames it by `Content-Length`, so a response the layer cuts off
/// reads as short. Before, the layer's body declared no size, and an HTTP/1.0 response (a
/// proxy's default upstream protocol: nginx's) was framed by the connection's close, which
/// made a cut-off response look whole.
#[test]
fn a_streamed_response_of_known_length_is_framed_by_its_length() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    block_on(async {
        let (router, _, _) = app(layer(memory()).max_stored_body(8));
        let addr = support::serve(router).await;
        let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = "POST /charges HTTP/1.0\r\nhost: x\r\nidempotency-key: http10\r\n\
                       content-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        client.write_all(request.as_bytes()).await.expect("write");
        let mut response = Vec::new();
        client.read_to_end(&mut response).await.expect("read");
        let response = String::from_utf8_lossy(&response).to_ascii_lowercase();
        let (head, body) = response.split_once("\r\n\r\n").expect("a head");
        assert!(head.starts_with("http/1.0 201"), "{head}");
        let length = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length: "))
            .unwrap_or_else(|| panic!("framed by the connection's close: {head}"));
        assert_eq!(length.parse::<usize>().expect("a length"), body.len());
    });
}

// ---------------------------------------------------------------------------------------
// End to end over TCP, on every store.

async fn end_to_end(store: Arc<dyn Store>) {
    let (router, calls, _) = app(layer(store));
    let addr = serve(router).await;
    let key = |name: &str| format!("{name}-{}", uuid::Uuid::new_v4());

    // Replay.
    let k = key("replay");
    let first = post(addr, "/charges", &[("idempotency-key", &k)], "{}").await;
    let retry = post(addr, "/charges", &[("idempotency-key", &k)], "{}").await;
    assert_eq!((first.status, retry.status), (201, 201));
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    // 422.
    assert_eq!(
        post(
            addr,
            "/charges",
            &[("idempotency-key", &k)],
            "{\"other\":1}"
        )
        .await
        .status,
        422
    );

    // The double-charge scenario: the client times out and hangs up mid-handler; the handler
    // still completes, and the retry gets the replay.
    let before = calls.get();
    let k = key("disconnect");
    post_and_hang_up(
        addr,
        "/charges",
        &[("idempotency-key", &k), ("x-delay-ms", "400")],
        "{}",
        Duration::from_millis(100),
    )
    .await;
    let mut settled = None;
    for _ in 0..100 {
        let retry = post(
            addr,
            "/charges",
            &[("idempotency-key", &k), ("x-delay-ms", "400")],
            "{}",
        )
        .await;
        if retry.status == 201 {
            settled = Some(retry);
            break;
        }
        assert_eq!(retry.status, 409, "{retry:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let retry = settled.expect("the retry settles");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        calls.get(),
        before + 1,
        "the disconnected request ran exactly once"
    );

    // 50 concurrent requests with one key: one execution, the rest 409 or replays.
    let before = calls.get();
    let k = key("storm");
    let requests = (0..50).map(|_| {
        let k = k.clone();
        tokio::spawn(async move {
            post(
                addr,
                "/charges",
                &[("idempotency-key", &k), ("x-delay-ms", "100")],
                "{}",
            )
            .await
        })
    });
    let replies: Vec<_> = futures::future::join_all(requests)
        .await
        .into_iter()
        .map(|r| r.expect("task"))
        .collect();
    let created = replies.iter().filter(|r| r.status == 201).count();
    assert!(
        replies.iter().all(|r| r.status == 201 || r.status == 409),
        "{replies:?}"
    );
    let fresh = replies
        .iter()
        .filter(|r| r.status == 201 && r.header("idempotent-replayed").is_none())
        .count();
    assert_eq!(fresh, 1, "exactly one response came from an execution");
    assert!(created >= 1);
    assert_eq!(calls.get(), before + 1);
    let conflict = replies.iter().find(|r| r.status == 409);
    if let Some(conflict) = conflict {
        assert_eq!(
            conflict.header("content-type"),
            Some("application/problem+json")
        );
        assert!(conflict.header("retry-after").is_some());
        assert_eq!(conflict.json()["type"], "urn:idempotency:problem:in-flight");
    }

    // 5xx released, panic released.
    let k = key("fail");
    assert_eq!(
        post(
            addr,
            "/charges",
            &[("idempotency-key", &k), ("x-fail", "502")],
            "{}"
        )
        .await
        .status,
        502
    );
    assert_eq!(
        post(addr, "/charges", &[("idempotency-key", &k)], "{}")
            .await
            .header("idempotent-replayed"),
        None
    );
    let k = key("panic");
    assert_eq!(
        post(
            addr,
            "/charges",
            &[("idempotency-key", &k), ("x-panic", "1")],
            "{}"
        )
        .await
        .status,
        500
    );
    assert_eq!(
        post(addr, "/charges", &[("idempotency-key", &k)], "{}")
            .await
            .status,
        201
    );
}

#[test]
fn end_to_end_on_the_memory_store() {
    block_on(end_to_end(memory()));
}

#[test]
fn end_to_end_on_postgres() {
    block_on(async {
        let Some(store) = idempotency_test::stores::postgres().await else {
            return;
        };
        end_to_end(store).await;
    });
}

/// A Redis store on the binary's shared Redis, its keys under a fresh prefix.
async fn redis_store() -> Option<Arc<dyn Store>> {
    let redis = services::redis().await?;
    let store = idempotency_redis::RedisStore::builder(redis.url())
        .prefix(idempotency_test::unique("http"))
        .connect()
        .await
        .expect("store");
    Some(Arc::new(store))
}

/// A hybrid store on the binary's shared Postgres and Redis.
async fn hybrid_store() -> Option<Arc<dyn Store>> {
    let (Some(pg), Some(redis)) = (
        idempotency_test::stores::postgres().await,
        services::redis().await,
    ) else {
        return None;
    };
    let redis = idempotency_redis::RedisStore::builder(redis.url())
        .prefix(idempotency_test::unique("http"));
    let store = idempotency_hybrid::HybridStore::connect((*pg).clone(), redis)
        .await
        .expect("hybrid");
    Some(Arc::new(store))
}

#[test]
fn end_to_end_on_redis() {
    block_on(async {
        let Some(store) = redis_store().await else {
            return;
        };
        end_to_end(store).await;
    });
}

#[test]
fn end_to_end_on_the_hybrid_store() {
    block_on(async {
        let Some(store) = hybrid_store().await else {
            return;
        };
        end_to_end(store).await;
    });
}

/// A handler that runs longer than the lease keeps it: the layer renews it while the handler
/// runs, so a duplicate arriving after the original lease would have expired is still 409.
#[test]
fn a_long_handler_keeps_its_lease_by_renewing_it() {
    block_on(async {
        let policy = idempotency_core::Policy::default().with_lease(Duration::from_millis(300));
        let (router, calls, _) = app(layer(memory()).policy(policy));
        let first = {
            let router = router.clone();
            tokio::spawn(async move {
                send(
                    &router,
                    "POST",
                    Some("slow"),
                    &[("x-delay-ms", "1200")],
                    "{}",
                )
                .await
            })
        };
        tokio::time::sleep(Duration::from_millis(700)).await; // past the unrenewed lease
        let dup = send(
            &router,
            "POST",
            Some("slow"),
            &[("x-delay-ms", "1200")],
            "{}",
        )
        .await;
        assert_eq!(
            dup.status, 409,
            "the lease was renewed, so the duplicate did not run"
        );
        assert_eq!(first.await.expect("first").status, 201);
        assert_eq!(calls.get(), 1);
    });
}

// ---------------------------------------------------------------------------------------
// Streaming responses and the request future under cancellation.

/// `POST /stream`: a response of unknown length. `x-chunks: n` sends n chunks of 64 KiB of
/// `x` (0 = never ends, a tick every 20 ms, like server-sent events); `x-hold` sends the
/// first chunk, then waits for the test's signal before the rest.
fn streaming_app(
    layer: idempotency_tower::IdempotencyLayer,
) -> (axum::Router, support::Calls, HoldSignal) {
    let calls = support::Calls::default();
    let hold: HoldSignal = Arc::default();
    let (c, h) = (calls.clone(), hold.clone());
    let router = axum::Router::new()
        .route(
            "/stream",
            axum::routing::post(move |headers: axum::http::HeaderMap| {
                let (calls, hold) = (c.clone(), h.clone());
                async move {
                    calls.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let chunks: usize = headers
                        .get("x-chunks")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(1);
                    let held = headers.contains_key("x-hold");
                    // `x-declare-length`: a Content-Length header for the stream, whose end
                    // (after the last byte) waits for the test's signal.
                    let declared = headers.contains_key("x-declare-length");
                    let stream = futures::stream::unfold(0usize, move |i| {
                        let hold = hold.clone();
                        async move {
                            if chunks == 0 {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                return Some((
                                    Ok::<_, std::io::Error>(bytes::Bytes::from_static(
                                        b"data: tick\n\n",
                                    )),
                                    i + 1,
                                ));
                            }
                            if i == chunks {
                                if declared {
                                    hold.notified().await;
                                }
                                return None;
                            }
                            if held && i == 1 {
                                hold.notified().await;
                            }
                            Some((Ok(bytes::Bytes::from(vec![b'x'; 64 * 1024])), i + 1))
                        }
                    });
                    let mut response = axum::response::IntoResponse::into_response((
                        axum::http::StatusCode::OK,
                        Body::from_stream(stream),
                    ));
                    if declared {
                        response.headers_mut().insert(
                            "content-length",
                            (chunks * 64 * 1024).to_string().parse().expect("a length"),
                        );
                    }
                    response
                }
            }),
        )
        .layer(layer);
    (router, calls, hold)
}

type HoldSignal = Arc<tokio::sync::Notify>;

fn stream_request(key: &str, extra: &[(&str, &str)]) -> axum::http::Request<Body> {
    let mut request = axum::http::Request::builder()
        .method("POST")
        .uri("/stream")
        .header("idempotency-key", key);
    for (n, v) in extra {
        request = request.header(*n, *v);
    }
    request.body(Body::empty()).expect("request")
}

/// A response that never ends (a stream, server-sent events) used to renew its lease forever
/// and wedge the key: every retry got 409. Now, once its client hangs up, the rest is drained
/// for at most half a lease and the outcome stored without its body: the retry replays the
/// head (`Idempotent-Replay-Body: incomplete`) and the handler never runs a second time.
#[test]
fn a_never_ending_response_does_not_wedge_the_key_once_its_client_left() {
    block_on(async {
        let layer = layer(memory())
            .policy(idempotency_core::Policy::default().with_lease(Duration::from_secs(1)));
        let (router, calls, _) = streaming_app(layer);
        let addr = serve(router).await;
        let key = uuid::Uuid::new_v4().to_string();
        // The first client reads the start of the stream, then hangs up.
        {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let request = format!(
                "POST /stream HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\nx-chunks: 0\r\ncontent-length: 0\r\n\r\n"
            );
            client.write_all(request.as_bytes()).await.expect("write");
            let mut seen = Vec::new();
            tokio::time::timeout(Duration::from_secs(5), async {
                while !String::from_utf8_lossy(&seen).contains("tick") {
                    let mut buf = [0u8; 1024];
                    let n = client.read(&mut buf).await.expect("read");
                    assert!(n > 0, "the stream started");
                    seen.extend_from_slice(&buf[..n]);
                }
            })
            .await
            .expect("the stream reaches its client while it is produced, not once it ends");
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(6);
        let reply = loop {
            let reply = tokio::time::timeout(
                Duration::from_secs(5),
                post(
                    addr,
                    "/stream",
                    &[("idempotency-key", &key), ("x-chunks", "0")],
                    "",
                ),
            )
            .await
            .expect("a retry must not stream a second execution");
            if reply.status != 409 || tokio::time::Instant::now() > deadline {
                break reply;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.header("idempotent-replayed"), Some("true"));
        assert_eq!(reply.header("idempotent-replay-body"), Some("incomplete"));
        assert_eq!(calls.get(), 1);
    });
}

/// A body of ten bytes declared (an exact size hint) that has five: it then ends, or stalls
/// for ever.
struct FiveOfTen {
    sent: bool,
    stalls: bool,
}

impl FiveOfTen {
    fn ending() -> Self {
        Self {
            sent: false,
            stalls: false,
        }
    }

    fn stalling() -> Self {
        Self {
            sent: false,
            stalls: true,
        }
    }
}

impl http_body::Body for FiveOfTen {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        if !std::mem::replace(&mut self.sent, true) {
            let hello = http_body::Frame::data(bytes::Bytes::from_static(b"hello"));
            return std::task::Poll::Ready(Some(Ok(hello)));
        }
        if self.stalls {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(None)
        }
    }
    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(10)
    }
}

/// A body of a known size that stalls before its end (a handler passing an upstream's
/// response through: hyper reports the upstream's `Content-Length` as an exact size) is read
/// whole before anything is answered. Once its client has left, it is read for at most half a
/// lease more, then stored without its body: the retry replays the head
/// (`Idempotent-Replay-Body: incomplete`), the handler does not run again, and `drain`
/// returns. Before, the read went on for ever, its lease renewed: every retry got 409, and
/// `drain` never returned (the process exited at the end of its grace, and the retry after
/// the restart took the key over).
#[test]
fn a_body_of_known_size_that_stalls_does_not_wedge_the_key_once_its_client_left() {
    block_on(async {
        let layer = layer(memory())
            .policy(idempotency_core::Policy::default().with_lease(Duration::from_secs(1)));
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = calls.clone();
        let router = axum::Router::new()
            .route(
                "/stalls",
                axum::routing::post(move || {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    async {
                        let mut response =
                            axum::response::Response::new(Body::new(FiveOfTen::stalling()));
                        *response.status_mut() = axum::http::StatusCode::CREATED;
                        response
                    }
                }),
            )
            .layer(layer.clone());
        let addr = serve(router).await;
        let key = uuid::Uuid::new_v4().to_string();
        // The first client gets nothing (the body is read whole first), and hangs up.
        let first = tokio::time::timeout(
            Duration::from_millis(300),
            post(addr, "/stalls", &[("idempotency-key", &key)], ""),
        )
        .await;
        assert!(
            first.is_err(),
            "nothing is answered before the body is read"
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(6);
        let reply = loop {
            let reply = post(addr, "/stalls", &[("idempotency-key", &key)], "").await;
            if reply.status != 409 || tokio::time::Instant::now() > deadline {
                break reply;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(reply.status, 201, "{reply:?}");
        assert_eq!(reply.header("idempotent-replayed"), Some("true"));
        assert_eq!(reply.header("idempotent-replay-body"), Some("incomplete"));
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        tokio::time::timeout(Duration::from_secs(10), layer.drain())
            .await
            .expect("drain returns once the stalled body was given up");
    });
}

/// `POST /stream` under `layer`: a body that does the work as it streams, a batch per chunk
/// (6 bytes) every 20 ms, for ever, counted in the second value.
fn batching(
    layer: idempotency_tower::IdempotencyLayer,
) -> (axum::Router, Arc<std::sync::atomic::AtomicUsize>) {
    use futures::StreamExt as _;
    let batches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = batches.clone();
    let router = axum::Router::new()
        .route(
            "/stream",
            axum::routing::post(move || {
                let batches = counted.clone();
                async move {
                    let stream = futures::stream::repeat(()).then(move |()| {
                        let batches = batches.clone();
                        async move {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            batches.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"batch\n"))
                        }
                    });
                    Body::from_stream(stream)
                }
            }),
        )
        .layer(layer);
    (router, batches)
}

/// An operator releases `key`'s live lease (a holder thought stuck).
async fn release_live(store: &dyn Store, key: &str) {
    let released = store
        .force_release(
            &record_id(key),
            idempotency_core::ReleaseScope::default().with_live(),
        )
        .await;
    assert!(released.is_ok(), "{released:?}");
}

/// The rest of `body` ends in an error (cut off, not ended cleanly), and no batch of its
/// work runs after that.
async fn cut_off_and_stopped(body: Body, batches: &std::sync::atomic::AtomicUsize) {
    let rest = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("the stream goes on");
    assert!(rest.is_err(), "the stream must be cut off, not end cleanly");
    let stopped_at = batches.load(std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        batches.load(std::sync::atomic::Ordering::SeqCst),
        stopped_at,
        "the body ran on"
    );
}

/// A response whose body does the work as it streams (a batch per chunk), and whose lease is
/// lost meanwhile (an operator releases the live lease of a holder thought stuck; so too a
/// takeover after this attempt's renewals failed for a lease), is stopped at its next
/// renewal, as a handler is: its client's stream is cut off, and the body is not polled
/// again, since the attempt that holds the key now runs the operation. Before, a lost lease
/// while streaming was logged and the body went on to its end: the rest of the operation
/// ran twice.
#[test]
fn a_response_streaming_when_its_lease_is_lost_is_stopped() {
    block_on(async {
        let store = memory();
        let lease = Duration::from_millis(600);
        let (router, batches) = batching(
            layer(store.clone()).policy(idempotency_core::Policy::default().with_lease(lease)),
        );
        let response = router
            .oneshot(stream_request("k", &[]))
            .await
            .expect("infallible");
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        let first = body.frame().await.expect("a first batch").expect("a frame");
        assert_eq!(first.into_data().expect("data"), "batch\n");
        release_live(&*store, "k").await;
        cut_off_and_stopped(body, &batches).await;
    });
}

/// A body that does its work as it streams, frozen past its lease with the whole process
/// (here the runtime's one thread blocks) while another attempt takes the key over, does not
/// produce another batch when it wakes: it is not polled until a renewal says the lease is
/// still this attempt's, and that renewal says it is lost. Before, the body and the overdue
/// renewal woke together, and the body often went first: batches of the operation ran
/// beside the attempt that took over.
#[test]
fn a_streaming_body_stalled_past_its_lease_does_not_resume_after_a_takeover() {
    on_one_thread(async {
        let store = memory();
        let lease = Duration::from_millis(600);
        let (router, batches) = batching(
            layer(store.clone()).policy(idempotency_core::Policy::default().with_lease(lease)),
        );
        // The select between the body and its overdue renewal is random: eight keys.
        for n in 0..8 {
            let key = format!("streaming-{n}");
            let response = router
                .clone()
                .oneshot(stream_request(&key, &[]))
                .await
                .expect("infallible");
            assert_eq!(response.status(), 200);
            let mut body = response.into_body();
            body.frame().await.expect("a first batch").expect("a frame");
            // Frozen past the lease: no task runs; the next batch and the renewals come due.
            std::thread::sleep(lease + Duration::from_millis(300));
            take_over_while_frozen(&*store, &key, lease);
            let frozen_at = batches.load(std::sync::atomic::Ordering::SeqCst);
            let rest = tokio::time::timeout(Duration::from_secs(5), body.collect())
                .await
                .expect("the stream goes on after its lease was lost");
            assert!(rest.is_err(), "the stream must be cut off, not end cleanly");
            assert_eq!(
                batches.load(std::sync::atomic::Ordering::SeqCst),
                frozen_at,
                "a body stalled past its lease ran a batch after the key was taken over"
            );
        }
    });
}

/// A body over the stored-body limit has its head stored when it crosses the limit; a write
/// refused there (the lease was lost: here an operator released the live lease just before)
/// stops the body, as a lost renewal does. Before, the body was marked stored whatever the
/// write said, its renewals and its lease gate stopped, and its batches ran on, for ever,
/// beside the attempt that now held the key.
#[test]
fn a_body_whose_head_could_not_be_stored_at_the_limit_is_stopped() {
    block_on(async {
        let store = memory();
        let lease = Duration::from_millis(600);
        let (router, batches) = batching(
            layer(store.clone())
                .policy(idempotency_core::Policy::default().with_lease(lease))
                .max_stored_body(16),
        );
        let response = router
            .oneshot(stream_request("over", &[]))
            .await
            .expect("infallible");
        let mut body = response.into_body();
        body.frame().await.expect("a first batch").expect("a frame");
        // Released before the third batch takes the body over the limit (and before the
        // first renewal, a third of a lease in).
        release_live(&*store, "over").await;
        cut_off_and_stopped(body, &batches).await;
    });
}

/// A streamed response whose forwarding stops before its end for any reason (here its task
/// is dropped mid-stream: the server's runtime shut down) is cut off for its client: its end
/// is clean only when the whole body was forwarded. Before, only the cases the forwarding
/// task knew of were cut off; a task dropped (or one that panicked) ended the chunked body
/// cleanly, and the client took a truncated body for a whole one.
#[test]
fn a_streamed_response_whose_forwarding_stopped_is_cut_off() {
    let server = idempotency_test::doomed_runtime();
    let (router, _, _) = streaming_app(layer(memory()));
    // The first chunk is forwarded; the handler holds the rest back.
    let (response, first) = server.block_on(async {
        let response = router
            .oneshot(stream_request("k", &[("x-chunks", "4"), ("x-hold", "1")]))
            .await
            .expect("infallible");
        let mut body = response.into_body();
        let first = body.frame().await.expect("a frame").expect("data");
        (body, first)
    });
    assert_eq!(first.data_ref().map(|d| d.len()), Some(64 * 1024));
    server.shutdown_background(); // the forwarding task is dropped
    block_on(async {
        let rest = tokio::time::timeout(Duration::from_secs(10), response.collect())
            .await
            .expect("the stream ends");
        assert!(
            rest.is_err(),
            "a truncated body ended cleanly after {} more bytes",
            rest.map(|b| b.to_bytes().len()).unwrap_or_default()
        );
    });
}

/// A response body whose length differs from the exact size it declared (a hand-written body
/// with a stale hint: hyper frames a response by that hint, and aborts it when the body ends
/// early) is a broken body: stored marked incomplete, never replayed as whole, and nothing
/// runs again. Before, the layer buffered the bytes there were and stored them as the whole
/// body.
#[test]
fn a_body_shorter_than_its_declared_size_is_not_stored_whole() {
    block_on(async {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = calls.clone();
        let router = axum::Router::new()
            .route(
                "/short",
                axum::routing::post(move || {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    async { axum::response::Response::new(Body::new(FiveOfTen::ending())) }
                }),
            )
            .layer(layer(memory()));
        let request = || {
            axum::http::Request::post("/short")
                .header("idempotency-key", "k")
                .body(Body::empty())
                .expect("request")
        };
        let first = router.clone().oneshot(request()).await.expect("infallible");
        assert_eq!(first.status(), 500);
        let again = router.clone().oneshot(request()).await.expect("infallible");
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["idempotent-replay-body"], "incomplete");
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    });
}

/// A response's trailers (gRPC sends its status in one) reach the first client and are
/// stored and replayed, whether the body was read whole (a known size) or streamed. Before,
/// a body read whole lost its trailers even for the first client, and no replay had any:
/// a gRPC client replayed a body without `grpc-status` saw a protocol error.
#[test]
fn trailers_reach_the_first_client_and_every_replay() {
    use http_body_util::BodyExt as _;
    block_on(async {
        let trailers = || {
            let mut map = axum::http::HeaderMap::new();
            map.insert("grpc-status", "0".parse().expect("value"));
            map.append("x-checksum", "abc".parse().expect("value"));
            map
        };
        let router = axum::Router::new()
            .route(
                "/trailers",
                axum::routing::post(move |headers: axum::http::HeaderMap| async move {
                    let body = if headers.contains_key("x-stream") {
                        // No size hint: streamed (chunked over HTTP/1.1, with its trailers
                        // announced as HTTP/1.1 needs).
                        let frames = futures::stream::iter([
                            Ok::<_, std::convert::Infallible>(http_body::Frame::data(
                                bytes::Bytes::from_static(b"ok"),
                            )),
                            Ok(http_body::Frame::trailers(trailers())),
                        ]);
                        let mut response = axum::response::Response::new(Body::new(
                            http_body_util::StreamBody::new(frames),
                        ));
                        response
                            .headers_mut()
                            .insert("trailer", "grpc-status, x-checksum".parse().expect("value"));
                        return response;
                    } else {
                        // A known size: read whole.
                        Body::new(
                            http_body_util::Full::new(bytes::Bytes::from_static(b"ok"))
                                .with_trailers(std::future::ready(Some(Ok(trailers())))),
                        )
                    };
                    axum::response::Response::new(body)
                }),
            )
            .layer(layer(memory()));
        for (key, extra) in [("whole", vec![]), ("streamed", vec![("x-stream", "1")])] {
            for attempt in ["first", "replay"] {
                let mut request =
                    axum::http::Request::post("/trailers").header("idempotency-key", key);
                for (name, value) in &extra {
                    request = request.header(*name, *value);
                }
                let request = request.body(Body::empty()).expect("request");
                let response = router.clone().oneshot(request).await.expect("infallible");
                let collected = response.into_body().collect().await.expect("body");
                let got = collected.trailers().cloned().unwrap_or_default();
                assert_eq!(got, trailers(), "{key}, {attempt}");
                assert_eq!(collected.to_bytes(), "ok", "{key}, {attempt}");
            }
        }
        // Over HTTP/1.1, trailers need a client that accepts them (`TE: trailers`), a chunked
        // body and a `Trailer` header naming them: the replay announces what it stored.
        let addr = serve(router).await;
        let expected = vec![
            ("grpc-status".to_owned(), "0".to_owned()),
            ("x-checksum".to_owned(), "abc".to_owned()),
        ];
        for attempt in ["first", "replay"] {
            let headers = [
                ("idempotency-key", "over-http1"),
                ("x-stream", "1"),
                ("te", "trailers"),
            ];
            let reply = post(addr, "/trailers", &headers, "").await;
            assert_eq!(reply.body, "ok", "{attempt}");
            assert_eq!(reply.trailers, expected, "{attempt}: {:?}", reply.headers);
        }
    });
}

/// A gRPC service behind `layer` at `/grpc`, answering as the request's headers say:
/// `x-mode` (`trailers-only`: a call that failed before any message; `whole`: a known size,
/// read whole; `streamed`; `large`: streamed far over a 64-byte stored-body limit;
/// `after-trailers` and `pending-after`: streamed, then more after its trailers) and
/// `x-status` (its `grpc-status`). Counts its runs.
fn grpc_service(layer: idempotency_tower::IdempotencyLayer) -> (axum::Router, support::Calls) {
    let calls = support::Calls::default();
    let counted = calls.0.clone();
    let router = axum::Router::new()
        .route(
            "/grpc",
            axum::routing::post(move |headers: axum::http::HeaderMap| {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async move {
                    let header = |name: &str| {
                        headers
                            .get(name)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .to_owned()
                    };
                    let (mode, status) = (header("x-mode"), header("x-status"));
                    let trailers = || {
                        let mut map = axum::http::HeaderMap::new();
                        map.insert("grpc-status", status.parse().expect("value"));
                        map
                    };
                    let message = bytes::Bytes::from_static(b"\0\0\0\0\x02ok");
                    if mode == "slow" {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    if mode == "problem" {
                        let mut response = axum::response::Response::new(Body::from("{}"));
                        *response.status_mut() = axum::http::StatusCode::UNPROCESSABLE_ENTITY;
                        response.headers_mut().insert(
                            "content-type",
                            "application/problem+json".parse().expect("value"),
                        );
                        return response;
                    }
                    let mut response = match mode.as_str() {
                        "trailers-only" | "slow" => {
                            let mut response = axum::response::Response::new(Body::empty());
                            response
                                .headers_mut()
                                .insert("grpc-status", status.parse().expect("value"));
                            response
                        }
                        "whole" => axum::response::Response::new(Body::new(
                            http_body_util::Full::new(message)
                                .with_trailers(std::future::ready(Some(Ok(trailers())))),
                        )),
                        _ => {
                            let n = if mode == "large" { 40 } else { 1 };
                            // tonic's body after an error's trailers polls the handler's
                            // stream on: more messages, or a wait.
                            let after = match mode.as_str() {
                                "after-trailers" => vec![http_body::Frame::data(message.clone())],
                                _ => vec![],
                            };
                            let frames = std::iter::repeat_n(message, n)
                                .map(http_body::Frame::data)
                                .chain([http_body::Frame::trailers(trailers())])
                                .chain(after)
                                .map(Ok::<_, std::convert::Infallible>);
                            let frames = futures::stream::iter(frames);
                            let body = if mode == "pending-after" {
                                Body::new(http_body_util::StreamBody::new(
                                    futures::StreamExt::chain(frames, futures::stream::pending()),
                                ))
                            } else {
                                Body::new(http_body_util::StreamBody::new(frames))
                            };
                            axum::response::Response::new(body)
                        }
                    };
                    response
                        .headers_mut()
                        .insert("content-type", "application/grpc".parse().expect("value"));
                    response
                }
            }),
        )
        .layer(layer.max_stored_body(64));
    (router, calls)
}

/// Sends a gRPC-shaped call to `router`'s `/grpc` (see [`grpc_service`]); its response's
/// `Idempotent-Replayed`, its trailers' `grpc-status`, and its body.
async fn grpc_call(
    router: &axum::Router,
    key: &str,
    mode: &str,
    status: &str,
) -> (bool, Option<String>, bytes::Bytes) {
    let request = axum::http::Request::post("/grpc")
        .header("idempotency-key", key)
        .header("x-mode", mode)
        .header("x-status", status)
        .body(Body::empty())
        .expect("request");
    let response = router.clone().oneshot(request).await.expect("infallible");
    let replayed = response.headers().contains_key("idempotent-replayed");
    let in_head = response.headers().get("grpc-status").cloned();
    let collected = response.into_body().collect().await.expect("body");
    let status = collected
        .trailers()
        .and_then(|t| t.get("grpc-status").cloned())
        .or(in_head)
        .map(|v| v.to_str().expect("ascii").to_owned());
    (replayed, status, collected.to_bytes())
}

/// The layer's own refusals reach a gRPC client as gRPC statuses (a trailers-only response,
/// `grpc-status`, the detail in `grpc-message`), not as HTTP problems, which gRPC clients
/// read as `UNKNOWN` or `INTERNAL`: a retry of a call still running is `UNAVAILABLE`, which
/// their retry policies retry (with the layer's `Retry-After` as the server's pushback),
/// a key reused for another call or a malformed key `INVALID_ARGUMENT`. A handler's own
/// problem+json, and its replay, are left as they are.
#[test]
fn the_layers_refusals_reach_grpc_clients_as_grpc_statuses() {
    block_on(async {
        let (router, calls) = grpc_service(layer(memory()));
        let call = |key: &str, mode: &str, message: &'static [u8]| {
            let request = axum::http::Request::post("/grpc")
                .header("content-type", "application/grpc")
                .header("idempotency-key", key)
                .header("x-mode", mode)
                .header("x-status", "0")
                .body(Body::from(message))
                .expect("request");
            let router = router.clone();
            async move { router.oneshot(request).await.expect("infallible") }
        };
        let status_of = |response: &axum::http::Response<Body>| {
            assert_eq!(response.status(), 200, "gRPC travels in HTTP 200");
            assert_eq!(response.headers()["content-type"], "application/grpc");
            assert!(response.headers().contains_key("grpc-message"));
            response.headers()["grpc-status"]
                .to_str()
                .expect("ascii")
                .to_owned()
        };
        // A retry while the first call still runs.
        let charge = b"\0\0\0\0\x021k";
        let (first, retry) = tokio::join!(call("running", "slow", charge), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            call("running", "slow", charge).await
        });
        assert_eq!(first.headers()["grpc-status"], "0");
        assert_eq!(status_of(&retry), "14", "in flight: UNAVAILABLE");
        assert!(retry.headers().contains_key("grpc-retry-pushback-ms"));
        // The key reused for another call.
        let reused = call("running", "slow", b"\0\0\0\0\x022k").await;
        assert_eq!(status_of(&reused), "3", "key reused: INVALID_ARGUMENT");
        // A malformed key.
        let malformed = call("", "slow", charge).await;
        assert_eq!(status_of(&malformed), "3", "INVALID_ARGUMENT");
        assert_eq!(calls.get(), 1, "only the first call ran");
        // A request body that broke off: nothing ran, and the same call sent again may well
        // succeed.
        let broken = axum::http::Request::post("/grpc")
            .header("content-type", "application/grpc")
            .header("idempotency-key", "broken")
            .header("x-mode", "slow")
            .body(Body::from_stream(futures::stream::iter([
                Ok(bytes::Bytes::from_static(b"\0\0\0")),
                Err(std::io::Error::other("the client's stream broke")),
            ])))
            .expect("request");
        let broken = router.clone().oneshot(broken).await.expect("infallible");
        assert_eq!(status_of(&broken), "14", "broke off: UNAVAILABLE");
        // The handler's own problem (a validation error, stored): not the layer's to recast.
        for attempt in ["first", "replay"] {
            let own = call("its-own", "problem", charge).await;
            assert_eq!(own.status(), 422, "{attempt}");
            assert_eq!(own.headers()["content-type"], "application/problem+json");
            assert_eq!(
                own.headers().contains_key("idempotent-replayed"),
                attempt == "replay"
            );
        }
    });
}

/// gRPC answers HTTP 200 whatever happened and carries its status in `grpc-status`: in the
/// headers of a trailers-only response, or in the trailers after the messages. A failure
/// there (`UNAVAILABLE`, which gRPC clients retry; `UNAUTHENTICATED`) is not stored, as the
/// HTTP status it stands for would not be: the retry runs again. Before, the 200 was stored
/// and every retry replayed the transient failure for the whole retention. A success is
/// stored and replayed with its status.
#[test]
fn grpc_failures_are_not_stored_and_their_retries_run_again() {
    block_on(async {
        let (router, calls) = grpc_service(layer(memory()));
        for mode in ["trailers-only", "whole", "streamed", "after-trailers"] {
            for (status, stored) in [("14", false), ("16", false), ("0", true)] {
                let key = format!("grpc-{mode}-{status}");
                for attempt in ["first", "retry"] {
                    let (replayed, got, _) = grpc_call(&router, &key, mode, status).await;
                    assert_eq!(got.as_deref(), Some(status), "{mode}, {status}, {attempt}");
                    let expect_replay = stored && attempt == "retry";
                    assert_eq!(
                        replayed, expect_replay,
                        "{mode}, status {status}, {attempt}"
                    );
                }
                let runs = if stored { 1 } else { 2 };
                assert_eq!(
                    calls.take(),
                    runs,
                    "{mode}, status {status}: runs of the handler"
                );
            }
        }
        // Over the stored-body limit, a stream is stored at the limit without its body or
        // trailers, as any is: its replay is a trailers-only `INTERNAL`, never a success
        // without messages (which a missing `grpc-status` was to some clients).
        let (_, first, body) = grpc_call(&router, "grpc-large", "large", "0").await;
        assert_eq!((first.as_deref(), body.len()), (Some("0"), 280));
        let (replayed, again, body) = grpc_call(&router, "grpc-large", "large", "0").await;
        assert!(replayed && body.is_empty(), "{again:?} {body:?}");
        assert_eq!(again.as_deref(), Some("13"));
        assert_eq!(calls.take(), 1);
    });
}

/// A gRPC failure that may have taken effect (`DEADLINE_EXCEEDED`: a downstream charge whose
/// answer came late; `INTERNAL`) is kept for the outcome-unknown policy, as a response marked
/// `MaybeApplied` is: a gRPC handler has no way to mark one. Under `Reject` the retry is
/// refused rather than run again; `UNAVAILABLE` is given back and runs again.
#[test]
fn grpc_failures_that_may_have_taken_effect_are_kept_for_the_outcome_unknown_policy() {
    block_on(async {
        let reject = layer(memory()).on_outcome_unknown(idempotency_tower::OutcomeUnknown::Reject);
        let (router, calls) = grpc_service(reject);
        for (status, runs) in [("4", 1), ("13", 1), ("14", 2)] {
            for mode in ["trailers-only", "streamed"] {
                let key = format!("grpc-unknown-{mode}-{status}");
                grpc_call(&router, &key, mode, status).await;
                let request = axum::http::Request::post("/grpc")
                    .header("idempotency-key", key.as_str())
                    .header("x-mode", mode)
                    .header("x-status", status)
                    .body(Body::empty())
                    .expect("request");
                let retry = router.clone().oneshot(request).await.expect("infallible");
                assert_eq!(calls.take(), runs, "{mode}, status {status}: {retry:?}");
            }
        }
    });
}

/// Trailers end the response for the client (hyper sends them with the stream's end), so
/// they reach it only once the outcome is stored: a client that read the whole response and
/// retries at once gets the replay. Before, they were forwarded first, and a retry made
/// while the store's write was on its way found the key in flight (409, which gRPC clients
/// do not retry).
#[test]
fn trailers_reach_the_client_only_once_the_outcome_is_stored() {
    block_on(async {
        let slow = Arc::new(support::Rigged {
            complete_takes: Duration::from_millis(300),
            ..support::Rigged::default()
        });
        let (router, calls) = grpc_service(layer(slow));
        let addr = serve(router).await;
        for status in ["0", "14"] {
            let key = format!("grpc-held-{status}");
            let headers = [
                ("idempotency-key", key.as_str()),
                ("x-mode", "streamed"),
                ("x-status", status),
                ("te", "trailers"),
            ];
            let first = post(addr, "/grpc", &headers, "").await;
            let retry = post(addr, "/grpc", &headers, "").await;
            assert_eq!(retry.status, 200, "{status}: {:?}", retry.headers);
            let replayed = retry
                .headers
                .iter()
                .any(|(k, _)| k == "idempotent-replayed");
            assert_eq!(replayed, status == "0", "{status}: {:?}", first.headers);
            assert_eq!(calls.take(), if status == "0" { 1 } else { 2 }, "{status}");
        }
        // A body that waits after its trailers (tonic's, polling a handler's stream that
        // stays open) ends at them, as without the layer. (The guard turns a hang into a
        // failure.)
        let headers = [
            ("idempotency-key", "grpc-pending-after"),
            ("x-mode", "pending-after"),
            ("x-status", "14"),
            ("te", "trailers"),
        ];
        let answered =
            tokio::time::timeout(Duration::from_secs(20), post(addr, "/grpc", &headers, "")).await;
        let reply = answered.expect("the response ends at its trailers");
        assert_eq!(reply.status, 200);
        assert_eq!(calls.take(), 1);
    });
}

/// A body read whole whose trailers frame is empty keeps its exact size for the first client,
/// as its replay does (framed by `Content-Length`, not chunked).
#[test]
fn an_empty_trailers_frame_keeps_the_body_framed_by_its_length() {
    use http_body::Body as _;
    use http_body_util::BodyExt as _;
    block_on(async {
        let router = axum::Router::new()
            .route(
                "/empty-trailers",
                axum::routing::post(|| async {
                    let body = http_body_util::Full::new(bytes::Bytes::from_static(b"ok"))
                        .with_trailers(std::future::ready(Some(Ok(axum::http::HeaderMap::new()))));
                    axum::response::Response::new(Body::new(body))
                }),
            )
            .layer(layer(memory()));
        for attempt in ["first", "replay"] {
            let request = axum::http::Request::post("/empty-trailers")
                .header("idempotency-key", "k")
                .body(Body::empty())
                .expect("request");
            let response = router.clone().oneshot(request).await.expect("infallible");
            assert_eq!(response.body().size_hint().exact(), Some(2), "{attempt}");
        }
    });
}

/// A response larger than the stored-body limit streams to the first client as it is
/// produced (the head arrives while the handler still holds the rest back), instead of being
/// buffered whole; it is stored without its body, and the retry replays that.
#[test]
fn a_large_response_streams_and_is_stored_without_its_body() {
    block_on(async {
        let (router, calls, hold) = streaming_app(layer(memory()).max_stored_body(100_000));
        let key = uuid::Uuid::new_v4().to_string();
        let chunks = [("x-chunks", "64"), ("x-hold", "1")];
        let response = tokio::time::timeout(
            Duration::from_secs(5),
            router.clone().oneshot(stream_request(&key, &chunks)),
        )
        .await
        .expect("the head arrives before the body is complete")
        .expect("response");
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        let first = body.frame().await.expect("a frame").expect("data");
        assert_eq!(first.data_ref().map(|d| d.len()), Some(64 * 1024));
        hold.notify_one();
        let rest = body.collect().await.expect("the rest").to_bytes();
        assert_eq!(
            first.into_data().expect("data").len() + rest.len(),
            64 * 64 * 1024
        );

        let again = router
            .clone()
            .oneshot(stream_request(&key, &chunks))
            .await
            .expect("replay");
        assert_eq!(again.status(), 200);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["idempotent-replay-body"], "omitted");
        assert!(
            again
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes()
                .is_empty()
        );
        assert_eq!(calls.get(), 1);
    });
}

/// A response with a `Content-Length`, larger than the stored-body limit, streams to its end
/// and ends cleanly: stored without its body at its first frame, it must still count the
/// bytes it forwards after, or the end looked short of the declared length and was turned
/// into an error after the last byte (a payment the client saw fail).
#[test]
fn a_large_response_with_a_declared_length_ends_cleanly() {
    block_on(async {
        let (router, calls, hold) = streaming_app(layer(memory()).max_stored_body(100_000));
        let key = uuid::Uuid::new_v4().to_string();
        let chunks = [("x-chunks", "16"), ("x-declare-length", "1")];
        hold.notify_one(); // the end need not wait
        let response = router
            .clone()
            .oneshot(stream_request(&key, &chunks))
            .await
            .expect("response");
        assert_eq!(response.status(), 200);
        let body = response
            .into_body()
            .collect()
            .await
            .expect("the whole body, ending cleanly")
            .to_bytes();
        assert_eq!(body.len(), 16 * 64 * 1024);

        let again = router
            .clone()
            .oneshot(stream_request(&key, &chunks))
            .await
            .expect("replay");
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["idempotent-replay-body"], "omitted");
        assert_eq!(calls.get(), 1);
    });
}

/// The layer's request future dropped at its 1st, 2nd, … poll (a client hang-up, an outer
/// timeout) until it completes undropped: after every drop, the same request is answerable
/// long before the lease would free an orphaned claim (it executes, or replays the execution
/// the dropped request started), and the handler runs exactly once per key.
///
/// `delay_ms`: how long the handler waits (it then runs in a task of its own); `None`, it
/// answers at once and its outcome is stored from the request's own future, so the drops
/// land while that write is in flight.
///
/// On a loaded machine a request can complete at its very first poll (the thread is
/// preempted while the store answers), and then the sweep dropped nothing by chance: it is
/// run again, up to [`SWEEP_ROUNDS`](idempotency_test::conformance::SWEEP_ROUNDS) times,
/// as the stores' own sweep is.
async fn layer_sweep(store: Arc<dyn Store>, delay_ms: Option<&'static str>) {
    for _ in 0..idempotency_test::conformance::SWEEP_ROUNDS {
        if layer_sweep_once(store.clone(), delay_ms).await > 0 {
            return;
        }
    }
    panic!("the sweep dropped nothing in any of its rounds");
}

/// One round of [`layer_sweep`]; returns how many request futures it dropped.
async fn layer_sweep_once(store: Arc<dyn Store>, delay_ms: Option<&'static str>) -> usize {
    use idempotency_test::conformance::{ANSWERABLE_WITHIN, SWEEP_LEASE, drop_at_poll};
    let layer = layer(store).policy(idempotency_core::Policy::default().with_lease(SWEEP_LEASE));
    let (router, calls, _) = app(layer);
    let request = |key: &str| {
        axum::http::Request::builder()
            .method("POST")
            .uri("/charges")
            .header("idempotency-key", key)
            .header(
                "x-delay-ms",
                // Not a number: the handler answers at once.
                delay_ms.unwrap_or("at-once"),
            )
            .body(Body::from("{}"))
            .expect("request")
    };
    let mut dropped = 0;
    for k in 1..=400 {
        let key = uuid::Uuid::new_v4().to_string();
        let before = calls.get();
        let first = drop_at_poll(router.clone().oneshot(request(&key)), k).await;
        let deadline = tokio::time::Instant::now() + ANSWERABLE_WITHIN;
        let response = loop {
            let response = router
                .clone()
                .oneshot(request(&key))
                .await
                .expect("response");
            if response.status() != 409 || tokio::time::Instant::now() > deadline {
                break response;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        assert_eq!(response.status(), 201, "after a drop at poll {k}");
        assert_eq!(
            calls.get(),
            before + 1,
            "one execution per key (drop at poll {k})"
        );
        // And what the retry got is that execution's outcome (its call's number), not
        // another's or a half-stored one.
        let executed = format!(r#""charge":{}"#, before + 1);
        let body = |response: axum::response::Response| async move {
            let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await;
            String::from_utf8(bytes.expect("body").to_vec()).expect("utf-8")
        };
        let got = body(response).await;
        assert!(got.contains(&executed), "drop at poll {k}: {got}");
        match first {
            Some(done) => {
                let done = done.expect("response");
                assert_eq!(done.status(), 201);
                let got = body(done).await;
                assert!(got.contains(&executed), "undropped: {got}");
                return dropped;
            }
            None => dropped += 1,
        }
    }
    panic!("the request future never completed undropped");
}

/// A handler that keeps its task's cooperative budget spent (a CPU loop that yields with
/// `consume_budget`, as tokio advises) still has its lease renewed: a retry two leases in is
/// told "in flight", not handed the key, and the handler runs once.
#[test]
fn a_handler_that_spends_its_budget_still_has_its_lease_renewed() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    block_on(async {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let handler = move || {
            let calls = counted.clone();
            async move {
                calls.fetch_add(1, SeqCst);
                let until = tokio::time::Instant::now() + Duration::from_secs(3);
                while tokio::time::Instant::now() < until {
                    tokio::task::consume_budget().await;
                }
                (axum::http::StatusCode::CREATED, "ch_1")
            }
        };
        let lease = idempotency_core::Policy::default().with_lease(Duration::from_secs(1));
        let router = axum::Router::new()
            .route("/charges", axum::routing::post(handler))
            .layer(layer(memory()).policy(lease));
        let request = || {
            axum::http::Request::builder()
                .method("POST")
                .uri("/charges")
                .header("idempotency-key", "busy-handler")
                .body(Body::from("{}"))
                .expect("request")
        };
        let first = tokio::spawn(router.clone().oneshot(request()));
        tokio::time::sleep(Duration::from_secs(2)).await;
        let retry = router.clone().oneshot(request()).await.expect("retry");
        assert_eq!(retry.status(), 409, "the lease was not renewed");
        let first = first.await.expect("first").expect("response");
        assert_eq!(first.status(), 201);
        assert_eq!(calls.load(SeqCst), 1, "the handler ran once");
    });
}

/// A handler that answers at once runs in the request's own task: no hand-off to another
/// task and back per request, which on a busy server cost more than the store's round trip.
/// (A handler that has to wait moves into a task of its own: the sweep above.)
#[test]
fn a_handler_that_answers_at_once_runs_in_the_request_s_task() {
    block_on(async {
        let seen = Arc::new(std::sync::Mutex::new(None));
        let handler_seen = seen.clone();
        let handler = move || {
            let seen = handler_seen.clone();
            async move {
                *seen.lock().expect("lock") = tokio::task::try_id();
                (axum::http::StatusCode::CREATED, "ch_1")
            }
        };
        let router = axum::Router::new()
            .route("/charges", axum::routing::post(handler))
            .layer(layer(memory()));
        let request = axum::http::Request::builder()
            .method("POST")
            .uri("/charges")
            .header("idempotency-key", "in-the-request-s-task")
            .body(Body::from("{}"))
            .expect("request");
        let caller = tokio::spawn(async move {
            let response = router.oneshot(request).await.expect("response");
            assert_eq!(response.status(), 201);
            tokio::task::id()
        })
        .await
        .expect("the caller's task");
        assert_eq!(*seen.lock().expect("lock"), Some(caller));
    });
}

#[test]
fn the_request_future_dropped_at_every_poll_on_memory() {
    block_on(layer_sweep(memory(), Some("20")));
}

#[test]
fn the_request_future_dropped_at_every_poll_on_postgres() {
    block_on(async {
        let Some(store) = idempotency_test::stores::postgres().await else {
            return;
        };
        layer_sweep(store, Some("20")).await;
    });
}

/// A store whose writes take a while, under a handler that answers at once: the drops land
/// while the outcome is being stored from the request's own future.
#[test]
fn the_request_future_dropped_at_every_poll_while_its_outcome_is_stored_on_memory() {
    let store = idempotency_test::late::LateBegin::new(MemoryStore::new(), Duration::ZERO);
    store.set_complete_delay(Duration::from_millis(5));
    block_on(layer_sweep(Arc::new(store), None));
}

#[test]
fn the_request_future_dropped_at_every_poll_while_its_outcome_is_stored_on_postgres() {
    block_on(async {
        let Some(store) = idempotency_test::stores::postgres().await else {
            return;
        };
        layer_sweep(store, None).await;
    });
}

#[test]
fn the_request_future_dropped_at_every_poll_while_its_outcome_is_stored_on_redis() {
    block_on(async {
        let Some(store) = redis_store().await else {
            return;
        };
        layer_sweep(store, None).await;
    });
}

#[test]
fn the_request_future_dropped_at_every_poll_while_its_outcome_is_stored_on_the_hybrid_store() {
    block_on(async {
        let Some(store) = hybrid_store().await else {
            return;
        };
        layer_sweep(store, None).await;
    });
}

/// A handler that answers at once has its outcome stored from the request's own task too:
/// no hand-off to a task and back while the store writes. (Before, the write moved into a
/// task of its own as soon as it had to wait.)
#[test]
fn a_handler_that_answers_at_once_has_its_outcome_stored_in_the_request_s_task() {
    block_on(async {
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            Duration::ZERO,
        ));
        store.set_complete_delay(Duration::from_millis(20));
        let (router, calls, _) = app(layer(store.clone()));
        let caller = tokio::spawn(async move {
            let response = send(&router, "POST", Some("stored-here"), &[], "{}").await;
            assert_eq!(response.status, 201);
            tokio::task::id()
        })
        .await
        .expect("the caller's task");
        assert_eq!(calls.get(), 1);
        assert_eq!(store.last_complete_task(), Some(caller));
    });
}

/// A write slower than the hand-over: the outcome is stored from a task of its own while the
/// request waits, and the request is still answered (woken when the write ends in that task).
#[test]
fn a_slow_write_moves_into_a_task_and_its_request_is_still_answered() {
    block_on(async {
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            Duration::ZERO,
        ));
        store.set_complete_delay(idempotency_core::HANDOVER_AFTER * 3);
        let (router, calls, _) = app(layer(store.clone()));
        let caller = tokio::spawn(async move {
            let response = send(&router, "POST", Some("slow-write"), &[], "{}").await;
            (response.status, tokio::task::id())
        });
        let (status, caller) = tokio::time::timeout(Duration::from_secs(10), caller)
            .await
            .expect("the request is answered")
            .expect("the caller's task");
        assert_eq!(status, 201);
        assert_eq!(calls.get(), 1);
        assert_ne!(
            store.last_complete_task(),
            Some(caller),
            "the write moved into a task of its own"
        );
    });
}

/// A request future held without being polled (its caller busy in another branch of a
/// `select!`) while the outcome of a handler that answered at once is being stored: the write
/// moves into a task of its own and lands, so a retry after the lease would have lapsed
/// replays — the handler runs once. (Stored from the request's future alone, the lease ran
/// out unrenewed and the retry took the key over and ran the handler again.)
#[test]
fn a_request_held_without_polling_while_its_outcome_is_stored_still_stores_it() {
    block_on(async {
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            Duration::ZERO,
        ));
        store.set_complete_delay(Duration::from_millis(50));
        let lease = Duration::from_millis(600);
        let policy = idempotency_core::Policy::default().with_lease(lease);
        let (router, calls, _) = app(layer(store.clone()).policy(policy));
        let held = send(&router, "POST", Some("held-while-stored"), &[], "{}");
        tokio::pin!(held);
        // Polled until the handler has run and the write has begun, then held.
        while calls.get() == 0 {
            assert!(futures::poll!(&mut held).is_pending());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(lease * 3).await;
        let retry = send(&router, "POST", Some("held-while-stored"), &[], "{}").await;
        assert_eq!(retry.status, 201);
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(calls.get(), 1, "the handler ran once");
        let first = held.await;
        assert_eq!(first.status, 201);
    });
}

/// The request dropped (an outer timeout) while the outcome of a handler that answered at
/// once is being stored: the write goes on in a task of its own, `drain` waits for it, and
/// the retry replays — the handler ran once.
#[test]
fn a_request_dropped_while_its_outcome_is_stored_still_stores_it() {
    block_on(async {
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            Duration::ZERO,
        ));
        store.set_complete_delay(Duration::from_millis(300));
        let layer = layer(store.clone());
        let (router, calls, _) = app(layer.clone());
        let cut = tokio::time::timeout(
            Duration::from_millis(100),
            send(&router, "POST", Some("dropped-while-stored"), &[], "{}"),
        )
        .await;
        assert!(
            cut.is_err(),
            "the request is cut off while its outcome is stored"
        );
        assert_eq!(calls.get(), 1, "the handler ran");
        layer.drain().await;
        let id = idempotency_core::RecordId::new(
            &idempotency_core::Scope::new("anonymous"),
            &idempotency_core::IdempotencyKey::new("dropped-while-stored").expect("key"),
        );
        let record = store
            .inspect(&id)
            .await
            .expect("inspect")
            .expect("a record");
        assert!(
            matches!(
                record.state,
                idempotency_core::RecordState::Completed { .. }
            ),
            "drain waited for the outcome to be stored: {record:?}"
        );
        store.set_complete_delay(Duration::ZERO);
        let retry = send(&router, "POST", Some("dropped-while-stored"), &[], "{}").await;
        assert_eq!(retry.status, 201);
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(calls.get(), 1, "the handler ran once");
    });
}

/// Sends a request for `/stream` and reads only the response head; the socket is returned
/// still open (the caller decides whether to keep reading, stall, or hang up).
///
/// Raw TCP on purpose, unlike the rest of the suite (`idempotency_test::http`, hyper): a
/// stalled reader must leave the bytes in the socket so the server's writes block, and a
/// client library reads ahead into its own buffer.
async fn stream_head(
    addr: std::net::SocketAddr,
    key: &str,
    chunks: &str,
) -> (u16, String, tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "POST /stream HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\nx-chunks: {chunks}\r\ncontent-length: 0\r\n\r\n"
    );
    client.write_all(request.as_bytes()).await.expect("write");
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        assert_eq!(
            client.read(&mut byte).await.expect("read"),
            1,
            "a response head"
        );
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let status = head[9..12].parse().expect("status");
    (status, head, client)
}

/// A client that takes the head and then stops reading (an exhausted flow-control window, a
/// stalled proxy) must not let the lease lapse while the response is still being produced:
/// before, the forwarding task waited on it without renewing, the lease ran out, and a retry
/// ran the handler a second time. Now a reader stalled for a third of a lease counts as gone,
/// and the outcome is stored (renewing meanwhile): the retry replays.
#[test]
fn a_stalled_reader_does_not_let_a_retry_run_again() {
    block_on(async {
        let layer = layer(memory())
            .policy(idempotency_core::Policy::default().with_lease(Duration::from_secs(1)))
            .max_stored_body(64 << 20);
        let (router, calls, _) = streaming_app(layer);
        let addr = serve(router).await;
        let key = uuid::Uuid::new_v4().to_string();
        // 4,000 chunks of 64 KiB: far more than the socket buffers hold.
        let (status, _, stalled) = stream_head(addr, &key, "4000").await;
        assert_eq!(status, 200);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(6);
        let head = loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let (status, head, _) =
                tokio::time::timeout(Duration::from_secs(5), stream_head(addr, &key, "4000"))
                    .await
                    .expect("a head");
            if status != 409 || tokio::time::Instant::now() > deadline {
                break head;
            }
        };
        drop(stalled);
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("idempotent-replayed: true"), "{head}");
        assert_eq!(calls.get(), 1, "the handler ran again: {head}");
    });
}

/// A client that stops reading a streamed response long enough to count as gone (a third of
/// a lease), then reads on, gets the frames that were waiting for it and then an error, not
/// a clean end: the frames forwarded after it was given up never reach it, so its body is
/// not whole, even though the response's end was stored whole.
#[test]
fn a_reader_that_stalled_then_read_on_is_cut_off() {
    block_on(async {
        let layer = layer(memory())
            .policy(idempotency_core::Policy::default().with_lease(Duration::from_millis(300)));
        let (router, _, _) = streaming_app(layer.clone());
        let response = router
            .oneshot(stream_request("k", &[("x-chunks", "20")]))
            .await
            .expect("infallible");
        assert_eq!(response.status(), 200);
        // Not read until the forwarding task gave the reader up and stored the whole body.
        layer.drain().await;
        let mut body = response.into_body();
        let mut read = 0;
        let end = loop {
            match body.frame().await {
                Some(Ok(frame)) => read += frame.data_ref().map_or(0, |d| d.len()),
                other => break other,
            }
        };
        assert!(read < 20 * 64 * 1024, "the reader got it all: {read}");
        assert!(
            matches!(end, Some(Err(_))),
            "a body missing frames ended cleanly after {read} bytes"
        );
    });
}

/// A streamed response with a declared length is whole for its client at the last byte,
/// before the stream ends: the outcome is stored before that byte is forwarded, so a client
/// that read it all and retries at once gets the replay, not a 409.
#[test]
fn a_declared_length_response_is_stored_before_its_last_byte() {
    block_on(async {
        let (router, calls, hold) = streaming_app(layer(memory()));
        let key = uuid::Uuid::new_v4().to_string();
        let request = [("x-chunks", "4"), ("x-declare-length", "1")];
        let response = router
            .clone()
            .oneshot(stream_request(&key, &request))
            .await
            .expect("response");
        let mut body = response.into_body();
        let mut read = 0;
        while read < 4 * 64 * 1024 {
            let frame = body.frame().await.expect("a frame").expect("data");
            read += frame.data_ref().map_or(0, |d| d.len());
        }
        // Every byte is here; the handler still holds its stream's end back.
        let again = router
            .clone()
            .oneshot(stream_request(&key, &request))
            .await
            .expect("retry");
        assert_eq!(again.status(), 200);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        hold.notify_one();
        assert_eq!(calls.get(), 1);
    });
}

/// The store is down for longer than a lease right after the handler ran: the response goes
/// out (the operation ran), and storing its outcome goes on in the background instead of
/// stopping with the lease. Once it lands, the retry replays; before, the lease ran out with
/// nothing stored, and the retry took the key over and charged a second time (`Reexecute`).
#[test]
fn an_outcome_the_store_refused_for_a_whole_lease_is_stored_later() {
    block_on(async {
        let store = Arc::new(idempotency_test::late::LateBegin::new(
            MemoryStore::new(),
            Duration::ZERO,
        ));
        // Five tries at most fit in a lease of a second; the rest, in the background, fail
        // until the eleventh lands.
        store.fail_completes(10);
        store.fail_renewals(10); // the whole store is down, not only this outcome refused
        let policy = idempotency_core::Policy::default().with_lease(Duration::from_secs(1));
        let layer = layer(store.clone()).policy(policy);
        let (router, calls, _) = app(layer.clone());
        let first = send(&router, "POST", Some("outage"), &[], "{}").await;
        assert_eq!((first.status, calls.get()), (201, 1));
        layer.drain().await; // the background write, until the store took it
        tokio::time::sleep(Duration::from_millis(1500)).await; // the lease is long over
        let retry = send(&router, "POST", Some("outage"), &[], "{}").await;
        assert_eq!(calls.get(), 1, "the handler ran once");
        assert_eq!(retry.status, 201);
        assert_eq!(retry.headers["idempotent-replayed"], "true");
    });
}

/// A response whose outcome was not stored (its lease was taken while the handler ran) does
/// not advertise an expiry: it would promise a replay until that date, and a retry runs
/// again (the other attempt decides the key).
#[test]
fn a_response_whose_outcome_was_not_stored_advertises_no_expiry() {
    block_on(async {
        let store = idempotency_test::late::LateBegin::new(MemoryStore::new(), Duration::ZERO);
        store.lose_completes(1);
        let layer = layer(Arc::new(store)).advertise_expiry(true);
        let (router, calls, _) = app(layer);
        let lost = send(&router, "POST", Some("exp-lost"), &[], "{}").await;
        assert_eq!((lost.status, calls.get()), (201, 1));
        assert!(
            lost.headers.get("idempotency-expires").is_none(),
            "{:?}",
            lost.headers
        );
        let stored = send(&router, "POST", Some("exp-stored"), &[], "{}").await;
        assert_eq!(stored.status, 201);
        assert!(stored.headers.get("idempotency-expires").is_some());
    });
}

/// `advertise_expiry`: a stored response and its replays say the same `Idempotency-Expires`
/// date, never later than the record's expiry in the store (read back with `inspect`); a
/// response that is not stored says nothing, and neither does a layer not told to.
#[test]
fn the_advertised_expiry_is_on_first_responses_and_replays_and_not_after_the_store_s() {
    block_on(async {
        let Some(store) = idempotency_test::stores::postgres().await else {
            return;
        };
        let store: Arc<dyn Store> = store;
        let retention = Duration::from_secs(3600);
        let policy = idempotency_core::Policy::default().with_retention(retention);
        let (router, _, _) = app(layer(store.clone()).policy(policy).advertise_expiry(true));
        let key = idempotency_test::unique("exp");
        let sent = std::time::SystemTime::now();
        let first = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(first.status, 201);
        let advertised = first.headers["idempotency-expires"]
            .to_str()
            .expect("ascii")
            .to_owned();
        let until = httpdate::parse_http_date(&advertised).expect("an HTTP-date");
        assert!(
            until + Duration::from_secs(2) >= sent + retention,
            "{advertised}"
        );
        assert!(
            until <= std::time::SystemTime::now() + retention,
            "{advertised}"
        );
        let replay = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(replay.headers["idempotent-replayed"], "true");
        assert_eq!(replay.headers["idempotency-expires"], advertised.as_str());

        let id = idempotency_core::RecordId::new(
            &idempotency_core::Scope::new("anonymous"),
            &idempotency_core::IdempotencyKey::new(key).expect("key"),
        );
        let record = store.inspect(&id).await.expect("inspect").expect("stored");
        assert!(
            until <= record.expires_at,
            "advertised {advertised}, the store keeps it until {:?}",
            record.expires_at
        );

        let failed = send(&router, "POST", Some("exp-503"), &[("x-fail", "503")], "{}").await;
        assert_eq!(failed.status, 503);
        assert!(failed.headers.get("idempotency-expires").is_none());
        let (quiet, _, _) = app(layer(store));
        let plain = send(
            &quiet,
            "POST",
            Some(&idempotency_test::unique("exp")),
            &[],
            "{}",
        )
        .await;
        assert_eq!(plain.status, 201);
        assert!(plain.headers.get("idempotency-expires").is_none());
    });
}

/// A header the response's `Connection` names is hop-by-hop for that response (RFC 9110
/// §7.6.1): meant for the next hop only, like `Keep-Alive`. It is not stored, so a replay
/// does not hand it to a client the first answer never reached. It was stored and replayed.
#[test]
fn a_header_the_response_names_in_connection_is_not_stored() {
    block_on(async {
        let router = axum::Router::new()
            .route(
                "/charges",
                axum::routing::post(|| async {
                    (
                        axum::http::StatusCode::CREATED,
                        [
                            ("connection", "X-Hop-Secret, x-hop-other"),
                            ("x-hop-secret", "next-hop-only"),
                            ("x-hop-other", "also"),
                            ("x-kept", "yes"),
                        ],
                        "charged",
                    )
                }),
            )
            .layer(layer(memory()));
        let first = send(&router, "POST", Some("hop-1"), &[], "{}").await;
        assert_eq!(first.status, 201);
        let retry = send(&router, "POST", Some("hop-1"), &[], "{}").await;
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(retry.headers["x-kept"], "yes");
        assert!(retry.headers.get("x-hop-secret").is_none());
        assert!(retry.headers.get("x-hop-other").is_none());
        assert!(retry.headers.get("connection").is_none());
    });
}

/// A `Connection` value with a byte that is not visible ASCII (obs-text, which HTTP allows in
/// a field value) still names the headers its other parts name. The whole value was read as
/// text or not at all, so one such byte made it name nothing, and the header it named was
/// stored and replayed.
#[test]
fn a_connection_value_with_obs_text_still_names_its_other_headers() {
    block_on(async {
        let router = axum::Router::new()
            .route(
                "/charges",
                axum::routing::post(|| async {
                    let mut headers = axum::http::HeaderMap::new();
                    headers.insert(
                        "connection",
                        axum::http::HeaderValue::from_bytes(b"X-Hop-Secret, caf\xe9")
                            .expect("obs-text is a valid field value"),
                    );
                    headers.insert("x-hop-secret", "next-hop-only".parse().expect("value"));
                    headers.insert("x-kept", "yes".parse().expect("value"));
                    (axum::http::StatusCode::CREATED, headers, "charged")
                }),
            )
            .layer(layer(memory()));
        let first = send(&router, "POST", Some("hop-obs-1"), &[], "{}").await;
        assert_eq!(first.status, 201);
        let retry = send(&router, "POST", Some("hop-obs-1"), &[], "{}").await;
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        assert_eq!(retry.headers["x-kept"], "yes");
        assert!(retry.headers.get("x-hop-secret").is_none());
    });
}

/// A response whose framing ends with its head over HTTP/1.1 (a 204, one of `Content-Length:
/// 0`) from a body that does not know its size: the client has it whole as soon as the head
/// is sent, so a retry right after must get the replay, not a 409 while the handler's body
/// (never sent) takes its time to end. That body still runs, to its end, before the outcome
/// is stored and the head sent (it may stream the handler's work).
#[test]
fn a_response_complete_with_its_head_is_stored_before_it_is_sent() {
    use axum::{http::StatusCode, response::IntoResponse, routing};
    use std::sync::atomic::{AtomicUsize, Ordering};

    // A body that ends, empty, a moment after the head (its size not known up front), and
    // counts that it ran to its end.
    fn late_empty(worked: Arc<AtomicUsize>) -> Body {
        Body::from_stream(futures::stream::once(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            worked.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(bytes::Bytes::new())
        }))
    }

    block_on(async {
        let (calls, worked) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let handler = |response: fn(Body) -> axum::response::Response| {
            let (calls, worked) = (calls.clone(), worked.clone());
            move || async move {
                calls.fetch_add(1, Ordering::SeqCst);
                response(late_empty(worked))
            }
        };
        let router = axum::Router::new()
            .route(
                "/no-content",
                routing::post(handler(|body| {
                    (StatusCode::NO_CONTENT, body).into_response()
                })),
            )
            .route(
                "/zero-length",
                routing::post(handler(|body| {
                    ([("content-length", "0")], body).into_response()
                })),
            )
            .route_layer(layer(memory()));
        let addr = serve(router).await.to_string();
        for (n, (path, status)) in [("/no-content", 204), ("/zero-length", 200)]
            .into_iter()
            .enumerate()
        {
            let key = uuid::Uuid::new_v4().to_string();
            let headers = [("idempotency-key", key)];
            let send = || {
                idempotency_test::http::send(
                    &addr,
                    "POST",
                    path,
                    &headers,
                    "{}",
                    Duration::from_secs(30),
                )
            };
            let first = send().await.expect("an answer");
            assert_eq!(first.status, status, "{path}: {first:?}");
            assert_eq!(
                worked.load(Ordering::SeqCst),
                n + 1,
                "{path}: its body ran first"
            );
            let retry = send().await.expect("an answer");
            assert_eq!(
                (retry.status, retry.header("idempotent-replayed")),
                (status, Some("true")),
                "{path}: the client had the whole response, its retry gets the replay: {retry:?}"
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2, "one run per key");
        assert_eq!(worked.load(Ordering::SeqCst), 2, "each body ran once");
    });
}
