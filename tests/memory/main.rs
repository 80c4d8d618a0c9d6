//! The conformance suite against the in-process memory store.

use std::sync::Arc;

use idempotency_core::{MemoryStore, Store};

idempotency_test::conformance_tests!(async {
    // Cases use fresh keys, so one store serves them all, as a container does for the others.
    static STORE: std::sync::OnceLock<Arc<dyn Store>> = std::sync::OnceLock::new();
    Some(STORE.get_or_init(|| Arc::new(MemoryStore::new())).clone())
});

/// A release that fails (a store blip) after the operation failed is retried, not left to
/// hold the key for a lease (and then come back as an attempt whose outcome is unknown).
#[test]
fn an_executor_release_that_failed_is_retried() {
    use std::time::Duration;

    use idempotency_core::{
        Begin, Executor, Fingerprint, IdempotencyKey, RecordId, RunError, Scope,
    };
    use idempotency_test::late::LateBegin;

    idempotency_test::block_on(async {
        let store = Arc::new(LateBegin::new(MemoryStore::new(), Duration::ZERO));
        let executor = Executor::new(store.clone());
        let (scope, key, fp) = (
            Scope::new("release"),
            IdempotencyKey::new("k").expect("key"),
            Fingerprint::of(b"p"),
        );
        store.fail_releases(1);
        let failed = executor
            .run(&scope, &key, &fp, || async {
                Err::<u8, _>("declined by the network")
            })
            .await;
        assert!(matches!(failed, Err(RunError::Failed(_))), "{failed:?}");
        executor.drain().await;
        let again = store
            .inner()
            .begin(&RecordId::new(&scope, &key), &fp, Duration::from_secs(30))
            .await
            .expect("begin");
        assert!(matches!(again, Begin::Execute(_)), "{again:?}");
    });
}

/// An operation whose lease was lost while it ran is stopped at its await, before the effect
/// it had not reached yet: its renewals failed for longer than a lease (a store unreachable
/// from this worker only), a redelivery took the key over and ran the operation, and this
/// worker's next renewal was answered `LeaseLost`. So too after an operator released the
/// live lease of a holder thought stuck.
#[tokio::test(start_paused = true)]
async fn an_operation_whose_lease_was_lost_is_stopped() {
    use std::{
        sync::atomic::{AtomicUsize, Ordering},
        time::Duration,
    };

    use idempotency_core::{
        Begin, Executor, Fingerprint, IdempotencyKey, Policy, RecordId, ReleaseScope, RunError,
        Scope,
    };
    use idempotency_test::late::LateBegin;

    let store = Arc::new(LateBegin::new(MemoryStore::new(), Duration::ZERO));
    let lease = Duration::from_secs(3);
    let executor = Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease));
    let scope = Scope::new("lost");
    let fp = Fingerprint::of(b"p");
    for operator in [false, true] {
        let key = IdempotencyKey::new(if operator { "released" } else { "taken" }).expect("key");
        let id = RecordId::new(&scope, &key);
        let effects = Arc::new(AtomicUsize::new(0));
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let effect = effects.clone();
        let run = executor.run(&scope, &key, &fp, || async move {
            let _ = wait.await; // e.g. a fraud check, before the charge
            effect.fetch_add(1, Ordering::SeqCst);
            Ok::<_, &str>(1)
        });
        let elsewhere = async {
            if operator {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let released = store
                    .inner()
                    .force_release(&id, ReleaseScope::default().with_live())
                    .await;
                assert!(released.is_ok(), "{released:?}");
            } else {
                store.fail_renewals(u64::MAX);
                tokio::time::sleep(lease * 2).await;
                let taken = store.inner().begin(&id, &fp, lease).await.expect("begin");
                assert!(matches!(taken, Begin::TakeOver(_)), "{taken:?}");
                store.fail_renewals(0); // reachable again
            }
            tokio::time::sleep(lease).await; // past this worker's next renewal
            let _ = go.send(());
        };
        let (ran, ()) = tokio::join!(run, elsewhere);
        assert!(matches!(ran, Err(RunError::LeaseLost)), "{ran:?}");
        assert_eq!(
            effects.load(Ordering::SeqCst),
            0,
            "the effect ran after the lease was lost"
        );
    }
}

/// A claim answered late (40 % of the lease after the store granted it) leaves the operation
/// as many renewals before its lease runs out as a quick one, so one failed renewal does not
/// lose it. The renewals were timed from the operation's first wait, not from the ask the
/// store counts the lease from: the first came at 73 % of the lease and failed, the next
/// after the lease had run out, and a redelivery in between took the key over.
#[tokio::test(start_paused = true)]
async fn a_slow_claim_leaves_the_operation_every_renewal() {
    use std::time::Duration;

    use idempotency_core::{Begin, Executor, Fingerprint, IdempotencyKey, Policy, RecordId, Scope};
    use idempotency_test::late::LateBegin;

    let lease = Duration::from_secs(6);
    let store = Arc::new(LateBegin::new(MemoryStore::new(), lease * 2 / 5));
    store.fail_renewals(1); // a blip, which a lease is meant to ride out
    let executor = Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease));
    let (scope, key, fp) = (
        Scope::new("slow-claim"),
        IdempotencyKey::new("k").expect("key"),
        Fingerprint::of(b"p"),
    );
    let id = RecordId::new(&scope, &key);
    let (go, wait) = tokio::sync::oneshot::channel::<()>();
    let run = executor.run(&scope, &key, &fp, || async move {
        let _ = wait.await;
        Ok::<_, &str>(1)
    });
    let redelivery = async {
        // Just past the lease as first granted, while the operation still runs.
        tokio::time::sleep(lease + Duration::from_millis(200)).await;
        let taken = store.inner().begin(&id, &fp, lease).await.expect("begin");
        let _ = go.send(());
        taken
    };
    let (ran, taken) = tokio::join!(run, redelivery);
    assert!(matches!(taken, Begin::InFlight { .. }), "{taken:?}");
    let ran = ran.expect("the run kept its lease");
    assert!(!ran.replayed);
}

