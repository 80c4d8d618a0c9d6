//! An earlier attempt that never stored its outcome (`Begin::TakeOver`), met by each
//! `OutcomeUnknown` policy of the layer, over Postgres.

use std::{sync::Arc, time::Duration};

use idempotency_core::{
    Begin, Fingerprint, IdempotencyKey, Outcome, Policy, RecordId, ReleaseScope, Scope, Store,
};
use idempotency_test::block_on;
use idempotency_tower::OutcomeUnknown;

use crate::{
    send,
    support::{app, layer},
};

/// A key whose attempt "crashed": claimed directly with a short lease that then ran out.
async fn crashed_attempt(store: &dyn Store) -> (String, RecordId) {
    let key = idempotency_test::unique("crashed");
    let id = RecordId::new(
        &Scope::new("anonymous"),
        &IdempotencyKey::new(key.clone()).expect("key"),
    );
    // The same request the test then retries through the layer: `POST /charges` with `{}`.
    let request = Fingerprint::builder()
        .method("POST")
        .path_and_query("/charges")
        .body(b"{}")
        .finish();
    let claimed = store
        .begin(&id, &request, Duration::from_millis(300))
        .await
        .expect("begin");
    assert!(matches!(claimed, Begin::Execute(_)), "{claimed:?}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    (key, id)
}

/// A reconcile hook that, like an operator acting while it looks, releases the key (its live
/// lease included) and then answers `found`.
fn releasing_hook(store: &Arc<dyn Store>, found: Option<Outcome>) -> OutcomeUnknown {
    let operator = store.clone();
    OutcomeUnknown::reconcile(move |unresolved| {
        let (operator, found) = (operator.clone(), found.clone());
        async move {
            let scope = ReleaseScope::default().with_live();
            operator
                .force_release(&unresolved.record_id, scope)
                .await
                .expect("release");
            Ok(found)
        }
    })
}

/// `POST /charges` with `key` and `{}`, sent without being awaited: a request future to poll
/// once, hold, or drop.
fn charge(
    router: &axum::Router,
    key: &str,
) -> std::pin::Pin<Box<tower::util::Oneshot<axum::Router, axum::http::Request<axum::body::Body>>>> {
    let request = axum::http::Request::post("/charges")
        .header("idempotency-key", key)
        .body(axum::body::Body::from("{}"))
        .expect("request");
    Box::pin(tower::ServiceExt::oneshot(router.clone(), request))
}

async fn postgres() -> Option<Arc<dyn Store>> {
    let store: Arc<dyn Store> = idempotency_test::stores::postgres().await?;
    Some(store)
}

#[test]
fn another_request_under_the_key_of_a_crashed_attempt_is_422() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        let (router, calls, _) =
            app(layer(store.clone()).on_outcome_unknown(OutcomeUnknown::Reject));
        let (key, _) = crashed_attempt(&*store).await;
        let other = send(&router, "POST", Some(&key), &[], r#"{"amount":9999}"#).await;
        assert_eq!(other.status, 422, "{}", other.body);
        assert_eq!(calls.get(), 0);
    });
}

#[test]
fn reexecute_runs_the_operation_again() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        let (router, calls, _) = app(layer(store.clone()));
        let (key, _) = crashed_attempt(&*store).await;
        let answer = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(answer.status, 201, "{}", answer.body);
        assert_eq!(calls.get(), 1);
    });
}

/// `Reject` keeps the attempt as what it is, one whose outcome is unknown: each retry is told
/// so, and the record stays for an operator to resolve. Found nothing: the operator releases
/// it, and the key runs again.
#[test]
fn reject_answers_409_and_keeps_answering_it_until_an_operator_releases_the_record() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        let (router, calls, _) =
            app(layer(store.clone()).on_outcome_unknown(OutcomeUnknown::Reject));
        let (key, id) = crashed_attempt(&*store).await;
        for _ in 0..2 {
            let answer = send(&router, "POST", Some(&key), &[], "{}").await;
            assert_eq!(answer.status, 409, "{}", answer.body);
            assert_eq!(
                answer.problem_type(),
                "urn:idempotency:problem:outcome-unknown"
            );
            assert!(answer.headers.get("retry-after").is_none());
        }
        assert_eq!(calls.get(), 0, "the operation never ran again");
        let kept = store.inspect(&id).await.expect("inspect").expect("kept");
        assert_eq!(
            kept.state,
            idempotency_core::RecordState::InFlight {
                lease_remaining: Duration::ZERO
            },
            "kept as an attempt whose outcome is unknown"
        );

        // The operator found no effect and releases the record: the key runs again.
        assert_eq!(
            store
                .force_release(&id, ReleaseScope::default())
                .await
                .expect("force_release"),
            idempotency_core::ForceReleased::Released
        );
        let after = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(after.status, 201, "{}", after.body);
        assert_eq!(calls.get(), 1);
    });
}

#[test]
fn reconcile_replays_what_the_hook_found_and_runs_when_it_found_nothing() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        // The hook "finds" a charge for the first key only.
        let (found_key, found_id) = crashed_attempt(&*store).await;
        let (clean_key, _) = crashed_attempt(&*store).await;
        let found = found_id;
        let policy = OutcomeUnknown::reconcile(move |unresolved| async move {
            assert_eq!(unresolved.body, "{}", "the hook sees the retry's request");
            Ok((unresolved.record_id == found).then(|| {
                Outcome::new(201)
                    .with_header("content-type", "application/json")
                    .with_body(r#"{"id":"ch_found"}"#)
            }))
        });
        let (router, calls, _) = app(layer(store.clone())
            .policy(Policy::default())
            .on_outcome_unknown(policy));
        let answer = send(&router, "POST", Some(&found_key), &[], "{}").await;
        assert_eq!(answer.status, 201, "{}", answer.body);
        assert_eq!(answer.body, r#"{"id":"ch_found"}"#);
        assert_eq!(answer.headers["idempotent-replayed"], "true");
        let again = send(&router, "POST", Some(&found_key), &[], "{}").await;
        assert_eq!(
            again.body, r#"{"id":"ch_found"}"#,
            "stored: a retry replays it"
        );
        assert_eq!(calls.get(), 0, "the effect was found: no second run");

        let clean = send(&router, "POST", Some(&clean_key), &[], "{}").await;
        assert_eq!(clean.status, 201, "{}", clean.body);
        assert!(clean.headers.get("idempotent-replayed").is_none());
        assert_eq!(calls.get(), 1, "nothing found: the operation ran");
    });
}

