//! The Postgres store against a real Postgres: conformance, races, the transactional
//! completion of the seed scenario, pool starvation, outages and purging.

use std::{sync::Arc, time::Duration};

use idempotency_core::{Begin, Error, LeaseToken, Outcome, Store};
use idempotency_postgres::{GroupCommit, PostgresStore};
use idempotency_test::{
    block_on,
    conformance::{LONG, PAST_SHORT, SHORT, execute, fp, fresh_id},
    services,
};

mod claimed;

/// The store shared by this binary's tests, migrated once.
async fn store() -> Option<Arc<PostgresStore>> {
    idempotency_test::stores::postgres().await
}

idempotency_test::conformance_tests!(async { store().await.map(|s| s as Arc<dyn Store>) });

/// The URL of the Postgres the harness runs (the shared store's).
async fn postgres_url() -> String {
    services::postgres()
        .await
        .expect("postgres")
        .url()
        .to_owned()
}

/// The whole suite again on the per-request store (no group commit): the batched store must
/// answer exactly as it does.
mod per_request {
    use std::sync::Arc;

    use idempotency_core::Store;

    idempotency_test::conformance_tests!(async {
        idempotency_test::stores::postgres_per_request()
            .await
            .map(|s| s as Arc<dyn Store>)
    });
}

/// The whole suite again on a key table of the application's choosing, in a schema of its
/// own (`PostgresStoreBuilder::table`).
mod own_table {
    use std::sync::Arc;

    use idempotency_core::Store;

    idempotency_test::conformance_tests!(async {
        idempotency_test::stores::postgres_own_table()
            .await
            .map(|s| s as Arc<dyn Store>)
    });
}

/// A store on its own table reads and writes that table only — `complete_in` in the
/// application's transaction included — and its migrations are recorded beside it.
#[test]
fn a_store_on_its_own_table_uses_that_table_only() {
    block_on(async {
        let Some(store) = idempotency_test::stores::postgres_own_table().await else {
            return;
        };
        let table = idempotency_test::stores::OWN_TABLE;
        assert_eq!(store.table(), r#""idem_test"."charge_keys""#);
        let rows = |table: &'static str, id: idempotency_core::RecordId| {
            let pool = store.pool().clone();
            async move {
                let sql = format!("SELECT count(*) FROM {table} WHERE record_id = $1");
                let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .bind(&id.as_bytes()[..])
                    .fetch_one(&pool)
                    .await
                    .expect("count");
                n
            }
        };

        let id = fresh_id();
        let token = execute(&*store, &id, &fp("own"), LONG).await;
        let mut tx = store.pool().begin().await.expect("tx");
        store
            .complete_in(&mut tx, &id, token, &Outcome::new(201), LONG)
            .await
            .expect("complete_in");
        tx.commit().await.expect("commit");
        assert_eq!(
            store.begin(&id, &fp("own"), LONG).await.expect("replay"),
            Begin::Replay(Outcome::new(201))
        );
        assert_eq!(rows(table, id).await, 1);
        // The default table exists in this database (the other stores migrated it): it has
        // no trace of the record.
        let _migrated = idempotency_test::stores::postgres().await.expect("store");
        assert_eq!(rows("idempotency_keys", id).await, 0);

        // Concurrent calls: the group commit's batch statements are written for it too.
        let before = store.group_commit_stats();
        let ids: Vec<_> = (0..48).map(|_| fresh_id()).collect();
        futures::future::join_all(ids.iter().map(|id| {
            let store = store.clone();
            async move {
                let token = execute(&*store, id, &fp("batched"), LONG).await;
                store
                    .complete(id, token, &Outcome::new(201), LONG)
                    .await
                    .expect("complete");
            }
        }))
        .await;
        let after = store.group_commit_stats();
        assert!(
            after.statements - before.statements < after.calls - before.calls,
            "calls were batched: {before:?} → {after:?}"
        );
        for id in &ids {
            assert_eq!(rows(table, *id).await, 1);
            assert_eq!(rows("idempotency_keys", *id).await, 0);
        }

        let (applied,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM idem_test.charge_keys_migrations WHERE success")
                .fetch_one(store.pool())
                .await
                .expect("migrations table");
        assert!(applied >= 1);
    });
}

/// Two stores made from one (`with_table` on clones of a `from_pool` store), each on its own
/// table, under concurrent load: each one's calls — batched ones included — land in its own
/// table only (a clone must not share the other's batch queues, whose statements name the
/// other table).
#[test]
fn stores_on_two_tables_from_one_pool_keep_apart() {
    block_on(async {
        let Some(shared) = store().await else { return };
        let base = PostgresStore::from_pool(shared.pool().clone());
        let tables = ["idem_test.left_keys", "idem_test.right_keys"];
        let stores: Vec<_> = tables
            .iter()
            .map(|t| Arc::new(base.clone().with_table(t).expect("table")))
            .collect();
        for store in &stores {
            store.migrate().await.expect("migrate");
        }
        let ids: Vec<Vec<_>> = stores
            .iter()
            .map(|_| (0..32).map(|_| fresh_id()).collect())
            .collect();
        futures::future::join_all(stores.iter().zip(&ids).flat_map(|(store, ids)| {
            ids.iter().map(move |id| {
                let store = store.clone();
                async move {
                    let token = execute(&*store, id, &fp("apart"), LONG).await;
                    store
                        .complete(id, token, &Outcome::new(201), LONG)
                        .await
                        .expect("complete");
                }
            })
        }))
        .await;
        for (table, ids) in tables.iter().zip(&ids) {
            let sql = format!("SELECT count(*) FROM {table} WHERE record_id = ANY($1)");
            let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(
                    ids.iter()
                        .map(|id| id.as_bytes().to_vec())
                        .collect::<Vec<_>>(),
                )
                .fetch_one(shared.pool())
                .await
                .expect("count");
            assert_eq!(n, 32, "{table}");
        }
    });
}

/// A claim acknowledged by a commit Postgres had not flushed (`synchronous_commit = off`,
/// a common tuning of the server or the role) is lost in a crash of the server, and the
/// retry runs the operation again: the store's sessions flush their commits whatever the
/// server or the role says (`local`), and keep any setting that waits for standbys.
#[test]
fn the_stores_sessions_commit_durably() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        for (asked, expected) in [
            ("off", "local"),
            ("local", "local"),
            ("on", "on"),
            ("remote_write", "remote_write"),
            ("remote_apply", "remote_apply"),
        ] {
            let url = format!("{}?options=-c%20synchronous_commit%3D{asked}", pg.url());
            let store = PostgresStore::builder(&url).connect().await.expect("store");
            store.migrate().await.expect("migrate");
            let level: String = sqlx::query_scalar("SHOW synchronous_commit")
                .fetch_one(store.pool())
                .await
                .expect("show");
            assert_eq!(level, expected, "asked for {asked}");
        }
    });
}

/// An operator's `ALTER SYSTEM SET synchronous_commit = off` and reload, made while the
/// store's connections are open, does not reach them: before, a session that had found the
/// server durable set nothing of its own, and took the reloaded `off` until it was
/// recycled (claims acknowledged before they were flushed, lost in a crash: the retry runs
/// again). A Postgres of its own: the setting is the whole server's.
#[test]
fn a_server_made_fast_later_does_not_reach_the_stores_sessions() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::start_postgres().await;
        let store = PostgresStore::builder(pg.url())
            .per_request()
            .max_connections(1)
            .connect()
            .await
            .expect("store");
        store.migrate().await.expect("migrate");
        let show =
            || sqlx::query_scalar::<_, String>("SHOW synchronous_commit").fetch_one(store.pool());
        assert_eq!(show().await.expect("show"), "on");
        for change in [
            "ALTER SYSTEM SET synchronous_commit = off",
            "SELECT pg_reload_conf()",
        ] {
            sqlx::query(change)
                .execute(store.pool())
                .await
                .expect(change);
        }
        // The reload reaches a session between statements.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(show().await.expect("show"), "on");
    });
}

/// The start of a trigger body (its `IF` left open): every claim's lease is written short
/// (as after a long lock wait), so it is re-armed; the first re-arm fails as a
/// serialization race would (a sequence is not rolled back with the statement, so it fails
/// once).
const RACE_ON_FIRST_REARM: &str = "IF TG_OP = 'INSERT' THEN
       NEW.expires_at := clock_timestamp() + interval '100 milliseconds';
     ELSIF TG_OP = 'UPDATE' AND NEW.lease_token = OLD.lease_token
           AND NEW.state = 0 AND OLD.state = 0 AND NEW.expires_at > OLD.expires_at
           AND nextval(TG_TABLE_NAME || '_races') = 1 THEN
       RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001';";

/// A serialization failure (a pool run SERIALIZABLE, whose false positives are ordinary)
/// raised after a round's grant committed — here by the re-arm of a lease that a lock wait
/// left short — leaves that grant to nobody: the claim gives it back before it looks again.
/// It went on to the next round, which read its own grant and answered `InFlight` to the
/// request that made it (then `TakeOver`, an outcome unknown, for an operation never run).
#[test]
fn a_race_after_a_grant_gives_the_grant_back() {
    block_on(async {
        let Some(store) = store_with_trigger(&format!("{RACE_ON_FIRST_REARM} END IF;")).await
        else {
            return;
        };
        let id = fresh_id();
        let answer = store.begin(&id, &fp("race"), LONG).await.expect("begin");
        assert!(matches!(answer, Begin::Execute(_)), "{answer:?}");
    });
}

/// The same race, and the give-back fails too (the connection breaks): the claim answers
/// `Unavailable` and the grant is given back later. It went on to the next round, which
/// read the grant as another attempt's: `InFlight` to the request that made it, or, once
/// the (here short) lease ran out, `TakeOver`, an outcome unknown for an operation never
/// run.
#[test]
fn a_race_after_a_grant_whose_give_back_fails_answers_unavailable() {
    block_on(async {
        // The give-back (a delete) is the sequence's second use.
        let Some(store) = store_with_trigger(&format!(
            "{RACE_ON_FIRST_REARM}
             ELSIF TG_OP = 'DELETE' AND nextval(TG_TABLE_NAME || '_races') = 2 THEN
               RAISE EXCEPTION 'the connection broke' USING ERRCODE = '08006';
             END IF;"
        ))
        .await
        else {
            return;
        };
        let id = fresh_id();
        let answer = store.begin(&id, &fp("race"), LONG).await;
        assert!(matches!(answer, Err(Error::Unavailable(_))), "{answer:?}");
        store.drain().await; // the grant given back
        let again = store.begin(&id, &fp("race"), LONG).await.expect("begin");
        assert!(matches!(again, Begin::Execute(_)), "{again:?}");
    });
}

/// A store on a table of its own whose rows pass through a `BEFORE INSERT OR UPDATE OR
/// DELETE` trigger running `body` (PL/pgSQL; `NEW` is null on a delete; a sequence
/// `<table>_races` is there for it to count). `None` when service tests are opted out.
async fn store_with_trigger(body: &str) -> Option<PostgresStore> {
    let pg = services::postgres().await?;
    let table = format!("trig_{}", idempotency_test::unique("t").replace('-', "_"));
    let store = PostgresStore::builder(pg.url())
        .table(&table)
        .connect()
        .await
        .expect("store");
    store.migrate().await.expect("migrate");
    let ddl = format!(
        "CREATE SEQUENCE {table}_races;
         CREATE FUNCTION {table}_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN {body} RETURN COALESCE(NEW, OLD); END $$;
         CREATE TRIGGER {table}_trigger BEFORE INSERT OR UPDATE OR DELETE ON {table}
           FOR EACH ROW EXECUTE FUNCTION {table}_trigger();"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
        .execute(store.pool())
        .await
        .expect("trigger");
    Some(store)
}

/// `begin_with_ttl` says how long the record lives from now: for a grant, what is left of
/// its lease (a claim that waited on a lock has less than it asked for), never the whole.
#[test]
fn a_grants_ttl_is_what_is_left_of_its_lease() {
    block_on(async {
        // Written with 6 s left of a 10 s lease, as after a 4 s lock wait: more than half,
        // so granted without a re-arm.
        let Some(store) = store_with_trigger(
            "IF TG_OP = 'INSERT' THEN
               NEW.expires_at := clock_timestamp() + interval '6 seconds';
             END IF;",
        )
        .await
        else {
            return;
        };
        let (answer, ttl) = store
            .begin_with_ttl(&fresh_id(), &fp("ttl"), Duration::from_secs(10))
            .await
            .expect("begin");
        assert!(matches!(answer, Begin::Execute(_)), "{answer:?}");
        let ttl = ttl.expect("a ttl");
        assert!(ttl <= Duration::from_secs(6), "{ttl:?}");
        assert!(ttl > Duration::from_secs(5), "{ttl:?}");
    });
}

/// A table name is written into statements, so only plain identifiers are accepted: anything
/// else is refused at connect with a configuration error, before any SQL runs.
#[test]
fn an_invalid_table_name_is_a_configuration_error() {
    block_on(async {
        for table in ["keys; DROP TABLE charges", "Keys", "a.b.c", "\"keys\"", ""] {
            let refused = PostgresStore::builder("postgres://app@127.0.0.1:1/app")
                .table(table)
                .connect()
                .await
                .expect_err(table);
            assert!(
                matches!(refused, Error::Config(_)),
                "{table:?}: {refused:?}"
            );
        }
        let pool = sqlx::PgPool::connect_lazy("postgres://app@127.0.0.1:1/app").expect("pool");
        assert!(matches!(
            PostgresStore::from_pool(pool).with_table("x-y"),
            Err(Error::Config(_))
        ));
    });
}

#[test]
fn migrations_are_idempotent_and_concurrent_safe() {
    block_on(async {
        let Some(store) = store().await else { return };
        let runs = (0..4).map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        });
        for run in futures::future::join_all(runs).await {
            run.expect("task").expect("migrate");
        }
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM _idempotency_migrations")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(n as usize, idempotency_postgres::migrator().iter().count());
    });
}

#[test]
fn concurrent_begins_from_separate_connections_execute_once_per_key() {
    block_on(async {
        let Some(store) = store().await else { return };
        idempotency_test::conformance::concurrent_begins_execute_once_per_key(store, 100).await;
    });
}