/// Renewals that fail for a while (a store blip) hold the operation at its lease's gate, five
/// sixths of a lease after the last renewal that answered; the executor then renews at once,
/// as the layer does, and the operation goes on as soon as the store answers. Before, it
/// waited for its schedule's next tick, a sixth of a lease later (here 2.5 s of its run held
/// to 3 s; at the default lease, five seconds for every blip of two renewals).
#[tokio::test(start_paused = true)]
async fn an_operation_at_its_gate_is_renewed_at_once() {
    use std::time::Duration;

    use idempotency_core::{Executor, Fingerprint, IdempotencyKey, Policy, Scope};
    use idempotency_test::late::LateBegin;

    let lease = Duration::from_secs(3);
    let store = Arc::new(LateBegin::new(MemoryStore::new(), Duration::ZERO));
    store.fail_renewals(2); // the renewals at 1 s and 2 s
    let executor = Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease));
    let (scope, key, fp) = (
        Scope::new("gate"),
        IdempotencyKey::new("k").expect("key"),
        Fingerprint::of(b"p"),
    );
    let started = tokio::time::Instant::now();
    let ran = executor
        .run(&scope, &key, &fp, || async {
            tokio::time::sleep(Duration::from_millis(2600)).await;
            Ok::<_, &str>(1)
        })
        .await
        .expect("the run kept its lease");
    assert_eq!(ran.value, 1);
    // Paused time: the run's virtual clock, not the machine's.
    assert!(
        started.elapsed() < Duration::from_millis(2700),
        "held at the gate until the schedule's next renewal: {:?}",
        started.elapsed()
    );
}

/// At shutdown, `drain` waits for what dropped runs left to settle: the outcome of one
/// dropped after its operation succeeded, the leases of one dropped mid-operation and one
/// dropped mid-claim.
#[test]
fn executor_drain_waits_for_what_dropped_runs_left_to_settle() {
    use std::time::Duration;

    use idempotency_core::{Executor, Fingerprint, IdempotencyKey, RecordId, Scope};
    use idempotency_test::late::LateBegin;

    idempotency_test::block_on(async {
        let store = Arc::new(LateBegin::new(MemoryStore::new(), Duration::ZERO));
        // Long against the three 50 ms give-ups below: a loaded machine must not let a
        // write land before the checks that come before `drain`.
        store.set_complete_delay(Duration::from_secs(1));
        store.set_release_delay(Duration::from_secs(1));
        let executor = Executor::new(store.clone());
        let (scope, fp) = (Scope::new("drain"), Fingerprint::of(b"p"));
        let record = |key: &str| {
            let key = IdempotencyKey::new(key).expect("key");
            (key.clone(), RecordId::new(&scope, &key))
        };
        let give_up = Duration::from_millis(50);
        // Dropped after its operation succeeded, while its outcome is being stored.
        let (ran, ran_id) = record("ran");
        let run = executor.run(&scope, &ran, &fp, || async { Ok::<_, &str>(1) });
        assert!(tokio::time::timeout(give_up, run).await.is_err());
        // Dropped while its operation runs: the lease is being given back.
        let (cut, cut_id) = record("cut");
        let run = executor.run(&scope, &cut, &fp, || async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok::<_, &str>(2)
        });
        assert!(tokio::time::timeout(give_up, run).await.is_err());
        // Dropped mid-claim (answered after it gave up): the lease is given back.
        store.set_delay(Duration::from_millis(200));
        let (claiming, claiming_id) = record("claiming");
        let run = executor.run(&scope, &claiming, &fp, || async { Ok::<_, &str>(3) });
        assert!(tokio::time::timeout(give_up, run).await.is_err());

        let inspect = |id: RecordId| {
            let store = store.clone();
            async move { store.inner().inspect(&id).await.expect("inspect") }
        };
        let unsettled = inspect(ran_id).await.expect("leased");
        assert!(
            !unsettled.is_completed(),
            "stored before drain: {unsettled:?}"
        );
        assert!(inspect(cut_id).await.is_some() && inspect(claiming_id).await.is_some());
        // Shutdown: once `drain` returns, the process may exit and lose nothing.
        executor.drain().await;
        assert_eq!(store.drains(), 1, "the executor's drain drains its store");
        let stored = inspect(ran_id).await.expect("kept");
        assert!(stored.is_completed(), "{stored:?}");
        assert!(
            inspect(cut_id).await.is_none(),
            "the cut run's lease is given back"
        );
        assert!(
            inspect(claiming_id).await.is_none(),
            "the orphaned claim's too"
        );
    });
}

/// A run held without polling (its caller busy in another branch of a `select!`) after its
/// operation returned, while the outcome is being written: the write goes on in a task of
/// its own, so a redelivery after the lease would have lapsed gets the stored result and the
/// operation runs once. (Written from the held future alone, the lease ran out unrenewed and
/// the redelivery took the key over and ran the operation again.)
#[test]
fn an_executor_run_held_while_its_outcome_is_stored_still_stores_it() {
    use std::{
        sync::atomic::{AtomicUsize, Ordering},
        time::Duration,
    };

    use idempotency_core::{Executor, Fingerprint, IdempotencyKey, Policy, Scope};
    use idempotency_test::late::LateBegin;

    idempotency_test::block_on(async {
        let store = Arc::new(LateBegin::new(MemoryStore::new(), Duration::ZERO));
        store.set_complete_delay(Duration::from_millis(50));
        let lease = Duration::from_millis(600);
        let executor =
            Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease));
        let (scope, fp) = (Scope::new("held"), Fingerprint::of(b"p"));
        let key = IdempotencyKey::new("held-while-stored").expect("key");
        let runs = AtomicUsize::new(0);
        let held = executor.run(&scope, &key, &fp, || async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, &str>(1u32)
        });
        tokio::pin!(held);
        while runs.load(Ordering::SeqCst) == 0 {
            assert!(futures::poll!(&mut held).is_pending());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(lease * 3).await;
        let redelivered = executor
            .run(&scope, &key, &fp, || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, &str>(2u32)
            })
            .await
            .expect("the stored result");
        assert_eq!((redelivered.value, redelivered.replayed), (1, true));
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the operation ran once");
        let first = held.await.expect("stored");
        assert_eq!((first.value, first.replayed), (1, false));
    });
}