/// The hook's answer is stored and replayed as a handler's response is: without hop-by-hop
/// headers, those its `Connection` names, its `Content-Length` or `Date`, and without
/// trailers that HTTP/2 refuses (`proxy-connection`: a reset stream on every replay) or that
/// HTTP/1.1 drops (`content-type`). A hook that copied a
/// processor's response headers stored and replayed them verbatim, and a stale
/// `Content-Length` framed every replay wrongly.
#[test]
fn a_reconciled_answer_keeps_no_framing_or_hop_by_hop_headers() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        let policy = OutcomeUnknown::reconcile(|_| async {
            Ok(Some(
                Outcome::new(201)
                    .with_header("content-length", "999")
                    .with_header("transfer-encoding", "chunked")
                    .with_header("connection", "x-hop")
                    .with_header("x-hop", "1")
                    .with_header("date", "Tue, 01 Dec 2026 00:00:00 GMT")
                    .with_header("x-kept", "yes")
                    .with_body("x")
                    .with_trailer("proxy-connection", "close")
                    .with_trailer("content-type", "text/plain")
                    .with_trailer("grpc-status", "0"),
            ))
        });
        let (router, calls, _) = app(layer(store.clone()).on_outcome_unknown(policy));
        let (key, _) = crashed_attempt(&*store).await;
        for attempt in ["found", "replayed"] {
            let answer = send(&router, "POST", Some(&key), &[], "{}").await;
            assert_eq!(answer.status, 201, "{attempt}: {}", answer.body);
            assert_eq!(answer.body, "x");
            assert_eq!(answer.headers["x-kept"], "yes", "{attempt}");
            assert!(
                answer
                    .headers
                    .get("content-length")
                    .is_none_or(|length| length == "1"),
                "{attempt}: the body's own length, not the stored one: {:?}",
                answer.headers
            );
            let trailers = answer
                .trailers
                .keys()
                .map(|n| n.as_str())
                .collect::<Vec<_>>();
            assert_eq!(
                trailers,
                ["grpc-status"],
                "{attempt}: trailers HTTP/2 refuses, or that HTTP/1.1 drops, kept"
            );
            for dropped in ["transfer-encoding", "connection", "x-hop", "date"] {
                assert!(
                    answer.headers.get(dropped).is_none(),
                    "{attempt}: {dropped} kept: {:?}",
                    answer.headers
                );
            }
        }
        assert_eq!(calls.get(), 0);
    });
}

/// The hook's answer is stored only if the policy stores its status: one it does not store
/// (here a 502, a 409 or a 422 under a stricter rule) is answered and the key stays
/// unresolved, so the next retry asks the hook again. It was stored whatever its status,
/// and a refusal a retry could have got past was replayed for the whole retention.
#[test]
fn a_reconciled_answer_the_policy_does_not_store_is_not_stored() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = asked.clone();
        let policy = OutcomeUnknown::reconcile(move |_| {
            let count = count.clone();
            async move {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(Some(Outcome::new(502).with_body("the processor is down")))
            }
        });
        let (router, calls, _) = app(layer(store.clone()).on_outcome_unknown(policy));
        let (key, _) = crashed_attempt(&*store).await;
        for _ in 0..2 {
            let answer = send(&router, "POST", Some(&key), &[], "{}").await;
            assert_eq!(answer.status, 502, "{}", answer.body);
            assert_eq!(answer.body, "the processor is down");
        }
        assert_eq!(
            asked.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "not stored: the retry asked the hook again"
        );
        assert_eq!(calls.get(), 0);
    });
}

/// Nor a `1xx` a hook answers, whatever the policy says, nor a gRPC failure in its fields
/// (HTTP 200 with `grpc-status: 14`), both judged as a handler's response would be: here
/// under a policy that stores every status below 500. They were stored, and every retry was
/// replayed a `101` that upgrades nothing, or an `UNAVAILABLE` for the whole retention.
#[test]
fn a_reconciled_1xx_or_grpc_failure_is_never_stored() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        let found = [
            Outcome::new(101),
            Outcome::new(200)
                .with_header("content-type", "application/grpc")
                .with_header("grpc-status", "14"),
        ];
        for outcome in found {
            let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let (count, answer) = (asked.clone(), outcome.clone());
            let hook = OutcomeUnknown::reconcile(move |_| {
                let (count, answer) = (count.clone(), answer.clone());
                async move {
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Ok(Some(answer))
                }
            });
            let storing = idempotency_core::Policy::default().with_cacheable(|status| status < 500);
            let (router, calls, _) = app(layer(store.clone())
                .policy(storing)
                .on_outcome_unknown(hook));
            let (key, _) = crashed_attempt(&*store).await;
            for _ in 0..2 {
                let answer = send(&router, "POST", Some(&key), &[], "{}").await;
                assert_eq!(answer.status, outcome.status, "{}", answer.body);
            }
            assert_eq!(
                asked.load(std::sync::atomic::Ordering::SeqCst),
                2,
                "{outcome:?} not stored: the retry asked the hook again"
            );
            assert_eq!(calls.get(), 0);
        }
    });
}

