//! Beyond HTTP, against a real Postgres: the idempotent executor over the Postgres store,
//! and guarded state transitions.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idempotency_core::{
    Error, Executor, Fingerprint, IdempotencyKey, Policy, RecordId, RunError, Scope,
};
use idempotency_postgres::{PostgresStore, StateMachine, Transition, TransitionError};
use idempotency_test::block_on;

async fn store() -> Option<Arc<PostgresStore>> {
    idempotency_test::stores::postgres().await
}

fn fresh() -> (Scope, IdempotencyKey) {
    (
        Scope::new(uuid::Uuid::new_v4().to_string()),
        IdempotencyKey::new(uuid::Uuid::new_v4().to_string()).expect("key"),
    )
}

#[test]
fn executor_repeats_return_the_stored_result() {
    block_on(async {
        let Some(store) = store().await else { return };
        let executor = Executor::new(store);
        let (scope, key) = fresh();
        let runs = AtomicUsize::new(0);
        for replayed in [false, true, true] {
            let done = executor
                .run(&scope, &key, &Fingerprint::of(b"charge 10"), || async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(("ch_1".to_owned(), 10u64))
                })
                .await
                .expect("run");
            assert_eq!(done.value, ("ch_1".to_owned(), 10));
            assert_eq!(done.replayed, replayed);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let other = executor
            .run(&scope, &key, &Fingerprint::of(b"charge 11"), || async {
                Ok::<u8, ()>(1)
            })
            .await;
        assert!(matches!(other, Err(RunError::Mismatch)));
    });
}

#[test]
fn executor_runs_concurrent_duplicates_once() {
    block_on(async {
        let Some(store) = store().await else { return };
        let executor = Arc::new(Executor::new(store));
        let (scope, key) = fresh();
        let runs = Arc::new(AtomicUsize::new(0));
        let attempts = (0..32).map(|_| {
            let (executor, scope, key, runs) =
                (executor.clone(), scope.clone(), key.clone(), runs.clone());
            tokio::spawn(async move {
                executor
                    .run(&scope, &key, &Fingerprint::of(b"p"), || async {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        Ok::<_, ()>(42u32)
                    })
                    .await
            })
        });
        let results: Vec<_> = futures::future::join_all(attempts)
            .await
            .into_iter()
            .map(|r| r.expect("task"))
            .collect();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let ran = results
            .iter()
            .filter(|r| matches!(r, Ok(e) if !e.replayed))
            .count();
        assert_eq!(ran, 1);
        assert!(
            results
                .iter()
                .all(|r| matches!(r, Ok(_) | Err(RunError::InFlight { .. })))
        );
    });
}

#[test]
fn executor_runs_again_after_a_retryable_error() {
    block_on(async {
        let Some(store) = store().await else { return };
        let executor = Executor::new(store);
        let (scope, key) = fresh();
        let first = executor
            .run(&scope, &key, &Fingerprint::of(b"p"), || async {
                Err::<u8, _>("timeout")
            })
            .await;
        assert!(matches!(first, Err(RunError::Failed("timeout"))));
        let second = executor
            .run(&scope, &key, &Fingerprint::of(b"p"), || async {
                Ok::<u8, &str>(5)
            })
            .await
            .expect("run");
        assert_eq!((second.value, second.replayed), (5, false));
    });
}