async fn charges_table(store: &PostgresStore) -> String {
    let table = idempotency_test::unique("charges");
    // The record id under a unique constraint: even a takeover after a crash between the
    // charge and the completion cannot insert a second charge for the same key.
    let ddl = format!(
        "CREATE TABLE {table} (id text PRIMARY KEY, record_id bytea NOT NULL UNIQUE, amount bigint NOT NULL)"
    );
    sqlx::query(sqlx::AssertSqlSafe(ddl))
        .execute(store.pool())
        .await
        .expect("create");
    table
}

/// The seed scenario through the transactional completion API: one charge row, the same
/// charge id for both requests.
#[test]
fn the_same_request_twice_charges_once() {
    block_on(async {
        let Some(store) = store().await else { return };
        let table = charges_table(&store).await;
        let id = fresh_id();
        let mut answers = Vec::new();
        for _ in 0..2 {
            match store
                .begin(&id, &fp("charge 1000 eur"), LONG)
                .await
                .expect("begin")
            {
                Begin::Execute(token) => {
                    let charge_id = format!("ch_{}", uuid::Uuid::new_v4().simple());
                    let mut tx = store.pool().begin().await.expect("tx");
                    let insert = format!(
                        "INSERT INTO {table} (id, record_id, amount) VALUES ($1, $2, 1000)"
                    );
                    sqlx::query(sqlx::AssertSqlSafe(insert))
                        .bind(&charge_id)
                        .bind(&id.as_bytes()[..])
                        .execute(&mut *tx)
                        .await
                        .expect("insert charge");
                    let outcome = Outcome::new(201).with_body(charge_id.clone());
                    store
                        .complete_in(&mut tx, &id, token, &outcome, LONG)
                        .await
                        .expect("complete_in");
                    tx.commit().await.expect("commit");
                    answers.push(charge_id);
                }
                Begin::Replay(outcome) => {
                    answers.push(String::from_utf8(outcome.body.to_vec()).expect("utf8"));
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(answers[0], answers[1]);
        let count = format!("SELECT count(*) FROM {table}");
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(count))
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(n, 1);
    });
}

/// A rolled-back transaction leaves neither the business row nor a completed record; the
/// retry (after the lease is released) executes and finds nothing to undo.
#[test]
fn a_rolled_back_completion_leaves_nothing() {
    block_on(async {
        let Some(store) = store().await else { return };
        let table = charges_table(&store).await;
        let id = fresh_id();
        let token = execute(&*store, &id, &fp("a"), LONG).await;
        let mut tx = store.pool().begin().await.expect("tx");
        let insert =
            format!("INSERT INTO {table} (id, record_id, amount) VALUES ('ch_x', $1, 1000)");
        sqlx::query(sqlx::AssertSqlSafe(insert))
            .bind(&id.as_bytes()[..])
            .execute(&mut *tx)
            .await
            .expect("insert");
        store
            .complete_in(&mut tx, &id, token, &Outcome::new(201), LONG)
            .await
            .expect("complete_in");
        tx.rollback().await.expect("rollback");

        let count = format!("SELECT count(*) FROM {table}");
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(count))
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(n, 0);
        let (state,): (i16,) =
            sqlx::query_as("SELECT state FROM idempotency_keys WHERE record_id = $1")
                .bind(&id.as_bytes()[..])
                .fetch_one(store.pool())
                .await
                .expect("row");
        assert_eq!(state, 0, "the record is still in flight, not completed");
        store.release(&id, token).await.expect("release");
        execute(&*store, &id, &fp("a"), LONG).await;
    });
}

/// No transaction is held while the operation runs: 50 operations of 200 ms each, holding
/// leases at once, all complete through a pool of 2 connections.
#[test]
fn a_pool_of_two_serves_fifty_concurrent_operations() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        store().await; // migrated
        let small = Arc::new(
            PostgresStore::builder(pg.url())
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(30))
                .call_timeout(Duration::from_secs(60))
                .connect()
                .await
                .expect("store"),
        );
        let ops = (0..50).map(|i| {
            let store = small.clone();
            tokio::spawn(async move {
                let id = fresh_id();
                let token = execute(&*store, &id, &fp("a"), LONG).await;
                tokio::time::sleep(Duration::from_millis(200)).await; // the operation
                let outcome = Outcome::new(201).with_body(format!("op {i}"));
                store
                    .complete(&id, token, &outcome, LONG)
                    .await
                    .expect("complete");
                store.begin(&id, &fp("a"), LONG).await.expect("begin")
            })
        });
        for op in futures::future::join_all(ops).await {
            assert!(matches!(op.expect("task"), Begin::Replay(_)));
        }
    });
}

/// A stopped Postgres yields `Unavailable` (never a hang, never an `Execute`), and the same
/// store value works again once Postgres is back.
#[test]
fn a_stopped_postgres_is_unavailable_then_recovers() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::start_postgres().await;
        let store = PostgresStore::builder(pg.url())
            .acquire_timeout(Duration::from_millis(500))
            .call_timeout(Duration::from_secs(1))
            .connect()
            .await
            .expect("store");
        store.migrate().await.expect("migrate");
        let id = fresh_id();
        let token = execute(&store, &id, &fp("a"), LONG).await;

        pg.stop().await;
        // The guard only turns a hang into a failure message; the store's own budget is 1 s.
        let guard = Duration::from_secs(20);
        let begin = tokio::time::timeout(guard, store.begin(&fresh_id(), &fp("a"), LONG))
            .await
            .expect("begin must not hang");
        assert!(matches!(begin, Err(Error::Unavailable(_))), "{begin:?}");
        let complete =
            tokio::time::timeout(guard, store.complete(&id, token, &Outcome::new(201), LONG))
                .await
                .expect("complete must not hang");
        assert!(
            matches!(complete, Err(Error::Unavailable(_))),
            "{complete:?}"
        );

        pg.start().await;
        // The lease is still live on the server: the same store completes it.
        store
            .complete(&id, token, &Outcome::new(201), LONG)
            .await
            .expect("complete after restart");
        assert_eq!(
            store.begin(&id, &fp("a"), LONG).await.expect("begin"),
            Begin::Replay(Outcome::new(201))
        );
    });
}

/// Purging while new records are inserted deletes exactly the expired rows: two of the
/// library's purgers at once (small batches, paced), which stop at their first short batch.
#[test]
fn purge_under_concurrent_inserts_removes_only_expired_rows() {
    block_on(async {
        let Some(store) = store().await else { return };
        let mut expired = Vec::new();
        for _ in 0..300 {
            let id = fresh_id();
            let token = execute(&*store, &id, &fp("a"), LONG).await;
            store
                .complete(&id, token, &Outcome::new(201), SHORT)
                .await
                .expect("complete");
            expired.push(id);
        }
        tokio::time::sleep(PAST_SHORT).await;

        let writer = {
            let store = store.clone();
            tokio::spawn(async move {
                let mut live = Vec::new();
                for _ in 0..300 {
                    let id = fresh_id();
                    let token = execute(&*store, &id, &fp("a"), LONG).await;
                    store
                        .complete(&id, token, &Outcome::new(201), LONG)
                        .await
                        .expect("complete");
                    live.push(id);
                }
                live
            })
        };
        let purgers = (0..2).map(|_| {
            let purger = idempotency_core::Purger::new(store.clone())
                .batch(50)
                .pause(1.0);
            tokio::spawn(async move { purger.run_once().await.expect("purge") })
        });
        // What each deleted is not checked: other cases share the table and purge too.
        for purged in futures::future::join_all(purgers).await {
            purged.expect("purger");
        }
        let live = writer.await.expect("writer");

        let ids = |v: &[idempotency_core::RecordId]| {
            v.iter()
                .map(|id| id.as_bytes().to_vec())
                .collect::<Vec<_>>()
        };
        let count = "SELECT count(*) FROM idempotency_keys WHERE record_id = ANY($1)";
        let (left,): (i64,) = sqlx::query_as(count)
            .bind(ids(&expired))
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(left, 0, "every expired row is purged");
        let (kept,): (i64,) = sqlx::query_as(count)
            .bind(ids(&live))
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(kept, 300, "no live row is purged");
    });
}

/// The row of an attempt whose outcome is unknown (its lease ran out unfinished: a crash
/// mid-charge) survives the purge for a day, as long as a completed outcome by default: a
/// retry two hours after the crash is still told `TakeOver` (so the layer's `Reject` and
/// `Reconcile` see it), not `Execute`, which charged a second time, and a slow owner's late
/// completion is still accepted. Past the day it goes; a store set to keep these for two
/// hours purges a three-hour-old one, and one set below an hour keeps them an hour. Leases are moved into the past by the database's
/// clock, as the purge reads it (and only by hours: the other cases' purges keep them).
#[test]
fn the_purge_keeps_an_unknown_outcome_for_a_day_not_an_hour() {
    block_on(async {
        let Some(store) = store().await else { return };
        let move_back = |id: idempotency_core::RecordId, minutes: i32| {
            let pool = store.pool().clone();
            async move {
                sqlx::query(
                    "UPDATE idempotency_keys \
                     SET expires_at = now() - $2 * interval '1 minute' WHERE record_id = $1",
                )
                .bind(id.as_bytes().as_slice())
                .bind(f64::from(minutes))
                .execute(&pool)
                .await
                .expect("move the lease back");
            }
        };
        let (retried, late, forgotten) = (fresh_id(), fresh_id(), fresh_id());
        execute(&*store, &retried, &fp("a"), LONG).await;
        let late_token = execute(&*store, &late, &fp("a"), LONG).await;
        execute(&*store, &forgotten, &fp("a"), LONG).await;
        move_back(retried, 2 * 60).await;
        move_back(late, 2 * 60).await;
        move_back(forgotten, 24 * 60 + 1).await;
        // Other cases share the table and leave expired rows too.
        while store.purge_expired(1000).await.expect("purge") >= 1000 {}

        let retry = store.begin(&retried, &fp("a"), LONG).await.expect("begin");
        assert!(
            matches!(retry, Begin::TakeOver(_)),
            "two hours on: {retry:?}"
        );
        store
            .complete(&late, late_token, &Outcome::new(201), LONG)
            .await
            .expect("a late completion two hours on");
        assert_eq!(
            store.begin(&late, &fp("a"), LONG).await.expect("begin"),
            Begin::Replay(Outcome::new(201))
        );
        let retry = store
            .begin(&forgotten, &fp("a"), LONG)
            .await
            .expect("begin");
        assert!(matches!(retry, Begin::Execute(_)), "a day on: {retry:?}");

        let two_hours = (*store)
            .clone()
            .with_unknown_outcome_retention(Duration::from_secs(2 * 3600));
        let short = fresh_id();
        execute(&two_hours, &short, &fp("a"), LONG).await;
        move_back(short, 3 * 60).await;
        while two_hours.purge_expired(1000).await.expect("purge") >= 1000 {}
        let retry = store.begin(&short, &fp("a"), LONG).await.expect("begin");
        assert!(
            matches!(retry, Begin::Execute(_)),
            "kept two hours: {retry:?}"
        );

        // Never less than the grace every store gives a late completion (an hour): the
        // executor's and the layer's late writes count on it. Before, a store set to ten
        // minutes purged a half-hour-old lease, its owner's completion was refused, and the
        // retry ran as new (`Execute`, past `OutcomeUnknown::Reject`).
        let ten_minutes = (*store)
            .clone()
            .with_unknown_outcome_retention(Duration::from_secs(10 * 60));
        let slow = fresh_id();
        let slow_token = execute(&ten_minutes, &slow, &fp("a"), LONG).await;
        move_back(slow, 30).await;
        while ten_minutes.purge_expired(1000).await.expect("purge") >= 1000 {}
        ten_minutes
            .complete(&slow, slow_token, &Outcome::new(201), LONG)
            .await
            .expect("a late completion half an hour on");
        assert_eq!(
            ten_minutes
                .begin(&slow, &fp("a"), LONG)
                .await
                .expect("begin"),
            Begin::Replay(Outcome::new(201))
        );
    });
}

/// A transaction that inserted the key's row (a lease of an hour) and has not committed:
/// a claim's insert on the key waits on it until it ends.
async fn insert_uncommitted(
    store: &PostgresStore,
    id: &idempotency_core::RecordId,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    insert_uncommitted_on(store.pool(), id).await
}

/// [`insert_uncommitted`] on a connection of `pool`.
async fn insert_uncommitted_on(
    pool: &sqlx::PgPool,
    id: &idempotency_core::RecordId,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut blocker = pool.begin().await.expect("transaction");
    sqlx::query(
        "INSERT INTO idempotency_keys (record_id, fingerprint, state, lease_token, expires_at) \
         VALUES ($1, $2, 0, gen_random_uuid(), now() + interval '1 hour')",
    )
    .bind(&id.as_bytes()[..])
    .bind(&fp("a").as_bytes()[..])
    .execute(&mut *blocker)
    .await
    .expect("blocking insert");
    blocker
}

/// A transaction holding the row's lock (`FOR UPDATE`) until it ends.
async fn lock_row(
    store: &PostgresStore,
    id: &idempotency_core::RecordId,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut blocker = store.pool().begin().await.expect("tx");
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE record_id = $1 FOR UPDATE")
        .bind(&id.as_bytes()[..])
        .execute(&mut *blocker)
        .await
        .expect("lock");
    blocker
}

/// A takeover that waited on a row lock for longer than its lease must still be granted a
/// whole lease. With `now()` (the statement's start) the lease it wrote had already ended,
/// and the next `begin` executed a second time.
#[test]
fn a_claim_that_waited_on_a_lock_gets_a_whole_lease() {
    block_on(async {
        let Some(store) = store().await else { return };
        let id = fresh_id();
        execute(&*store, &id, &fp("a"), SHORT).await;
        tokio::time::sleep(PAST_SHORT).await; // expired: the next begin takes it over
        let blocker = lock_row(&store, &id).await;
        let lease = Duration::from_millis(800);
        let waiting = {
            let (store, id) = (store.clone(), id);
            tokio::spawn(async move { store.begin(&id, &fp("a"), lease).await })
        };
        tokio::time::sleep(lease + Duration::from_millis(400)).await; // longer than the lease
        blocker.commit().await.expect("unlock");
        let first = waiting.await.expect("task").expect("begin");
        assert!(matches!(first, Begin::TakeOver(_)), "{first:?}");
        // Right after the grant, the lease is live: a duplicate is in flight, not a second run.
        let second = store.begin(&id, &fp("a"), lease).await.expect("begin");
        assert!(matches!(second, Begin::InFlight { .. }), "{second:?}");
    });
}