#[test]
fn a_failing_reconcile_hook_answers_503_and_runs_nothing() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        let policy = OutcomeUnknown::reconcile(|_| async { Err("the ledger is down".into()) });
        let (router, calls, _) = app(layer(store.clone()).on_outcome_unknown(policy));
        let (key, id) = crashed_attempt(&*store).await;
        let answer = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(answer.status, 503, "{}", answer.body);
        assert!(answer.headers.get("retry-after").is_some());
        assert_eq!(calls.get(), 0);
        // Not released: the key stays unresolved (in flight under this attempt's lease),
        // so no retry can slip through as a fresh `Execute`.
        let held = store.inspect(&id).await.expect("inspect").expect("kept");
        assert!(matches!(
            held.state,
            idempotency_core::RecordState::InFlight { .. }
        ));
        let retry = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(retry.status, 409, "{}", retry.body);
        assert_eq!(calls.get(), 0);
    });
}

/// `drain` (shutdown) waits for a reconcile that is still settling its key, even once the
/// request that started it is gone: exiting then would cut the outcome's write short, and the
/// key would be asked the question again after a whole lease.
#[test]
fn drain_waits_for_a_reconcile_whose_request_is_gone() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let wait = Arc::new(std::sync::Mutex::new(Some(wait)));
        let policy = OutcomeUnknown::reconcile(move |_| {
            let wait = wait.lock().expect("lock").take();
            async move {
                if let Some(wait) = wait {
                    let _ = wait.await;
                }
                Ok(Some(Outcome::new(201).with_body("found")))
            }
        });
        let layer = layer(store.clone()).on_outcome_unknown(policy);
        let (router, calls, _) = app(layer.clone());
        let (key, id) = crashed_attempt(&*store).await;
        let hung_up = tokio::time::timeout(
            Duration::from_millis(100),
            send(&router, "POST", Some(&key), &[], "{}"),
        )
        .await;
        assert!(hung_up.is_err(), "the hook was still looking");

        let mut drain = std::pin::pin!(layer.drain());
        let early = tokio::time::timeout(Duration::from_millis(200), &mut drain).await;
        assert!(
            early.is_err(),
            "drain returned while a reconcile was settling its key"
        );
        go.send(()).expect("the hook waits");
        tokio::time::timeout(Duration::from_secs(5), drain)
            .await
            .expect("drain ends once the reconcile has");
        let settled = store.inspect(&id).await.expect("inspect").expect("kept");
        assert!(settled.is_completed(), "{settled:?}");
        assert_eq!(calls.get(), 0);
    });
}

/// A request dropped (a hang-up, an outer timeout) while its reconcile hook looks, or as the
/// hook answers, when the hook found nothing, ends the lease it took over instead of renewing
/// it for nobody: the retry asks the hook again and runs at once. The lease was renewed and
/// held, and every retry answered 409 for a whole lease.
#[tokio::test(start_paused = true)]
async fn a_reconcile_whose_request_is_gone_leaves_the_key_to_the_retry() {
    {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let policy = OutcomeUnknown::reconcile(|_| async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            Ok(None)
        });
        let layer = layer(store.clone()).on_outcome_unknown(policy);
        let (router, calls, _) = app(layer.clone());
        for (run, answered) in [(1, false), (2, true)] {
            let (key, _) = crashed_attempt(&*store).await;
            let mut first = charge(&router, &key);
            assert!(futures::poll!(&mut first).is_pending(), "the hook looks");
            if answered {
                // Its verdict is sent, and never read.
                tokio::time::sleep(Duration::from_millis(600)).await;
            }
            drop(first);
            layer.drain().await; // the hook's task, to its end
            let retry = send(&router, "POST", Some(&key), &[], "{}").await;
            assert_eq!(retry.status, 201, "{}", retry.body);
            assert_eq!(calls.get(), run);
        }
    }
}

/// A reconcile verdict read too late to act on (the request was held without a poll for over
/// half a lease) runs nothing, and ends the lease renewed for it rather than leave it held
/// for nobody: the retry asks the hook again at once instead of answering 409.
#[tokio::test(start_paused = true)]
async fn a_reconcile_verdict_read_too_late_ends_its_lease() {
    let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
    let lease = Duration::from_secs(3);
    let policy = OutcomeUnknown::reconcile(|_| async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok(None)
    });
    let layer = layer(store.clone())
        .policy(Policy::default().with_lease(lease))
        .on_outcome_unknown(policy);
    let (router, calls, _) = app(layer.clone());
    let (key, _) = crashed_attempt(&*store).await;
    let mut first = charge(&router, &key);
    assert!(futures::poll!(&mut first).is_pending(), "the hook looks");
    // The hook answers, and the request is not polled for most of the lease it renewed.
    tokio::time::sleep(lease * 2 / 3).await;
    let first = first.await.expect("infallible");
    assert_eq!(first.status(), 503);
    layer.drain().await; // the lease's end
    let retry = send(&router, "POST", Some(&key), &[], "{}").await;
    assert_eq!(retry.status, 201, "{}", retry.body);
    assert_eq!(calls.get(), 1);
}

/// A request held without being polled after its reconcile hook found nothing must not run
/// the operation on a lease that ran out meanwhile: another retry may have taken the key
/// over, asked the hook (which found nothing, the first having run nothing yet) and run it.
/// Read too late, the hook's verdict is given up like a late grant: 503, nothing runs.
#[test]
fn a_reconcile_verdict_read_after_its_lease_ran_out_runs_nothing() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let lease = Duration::from_millis(300);
        let policy = OutcomeUnknown::reconcile(|_| async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(None)
        });
        let (router, calls, _) = app(layer(store.clone())
            .policy(Policy::default().with_lease(lease))
            .on_outcome_unknown(policy));
        let (key, _) = crashed_attempt(&*store).await;
        let mut first = charge(&router, &key);
        assert!(
            futures::poll!(&mut first).is_pending(),
            "the hook runs in a task"
        );
        // Held, not polled: the hook answers, its lease runs out, and a retry takes over.
        tokio::time::sleep(lease * 3).await;
        let retry = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert_eq!(calls.get(), 1);
        let first = first.await.expect("infallible");
        assert_eq!(first.status(), 503);
        assert_eq!(
            calls.get(),
            1,
            "the first request ran the operation a second time"
        );
    });
}

