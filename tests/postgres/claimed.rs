//! `Executor::run_with_claim` with `PostgresStore::complete_claim_in`: the operation's effect
//! and its stored result commit in one transaction, so nothing between them (a crash, a
//! panic, a dropped future, an error after the commit) runs the effect a second time.
//!
//! The ledger has no unique constraint on purpose: a second effect would show as a second
//! row, where a constraint would hide it.

use std::{sync::Arc, time::Duration};

use idempotency_core::{
    Claim, Executed, Executor, Fingerprint, IdempotencyKey, Outcome, Policy, RecordId,
    ReleaseScope, RunError, Scope, Store,
};
use idempotency_postgres::{CommitClaimError, PostgresStore};
use idempotency_test::block_on;

use super::store;

/// A ledger table of its own, without constraints.
async fn ledger(store: &PostgresStore) -> String {
    let table = idempotency_test::unique("ledger");
    let ddl = format!("CREATE TABLE {table} (record_id bytea NOT NULL, entry text NOT NULL)");
    sqlx::query(sqlx::AssertSqlSafe(ddl))
        .execute(store.pool())
        .await
        .expect("create the ledger");
    table
}

/// The shared store, a ledger of its own, and an executor (on a lease of `lease`, or the
/// default policy).
async fn setup(
    lease: Option<Duration>,
) -> Option<(Arc<PostgresStore>, String, Executor<PostgresStore>)> {
    let store = store().await?;
    let table = ledger(&store).await;
    let policy = lease.map_or_else(Policy::default, |lease| Policy::default().with_lease(lease));
    let executor = Executor::new(store.clone()).with_policy(policy);
    Some((store, table, executor))
}

async fn entries(store: &PostgresStore, table: &str) -> Vec<String> {
    let select = format!("SELECT entry FROM {table} ORDER BY entry");
    sqlx::query_scalar(sqlx::AssertSqlSafe(select))
        .fetch_all(store.pool())
        .await
        .expect("read the ledger")
}

/// A key of its own, in this file's scope, for the message "1000".
fn fresh_key() -> (Scope, IdempotencyKey, Fingerprint) {
    let key = IdempotencyKey::new(uuid::Uuid::new_v4().to_string()).expect("key");
    (Scope::new("claimed"), key, Fingerprint::of(b"1000"))
}

/// The key's answer to a redelivery that would run again: the value it replays.
async fn replayed(
    executor: &Executor<PostgresStore>,
    scope: &Scope,
    key: &IdempotencyKey,
    fp: &Fingerprint,
) -> String {
    let again = executor
        .run_with_claim(scope, key, fp, |_claim| async {
            Ok::<String, idempotency_core::Error>("runs again".into())
        })
        .await
        .expect("the redelivery");
    assert!(again.replayed, "the redelivery ran again");
    again.value
}

/// What the operation does after its transaction committed.
#[derive(Clone, Copy, Debug)]
enum After {
    Panics,
    Fails,
    /// Never returns: the run's future is dropped (a shutdown, a timeout, a crash's
    /// equivalent for this process).
    Hangs,
}

/// The operation: one ledger entry and its result, in one transaction.
async fn write_and_complete(
    store: &PostgresStore,
    table: &str,
    claim: &Claim<String>,
    entry: &str,
) -> Result<String, idempotency_core::Error> {
    let tx = entry_written(store, table, claim.id(), entry).await?;
    let value = entry.to_owned();
    store.commit_claim(tx, claim, &value).await?;
    Ok(value)
}

/// A transaction that wrote one ledger entry for `id`, left open.
async fn entry_written<'s>(
    store: &'s PostgresStore,
    table: &str,
    id: &RecordId,
    entry: &str,
) -> Result<sqlx::Transaction<'s, sqlx::Postgres>, idempotency_core::Error> {
    let mut tx = store.pool().begin().await.map_err(unavailable)?;
    let insert = format!("INSERT INTO {table} (record_id, entry) VALUES ($1, $2)");
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .bind(&id.as_bytes()[..])
        .bind(entry)
        .execute(&mut *tx)
        .await
        .map_err(unavailable)?;
    Ok(tx)
}