/// A takeover decides between a new run and an unfinished one on the row it takes, not on an
/// earlier read of it. Here the row was read completed and expired; before the takeover got
/// its lock, another attempt took it over and crashed (its lease ended unfinished). Taking it
/// as a plain new run (`Execute`) hid that attempt from `OutcomeUnknown::Reject` and
/// `Reconcile`, and a give-back of the grant would have deleted its trace.
#[test]
fn a_takeover_decides_on_the_row_it_takes_not_on_an_earlier_read() {
    block_on(async {
        let Some(store) = store().await else { return };
        let id = fresh_id();
        let token = execute(&*store, &id, &fp("a"), LONG).await;
        store
            .complete(&id, token, &Outcome::new(201), Duration::from_millis(1))
            .await
            .expect("complete");
        tokio::time::sleep(Duration::from_millis(20)).await; // past its retention
        let mut blocker = lock_row(&store, &id).await;
        // Reads the row completed and expired, then waits for the lock to take it over.
        let waiting = {
            let (store, id) = (store.clone(), id);
            tokio::spawn(async move { store.begin(&id, &fp("a"), LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(400)).await;
        // Meanwhile another attempt took the row over, ran, and died unfinished.
        sqlx::query(
            "UPDATE idempotency_keys SET state = 0, lease_token = gen_random_uuid(),
                 expires_at = clock_timestamp(), status = NULL, response = NULL,
                 completed_at = NULL
             WHERE record_id = $1",
        )
        .bind(&id.as_bytes()[..])
        .execute(&mut *blocker)
        .await
        .expect("an attempt that died");
        blocker.commit().await.expect("unlock");
        let answer = waiting.await.expect("task").expect("begin");
        assert!(matches!(answer, Begin::TakeOver(_)), "{answer:?}");
    });
}

/// `complete_in` inside a long caller transaction keeps the whole retention, counted from
/// the write, not from the transaction's start.
#[test]
fn complete_in_a_long_transaction_keeps_the_whole_retention() {
    block_on(async {
        let Some(store) = store().await else { return };
        let id = fresh_id();
        let token = execute(&*store, &id, &fp("a"), LONG).await;
        let retention = Duration::from_millis(2_500);
        let mut tx = store.pool().begin().await.expect("tx");
        sqlx::query("SELECT pg_sleep(1.5)") // within the store's 2 s statement timeout
            .execute(&mut *tx)
            .await
            .expect("a long transaction");
        store
            .complete_in(&mut tx, &id, token, &Outcome::new(201), retention)
            .await
            .expect("complete_in");
        tx.commit().await.expect("commit");
        let (answer, ttl) = store
            .begin_with_ttl(&id, &fp("a"), LONG)
            .await
            .expect("begin");
        assert_eq!(answer, Begin::Replay(Outcome::new(201)));
        let ttl = ttl.expect("a replay has a ttl");
        // Counted from the transaction's start, at most 1 s would be left.
        assert!(
            ttl > Duration::from_millis(1_500),
            "retention left: {ttl:?}"
        );
    });
}

/// On a pool whose sessions default to SERIALIZABLE (the application's own pool, given to
/// `from_pool`), racing begins must still answer Execute once and InFlight otherwise, never
/// turn the race into `Unavailable` (a 503).
#[test]
fn serializable_sessions_do_not_turn_races_into_errors() {
    block_on(async {
        let Some(shared) = store().await else { return };
        let url = postgres_url().await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::query("SET default_transaction_isolation = 'serializable'")
                        .execute(conn)
                        .await
                        .map(|_| ())
                })
            })
            .connect(&url)
            .await
            .expect("pool");
        drop(shared);
        let store = Arc::new(PostgresStore::from_pool(pool));
        for _ in 0..10 {
            let id = fresh_id();
            let racers = (0..16).map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.begin(&id, &fp("a"), LONG).await })
            });
            let mut executes = 0;
            for answer in futures::future::join_all(racers).await {
                match answer.expect("task") {
                    Ok(Begin::Execute(_)) => executes += 1,
                    Ok(Begin::InFlight { .. }) => {}
                    other => panic!("a race must not fail: {other:?}"),
                }
            }
            assert_eq!(executes, 1);
        }
    });
}

/// A store of its own on the shared Postgres, one batch of each kind in flight at a time, so
/// that concurrent calls must queue behind it and share statements.
async fn group_commit_store(lock_timeout: Duration) -> Option<PostgresStore> {
    group_commit_store_with(GroupCommit::default().lock_timeout(lock_timeout)).await
}

/// [`group_commit_store`] with other settings (still one batch of a kind in flight).
async fn group_commit_store_with(settings: GroupCommit) -> Option<PostgresStore> {
    let pg = services::postgres().await?;
    let store = PostgresStore::builder(pg.url())
        .statement_timeout(Duration::from_secs(5))
        .call_timeout(Duration::from_secs(1))
        .group_commit(settings.concurrency(1))
        .connect()
        .await
        .expect("store");
    store.migrate().await.expect("migrate");
    Some(store)
}

/// A claim polled once (it took its kind's batch slot and waits on Postgres), then held.
async fn stalled_claim(
    store: &Arc<PostgresStore>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = idempotency_core::Result<Begin>> + Send>> {
    let (store, id, a) = (store.clone(), fresh_id(), fp("a"));
    let mut stalled = Box::pin(async move { store.begin(&id, &a, LONG).await });
    assert!(
        futures::poll!(&mut stalled).is_pending(),
        "the lone claim waits on Postgres"
    );
    stalled
}

#[test]
fn concurrent_calls_share_statements() {
    block_on(async {
        let Some(store) = group_commit_store(Duration::from_millis(100)).await else {
            return;
        };
        let store = Arc::new(store);
        let ids: Vec<_> = (0..64).map(|_| fresh_id()).collect();
        let begins = ids.iter().map(|id| {
            let (store, id) = (store.clone(), *id);
            tokio::spawn(async move { execute(&*store, &id, &fp("a"), LONG).await })
        });
        let tokens: Vec<_> = futures::future::join_all(begins)
            .await
            .into_iter()
            .map(|t| t.expect("task"))
            .collect();
        let outcome = Outcome::new(201).with_body("ok");
        let completes = ids
            .iter()
            .zip(&tokens)
            .map(|(id, token)| store.complete(id, *token, &outcome, LONG));
        for done in futures::future::join_all(completes).await {
            done.expect("complete");
        }
        let stats = store.group_commit_stats();
        assert_eq!(stats.calls, 128);
        // One batch in flight at a time: whoever arrived meanwhile shared the next statement.
        assert!(stats.statements < stats.calls / 2, "{stats:?}");
        for id in &ids {
            assert!(matches!(
                store.begin(id, &fp("a"), LONG).await.expect("begin"),
                Begin::Replay(_)
            ));
        }
    });
}

/// A storm of duplicates of one key (a gateway and a client retrying together) shares the
/// batch statement: the repeats of a key in a batch are answered from the row the statement
/// met for its first claim, here the live row of the request that runs. Before, each repeat
/// ran again on the per-request pool, one pooled connection per duplicate: here, with the
/// per-request pool's only connection held by the application, they waited for it and were
/// answered `Unavailable` (a 503) instead of `InFlight` (a 409) or `Mismatch` (a 422).
#[test]
fn duplicates_in_one_batch_need_no_connection_of_their_own() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        let (store, held) = one_batch_at_a_time(pg.url()).await;
        for other in ["a", "b"] {
            let id = fresh_id();
            execute(&*store, &id, &fp("a"), LONG).await;
            let prints: Vec<_> = (0..64)
                .map(|i| if i % 2 == 0 { "a" } else { other })
                .collect();
            let (answers, statements) = storm_behind_the_slot(&store, pg.url(), &id, &prints).await;
            answered_from_the_row(answers, &prints, "a", 0);
            assert_eq!(statements, 1);
        }
        drop(held);
    });
}

/// The repeats of a key whose first claim in the batch inserted its row are answered from
/// that row: in flight for the same request, a mismatch for another; one execution. The
/// per-request pool's only connection is held throughout: none of them asked it.
#[test]
fn repeats_of_a_key_inserted_by_their_batch_answer_from_its_row() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        let (store, held) = one_batch_at_a_time(pg.url()).await;
        let id = fresh_id();
        let prints: Vec<_> = (0..17)
            .map(|i| if i % 2 == 0 { "a" } else { "b" })
            .collect();
        let (answers, statements) = storm_behind_the_slot(&store, pg.url(), &id, &prints).await;
        // The first of them queued inserts the row; the others answer from it.
        let first = answers
            .iter()
            .position(|answer| matches!(answer, Ok(Begin::Execute(_))))
            .expect("one claim executes");
        answered_from_the_row(answers, &prints, prints[first], 1);
        assert_eq!(statements, 1);
        drop(held);
    });
}

/// Duplicates of a key whose stored outcome is damaged are each told so (`Corrupt`, a 500
/// the operator must see), from their batch: they asked the per-request pool for a
/// connection, one each, and on a busy pool were answered `Unavailable` (a 503, "retry")
/// instead.
#[test]
fn repeats_of_a_damaged_record_are_told_so_from_their_batch() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        let (store, mut held) = one_batch_at_a_time(pg.url()).await;
        let id = fresh_id();
        let token = execute(&*store, &id, &fp("a"), LONG).await;
        let outcome = Outcome::new(201).with_body("ok");
        store
            .complete(&id, token, &outcome, LONG)
            .await
            .expect("complete");
        sqlx::query("UPDATE idempotency_keys SET response = '\\x00' WHERE record_id = $1")
            .bind(&id.as_bytes()[..])
            .execute(&mut *held)
            .await
            .expect("damage");
        let prints = ["a"; 16];
        let (answers, _) = storm_behind_the_slot(&store, pg.url(), &id, &prints).await;
        for answer in answers {
            assert!(matches!(answer, Err(Error::Corrupt(_))), "{answer:?}");
        }
        drop(held);
    });
}

/// Asserts that `answers` (to claims with `prints`) come from the row of the request with
/// `running`'s fingerprint: `executions` of them (0 or 1) that request's own execution, the
/// rest in flight for it and a mismatch for the other.
fn answered_from_the_row(
    answers: Vec<idempotency_core::Result<Begin>>,
    prints: &[&str],
    running: &str,
    executions: usize,
) {
    let mut executed = 0;
    for (answer, print) in answers.into_iter().zip(prints) {
        match answer.expect("every claim is answered") {
            Begin::Execute(_) if *print == running => executed += 1,
            Begin::InFlight { .. } if *print == running => {}
            Begin::Mismatch if *print != running => {}
            other => panic!("a claim with {print} answered {other:?}"),
        }
    }
    assert_eq!(executed, executions);
}

/// A store with one batch of a kind at a time whose batches wait on a row lock for 10 s (a
/// lone claim held on a lock keeps the batch slot, and calls queue behind it, for up to 10 s:
/// see [`hold_the_batch_slot`]), and the only connection of its per-request pool, held as
/// the application's own query would. Both pools have connected already. Calls of 10 s (a
/// batch's deadline is two, a caller waits one): a slow host's storm is answered before its
/// callers give up.
async fn one_batch_at_a_time(
    url: &str,
) -> (
    Arc<PostgresStore>,
    sqlx::pool::PoolConnection<sqlx::Postgres>,
) {
    let settings = GroupCommit::default()
        .concurrency(1)
        .lock_timeout(Duration::from_secs(10));
    let store = PostgresStore::builder(url)
        .max_connections(1)
        .call_timeout(Duration::from_secs(10))
        // The batches' lock wait is at most half of it.
        .statement_timeout(Duration::from_secs(30))
        .group_commit(settings)
        .connect()
        .await
        .expect("store");
    store.migrate().await.expect("migrate");
    execute(&store, &fresh_id(), &fp("a"), LONG).await;
    let held = store.pool().acquire().await.expect("a connection");
    (Arc::new(store), held)
}

/// A lone claim of a key of its own, holding the batch slot of a [`one_batch_at_a_time`]
/// store: it waits on the returned transaction's uncommitted insert of that key (made on a
/// connection of the test's, not the store's) until the transaction ends (or its lock wait,
/// 10 s). Returned once the claim has the slot: once the store counts one more call, so no
/// other call of the store's may be under way (the count is of every kind's calls).
async fn hold_the_batch_slot(
    store: &Arc<PostgresStore>,
    url: &str,
) -> (
    sqlx::Transaction<'static, sqlx::Postgres>,
    tokio::task::JoinHandle<idempotency_core::Result<Begin>>,
) {
    let other = fresh_id();
    let side = sqlx::PgPool::connect(url).await.expect("side pool");
    let blocker = insert_uncommitted_on(&side, &other).await;
    let calls = store.group_commit_stats().calls;
    let lone = {
        let store = store.clone();
        tokio::spawn(async move { store.begin(&other, &fp("a"), LONG).await })
    };
    joined(store, calls + 1).await;
    (blocker, lone)
}