/// A stalled owner whose lease expired cannot store its result over the one of the attempt
/// that took over.
#[test]
fn executor_stale_owner_cannot_complete() {
    block_on(async {
        let Some(store) = store().await else { return };
        let executor = Arc::new(
            Executor::new(store.clone())
                .with_policy(Policy::default().with_lease(Duration::from_secs(30))),
        );
        let (scope, key) = fresh();
        let id = RecordId::new(&scope, &key);
        let (stalled_tx, stalled_rx) = tokio::sync::oneshot::channel::<()>();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let stale = {
            let (executor, scope, key) = (executor.clone(), scope.clone(), key.clone());
            tokio::spawn(async move {
                executor
                    .run(&scope, &key, &Fingerprint::of(b"p"), || async move {
                        let _ = stalled_tx.send(());
                        let _ = go_rx.await; // a GC pause, a partition: renewals cannot help
                        Ok::<_, ()>("stale".to_owned())
                    })
                    .await
            })
        };
        stalled_rx.await.expect("stalled");
        // The stalled worker's lease runs out (as if its renewals had failed).
        sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '1 second' WHERE record_id = $1")
            .bind(&id.as_bytes()[..])
            .execute(store.pool())
            .await
            .expect("expire");
        let owner = executor
            .run(&scope, &key, &Fingerprint::of(b"p"), || async {
                Ok::<_, ()>("owner".to_owned())
            })
            .await
            .expect("takeover");
        assert_eq!((owner.value.as_str(), owner.replayed), ("owner", false));
        go_tx.send(()).expect("go");
        let stale = stale.await.expect("task");
        assert!(
            matches!(stale, Err(RunError::NotStored(Error::LeaseLost))),
            "{stale:?}"
        );
        let replay = executor
            .run(&scope, &key, &Fingerprint::of(b"p"), || async {
                Ok::<_, ()>("again".to_owned())
            })
            .await
            .expect("replay");
        assert_eq!((replay.value.as_str(), replay.replayed), ("owner", true));
    });
}

async fn orders(store: &PostgresStore) -> (StateMachine, String) {
    orders_versioned_as(store, "bigint").await
}

/// An orders table whose `version` column is of type `version_type`, with row o1 pending at
/// version 1, and its machine pending → processing → shipped → completed.
async fn orders_versioned_as(store: &PostgresStore, version_type: &str) -> (StateMachine, String) {
    let table = idempotency_test::unique("orders");
    let ddl = format!(
        "CREATE TABLE {table} (id text PRIMARY KEY, status text NOT NULL, version {version_type} NOT NULL)"
    );
    sqlx::query(sqlx::AssertSqlSafe(ddl))
        .execute(store.pool())
        .await
        .expect("create");
    let insert = format!("INSERT INTO {table} VALUES ('o1', 'pending', 1)");
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .execute(store.pool())
        .await
        .expect("insert");
    let machine = StateMachine::builder(&table)
        .expect("table")
        .allow("pending", "processing")
        .allow("processing", "shipped")
        .allow("shipped", "completed")
        .build()
        .expect("machine");
    (machine, table)
}

/// Columns named like SQL's own functions (`user`, `current_date`) are the columns: before,
/// a transition's `WHERE user = $1` compared the role's name with the id, and moved every
/// row at that status and version when the id was the role's name.
#[test]
fn columns_named_like_sql_functions_are_the_columns() {
    block_on(async {
        let Some(store) = store().await else { return };
        let table = idempotency_test::unique("accounts");
        let ddl = format!(
            r#"CREATE TABLE {table} ("user" text PRIMARY KEY, "current_date" text NOT NULL, version bigint NOT NULL)"#
        );
        let rows = format!(
            "INSERT INTO {table} VALUES (current_user, 'pending', 1), ('someone else', 'pending', 1)"
        );
        for sql in [ddl, rows] {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(store.pool())
                .await
                .expect("setup");
        }
        let machine = StateMachine::builder(&table)
            .expect("table")
            .columns("user", "current_date", "version")
            .expect("columns")
            .allow("pending", "open")
            .build()
            .expect("machine");
        let (role,): (String,) = sqlx::query_as("SELECT current_user::text")
            .fetch_one(store.pool())
            .await
            .expect("role");
        let pool = store.pool();
        assert_eq!(
            machine.transition(pool, &role, "open", 1).await.expect("t"),
            Transition::Applied { version: 2 }
        );
        assert_eq!(
            machine
                .transition(pool, "someone else", "open", 1)
                .await
                .expect("t"),
            Transition::Applied { version: 2 },
            "the other row moved with the first"
        );
    });
}