/// A lease counts from the ask. A grant read with half its lease or less left (here all of
/// it gone: a retry could have taken the key over and be running the operation) is given
/// back, not acted on; a grant read a quarter of the lease late still runs.
#[test]
fn the_executor_gives_back_a_grant_read_late() {
    use std::{
        sync::atomic::{AtomicUsize, Ordering},
        time::Duration,
    };

    use idempotency_core::{
        Begin, Error, Executor, Fingerprint, IdempotencyKey, Policy, RecordId, RunError, Scope,
    };
    use idempotency_test::late::LateBegin;

    idempotency_test::block_on(async {
        let lease = Duration::from_millis(400);
        let (scope, fp) = (Scope::new("late"), Fingerprint::of(b"p"));
        let key = IdempotencyKey::new("k").expect("key");
        let runs = AtomicUsize::new(0);
        let op = || async { Ok::<_, &str>(runs.fetch_add(1, Ordering::SeqCst)) };
        let store = Arc::new(LateBegin::new(MemoryStore::new(), lease));
        let executor =
            Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease));

        let answer = executor.run(&scope, &key, &fp, op).await;
        assert!(
            matches!(answer, Err(RunError::Store(Error::Unavailable(_)))),
            "{answer:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the operation never ran");
        // Given back (in a task): the next claim is a fresh `Execute`, not a `TakeOver` of an
        // attempt that never ran.
        let id = RecordId::new(&scope, &key);
        executor.drain().await;
        assert!(matches!(
            store.inner().begin(&id, &fp, lease).await,
            Ok(Begin::Execute(_))
        ));

        // Read a quarter of the lease late: more than half is left, so it runs.
        let other = IdempotencyKey::new("k2").expect("key");
        store.set_delay(lease / 4);
        let answer = executor.run(&scope, &other, &fp, op).await;
        assert!(answer.is_ok(), "{answer:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    });
}

/// The purger's pacing, on the memory store with a purge statement that takes 10 ms (of the
/// paused test clock).
mod purger {
    use std::{sync::Arc, time::Duration};

    use idempotency_core::{
        Begin, Fingerprint, IdempotencyKey, MemoryStore, Outcome, Purger, RecordId, Scope, Store,
        spawn_purger,
    };
    use idempotency_test::late::LateBegin;

    const STATEMENT: Duration = Duration::from_millis(10);

    /// A store holding `records` expired records, whose purge statements take `STATEMENT`.
    async fn backlog(records: usize) -> Arc<LateBegin<MemoryStore>> {
        let store = Arc::new(LateBegin::new(MemoryStore::new(), Duration::ZERO));
        let fp = Fingerprint::of(b"purge");
        for i in 0..records {
            let key = IdempotencyKey::new(format!("k{i}")).expect("key");
            let id = RecordId::new(&Scope::new("purge"), &key);
            let Ok(Begin::Execute(token)) = store.begin(&id, &fp, Duration::from_secs(5)).await
            else {
                panic!("a fresh key executes");
            };
            store
                .complete(&id, token, &Outcome::new(201), Duration::from_secs(1))
                .await
                .expect("complete");
        }
        tokio::time::advance(Duration::from_secs(2)).await;
        store.set_purge_delay(STATEMENT);
        store
    }

    fn gaps(store: &LateBegin<MemoryStore>) -> Vec<Duration> {
        store
            .purge_starts()
            .windows(2)
            .map(|w| w[1] - w[0])
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_pass_pauses_after_each_full_batch_in_proportion_to_its_time() {
        let store = backlog(35).await;
        let purger = Purger::new(store.clone()).batch(10).pause(2.0);
        let started = tokio::time::Instant::now();
        assert_eq!(purger.run_once().await.expect("purged"), 35);
        // Four statements (10, 10, 10, 5 records): each full one is followed by twice its
        // time, the short last one by nothing.
        assert_eq!(gaps(&store), vec![STATEMENT * 3; 3]);
        assert_eq!(started.elapsed(), STATEMENT * 10);
        assert_eq!(store.purge_expired(10).await.expect("purge"), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_of_zero_runs_batches_back_to_back() {
        // A NaN or negative factor is no pause either, not a panic in `mul_f64`.
        for factor in [0.0, f64::NAN, -1.0] {
            let store = backlog(25).await;
            let purger = Purger::new(store.clone()).batch(10).pause(factor);
            assert_eq!(purger.run_once().await.expect("purged"), 25);
            assert_eq!(gaps(&store), vec![STATEMENT; 2], "pause {factor}");
        }
    }

    /// An infinite factor (or a huge one) pauses for the interval, no longer: it neither
    /// panics in the arithmetic nor stops the purge for good.
    #[tokio::test(start_paused = true)]
    async fn a_pause_never_outlasts_the_interval() {
        let store = backlog(25).await;
        let interval = Duration::from_secs(1);
        let purger = Purger::new(store.clone())
            .every(interval)
            .batch(10)
            .pause(f64::INFINITY);
        assert_eq!(purger.run_once().await.expect("purged"), 25);
        assert_eq!(gaps(&store), vec![STATEMENT + interval; 2]);
        // Nor does a zero interval panic the task (Tokio's interval refuses zero).
        let store = backlog(0).await;
        let purger = Purger::new(store.clone()).every(Duration::ZERO).spawn();
        tokio::time::sleep(STATEMENT * 3).await;
        purger.shutdown().await;
        assert!(
            store.purge_starts().len() >= 2,
            "{:?}",
            store.purge_starts()
        );
    }

    /// Before pacing, `spawn_purger` ran a backlog's batches back to back, so a purge kept a
    /// database core busy for as long as the backlog lasted.
    #[tokio::test(start_paused = true)]
    async fn spawn_purger_paces_its_batches() {
        let store = backlog(35).await;
        let purger = spawn_purger(store.clone(), Duration::from_secs(60), 10);
        while store.purge_starts().len() < 4 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        purger.shutdown().await;
        assert_eq!(gaps(&store), vec![STATEMENT * 3; 3]);
    }

    /// A dropped handle dropped the stop signal's sender, which the task read as "stop":
    /// `let _ = spawn_purger(..)` ran one pass at most, and never again.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_handle_leaves_the_purger_running() {
        let store = backlog(0).await;
        drop(spawn_purger(store.clone(), Duration::from_secs(60), 10));
        tokio::time::sleep(Duration::from_secs(150)).await;
        // Passes at 0 s, 60 s and 120 s.
        assert_eq!(store.purge_starts().len(), 3);
    }

    /// A store whose purge panics once does not stop the purger: the pass fails as for an
    /// unavailable store, and the next tick purges. The panic ended its task, and expired
    /// records piled up for good (in the demo's default memory store too).
    #[tokio::test(start_paused = true)]
    async fn a_purge_that_panics_does_not_stop_the_purger() {
        let store = backlog(5).await;
        store.panic_purges(1);
        let purger = spawn_purger(store.clone(), Duration::from_secs(60), 10);
        tokio::time::sleep(Duration::from_secs(90)).await;
        // Passes at 0 s (it panicked) and 60 s.
        assert_eq!(store.purge_starts().len(), 2);
        assert_eq!(store.purge_expired(10).await.expect("purge"), 0, "purged");
        purger.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_between_passes_runs_no_batch() {
        let store = backlog(0).await;
        let purger = spawn_purger(store.clone(), Duration::from_secs(60), 10);
        tokio::time::sleep(Duration::from_secs(30)).await;
        let asked = tokio::time::Instant::now();
        purger.shutdown().await;
        assert_eq!(asked.elapsed(), Duration::ZERO);
        assert_eq!(store.purge_starts().len(), 1);
        // Nor one asked before the first tick.
        let store = backlog(0).await;
        spawn_purger(store.clone(), Duration::from_secs(60), 10)
            .shutdown()
            .await;
        assert!(store.purge_starts().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_cuts_a_pause_short() {
        let store = backlog(100).await;
        let purger = Purger::new(store.clone()).batch(10).pause(1_000.0).spawn();
        // Past the first batch, into its 10 s pause.
        tokio::time::sleep(STATEMENT * 2).await;
        assert_eq!(store.purge_starts().len(), 1);
        let asked = tokio::time::Instant::now();
        purger.shutdown().await;
        assert_eq!(asked.elapsed(), Duration::ZERO);
        assert_eq!(store.purge_starts().len(), 1);
        assert_eq!(store.purge_expired(100).await.expect("purge"), 90);
    }
}

/// The record of an attempt whose outcome is unknown (its lease ran out unfinished: a crash
/// mid-charge) is kept as long as a completed outcome is by default, a day: a retry two
/// hours after the crash is still told `TakeOver`, so `OutcomeUnknown::Reject` and
/// `Reconcile` see it, instead of `Execute`, which ran the charge a second time. Only past
/// the day does the purge forget it.
#[test]
fn an_unknown_outcome_is_kept_for_a_day_not_an_hour() {
    use std::time::Duration;

    use idempotency_core::{Begin, Fingerprint, IdempotencyKey, RecordId, Scope};

    idempotency_test::block_on(async {
        let store = MemoryStore::with_manual_clock();
        let lease = Duration::from_secs(30);
        let fp = Fingerprint::of(b"amount=100");
        let [retried, forgotten] = ["retried", "forgotten"].map(|key| {
            RecordId::new(
                &Scope::new("unknown"),
                &IdempotencyKey::new(key).expect("key"),
            )
        });
        for id in [&retried, &forgotten] {
            let claimed = store.begin(id, &fp, lease).await.expect("begin");
            assert!(matches!(claimed, Begin::Execute(_)), "{claimed:?}");
        }

        store.advance(lease + Duration::from_secs(2 * 3600));
        assert_eq!(store.purge_expired(100).await.expect("purge"), 0);
        let retry = store.begin(&retried, &fp, lease).await.expect("begin");
        assert!(
            matches!(retry, Begin::TakeOver(_)),
            "two hours on: {retry:?}"
        );

        store.advance(Duration::from_secs(22 * 3600) + Duration::from_secs(1));
        // The takeover's own lease ran out two hours later: it is kept until then plus a day.
        assert_eq!(store.purge_expired(100).await.expect("purge"), 1);
        let retry = store.begin(&forgotten, &fp, lease).await.expect("begin");
        assert!(matches!(retry, Begin::Execute(_)), "a day on: {retry:?}");
    });
}

/// The store refuses the outcome for longer than a lease right after the operation ran: the
/// run answers `NotStored` ("it ran"), and storing the outcome goes on in the background
/// until the store takes it. The next delivery then replays; before, the lease ran out with
/// nothing stored, and it took the key over and ran the operation a second time.
#[test]
fn an_outcome_not_stored_within_the_lease_is_stored_later() {
    use std::time::Duration;

    use idempotency_core::{Executor, Fingerprint, IdempotencyKey, Policy, RunError, Scope};
    use idempotency_test::late::LateBegin;

    idempotency_test::block_on(async {
        let store = Arc::new(LateBegin::new(MemoryStore::new(), Duration::ZERO));
        let executor = Executor::new(store.clone())
            .with_policy(Policy::default().with_lease(Duration::from_secs(1)));
        let (scope, key, fp) = (
            Scope::new("late"),
            IdempotencyKey::new("k").expect("key"),
            Fingerprint::of(b"p"),
        );
        // Five tries at most fit in a lease of a second; the rest, in the background, fail
        // until the eleventh lands.
        store.fail_completes(10);
        store.fail_renewals(10); // the whole store is down, not only this outcome refused
        let first = executor
            .run(&scope, &key, &fp, || async {
                Ok::<_, ()>("charged".to_owned())
            })
            .await;
        assert!(matches!(first, Err(RunError::NotStored(_))), "{first:?}");
        executor.drain().await; // the background write, until the store took it
        tokio::time::sleep(Duration::from_millis(1500)).await; // the lease is long over
        replays(&executor, &(scope, key, fp), "charged").await;
    });
}

/// A store that takes the lease's renewals while it refuses outcomes for a while (the
/// Postgres store's group commit runs completes and renewals in separate batches: a full
/// queue of completes, a batch of them past the statement timeout) is not refusing this
/// outcome for good: the background write keeps trying for a whole lease of such refusals,
/// and stores it. It gave up after three, within a second, and a retry after the lease ran
/// the operation a second time.
#[test]
fn an_outcome_refused_for_less_than_a_lease_while_renewals_pass_is_stored_late() {
    use std::time::Duration;

    use idempotency_core::{Executor, Fingerprint, IdempotencyKey, Policy, RunError, Scope};
    use idempotency_test::late::LateBegin;

    idempotency_test::block_on(async {
        let store = Arc::new(LateBegin::new(MemoryStore::new(), Duration::ZERO));
        let lease = Duration::from_secs(5);
        let executor =
            Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease));
        let (scope, key, fp) = (
            Scope::new("refused-a-while"),
            IdempotencyKey::new("k").expect("key"),
            Fingerprint::of(b"p"),
        );
        // About nine tries fit in the lease; the background write meets four more refusals
        // (within a second and a half), then the store takes it.
        store.fail_completes(13);
        let first = executor
            .run(&scope, &key, &fp, || async {
                Ok::<_, ()>("charged".to_owned())
            })
            .await;
        assert!(matches!(first, Err(RunError::NotStored(_))), "{first:?}");
        executor.drain().await;
        tokio::time::sleep(lease).await; // the lease is long over
        replays(&executor, &(scope, key, fp), "charged").await;
    });
}

/// A store that takes the lease's renewals but refuses the outcome (too large, a
/// constraint) is up: the background write gives up after three such refusals instead of
/// holding the key "in flight" for an hour, and `drain` does not wait for it that long.
#[test]
fn an_outcome_a_live_store_keeps_refusing_is_not_retried_for_an_hour() {
    use std::time::Duration;

    use idempotency_core::{Executor, Fingerprint, IdempotencyKey, Policy, RunError, Scope};
    use idempotency_test::late::LateBegin;

    idempotency_test::block_on(async {
        let store = Arc::new(LateBegin::new(MemoryStore::new(), Duration::ZERO));
        let executor = Executor::new(store.clone())
            .with_policy(Policy::default().with_lease(Duration::from_secs(1)));
        let (scope, key, fp) = (
            Scope::new("refused"),
            IdempotencyKey::new("k").expect("key"),
            Fingerprint::of(b"p"),
        );
        store.fail_completes(1_000);
        let first = executor
            .run(&scope, &key, &fp, || async { Ok::<_, ()>(1u8) })
            .await;
        assert!(matches!(first, Err(RunError::NotStored(_))), "{first:?}");
        let drained = tokio::time::timeout(Duration::from_secs(60), executor.drain()).await;
        assert!(drained.is_ok(), "the background write gave up");
    });
}

/// A store that refuses an outcome for good while its renewals fail now and then (a flaky
/// path to it) is still refusing that outcome: the background write gives up after refusals
/// spanning a lease. A failed renewal restarted the count, so renewals failing every other
/// try held the key "in flight" for the whole hour's grace (the code before `997b04f`).
#[tokio::test(start_paused = true)]
async fn an_outcome_refused_for_good_while_renewals_fail_now_and_then_is_given_up() {
    use std::time::Duration;

    use idempotency_core::{Begin, Fingerprint, Outcome, RecordId, complete_late};
    use idempotency_test::late::LateBegin;

    let store = LateBegin::new(MemoryStore::new(), Duration::ZERO);
    let (id, fp, lease) = (
        RecordId::from_bytes([4; 32]),
        Fingerprint::of(b"a charge"),
        Duration::from_secs(1),
    );
    let Ok(Begin::Execute(token)) = store.begin(&id, &fp, lease).await else {
        panic!("a fresh key executes");
    };
    store.fail_completes(u64::MAX);
    store.fail_every_other_renewal();
    let outcome = Outcome::new(201);
    let given_up = tokio::time::timeout(
        Duration::from_secs(120),
        complete_late(&store, &id, token, &outcome, Duration::from_secs(60), lease),
    )
    .await;
    assert_eq!(
        given_up,
        Ok(false),
        "the write gave up within two minutes (of the paused clock)"
    );
}

/// An attempt whose lease ran out unfinished is remembered (`TakeOver`: its outcome unknown)
/// a day by default, and as long as configured: a store whose outcomes are kept longer than a
/// day must remember a crash as long, or a retry on the second day runs as new.
#[tokio::test(start_paused = true)]
async fn an_unknown_outcome_is_kept_as_long_as_configured() {
    use std::time::Duration;

    use idempotency_core::{Begin, Fingerprint, RecordId};

    let day = Duration::from_secs(24 * 3600);
    let (id, fp) = (RecordId::from_bytes([3; 32]), Fingerprint::of(b"a charge"));
    let default = MemoryStore::new();
    let week = MemoryStore::new().with_unknown_outcome_retention(7 * day);
    for store in [&default, &week] {
        let begun = store.begin(&id, &fp, Duration::from_secs(1)).await;
        assert!(matches!(begun, Ok(Begin::Execute(_))), "{begun:?}"); // then it crashed
    }
    tokio::time::advance(2 * day).await;
    assert_eq!(default.purge_expired(100).await.expect("purge"), 1);
    assert_eq!(week.purge_expired(100).await.expect("purge"), 0);
    let again = week.begin(&id, &fp, Duration::from_secs(30)).await;
    assert!(matches!(again, Ok(Begin::TakeOver(_))), "{again:?}");
}

/// Two `complete`s of one token at once (a retry of one whose answer was lost) both
/// succeed: the first outcome stands. The check for "completed by this token already" and
/// the write took the lock apart, so the slower call could find the record completed between
/// them and answer `LeaseLost`.
#[test]
fn two_completes_of_one_token_at_once_both_succeed() {
    use std::{sync::Barrier, time::Duration};

    use idempotency_core::{Begin, Fingerprint, Outcome, RecordId};

    for round in 0..2_000_u32 {
        let store = Arc::new(MemoryStore::new());
        let mut bytes = [0; 32];
        bytes[..4].copy_from_slice(&round.to_be_bytes());
        let (id, fp) = (RecordId::from_bytes(bytes), Fingerprint::of(b"a charge"));
        let Ok(Begin::Execute(token)) =
            futures::executor::block_on(store.begin(&id, &fp, Duration::from_secs(30)))
        else {
            panic!("a fresh key executes");
        };
        let start = Arc::new(Barrier::new(2));
        let calls: Vec<_> = (0..2)
            .map(|_| {
                let (store, start) = (store.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let outcome = Outcome::new(201);
                    let retention = Duration::from_secs(60);
                    futures::executor::block_on(store.complete(&id, token, &outcome, retention))
                })
            })
            .collect();
        for call in calls {
            let answer = call.join().expect("thread");
            assert!(answer.is_ok(), "round {round}: {answer:?}");
        }
    }
}

/// The purge works from a queue of deadlines, not a scan of every record: each record goes
/// when the deadline it has now passes, whatever deadlines it had before (a renewal, a
/// completion, a release and a new attempt each leave an older entry behind), in batches, in
/// a snapshot as in the original.
#[test]
fn the_purge_removes_each_record_at_its_current_deadline() {
    use std::time::Duration;

    use idempotency_core::{Begin, Fingerprint, Outcome, RecordId, Store};

    idempotency_test::block_on(async {
        let store = MemoryStore::with_manual_clock();
        let (fp, lease) = (Fingerprint::of(b"purge"), Duration::from_secs(30));
        let (hour, day) = (Duration::from_secs(3600), Duration::from_secs(24 * 3600));
        let id = |n: u8| RecordId::from_bytes([n; 32]);
        let execute = |n: u8| {
            let store = &store;
            async move {
                match store.begin(&id(n), &fp, lease).await.expect("begin") {
                    Begin::Execute(token) | Begin::TakeOver(token) => token,
                    other => panic!("{other:?}"),
                }
            }
        };
        let outcome = Outcome::new(201);
        // 1, 2, 3: completed, kept an hour.
        for n in 1..=3 {
            let token = execute(n).await;
            store
                .complete(&id(n), token, &outcome, hour)
                .await
                .expect("complete");
        }
        // 4: completed, kept two days (its lease's deadline, a day on, comes first).
        let token = execute(4).await;
        store
            .complete(&id(4), token, &outcome, 2 * day)
            .await
            .expect("complete");
        // 5: released, then run again and kept two days.
        let token = execute(5).await;
        store.release(&id(5), token).await.expect("release");
        let token = execute(5).await;
        store
            .complete(&id(5), token, &outcome, 2 * day)
            .await
            .expect("complete");
        // 6: still running an hour on, renewed for two days.
        let running = execute(6).await;
        store.advance(hour - Duration::from_secs(1));
        store.renew(&id(6), running, 2 * day).await.expect("renew");
        store.advance(Duration::from_secs(1));

        let copy = store.snapshot();
        for store in [&store, &copy] {
            assert_eq!(store.purge_expired(2).await.expect("purge"), 2, "a batch");
            assert_eq!(store.purge_expired(2).await.expect("purge"), 1);
            assert_eq!(store.purge_expired(2).await.expect("purge"), 0);
            assert_eq!(store.len(), 3);
            store.advance(day + lease);
            assert_eq!(
                store.purge_expired(100).await.expect("purge"),
                0,
                "a day on: 4 and 5 are kept two days, 6's lease was renewed"
            );
            assert_eq!(store.len(), 3);
            store.advance(day);
            assert_eq!(store.purge_expired(100).await.expect("purge"), 2);
            assert_eq!(
                store.len(),
                1,
                "6's lease ended a day ago, an unknown outcome"
            );
            store.advance(day);
            assert_eq!(store.purge_expired(100).await.expect("purge"), 1);
            assert!(store.is_empty());
        }
    });
}

/// An operation that stored its own result and returned `Ok` while the store refused every
/// call for a whole lease: the executor cannot confirm that its transaction committed, so it
/// writes nothing and says so (`Unconfirmed`), and its release goes on in the background.
/// Whatever happened, the key then answers right: a completion that committed replays; one
/// that did not (the transaction rolled back) is released, and the next run executes. Were
/// the value stored instead, the rolled-back case would replay a result never committed.
#[test]
fn a_commit_the_executor_cannot_confirm_is_left_to_the_store() {
    use std::time::Duration;

    use idempotency_core::RunError;

    idempotency_test::block_on(async {
        for committed in [true, false] {
            let (store, executor, (scope, key, fp)) = faulty(Duration::from_secs(1), "unconfirmed");
            // About five tries fit in a lease of a second; the background release lands on
            // its third. The renewals between the tries fail too: the whole store is down.
            store.fail_releases(8);
            store.fail_renewals(20);
            let inner = store.clone();
            let first = executor
                .run_with_claim(&scope, &key, &fp, |claim| async move {
                    let c = claim.completion(&"charged".to_owned()).expect("completion");
                    if committed {
                        inner
                            .complete(&c.id, c.token, &c.outcome, c.retention)
                            .await
                            .expect("complete");
                    }
                    claim.accepted(); // … and the transaction committed, or rolled back
                    Ok::<_, ()>("charged".to_owned())
                })
                .await;
            assert!(
                matches!(first, Err(RunError::Unconfirmed(_))),
                "committed: {committed}: {first:?}"
            );
            executor.drain().await; // the background release
            let again = executor
                .run(&scope, &key, &fp, || async {
                    Ok::<_, ()>("charged again".to_owned())
                })
                .await
                .expect("the redelivery");
            let expected = if committed {
                ("charged", true)
            } else {
                ("charged again", false)
            };
            assert_eq!(
                (again.value.as_str(), again.replayed),
                expected,
                "committed: {committed}"
            );
        }
    });
}

/// An operation whose own completion committed, whose next renewal therefore answered
/// `LeaseLost`, and whose read of the record (is that its own commit?) then failed: the run
/// is not stopped on a read that said nothing, and the commit is confirmed once the
/// operation returns. Before, a failed read counted as "not completed": the run was stopped
/// and answered `LeaseLost` for a charge that had committed.
#[test]
fn a_failed_read_after_the_runs_own_commit_does_not_stop_it() {
    use std::time::Duration;

    idempotency_test::block_on(async {
        // Renewed every 100 ms: the operation outlasts several renewals after its commit.
        let (store, executor, keyed) = faulty(Duration::from_millis(300), "read");
        let (scope, key, fp) = &keyed;
        store.fail_inspects(1);
        let inner = store.clone();
        let done = executor
            .run_with_claim(scope, key, fp, |claim| async move {
                let c = claim.completion(&"charged".to_owned()).expect("completion");
                inner
                    .complete(&c.id, c.token, &c.outcome, c.retention)
                    .await
                    .expect("complete");
                claim.accepted(); // … and the transaction committed
                tokio::time::sleep(Duration::from_millis(500)).await;
                Ok::<_, ()>("charged".to_owned())
            })
            .await
            .expect("the run is not stopped by a read that failed");
        assert_eq!((done.value.as_str(), done.replayed), ("charged", false));
        replays(&executor, &keyed, "charged").await;
    });
}

/// An operation that stored its own result and returned `Ok`, though its transaction rolled
/// back; the executor's release, which confirms that, went through but its answer was lost,
/// and the retry is refused (the record is gone). A refusal is no confirmation of a commit:
/// the executor's completion, which a record this token completed would accept, is refused
/// too, and with no record left (its own release, or a committed record forgotten?) the run
/// answers `Unconfirmed`: redeliver. The redelivery runs. Before, the refusal read as
/// "committed", and the run answered `NotStored` ("it ran"), which a consumer acknowledges:
/// a charge never applied was dropped.
#[test]
fn a_confirmation_whose_release_answer_was_lost_is_not_a_commit() {
    use std::time::Duration;

    use idempotency_core::RunError;

    idempotency_test::block_on(async {
        let (store, executor, (scope, key, fp)) = faulty(Duration::from_secs(30), "lost-answer");
        store.lose_release_answers(1);
        let first = executor
            .run_with_claim(&scope, &key, &fp, |claim| async move {
                let _completion = claim.completion(&"charged".to_owned()).expect("completion");
                claim.accepted(); // … and then the transaction rolled back
                Ok::<_, ()>("charged".to_owned())
            })
            .await;
        assert!(matches!(first, Err(RunError::Unconfirmed(_))), "{first:?}");
        let again = executor
            .run(&scope, &key, &fp, || async {
                Ok::<_, ()>("charged on the redelivery".to_owned())
            })
            .await
            .expect("the redelivery");
        assert_eq!(
            (again.value.as_str(), again.replayed),
            ("charged on the redelivery", false)
        );
    });
}

/// A store whose `complete` panics once (a bug in it) after the operation ran: the executor
/// takes that for a failed write and tries again, so the outcome is stored and the next run
/// replays it. Before, the panic came out of the run with nothing stored and nothing
/// released, and the run after the lease took the key over and ran the operation again.
#[test]
fn a_store_whose_completion_panics_once_still_stores_the_outcome() {
    use std::{
        sync::atomic::{AtomicUsize, Ordering},
        time::Duration,
    };

    use futures::FutureExt as _;

    idempotency_test::block_on(async {
        let (store, executor, (scope, key, fp)) = faulty(Duration::from_millis(500), "panics");
        store.panic_completes(1);
        let runs = AtomicUsize::new(0);
        let op = || async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, ()>("charged".to_owned())
        };
        let first = std::panic::AssertUnwindSafe(executor.run(&scope, &key, &fp, op))
            .catch_unwind()
            .await;
        assert!(
            matches!(&first, Ok(Ok(done)) if done.value == "charged"),
            "the run ends as if the first write had failed: {:?}",
            first.as_ref().map(|r| r.as_ref().map(|d| &d.value))
        );
        tokio::time::sleep(Duration::from_millis(600)).await; // past the lease
        let again = executor.run(&scope, &key, &fp, op).await.expect("again");
        assert!(again.replayed, "the outcome was stored");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    });
}

/// A run polled outside a Tokio runtime (here `futures`' executor), or on one without its
/// timer, claims nothing and runs nothing: it could not renew its lease or store its
/// outcome in a task. Before, the
/// operation ran, the run panicked when it came to store the outcome, and the lease was left
/// to run out: the next run took the key over and ran the operation again.
#[test]
fn a_run_outside_a_tokio_runtime_runs_nothing() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::FutureExt as _;
    use idempotency_core::{Error, RunError};

    let (_, _, (scope, key, fp)) = faulty(std::time::Duration::from_millis(200), "runtime");
    let executor = idempotency_core::Executor::new(Arc::new(MemoryStore::new())).with_policy(
        idempotency_core::Policy::default().with_lease(std::time::Duration::from_millis(200)),
    );
    let runs = AtomicUsize::new(0);
    let op = || async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, ()>("charged".to_owned())
    };
    let outside = futures::executor::block_on(
        std::panic::AssertUnwindSafe(executor.run(&scope, &key, &fp, op)).catch_unwind(),
    );
    assert!(
        matches!(outside, Ok(Err(RunError::Store(Error::Config(_))))),
        "{:?}",
        outside.as_ref().map(|r| r.as_ref().map(|d| &d.value))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the operation ran");
    // A runtime without its timer: no renewal could run either.
    let timerless = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    let without_timer = timerless
        .block_on(std::panic::AssertUnwindSafe(executor.run(&scope, &key, &fp, op)).catch_unwind());
    assert!(
        matches!(without_timer, Ok(Err(RunError::Store(Error::Config(_))))),
        "{:?}",
        without_timer.as_ref().map(|r| r.as_ref().map(|d| &d.value))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the operation ran");
    idempotency_test::block_on(async {
        let inside = executor.run(&scope, &key, &fp, op).await.expect("a run");
        assert!(!inside.replayed, "the key was left claimed");
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A lease given back while the store is down for minutes (a failover) is given back once
/// the store is back, so the key is free for the retry. Before, the release gave up after a
/// minute and the lease ran out: the key came back as an attempt whose outcome is unknown,
/// which the layer's `Reject` answers 409 for a day, for a request that never ran.
#[tokio::test(start_paused = true)]
async fn a_release_refused_for_minutes_still_lands() {
    use std::time::Duration;

    use idempotency_core::{Begin, Fingerprint, RecordId, Store, release_orphan};

    let store = Faulty::new(MemoryStore::new(), Duration::ZERO);
    let (id, fp, lease) = (
        RecordId::from_bytes([9; 32]),
        Fingerprint::of(b"a charge"),
        Duration::from_secs(10),
    );
    let Ok(Begin::Execute(token)) = store.begin(&id, &fp, lease).await else {
        panic!("a fresh key executes");
    };
    let down_since = tokio::time::Instant::now();
    store.fail_releases(40); // about three minutes of tries, 5 s apart at most
    assert!(release_orphan(&store, &id, token).await);
    assert!(
        down_since.elapsed() > Duration::from_secs(120),
        "{:?}",
        down_since.elapsed()
    );
    assert!(
        matches!(store.begin(&id, &fp, lease).await, Ok(Begin::Execute(_))),
        "the lease was left to run out"
    );
}

/// A short lease (tens of milliseconds, as tests and tight loops use) is renewed every third
/// of it, like any other, so an operation that outlives it keeps its key. Renewals were never
/// closer than 10 ms apart: a lease of 10 ms or less ran out before its first renewal, and a
/// second run took the key over while the first still ran.
#[tokio::test(start_paused = true)]
async fn a_short_lease_is_renewed_every_third_of_it() {
    use std::time::Duration;

    use idempotency_core::{Executor, Fingerprint, IdempotencyKey, Policy, RunError, Scope};

    let executor = Arc::new(
        Executor::new(Arc::new(MemoryStore::new()))
            .with_policy(Policy::default().with_lease(Duration::from_millis(6))),
    );
    let (scope, key, fp) = (
        Scope::new("short"),
        IdempotencyKey::new("k").expect("key"),
        Fingerprint::of(b"p"),
    );
    let (done, wait) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let (executor, scope, key) = (executor.clone(), scope.clone(), key.clone());
        tokio::spawn(async move {
            executor
                .run(&scope, &key, &fp, || async {
                    let _ = wait.await;
                    Ok::<_, ()>("first".to_owned())
                })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await; // three leases
    let second = executor
        .run(&scope, &key, &fp, || async {
            Ok::<_, ()>("second".to_owned())
        })
        .await;
    assert!(
        matches!(second, Err(RunError::InFlight { .. })),
        "{:?}",
        second.map(|d| d.value)
    );
    let _ = done.send(());
    let first = first.await.expect("the first run").expect("it ran");
    assert_eq!(first.value, "first");
}

/// A memory store behind injected faults.
type Faulty = idempotency_test::late::LateBegin<MemoryStore>;
/// A key: its scope, the key, the request's fingerprint.
type Key = (
    idempotency_core::Scope,
    idempotency_core::IdempotencyKey,
    idempotency_core::Fingerprint,
);

/// A memory store behind injected faults, an executor on a lease of `lease` over it, and a
/// key of its own in `scope`.
fn faulty(
    lease: std::time::Duration,
    scope: &str,
) -> (Arc<Faulty>, idempotency_core::Executor<Faulty>, Key) {
    use idempotency_core::{Executor, Fingerprint, IdempotencyKey, Policy, Scope};
    let store = Arc::new(Faulty::new(MemoryStore::new(), std::time::Duration::ZERO));
    let executor = Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease));
    let key = (
        Scope::new(scope),
        IdempotencyKey::new("k").expect("key"),
        Fingerprint::of(b"p"),
    );
    (store, executor, key)
}

/// The key replays `value`: a run on it does not run.
async fn replays(executor: &idempotency_core::Executor<Faulty>, key: &Key, value: &str) {
    let (scope, key, fp) = key;
    let again = executor
        .run(scope, key, fp, || async { Ok::<_, ()>("twice".to_owned()) })
        .await
        .expect("replay");
    assert_eq!((again.value.as_str(), again.replayed), (value, true));
}