/// How an operation stores its result in its own transaction.
#[derive(Debug, Clone, Copy)]
enum OwnCompletion {
    /// `complete_claim_in`: the claim's completion, then `Claim::accepted`.
    ClaimIn,
    /// `complete_in` with the claim's id and token, and nothing said to the claim (what the
    /// docs of `completing_in_transaction` allow): the store's call tells the run.
    StoresCall,
}

impl OwnCompletion {
    const BOTH: [Self; 2] = [Self::ClaimIn, Self::StoresCall];

    async fn complete(
        self,
        store: &PostgresStore,
        tx: &mut sqlx::PgConnection,
        claim: &Claim<String>,
        value: &String,
    ) -> Result<(), idempotency_core::Error> {
        match self {
            Self::ClaimIn => store.complete_claim_in(tx, claim, value).await,
            Self::StoresCall => {
                let body = serde_json::to_vec(value).expect("json");
                let outcome = Outcome::new(200).with_body(body);
                let (id, token) = (*claim.id(), claim.token());
                store
                    .complete_in(tx, &id, token, &outcome, claim.retention())
                    .await
            }
        }
    }
}

/// Empties the ledger between the cases of one test.
async fn clear(store: &PostgresStore, table: &str) {
    let delete = format!("DELETE FROM {table}");
    sqlx::query(sqlx::AssertSqlSafe(delete))
        .execute(store.pool())
        .await
        .expect("clear the ledger");
}

fn unavailable(error: sqlx::Error) -> idempotency_core::Error {
    idempotency_core::Error::unavailable(error)
}

/// An operation that committed its effect and its result, then panicked, failed or was
/// dropped before the executor stored the result: the redelivery replays the committed
/// result and writes nothing. (With `Executor::run` and the effect committed on its own,
/// each of these releases the key and the redelivery writes a second entry.)
#[test]
fn a_result_committed_with_its_effect_replays_whatever_happens_after_the_commit() {
    block_on(async {
        let Some((store, table, executor)) = setup(None).await else {
            return;
        };
        let (store, table) = (&*store, table.as_str());
        for after in [After::Panics, After::Fails, After::Hangs] {
            let (scope, key, fp) = fresh_key();
            let (committed, on_commit) = tokio::sync::oneshot::channel();
            let first = executor.run_with_claim(&scope, &key, &fp, |claim| async move {
                write_and_complete(store, table, &claim, &format!("first {after:?}"))
                    .await
                    .expect("the first run commits");
                let _ = committed.send(());
                match after {
                    After::Panics => panic!("after the commit"),
                    After::Fails => Err("failed after the commit"),
                    After::Hangs => std::future::pending().await,
                }
            });
            let first: Option<Result<Executed<String>, _>> = match after {
                // Dropped once its transaction committed.
                After::Hangs => tokio::select! {
                    done = first => Some(done),
                    _ = on_commit => None,
                },
                After::Panics | After::Fails => Some(first.await),
            };
            match (after, &first) {
                (After::Panics, Some(Err(RunError::Panicked)))
                | (After::Fails, Some(Err(RunError::Failed(_))))
                | (After::Hangs, None) => {}
                _ => panic!("{after:?}: {first:?}"),
            }
            // What the dropped run left to settle (its release, fenced off by the commit).
            executor.drain().await;

            let again = executor
                .run_with_claim(&scope, &key, &fp, |claim| async move {
                    write_and_complete(store, table, &claim, "second").await
                })
                .await
                .expect("the redelivery");
            assert!(again.replayed, "{after:?}: the redelivery ran again");
            assert_eq!(again.value, format!("first {after:?}"));
        }
        assert_eq!(
            entries(store, table).await,
            ["first Fails", "first Hangs", "first Panics"],
            "one entry per key"
        );
    });
}