/// A handler that panics may have had its effect first (the card charged, then a bug): its
/// outcome is unknown, exactly what `Reject` and `Reconcile` are for. Under them the lease is
/// ended and its record kept, so the retry meets the policy; it was released, and the retry
/// ran the operation as a fresh `Execute`. (Under `Reexecute` a panic still releases.)
#[test]
fn a_panicked_handler_under_reject_leaves_the_outcome_unknown() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let (router, calls, _) =
            app(layer(store.clone()).on_outcome_unknown(OutcomeUnknown::Reject));
        let panicked = send(&router, "POST", Some("k"), &[("x-panic", "1")], "{}").await;
        assert_eq!(panicked.status, 500);
        let retry = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(retry.status, 409, "{}", retry.body);
        assert_eq!(
            retry.problem_type(),
            "urn:idempotency:problem:outcome-unknown"
        );
        assert_eq!(calls.get(), 0, "the retry did not run the operation");
    });
}

/// Under `Reexecute` a retry runs again, but a run that took over an attempt whose outcome is
/// unknown and then panics must still keep that attempt's record (end the lease), as a
/// plain failure after a takeover does, and as the executor does: it was released, the
/// attempt was forgotten, and a gateway under `Reject` on the same store ran the operation
/// as a fresh `Execute`.
#[test]
fn a_panic_after_a_takeover_under_reexecute_keeps_the_record() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let (rejecting, calls, _) =
            app(layer(store.clone()).on_outcome_unknown(OutcomeUnknown::Reject));
        let (reexecuting, _, _) =
            app(layer(store.clone()).on_outcome_unknown(OutcomeUnknown::Reexecute));
        let crashed = send(&rejecting, "POST", Some("k"), &[("x-panic", "1")], "{}").await;
        assert_eq!(crashed.status, 500);
        let again = send(&reexecuting, "POST", Some("k"), &[("x-panic", "1")], "{}").await;
        assert_eq!(again.status, 500);
        let retry = send(&rejecting, "POST", Some("k"), &[], "{}").await;
        assert_eq!(retry.status, 409, "{}", retry.body);
        assert_eq!(
            retry.problem_type(),
            "urn:idempotency:problem:outcome-unknown"
        );
        assert_eq!(calls.get(), 0, "the retry did not run the operation");
    });
}

/// A `101 Switching Protocols` (a `POST` that starts an exec session, Docker's pattern) says
/// the handler accepted the request and ran: its outcome is an upgraded connection, which no
/// store can replay. It is kept for the outcome-unknown policy, as a panic is; it was
/// released as a failure, and under `Reject` the retry started the session again.
#[test]
fn an_upgrade_under_reject_leaves_the_outcome_unknown() {
    block_on(async {
        // Also under a policy that would store every status below 500: a replayed `101`
        // would upgrade nothing.
        let storing = idempotency_core::Policy::default().with_cacheable(|status| status < 500);
        for (n, policy) in [idempotency_core::Policy::default(), storing]
            .into_iter()
            .enumerate()
        {
            let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
            let (router, calls, _) = app(layer(store.clone())
                .policy(policy)
                .on_outcome_unknown(OutcomeUnknown::Reject));
            let upgraded = send(&router, "POST", Some("k"), &[("x-fail", "101")], "{}").await;
            assert_eq!(upgraded.status, 101);
            let retry = send(&router, "POST", Some("k"), &[("x-fail", "101")], "{}").await;
            assert_eq!(retry.status, 409, "policy {n}: {}", retry.body);
            assert_eq!(
                retry.problem_type(),
                "urn:idempotency:problem:outcome-unknown"
            );
            assert_eq!(calls.get(), 1, "the retry did not run the operation");
        }
    });
}

/// An inner service's error is most often a refusal before anything ran (load shed, a closed
/// buffer): the key is released and the retry runs, even under `Reject` (kept as
/// outcome-unknown, one such blip would lock the key for its retention).
#[test]
fn a_service_error_under_reject_lets_the_retry_run() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tower::{Layer, ServiceExt};

    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let inner = tower::service_fn(move |_: axum::http::Request<idempotency_tower::Body>| {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    return Err(std::io::Error::other("overloaded: shed before running"));
                }
                Ok(axum::http::Response::builder()
                    .status(201)
                    .body(axum::body::Body::from("charged"))
                    .expect("response"))
            }
        });
        let service = layer(store)
            .on_outcome_unknown(OutcomeUnknown::Reject)
            .layer(inner);
        let request = || {
            axum::http::Request::post("/charges")
                .header("idempotency-key", "k")
                .body(axum::body::Body::from("{}"))
                .expect("request")
        };
        let shed = service.clone().oneshot(request()).await;
        assert!(shed.is_err(), "the service's error reaches the caller");
        let retry = service.oneshot(request()).await.expect("answered");
        assert_eq!(retry.status(), 201);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    });
}