/// Claims of `id` with each of `prints`, queued together behind [`hold_the_batch_slot`]'s
/// lone claim, then let go: their answers, and the statements the batches took for them.
async fn storm_behind_the_slot(
    store: &Arc<PostgresStore>,
    url: &str,
    id: &idempotency_core::RecordId,
    prints: &[&'static str],
) -> (Vec<idempotency_core::Result<Begin>>, u64) {
    let (blocker, lone) = hold_the_batch_slot(store, url).await;
    let storm = storm(store, id, prints).await;
    let before = store.group_commit_stats();
    blocker.rollback().await.expect("rollback");
    assert!(matches!(
        lone.await.expect("task"),
        Ok(Begin::Execute(_)) | Err(Error::Unavailable(_))
    ));
    let answers = futures::future::join_all(storm)
        .await
        .into_iter()
        .map(|answer| answer.expect("task"))
        .collect();
    let statements = store.group_commit_stats().statements - before.statements;
    (answers, statements)
}

/// Claims of `id` with each of `prints`, spawned together; returned once every one of them
/// has joined the batch queue.
async fn storm(
    store: &Arc<PostgresStore>,
    id: &idempotency_core::RecordId,
    prints: &[&'static str],
) -> Vec<tokio::task::JoinHandle<idempotency_core::Result<Begin>>> {
    let calls = store.group_commit_stats().calls;
    let claims = prints
        .iter()
        .map(|print| {
            let (store, id, fp) = (store.clone(), *id, fp(print));
            tokio::spawn(async move { store.begin(&id, &fp, LONG).await })
        })
        .collect();
    joined(store, calls + prints.len() as u64).await;
    claims
}

/// Waits until `calls` calls have gone through the store's batch queues (taken its slot, or
/// queued behind it). A bound on liveness, not a timing: a claim that ended before it reached
/// the queue would leave the test waiting for ever.
async fn joined(store: &PostgresStore, calls: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while store.group_commit_stats().calls < calls {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{calls} calls never joined the batch queues: {:?}",
            store.group_commit_stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A batch whose drain task is dropped while its statement runs (the drain runs on the
/// runtime of the call that started it; here that runtime shuts down) may still commit the
/// claims in it: the callers, told `Unavailable`, give them back. Left, a grant nobody held
/// answered `InFlight` for a whole lease, then `TakeOver`: an outcome reported unknown for an
/// operation that never ran.
#[test]
fn a_claim_whose_batch_died_unanswered_is_given_back() {
    block_on(async {
        let Some(HeldPair {
            store,
            first,
            second,
            mut holds,
            doomed,
        }) = held_pair().await
        else {
            return;
        };
        // The first claim runs alone on the doomed runtime, holding the batch slot.
        let lone = {
            let store = store.clone();
            doomed.spawn(async move { store.begin(&first, &fp("a"), LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The second queues behind it, from this runtime.
        let queued = {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&second, &fp("a"), LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The first ends; its slot passes to a drain task on the doomed runtime, whose batch
        // now waits on the second key.
        holds.remove(0).rollback().await.expect("rollback");
        let lone = lone.await.expect("task");
        assert!(matches!(lone, Ok(Begin::Execute(_))), "{lone:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        doomed.shutdown_background(); // the drain task is dropped mid-statement
        let queued = queued.await.expect("task");
        assert!(matches!(queued, Err(Error::Unavailable(_))), "{queued:?}");
        // The statement, still running on the server, commits the second claim.
        holds.remove(0).rollback().await.expect("rollback");
        store.drain().await; // the give-back
        // Connections the doomed runtime opened fail once each ("being shutdown").
        let mut again = store.begin(&second, &fp("a"), LONG).await;
        for _ in 0..20 {
            if !matches!(again, Err(Error::Unavailable(_))) {
                break;
            }
            again = store.begin(&second, &fp("a"), LONG).await;
        }
        assert!(matches!(again, Ok(Begin::Execute(_))), "{again:?}");
    });
}

/// The mirror image: the drain lives and the caller is gone. A claim queued from a runtime
/// that shuts down while a drain on another runtime runs its batch cannot be handed to a
/// task of its own (its runtime takes no more), so its answer finds nobody. The drain gives
/// the grant back; it threw it away, and the key answered `InFlight` for a whole lease, then
/// `TakeOver` for an operation that never ran.
#[test]
fn a_claim_whose_caller_died_during_its_batch_is_given_back() {
    block_on(async {
        let Some(HeldPair {
            store,
            first,
            second,
            mut holds,
            doomed,
        }) = held_pair().await
        else {
            return;
        };
        // The first claim runs alone on this runtime, holding the batch slot.
        let lone = {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&first, &fp("a"), LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The second queues behind it, from the doomed runtime.
        let queued = {
            let store = store.clone();
            doomed.spawn(async move { store.begin(&second, &fp("a"), LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The first ends; its slot passes to a drain task on this runtime, whose batch now
        // waits on the second key.
        holds.remove(0).rollback().await.expect("rollback");
        let lone = lone.await.expect("task");
        assert!(matches!(lone, Ok(Begin::Execute(_))), "{lone:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        doomed.shutdown_background(); // the queued caller is dropped mid-statement
        drop(queued);
        // The statement commits the second claim; its answer finds nobody.
        holds.remove(0).rollback().await.expect("rollback");
        tokio::time::sleep(Duration::from_millis(200)).await;
        store.drain().await; // the give-back
        let again = store.begin(&second, &fp("a"), LONG).await;
        assert!(matches!(again, Ok(Begin::Execute(_))), "{again:?}");
    });
}

/// A drain started on a runtime that is alive but no longer polled (a current-thread
/// runtime whose `block_on` returned: it polls its tasks only inside the next one) hands its
/// slot on once its batch deadline has gone by, as a lone call held without polling does.
/// It kept the slot for good, and every later call of its kind, from any runtime, queued
/// behind it and answered `Unavailable`.
#[test]
fn a_drain_on_a_runtime_nobody_polls_hands_its_slot_on() {
    block_on(async {
        let Some(HeldPair {
            store,
            first,
            second,
            mut holds,
            doomed,
        }) = held_pair().await
        else {
            return;
        };
        doomed.shutdown_background(); // not needed here
        holds
            .pop()
            .expect("second")
            .rollback()
            .await
            .expect("rollback");
        let (unpark, parked) = std::sync::mpsc::channel::<()>();
        let (answered, lone) = tokio::sync::oneshot::channel();
        // The first claim runs alone in a current-thread runtime's `block_on`, holding the
        // batch slot; the runtime then lives on, unpolled.
        let thread = {
            let store = store.clone();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let _ = answered.send(runtime.block_on(store.begin(&first, &fp("a"), LONG)));
                let _ = parked.recv();
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The second queues behind it, from this runtime.
        let queued = {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&second, &fp("a"), LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The first ends; its slot passes to a drain task on the parked runtime.
        holds.remove(0).rollback().await.expect("rollback");
        let lone = lone.await.expect("the lone claim's answer");
        assert!(matches!(lone, Ok(Begin::Execute(_))), "{lone:?}");
        let give_up = tokio::time::Instant::now() + store.call_timeout() * 10;
        let mut refused = 0;
        loop {
            match store.begin(&fresh_id(), &fp("a"), LONG).await {
                Ok(Begin::Execute(_)) => break,
                Err(Error::Unavailable(_)) if tokio::time::Instant::now() < give_up => {
                    refused += 1;
                }
                other => panic!("after {refused} refusals: {other:?}"),
            }
        }
        let queued = queued.await.expect("task");
        assert!(
            matches!(queued, Ok(Begin::Execute(_)) | Err(Error::Unavailable(_))),
            "{queued:?}"
        );
        unpark.send(()).expect("unpark");
        thread.join().expect("thread");
    });
}

/// A claim whose caller's runtime shuts down while its statement waits in Postgres (on a
/// row lock here) moves to the runtime the store was made on, and gives back what it was
/// granted. The runtime shutting down dropped the rest of the claim unrun (a closed runtime
/// takes no task), the statement committed all the same, and the key was held by nobody:
/// `InFlight` for a lease, then an unknown outcome for an operation that never ran.
#[test]
fn a_claim_whose_runtime_shut_down_mid_statement_is_given_back() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        // Made on this runtime: its home.
        let store = PostgresStore::builder(pg.url())
            .per_request()
            .statement_timeout(Duration::from_secs(5))
            .call_timeout(Duration::from_secs(3))
            .connect()
            .await
            .expect("store");
        store.migrate().await.expect("migrate");
        let store = Arc::new(store);
        let id = fresh_id();
        let hold = hold_insert(&store, &id).await;
        let doomed = idempotency_test::doomed_runtime();
        let claim = {
            let store = store.clone();
            doomed.spawn(async move { store.begin(&id, &fp("a"), LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await; // waiting on the lock
        doomed.shutdown_background();
        assert!(claim.await.is_err(), "the caller is gone");
        // The statement goes on, and claims the key once the lock goes.
        hold.rollback().await.expect("rollback");
        tokio::time::sleep(Duration::from_millis(500)).await;
        store.drain().await; // the give-back
        let again = store.begin(&id, &fp("a"), LONG).await;
        assert!(matches!(again, Ok(Begin::Execute(_))), "{again:?}");
    });
}

/// A claim answered `Unavailable` after its statement committed (its reply lost), on a
/// runtime that shuts down right after: the give-back it left runs on the runtime the store
/// was made on too. It ran on the caller's alone, waiting out a budget there, and the
/// runtime shutting down dropped it: the key was held by nobody (`InFlight` for a lease,
/// then an unknown outcome for an operation that never ran), and `drain` returned at once.
#[test]
fn a_give_back_left_on_a_runtime_that_shuts_down_still_runs() {
    block_on(async {
        let Some(shared) = store().await else { return };
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let relayed = losing_a_claims_reply(armed.clone()).await;
        // Made on this runtime: its home.
        for (_, store) in both_kinds(&relayed).await {
            let (store, id) = (Arc::new(store), fresh_id());
            let doomed = idempotency_test::doomed_runtime();
            armed.store(true, std::sync::atomic::Ordering::SeqCst);
            let claim = {
                let store = store.clone();
                doomed.spawn(async move { store.begin(&id, &fp("a"), LONG).await })
            };
            let begin = claim.await.expect("answered");
            assert!(matches!(begin, Err(Error::Unavailable(_))), "{begin:?}");
            doomed.shutdown_background();
            assert!(
                !armed.load(std::sync::atomic::Ordering::SeqCst),
                "the relay did not cut a committed claim's reply"
            );
            store.drain().await;
            assert!(
                shared.inspect(&id).await.expect("inspect").is_none(),
                "the give-back ran all the same"
            );
        }
    });
}

/// A claim whose reply was lost (the connection reset after the commit) under a lease
/// shorter than the store's budget: its grant is given back at once, so a retry after the
/// lease ran out runs as new. Looked for one budget after the give-up only, the grant's lease
/// ran out first, and the retry took the key over as an attempt whose outcome is unknown (a
/// 409 under `Reject`, a question to the reconcile hook) for an operation that never ran.
#[test]
fn a_lost_grant_under_a_short_lease_is_given_back_before_it_runs_out() {
    block_on(async {
        let Some(shared) = store().await else { return };
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let relayed = losing_a_claims_reply(armed.clone()).await;
        let lease = Duration::from_millis(400);
        for (kind, store) in both_kinds(&relayed).await {
            let id = fresh_id();
            armed.store(true, std::sync::atomic::Ordering::SeqCst);
            let begin = store.begin(&id, &fp("a"), lease).await;
            armed.store(false, std::sync::atomic::Ordering::SeqCst);
            // The lease over, the store's budget (1 s) not yet.
            let retry_at = tokio::time::Instant::now() + Duration::from_millis(600);
            a_retry_runs_as_new(kind, begin, &shared, &store, &id, retry_at).await;
        }
    });
}

/// A claim whose reply hangs after its commit (one connection's bytes held back: a stalled
/// TCP stream retransmitting, a pooler that stopped forwarding) under a lease longer than the
/// caller's budget and shorter than the claim's own bound (four budgets alone, two in a
/// batch): once its caller has gone, its grant is looked for at once, on another connection,
/// and given back, so a retry after the lease ran out runs as new. Looked for only once the
/// claim was given up, the grant's lease ran out first, and the retry took the key over as an
/// attempt whose outcome is unknown (a 409 under `Reject`) for an operation that never ran.
#[test]
fn a_hung_grant_under_a_short_lease_is_given_back_once_its_caller_is_gone() {
    block_on(async {
        let Some(shared) = store().await else { return };
        let (relay, url) = delaying_relayed_url().await;
        let lease = Duration::from_millis(2_400);
        for (kind, store) in both_kinds(&url).await {
            let id = fresh_id();
            let started = tokio::time::Instant::now();
            // A claim's reply carries the `SELECT n` command tag; a release's does not.
            relay.delay_replies_containing(Duration::from_secs(10), b"SELECT ");
            let begin = store.begin(&id, &fp("a"), lease).await;
            relay.delay_replies_containing(Duration::ZERO, b"SELECT ");
            // The lease over, the claim's own bound not yet.
            let retry_at = started + Duration::from_millis(2_800);
            a_retry_runs_as_new(kind, begin, &shared, &store, &id, retry_at).await;
        }
    });
}

/// A claim whose statement commits after its caller has gone and after the look that
/// followed (it waited on a lock; so too a takeover that waited for a pool connection, or a
/// commit that waits on a replica), and whose reply then hangs, under a lease shorter than
/// the claim's own bound (four budgets): its grant is looked for again while the claim
/// still waits, often enough to find it before its lease runs out, so a retry after the
/// lease runs as new. Looked for once only, it was found at the claim's give-up, after the
/// lease ran out: the retry took the key over as an attempt whose outcome is unknown (a
/// 409 under `Reject`) for an operation that never ran.
#[test]
fn a_hung_grant_committing_after_the_look_is_still_given_back_before_its_lease_runs_out() {
    // Budget 1 s; lease 3 s (a look every second); the grant committed at 1.8 s, with
    // 1.2 s left (the lease counts from the statement's start).
    block_on(a_hung_grant_committing_late(
        Duration::from_secs(1),
        Duration::from_millis(3_000),
        Duration::from_millis(1_800),
        Duration::from_millis(3_400),
    ));
}

/// The same, the grant committing after the last look before its lease runs out (its lock
/// wait took most of the lease): the claim looks once more shortly before the lease, counted
/// from before its statement was sent, runs out. With looks a third of the lease apart
/// only, the next came after the lease had run out, and the retry heard `TakeOver`.
#[test]
fn a_hung_grant_committing_in_its_leases_last_third_is_still_given_back() {
    // Budget 2 s; lease 4.5 s: looks at about 2 and 3.5 s, once more at about 4.05 s (a
    // tenth of the lease before it runs out), then at about 5.5 s; the grant committed at
    // 3.7 s, with 0.8 s left.
    block_on(a_hung_grant_committing_late(
        Duration::from_secs(2),
        Duration::from_millis(4_500),
        Duration::from_millis(3_700),
        Duration::from_millis(4_800),
    ));
}

/// A claim of a key another transaction is inserting, on a store with the budget given,
/// whose reply is held back all along: its caller leaves at the budget, the insert holding
/// the key rolls back at `rollback_at` (after that, the claim's grant commits, its lease
/// counted from the statement's start), and a retry at `retry_at`, once the lease ran out
/// and before the claim gives up (four budgets), runs as new.
async fn a_hung_grant_committing_late(
    budget: Duration,
    lease: Duration,
    rollback_at: Duration,
    retry_at: Duration,
) {
    let Some(shared) = store().await else { return };
    let (relay, url) = delaying_relayed_url().await;
    // A statement timeout past the lock wait.
    let builder = || {
        PostgresStore::builder(&url)
            .call_timeout(budget)
            .statement_timeout(Duration::from_secs(10))
    };
    let kinds = [
        ("per-request", builder().per_request()),
        ("group commit", builder()),
    ];
    for (kind, builder) in kinds {
        let store = builder.connect().await.expect("store");
        let id = fresh_id();
        let started = tokio::time::Instant::now();
        // Another transaction's insert of the key, not committed: the claim waits on it.
        let hold = hold_insert(&shared, &id).await;
        relay.delay_replies_containing(Duration::from_secs(20), b"SELECT ");
        let rollback = async {
            tokio::time::sleep_until(started + rollback_at).await;
            hold.rollback().await.expect("rollback");
        };
        let a = fp("a");
        let (begin, ()) = tokio::join!(store.begin(&id, &a, lease), rollback);
        // The claim's reply, sent once the rollback let its insert through, is held all
        // along.
        a_retry_runs_as_new(kind, begin, &shared, &store, &id, started + retry_at).await;
        relay.delay_replies_containing(Duration::ZERO, b"SELECT ");
    }
}

/// A claim of `id` on `store` answered `begin` (`Unavailable`: nobody holds what it may
/// have granted); a retry on `shared` at `retry_at`, once the claim's lease ran out, runs
/// as new — not as an attempt whose outcome is unknown, for an operation that never ran.
async fn a_retry_runs_as_new(
    kind: &str,
    begin: idempotency_core::Result<Begin>,
    shared: &PostgresStore,
    store: &PostgresStore,
    id: &idempotency_core::RecordId,
    retry_at: tokio::time::Instant,
) {
    assert!(
        matches!(begin, Err(Error::Unavailable(_))),
        "{kind}: {begin:?}"
    );
    tokio::time::sleep_until(retry_at).await;
    let retry = shared.begin(id, &fp("a"), LONG).await.expect("retry");
    assert!(
        matches!(retry, Begin::Execute(_)),
        "{kind}: an operation that never ran reads as an unknown outcome: {retry:?}"
    );
    store.drain().await;
}

/// A claim whose caller went away while it waited for a connection is never sent: its
/// grant, were its reply to hang, would be looked for only once the claim gave up (four
/// budgets), after a short lease ran out. Before, it was sent once a connection came, and
/// committed a lease nobody held.
#[test]
fn a_claim_whose_caller_left_before_it_was_sent_is_never_sent() {
    block_on(async {
        let Some(shared) = store().await else { return };
        let (relay, url) = delaying_relayed_url().await;
        let store = PostgresStore::builder(url)
            .per_request()
            .max_connections(1)
            .call_timeout(Duration::from_secs(1))
            .connect()
            .await
            .expect("store");
        let id = fresh_id();
        let held = store.pool().acquire().await.expect("the pool's connection");
        relay.delay_replies_containing(Duration::from_secs(10), b"SELECT ");
        let gone =
            tokio::time::timeout(Duration::from_millis(200), store.begin(&id, &fp("a"), LONG))
                .await;
        assert!(gone.is_err(), "the caller gave up: {gone:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(held);
        // Time for a claim sent on the freed connection to commit (its reply held back).
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let found = shared.inspect(&id).await.expect("inspect");
        relay.delay_replies_containing(Duration::ZERO, b"SELECT ");
        assert!(
            found.is_none(),
            "a claim nobody waited for was sent: {found:?}"
        );
        store.drain().await;
    });
}

/// The look for an orphaned claim's grants, sent while the claim still waits for the row it
/// will take over (an unfinished attempt's, whose lease ran out), must not delete the
/// takeover that lands before the look: the unfinished attempt would be forgotten, and the
/// next `begin` would answer `Execute` for an operation that may have run. From the look
/// on, the claim sends no takeover; before, the look read the token as a fresh grant's and
/// released (deleted) the row the takeover had written under it.
#[test]
fn the_look_for_an_orphaned_claim_keeps_an_unfinished_attempt() {
    block_on(async {
        let Some(shared) = store().await else { return };
        let (relay, url) = delaying_relayed_url().await;
        for (kind, store) in both_kinds(&url).await {
            let id = fresh_id();
            // An attempt that claimed the key and never finished: its lease ran out.
            let first = shared.begin(&id, &fp("a"), Duration::from_millis(50)).await;
            assert!(matches!(first, Ok(Begin::Execute(_))), "{kind}: {first:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
            // The claim's read of that row comes after its caller's budget (1 s); the look's
            // release (its statement's text on a fresh connection) reaches the server after
            // the takeover would have.
            relay.delay_replies_containing(Duration::from_millis(1_200), b"SELECT ");
            relay.delay_requests_containing(Duration::from_millis(600), b"DELETE FROM");
            let begin = store.begin(&id, &fp("a"), LONG).await;
            // A takeover's reply (held reply chunks keep their due time) comes after the
            // look's release: the claim is still running when the release lands.
            relay.delay_replies_containing(Duration::from_secs(2), b"UPDATE 1");
            assert!(
                matches!(begin, Err(Error::Unavailable(_))),
                "{kind}: {begin:?}"
            );
            tokio::time::sleep(Duration::from_secs(3)).await;
            relay.delay_replies_containing(Duration::ZERO, b"UPDATE 1");
            relay.delay_requests_containing(Duration::ZERO, b"DELETE FROM");
            store.drain().await;
            let retry = shared.begin(&id, &fp("a"), LONG).await.expect("retry");
            assert!(
                matches!(retry, Begin::TakeOver(_)),
                "{kind}: the unfinished attempt was forgotten: {retry:?}"
            );
        }
    });
}

/// A group-commit store whose batches wait on a lock far longer than a test's steps, two
/// fresh keys whose inserts two transactions hold open (claims of them wait until they end),
/// and a runtime to shut down under a claim.
struct HeldPair {
    store: Arc<PostgresStore>,
    first: idempotency_core::RecordId,
    second: idempotency_core::RecordId,
    holds: Vec<sqlx::Transaction<'static, sqlx::Postgres>>,
    doomed: tokio::runtime::Runtime,
}

async fn held_pair() -> Option<HeldPair> {
    let settings = GroupCommit::default().lock_timeout(Duration::from_secs(10));
    let store = Arc::new(group_commit_store_with(settings).await?);
    let (first, second) = (fresh_id(), fresh_id());
    let mut holds = Vec::new();
    for id in [&first, &second] {
        holds.push(hold_insert(&store, id).await);
    }
    let doomed = idempotency_test::doomed_runtime();
    Some(HeldPair {
        store,
        first,
        second,
        holds,
        doomed,
    })
}

/// Opens a transaction that inserts `id`'s row and holds it: claims of the key wait until
/// it ends.
async fn hold_insert(
    store: &PostgresStore,
    id: &idempotency_core::RecordId,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = store.pool().begin().await.expect("tx");
    sqlx::query(
        "INSERT INTO idempotency_keys (record_id, fingerprint, state, lease_token, \
         expires_at) VALUES ($1, $2, 0, gen_random_uuid(), now() + interval '1 minute')",
    )
    .bind(&id.as_bytes()[..])
    .bind(&fp("other").as_bytes()[..])
    .execute(&mut *tx)
    .await
    .expect("hold the key");
    tx
}

/// A key whose row another transaction holds (an application's `complete_in` that has not
/// committed) must not stall the calls batched with it: their batch gives up on the lock
/// after `lock_timeout` and each call goes on alone. Without the short lock timeout the
/// batch waits for the transaction and every call in it runs out of its 1 s budget.
#[test]
fn a_locked_row_does_not_stall_its_batch() {
    block_on(async {
        let Some(store) = group_commit_store(Duration::from_millis(100)).await else {
            return;
        };
        let store = Arc::new(store);
        let locked = fresh_id();
        execute(&*store, &locked, &fp("a"), LONG).await;
        let mut tx = store.pool().begin().await.expect("tx");
        sqlx::query("UPDATE idempotency_keys SET expires_at = expires_at WHERE record_id = $1")
            .bind(&locked.as_bytes()[..])
            .execute(&mut *tx)
            .await
            .expect("lock the row");

        let ids: Vec<_> = (0..32).map(|_| fresh_id()).collect();
        let others = ids.iter().map(|id| {
            let (store, id) = (store.clone(), *id);
            tokio::spawn(async move { store.begin(&id, &fp("a"), LONG).await })
        });
        let blocked = {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&locked, &fp("a"), LONG).await })
        };
        for answer in futures::future::join_all(others).await {
            assert!(
                matches!(answer.expect("task"), Ok(Begin::Execute(_))),
                "a call batched with a locked row was stalled"
            );
        }
        // The locked key itself waits on the per-request path, within its own budget.
        assert!(matches!(
            blocked.await.expect("task"),
            Err(Error::Unavailable(_))
        ));
        tx.rollback().await.expect("rollback");
        assert!(matches!(
            store.begin(&locked, &fp("a"), LONG).await.expect("begin"),
            Begin::InFlight { .. }
        ));
    });
}

/// A lone call runs its statement in its caller's future. One that is held but never polled
/// again (its caller parked on something else, without dropping it) must not keep its batch
/// slot, and with it every claim after it, for as long as the caller holds it: past the
/// batch deadline the next call hands the slot to a drain. Before, that call queued behind
/// the held slot and ran out of its budget, and so did every call after it.
#[test]
fn a_stalled_lone_call_does_not_hold_the_batch_slot() {
    block_on(async {
        let Some(store) = group_commit_store(Duration::from_millis(100)).await else {
            return;
        };
        let store = Arc::new(store);
        let stalled = stalled_claim(&store).await;
        // The batch deadline is twice the call budget (1 s here).
        tokio::time::sleep(store.call_timeout() * 2 + Duration::from_millis(200)).await;
        let answer = store.begin(&fresh_id(), &fp("a"), LONG).await;
        assert!(
            matches!(answer, Ok(Begin::Execute(_))),
            "a claim behind a stalled one: {answer:?}"
        );
        // Polled again, the stalled call ends (its own answer, or out of its budget) and
        // gives back no slot it no longer holds: claims alone and together still run.
        let late = stalled.await;
        assert!(
            matches!(late, Ok(Begin::Execute(_)) | Err(Error::Unavailable(_))),
            "{late:?}"
        );
        for _ in 0..4 {
            execute(&*store, &fresh_id(), &fp("a"), LONG).await;
        }
        let together = (0..32).map(|_| {
            let store = store.clone();
            tokio::spawn(async move { execute(&*store, &fresh_id(), &fp("a"), LONG).await })
        });
        for claimed in futures::future::join_all(together).await {
            claimed.expect("task");
        }
        execute(&*store, &fresh_id(), &fp("a"), LONG).await;
    });
}

/// The batches have few connections of their own (four per batch in flight), and a lone
/// call of each kind runs in its caller's future: four such calls held but never polled
/// again (a claim, a completion, a release, a renewal) keep every one of them. A claim then
/// finds no batch connection; nothing was sent, so it goes the per-request way. At first it
/// waited out the batch pool's acquire timeout and answered `Unavailable`, as did every
/// claim after it for as long as the four were held. Then it went per request, but only
/// after that whole wait (2 s by default, here past the claim's 1 s budget): now a batch
/// that finds every connection out waits a quarter of a second.
#[test]
fn claims_go_per_request_while_every_batch_connection_is_held() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        // The pool's default acquire timeout (2 s), longer than the call budget.
        let store = PostgresStore::builder(pg.url())
            .call_timeout(Duration::from_secs(1))
            .group_commit(GroupCommit::default().concurrency(1))
            .connect()
            .await
            .expect("store");
        store.migrate().await.expect("migrate");
        let store = Arc::new(store);
        let claim = stalled_claim(&store).await;
        let (id, token, outcome) = (fresh_id(), LeaseToken::generate(), Outcome::new(200));
        type Held<'a> = std::pin::Pin<
            Box<dyn std::future::Future<Output = idempotency_core::Result<()>> + Send + 'a>,
        >;
        let mut held: [Held<'_>; 3] = [
            Box::pin(store.complete(&id, token, &outcome, LONG)),
            Box::pin(store.release(&id, token)),
            Box::pin(store.renew(&id, token, LONG)),
        ];
        for call in &mut held {
            assert!(
                futures::poll!(call).is_pending(),
                "a lone call waits on Postgres"
            );
        }
        // Past the batch deadline (twice the call budget) the claims' slot passes on.
        tokio::time::sleep(store.call_timeout() * 2 + Duration::from_millis(200)).await;
        let answer = store.begin(&fresh_id(), &fp("a"), LONG).await;
        assert!(
            matches!(answer, Ok(Begin::Execute(_))),
            "a claim with every batch connection held: {answer:?}"
        );
        drop((claim, held));
        execute(&*store, &fresh_id(), &fp("a"), LONG).await;
    });
}

/// The same with the queue full behind the stalled call (its callers gave up; their claims
/// still wait, detached): a call after the deadline hands the slot to a drain and joins it.
/// Before, the full queue was checked first and refused every call, and none ever started
/// the drain that would have emptied it.
#[test]
fn a_queue_that_filled_behind_a_stalled_call_empties() {
    block_on(async {
        // At most 32 calls wait.
        let Some(store) = group_commit_store_with(GroupCommit::default().max_batch(1)).await else {
            return;
        };
        let store = Arc::new(store);
        let stalled = stalled_claim(&store).await;
        let behind = (0..40).map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&fresh_id(), &fp("a"), LONG).await })
        });
        for answer in futures::future::join_all(behind).await {
            let answer = answer.expect("task");
            assert!(matches!(answer, Err(Error::Unavailable(_))), "{answer:?}");
        }
        tokio::time::sleep(store.call_timeout() * 2 + Duration::from_millis(200)).await;
        let answer = store.begin(&fresh_id(), &fp("a"), LONG).await;
        assert!(matches!(answer, Ok(Begin::Execute(_))), "{answer:?}");
        drop(stalled);
        execute(&*store, &fresh_id(), &fp("a"), LONG).await;
    });
}

/// One call's odd input must not fail the calls batched with it: a retention of
/// `Duration::MAX` (past Postgres' interval range, before it was capped) used to fail the
/// whole statement, and every `complete` in it with `Unavailable`.
#[test]
fn an_extreme_duration_in_a_batch_fails_nobody() {
    block_on(async {
        let Some(store) = group_commit_store(Duration::from_millis(100)).await else {
            return;
        };
        let store = Arc::new(store);
        // The 16 completes are sent together; on 2 busy cores the batcher may still take
        // them one by one, so the round is repeated (up to 5 times) until they shared a
        // statement. Every round checks every answer.
        let mut batched = false;
        for _ in 0..5 {
            let ids: Vec<_> = (0..16).map(|_| fresh_id()).collect();
            let mut tokens = Vec::new();
            for id in &ids {
                tokens.push(execute(&*store, id, &fp("a"), LONG).await);
            }
            let before = store.group_commit_stats();
            let outcome = Outcome::new(201).with_body("kept");
            let completes = ids.iter().zip(&tokens).enumerate().map(|(i, (id, token))| {
                let retention = if i == 3 { Duration::MAX } else { LONG };
                store.complete(id, *token, &outcome, retention)
            });
            for done in futures::future::join_all(completes).await {
                done.expect("every complete in the batch");
            }
            let after = store.group_commit_stats();
            batched = after.statements - before.statements < after.calls - before.calls;
            for id in &ids {
                assert_eq!(
                    store.begin(id, &fp("a"), LONG).await.expect("begin"),
                    Begin::Replay(outcome.clone())
                );
            }
            if batched {
                break;
            }
        }
        assert!(batched, "the completes never shared a statement");
    });
}

/// The shared Postgres's URL through a [`cutting_relay`](idempotency_test::relay::cutting_relay).
async fn relayed_url(armed: Arc<std::sync::atomic::AtomicBool>, cut: fn(&[u8]) -> bool) -> String {
    let pg = services::postgres().await.expect("postgres");
    let upstream = idempotency_test::relay::upstream(pg.url());
    let port = idempotency_test::relay::cutting_relay(upstream, armed, cut).await;
    idempotency_test::relay::through(pg.url(), port)
}

/// The shared Postgres's URL through a relay that can hold its bytes back.
async fn delaying_relayed_url() -> (idempotency_test::relay::DelayingRelay, String) {
    let pg = services::postgres().await.expect("postgres");
    let relay =
        idempotency_test::relay::delaying_relay(idempotency_test::relay::upstream(pg.url())).await;
    let url = idempotency_test::relay::through(pg.url(), relay.port);
    (relay, url)
}

/// The shared Postgres's URL through a relay that, while `armed`, loses the reply of a
/// committed claim. Every claim statement is a `WITH … INSERT … SELECT` run outside a
/// transaction: a reply carrying the `SELECT n` command tag comes after the commit.
async fn losing_a_claims_reply(armed: Arc<std::sync::atomic::AtomicBool>) -> String {
    relayed_url(armed, a_committed_claims_reply).await
}

/// The reply of a claim statement that committed: its rows' command tag, then
/// `ReadyForQuery` with the session idle (a statement outside a transaction block is
/// committed before the server says it is ready). Postgres sends the whole reply in one
/// write at the `Sync`. What the relays cut or replace: the commit is known from the reply
/// itself, where a look at the table after the claim answered would race the store's
/// give-back, which starts at once.
fn a_committed_claims_reply(reply: &[u8]) -> bool {
    reply.windows(7).any(|w| w == b"SELECT ") && reply.ends_with(b"Z\0\0\0\x05I")
}

/// A claim whose statement commits after its caller gave up, and after the store's first
/// attempt to give its grant back (the statement waited on a lock; so too a commit that
/// waits on a replica, or a statement whose bytes arrive after a network heals): that grant
/// must still be given back. Left, nobody holds it: the key answers `InFlight` for the
/// lease, then `TakeOver` (an outcome reported unknown for an operation that never ran).
#[test]
fn a_claim_that_commits_after_its_give_back_is_still_given_back() {
    // Well past the store's first give-back (one budget after it gave up).
    block_on(a_claim_committing_late_is_given_back(
        Duration::from_secs(3),
        Duration::from_millis(250),
    ));
}

/// The same, committing after the third look (21 budgets after the claim was given up),
/// where the looks used to end: a kernel retransmits a closed socket's unsent bytes for
/// about 15 minutes, and a commit can wait on a replica longer still.
#[test]
fn a_claim_that_commits_after_the_third_look_is_still_given_back() {
    block_on(a_claim_committing_late_is_given_back(
        Duration::from_secs(8), // after the drain; 21 budgets of 300 ms are 6.3 s
        Duration::from_secs(1),
    ));
}

/// With a small budget the looks counted in budgets end early (1,365 budgets of 10 ms are
/// under 14 s): a claim that commits after them, still within the sessions' statement
/// timeout (its lock wait), is given back by a look at that timeout. Before, it was left to
/// nobody: `InFlight` for the lease, then `TakeOver`.
#[test]
fn a_claim_that_commits_after_a_small_budgets_looks_is_still_given_back() {
    block_on(a_claim_committing_late_is_given_back_with(
        Duration::from_millis(10),
        Duration::from_secs(20),
        Duration::from_secs(15), // after the drain; the looks end at 13.65 s
        Duration::from_secs(1),
    ));
}

/// A per-request store with a 300 ms budget claims a key whose row another transaction
/// holds for `held`, uncommitted, then the claim commits: its grant must be given back
/// (`executes_within(pause)`).
async fn a_claim_committing_late_is_given_back(held: Duration, pause: Duration) {
    let (budget, statement_timeout) = (Duration::from_millis(300), Duration::from_secs(30));
    a_claim_committing_late_is_given_back_with(budget, statement_timeout, held, pause).await;
}

/// [`a_claim_committing_late_is_given_back`] with the claiming store's `budget` and
/// `statement_timeout`; the answers are read through a store with the default budget.
async fn a_claim_committing_late_is_given_back_with(
    budget: Duration,
    statement_timeout: Duration,
    held: Duration,
    pause: Duration,
) {
    let Some(pg) = services::postgres().await else {
        return;
    };
    let store = PostgresStore::builder(pg.url())
        .per_request()
        .call_timeout(budget)
        .statement_timeout(statement_timeout)
        .connect()
        .await
        .expect("store");
    // Also opens a connection, so that the claim is sent, not given up while connecting.
    store.migrate().await.expect("migrate");
    let reader = PostgresStore::builder(pg.url())
        .per_request()
        .connect()
        .await
        .expect("reader");
    let id = fresh_id();
    // Another transaction holds the key's row, uncommitted: the claim's insert waits.
    let blocker = insert_uncommitted(&store, &id).await;
    let given_up = store.begin(&id, &fp("a"), LONG).await;
    assert!(
        matches!(given_up, Err(Error::Unavailable(_))),
        "{given_up:?}"
    );
    // A shutdown waits for the first give-back only, not for the later looks (for every
    // claim that timed out, most of which wrote nothing).
    let drained = tokio::time::timeout(Duration::from_secs(3), store.drain()).await;
    assert!(drained.is_ok(), "drain waited for the later give-backs");
    // Looked for, having been sent. (With a budget of a few milliseconds, a stall as the
    // claim began can give it up before it is sent: then nothing is looked for, rightly.)
    if budget >= Duration::from_millis(100) {
        assert_eq!(
            store.grants_in_doubt(),
            1,
            "the claim's grant is looked for"
        );
    }
    tokio::time::sleep(held).await;
    // The blocker rolls back and the claim's insert commits: a lease for a caller long gone.
    blocker.rollback().await.expect("rollback");
    let answers = executes_within(&reader, || id, pause).await;
    assert!(
        answers.is_ok(),
        "the late grant was never given back: {answers:?}"
    );
    // Found and given back: no longer looked for (counted down as its look returns).
    let mut left = store.grants_in_doubt();
    for _ in 0..100 {
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = store.grants_in_doubt();
    }
    assert_eq!(left, 0, "a grant given back is still looked for");
}

/// Claims cut off before their statement reached Postgres — no connection to send it on:
/// the server's host resets every connection, or is gone and connects hang — wrote
/// nothing, so nothing is looked for. Before, each was taken for a grant that might still
/// commit: looked for again and again for 70 minutes, a statement per claim per look, in a
/// burst on the new primary after a failover (where the old one's host vanished).
#[test]
fn claims_that_never_reached_postgres_leave_nothing_to_look_for() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let url = postgres_url().await;
        // Accepts, finds no server behind it (nothing listens on port 1), closes.
        let resetting = idempotency_test::relay::cutting_relay(
            "127.0.0.1:1".into(),
            Arc::new(std::sync::atomic::AtomicBool::new(false)),
            |_| false,
        )
        .await;
        // Every connection, from its first byte, passes nothing.
        let gone =
            idempotency_test::relay::stalling_relay(idempotency_test::relay::upstream(&url)).await;
        gone.vanish();
        for (how, port) in [("reset", resetting), ("hanging", gone.port)] {
            for per_request in [true, false] {
                let builder = PostgresStore::builder(idempotency_test::relay::through(&url, port))
                    .call_timeout(Duration::from_millis(200))
                    .acquire_timeout(Duration::from_secs(60));
                let builder = if per_request {
                    builder.per_request()
                } else {
                    builder
                };
                let store = builder.connect().await.expect("store");
                let answer = store.begin(&fresh_id(), &fp("a"), LONG).await;
                assert!(
                    matches!(answer, Err(Error::Unavailable(_))),
                    "{how}: {answer:?}"
                );
                // The claim settled, and the first look of any give-back ran.
                store.drain().await;
                assert_eq!(
                    store.grants_in_doubt(),
                    0,
                    "{how}, per-request {per_request}: a claim never sent is looked for"
                );
            }
        }
    });
}

/// A server that refuses writes — a standby the store's address still names after a
/// failover, a role fenced with `default_transaction_read_only` — answers every claim
/// `25006` before it writes anything: nothing was granted, nothing is looked for, and
/// `may_have_committed` says so. Before, each refused claim was taken for a grant that may
/// have committed, and looked for every call budget for 70 minutes: at a thousand requests a
/// second, a misroute of a minute left sixty thousand searches sending releases.
#[test]
fn claims_a_read_only_server_refused_are_not_looked_for() {
    block_on(async {
        // The shared store migrated the table.
        let Some(_) = store().await else { return };
        let url = postgres_url().await;
        let admin = sqlx::PgPool::connect(&url).await.expect("admin pool");
        let role = format!("fenced_{}", &fresh_id().to_hex()[..12]);
        for sql in [
            format!("CREATE ROLE {role} LOGIN"),
            format!("ALTER ROLE {role} SET default_transaction_read_only = on"),
            format!("GRANT ALL ON idempotency_keys TO {role}"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .execute(&admin)
                .await
                .expect(&sql);
        }
        let fenced = url.replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
        assert_ne!(fenced, url, "the harness's URL names the user postgres");
        for per_request in [true, false] {
            let builder = PostgresStore::builder(&fenced);
            let builder = if per_request {
                builder.per_request()
            } else {
                builder
            };
            let store = Arc::new(builder.connect().await.expect("store"));
            // Sixteen at once: the batched store sends most of them in shared statements.
            let claims = (0..16).map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.begin(&fresh_id(), &fp("a"), LONG).await })
            });
            for answer in futures::future::join_all(claims).await {
                let answer = answer.expect("task");
                let Err(Error::Unavailable(source)) = &answer else {
                    panic!("per-request {per_request}: {answer:?}");
                };
                // A batch's callers share its error as text; a lone statement's is sqlx's.
                if let Some(refused) = source.downcast_ref::<sqlx::Error>() {
                    assert!(
                        !idempotency_postgres::may_have_committed(refused),
                        "{refused}"
                    );
                } else {
                    assert!(!per_request, "{source:?}");
                }
            }
            store.drain().await;
            assert_eq!(
                store.grants_in_doubt(),
                0,
                "per-request {per_request}: claims the server refused are looked for"
            );
        }
    });
}

/// A batch of several claims that waits for its connection (the pool busy) leaves out the
/// claims dropped meanwhile (a runtime shutting down drops the task that runs a claim):
/// never sent, they write no grant and nothing is looked for, while the batch still answers
/// the claims that wait. Sent anyway, such a claim's grant is held by nobody (its give-up
/// done, its caller gone): `InFlight` for a lease, then `TakeOver` for an operation that
/// never ran.
#[test]
fn a_batch_leaves_out_the_claims_dropped_while_it_waited_for_its_connection() {
    block_on(async {
        // Migrates the key table, which the store below (on a pool of its own) uses.
        let Some(shared) = store().await else { return };
        let url = postgres_url().await;
        // One connection, held by the test until the batch waits for it.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&url)
            .await
            .expect("pool");
        let store = Arc::new(PostgresStore::from_pool(pool.clone()));
        let held = pool.acquire().await.expect("the pool's connection");
        // The claim itself, without `begin`'s wrapper (which would run it on in a task of
        // its own): aborting the task drops it.
        let claim = |id| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .claim_with_ttl(&id, &fp("a"), LONG, &Default::default())
                    .await
            })
        };
        let settle = || tokio::time::sleep(Duration::from_millis(200));
        let (first, dropped, waiting) = (fresh_id(), fresh_id(), fresh_id());
        // A lone claim takes the batch slot and waits for the connection in its own task;
        // the next two queue behind it.
        let lone = claim(first);
        settle().await;
        let given_up = claim(dropped);
        let answered = claim(waiting);
        settle().await;
        // The lone claim is dropped unsent: its slot passes to a drain that takes both
        // queued claims in one batch, which waits for the connection. One of them is
        // dropped there.
        lone.abort();
        settle().await;
        given_up.abort();
        settle().await;
        drop(held);
        let answer = answered.await.expect("task");
        assert!(matches!(answer, Ok((Begin::Execute(_), _))), "{answer:?}");
        assert!(lone.await.is_err_and(|e| e.is_cancelled()));
        assert!(given_up.await.is_err_and(|e| e.is_cancelled()));
        let stats = store.group_commit_stats();
        assert!(
            stats.statements < stats.calls,
            "the two queued claims shared a batch: {stats:?}"
        );
        store.drain().await;
        assert_eq!(
            store.grants_in_doubt(),
            0,
            "a claim never sent is looked for"
        );
        for (name, id) in [("alone", first), ("in the batch", dropped)] {
            let (rows,): (i64,) =
                sqlx::query_as("SELECT count(*) FROM idempotency_keys WHERE record_id = $1")
                    .bind(&id.as_bytes()[..])
                    .fetch_one(shared.pool())
                    .await
                    .expect("count");
            assert_eq!(rows, 0, "{name}: a claim dropped unsent wrote a grant");
            let again = shared.begin(&id, &fp("a"), LONG).await;
            assert!(matches!(again, Ok(Begin::Execute(_))), "{name}: {again:?}");
        }
    });
}

/// A claim that failed without writing its token leaves nothing to look for: it only read
/// another attempt's row (here an outcome this build cannot decode, as an older build reads a
/// newer one's during a rolling deploy), or its statement was cancelled by the statement
/// timeout while another transaction held the key (rolled back). Before, each was taken for
/// a grant that might still commit and looked for again and again for 70 minutes, a
/// statement per failed claim per look, while the errors lasted.
#[test]
fn claims_that_failed_without_writing_leave_nothing_to_look_for() {
    block_on(async {
        // Migrates the key table, which the stores below use.
        let Some(shared) = store().await else { return };
        let url = postgres_url().await;
        for per_request in [false, true] {
            let builder =
                PostgresStore::builder(&url).statement_timeout(Duration::from_millis(300));
            let builder = if per_request {
                builder.per_request()
            } else {
                builder
            };
            let store = builder.connect().await.expect("store");
            // Another attempt's outcome, which this build cannot decode.
            let unreadable = fresh_id();
            let token = execute(&*shared, &unreadable, &fp("a"), LONG).await;
            shared
                .complete(&unreadable, token, &Outcome::new(201), LONG)
                .await
                .expect("complete");
            sqlx::query("UPDATE idempotency_keys SET response = '\\x00ff' WHERE record_id = $1")
                .bind(&unreadable.as_bytes()[..])
                .execute(shared.pool())
                .await
                .expect("corrupt");
            let answer = store.begin(&unreadable, &fp("a"), LONG).await;
            assert!(matches!(answer, Err(Error::Corrupt(_))), "{answer:?}");
            // Another transaction's uncommitted row: the claim's insert waits on it until
            // the statement timeout cancels it.
            let held = fresh_id();
            let blocker = insert_uncommitted(&shared, &held).await;
            let answer = store.begin(&held, &fp("a"), LONG).await;
            assert!(matches!(answer, Err(Error::Unavailable(_))), "{answer:?}");
            blocker.rollback().await.expect("rollback");
            store.drain().await;
            assert_eq!(
                store.grants_in_doubt(),
                0,
                "per-request {per_request}: a claim that wrote nothing is looked for"
            );
        }
    });
}

/// Begins on `id()` every `pause`, 40 times at most, until a `begin` executes; else the last
/// answer.
async fn executes_within(
    store: &PostgresStore,
    id: impl Fn() -> idempotency_core::RecordId,
    pause: Duration,
) -> Result<(), Result<Begin, Error>> {
    let mut last = Ok(Begin::Mismatch);
    for _ in 0..40 {
        match store.begin(&id(), &fp("a"), LONG).await {
            Ok(Begin::Execute(_)) => return Ok(()),
            other => last = other,
        }
        tokio::time::sleep(pause).await;
    }
    Err(last)
}

/// A failover whose old primary vanished: its connections hang mid-statement (no reset, only
/// TCP's own timeout, about 15 minutes). Calls on them run out of budget, and the store must
/// serve again from fresh connections to the new primary soon after. sqlx hands a dropped
/// connection back to its pool by pinging it first, with no timeout: every hung connection
/// kept its pool slot, the four of the batches went first, and every call failed with a pool
/// timeout. The store now closes a connection whose statement was given up. So does an
/// operator's release, whose read of the database's clock was on a bare pooled query (the
/// operators releasing stuck keys during the failover took the pool's slots for good).
#[test]
fn connections_that_hang_mid_statement_do_not_hold_the_pool() {
    block_on(async {
        if services::skipping() {
            return;
        }
        hung_calls_free_the_pool(false).await;
        hung_calls_free_the_pool(true).await;
    });
}

/// A connection whose statement was answered, and whose host vanished while sqlx pinged it
/// on its way back to the pool (a failover under load: a connection is in that ping about as
/// often as in a statement), frees its pool slot within seconds: the ping is bounded. sqlx's
/// own has no timeout: the slot was held for TCP's timeout (about 15 minutes), and a pool of
/// one answered nothing but pool timeouts though the new primary answered.
#[test]
fn a_connection_that_hangs_on_its_way_back_to_the_pool_frees_its_slot() {
    let url = block_on(async {
        if services::skipping() {
            return None;
        }
        Some(
            services::postgres()
                .await
                .expect("postgres")
                .url()
                .to_owned(),
        )
    });
    let Some(url) = url else { return };
    // One thread: the task that hands the connection back has not run when the host
    // vanishes, right after the statement's answer (nor have the relay's).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let relay =
            idempotency_test::relay::stalling_relay(idempotency_test::relay::upstream(&url)).await;
        let store = PostgresStore::builder(idempotency_test::relay::through(&url, relay.port))
            .per_request()
            .max_connections(1)
            .acquire_timeout(Duration::from_millis(200))
            .call_timeout(Duration::from_millis(300))
            .connect()
            .await
            .expect("store");
        store.migrate().await.expect("migrate");
        execute(&store, &fresh_id(), &fp("a"), LONG).await;
        relay.vanish();
        relay.fail_over();
        let served = executes_within(&store, fresh_id, Duration::from_millis(500)).await;
        assert!(served.is_ok(), "{served:?}");
    });
}

