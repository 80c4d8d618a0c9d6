//! The store conformance suite: the state machine of DESIGN.md, written once and run against
//! every store with [`conformance_tests!`](crate::conformance_tests).
//!
//! Every case draws fresh random keys, so the cases share one store (one container) and run in
//! parallel. Time-dependent cases use leases of a few hundred milliseconds.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use idempotency_core::{
    Begin, Error, Fingerprint, IdempotencyKey, LeaseToken, Outcome, RecordId, Scope, Store,
};

/// A lease long enough never to expire during a case.
pub const LONG: Duration = Duration::from_secs(60);
/// A lease or retention that expires within a case.
pub const SHORT: Duration = Duration::from_millis(300);
/// Long enough for a [`SHORT`] duration to have passed on the store's clock.
pub const PAST_SHORT: Duration = Duration::from_millis(700);

/// A fresh record id in a random scope.
pub fn fresh_id() -> RecordId {
    RecordId::new(
        &Scope::new(uuid::Uuid::new_v4().to_string()),
        &IdempotencyKey::new(uuid::Uuid::new_v4().to_string()).expect("a uuid is a valid key"),
    )
}

/// A fingerprint named by a short label.
pub fn fp(label: &str) -> Fingerprint {
    Fingerprint::builder()
        .method("POST")
        .path_and_query("/charges")
        .body(label.as_bytes())
        .finish()
}

/// Begins and expects `Execute`, returning the token.
pub async fn execute(
    store: &dyn Store,
    id: &RecordId,
    fp: &Fingerprint,
    lease: Duration,
) -> LeaseToken {
    match store.begin(id, fp, lease).await.expect("begin") {
        Begin::Execute(token) => token,
        other => panic!("expected Execute, got {other:?}"),
    }
}

fn sample_outcome() -> Outcome {
    Outcome::new(201)
        .with_header("content-type", "application/json")
        .with_header("location", "/charges/ch_1")
        .with_body(r#"{"id":"ch_1"}"#)
}

/// The first `begin` on a key executes.
pub async fn first_begin_executes(store: &dyn Store) {
    let id = fresh_id();
    execute(store, &id, &fp("a"), LONG).await;
}

/// A replay returns the exact outcome: binary body, repeated headers in order, 1 MiB.
pub async fn replay_returns_the_exact_outcome(store: &dyn Store) {
    let body: Vec<u8> = (0..(1usize << 20)).map(|i| (i * 7 % 256) as u8).collect();
    let outcome = Outcome::new(201)
        .with_header("set-cookie", "a=1")
        .with_header("x-binary", Bytes::from_static(b"\x00\x01\xfe\xff"))
        .with_header("set-cookie", "b=2")
        .with_body(body);
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), LONG).await;
    store
        .complete(&id, token, &outcome, LONG)
        .await
        .expect("complete");
    for _ in 0..2 {
        match store.begin(&id, &fp("a"), LONG).await.expect("begin") {
            Begin::Replay(replayed) => assert_eq!(replayed, outcome),
            other => panic!("expected Replay, got {other:?}"),
        }
    }
}

/// The same key with another fingerprint while in flight is a mismatch.
pub async fn mismatch_while_in_flight(store: &dyn Store) {
    let id = fresh_id();
    execute(store, &id, &fp("a"), LONG).await;
    assert_eq!(
        store.begin(&id, &fp("b"), LONG).await.expect("begin"),
        Begin::Mismatch
    );
}

/// The same key with another fingerprint after completion is a mismatch, and the stored
/// outcome is untouched.
pub async fn mismatch_after_completion(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), LONG).await;
    store
        .complete(&id, token, &sample_outcome(), LONG)
        .await
        .expect("complete");
    assert_eq!(
        store.begin(&id, &fp("b"), LONG).await.expect("begin"),
        Begin::Mismatch
    );
    assert_eq!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(sample_outcome())
    );
}