/// A store whose release panics is taken for a failed call, as every other store call of the
/// layer is: the handler's own answer goes out (not a 500), and the release is retried until
/// it lands. Unwound, the lease was left to run out, and under `Reject` the retry of a
/// request its handler said was not applied met a stored 409 outcome-unknown.
#[test]
fn a_release_that_panics_is_retried_and_the_handlers_answer_kept() {
    use std::sync::atomic::Ordering;

    block_on(async {
        let store = Arc::new(crate::support::Rigged::default());
        let layer = layer(store.clone())
            .policy(Policy::default().with_lease(Duration::from_millis(600)))
            .on_outcome_unknown(OutcomeUnknown::Reject);
        let (router, calls, _) = app(layer.clone());
        store.panic_next_give_back.store(true, Ordering::SeqCst);
        let failed = send(&router, "POST", Some("k"), &[("x-fail", "503")], "{}").await;
        assert_eq!(failed.status, 503, "{}", failed.body);
        layer.drain().await;
        tokio::time::sleep(Duration::from_millis(700)).await; // past the lease
        let retry = send(&router, "POST", Some("k"), &[], "{}").await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert_eq!(calls.get(), 2, "the retry ran");
    });
}

/// A retry that took over a crashed attempt's key and whose handler answers a failure that
/// is not stored ends its lease and keeps the record, as the executor does: the next retry
/// is taken over too, and the reconcile hook is asked again (the crashed attempt's effect may
/// be visible by then). Released, the next retry was a fresh `Execute` that skipped the hook
/// and charged a second time.
#[test]
fn a_run_that_took_over_and_is_not_stored_leaves_the_key_to_the_policy() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let (key, _) = crashed_attempt(&*store).await;
        let asked = Arc::new(AtomicUsize::new(0));
        let counted = asked.clone();
        let policy = OutcomeUnknown::reconcile(move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok(None) }
        });
        let (router, calls, _) = app(layer(store).on_outcome_unknown(policy));
        let failed = send(&router, "POST", Some(&key), &[("x-fail", "503")], "{}").await;
        assert_eq!(failed.status, 503, "{}", failed.body);
        let retry = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert_eq!(asked.load(Ordering::SeqCst), 2, "the hook was asked again");
        assert_eq!(calls.get(), 2);
    });
}

/// A failure the handler marks `MaybeApplied` (a processor that timed out after it may have
/// charged) is not given back under `Reject`: the retry meets an attempt whose outcome is
/// unknown (409), not a fresh run. Unmarked, or under `Reexecute`, the retry runs.
#[test]
fn a_failure_that_may_have_taken_effect_is_an_unknown_outcome() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        let maybe = [("x-fail", "504"), ("x-maybe-applied", "1")];
        for (policy, marked, retried) in [
            (OutcomeUnknown::Reject, true, 409),
            (OutcomeUnknown::Reject, false, 201),
            (OutcomeUnknown::Reexecute, true, 201),
        ] {
            let (router, calls, _) = app(layer(store.clone()).on_outcome_unknown(policy));
            let key = idempotency_test::unique("maybe");
            let headers = if marked { &maybe[..] } else { &maybe[..1] };
            let failed = send(&router, "POST", Some(&key), headers, "{}").await;
            assert_eq!(failed.status, 504, "{}", failed.body);
            let retry = send(&router, "POST", Some(&key), &[], "{}").await;
            assert_eq!(retry.status, retried, "marked {marked}: {}", retry.body);
            assert_eq!(calls.get(), if retried == 409 { 1 } else { 2 });
        }
    });
}

/// A key taken from its reconciling retry (here an operator releases the live lease while
/// the hook looks) answers that retry 409 with what is left of the layer's mean run time in
/// `Retry-After`, as every other in-flight answer does (a second without a sample), not the
/// whole lease (30 s).
#[test]
fn a_key_taken_while_reconciling_advertises_the_run_time_not_the_lease() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let policy = releasing_hook(&store, None);
        let (router, calls, _) = app(layer(store.clone()).on_outcome_unknown(policy));
        let (key, _) = crashed_attempt(&*store).await;
        let answer = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(answer.status, 409, "{}", answer.body);
        assert_eq!(answer.problem_type(), "urn:idempotency:problem:in-flight");
        assert_eq!(answer.headers["retry-after"], "1");
        assert_eq!(calls.get(), 0);
    });
}

/// An outcome a reconcile hook found that could not be stored (here an operator released the
/// key while the hook looked) promises no date: its retries are not replayed it. Before, it
/// carried `Idempotency-Expires` all the same.
#[test]
fn a_found_outcome_that_was_not_stored_advertises_no_expiry() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let found = Outcome::new(201).with_body(r#"{"id":"ch_found"}"#);
        let policy = releasing_hook(&store, Some(found));
        let (router, _, _) = app(layer(store.clone())
            .policy(Policy::default())
            .advertise_expiry(true)
            .on_outcome_unknown(policy));
        let (key, _) = crashed_attempt(&*store).await;
        let answer = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(answer.status, 201, "{}", answer.body);
        assert!(
            answer.headers.get("idempotency-expires").is_none(),
            "a date for an outcome not stored: {:?}",
            answer.headers
        );
    });
}

/// With `advertise_expiry`, every stored response and its replays say until when the key is
/// kept: an outcome a reconcile hook found is a stored response too. Before, it was stored,
/// and replayed, without the header.
#[test]
fn an_outcome_a_reconcile_hook_found_advertises_its_expiry() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        let (found, _) = crashed_attempt(&*store).await;
        let policy = OutcomeUnknown::reconcile(|_| async {
            Ok(Some(Outcome::new(201).with_body(r#"{"id":"ch_found"}"#)))
        });
        let (router, calls, _) = app(layer(store.clone())
            .policy(Policy::default())
            .advertise_expiry(true)
            .on_outcome_unknown(policy));
        let first = send(&router, "POST", Some(&found), &[], "{}").await;
        let replay = send(&router, "POST", Some(&found), &[], "{}").await;
        assert_eq!((first.status, replay.status), (201, 201), "{}", first.body);
        let expires = first.headers.get("idempotency-expires");
        assert!(expires.is_some(), "the hook's outcome: {:?}", first.headers);
        assert_eq!(replay.headers.get("idempotency-expires"), expires);
        assert_eq!(calls.get(), 0);
    });
}

