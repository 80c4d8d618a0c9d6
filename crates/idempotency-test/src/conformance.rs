//! The store conformance suite: the state machine of `docs/design.md`, written once and run against
//! every store with [`conformance_tests!`](crate::conformance_tests).
//!
//! Every case draws fresh random keys, so the cases share one store (one container) and run in
//! parallel. Time-dependent cases use leases of a few hundred milliseconds.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use idempotency_core::{
    Begin, Error, Fingerprint, ForceReleased, IdempotencyKey, LeaseToken, Outcome, RecordId,
    RecordState, ReleaseScope, Scope, Store,
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
    claim_expecting(store, id, fp, lease, false).await
}

/// An operator releases `id`'s completed record (it must be there), and a new request runs
/// and completes under the key: the outcome it stored, which the key must replay from then
/// on, whatever an earlier release that lands late does.
pub async fn released_and_run_again(store: &dyn Store, id: &RecordId) -> Outcome {
    let scope = ReleaseScope::default().with_completed();
    let again = store.force_release(id, scope).await.expect("release");
    assert_eq!(again, ForceReleased::Deleted);
    let token = execute(store, id, &fp("a"), LONG).await;
    let outcome = Outcome::new(201).with_body("second");
    store
        .complete(id, token, &outcome, LONG)
        .await
        .expect("complete");
    outcome
}

/// Begins on a key whose lease ran out unfinished and expects `TakeOver` (the earlier
/// attempt's outcome is unknown), returning the new token.
pub async fn take_over(
    store: &dyn Store,
    id: &RecordId,
    fp: &Fingerprint,
    lease: Duration,
) -> LeaseToken {
    claim_expecting(store, id, fp, lease, true).await
}

async fn claim_expecting(
    store: &dyn Store,
    id: &RecordId,
    fp: &Fingerprint,
    lease: Duration,
    takeover: bool,
) -> LeaseToken {
    match (store.begin(id, fp, lease).await.expect("begin"), takeover) {
        (Begin::Execute(token), false) | (Begin::TakeOver(token), true) => token,
        (other, _) => {
            let expected = if takeover { "TakeOver" } else { "Execute" };
            panic!("expected {expected}, got {other:?}")
        }
    }
}

pub use crate::{
    differential::answers_as_the_model_store, linearizable::concurrent_calls_are_linearizable,
};

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

/// A replay returns the exact outcome: binary body, repeated headers in order, 1 MiB,
/// trailers.
pub async fn replay_returns_the_exact_outcome(store: &dyn Store) {
    let body: Vec<u8> = (0..(1usize << 20)).map(|i| (i * 7 % 256) as u8).collect();
    let outcome = Outcome::new(201)
        .with_header("set-cookie", "a=1")
        .with_header("x-binary", Bytes::from_static(b"\x00\x01\xfe\xff"))
        .with_header("set-cookie", "b=2")
        .with_body(body)
        .with_trailer("grpc-status", "0")
        .with_trailer("x-binary", Bytes::from_static(b"\x00\xff"));
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

/// An expired lease (a crashed worker) is taken over with a new token, and the answer says
/// so (`TakeOver`: the crashed attempt's outcome is unknown). A key released, or completed
/// and past its retention, is a fresh start (`Execute`), and so is a takeover's own release.
pub async fn expired_lease_is_taken_over(store: &dyn Store) {
    let id = fresh_id();
    let first = execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let second = take_over(store, &id, &fp("a"), LONG).await;
    assert_ne!(first, second);
    store.release(&id, second).await.expect("release");
    execute(store, &id, &fp("a"), LONG).await;

    let done = fresh_id();
    let token = execute(store, &done, &fp("a"), LONG).await;
    store
        .complete(&done, token, &sample_outcome(), SHORT)
        .await
        .expect("complete");
    tokio::time::sleep(PAST_SHORT).await;
    execute(store, &done, &fp("a"), LONG).await;
}

/// A lease that ran out unfinished is taken over only by the same request: another request
/// under the key is a `Mismatch` (it must not inherit, or be answered with, the unknown
/// outcome of a different operation), and changes nothing.
pub async fn an_unfinished_lease_is_not_another_request_s(store: &dyn Store) {
    let id = fresh_id();
    execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        store.begin(&id, &fp("b"), LONG).await.expect("begin"),
        Begin::Mismatch
    );
    take_over(store, &id, &fp("a"), LONG).await;
}

/// A takeover whose caller went away (dropped, or gone before the answer) is not undone
/// like a fresh claim: undone, the unfinished attempt before it would be forgotten and the
/// next `begin` would answer `Execute`. Its lease runs out, and the next `begin` still says
/// `TakeOver`.
pub async fn an_abandoned_takeover_keeps_the_outcome_unknown(store: &dyn Store) {
    let id = fresh_id();
    execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    match drop_at_poll(store.begin(&id, &fp("a"), SHORT), 1).await {
        None | Some(Ok(Begin::TakeOver(_))) => {}
        Some(other) => panic!("an unfinished lease answered {other:?}"),
    }
    tokio::time::sleep(PAST_SHORT).await;
    take_over(store, &id, &fp("a"), LONG).await;
}

/// A lease renewed for zero is over at once and keeps its record: the next `begin` takes it
/// over (the attempt's outcome is unknown) instead of answering `InFlight`; a takeover whose
/// claimer went away is ended so ([`idempotency_core::end_orphan`]), not left to run out.
pub async fn a_lease_renewed_for_zero_ends_now_and_keeps_its_record(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), LONG).await;
    store
        .renew(&id, token, Duration::ZERO)
        .await
        .expect("renew for zero");
    assert_eq!(
        store.begin(&id, &fp("b"), LONG).await.expect("begin"),
        Begin::Mismatch,
        "the unfinished attempt is kept"
    );
    let token = take_over(store, &id, &fp("a"), LONG).await;
    // A takeover nobody receives (dropped before its answer) is ended, not left for a lease.
    store
        .renew(&id, token, Duration::ZERO)
        .await
        .expect("renew for zero");
    match drop_at_poll(store.begin(&id, &fp("a"), LONG), 1).await {
        None => {}
        // Answered at its first poll (a store that never waits): received, so ours to end.
        Some(Ok(Begin::TakeOver(token))) => {
            store
                .renew(&id, token, Duration::ZERO)
                .await
                .expect("renew for zero");
        }
        Some(other) => panic!("an unfinished lease answered {other:?}"),
    }
    store.drain().await;
    take_over(store, &id, &fp("a"), LONG).await;
}