/// A live duplicate is told to retry within the remaining lease.
pub async fn live_duplicate_is_in_flight(store: &dyn Store) {
    let id = fresh_id();
    execute(store, &id, &fp("a"), LONG).await;
    match store.begin(&id, &fp("a"), LONG).await.expect("begin") {
        Begin::InFlight { retry_after } => {
            assert!(
                retry_after > Duration::ZERO && retry_after <= LONG,
                "{retry_after:?}"
            );
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
}

/// After `release` the next `begin` executes again, with a new token.
pub async fn release_lets_the_next_begin_execute(store: &dyn Store) {
    let id = fresh_id();
    let first = execute(store, &id, &fp("a"), LONG).await;
    store.release(&id, first).await.expect("release");
    let second = execute(store, &id, &fp("a"), LONG).await;
    assert_ne!(first, second);
}

/// An expired lease (a crashed worker) is taken over with a new token.
pub async fn expired_lease_is_taken_over(store: &dyn Store) {
    let id = fresh_id();
    let first = execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let second = execute(store, &id, &fp("a"), LONG).await;
    assert_ne!(first, second);
}

/// A stale token can neither complete, release nor renew, and changes nothing: the new
/// owner's outcome is intact afterwards.
pub async fn stale_token_changes_nothing(store: &dyn Store) {
    let id = fresh_id();
    let stale = execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let owner = execute(store, &id, &fp("a"), LONG).await;

    let other = Outcome::new(200).with_body("stale");
    assert!(matches!(
        store.complete(&id, stale, &other, LONG).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.release(&id, stale).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.renew(&id, stale, LONG).await,
        Err(Error::LeaseLost)
    ));
    // Still the new owner's in-flight record.
    assert!(matches!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::InFlight { .. }
    ));

    store
        .complete(&id, owner, &sample_outcome(), LONG)
        .await
        .expect("complete");
    assert!(matches!(
        store.complete(&id, stale, &other, LONG).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.release(&id, stale).await,
        Err(Error::LeaseLost)
    ));
    assert_eq!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(sample_outcome())
    );
}

/// A token whose lease expired cannot complete even when nobody took over: the next `begin`
/// may already be executing, and the store cannot tell.
pub async fn expired_token_cannot_complete(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert!(matches!(
        store.complete(&id, token, &sample_outcome(), LONG).await,
        Err(Error::LeaseLost)
    ));
    execute(store, &id, &fp("a"), LONG).await;
}

/// Completing twice, or releasing a completed record, fails and keeps the first outcome.
pub async fn completed_record_is_final(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), LONG).await;
    store
        .complete(&id, token, &sample_outcome(), LONG)
        .await
        .expect("complete");
    let other = Outcome::new(500);
    assert!(matches!(
        store.complete(&id, token, &other, LONG).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.release(&id, token).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.renew(&id, token, LONG).await,
        Err(Error::LeaseLost)
    ));
    assert_eq!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(sample_outcome())
    );
}

/// `renew` extends a lease past its original expiry.
pub async fn renew_extends_the_lease(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), SHORT).await;
    store.renew(&id, token, LONG).await.expect("renew");
    tokio::time::sleep(PAST_SHORT).await;
    assert!(matches!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::InFlight { .. }
    ));
    store
        .complete(&id, token, &sample_outcome(), LONG)
        .await
        .expect("complete after renew");
}

/// A completed record past its retention behaves as absent.
pub async fn retention_expiry_makes_the_record_absent(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), LONG).await;
    store
        .complete(&id, token, &sample_outcome(), SHORT)
        .await
        .expect("complete");
    tokio::time::sleep(PAST_SHORT).await;
    // Absent: even another fingerprint executes.
    execute(store, &id, &fp("b"), LONG).await;
}