/// An operation whose transaction failed after its completion, the error ignored: Postgres
/// answers the `COMMIT` of that failed transaction with a rollback, which sqlx reports as a
/// success. Nothing committed (no entry, no result), and the run says so (`NotCommitted`)
/// with the key released: the redelivery writes the entry once. Before, the executor stored
/// the result itself, and every redelivery replayed an entry that was never written; and it
/// still did for an operation completing with `complete_in` and the claim's token (the
/// store's acceptance never reached the run).
#[test]
fn a_transaction_that_rolled_back_after_its_completion_stores_nothing() {
    block_on(async {
        let Some((store, table, executor)) = setup(None).await else {
            return;
        };
        let (store, table) = (&*store, table.as_str());
        for how in OwnCompletion::BOTH {
            let (scope, key, fp) = fresh_key();
            let first = executor
                .run_with_claim(&scope, &key, &fp, |claim| async move {
                    let mut tx = entry_written(store, table, claim.id(), "lost").await?;
                    let value = "lost".to_owned();
                    how.complete(store, &mut tx, &claim, &value).await?;
                    let failed = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
                    assert!(failed.is_err(), "the statement after the completion fails");
                    tx.commit().await.map_err(unavailable)?; // a rollback, answered as a commit
                    Ok::<_, idempotency_core::Error>(value)
                })
                .await;
            assert!(
                matches!(first, Err(RunError::NotCommitted)),
                "{how:?}: {first:?}"
            );
            assert!(
                entries(store, table).await.is_empty(),
                "{how:?}: nothing committed"
            );

            let again = executor
                .run_with_claim(&scope, &key, &fp, |claim| async move {
                    write_and_complete(store, table, &claim, "written").await
                })
                .await
                .expect("the redelivery");
            assert!(
                !again.replayed,
                "{how:?}: the redelivery replayed a result never committed"
            );
            assert_eq!(entries(store, table).await, ["written"]);
            assert_eq!(replayed(&executor, &scope, &key, &fp).await, "written");
            clear(store, table).await;
        }
    });
}

/// A `COMMIT` that fails (here a deferred constraint, checked at the commit) through
/// `commit_claim`: the run fails with the database's error, nothing is stored, the key is
/// released, and the redelivery runs.
#[test]
fn a_commit_that_fails_stores_nothing_and_releases_the_key() {
    block_on(async {
        let Some((store, _, executor)) = setup(None).await else {
            return;
        };
        let table = idempotency_test::unique("deferred");
        let ddl = format!(
            "CREATE TABLE {table} (entry text NOT NULL, \
             UNIQUE (entry) DEFERRABLE INITIALLY DEFERRED)"
        );
        sqlx::query(sqlx::AssertSqlSafe(ddl))
            .execute(store.pool())
            .await
            .expect("create the table");
        let (store, table) = (&*store, table.as_str());
        let (scope, key, fp) = fresh_key();
        let run = |entries: &'static [&'static str]| {
            executor.run_with_claim(&scope, &key, &fp, move |claim| async move {
                let mut tx = store.pool().begin().await.map_err(unavailable)?;
                for entry in entries {
                    let insert = format!("INSERT INTO {table} (entry) VALUES ($1)");
                    sqlx::query(sqlx::AssertSqlSafe(insert))
                        .bind(*entry)
                        .execute(&mut *tx)
                        .await
                        .map_err(unavailable)?;
                }
                let value = entries.join("+");
                store.commit_claim(tx, &claim, &value).await?;
                Ok::<_, CommitClaimError>(value)
            })
        };
        // The database's own error, for the caller to classify (a constraint: the message's
        // fault, not the store's).
        let first = run(&["twice", "twice"]).await;
        match &first {
            Err(RunError::Failed(CommitClaimError::Commit(sqlx::Error::Database(db)))) => {
                assert_eq!(db.code().as_deref(), Some("23505"), "{db}");
            }
            other => panic!("{other:?}"),
        }
        let again = run(&["once"]).await.expect("the redelivery");
        assert_eq!((again.value.as_str(), again.replayed), ("once", false));
        let select = format!("SELECT entry FROM {table}");
        let rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(select))
            .fetch_all(store.pool())
            .await
            .expect("read");
        assert_eq!(rows, ["once"]);
    });
}