/// A claim whose lease is zero is granted, and over at once, as a lease renewed for zero
/// is: the next `begin` of the same request takes it over (its outcome is unknown), another
/// request's is refused, and the first token owns nothing after the takeover. No store may
/// refuse it as an error nor keep it live.
pub async fn a_claim_with_a_zero_lease_is_over_at_once(store: &dyn Store) {
    let id = fresh_id();
    let first = execute(store, &id, &fp("a"), Duration::ZERO).await;
    assert_eq!(
        store.begin(&id, &fp("b"), LONG).await.expect("begin"),
        Begin::Mismatch,
        "the unfinished attempt is kept"
    );
    let owner = take_over(store, &id, &fp("a"), LONG).await;
    assert!(matches!(
        store.complete(&id, first, &sample_outcome(), LONG).await,
        Err(Error::LeaseLost)
    ));
    store
        .complete(&id, owner, &sample_outcome(), LONG)
        .await
        .expect("the owner completes");
    assert_eq!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(sample_outcome())
    );
}

/// A lease or a retention of `Duration::MAX` ("for good") is accepted, by a store that
/// caps it at its own limit, and never overflows a clock: the record is claimed, renewed,
/// completed and replayed like any other.
pub async fn unbounded_durations_mean_for_good(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), Duration::MAX).await;
    store
        .renew(&id, token, Duration::MAX)
        .await
        .expect("renew for good");
    assert!(matches!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::InFlight { .. }
    ));
    store
        .complete(&id, token, &sample_outcome(), Duration::MAX)
        .await
        .expect("complete for good");
    assert_eq!(
        store
            .begin(&id, &fp("a"), Duration::MAX)
            .await
            .expect("begin"),
        Begin::Replay(sample_outcome())
    );
}

/// A stale token can neither complete, release nor renew, and changes nothing: the new
/// owner's outcome is intact afterwards.
pub async fn stale_token_changes_nothing(store: &dyn Store) {
    let id = fresh_id();
    let stale = execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let owner = take_over(store, &id, &fp("a"), LONG).await;

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

/// A token whose lease expired still owns the record while nobody took over: its late
/// `complete` is accepted (a slow handler after a store blip must not cause a second
/// execution), and the next `begin` replays it. A late `release` is accepted too.
pub async fn late_completion_is_accepted_when_nobody_took_over(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    store
        .complete(&id, token, &sample_outcome(), LONG)
        .await
        .expect("a late completion nobody overtook is accepted");
    assert_eq!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(sample_outcome())
    );

    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    store
        .release(&id, token)
        .await
        .expect("a late release nobody overtook is accepted");
    execute(store, &id, &fp("a"), LONG).await;
}

/// Takeover versus late completion, in both orders: whichever lands first wins, and the
/// other changes nothing. Late completion first: the takeover replays it. Takeover first:
/// the late completion is fenced off and the new owner's outcome stands.
pub async fn takeover_versus_late_completion_in_both_orders(store: &dyn Store) {
    let late = Outcome::new(201).with_body("late");
    // Completion first.
    let id = fresh_id();
    let stale = execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    store
        .complete(&id, stale, &late, LONG)
        .await
        .expect("late complete");
    assert_eq!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(late.clone())
    );
    // Takeover first.
    let id = fresh_id();
    let stale = execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let owner = take_over(store, &id, &fp("a"), LONG).await;
    assert!(matches!(
        store.complete(&id, stale, &late, LONG).await,
        Err(Error::LeaseLost)
    ));
    store
        .complete(&id, owner, &sample_outcome(), LONG)
        .await
        .expect("complete");
    assert_eq!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(sample_outcome())
    );
}

/// Takeover and late completion racing, many keys at once: exactly one wins per key. Either
/// the completion landed (and the racing `begin` replays it) or the takeover did (and the
/// completion is `LeaseLost`): never a completion accepted *and* a second execution.
pub async fn takeover_races_late_completion(store: Arc<dyn Store>) {
    let late = Outcome::new(201).with_body("late");
    let mut keys = Vec::new();
    for _ in 0..16 {
        let id = fresh_id();
        keys.push((id, execute(&*store, &id, &fp("a"), SHORT).await));
    }
    tokio::time::sleep(PAST_SHORT).await;
    // Every other key sends the `begin` first: polled in one order only, one side would
    // nearly always win on a store that answers in the order it was asked.
    let races = keys.into_iter().enumerate().map(|(i, (id, stale))| {
        let (store, late) = (store.clone(), late.clone());
        async move {
            let fingerprint = fp("a");
            let complete = store.complete(&id, stale, &late, LONG);
            let begin = store.begin(&id, &fingerprint, LONG);
            let (completed, begun) = if i % 2 == 0 {
                tokio::join!(complete, begin)
            } else {
                let (begun, completed) = tokio::join!(begin, complete);
                (completed, begun)
            };
            match (completed, begun.expect("begin")) {
                (Ok(()), Begin::Replay(outcome)) => assert_eq!(outcome, late),
                (Ok(()), other) => panic!("completion accepted, yet begin answered {other:?}"),
                (Err(Error::LeaseLost), Begin::TakeOver(_)) => {}
                (completed, begun) => panic!("unexpected race result {completed:?} / {begun:?}"),
            }
        }
    });
    futures::future::join_all(races).await;
}

/// Completing again with the same token is `Ok` and keeps the first outcome (the first
/// answer may have been lost); releasing or renewing a completed record fails.
pub async fn completed_record_is_final(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), LONG).await;
    store
        .complete(&id, token, &sample_outcome(), LONG)
        .await
        .expect("complete");
    let other = Outcome::new(500);
    store
        .complete(&id, token, &other, LONG)
        .await
        .expect("completing again with the same token is idempotent");
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