/// Also over a `version` column of type `integer`: a move is reported `Applied`, not a
/// decoding error after the row moved (which a retry then saw as `AlreadyApplied`, so code
/// acting on `Applied` never acted).
#[test]
fn transitions_walk_forward_and_tell_repeats_from_conflicts() {
    block_on(async {
        let Some(store) = store().await else { return };
        for version_type in ["bigint", "integer"] {
            let (m, _) = orders_versioned_as(&store, version_type).await;
            let pool = store.pool();
            assert_eq!(
                m.transition(pool, "o1", "processing", 1).await.expect("t"),
                Transition::Applied { version: 2 }
            );
            // The same request again: already applied, no second effect.
            assert_eq!(
                m.transition(pool, "o1", "processing", 1).await.expect("t"),
                Transition::AlreadyApplied { version: 2 }
            );
            assert_eq!(
                m.transition(pool, "o1", "shipped", 2).await.expect("t"),
                Transition::Applied { version: 3 }
            );
            // A stale version.
            assert_eq!(
                m.transition(pool, "o1", "completed", 2).await.expect("t"),
                Transition::Conflict {
                    status: "shipped".into(),
                    version: 3
                }
            );
            // Backwards: "processing" only follows "pending".
            assert_eq!(
                m.transition(pool, "o1", "processing", 3).await.expect("t"),
                Transition::Conflict {
                    status: "shipped".into(),
                    version: 3
                }
            );
            assert_eq!(
                m.transition(pool, "o1", "completed", 3).await.expect("t"),
                Transition::Applied { version: 4 }
            );
            assert_eq!(
                m.transition(pool, "missing", "processing", 1)
                    .await
                    .expect("t"),
                Transition::NotFound
            );
            // A known status that nothing leads to: a forbidden move (a conflict), not bad
            // input, and never "already applied" even where the row sits in it.
            assert_eq!(
                m.transition(pool, "o1", "pending", 4).await.expect("t"),
                Transition::Conflict {
                    status: "completed".into(),
                    version: 4
                }
            );
            assert_eq!(
                m.transition(pool, "missing", "pending", 1)
                    .await
                    .expect("t"),
                Transition::NotFound
            );
            // Not a status of the machine at all: the caller's error.
            assert!(matches!(
                m.transition(pool, "o1", "cancelled", 4).await,
                Err(TransitionError::UnknownTarget(status)) if status == "cancelled"
            ));
        }
    });
}

/// A move made inside the caller's transaction commits or rolls back with the caller's own
/// writes (an outbox or ledger row): rolled back, the redelivery moves the row and writes
/// the row again; committed, a repeat is `AlreadyApplied` and the follow-up write is there.
/// Before, `transition` took only a `Copy` executor (a pool), so the move committed on its
/// own and a crash before the follow-up write lost it for good (the repeat said
/// `AlreadyApplied`, "acknowledge it").
#[test]
fn a_transition_commits_or_rolls_back_with_the_callers_transaction() {
    block_on(async {
        let Some(store) = store().await else { return };
        let (m, _) = orders(&store).await;
        let outbox = idempotency_test::unique("outbox");
        let ddl = format!("CREATE TABLE {outbox} (order_id text NOT NULL)");
        sqlx::query(sqlx::AssertSqlSafe(ddl))
            .execute(store.pool())
            .await
            .expect("outbox");
        let insert = format!("INSERT INTO {outbox} VALUES ('o1')");
        for commit in [false, true] {
            let mut tx = store.pool().begin().await.expect("tx");
            assert_eq!(
                m.transition(&mut *tx, "o1", "processing", 1)
                    .await
                    .expect("t"),
                Transition::Applied { version: 2 }
            );
            sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
                .execute(&mut *tx)
                .await
                .expect("outbox row");
            if commit {
                tx.commit().await.expect("commit");
            } else {
                tx.rollback().await.expect("rollback"); // the crash before the commit
            }
        }
        let count = format!("SELECT count(*) FROM {outbox}");
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(count))
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(n, 1);
        assert_eq!(
            m.transition(store.pool(), "o1", "processing", 1)
                .await
                .expect("t"),
            Transition::AlreadyApplied { version: 2 }
        );
    });
}