/// An operation that retries its transaction because the first commit's answer was lost
/// (the commit landed): the retry's completion is refused (`LeaseLost`, roll back), so its
/// effect is not committed a second time. Before, the completion answered `Ok` (the token had
/// completed the record: a `Store::complete` retry's answer) and the second entry committed.
#[test]
fn a_transaction_retried_after_its_commit_landed_commits_nothing() {
    block_on(async {
        let Some((store, table, executor)) = setup(None).await else {
            return;
        };
        let (store, table) = (&*store, table.as_str());
        let (scope, key, fp) = fresh_key();
        let done = executor
            .run_with_claim(&scope, &key, &fp, |claim| {
                async move {
                    write_and_complete(store, table, &claim, "first try")
                        .await
                        .expect("the first try commits");
                    // Its answer "lost": the operation retries the whole transaction.
                    let retried = write_and_complete(store, table, &claim, "retry").await;
                    assert!(
                        matches!(retried, Err(idempotency_core::Error::LeaseLost)),
                        "the retry must roll back: {retried:?}"
                    );
                    retried
                }
            })
            .await;
        assert!(
            matches!(
                done,
                Err(RunError::Failed(idempotency_core::Error::LeaseLost))
            ),
            "{done:?}"
        );
        assert_eq!(entries(store, table).await, ["first try"]);
        assert_eq!(replayed(&executor, &scope, &key, &fp).await, "first try");
    });
}

/// A run whose key an operator released while it ran (it looked stuck) and another attempt
/// took over: its completion is refused (`LeaseLost`) inside its transaction, which rolls
/// back with its entry. The takeover's entry is the only one, and the key replays it.
#[test]
fn a_run_whose_key_was_taken_over_rolls_its_effect_back() {
    block_on(async {
        let Some((store, table, executor)) = setup(None).await else {
            return;
        };
        let (store, table) = (&*store, table.as_str());
        let (scope, key, fp) = fresh_key();
        let (written, on_written) = tokio::sync::oneshot::channel();
        let (go_on, on_go_on) = tokio::sync::oneshot::channel::<()>();
        let first = executor.run_with_claim(&scope, &key, &fp, |claim| async move {
            let mut tx = entry_written(store, table, claim.id(), "late").await?;
            let _ = written.send(());
            let _ = on_go_on.await;
            let value = "late".to_owned();
            store.complete_claim_in(&mut tx, &claim, &value).await?;
            tx.commit().await.map_err(unavailable)?;
            Ok::<_, idempotency_core::Error>(value)
        });
        let takeover = async {
            on_written.await.expect("the first run wrote");
            let id = RecordId::new(&scope, &key);
            store
                .force_release(&id, ReleaseScope::default().with_live())
                .await
                .expect("the operator's release");
            let taken = executor
                .run_with_claim(&scope, &key, &fp, |claim| async move {
                    write_and_complete(store, table, &claim, "takeover").await
                })
                .await
                .expect("the takeover");
            let _ = go_on.send(());
            taken
        };
        let (first, taken) = tokio::join!(first, takeover);
        assert!(!taken.replayed);
        assert!(
            matches!(
                first,
                Err(RunError::Failed(idempotency_core::Error::LeaseLost) | RunError::LeaseLost)
            ),
            "{first:?}"
        );
        assert_eq!(entries(store, table).await, ["takeover"]);
        assert_eq!(replayed(&executor, &scope, &key, &fp).await, "takeover");
    });
}

/// A transaction that rolls back after its completion was accepted (a later statement
/// failed, a serialization failure at commit) leaves the run on its lease: the renewals go
/// on, so a redelivery meanwhile is told "in flight", and the run's retried transaction
/// commits the only entry. Before, the renewals stopped at the acceptance: the lease ran out
/// and the redelivery took the key over while the run was still going.
#[test]
fn a_run_whose_accepted_transaction_rolled_back_keeps_its_lease() {
    block_on(async {
        let lease = Duration::from_millis(300);
        let Some((store, table, executor)) = setup(Some(lease)).await else {
            return;
        };
        let (store, table) = (&*store, table.as_str());
        let (scope, key, fp) = fresh_key();
        let (rolled_back, on_rolled_back) = tokio::sync::oneshot::channel();
        let (retry, on_retry) = tokio::sync::oneshot::channel::<()>();
        let run = executor.run_with_claim(&scope, &key, &fp, |claim| async move {
            let mut tx = store.pool().begin().await.map_err(unavailable)?;
            let value = "once".to_owned();
            store.complete_claim_in(&mut tx, &claim, &value).await?;
            tx.rollback().await.map_err(unavailable)?;
            let _ = rolled_back.send(());
            let _ = on_retry.await;
            write_and_complete(store, table, &claim, &value).await
        });
        let redelivery = async {
            on_rolled_back.await.expect("rolled back");
            // Three leases: the run's lease lives only if it is still renewed.
            tokio::time::sleep(lease * 3).await;
            let meanwhile = executor
                .run_with_claim(&scope, &key, &fp, |claim| async move {
                    write_and_complete(store, table, &claim, "redelivery").await
                })
                .await;
            let _ = retry.send(());
            meanwhile
        };
        let (done, meanwhile) = tokio::join!(run, redelivery);
        assert!(
            matches!(meanwhile, Err(RunError::InFlight { .. })),
            "{meanwhile:?}"
        );
        assert_eq!(done.expect("the retried transaction").value, "once");
        assert_eq!(entries(store, table).await, ["once"]);
    });
}