/// What the executor's confirmation of a commit relies on (an operation of
/// `Executor::run_with_claim` that completed its record in its own transaction and returned
/// `Ok`): its `release`, then its `complete` with the same token, tell a completion that
/// committed from one that did not.
/// - committed: the release is refused (`LeaseLost`) and the completion accepted again,
///   its first outcome kept;
/// - rolled back: the release goes through (and the completion after it is refused);
/// - rolled back, the release landed with its answer lost: the retried release and the
///   completion are both refused, storing nothing;
/// - rolled back, and another attempt took the key over: both refused, the takeover's lease
///   untouched.
pub async fn a_release_then_a_completion_tell_a_commit_from_a_rollback(store: &dyn Store) {
    let committed = fresh_id();
    let token = execute(store, &committed, &fp("a"), LONG).await;
    store
        .complete(&committed, token, &sample_outcome(), LONG)
        .await
        .expect("complete");
    assert!(matches!(
        store.release(&committed, token).await,
        Err(Error::LeaseLost)
    ));
    store
        .complete(&committed, token, &Outcome::new(500), LONG)
        .await
        .expect("the completing token's completion is accepted again");
    assert_eq!(
        store
            .begin(&committed, &fp("a"), LONG)
            .await
            .expect("begin"),
        Begin::Replay(sample_outcome())
    );

    for answer_lost in [false, true] {
        let rolled_back = fresh_id();
        let token = execute(store, &rolled_back, &fp("a"), LONG).await;
        store.release(&rolled_back, token).await.expect("release");
        if answer_lost {
            assert!(matches!(
                store.release(&rolled_back, token).await,
                Err(Error::LeaseLost)
            ));
        }
        assert!(matches!(
            store
                .complete(&rolled_back, token, &sample_outcome(), LONG)
                .await,
            Err(Error::LeaseLost)
        ));
        execute(store, &rolled_back, &fp("a"), LONG).await;
    }

    let taken = fresh_id();
    let token = execute(store, &taken, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let takeover = take_over(store, &taken, &fp("a"), LONG).await;
    assert!(matches!(
        store.release(&taken, token).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.complete(&taken, token, &sample_outcome(), LONG).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.begin(&taken, &fp("a"), LONG).await.expect("begin"),
        Begin::InFlight { .. }
    ));
    store
        .complete(&taken, takeover, &sample_outcome(), LONG)
        .await
        .expect("the takeover completes");
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

/// A lease renewed after it ran out, while nobody took it over, is its owner's again and live:
/// the token owned the record all along (a slow owner's renewal after a store blip), so the
/// next `begin` is `InFlight`, not a takeover.
pub async fn a_renewal_after_the_lease_ran_out_untaken_holds_it_again(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    store
        .renew(&id, token, LONG)
        .await
        .expect("a late renewal nobody overtook is accepted");
    assert!(matches!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::InFlight { .. }
    ));
    store
        .complete(&id, token, &sample_outcome(), LONG)
        .await
        .expect("complete after the renewal");
}

/// An owner that ended its own lease (`renew` for zero: a caller going away) still owns the
/// record until another `begin` takes it over: its completion is accepted and replayed, and
/// so is its release, after which the key runs again as new.
pub async fn the_owner_settles_after_ending_its_own_lease(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), LONG).await;
    store.renew(&id, token, Duration::ZERO).await.expect("end");
    store
        .complete(&id, token, &sample_outcome(), LONG)
        .await
        .expect("the owner's completion after its own end");
    assert_eq!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(sample_outcome())
    );

    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), LONG).await;
    store.renew(&id, token, Duration::ZERO).await.expect("end");
    store
        .release(&id, token)
        .await
        .expect("the owner's release after its own end");
    execute(store, &id, &fp("a"), LONG).await;
}

/// A record its owner released is gone for an operator too: `inspect` finds nothing.
pub async fn inspect_finds_nothing_after_a_release(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), LONG).await;
    assert!(store.inspect(&id).await.expect("inspect").is_some());
    store.release(&id, token).await.expect("release");
    let found = store.inspect(&id).await.expect("inspect");
    assert!(found.is_none(), "a released record: {found:?}");
}

/// An operator resolving an unknown outcome ([`resolve_unknown`]) and the attempt's own late
/// completion racing, many keys at once: exactly one outcome is stored per key, and the
/// key's retries replay that one. Either the completion landed first (the resolution finds
/// the record completed) or the resolution did (the completion is `LeaseLost`): never both
/// accepted, never one overwriting the other.
///
/// [`resolve_unknown`]: idempotency_core::resolve_unknown
pub async fn resolving_an_unknown_outcome_races_the_late_completion(store: Arc<dyn Store>) {
    use idempotency_core::{Resolved, resolve_unknown};

    let (late, found) = (
        Outcome::new(201).with_body("late"),
        Outcome::new(201).with_body("found by the operator"),
    );
    let mut keys = Vec::new();
    for _ in 0..16 {
        let id = fresh_id();
        keys.push((id, execute(&*store, &id, &fp("a"), SHORT).await));
    }
    tokio::time::sleep(PAST_SHORT).await;
    // Every other key sends the resolution first (see `takeover_races_late_completion`).
    let races = keys.into_iter().enumerate().map(|(i, (id, stale))| {
        let (store, late, found) = (store.clone(), late.clone(), found.clone());
        async move {
            let complete = store.complete(&id, stale, &late, LONG);
            let resolve = resolve_unknown(&store, &id, &found, LONG);
            let (completed, resolved) = join_in_turn(i, complete, resolve).await;
            let stored = match (completed, resolved.expect("resolve")) {
                (Ok(()), Resolved::Completed) => &late,
                (Err(Error::LeaseLost), Resolved::Stored) => &found,
                (completed, resolved) => {
                    panic!("both or neither stored: {completed:?} / {resolved:?}")
                }
            };
            assert_eq!(
                store.begin(&id, &fp("a"), LONG).await.expect("begin"),
                Begin::Replay(stored.clone())
            );
        }
    });
    futures::future::join_all(races).await;
}

/// An operator resolving an unknown outcome ([`resolve_unknown`]) while another releases the
/// attempt (`force_release`, default scope: found no effect), many keys at once: the answers
/// are those of some order of the two. The release first: it released, and the resolution
/// finds no record and stores nothing. The resolution first: its takeover holds the key
/// (the release answers `Live`) or its outcome is stored (`Completed`), and that outcome
/// replays. Never both "released" and "stored": a resolution that claimed the key the
/// release had just freed stored its outcome, found by review.
///
/// [`resolve_unknown`]: idempotency_core::resolve_unknown
pub async fn resolving_an_unknown_outcome_races_an_operators_release(store: Arc<dyn Store>) {
    use idempotency_core::{ForceReleased, ReleaseScope, Resolved, resolve_unknown};

    let found = Outcome::new(201).with_body("found by the operator");
    let mut keys = Vec::new();
    for _ in 0..16 {
        let id = fresh_id();
        execute(&*store, &id, &fp("a"), SHORT).await;
        keys.push(id);
    }
    tokio::time::sleep(PAST_SHORT).await;
    let races = keys.into_iter().enumerate().map(|(i, id)| {
        let (store, found) = (store.clone(), found.clone());
        async move {
            let release = store.force_release(&id, ReleaseScope::default());
            let resolve = resolve_unknown(&store, &id, &found, LONG);
            let (released, resolved) = join_in_turn(i, release, resolve).await;
            let (released, resolved) = (released.expect("release"), resolved.expect("resolve"));
            let stored = match (released, resolved) {
                // The release is one step, the resolution three (read, takeover, completion):
                // these three placements are all there is.
                (ForceReleased::Released, Resolved::Absent) => false,
                (ForceReleased::Live | ForceReleased::Completed, Resolved::Stored) => true,
                other => panic!("no order of the two answers {other:?}"),
            };
            if stored {
                assert_eq!(
                    store.begin(&id, &fp("a"), LONG).await.expect("begin"),
                    Begin::Replay(found.clone())
                );
            } else {
                let left = store.inspect(&id).await.expect("inspect");
                assert!(left.is_none(), "released, yet kept: {left:?}");
            }
        }
    });
    futures::future::join_all(races).await;
}