/// `PUT`, `DELETE` or `GET` on the admin routes for `key` (global scope: the layer's default
/// is "anonymous" here), with `body`.
async fn operator(store: &Arc<dyn Store>, method: &str, key: &str, body: &str) -> crate::Answer {
    let routes = idempotency_tower::admin_router(store.clone());
    operator_on(routes, method, key, body).await
}

/// An operator's call to `routes` about `key` in the `anonymous` scope.
async fn operator_on(routes: axum::Router, method: &str, key: &str, body: &str) -> crate::Answer {
    use tower::ServiceExt;

    let request = axum::http::Request::builder()
        .method(method)
        .uri(format!("/idempotency/scopes/anonymous/keys/{key}"))
        .body(axum::body::Body::from(body.to_owned()))
        .expect("request");
    let response = routes.oneshot(request).await.expect("infallible");
    crate::answer(response).await
}

/// The operator reconciled an attempt whose outcome is unknown and found its effect: the
/// response they `PUT` is the key's outcome, and its retries replay it without running the
/// operation. Before, a `Reject` verdict was stored as the key's outcome, and the operator's
/// only way on (deleting it) ran the operation again: a second charge.
#[test]
fn an_operator_resolves_an_unknown_outcome_and_its_retries_replay_it() {
    block_on(async {
        let Some(pg) = postgres().await else {
            return;
        };
        let memory: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let redis = crate::redis_store().await.expect("redis");
        let hybrid = crate::hybrid_store().await.expect("hybrid");
        for store in [memory, pg, redis, hybrid] {
            resolved_and_replayed(store).await;
        }
    });
}

/// [`an_operator_resolves_an_unknown_outcome_and_its_retries_replay_it`] on `store`.
async fn resolved_and_replayed(store: Arc<dyn Store>) {
    let (router, calls, _) = app(layer(store.clone()).on_outcome_unknown(OutcomeUnknown::Reject));
    let (key, id) = crashed_attempt(&*store).await;
    let told = send(&router, "POST", Some(&key), &[], "{}").await;
    assert_eq!(told.status, 409, "{}", told.body);

    let found = r#"{"status": 201, "headers": {"Content-Type": "application/json"},
                    "body": "{\"id\":\"ch_found\"}", "retention_seconds": 3600}"#;
    let resolved = operator(&store, "PUT", &key, found).await;
    assert_eq!(resolved.status, 204, "{}", resolved.body);
    for _ in 0..2 {
        let retry = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert_eq!(retry.body, r#"{"id":"ch_found"}"#);
        assert_eq!(retry.headers["content-type"], "application/json");
        assert_eq!(retry.headers["idempotent-replayed"], "true");
    }
    assert_eq!(calls.get(), 0, "the operation never ran again");
    let kept = store.inspect(&id).await.expect("inspect").expect("kept");
    assert_eq!(
        kept.state,
        idempotency_core::RecordState::Completed { status: 201 }
    );
    // Resolved once: a second resolution is refused.
    let again = operator(&store, "PUT", &key, found).await;
    assert_eq!(again.status, 409, "{}", again.body);
    assert_eq!(
        again.problem_type(),
        "urn:idempotency:problem:record-completed"
    );
}

/// The attempt's record released and the key claimed by another request (another body)
/// between the resolution's read and its takeover, or (the resolution's own lease released)
/// completed by that request while the resolution's completion was on its way: nothing of the
/// resolution is stored, and the answer says that another request holds the key
/// (`record-replaced`). Before, it said the record was completed and its outcome replayed
/// already: about a key whose record was in flight, and about one whose retries get 422.
#[test]
fn a_resolution_that_finds_another_requests_record_says_so() {
    block_on(async {
        for before_complete in [false, true] {
            let rigged = Arc::new(crate::support::Rigged::default());
            let store: Arc<dyn Store> = rigged.clone();
            let (key, id) = crashed_attempt(&*store).await;
            let another = Fingerprint::of(b"another request");
            let armed = if before_complete {
                &rigged.replace_before_complete
            } else {
                &rigged.replace_after_inspect
            };
            *armed.lock().expect("lock") = Some(another);
            let found = r#"{"status": 201, "body": "{\"id\":\"ch_found\"}"}"#;
            let resolved = operator(&store, "PUT", &key, found).await;
            assert_eq!(resolved.status, 409, "{}", resolved.body);
            assert_eq!(
                resolved.problem_type(),
                "urn:idempotency:problem:record-replaced",
                "{}",
                resolved.body
            );
            let kept = store.inspect(&id).await.expect("inspect").expect("kept");
            assert_eq!(
                kept.fingerprint, another,
                "the other request's record stays"
            );
            let theirs = if before_complete {
                matches!(
                    kept.state,
                    idempotency_core::RecordState::Completed { status: 202 }
                )
            } else {
                matches!(kept.state, idempotency_core::RecordState::InFlight { .. })
            };
            assert!(theirs, "nothing of the resolution was stored: {kept:?}");
        }
    });
}

/// The attempt's record released by another operator (a `DELETE`: no effect found, the key
/// runs again) between the resolution's read and its takeover: nothing is stored, and the
/// answer is the `404` the resolution would get after that release. Before, the resolution
/// claimed the free key and stored its outcome (`204`): both operators were told they had
/// succeeded, and the key's retries replayed an outcome for an operation the other operator
/// had found never took effect, which no order of the two gives.
#[test]
fn a_resolution_that_finds_the_record_released_since_stores_nothing() {
    block_on(async {
        let rigged = Arc::new(crate::support::Rigged::default());
        let store: Arc<dyn Store> = rigged.clone();
        let (key, id) = crashed_attempt(&*store).await;
        rigged
            .release_after_inspect
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let found = r#"{"status": 201, "body": "{\"id\":\"ch_found\"}"}"#;
        let resolved = operator(&store, "PUT", &key, found).await;
        assert_eq!(resolved.status, 404, "{}", resolved.body);
        let left = store.inspect(&id).await.expect("inspect");
        assert!(left.is_none(), "stored after the release: {left:?}");
    });
}