/// [`connections_that_hang_mid_statement_do_not_hold_the_pool`] with claims, or with
/// operators' releases, hanging.
async fn hung_calls_free_the_pool(releases: bool) {
    {
        let pg = services::postgres().await.expect("postgres");
        let upstream = idempotency_test::relay::upstream(pg.url());
        let relay = idempotency_test::relay::stalling_relay(upstream).await;
        let relayed = idempotency_test::relay::through(pg.url(), relay.port);
        // A small pool, to see its slots go: every store call runs on it.
        let store = PostgresStore::builder(relayed)
            .per_request()
            .max_connections(3)
            .call_timeout(Duration::from_millis(300))
            .connect()
            .await
            .expect("store");
        store.migrate().await.expect("migrate");
        let a = fp("a");
        let ids = |n| (0..n).map(|_| fresh_id()).collect::<Vec<_>>();
        // Warm: the pool's connections open.
        let warm = ids(3);
        let begins = warm.iter().map(|id| store.begin(id, &a, LONG));
        for answer in futures::future::join_all(begins).await {
            assert!(matches!(answer, Ok(Begin::Execute(_))), "{answer:?}");
        }
        // The primary vanishes: calls hang on the connections the pool had (and on those it
        // opens meanwhile) and run out of budget, for a few seconds.
        relay.vanish();
        let hung = ids(24);
        let scope = idempotency_core::ReleaseScope::default();
        for wave in hung.chunks(3) {
            if releases {
                futures::future::join_all(wave.iter().map(|id| store.force_release(id, scope)))
                    .await;
            } else {
                futures::future::join_all(wave.iter().map(|id| store.begin(id, &a, LONG))).await;
            }
        }
        relay.fail_over();
        // Served again once the hung connections are closed (sqlx bounds a close at 5 s).
        let answers = executes_within(&store, fresh_id, Duration::from_millis(500)).await;
        assert!(answers.is_ok(), "the store never served again: {answers:?}");
    }
}