/// `a` and `b` joined, `a` polled first for an even `i` and `b` for an odd one (so that races
/// run in both orders over many keys); the answers in argument order.
async fn join_in_turn<A: Future, B: Future>(i: usize, a: A, b: B) -> (A::Output, B::Output) {
    if i.is_multiple_of(2) {
        tokio::join!(a, b)
    } else {
        let (b, a) = tokio::join!(b, a);
        (a, b)
    }
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

/// Purging keeps live records (completed and in flight) and removes expired ones: the
/// token that completed a purged record no longer finds it (before the purge, memory and
/// Postgres answer its repeated `complete` with `Ok`; Redis lets the key expire by itself).
pub async fn purge_removes_only_expired_records(store: &dyn Store) {
    let expired = fresh_id();
    let expired_token = execute(store, &expired, &fp("a"), LONG).await;
    store
        .complete(&expired, expired_token, &sample_outcome(), SHORT)
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
    assert!(
        matches!(
            store
                .complete(&expired, expired_token, &sample_outcome(), LONG)
                .await,
            Err(Error::LeaseLost)
        ),
        "a purged record is gone: the token that completed it owns nothing"
    );
    execute(store, &expired, &fp("b"), LONG).await;
    take_over(store, &expired_lease, &fp("a"), LONG).await;
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

/// 32 concurrent `begin`s on an attempt whose lease ran out unfinished, on 8 keys in turn:
/// exactly one `TakeOver` per key (one taker wins; the row lock, or the script), every other
/// `InFlight` under the taker's lease, and the old owner's late `complete` refused.
pub async fn concurrent_takeovers_grant_once(store: Arc<dyn Store>) {
    for _ in 0..8 {
        let id = fresh_id();
        let crashed = execute(&*store, &id, &fp("a"), LONG).await;
        store
            .renew(&id, crashed, Duration::ZERO)
            .await
            .expect("end the lease, as after a crash");
        let attempts = (0..32).map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&id, &fp("a"), LONG).await })
        });
        let mut taken = Vec::new();
        for result in futures::future::join_all(attempts).await {
            match result.expect("task").expect("begin") {
                Begin::TakeOver(token) => taken.push(token),
                Begin::InFlight { .. } => {}
                other => panic!("a takeover race answered {other:?}"),
            }
        }
        assert_eq!(taken.len(), 1, "one taker, not {}", taken.len());
        assert!(matches!(
            store.complete(&id, crashed, &sample_outcome(), LONG).await,
            Err(Error::LeaseLost)
        ));
        store
            .complete(&id, taken[0], &sample_outcome(), LONG)
            .await
            .expect("the taker completes");
    }
}

// ---------------------------------------------------------------------------------------
// The operator's view: inspect and force_release.

/// The wall clock, for checking a store's times loosely (the store's clock is another
/// machine's in production; here the same host's, within a second).
fn near(t: SystemTime, expected: SystemTime) -> bool {
    let slack = Duration::from_secs(2);
    t + slack >= expected && t <= expected + slack
}