/// As in the next test, but completed by `PostgresStore::complete_in` with the claim's id
/// and token, without asking `Claim::completion`, and with an await between the write and
/// `Claim::accepted` that outlasts the lease: the transaction holds the row, so renewals
/// wait on it, and an operation held for want of a renewal's answer once its lease may have
/// run out would never commit (and the key would stay locked). Before, the run never
/// returned; and it still did not when only `accepted` ended the hold.
#[test]
fn a_run_that_completes_with_its_own_call_is_not_held() {
    block_on(async {
        let Some((store, table, executor)) = setup(Some(Duration::from_millis(300))).await else {
            return;
        };
        let (store, table) = (&*store, table.as_str());
        let (scope, key, fp) = fresh_key();
        let run = executor.run_with_claim(&scope, &key, &fp, |claim| async move {
            let mut tx = entry_written(store, table, claim.id(), "once").await?;
            let value = "once".to_owned();
            let outcome = Outcome::new(200).with_body(serde_json::to_vec(&value).expect("json"));
            store
                .complete_in(
                    &mut tx,
                    claim.id(),
                    claim.token(),
                    &outcome,
                    claim.retention(),
                )
                .await?;
            // Past the lease with the row locked: the renewals wait on it.
            tokio::time::sleep(Duration::from_millis(600)).await;
            claim.accepted();
            tx.commit().await.map_err(unavailable)?;
            Ok::<_, idempotency_core::Error>(value)
        });
        // Generous: the run takes 0.6 s; held, it never ends.
        let done = tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("the run is not held by renewals that wait on its own transaction");
        let done = done.expect("the run is not stopped by its own completion");
        assert_eq!(done.value, "once");
        assert_eq!(entries(store, table).await, ["once"]);
        assert_eq!(replayed(&executor, &scope, &key, &fp).await, "once");
    });
}

/// A renewal that waited on the row the run's own completion locked, or came after its
/// commit, answers `LeaseLost` (the record is no longer in flight): that is the run's own
/// completion, and must not stop it (once the store accepted the completion, the executor
/// stops renewing). Before, the run was stopped after its commit and reported `LeaseLost`;
/// and it still was when the operation completed with `complete_in` and the claim's token.
#[test]
fn a_renewal_that_meets_the_runs_own_completion_does_not_stop_it() {
    block_on(async {
        // Renewed every 100 ms: several renewals fall inside the transaction and after it.
        let Some((store, table, executor)) = setup(Some(Duration::from_millis(300))).await else {
            return;
        };
        let (store, table) = (&*store, table.as_str());
        for how in OwnCompletion::BOTH {
            let (scope, key, fp) = fresh_key();
            let done = executor
                .run_with_claim(&scope, &key, &fp, |claim| async move {
                    let mut tx = entry_written(store, table, claim.id(), "once").await?;
                    let value = "once".to_owned();
                    how.complete(store, &mut tx, &claim, &value).await?;
                    // The row is locked until the commit: renewals wait on it.
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    tx.commit().await.map_err(unavailable)?;
                    // After the commit: renewals find the record completed.
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    Ok::<_, idempotency_core::Error>(value)
                })
                .await;
            let done = done.unwrap_or_else(|e| panic!("{how:?}: the run was stopped: {e:?}"));
            assert!(!done.replayed);
            assert_eq!(done.value, "once");
            assert_eq!(entries(store, table).await, ["once"]);
            assert_eq!(replayed(&executor, &scope, &key, &fp).await, "once");
            clear(store, table).await;
        }
    });
}