/// A claim whose answer is lost on the way back (the connection breaks after Postgres
/// committed the lease) is `Unavailable` to its caller, and the lease it wrote is given
/// back: nothing ran, so the retry is a fresh `Execute`. Left to run out, the lease would
/// make the retry a `TakeOver`, an outcome reported unknown for an operation that never ran
/// (and, under `OutcomeUnknown::Reject`, a key refused for its whole retention).
#[test]
fn a_claim_whose_answer_is_lost_leaves_no_lease() {
    block_on(async {
        let Some(shared) = store().await else { return };
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let relayed = losing_a_claims_reply(armed.clone()).await;
        claims_answered_unavailable_leave_no_lease(&shared, &relayed, &armed).await;
    });
}

/// A per-request store and a group-commit store on `url`, each call within a second.
async fn both_kinds(url: &str) -> [(&'static str, PostgresStore); 2] {
    let builder = || PostgresStore::builder(url).call_timeout(Duration::from_secs(1));
    [
        (
            "per-request",
            builder().per_request().connect().await.expect("store"),
        ),
        ("group commit", builder().connect().await.expect("store")),
    ]
}

/// A claim whose reply was lost as Postgres went away (it had committed): while Postgres
/// cannot be reached, the store looks for the grant every budget, and gives it back as soon
/// as Postgres is back. Looked for on its schedule alone (1, 5, then 21 budgets after the
/// give-up), the look after the outage came long after the grant's lease ran out, and a
/// retry in between took the key over as an attempt whose outcome is unknown — a 409 under
/// `Reject` — for an operation that never ran.
#[test]
fn a_grant_whose_reply_an_outage_lost_is_given_back_once_postgres_is_back() {
    use idempotency_test::relay;

    block_on(async {
        let Some(shared) = store().await else { return };
        // The store reaches Postgres through a relay that goes down (every connection
        // closed, new ones refused) and one behind it that loses a committed claim's reply.
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let losing = losing_a_claims_reply(armed.clone()).await;
        let outage = relay::stalling_relay(relay::upstream(&losing)).await;
        let store = PostgresStore::builder(relay::through(&losing, outage.port))
            .per_request()
            .acquire_timeout(Duration::from_millis(300))
            .call_timeout(Duration::from_millis(500))
            .connect()
            .await
            .expect("store");
        execute(&store, &fresh_id(), &fp("a"), LONG).await;
        let id = fresh_id();
        armed.store(true, std::sync::atomic::Ordering::SeqCst);
        let begin = store.begin(&id, &fp("a"), Duration::from_secs(1)).await;
        assert!(matches!(begin, Err(Error::Unavailable(_))), "{begin:?}");
        // Down before the first look (0.5 s after the give-up) and past the second (2.5 s).
        outage.cut_off();
        tokio::time::sleep(Duration::from_secs(3)).await;
        outage.fail_over();
        // Back, well before the schedule's next look (10.5 s after the give-up), and after
        // the grant's lease (1 s) ran out: a few budgets for the looks to find it.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let retry = shared.begin(&id, &fp("a"), LONG).await;
        assert!(
            matches!(retry, Ok(Begin::Execute(_))),
            "a claim that never ran is reported unknown: {retry:?}"
        );
    });
}

/// On the per-request and the group-commit store through `relayed` (a relay that mangles
/// the reply of a committed claim while `armed`): the claim answers `Unavailable`, its lease
/// committed, and once `drain` returns it is given back.
async fn claims_answered_unavailable_leave_no_lease(
    shared: &PostgresStore,
    relayed: &str,
    armed: &std::sync::atomic::AtomicBool,
) {
    for (name, store) in both_kinds(relayed).await {
        let id = fresh_id();
        armed.store(true, std::sync::atomic::Ordering::SeqCst);
        let begin = store.begin(&id, &fp("a"), SHORT).await;
        assert!(
            matches!(begin, Err(Error::Unavailable(_))),
            "{name}: {begin:?}"
        );
        assert!(
            !armed.load(std::sync::atomic::Ordering::SeqCst),
            "{name}: the relay did not mangle a committed claim's reply"
        );
        // The give-back starts at once (a look at the table here raced it, and lost on a
        // busy host); a graceful shutdown's `drain` waits for it.
        store.drain().await;
        assert!(
            shared.inspect(&id).await.expect("inspect").is_none(),
            "{name}: the lease of a claim nobody was told of is given back once drain returns"
        );
        execute(shared, &id, &fp("a"), LONG).await;
    }
}

/// A claim whose statement committed but whose caller was told of a database error (a
/// pooler such as PgBouncer answers `08P01` when its server connection broke after the
/// statement ran; so does its `query_timeout`) is given back like one whose answer was
/// lost, on the group-commit store as on the per-request one. Before, the group commit took
/// every database error for a rollback: the grant was held by nobody, the key answered
/// `InFlight` for the lease, then `TakeOver` for an operation that never ran.
#[test]
fn a_claim_that_committed_but_was_answered_an_error_leaves_no_lease() {
    block_on(async {
        let Some(shared) = store().await else { return };
        let pg = services::postgres().await.expect("postgres");
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let port = idempotency_test::relay::replacing_relay(
            idempotency_test::relay::upstream(pg.url()),
            armed.clone(),
            a_committed_claims_reply,
            idempotency_test::relay::postgres_error("08P01", "server conn crashed?"),
        )
        .await;
        let relayed = idempotency_test::relay::through(pg.url(), port);
        claims_answered_unavailable_leave_no_lease(&shared, &relayed, &armed).await;
    });
}

/// A `begin` and a `complete` of a new key: two calls.
async fn one_operation(store: &PostgresStore) -> idempotency_core::Result<()> {
    let id = fresh_id();
    match store.begin(&id, &fp("a"), LONG).await? {
        Begin::Execute(token) => store.complete(&id, token, &Outcome::new(201), LONG).await,
        other => panic!("a new key answered {other:?}"),
    }
}

/// Server chunks that are a bare `ReadyForQuery` (idle): the answer to a ping (a lone
/// `Sync`), never to a statement, whose reply carries its rows and command tag before it.
static PINGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn count_pings(reply: &[u8]) -> bool {
    if reply == b"Z\0\0\0\x05I" {
        PINGS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    false // never cut
}

/// A call on a connection used moments ago goes straight to its statement. sqlx's default
/// pings every connection it hands out — one more round trip before every statement — and
/// pings it again as it goes back to the pool (that one cannot be turned off). So a store
/// under load sees one ping per statement, not two; a connection idle for longer than half
/// a second is still checked before it is used (next test: the one that matters).
#[test]
fn a_connection_used_moments_ago_is_not_pinged_again_before_its_next_call() {
    use std::sync::atomic::Ordering::SeqCst;
    block_on(async {
        let Some(_shared) = store().await else { return };
        let never = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let relayed = relayed_url(never, count_pings).await;
        for store in [
            PostgresStore::builder(relayed.clone())
                .per_request()
                .connect()
                .await
                .expect("per-request store"),
            PostgresStore::builder(relayed.clone())
                .connect()
                .await
                .expect("group commit store"),
        ] {
            // Warm: the connections exist and the statements are prepared.
            one_operation(&store).await.expect("complete");
            // The pings of a connection's return run in a task of their own: let them land.
            tokio::time::sleep(Duration::from_millis(300)).await;

            let before = PINGS.load(SeqCst);
            let calls = 20;
            for _ in 0..calls / 2 {
                one_operation(&store).await.expect("complete");
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            let pings = PINGS.load(SeqCst) - before;
            assert!(
                pings <= calls,
                "{pings} pings for {calls} calls in a row: a ping before every statement"
            );

            // Idle for longer than the bypass window: pinged before it is used.
            tokio::time::sleep(Duration::from_millis(700)).await;
            let before = PINGS.load(SeqCst);
            let id = fresh_id();
            execute(&store, &id, &fp("a"), LONG).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let pings = PINGS.load(SeqCst) - before;
            assert!(
                pings >= 2,
                "a connection idle for 700 ms was used without a ping ({pings} pings)"
            );
        }
    });
}

/// Postgres restarts while the store's connections sit idle in its pools: they are all dead,
/// and the next call still succeeds (an idle connection is pinged before use and replaced
/// when the ping fails), instead of failing once per dead connection.
#[test]
fn a_restart_while_the_pool_is_idle_fails_no_call() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::start_postgres().await;
        for per_request in [true, false] {
            let builder = PostgresStore::builder(pg.url()).call_timeout(Duration::from_secs(5));
            let store = if per_request {
                builder.per_request()
            } else {
                builder
            }
            .connect()
            .await
            .expect("store");
            store.migrate().await.expect("migrate");
            // Several connections in each pool, all idle afterwards.
            let warm = (0..8).map(|_| one_operation(&store));
            for done in futures::future::join_all(warm).await {
                done.expect("complete");
            }

            let stopped = std::time::Instant::now();
            pg.stop().await;
            pg.start().await;
            // Connections used less than half a second ago are not pinged (the store's
            // bypass window): a real crash and recovery, or a failover, takes longer than
            // that; a container restarted here may not.
            tokio::time::sleep(Duration::from_secs(1).saturating_sub(stopped.elapsed())).await;

            for _ in 0..8 {
                let done = one_operation(&store).await;
                assert!(
                    done.is_ok(),
                    "a call after the restart failed: {done:?} (per_request: {per_request})"
                );
            }
        }
    });
}