/// `inspect` sees nothing, then the lease, then the outcome, then (past its retention)
/// nothing again; a lease that ran out is still reported, with no lease left.
pub async fn inspect_reports_each_state(store: &dyn Store) {
    let id = fresh_id();
    assert_eq!(store.inspect(&id).await.expect("inspect"), None);
    let before = SystemTime::now();
    let token = execute(store, &id, &fp("a"), LONG).await;
    let record = store
        .inspect(&id)
        .await
        .expect("inspect")
        .expect("in flight");
    assert_eq!(record.fingerprint, fp("a"));
    match record.state {
        RecordState::InFlight { lease_remaining } => {
            assert!(lease_remaining <= LONG, "{lease_remaining:?}");
            assert!(lease_remaining > LONG / 2, "{lease_remaining:?}");
        }
        other => panic!("a claimed key inspected as {other:?}"),
    }
    assert!(near(record.expires_at, before + LONG), "{record:?}");
    if let Some(created) = record.created_at {
        assert!(near(created, before), "{record:?}");
    }
    store
        .complete(&id, token, &Outcome::new(201).with_body("ch_1"), SHORT)
        .await
        .expect("complete");
    let record = store
        .inspect(&id)
        .await
        .expect("inspect")
        .expect("completed");
    assert_eq!(record.state, RecordState::Completed { status: 201 });
    assert!(record.is_completed());
    assert_eq!(record.fingerprint, fp("a"));
    assert!(
        near(record.expires_at, SystemTime::now() + SHORT),
        "{record:?}"
    );
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(store.inspect(&id).await.expect("inspect"), None);

    let orphan = fresh_id();
    execute(store, &orphan, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let record = store
        .inspect(&orphan)
        .await
        .expect("inspect")
        .expect("a lease that ran out is still there until taken over");
    assert_eq!(
        record.state,
        RecordState::InFlight {
            lease_remaining: Duration::ZERO
        }
    );
    assert!(record.expires_at <= SystemTime::now() + Duration::from_secs(1));
}

/// `force_release` frees an in-flight key for the next `begin` and fences its owner off:
/// the old token's `complete`, `renew` and `release` answer `LeaseLost`, and the new owner's
/// outcome is the one that replays. A live lease only when asked for; a lease that ran out
/// by default.
pub async fn force_release_fences_the_owner(store: &dyn Store) {
    let id = fresh_id();
    assert_eq!(
        store
            .force_release(&id, ReleaseScope::default())
            .await
            .expect("force_release"),
        ForceReleased::Absent
    );
    let old = execute(store, &id, &fp("a"), LONG).await;
    for scope in [
        ReleaseScope::default(),
        ReleaseScope::default().with_completed(),
    ] {
        assert_eq!(
            store
                .force_release(&id, scope)
                .await
                .expect("force_release"),
            ForceReleased::Live,
            "a live lease is kept unless asked for ({scope:?})"
        );
    }
    store
        .renew(&id, old, LONG)
        .await
        .expect("the holder of a kept lease still owns it");
    assert_eq!(
        store
            .force_release(&id, ReleaseScope::default().with_live())
            .await
            .expect("force_release"),
        ForceReleased::Released
    );
    assert_eq!(store.inspect(&id).await.expect("inspect"), None);
    let outcome = sample_outcome();
    assert!(matches!(
        store.renew(&id, old, LONG).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.complete(&id, old, &outcome, LONG).await,
        Err(Error::LeaseLost)
    ));
    assert_eq!(
        store.inspect(&id).await.expect("inspect"),
        None,
        "a fenced complete wrote nothing"
    );
    let new = execute(store, &id, &fp("b"), LONG).await;
    assert!(matches!(
        store.complete(&id, old, &outcome, LONG).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.release(&id, old).await,
        Err(Error::LeaseLost)
    ));
    let mine = Outcome::new(200).with_body("the new owner's");
    store
        .complete(&id, new, &mine, LONG)
        .await
        .expect("the new owner completes");
    assert_eq!(
        store.begin(&id, &fp("b"), LONG).await.expect("begin"),
        Begin::Replay(mine)
    );

    let orphan = fresh_id();
    let old = execute(store, &orphan, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        store
            .force_release(&orphan, ReleaseScope::default())
            .await
            .expect("force_release"),
        ForceReleased::Released
    );
    assert!(matches!(
        store.complete(&orphan, old, &outcome, LONG).await,
        Err(Error::LeaseLost)
    ));
    execute(store, &orphan, &fp("a"), LONG).await;
}

/// An operator saw a lease run out and releases it; meanwhile a retry took the key over and
/// is running the operation. The release must find the takeover's live lease and keep it:
/// deleted, the next retry would execute a third attempt while the second still runs. The
/// check is the store's, atomic with the delete (found by an attacker's read of the admin
/// surface).
pub async fn force_release_spares_a_takeover(store: &dyn Store) {
    let id = fresh_id();
    execute(store, &id, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let taken = take_over(store, &id, &fp("a"), LONG).await;
    assert_eq!(
        store
            .force_release(&id, ReleaseScope::default())
            .await
            .expect("force_release"),
        ForceReleased::Live
    );
    let outcome = sample_outcome();
    store
        .complete(&id, taken, &outcome, LONG)
        .await
        .expect("the takeover completes");
    assert_eq!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(outcome)
    );
}

/// An operator's release of every kind of record (live leases and outcomes) while claims of
/// the key come and go: whatever it met, it took, so its answer is `Released`, `Deleted` or
/// `Absent`, never `Live` or `Completed`, which no order of the calls gives. Found by the
/// linearizability check on the hybrid store (seed 20261205, round 18): the Postgres store
/// deleted, then read why nothing was deleted, in two statements, and when a claim came
/// between them three times running it answered `Live`.
pub async fn a_full_release_among_claims_answers_as_some_order_would(store: Arc<dyn Store>) {
    let id = fresh_id();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let claimers: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|body| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match store.begin(&id, &fp(body), LONG).await {
                        Ok(Begin::Execute(token) | Begin::TakeOver(token)) => {
                            // Released by the operator first, it is `LeaseLost`.
                            let _ = store.release(&id, token).await;
                        }
                        _ => tokio::task::yield_now().await,
                    }
                }
            })
        })
        .collect();
    let all = ReleaseScope::default().with_live().with_completed();
    for n in 0..300 {
        let answer = store.force_release(&id, all).await.expect("force_release");
        assert!(
            matches!(
                answer,
                ForceReleased::Released | ForceReleased::Deleted | ForceReleased::Absent
            ),
            "release {n} of every kind answered {answer:?}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for claimer in claimers {
        claimer.await.expect("claimer");
    }
}

/// A completed record stays (and replays) unless the operator asks for it explicitly; then
/// the key executes again. A record past its retention is absent.
pub async fn force_release_keeps_a_completed_record_unless_asked(store: &dyn Store) {
    let id = fresh_id();
    let token = execute(store, &id, &fp("a"), LONG).await;
    let outcome = sample_outcome();
    store
        .complete(&id, token, &outcome, LONG)
        .await
        .expect("complete");
    for scope in [ReleaseScope::default(), ReleaseScope::default().with_live()] {
        assert_eq!(
            store
                .force_release(&id, scope)
                .await
                .expect("force_release"),
            ForceReleased::Completed,
            "{scope:?}"
        );
    }
    assert_eq!(
        store.begin(&id, &fp("a"), LONG).await.expect("begin"),
        Begin::Replay(outcome.clone())
    );
    assert_eq!(
        store
            .force_release(&id, ReleaseScope::default().with_completed())
            .await
            .expect("force_release"),
        ForceReleased::Deleted
    );
    assert_eq!(store.inspect(&id).await.expect("inspect"), None);
    assert!(
        matches!(
            store.complete(&id, token, &outcome, LONG).await,
            Err(Error::LeaseLost)
        ),
        "the completing token owns nothing any more"
    );
    execute(store, &id, &fp("a"), LONG).await;

    let expired = fresh_id();
    let token = execute(store, &expired, &fp("a"), LONG).await;
    store
        .complete(&expired, token, &outcome, SHORT)
        .await
        .expect("complete");
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        store
            .force_release(&expired, ReleaseScope::default().with_completed())
            .await
            .expect("force_release"),
        ForceReleased::Absent
    );
}