#[test]
fn thirty_two_concurrent_identical_transitions_apply_once() {
    block_on(async {
        let Some(store) = store().await else { return };
        let (m, _) = orders(&store).await;
        let m = Arc::new(m);
        let attempts = (0..32).map(|_| {
            let (m, store) = (m.clone(), store.clone());
            tokio::spawn(async move {
                m.transition(store.pool(), "o1", "processing", 1)
                    .await
                    .expect("transition")
            })
        });
        let results: Vec<Transition> = futures::future::join_all(attempts)
            .await
            .into_iter()
            .map(|r| r.expect("task"))
            .collect();
        assert_eq!(
            results
                .iter()
                .filter(|r| matches!(r, Transition::Applied { .. }))
                .count(),
            1
        );
        assert!(
            results.iter().all(|r| matches!(
                r,
                Transition::Applied { version: 2 } | Transition::AlreadyApplied { version: 2 }
            )),
            "{results:?}"
        );
    });
}

/// The operation ran, then the store went down for a while: the executor retries `complete`
/// (renewing the lease) until the store answers, so the result is stored and a redelivery
/// replays it instead of running the effect again. (Before: one failed `complete` returned a
/// store error that read as "nothing ran", and the redelivery ran the effect twice.)
#[test]
fn executor_stores_the_outcome_after_a_store_outage() {
    block_on(async {
        let Some((pg, store)) = idempotency_test::stores::stoppable_postgres().await else {
            return;
        };
        let pg = Arc::new(pg);
        let executor =
            Executor::new(store).with_policy(Policy::default().with_lease(Duration::from_secs(20)));
        let (scope, key) = fresh();
        let runs = AtomicUsize::new(0);
        let done = executor
            .run(&scope, &key, &Fingerprint::of(b"p"), || async {
                runs.fetch_add(1, Ordering::SeqCst);
                pg.stop().await; // the effect happened; now the store is gone
                let pg = pg.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    pg.start().await;
                });
                Ok::<_, ()>("charged".to_owned())
            })
            .await
            .expect("stored once the store is back");
        assert_eq!((done.value.as_str(), done.replayed), ("charged", false));
        let again = executor
            .run(&scope, &key, &Fingerprint::of(b"p"), || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, ()>("twice".to_owned())
            })
            .await
            .expect("replay");
        assert_eq!((again.value.as_str(), again.replayed), ("charged", true));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    });
}

/// The store stays down for the whole lease: the answer says the operation ran and its
/// outcome was not stored, never an error that reads as "nothing ran".
#[test]
fn executor_reports_an_outcome_it_could_not_store() {
    block_on(async {
        let Some((pg, store)) = idempotency_test::stores::stoppable_postgres().await else {
            return;
        };
        let executor =
            Executor::new(store).with_policy(Policy::default().with_lease(Duration::from_secs(2)));
        let (scope, key) = fresh();
        let result = executor
            .run(&scope, &key, &Fingerprint::of(b"p"), || async {
                pg.stop().await;
                Ok::<_, ()>("charged".to_owned())
            })
            .await;
        match result {
            Err(error @ RunError::NotStored(Error::Unavailable(_))) => {
                assert!(error.to_string().contains("the operation ran"), "{error}");
            }
            other => panic!("expected NotStored, got {other:?}"),
        }
    });
}

/// Dropping `run` while the operation runs (a `select!`, a timeout) releases the key at once:
/// the next delivery runs instead of waiting out a lease nobody holds.
#[test]
fn executor_dropped_mid_operation_releases_the_key() {
    block_on(async {
        let Some(store) = store().await else { return };
        let executor =
            Executor::new(store).with_policy(Policy::default().with_lease(Duration::from_secs(60)));
        let (scope, key) = fresh();
        let dropped = tokio::time::timeout(
            Duration::from_millis(200),
            executor.run(&scope, &key, &Fingerprint::of(b"p"), || async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok::<_, ()>(0u8)
            }),
        )
        .await;
        assert!(dropped.is_err());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match executor
                .run(&scope, &key, &Fingerprint::of(b"p"), || async {
                    Ok::<_, ()>(1u8)
                })
                .await
            {
                Ok(done) => {
                    assert_eq!((done.value, done.replayed), (1, false));
                    break;
                }
                Err(RunError::InFlight { .. }) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => panic!("the key stayed claimed by nobody: {error:?}"),
            }
        }
    });
}