/// A batch of completes that runs past the statement timeout (large outcomes, a row each
/// slow to write) when no one of them alone would is not a refusal of each outcome: its
/// calls go on alone, the per-request way. Each was answered `Unavailable`, and the cohort,
/// retrying in step, failed together again until the background write took each refusal for
/// the store refusing that outcome for good.
#[test]
fn a_batch_of_completes_past_the_statement_timeout_gives_its_calls_back() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        let table = format!("gc_timeout_{}", uuid::Uuid::new_v4().simple());
        let store = PostgresStore::builder(pg.url())
            .table(table.clone())
            .statement_timeout(Duration::from_secs(1))
            .call_timeout(Duration::from_secs(5))
            .group_commit(GroupCommit::default().concurrency(1))
            .connect()
            .await
            .expect("store");
        store.migrate().await.expect("migrate");
        // Each stored outcome of status 299 takes 100 ms to write: one alone is well within
        // the second, a batch of twenty is not.
        for statement in [
            "CREATE OR REPLACE FUNCTION slow_outcome() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM pg_sleep(0.1); RETURN NEW; END $$"
                .to_owned(),
            format!(
                "CREATE TRIGGER slow BEFORE UPDATE ON {table} FOR EACH ROW \
                 WHEN (NEW.status = 299) EXECUTE FUNCTION slow_outcome()"
            ),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(store.pool())
                .await
                .expect("trigger");
        }
        let store = Arc::new(store);
        let ids: Vec<_> = (0..21).map(|_| fresh_id()).collect();
        let mut tokens = Vec::new();
        for id in &ids {
            tokens.push(execute(&*store, id, &fp("a"), LONG).await);
        }
        let outcome = Outcome::new(299).with_body("slow");
        let completes = ids.iter().zip(&tokens).map(|(id, token)| {
            let (store, id, token, outcome) = (store.clone(), *id, *token, outcome.clone());
            tokio::spawn(async move { store.complete(&id, token, &outcome, LONG).await })
        });
        let answers: Vec<_> = futures::future::join_all(completes)
            .await
            .into_iter()
            .map(|answer| answer.expect("task"))
            .collect();
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
        for id in &ids {
            let replay = store.begin(id, &fp("a"), LONG).await.expect("begin");
            assert_eq!(replay, Begin::Replay(outcome.clone()));
        }
    });
}