/// Generates one `#[test]` per conformance case for a store.
///
/// `$store` is an async expression giving `Option<Arc<dyn Store>>` (`None` when the harness
/// was told to skip service-backed tests). Each test runs on the binary's shared runtime, so
/// the store's pooled connections and containers outlive single tests.
///
/// `cache: $store` leaves out [`concurrent_calls_are_linearizable`]: for a store that answers
/// from a cache written after its answers, which a later call can see stale by design. (The
/// hybrid store does not need it: a later call of its process never sees its Redis behind
/// Postgres.)
///
/// ```text
/// idempotency_test::conformance_tests!(async {
///     Some(std::sync::Arc::new(idempotency_core::MemoryStore::new()) as std::sync::Arc<dyn idempotency_core::Store>)
/// });
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (cache: $store:expr) => {
        $crate::conformance_tests!(@all $store;);
    };
    ($store:expr) => {
        $crate::conformance_tests!(@all $store; concurrent_calls_are_linearizable);
    };
    (@all $store:expr; $($more:ident)?) => {
        $crate::conformance_tests!(@cases $store;
            first_begin_executes,
            replay_returns_the_exact_outcome,
            mismatch_while_in_flight,
            mismatch_after_completion,
            live_duplicate_is_in_flight,
            release_lets_the_next_begin_execute,
            expired_lease_is_taken_over,
            an_abandoned_takeover_keeps_the_outcome_unknown,
            a_lease_renewed_for_zero_ends_now_and_keeps_its_record,
            a_claim_with_a_zero_lease_is_over_at_once,
            an_unfinished_lease_is_not_another_request_s,
            stale_token_changes_nothing,
            unbounded_durations_mean_for_good,
            late_completion_is_accepted_when_nobody_took_over,
            takeover_versus_late_completion_in_both_orders,
            completed_record_is_final,
            a_release_then_a_completion_tell_a_commit_from_a_rollback,
            renew_extends_the_lease,
            a_renewal_after_the_lease_ran_out_untaken_holds_it_again,
            the_owner_settles_after_ending_its_own_lease,
            inspect_finds_nothing_after_a_release,
            retention_expiry_makes_the_record_absent,
            purge_removes_only_expired_records,
            scopes_are_isolated,
            inspect_reports_each_state,
            force_release_fences_the_owner,
            force_release_keeps_a_completed_record_unless_asked,
            force_release_spares_a_takeover,
        );
        $crate::conformance_tests!(@shared $store;
            concurrent_begins_execute_once,
            concurrent_takeovers_grant_once,
            concurrent_mixed_calls_answer_as_alone,
            takeover_races_late_completion,
            resolving_an_unknown_outcome_races_the_late_completion,
            resolving_an_unknown_outcome_races_an_operators_release,
            dropped_calls_leave_the_key_answerable,
            a_full_release_among_claims_answers_as_some_order_would,
            answers_as_the_model_store,
            $($more,)?
        );
    };
    (@shared $store:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::block_on(async {
                    let store: Option<std::sync::Arc<dyn $crate::Store>> = $store.await;
                    if let Some(store) = store {
                        $crate::conformance::$case(store).await;
                    }
                });
            }
        )*
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