/// Purging keeps live records (completed and in flight) and leaves expired ones absent.
pub async fn purge_removes_only_expired_records(store: &dyn Store) {
    let expired = fresh_id();
    let token = execute(store, &expired, &fp("a"), LONG).await;
    store
        .complete(&expired, token, &sample_outcome(), SHORT)
        .await
        .expect("complete");
    let expired_lease = fresh_id();
    execute(store, &expired_lease, &fp("a"), SHORT).await;
    let live = fresh_id();
    let token = execute(store, &live, &fp("a"), LONG).await;
    store
        .complete(&live, token, &sample_outcome(), LONG)
        .await
        .expect("complete");
    let in_flight = fresh_id();
    let in_flight_token = execute(store, &in_flight, &fp("a"), LONG).await;
    tokio::time::sleep(PAST_SHORT).await;

    // Drain: other cases share the store and leave expired records too.
    while store.purge_expired(1000).await.expect("purge") >= 1000 {}

    assert_eq!(
        store.begin(&live, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(sample_outcome())
    );
    assert!(matches!(
        store
            .begin(&in_flight, &fp("a"), LONG)
            .await
            .expect("begin"),
        Begin::InFlight { .. }
    ));
    store
        .complete(&in_flight, in_flight_token, &sample_outcome(), LONG)
        .await
        .expect("the in-flight owner still owns its record after a purge");
    execute(store, &expired, &fp("b"), LONG).await;
    execute(store, &expired_lease, &fp("b"), LONG).await;
}

/// The same key in two scopes names two records.
pub async fn scopes_are_isolated(store: &dyn Store) {
    let key = IdempotencyKey::new(uuid::Uuid::new_v4().to_string()).expect("key");
    let a = RecordId::new(
        &Scope::new(format!("tenant-a-{}", uuid::Uuid::new_v4())),
        &key,
    );
    let b = RecordId::new(
        &Scope::new(format!("tenant-b-{}", uuid::Uuid::new_v4())),
        &key,
    );
    let token = execute(store, &a, &fp("a"), LONG).await;
    store
        .complete(&a, token, &sample_outcome(), LONG)
        .await
        .expect("complete");
    // Tenant B neither sees A's outcome nor a mismatch: its own record is absent.
    let token_b = execute(store, &b, &fp("b"), LONG).await;
    assert!(matches!(
        store.complete(&a, token_b, &Outcome::new(200), LONG).await,
        Err(Error::LeaseLost)
    ));
}

/// 64 concurrent `begin`s on one key: exactly one `Execute`, every other `InFlight`.
pub async fn concurrent_begins_execute_once(store: Arc<dyn Store>) {
    concurrent_begins_execute_once_per_key(store, 1).await;
}

/// The same race on `keys` keys one after the other (each race on its own fresh key): what
/// the backend issues repeat at scale, where each `begin` may use another pooled connection.
pub async fn concurrent_begins_execute_once_per_key(store: Arc<dyn Store>, keys: usize) {
    for _ in 0..keys {
        let id = fresh_id();
        let attempts = (0..64).map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&id, &fp("a"), LONG).await })
        });
        let mut executes = 0;
        for result in futures::future::join_all(attempts).await {
            match result.expect("task").expect("begin") {
                Begin::Execute(_) => executes += 1,
                Begin::InFlight { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(executes, 1);
    }
}

/// Generates one `#[test]` per conformance case for a store.
///
/// `$store` is an async expression giving `Option<Arc<dyn Store>>` (`None` when the harness
/// was told to skip service-backed tests). Each test runs on the binary's shared runtime, so
/// the store's pooled connections and containers outlive single tests.
///
/// ```text
/// idempotency_test::conformance_tests!(async {
///     Some(std::sync::Arc::new(idempotency_core::MemoryStore::new()) as std::sync::Arc<dyn idempotency_core::Store>)
/// });
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($store:expr) => {
        $crate::conformance_tests!(@cases $store;
            first_begin_executes,
            replay_returns_the_exact_outcome,
            mismatch_while_in_flight,
            mismatch_after_completion,
            live_duplicate_is_in_flight,
            release_lets_the_next_begin_execute,
            expired_lease_is_taken_over,
            stale_token_changes_nothing,
            expired_token_cannot_complete,
            completed_record_is_final,
            renew_extends_the_lease,
            retention_expiry_makes_the_record_absent,
            purge_removes_only_expired_records,
            scopes_are_isolated,
        );
        #[test]
        fn concurrent_begins_execute_once() {
            $crate::block_on(async {
                let store: Option<std::sync::Arc<dyn $crate::Store>> = $store.await;
                if let Some(store) = store {
                    $crate::conformance::concurrent_begins_execute_once(store).await;
                }
            });
        }
    };
    (@cases $store:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::block_on(async {
                    let store: Option<std::sync::Arc<dyn $crate::Store>> = $store.await;
                    if let Some(store) = store {
                        $crate::conformance::$case(&*store).await;
                    }
                });
            }
        )*
    };
}