/// A group-commit store whose batches take one call each (its queue is full at 32 calls
/// waiting) and wait on a row lock far longer than a test's steps.
async fn one_call_batches() -> Option<Arc<PostgresStore>> {
    let settings = GroupCommit::default()
        .max_batch(1)
        .lock_timeout(Duration::from_secs(10));
    Some(Arc::new(group_commit_store_with(settings).await?))
}

/// A full queue of completes (Postgres not keeping up) refuses a claim, which ran nothing,
/// but not an outcome, whose operation ran: the complete goes on alone, the per-request way.
/// It was answered `Unavailable` at once, a refusal the background write could take for the
/// store refusing that outcome for good.
#[test]
fn a_full_queue_sends_a_complete_the_per_request_way() {
    block_on(async {
        let Some(store) = one_call_batches().await else {
            return;
        };
        let ids: Vec<_> = (0..41).map(|_| fresh_id()).collect();
        let mut tokens = Vec::new();
        for id in &ids {
            tokens.push(execute(&*store, id, &fp("a"), LONG).await);
        }
        // The first complete takes the slot and waits on its row, locked here.
        let mut lock = store.pool().begin().await.expect("tx");
        sqlx::query("SELECT 1 FROM idempotency_keys WHERE record_id = $1 FOR UPDATE")
            .bind(&ids[0].as_bytes()[..])
            .execute(&mut *lock)
            .await
            .expect("lock the row");
        let outcome = Outcome::new(201).with_body("ok");
        let complete = |i: usize| {
            let (store, id, token, outcome) = (store.clone(), ids[i], tokens[i], outcome.clone());
            tokio::spawn(async move { store.complete(&id, token, &outcome, LONG).await })
        };
        let first = complete(0);
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Thirty-two wait behind it (`max_batch` × 32), eight find the queue full.
        let rest: Vec<_> = (1..ids.len()).map(complete).collect();
        tokio::time::sleep(Duration::from_millis(200)).await;
        lock.rollback().await.expect("rollback");
        let mut answers = vec![first.await.expect("task")];
        for answer in futures::future::join_all(rest).await {
            answers.push(answer.expect("task"));
        }
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    });
}

/// Claims whose callers left while they waited in the queue (each out of its budget behind
/// a batch stalled on a lock) take no place in it: a claim that comes next is queued and
/// served, not refused as if Postgres were not keeping up. Before, the given-up claims
/// stayed queued until a batch took them, filled the queue (`max_batch` × 32), and the next
/// claim was answered `Unavailable` at once.
#[test]
fn claims_given_up_in_the_queue_do_not_fill_it() {
    block_on(async {
        let Some(store) = one_call_batches().await else {
            return;
        };
        // The slot's batch waits on a key another transaction is inserting.
        let locked = fresh_id();
        let hold = hold_insert(&store, &locked).await;
        let claim = |id| {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&id, &fp("a"), LONG).await })
        };
        let first = claim(locked);
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Thirty-two queue behind it (`max_batch` × 32); each caller leaves at its budget.
        let gone = (0..32).map(|_| claim(fresh_id())).collect::<Vec<_>>();
        for answer in futures::future::join_all(gone).await {
            let answer = answer.expect("task");
            assert!(matches!(answer, Err(Error::Unavailable(_))), "{answer:?}");
        }
        let next = fresh_id();
        let next = claim(next);
        tokio::time::sleep(Duration::from_millis(100)).await;
        hold.rollback().await.expect("rollback");
        let answer = next.await.expect("task");
        assert!(
            matches!(answer, Ok(Begin::Execute(_))),
            "a claim was refused for a queue of claims nobody waits for: {answer:?}"
        );
        let _ = first.await.expect("task");
        store.drain().await;
    });
}

/// An operator's release whose statements reach Postgres after the call gave up (their
/// bytes held up by the network, then delivered: a kernel retransmits a closed socket's
/// unsent bytes for minutes) must delete nothing: by then the operator was told
/// `Unavailable`, may have released the key again, and a new request may have run and
/// completed under it. Before, a late delete took that new outcome, and the next retry of
/// the key ran the operation a second time. (The release is a transaction now: its row read
/// is held back here, so its delete is never sent; a late commit is bounded by the server's
/// idle timeout, see `DELETE_LOCKED_SQL`.)
#[test]
fn an_operators_delete_that_arrives_after_its_call_gave_up_deletes_nothing() {
    block_on(async {
        let Some(store) = store().await else { return };
        let (relay, late) = relayed_operator(Duration::from_millis(500)).await;
        let id = fresh_id();
        let first = execute(&*store, &id, &fp("a"), LONG).await;
        store
            .complete(&id, first, &Outcome::new(201).with_body("first"), LONG)
            .await
            .expect("complete");
        // A release executes its prepared statement by name, with the record's id bound,
        // which the relay holds back.
        let scope = idempotency_core::ReleaseScope::default().with_completed();
        relay.delay_requests_containing(Duration::from_secs(2), id.as_bytes());
        let gave_up = late.force_release(&id, scope).await;
        assert!(matches!(gave_up, Err(Error::Unavailable(_))), "{gave_up:?}");

        // The operator releases the key again, and a new request runs under it.
        let outcome = idempotency_test::conformance::released_and_run_again(&*store, &id).await;
        // The first delete has reached Postgres by then.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            store.begin(&id, &fp("a"), LONG).await.expect("begin"),
            Begin::Replay(outcome),
            "the late delete took the new outcome"
        );
    });
}

/// An operator's release whose commit reaches Postgres after the call's budget (held up by
/// the network) commits nothing: the operator was told `Unavailable`. Its transaction may
/// stay idle after the delete only until the budget's end; it could stay idle a whole call
/// budget after its clock read, and a commit arriving 1.3 s into a budget of 1 s deleted the
/// record after its caller had given up.
#[test]
fn an_operators_commit_that_arrives_after_its_budget_commits_nothing() {
    block_on(async {
        let Some(store) = store().await else { return };
        let (relay, late) = relayed_operator(Duration::from_secs(1)).await;
        let id = fresh_id();
        let token = execute(&*store, &id, &fp("a"), LONG).await;
        let first = Outcome::new(201).with_body("first");
        store
            .complete(&id, token, &first, LONG)
            .await
            .expect("complete");
        // The row read's answer (a completed record, its retention not over: `1`, an
        // `int2`, and `false`, in Postgres' binary format) comes 700 ms late, so the delete
        // runs 300 ms before the budget's end; its commit then takes 600 ms to get there.
        let row = b"D\0\0\0\x11\0\x02\0\0\0\x02\0\x01\0\0\0\x01\0";
        relay.delay_replies_containing(Duration::from_millis(700), row);
        relay.delay_requests_containing(Duration::from_millis(600), b"COMMIT\0");
        let scope = idempotency_core::ReleaseScope::default().with_completed();
        let gave_up = late.force_release(&id, scope).await;
        assert!(matches!(gave_up, Err(Error::Unavailable(_))), "{gave_up:?}");
        relay.delay_replies(Duration::ZERO);
        relay.delay_requests(Duration::ZERO);
        // The commit has reached Postgres by then.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            store.begin(&id, &fp("a"), LONG).await.expect("begin"),
            Begin::Replay(first),
            "the late commit deleted the record"
        );
    });
}

/// An operator's release whose delete was refused for coming past its budget (the answer
/// of its clock read came late) answers `Unavailable` ("call again"), never that the record
/// was kept: here a lease that ran out, which every release takes, was reported `Live`.
#[test]
fn a_release_refused_for_its_budget_says_so() {
    block_on(async {
        let Some(store) = store().await else { return };
        let (relay, late) = relayed_operator(Duration::from_secs(1)).await;
        let scope = idempotency_core::ReleaseScope::default();
        let id = fresh_id();
        execute(&*store, &id, &fp("a"), SHORT).await;
        tokio::time::sleep(PAST_SHORT).await; // its lease ran out: every scope takes it
        // Only the clock read's answer is held back (a pooled connection's ping passes):
        // what is sent after it passes at once.
        relay.delay_replies_containing(Duration::from_millis(600), b"SELECT 1");
        let asked = tokio::time::Instant::now();
        let release = tokio::spawn(async move { late.force_release(&id, scope).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        relay.delay_replies(Duration::ZERO);
        let answer = release.await.expect("the release");
        assert!(
            asked.elapsed() >= Duration::from_millis(600),
            "the clock read's answer was held back"
        );
        assert!(matches!(answer, Err(Error::Unavailable(_))), "{answer:?}");
    });
}

/// An operator's store of one connection with a call budget of `budget`, through a relay
/// that can hold its bytes back, its release's statements already prepared (so that a
/// release sends no statement text, and takes no more round trips than its own).
async fn relayed_operator(
    budget: Duration,
) -> (idempotency_test::relay::DelayingRelay, PostgresStore) {
    let pg = services::postgres().await.expect("postgres");
    let relay =
        idempotency_test::relay::delaying_relay(idempotency_test::relay::upstream(pg.url())).await;
    let operator = PostgresStore::builder(idempotency_test::relay::through(pg.url(), relay.port))
        .per_request()
        .max_connections(1)
        .call_timeout(budget)
        .connect()
        .await
        .expect("the operator's store");
    let scope = idempotency_core::ReleaseScope::default();
    let other = operator
        .force_release(&fresh_id(), scope)
        .await
        .expect("release");
    assert_eq!(other, idempotency_core::ForceReleased::Absent);
    (relay, operator)
}