/// Many calls of every kind at once, each answered exactly as it would be alone: what a
/// store that coalesces concurrent calls (the Postgres group commit) must still get right.
/// One wave of `begin`s holds fresh keys, a completed key, a live lease, a mismatch, an
/// expired lease and one key asked twice; then a wave of `complete`s, `renew`s and
/// `release`s mixes owning and stale tokens, a token completed twice and one key twice.
pub async fn concurrent_mixed_calls_answer_as_alone(store: Arc<dyn Store>) {
    let s = &*store;
    let (done, live, expired, twice) = (fresh_id(), fresh_id(), fresh_id(), fresh_id());
    let token = execute(s, &done, &fp("a"), LONG).await;
    s.complete(&done, token, &sample_outcome(), LONG)
        .await
        .expect("complete");
    execute(s, &live, &fp("a"), LONG).await;
    let stale = execute(s, &expired, &fp("a"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;

    let fresh: Vec<RecordId> = (0..24).map(|_| fresh_id()).collect();
    let (a, b) = (fp("a"), fp("b"));
    let mut calls: Vec<(RecordId, &Fingerprint)> = fresh.iter().map(|id| (*id, &a)).collect();
    calls.extend([
        (done, &a),
        (done, &b),
        (live, &a),
        (live, &b),
        (expired, &a),
        (twice, &a),
        (twice, &a),
    ]);
    let answers =
        futures::future::join_all(calls.iter().map(|(id, fp)| s.begin(id, fp, LONG))).await;
    let answers: Vec<Begin> = answers.into_iter().map(|a| a.expect("begin")).collect();
    let n = fresh.len();
    let mut tokens = Vec::new();
    for answer in &answers[..n] {
        match answer {
            Begin::Execute(token) => tokens.push(*token),
            other => panic!("a fresh key answered {other:?}"),
        }
    }
    assert_eq!(answers[n], Begin::Replay(sample_outcome()));
    assert_eq!(answers[n + 1], Begin::Mismatch);
    assert!(
        matches!(answers[n + 2], Begin::InFlight { .. }),
        "{:?}",
        answers[n + 2]
    );
    assert_eq!(answers[n + 3], Begin::Mismatch);
    let taken = match answers[n + 4] {
        Begin::TakeOver(token) => token,
        ref other => panic!("an expired lease answered {other:?}"),
    };
    assert_ne!(taken, stale);
    let twice_token = match (&answers[n + 5], &answers[n + 6]) {
        (Begin::Execute(token), Begin::InFlight { .. })
        | (Begin::InFlight { .. }, Begin::Execute(token)) => *token,
        other => panic!("one key asked twice answered {other:?}"),
    };

    // The second wave: a third of the fresh keys complete (one of them twice with its
    // token), a third renew, a third release; the stale token fails everywhere.
    let outcome = Outcome::new(200).with_body("second wave");
    let (complete, rest) = fresh.split_at(n / 3);
    let (renew, release) = rest.split_at(n / 3);
    let token_of = |id: &RecordId| tokens[fresh.iter().position(|f| f == id).expect("fresh")];
    let completes = complete.iter().chain([&complete[0], &twice]).map(|id| {
        let token = if *id == twice {
            twice_token
        } else {
            token_of(id)
        };
        s.complete(id, token, &outcome, LONG)
    });
    let renews = renew.iter().map(|id| s.renew(id, token_of(id), LONG));
    let releases = release.iter().map(|id| s.release(id, token_of(id)));
    let stale_calls = [
        s.complete(&expired, stale, &outcome, LONG),
        s.renew(&expired, stale, LONG),
        s.release(&expired, stale),
    ];
    let (completes, renews, releases, stale_calls) = futures::join!(
        futures::future::join_all(completes),
        futures::future::join_all(renews),
        futures::future::join_all(releases),
        futures::future::join_all(stale_calls),
    );
    for result in completes.into_iter().chain(renews).chain(releases) {
        result.expect("an owning token's call");
    }
    for result in stale_calls {
        assert!(matches!(result, Err(Error::LeaseLost)), "{result:?}");
    }
    for id in complete.iter().chain([&twice]) {
        assert_eq!(
            s.begin(id, &fp("a"), LONG).await.expect("begin"),
            Begin::Replay(outcome.clone())
        );
    }
    for id in renew {
        assert!(matches!(
            s.begin(id, &fp("a"), LONG).await.expect("begin"),
            Begin::InFlight { .. }
        ));
    }
    for id in release {
        execute(s, id, &fp("a"), LONG).await;
    }
    // The taken-over key still belongs to its new owner.
    s.complete(&expired, taken, &outcome, LONG)
        .await
        .expect("the new owner completes");
}

// ---------------------------------------------------------------------------------------
// The cancellation sweep.

/// Polls `future` at most `k` times, then drops it: `None` when it was dropped, its output
/// when it finished within `k` polls. Wake-ups are the real ones (no busy polling), so the
/// k-th poll is the k-th time the future had something to do: the sweep below drops every
/// future at each of its await points in turn.
pub async fn drop_at_poll<F: std::future::Future>(future: F, k: usize) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut polls = 0;
    std::future::poll_fn(move |cx| {
        polls += 1;
        match future.as_mut().poll(cx) {
            std::task::Poll::Ready(output) => std::task::Poll::Ready(Some(output)),
            std::task::Poll::Pending if polls >= k => std::task::Poll::Ready(None),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    })
    .await
}

/// The lease of the sweep: an orphaned claim would hold the key this long.
pub const SWEEP_LEASE: Duration = Duration::from_secs(8);
/// How long after a drop the key must be answerable: well inside [`SWEEP_LEASE`], so a lease
/// left claimed by nobody (which only its expiry would free) fails the sweep.
pub const ANSWERABLE_WITHIN: Duration = Duration::from_secs(4);
/// How many sweeps [`dropped_calls_leave_the_key_answerable`] runs at most to see a drop.
pub const SWEEP_ROUNDS: usize = 5;
/// How many calls (each on a fresh key) a sweep makes of an operation that completes at its
/// first poll before it takes that as the operation's way: see [`DropPoints`].
pub const FIRST_POLL_TRIES: usize = 20;
/// A sweep that never completes undropped is a bug in the sweep or the store.
const MAX_POLLS: usize = 400;

/// The polls a [`sweep`] drops one operation's calls at, call after call: 1, 2, 3, … until a
/// call completes undropped.
///
/// A call that completes at its very first poll dropped nothing, and it tells nothing of the
/// store: on two busy cores the test's thread can be descheduled right after it sent the
/// request, and the reply is waiting when it reads. It happened to every call of five
/// sweeps in a row under `cargo test` on a loaded host. Such a call is made again, on a
/// fresh key, up to [`FIRST_POLL_TRIES`] times, so that a busy moment does not skip the
/// operation's drops; only a store that really answers at once (the memory store) uses
/// them all.
#[derive(Debug)]
struct DropPoints {
    what: &'static str,
    /// The poll the last call was dropped at (0 before the first call).
    k: usize,
    /// The last call completed undropped.
    finished: bool,
    first_poll_tries: usize,
}

impl DropPoints {
    fn new(what: &'static str) -> Self {
        Self {
            what,
            k: 0,
            finished: false,
            first_poll_tries: 1,
        }
    }

    /// The poll to drop the next call at, `None` when the operation's sweep is over.
    fn next(&mut self) -> Option<usize> {
        if !self.finished {
            self.k += 1;
            assert!(
                self.k <= MAX_POLLS,
                "{} never completed undropped",
                self.what
            );
            return Some(self.k);
        }
        if self.k == 1 && self.first_poll_tries < FIRST_POLL_TRIES {
            self.first_poll_tries += 1;
            self.finished = false;
            return Some(1);
        }
        None
    }

    /// The last call completed undropped.
    fn finished(&mut self) {
        self.finished = true;
    }
}

/// Begins until the answer is not `InFlight` (or `Unavailable`), for at most
/// [`ANSWERABLE_WITHIN`], and returns it.
pub async fn answer_within(store: &dyn Store, id: &RecordId, fp: &Fingerprint) -> Begin {
    let deadline = tokio::time::Instant::now() + ANSWERABLE_WITHIN;
    loop {
        match store.begin(id, fp, SWEEP_LEASE).await {
            Ok(Begin::InFlight { .. }) | Err(Error::Unavailable(_))
                if tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            Ok(answer) => return answer,
            Err(error) => panic!("the key did not become answerable: {error}"),
        }
    }
}

/// The operations a [`sweep`] drops calls of, in [`SweepReport::dropped_each`]'s order.
pub const SWEPT: [&str; 5] = ["begin", "a takeover", "complete", "release", "renew"];

/// What a [`sweep`] saw.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Calls dropped at some poll.
    pub dropped: usize,
    /// Calls that answered `Unavailable` (each then checked to have left nothing behind).
    pub unavailable: usize,
    /// Calls dropped, per operation of [`SWEPT`]: a total alone would pass a store one of
    /// whose operations always finished at its first poll, its drop points never tried.
    pub dropped_each: [usize; SWEPT.len()],
}

impl SweepReport {
    /// The operations of which no call was dropped.
    ///
    /// ```
    /// use idempotency_test::conformance::{SweepReport, SWEPT};
    ///
    /// let mut report = SweepReport::default();
    /// assert_eq!(report.never_dropped(), SWEPT.to_vec());
    /// report.add(&SweepReport { dropped: 5, dropped_each: [1; 5], ..Default::default() });
    /// assert!(report.never_dropped().is_empty());
    /// ```
    pub fn never_dropped(&self) -> Vec<&'static str> {
        SWEPT
            .iter()
            .zip(self.dropped_each)
            .filter(|(_, n)| *n == 0)
            .map(|(what, _)| *what)
            .collect()
    }

    /// Adds another sweep's counts to these.
    pub fn add(&mut self, other: &SweepReport) {
        self.dropped += other.dropped;
        self.unavailable += other.unavailable;
        for (mine, theirs) in self.dropped_each.iter_mut().zip(other.dropped_each) {
            *mine += theirs;
        }
    }
}

fn tally(report: &mut SweepReport, finished: Option<Result<(), Error>>, what: &str) -> bool {
    match finished {
        Some(Ok(())) => true,
        Some(Err(Error::Unavailable(_))) => {
            report.unavailable += 1;
            false
        }
        Some(Err(error)) => panic!("{what} failed: {error}"),
        None => {
            report.dropped += 1;
            let each = SWEPT.iter().position(|op| *op == what);
            report.dropped_each[each.expect("a swept operation")] += 1;
            false
        }
    }
}