/// The same, with the resolution's give-back of its claim failing (the store unavailable for
/// a moment): the operator hears `503`, and the claim goes back in a task the layer's drain
/// waits for, so that a shutdown right after does not leave it held and then read as an
/// unknown attempt (the other operator's release undone). Found by review.
#[test]
fn a_resolution_whose_give_back_failed_gives_it_back_before_the_drain_returns() {
    block_on(async {
        let rigged = Arc::new(crate::support::Rigged::default());
        let store: Arc<dyn Store> = rigged.clone();
        let layer = layer(store.clone());
        let (key, id) = crashed_attempt(&*store).await;
        rigged
            .release_after_inspect
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // The resolution's own try and the give-back's first.
        rigged
            .releases_unavailable
            .store(2, std::sync::atomic::Ordering::SeqCst);
        let found = r#"{"status": 201}"#;
        let resolved = operator_on(layer.admin_router(), "PUT", &key, found).await;
        assert_eq!(resolved.status, 503, "{}", resolved.body);
        layer.drain().await;
        let left = store.inspect(&id).await.expect("inspect");
        assert!(left.is_none(), "the claim was not given back: {left:?}");
    });
}

/// The resolution's own lease released by another operator (`DELETE ?live=true`) while its
/// completion was on its way: nothing is stored, and the answer is the `404` of a record
/// released, not the `409` "live lease, look again" it was, about a key with no record.
#[test]
fn a_resolution_whose_lease_an_operator_released_says_the_record_is_gone() {
    block_on(async {
        let rigged = Arc::new(crate::support::Rigged {
            complete_takes: Duration::from_secs(1),
            ..Default::default()
        });
        let store: Arc<dyn Store> = rigged.clone();
        let (key, id) = crashed_attempt(&*store).await;
        let resolving = {
            let store = store.clone();
            tokio::spawn(async move {
                let found = r#"{"status": 201}"#;
                operator(&store, "PUT", &key, found).await
            })
        };
        // Whether this lands before the resolution's takeover or during its completion, the
        // record is gone when it answers.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let scope = ReleaseScope::default().with_live();
        rigged
            .inner
            .force_release(&id, scope)
            .await
            .expect("release");
        let resolved = resolving.await.expect("task");
        assert_eq!(resolved.status, 404, "{}", resolved.body);
        let left = store.inspect(&id).await.expect("inspect");
        assert!(left.is_none(), "stored after the release: {left:?}");
    });
}

/// An operator who hangs up while the resolution's completion is on its way (an interrupted
/// `curl`: the request's future dropped) does not leave it half done: the outcome is stored.
/// Before, the resolution was dropped with the request after its takeover: the key was held
/// by the resolving lease (30 s), then read as an attempt whose outcome is unknown again.
#[test]
fn a_resolution_whose_operator_hung_up_still_stores_its_outcome() {
    block_on(async {
        let rigged = Arc::new(crate::support::Rigged {
            complete_takes: Duration::from_millis(500),
            ..Default::default()
        });
        let store: Arc<dyn Store> = rigged.clone();
        let (key, id) = crashed_attempt(&*store).await;
        let resolving = {
            let store = store.clone();
            tokio::spawn(async move { operator(&store, "PUT", &key, r#"{"status": 201}"#).await })
        };
        // Past the takeover (the memory store answers at once), within the completion.
        tokio::time::sleep(Duration::from_millis(200)).await;
        resolving.abort();
        assert!(resolving.await.is_err_and(|e| e.is_cancelled()));
        let completed = |kept: &Option<idempotency_core::Inspection>| {
            matches!(
                kept.as_ref().map(|record| record.state),
                Some(idempotency_core::RecordState::Completed { status: 201 })
            )
        };
        let mut kept = None;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            kept = store.inspect(&id).await.expect("inspect");
            if completed(&kept) {
                break;
            }
        }
        assert!(
            completed(&kept),
            "the resolution was left half done: {kept:?}"
        );
    });
}

/// Through the routes of a layer that advertises expiry, a resolved outcome carries
/// `Idempotency-Expires` as the layer's own do (for a retention of millions of years too: it is
/// kept for good, a century, as every store keeps it, and dated so).
#[test]
fn an_outcome_resolved_through_a_layer_that_advertises_expiry_carries_it() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let layer = layer(store.clone()).advertise_expiry(true);
        let (router, calls, _) = app(layer.clone());
        for body in [
            r#"{"status": 201}"#,
            r#"{"status": 201, "retention_seconds": 1000000000000000}"#,
        ] {
            let (key, _) = crashed_attempt(&*store).await;
            let resolved = operator_on(layer.admin_router(), "PUT", &key, body).await;
            assert_eq!(resolved.status, 204, "{body}: {}", resolved.body);
            let retry = send(&router, "POST", Some(&key), &[], "{}").await;
            assert_eq!(retry.status, 201, "{}", retry.body);
            assert!(
                retry.headers.contains_key("idempotency-expires"),
                "{body}: {:?}",
                retry.headers
            );
        }
        assert_eq!(calls.get(), 0, "the operation never ran again");
    });
}