/// Drops each store operation at its 1st, 2nd, … poll until it completes undropped (see
/// [`DropPoints`]), and after every drop asserts that nothing is left behind:
///
/// - `begin`: the key is answerable again long before the lease would free it: a lease the
///   dropped call was granted was released, not orphaned;
/// - `begin` taking over an unfinished attempt: the key answers `TakeOver` again at once (the
///   earlier attempt's outcome is still unknown), neither `InFlight` nor `Execute`;
/// - `complete`: the owner completes again: `Ok` (the store's `complete` is idempotent, so a
///   dropped call that landed is no error), and the key replays that outcome;
/// - `release`: the owner releases again (`Ok`, or `LeaseLost` because the dropped one
///   landed), and the key executes;
/// - `renew`: the owner renews again and still owns the key.
///
/// An `Unavailable` answer is checked the same way: whatever it may have written late must
/// not change the next answer.
pub async fn sweep(store: &dyn Store) -> SweepReport {
    let mut report = SweepReport::default();
    let outcome = sample_outcome();
    let mut points = DropPoints::new("begin");
    while let Some(k) = points.next() {
        let id = fresh_id();
        let call = drop_at_poll(store.begin(&id, &fp("a"), SWEEP_LEASE), k).await;
        let answered = call.map(|begun| {
            begun.map(|answer| {
                assert!(
                    matches!(answer, Begin::Execute(_)),
                    "a fresh key answered {answer:?}"
                );
            })
        });
        let finished = tally(&mut report, answered, "begin");
        if finished {
            points.finished();
            continue;
        }
        // `TakeOver` too: a claim given up on mid-flight may be ended rather than deleted
        // (Postgres, when it cannot tell whether the claim took an unfinished lease over).
        match answer_within(store, &id, &fp("a")).await {
            Begin::Execute(_) | Begin::TakeOver(_) => {}
            other => panic!("after begin dropped at poll {k}: {other:?}"),
        }
    }
    let mut points = DropPoints::new("a takeover");
    while let Some(k) = points.next() {
        // A takeover of an attempt whose outcome is unknown: given up on, it must leave the
        // record as it found it — unfinished, its lease over — not a lease nobody holds
        // (`InFlight` for a lease) nor a fresh key (`Execute`: a retry under
        // `OutcomeUnknown::Reject` would then run the operation as new).
        let id = fresh_id();
        let crashed = execute(store, &id, &fp("a"), SWEEP_LEASE).await;
        store
            .renew(&id, crashed, Duration::ZERO)
            .await
            .expect("end the lease, as after a crash");
        let call = drop_at_poll(store.begin(&id, &fp("a"), SWEEP_LEASE), k).await;
        let answered = call.map(|begun| {
            begun.map(|answer| {
                assert!(
                    matches!(answer, Begin::TakeOver(_)),
                    "an unfinished attempt answered {answer:?}"
                );
            })
        });
        let finished = tally(&mut report, answered, "a takeover");
        if finished {
            points.finished();
            continue;
        }
        match answer_within(store, &id, &fp("a")).await {
            Begin::TakeOver(_) => {}
            other => panic!("after a takeover dropped at poll {k}: {other:?}"),
        }
    }
    let mut points = DropPoints::new("complete");
    while let Some(k) = points.next() {
        let id = fresh_id();
        let token = execute(store, &id, &fp("a"), SWEEP_LEASE).await;
        let call = drop_at_poll(store.complete(&id, token, &outcome, LONG), k).await;
        let finished = tally(&mut report, call, "complete");
        store
            .complete(&id, token, &outcome, LONG)
            .await
            .unwrap_or_else(|e| panic!("completing again after a drop at poll {k}: {e}"));
        assert_eq!(
            answer_within(store, &id, &fp("a")).await,
            Begin::Replay(outcome.clone()),
            "after complete dropped at poll {k}"
        );
        if finished {
            points.finished();
        }
    }
    let mut points = DropPoints::new("release");
    while let Some(k) = points.next() {
        let id = fresh_id();
        let token = execute(store, &id, &fp("a"), SWEEP_LEASE).await;
        let call = drop_at_poll(store.release(&id, token), k).await;
        let finished = tally(&mut report, call, "release");
        match store.release(&id, token).await {
            Ok(()) | Err(Error::LeaseLost) => {}
            Err(error) => panic!("releasing again after a drop at poll {k}: {error}"),
        }
        match answer_within(store, &id, &fp("a")).await {
            Begin::Execute(_) => {}
            other => panic!("after release dropped at poll {k}: {other:?}"),
        }
        if finished {
            points.finished();
        }
    }
    let mut points = DropPoints::new("renew");
    while let Some(k) = points.next() {
        let id = fresh_id();
        let token = execute(store, &id, &fp("a"), SWEEP_LEASE).await;
        let call = drop_at_poll(store.renew(&id, token, SWEEP_LEASE), k).await;
        let finished = tally(&mut report, call, "renew");
        store
            .renew(&id, token, SWEEP_LEASE)
            .await
            .unwrap_or_else(|e| panic!("renewing again after a drop at poll {k}: {e}"));
        assert!(
            matches!(
                store.begin(&id, &fp("a"), SWEEP_LEASE).await,
                Ok(Begin::InFlight { .. })
            ),
            "after renew dropped at poll {k}, the owner must still hold the key"
        );
        store
            .complete(&id, token, &outcome, LONG)
            .await
            .expect("the owner completes");
        if finished {
            points.finished();
        }
    }
    report
}

/// The conformance case around [`sweep`]: every store passes it with its services healthy.
///
/// A call can finish at its first poll when the test's thread was descheduled between handing
/// the call off and waiting for the answer (2 busy cores do that). Each sweep already calls
/// such an operation again (see [`DropPoints`]); a sweep that still dropped nothing is run
/// again, up to [`SWEEP_ROUNDS`] times, until a call of each operation has been dropped.
pub async fn dropped_calls_leave_the_key_answerable(store: Arc<dyn Store>) {
    if store.name() == "memory" {
        // Every call finishes at its first poll: nothing to drop (still run: each call is
        // checked to leave the key answerable).
        sweep(&*store).await;
        return;
    }
    let report = sweep_every_operation(&*store).await;
    assert!(
        report.never_dropped().is_empty(),
        "the sweep never dropped a call of {:?}: {report:?}",
        report.never_dropped()
    );
}

/// [`sweep`], again up to [`SWEEP_ROUNDS`] times until a call of each operation was dropped;
/// the rounds' counts added up.
pub async fn sweep_every_operation(store: &dyn Store) -> SweepReport {
    let mut report = sweep(store).await;
    for _ in 1..SWEEP_ROUNDS {
        if report.never_dropped().is_empty() {
            break;
        }
        report.add(&sweep(store).await);
    }
    report
}