/// An outcome resolved through the layer's own admin routes, without a `retention_seconds`,
/// is kept for the layer's retention (here a week), as the layer keeps what it stores: a
/// retry on the second day replays it. From `admin_router(store)`, which does not know the
/// layer, it was kept a day, and such a retry ran the operation again.
#[test]
fn an_outcome_resolved_through_the_layers_routes_is_kept_for_the_layers_retention() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let week = Duration::from_secs(7 * 86_400);
        let layer = layer(store.clone()).policy(Policy::default().with_retention(week));
        let (key, id) = crashed_attempt(&*store).await;
        let resolved = operator_on(layer.admin_router(), "PUT", &key, r#"{"status": 201}"#).await;
        assert_eq!(resolved.status, 204, "{}", resolved.body);
        let kept = store.inspect(&id).await.expect("inspect").expect("kept");
        let two_days = std::time::SystemTime::now() + Duration::from_secs(2 * 86_400);
        assert!(
            kept.expires_at > two_days,
            "kept until {:?}, not the layer's week",
            kept.expires_at
        );
    });
}

/// A stored outcome with more header fields than a response holds (24,576: stored by an
/// operator's `PUT` before it was bounded, or a reconcile hook's answer) replays with those
/// that fit. Before, the replay panicked, on every retry of the key for its retention.
#[test]
fn an_outcome_with_more_fields_than_a_response_holds_still_replays() {
    block_on(async {
        let store: Arc<dyn Store> = Arc::new(idempotency_core::MemoryStore::new());
        let (router, calls, _) = app(layer(store.clone()));
        let (key, id) = crashed_attempt(&*store).await;
        let fp = store.inspect(&id).await.expect("inspect").expect("kept");
        let taken = store
            .begin(&id, &fp.fingerprint, Duration::from_secs(30))
            .await
            .expect("begin");
        let Begin::TakeOver(token) = taken else {
            panic!("{taken:?}");
        };
        let outcome = (0..25_000).fold(Outcome::new(201).with_body("charged"), |o, i| {
            o.with_header(format!("x-h{i}"), "v")
        });
        store
            .complete(&id, token, &outcome, Duration::from_secs(3600))
            .await
            .expect("complete");
        let retry = send(&router, "POST", Some(&key), &[], "{}").await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert_eq!(retry.body, "charged");
        assert_eq!(retry.headers["x-h0"], "v");
        assert_eq!(calls.get(), 0, "the operation never ran again");
    });
}

/// What the resolving `PUT` refuses, each with a problem that says why, storing nothing: a
/// body it cannot read, a record that is not an attempt whose outcome is unknown.
#[test]
fn an_operators_resolution_is_refused_unless_it_names_an_outcome_for_an_unknown_attempt() {
    block_on(async {
        let Some(store) = postgres().await else {
            return;
        };
        let (key, id) = crashed_attempt(&*store).await;
        let fields: Vec<String> = (0..101).map(|i| format!(r#""x-h{i}": "v""#)).collect();
        let many_headers = format!(r#"{{"status": 201, "headers": {{{}}}}}"#, fields.join(", "));
        for (body, why) in [
            ("not json", "not JSON"),
            ("[]", "an array"),
            (r#"{"status": 99}"#, "a status below 200"),
            (r#"{"status": 600}"#, "a status above 599"),
            (r#"{"body": "x"}"#, "no status"),
            (r#"{"status": 201, "colour": "red"}"#, "an unknown field"),
            (
                r#"{"status": 201, "headers": {"content-length": "3"}}"#,
                "a framing header",
            ),
            (
                r#"{"status": 201, "headers": {"bad name": "x"}}"#,
                "a malformed name",
            ),
            (
                r#"{"status": 201, "headers": {"x-n": 1}}"#,
                "a value not a string",
            ),
            (r#"{"status": 201, "body": 5}"#, "a body not a string"),
            (r#"{"status": 201, "retention_seconds": 0}"#, "no retention"),
            (
                r#"{"status": 201, "headers": {"Content-Type": "a/b", "content-type": "c/d"}}"#,
                "a header twice",
            ),
            (
                r#"{"status": 201, "headers": {"content-encoding": "gzip"}}"#,
                "an encoding for a text body",
            ),
            (
                r#"{"status": 201, "headers": {"Idempotency-Outcome-Not-Stored": "1"}}"#,
                "the layer's marker of an outcome not stored",
            ),
            (
                r#"{"status": 201, "headers": {"Idempotency-Expires": "Fri, 01 Jan 2100 00:00:00 GMT"}}"#,
                "an expiry date the store does not keep to",
            ),
            (&many_headers, "more headers than a client reads"),
        ] {
            let refused = operator(&store, "PUT", &key, body).await;
            assert_eq!(refused.status, 400, "{why}: {}", refused.body);
            assert_eq!(
                refused.problem_type(),
                "urn:idempotency:problem:invalid-request",
                "{why}"
            );
        }
        let still = store.inspect(&id).await.expect("inspect").expect("kept");
        assert!(
            matches!(still.state, idempotency_core::RecordState::InFlight { .. }),
            "nothing stored: {still:?}"
        );

        let outcome = r#"{"status": 201}"#;
        let none = operator(&store, "PUT", &idempotency_test::unique("never"), outcome).await;
        assert_eq!(none.status, 404, "{}", none.body);
        // A live lease: its holder may be running the operation.
        let live = idempotency_test::unique("live");
        let live_id = RecordId::new(
            &Scope::new("anonymous"),
            &IdempotencyKey::new(live.clone()).expect("key"),
        );
        let fp = Fingerprint::of(b"live");
        let claimed = store.begin(&live_id, &fp, Duration::from_secs(30)).await;
        assert!(matches!(claimed, Ok(Begin::Execute(_))), "{claimed:?}");
        let held = operator(&store, "PUT", &live, outcome).await;
        assert_eq!(held.status, 409, "{}", held.body);
        assert_eq!(held.problem_type(), "urn:idempotency:problem:lease-live");
    });
}
