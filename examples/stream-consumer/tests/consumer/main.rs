//! The consumer on a real Redis (streams) and a real Postgres (executor store, ledger).

use std::{
    collections::HashMap,
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use idempotency::postgres::PostgresStore;
use idempotency_test::{block_on, services};
use stream_consumer::{AfterEffect, ConsumeError, Consumer, Polled, publish};
use tokio::sync::Notify;

struct Rig {
    store: Arc<PostgresStore>,
    client: redis::Client,
    redis: redis::aio::MultiplexedConnection,
    stream: String,
    ledger: String,
}

async fn rig() -> Option<Rig> {
    let pg = services::postgres().await?;
    let redis = services::redis().await?;
    let store = PostgresStore::builder(pg.url())
        .max_connections(30)
        .connect()
        .await
        .expect("store");
    store.migrate().await.expect("migrate");
    let client = redis::Client::open(redis.url()).expect("client");
    let redis = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    Some(Rig {
        store: Arc::new(store),
        client,
        redis,
        stream: idempotency_test::unique("charges"),
        ledger: idempotency_test::unique("ledger"),
    })
}

impl Rig {
    /// A consumer of the group `ledger`.
    async fn consumer(&self, name: &str) -> Consumer {
        self.consumer_in("ledger", name).await
    }

    /// A consumer in `group` on its own connection (`XREADGROUP BLOCK` holds the connection
    /// it runs on), writing the rig's ledger.
    async fn consumer_in(&self, group: &str, name: &str) -> Consumer {
        // A response budget far beyond the 100 ms `BLOCK` of each read: redis-rs' default
        // (500 ms) leaves a loaded machine 400 ms of slack.
        let config =
            redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(10)));
        Consumer::new(
            self.client.clone(),
            self.store.clone(),
            &self.stream,
            group,
            name,
            &self.ledger,
        )
        .with_connection_config(config)
    }

    /// A consumer of the group `ledger` whose connections `redis` makes (through a relay).
    fn consumer_through(&self, redis: redis::Client, name: &str) -> Consumer {
        Consumer::new(
            redis,
            self.store.clone(),
            &self.stream,
            "ledger",
            name,
            &self.ledger,
        )
    }

    async fn effects(&self) -> HashMap<String, i64> {
        let sql = format!(
            "SELECT charge_id, count(*) FROM {} GROUP BY charge_id",
            self.ledger
        );
        sqlx::query_as::<_, (String, i64)>(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.store.pool())
            .await
            .expect("ledger")
            .into_iter()
            .collect()
    }

    /// The entries of a dead-letter stream, each as its fields (names and values that are
    /// not UTF-8 read lossily).
    async fn dead_letters(&mut self, stream: &str) -> Vec<HashMap<String, String>> {
        let reply: Vec<(String, Vec<Vec<u8>>)> =
            redis::AsyncCommands::xrange_all(&mut self.redis, stream)
                .await
                .expect("xrange");
        reply
            .into_iter()
            .map(|(_, fields)| {
                fields
                    .chunks(2)
                    .map(|pair| {
                        let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
                        (lossy(&pair[0]), lossy(&pair[1]))
                    })
                    .collect()
            })
            .collect()
    }

    /// Adds a message with exactly these fields (for messages `publish` would not write).
    async fn publish_raw(&mut self, fields: &[(&str, &str)]) -> String {
        redis::AsyncCommands::xadd(&mut self.redis, &self.stream, "*", fields)
            .await
            .expect("xadd")
    }

    /// Sets the group and ledger up, with a cap every amount of a million or more breaks:
    /// an effect that fails on every attempt.
    /// `XGROUP DESTROY` of the group `ledger` (an operator's, or a Redis restarted without
    /// it).
    async fn destroy_group(&mut self) {
        let destroyed: i64 = redis::cmd("XGROUP")
            .arg("DESTROY")
            .arg(&self.stream)
            .arg("ledger")
            .query_async(&mut self.redis)
            .await
            .expect("destroy");
        assert_eq!(destroyed, 1);
    }

    async fn capped_ledger(&self) {
        self.consumer("setup").await.setup().await.expect("setup");
        let check = format!(
            "ALTER TABLE {} ADD CONSTRAINT amount_cap CHECK (amount < 1000000)",
            self.ledger
        );
        sqlx::query(sqlx::AssertSqlSafe(check))
            .execute(self.store.pool())
            .await
            .expect("constraint");
    }

    /// Delivers every new message to a consumer `gone` of the group `ledger` that never
    /// handles them: they stay pending.
    async fn deliver_to_a_consumer_that_dies(&mut self) {
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("ledger")
            .arg("gone")
            .arg("COUNT")
            .arg(100)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut self.redis)
            .await
            .expect("xreadgroup");
    }

    /// Trims every message from the stream: those pending keep only their ids.
    async fn trim_all(&mut self) {
        let _: u64 = redis::cmd("XTRIM")
            .arg(&self.stream)
            .arg("MAXLEN")
            .arg(0)
            .query_async(&mut self.redis)
            .await
            .expect("xtrim");
    }

    async fn pending(&mut self) -> u64 {
        let reply: redis::streams::StreamPendingReply =
            redis::AsyncCommands::xpending(&mut self.redis, &self.stream, "ledger")
                .await
                .expect("xpending");
        reply.count() as u64
    }
}

/// The consumer dies after the effect, before `XACK`; another consumer claims the message,
/// the executor replays, and the effect happened exactly once.
#[test]
fn a_crash_before_ack_is_redelivered_without_a_second_effect() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut first = rig.consumer("c1").await;
        first.setup().await.expect("setup");
        publish(&mut rig.redis, &rig.stream, "ch_crash", 500)
            .await
            .expect("publish");
        first.crash_before_ack = Some("ch_crash".into());
        assert!(matches!(
            first.poll(10).await,
            Err(ConsumeError::Crashed(_))
        ));
        drop(first); // the process is gone; its message stays pending
        assert_eq!(rig.effects().await.get("ch_crash"), Some(&1));
        assert_eq!(rig.pending().await, 1);

        let mut second = rig.consumer("c2").await;
        second.claim_idle = Duration::from_millis(200);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let polled = second.poll(10).await.expect("poll");
        assert_eq!(
            (polled.applied, polled.replayed),
            (0, 1),
            "redelivered and replayed"
        );
        assert_eq!(
            rig.effects().await.get("ch_crash"),
            Some(&1),
            "exactly one effect"
        );
        assert_eq!(rig.pending().await, 0, "acknowledged");
    });
}

/// Consumer `c1` of the rig's group, made, with `charges` published (100 each).
async fn consumer_of(rig: &mut Rig, charges: &[&str]) -> Consumer {
    let mut consumer = rig.consumer("c1").await;
    consumer.setup().await.expect("setup");
    for charge in charges {
        publish(&mut rig.redis, &rig.stream, charge, 100)
            .await
            .expect("publish");
    }
    consumer
}

/// A poll that fails on one message (its `XACK` refused: here a crash before it) leaves the
/// messages it took after that one to the same consumer's next poll. Before, they waited in
/// its pending list for `claim_idle` (30 s by default): the read that took them had reset
/// their idle time, and `>` does not hand them out again.
#[test]
fn a_failed_poll_leaves_the_rest_of_its_messages_to_the_next() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut consumer = consumer_of(&mut rig, &["ch_fails", "ch_next"]).await;
        consumer.crash_before_ack = Some("ch_fails".into());
        assert!(matches!(
            consumer.poll(10).await,
            Err(ConsumeError::Crashed(_))
        ));
        assert_eq!(rig.effects().await.get("ch_next"), None);
        consumer.crash_before_ack = None;
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!((polled.applied, polled.acked), (1, 1), "{polled:?}");
        assert_eq!(
            rig.effects().await,
            HashMap::from([("ch_fails".to_owned(), 1), ("ch_next".to_owned(), 1)]),
        );
        // The one that failed waits for the claim, as before.
        assert_eq!(rig.pending().await, 1);
    });
}

/// The group lost after a poll failed mid-way: the next poll, handling what it owes, meets
/// `NOGROUP` and makes the group again, as a poll that owes nothing does. Found by review:
/// the owed messages' failures were the poll's own, and each poll failed on one more
/// before the claim made the group again.
#[test]
fn a_group_lost_after_a_failed_poll_is_made_again_by_the_next() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        // Its charge fails (over the ledger's cap): counted as a failure, on the group.
        rig.capped_ledger().await;
        let mut consumer = consumer_of(&mut rig, &["ch_fails"]).await;
        publish(&mut rig.redis, &rig.stream, "ch_huge", 5_000_000)
            .await
            .expect("publish");
        consumer.crash_before_ack = Some("ch_fails".into());
        assert!(matches!(
            consumer.poll(10).await,
            Err(ConsumeError::Crashed(_))
        ));
        consumer.crash_before_ack = None;
        rig.destroy_group().await;
        consumer
            .poll(10)
            .await
            .expect("the poll that meets the lost group");
        // The group made again from the stream's start: both come back.
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!((polled.replayed, polled.failed), (1, 1), "{polled:?}");
        assert_eq!(
            rig.effects().await,
            HashMap::from([("ch_fails".to_owned(), 1)])
        );
    });
}

/// A poll dropped in the middle of one message's effect (an outer timeout) leaves the
/// messages it took after that one to the next poll, as a poll that failed does.
#[test]
fn a_dropped_poll_leaves_the_rest_of_its_messages_to_the_next() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut consumer = consumer_of(&mut rig, &["ch_held", "ch_next"]).await;
        let reached = Arc::new(Notify::new());
        consumer.after_effect = Some(hold_at("ch_held", reached.clone(), Arc::new(Notify::new())));
        tokio::select! {
            polled = consumer.poll(10) => panic!("the effect is held: {polled:?}"),
            () = reached.notified() => {}
        }
        consumer.after_effect = None;
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!((polled.applied, polled.acked), (1, 1), "{polled:?}");
        assert_eq!(
            rig.effects().await,
            HashMap::from([("ch_next".to_owned(), 1)]),
            "the held one rolled back; the next applied"
        );
        assert_eq!(rig.pending().await, 1);
    });
}

/// Several previous scopes are each consulted: an upgrade from the group scope and a
/// ledger spelled otherwise before (`public.<table>`) carried together. The option held
/// one scope, and a second call replaced the first: the charges recorded under it were
/// applied again.
#[test]
fn every_previous_scope_is_consulted() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let (group, spelled) = two_previous_scopes(&mut rig).await;
        // What earlier versions recorded, each under its own scope.
        for (scope, charge) in [(&group, "ch_group"), (&spelled, "ch_spelled")] {
            let applied = format!("applied {charge}");
            recorded(&rig, scope, charge, 100, &applied).await;
        }
        for charge in ["ch_group", "ch_spelled", "ch_new"] {
            publish(&mut rig.redis, &rig.stream, charge, 100)
                .await
                .expect("publish");
        }
        let mut consumer = rig
            .consumer("c1")
            .await
            .with_previous_scope(group)
            .with_previous_scope(spelled);
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(
            (polled.applied, polled.replayed),
            (1, 2),
            "the earlier versions' charges replay: {polled:?}"
        );
        let effects = rig.effects().await;
        assert_eq!(effects.get("ch_new"), Some(&1), "{effects:?}");
        assert_eq!(effects.get("ch_group"), None, "{effects:?}");
        assert_eq!(effects.get("ch_spelled"), None, "{effects:?}");
    });
}

/// A charge applied with the message's amount under a later previous scope is applied,
/// whatever an earlier one holds (another amount's record, here): the message is
/// acknowledged. The first scope that held anything answered before, and the message was
/// dead-lettered as a charge applied with another amount although its own amount was in
/// the ledger.
#[test]
fn a_charge_applied_under_any_previous_scope_is_acknowledged() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let (group, spelled) = two_previous_scopes(&mut rig).await;
        // The group scope holds the charge id with another amount; the spelled scope holds
        // it applied with the message's.
        for (scope, amount) in [(&group, 999), (&spelled, 100)] {
            recorded(&rig, scope, "ch_twice", amount, "applied ch_twice").await;
        }
        publish(&mut rig.redis, &rig.stream, "ch_twice", 100)
            .await
            .expect("publish");
        let mut consumer = rig
            .consumer("c1")
            .await
            .with_previous_scope(group)
            .with_previous_scope(spelled);
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(
            (polled.replayed, polled.dead_lettered, polled.applied),
            (1, 0, 0),
            "{polled:?}"
        );
        assert_eq!(rig.effects().await.get("ch_twice"), None);
    });
}

/// A charge id applied with another amount under a previous scope: the dead letter names
/// that scope, where an operator freeing the charge id must release its record. It named
/// none, and the current scope (where the operator looked) held nothing.
#[test]
fn a_charge_applied_otherwise_under_a_previous_scope_names_that_scope() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let (group, _) = two_previous_scopes(&mut rig).await;
        recorded(&rig, &group, "ch_other", 999, "applied ch_other").await;
        publish(&mut rig.redis, &rig.stream, "ch_other", 100)
            .await
            .expect("publish");
        let mut consumer = rig.consumer("c1").await.with_previous_scope(group.clone());
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(polled.dead_lettered, 1, "{polled:?}");
        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        let reason = &dead[0]["reason"];
        assert!(reason.starts_with("mismatch: charge ch_other"), "{reason}");
        assert!(
            reason.contains(&format!("under scope {}", group.as_str())),
            "{reason}"
        );
    });
}

/// A record under a previous scope completed with the message's amount whose stored result
/// no longer decodes fails the message, as under the current scope (dead-lettered after
/// `max_failures`): read as applied, a dead-letter decision stored there was acknowledged,
/// and the charge left no ledger row and no dead letter.
#[test]
fn a_damaged_result_under_a_previous_scope_is_dead_lettered() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let (group, _) = two_previous_scopes(&mut rig).await;
        garbled(&rig, &group, "ch_1", 100).await;
        let (polled, dead) = ch_1_failing_once_under(&mut rig, &group, &[100]).await;
        assert_eq!(
            (polled.dead_lettered, polled.replayed, polled.applied),
            (1, 0, 0),
            "{polled:?}"
        );
        let reason = &dead[0]["reason"];
        assert!(reason.contains("no longer decodes"), "{reason}");
        assert!(reason.contains(group.as_str()), "{reason}");
        assert_eq!(rig.effects().await.get("ch_1"), None);
        assert_eq!(rig.pending().await, 0);
    });
}

/// A duplicate of a charge already dead-lettered because its record under a previous scope
/// is damaged is dead-lettered on its first delivery, with that decision: the current scope
/// holds it. Before, each duplicate met the damaged record first and counted failures of its
/// own to `max_failures` (about `max_failures` × `claim_idle` of waiting) before it got
/// there.
#[test]
fn a_duplicate_of_a_charge_dead_lettered_for_a_damaged_old_record_is_dead_lettered_at_once() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let (group, _) = two_previous_scopes(&mut rig).await;
        garbled(&rig, &group, "ch_1", 100).await;
        let (polled, _) = ch_1_failing_once_under(&mut rig, &group, &[100]).await;
        assert_eq!(polled.dead_lettered, 1, "{polled:?}");
        publish(&mut rig.redis, &rig.stream, "ch_1", 100)
            .await
            .expect("publish");
        let mut consumer = rig.consumer("c2").await.with_previous_scope(group.clone());
        consumer.max_failures = 3;
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!((polled.dead_lettered, polled.failed), (1, 0), "{polled:?}");
        assert_eq!(rig.pending().await, 0);
        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        assert_eq!(dead.len(), 2, "{dead:?}");
        // The decision as stored, as the main path replays it: no scope of its own named.
        let decided = format!("dead-lettered ch_1: {}", dead[0]["reason"]);
        assert_eq!(dead[1]["reason"], decided, "{dead:?}");
        assert_eq!(rig.effects().await.get("ch_1"), None);
    });
}

/// A charge applied under the current scope is acknowledged at once, whatever damage its
/// record under a previous scope carries: the ledger holds it. Before, it counted failures
/// on that record to `max_failures` first.
#[test]
fn a_charge_applied_under_the_current_scope_is_acknowledged_despite_a_damaged_old_record() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let (group, _) = two_previous_scopes(&mut rig).await;
        // Applied by this version (its ledger row and record in one transaction).
        publish(&mut rig.redis, &rig.stream, "ch_1", 100)
            .await
            .expect("publish");
        let polled = rig.consumer("c0").await.poll(10).await.expect("poll");
        assert_eq!(polled.applied, 1, "{polled:?}");
        garbled(&rig, &group, "ch_1", 100).await;
        publish(&mut rig.redis, &rig.stream, "ch_1", 100)
            .await
            .expect("publish");
        let mut consumer = rig.consumer("c1").await.with_previous_scope(group.clone());
        consumer.max_failures = 3;
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(
            (polled.replayed, polled.failed, polled.dead_lettered),
            (1, 0, 0),
            "{polled:?}"
        );
        assert_eq!(rig.pending().await, 0);
        assert_eq!(rig.effects().await.get("ch_1"), Some(&1));
    });
}

/// A record under a previous scope neither the operator's view nor a claim can read fails
/// the message of its amount (dead-lettered after `max_failures`, deciding the charge with
/// that amount); a message of another amount is dead-lettered as a mismatch, naming the
/// damaged scope. It was counted as damaged too, its dead-letter decision then answered
/// `Mismatch` (read as an attempt that would decide), and it stayed pending for ever.
#[test]
fn every_message_of_a_charge_damaged_under_a_previous_scope_is_dead_lettered() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let (group, _) = two_previous_scopes(&mut rig).await;
        recorded(&rig, &group, "ch_1", 100, "applied ch_1").await;
        damage(&rig, &group, "ch_1", "status = -1, response = '\\x00'").await;
        let (polled, dead) = ch_1_failing_once_under(&mut rig, &group, &[100, 200]).await;
        assert_eq!(
            (polled.dead_lettered, polled.deferred, polled.applied),
            (2, 0, 0),
            "{polled:?}"
        );
        assert_eq!(rig.pending().await, 0);
        for letter in &dead {
            assert!(letter["reason"].contains(group.as_str()), "{dead:?}");
        }
        assert!(
            dead[1]["reason"].contains("mismatch: charge ch_1"),
            "{dead:?}"
        );
        assert_eq!(rig.effects().await.get("ch_1"), None);
    });
}

/// A charge an earlier version applied, its record's status column damaged (the operator's
/// view cannot read it; a claim, which reads the stored result, can): acknowledged as
/// applied. It was dead-lettered as damaged, and the docs' way to apply a dead-lettered
/// charge (release its records, publish again) applied it twice.
#[test]
fn an_applied_charge_the_operators_view_cannot_read_under_a_previous_scope_is_acknowledged() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let (group, _) = two_previous_scopes(&mut rig).await;
        recorded(&rig, &group, "ch_1", 100, "applied ch_1").await;
        damage(&rig, &group, "ch_1", "status = -1").await;
        let (polled, dead) = ch_1_failing_once_under(&mut rig, &group, &[100]).await;
        assert_eq!(
            (polled.replayed, polled.dead_lettered, polled.applied),
            (1, 0, 0),
            "{polled:?} {dead:?}"
        );
        assert_eq!(rig.pending().await, 0);
    });
}

/// A charge applied with another amount under the current scope, its record unreadable to
/// the operator's view (which fails on a live completed row alone): dead-lettered as a
/// mismatch. The claim answered `Mismatch`, the view nothing, and the message was deferred
/// as if another attempt held the charge, on every delivery, for ever.
#[test]
fn a_charge_held_by_another_amounts_unreadable_record_is_dead_lettered() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut setup = rig.consumer("setup").await;
        setup.setup().await.expect("setup");
        recorded(&rig, &setup.scope(), "ch_1", 100, "applied ch_1").await;
        damage(&rig, &setup.scope(), "ch_1", "status = -1").await;
        publish(&mut rig.redis, &rig.stream, "ch_1", 200)
            .await
            .expect("publish");
        let mut consumer = rig.consumer("c1").await;
        consumer.max_failures = 1;
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(
            (polled.dead_lettered, polled.deferred),
            (1, 0),
            "{polled:?}"
        );
        assert_eq!(rig.pending().await, 0);
        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        assert!(
            dead[0]["reason"].starts_with("mismatch: charge ch_1"),
            "{dead:?}"
        );
    });
}

/// Damages the key table's row of `charge` under `scope` (`set`: an `UPDATE`'s assignments).
async fn damage(rig: &Rig, scope: &idempotency::Scope, charge: &str, set: &str) {
    use idempotency::{IdempotencyKey, RecordId};

    let id = RecordId::new(scope, &IdempotencyKey::new(charge).expect("key"));
    let sql = format!("UPDATE idempotency_keys SET {set} WHERE record_id = $1");
    let damaged = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&id.as_bytes()[..])
        .execute(rig.store.pool())
        .await
        .expect("damage the record");
    assert_eq!(damaged.rows_affected(), 1);
}

/// Publishes charge `ch_1` once with each of `amounts` and polls them once with a consumer
/// that looks under `previous` and dead-letters a message at its first failure: what the
/// poll counted, and the dead letters.
async fn ch_1_failing_once_under(
    rig: &mut Rig,
    previous: &idempotency::Scope,
    amounts: &[i64],
) -> (Polled, Vec<HashMap<String, String>>) {
    for &amount in amounts {
        publish(&mut rig.redis, &rig.stream, "ch_1", amount)
            .await
            .expect("publish");
    }
    let mut consumer = rig
        .consumer("c1")
        .await
        .with_previous_scope(previous.clone());
    consumer.max_failures = 1;
    let polled = consumer.poll(10).await.expect("poll");
    let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
    (polled, dead)
}

/// Records `charge` with `amount` under `scope` completed with a result that no longer
/// decodes (not the JSON string the executor stores).
async fn garbled(rig: &Rig, scope: &idempotency::Scope, charge: &str, amount: i64) {
    use idempotency::{Begin, Fingerprint, IdempotencyKey, Outcome, RecordId, Store};

    let id = RecordId::new(scope, &IdempotencyKey::new(charge).expect("key"));
    let fp = Fingerprint::of(&amount.to_be_bytes());
    let Ok(Begin::Execute(token)) = rig.store.begin(&id, &fp, Duration::from_secs(30)).await else {
        panic!("a fresh key");
    };
    let garbled = Outcome::new(200).with_body("not what the consumer stored");
    rig.store
        .complete(&id, token, &garbled, Duration::from_secs(3600))
        .await
        .expect("complete");
}

/// Sets the rig up and names the two scopes earlier versions used: the group scope, and the
/// ledger spelled `public.<table>`.
async fn two_previous_scopes(rig: &mut Rig) -> (idempotency::Scope, idempotency::Scope) {
    rig.consumer("setup").await.setup().await.expect("setup");
    let group = Consumer::group_scope(&rig.stream, "ledger");
    let spelled = idempotency::Scope::new(format!("ledger:public.{}", rig.ledger));
    (group, spelled)
}

/// Records what an earlier version of the consumer stored for `charge` with `amount` under
/// `scope`: its decision, `value`.
async fn recorded(rig: &Rig, scope: &idempotency::Scope, charge: &str, amount: i64, value: &str) {
    use idempotency::{Executor, Fingerprint, IdempotencyKey};

    let key = IdempotencyKey::new(charge).expect("key");
    let fp = Fingerprint::of(&amount.to_be_bytes());
    let value = value.to_owned();
    Executor::new(rig.store.clone())
        .run(scope, &key, &fp, || async move {
            Ok::<_, std::convert::Infallible>(value)
        })
        .await
        .expect("an earlier version's record");
}

/// A group created anew on the same stream (renamed, or reset to the stream's start)
/// reads every charge again: each replays, none is applied a second time. The charge is
/// the effect's, not the group's.
#[test]
fn a_group_created_anew_on_the_same_stream_applies_nothing_again() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut first = rig.consumer("c1").await;
        first.setup().await.expect("setup");
        for (charge, amount) in [("ch_a", 100), ("ch_b", 200), ("ch_c", 300)] {
            publish(&mut rig.redis, &rig.stream, charge, amount)
                .await
                .expect("publish");
        }
        let polled = first.poll(10).await.expect("poll");
        assert_eq!(polled.applied, 3, "{polled:?}");

        let mut renamed = rig.consumer_in("ledger-v2", "c1").await;
        renamed.setup().await.expect("setup");
        let polled = renamed.poll(10).await.expect("poll");
        assert_eq!(
            (polled.applied, polled.replayed),
            (0, 3),
            "every charge replays: {polled:?}"
        );
        let effects = rig.effects().await;
        for charge in ["ch_a", "ch_b", "ch_c"] {
            assert_eq!(effects.get(charge), Some(&1), "one effect for {charge}");
        }
    });
}

/// The group gone under a running consumer (a Redis restarted from a snapshot older than the
/// group, or with no persistence; a failover to a replica that never got it; an operator's
/// `XGROUP DESTROY`): the poll that meets it makes it again from the stream's start, and the
/// next ones apply what is new and replay what was applied. Before, every poll failed on
/// `NOGROUP` for good, and nothing was applied until someone ran `setup` again.
#[test]
fn a_group_lost_under_a_running_consumer_is_made_again() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut consumer = rig.consumer("c1").await;
        consumer.setup().await.expect("setup");
        publish(&mut rig.redis, &rig.stream, "ch_before", 100)
            .await
            .expect("publish");
        assert_eq!(consumer.poll(10).await.expect("poll").applied, 1);
        rig.destroy_group().await;
        publish(&mut rig.redis, &rig.stream, "ch_after", 200)
            .await
            .expect("publish");
        let (mut applied, mut replayed) = (0, 0);
        for _ in 0..3 {
            let polled = consumer
                .poll(10)
                .await
                .expect("a poll after the group was lost");
            applied += polled.applied;
            replayed += polled.replayed;
        }
        assert_eq!(
            (applied, replayed),
            (1, 1),
            "the new charge applied, the old replayed"
        );
        let effects = rig.effects().await;
        for charge in ["ch_before", "ch_after"] {
            assert_eq!(effects.get(charge), Some(&1), "one effect for {charge}");
        }
    });
}

/// An upgrade from the group scope with `with_previous_scope`: a charge applied under the
/// old key is acknowledged as a replay, one an old attempt still holds waits, and one whose
/// old attempt ran out unfinished (it never committed) is applied, once.
#[test]
fn an_upgrade_from_the_group_scope_applies_nothing_twice() {
    use idempotency::{Begin, Fingerprint, IdempotencyKey, Outcome, RecordId, Store};

    block_on(async {
        let Some(mut rig) = rig().await else { return };
        rig.consumer("setup").await.setup().await.expect("setup");
        let old = Consumer::group_scope(&rig.stream, "ledger");
        let claim = |charge: &str, lease: Duration| {
            let id = RecordId::new(&old, &IdempotencyKey::new(charge).expect("key"));
            let store = rig.store.clone();
            async move {
                let fp = Fingerprint::of(&100i64.to_be_bytes());
                match store.begin(&id, &fp, lease).await.expect("begin") {
                    Begin::Execute(token) => (id, token),
                    other => panic!("a fresh key answered {other:?}"),
                }
            }
        };
        // Applied by the old version: its ledger row and its outcome.
        let (done, token) = claim("ch_done", Duration::from_secs(30)).await;
        let insert = format!(
            "INSERT INTO {} (charge_id, amount) VALUES ('ch_done', 100)",
            rig.ledger
        );
        sqlx::query(sqlx::AssertSqlSafe(insert))
            .execute(rig.store.pool())
            .await
            .expect("ledger");
        // Its result as the executor stores it (a JSON string).
        let stored = Outcome::new(200).with_body(r#""applied ch_done""#);
        rig.store
            .complete(&done, token, &stored, Duration::from_secs(3600))
            .await
            .expect("complete");
        // Held by an old attempt right now, and one that ran out unfinished.
        claim("ch_live", Duration::from_secs(30)).await;
        claim("ch_over", Duration::ZERO).await;
        for charge in ["ch_done", "ch_live", "ch_over"] {
            publish(&mut rig.redis, &rig.stream, charge, 100)
                .await
                .expect("publish");
        }

        let mut upgraded = rig.consumer("c1").await.with_previous_scope(old);
        let polled = upgraded.poll(10).await.expect("poll");
        assert_eq!(
            (polled.applied, polled.replayed, polled.deferred),
            (1, 1, 1),
            "{polled:?}"
        );
        let effects = rig.effects().await;
        assert_eq!(effects.get("ch_done"), Some(&1), "not applied again");
        assert_eq!(effects.get("ch_over"), Some(&1), "applied once");
        assert_eq!(effects.get("ch_live"), None, "waits for the old attempt");
        assert_eq!(rig.pending().await, 1);
    });
}

/// 1,000 messages, 20 % of them duplicates (half published back to back, so two consumers
/// race on them), three consumers: every charge applied exactly once.
#[test]
fn a_thousand_messages_with_duplicates_apply_each_charge_once() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        rig.consumer("setup").await.setup().await.expect("setup");
        let unique = 800;
        let mut published = 0;
        for i in 0..unique {
            publish(&mut rig.redis, &rig.stream, &format!("ch_{i}"), 100 + i)
                .await
                .expect("publish");
            published += 1;
            if i % 4 == 0 {
                // A producer retry: right away for half, later for the other half.
                let j = if i % 8 == 0 { i } else { i / 2 };
                publish(&mut rig.redis, &rig.stream, &format!("ch_{j}"), 100 + j)
                    .await
                    .expect("publish");
                published += 1;
            }
        }
        assert_eq!(published, 1000);

        let acked = Arc::new(AtomicU64::new(0));
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut pool = Vec::new();
        for n in 0..3 {
            pool.push(rig.consumer(&format!("c{n}")).await);
        }
        let consumers = pool.into_iter().map(|mut consumer| {
            consumer.claim_idle = Duration::from_millis(300);
            let acked = acked.clone();
            tokio::spawn(async move {
                let mut mine = (0, 0, 0);
                while acked.load(Ordering::SeqCst) < 1000 {
                    assert!(Instant::now() < deadline, "the stream never drained");
                    let polled = consumer.poll(50).await.expect("poll");
                    mine.0 += polled.applied;
                    mine.1 += polled.replayed;
                    mine.2 += polled.acked;
                    acked.fetch_add(polled.acked, Ordering::SeqCst);
                }
                mine
            })
        });
        let totals: Vec<(u64, u64, u64)> = futures::future::join_all(consumers)
            .await
            .into_iter()
            .map(|r| r.expect("consumer"))
            .collect();
        let applied: u64 = totals.iter().map(|t| t.0).sum();
        let replayed: u64 = totals.iter().map(|t| t.1).sum();
        let acked_total: u64 = totals.iter().map(|t| t.2).sum();
        eprintln!(
            "consumers (applied, replayed, acked): {totals:?} acked={}",
            acked.load(Ordering::SeqCst)
        );

        let effects = rig.effects().await;
        assert_eq!(effects.len(), unique as usize, "every charge applied");
        assert!(effects.values().all(|n| *n == 1), "no charge applied twice");
        assert_eq!(applied, 800, "effects run");
        assert_eq!(acked_total, 1000, "every message acknowledged once");
        // Every duplicate replays; a message redelivered while its first consumer still held
        // it replays too, so there can be more replays than duplicates.
        assert!(replayed >= 200, "{replayed}");
        assert_eq!(rig.pending().await, 0);
        let dead = format!("{}:dead", rig.stream);
        assert!(
            rig.dead_letters(&dead).await.is_empty(),
            "good messages are never dead-lettered"
        );
    });
}

/// Malformed messages and a charge id repeated with another amount can never succeed: they
/// are dead-lettered on their first delivery, with their fields and why, and never claimed
/// again; the good messages around them are applied as before.
#[test]
fn malformed_and_mismatched_messages_are_dead_lettered_at_once() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut consumer = rig.consumer("c1").await;
        consumer.setup().await.expect("setup");
        consumer.claim_idle = Duration::from_millis(50);

        publish(&mut rig.redis, &rig.stream, "ch_ok", 100)
            .await
            .expect("publish");
        let no_amount = rig.publish_raw(&[("charge_id", "ch_no_amount")]).await;
        let bad_amount = rig
            .publish_raw(&[("charge_id", "ch_bad_amount"), ("amount", "ten")])
            .await;
        let no_charge = rig
            .publish_raw(&[("amount", "5"), ("reason", "mine")])
            .await;
        // An amount is a positive whole number, written plainly.
        let negative = rig
            .publish_raw(&[("charge_id", "ch_negative"), ("amount", "-500")])
            .await;
        let zero = rig
            .publish_raw(&[("charge_id", "ch_zero"), ("amount", "0")])
            .await;
        let plus = rig
            .publish_raw(&[("charge_id", "ch_plus"), ("amount", "+7")])
            .await;
        let mismatch = publish(&mut rig.redis, &rig.stream, "ch_ok", 999)
            .await
            .expect("publish");
        publish(&mut rig.redis, &rig.stream, "ch_ok", 100)
            .await
            .expect("publish"); // a true duplicate: replayed, not dead-lettered

        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(
            polled,
            Polled {
                applied: 1,
                replayed: 1,
                deferred: 0,
                failed: 0,
                dead_lettered: 7,
                not_stored: 0,
                acked: 9,
            }
        );

        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        let summary: Vec<(&str, &str, &str)> = dead
            .iter()
            .map(|d| {
                (
                    d["id"].as_str(),
                    d["deliveries"].as_str(),
                    d["group"].as_str(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                (no_amount.as_str(), "1", "ledger"),
                (bad_amount.as_str(), "1", "ledger"),
                (no_charge.as_str(), "1", "ledger"),
                (negative.as_str(), "1", "ledger"),
                (zero.as_str(), "1", "ledger"),
                (plus.as_str(), "1", "ledger"),
                (mismatch.as_str(), "1", "ledger"),
            ]
        );
        for bad in &dead[3..6] {
            assert!(
                bad["reason"].starts_with("malformed: the amount is not a positive"),
                "{bad:?}"
            );
        }
        assert!(
            dead[0]["reason"].starts_with("malformed: no amount"),
            "{:?}",
            dead[0]
        );
        assert!(
            dead[1]["reason"].starts_with("malformed: the amount is not a positive"),
            "{:?}",
            dead[1]
        );
        assert!(
            dead[2]["reason"].starts_with("malformed: no charge_id"),
            "{:?}",
            dead[2]
        );
        assert!(
            dead[6]["reason"].starts_with("mismatch: charge ch_ok"),
            "{:?}",
            dead[6]
        );
        assert_eq!(dead[1]["payload.amount"], "ten");
        // The message's own `reason` field is kept apart from the dead letter's.
        assert_eq!(dead[2]["payload.reason"], "mine");
        assert_eq!(dead[6]["payload.charge_id"], "ch_ok");
        assert_eq!(dead[6]["payload.amount"], "999");
        assert_eq!(rig.pending().await, 0, "all acknowledged");

        // Past `claim_idle`, nothing comes back.
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(consumer.poll(10).await.expect("poll"), Polled::default());
        assert_eq!(
            rig.dead_letters(&format!("{}:dead", rig.stream))
                .await
                .len(),
            7
        );
        assert_eq!(
            rig.effects().await,
            HashMap::from([("ch_ok".to_owned(), 1)])
        );
    });
}

/// An effect that fails on every attempt (here a check constraint the amount breaks) is
/// retried on each claim, and dead-lettered on its `max_failures`-th failure. Every
/// delivery goes to a fresh consumer — a restart — so the count is the one Redis keeps.
#[test]
fn a_message_failing_on_every_delivery_is_dead_lettered_after_max_failures() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        rig.capped_ledger().await;
        let graveyard = idempotency_test::unique("graveyard");
        let doomed = publish(&mut rig.redis, &rig.stream, "ch_huge", 5_000_000)
            .await
            .expect("publish");
        publish(&mut rig.redis, &rig.stream, "ch_fine", 10)
            .await
            .expect("publish");

        let mut rounds = Vec::new();
        for round in 0..8 {
            let mut consumer = rig.consumer(&format!("c{round}")).await;
            consumer.claim_idle = Duration::from_millis(50);
            consumer.max_failures = 3;
            consumer.dead_letter_stream.clone_from(&graveyard);
            let polled = consumer.poll(10).await.expect("poll");
            rounds.push((polled.applied, polled.failed, polled.dead_lettered));
            if round == 0 {
                // Counted per stream and group: another group's attempts are its own.
                let counts = format!("{}:ledger:failures", rig.stream);
                let counted: Option<u64> =
                    redis::AsyncCommands::hget(&mut rig.redis, &counts, &doomed)
                        .await
                        .expect("hget");
                assert_eq!(counted, Some(1));
            }
            // Past `claim_idle`, so the next consumer claims what this one left pending.
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        assert_eq!(
            rounds,
            [
                (1, 1, 0), // ch_fine applied; ch_huge: delivery 1 fails
                (0, 1, 0), // delivery 2 fails
                (0, 0, 1), // delivery 3 fails: dead-lettered
                (0, 0, 0), // and never claimed again
                (0, 0, 0),
                (0, 0, 0),
                (0, 0, 0),
                (0, 0, 0),
            ]
        );

        let dead = rig.dead_letters(&graveyard).await;
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0]["id"], doomed);
        assert_eq!(dead[0]["deliveries"], "3");
        assert_eq!(dead[0]["consumer"], "c2");
        assert_eq!(dead[0]["payload.charge_id"], "ch_huge");
        assert_eq!(dead[0]["payload.amount"], "5000000");
        let reason = &dead[0]["reason"];
        assert!(
            reason.starts_with("failed 3 times (delivery 3): "),
            "{reason}"
        );
        assert_eq!(dead[0]["failures"], "3");
        assert!(
            reason.contains("amount_cap"),
            "the database's reason: {reason}"
        );
        let default_dead = format!("{}:dead", rig.stream);
        assert!(rig.dead_letters(&default_dead).await.is_empty());
        assert_eq!(rig.pending().await, 0);
        assert_eq!(
            rig.effects().await,
            HashMap::from([("ch_fine".to_owned(), 1)])
        );
    });
}

/// The effect committed with its result, then the store's database went down for longer than
/// the executor's lease, so the executor could not confirm the commit on any retry
/// (`RunError::Unconfirmed`). The message stays pending — not acknowledged (had the
/// transaction not committed, its charge would be lost), not dead-lettered, not counted
/// toward dead-lettering — and once the database is back its redelivery replays the charge:
/// applied once.
#[test]
fn a_charge_whose_commit_could_not_be_confirmed_is_redelivered_and_replays() {
    block_on(async {
        let Some((pg, mut rig)) = stoppable_rig().await else {
            return;
        };
        let mut consumer = rig.consumer("c1").await.with_lease(Duration::from_secs(2));
        consumer.setup().await.expect("setup");
        consumer.claim_idle = Duration::from_millis(50);
        consumer.after_commit = Some(stops(pg.clone()));
        publish(&mut rig.redis, &rig.stream, "ch_lost", 700)
            .await
            .expect("publish");

        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(
            polled,
            Polled {
                failed: 1,
                ..Polled::default()
            }
        );
        assert_eq!(rig.pending().await, 1, "left pending, not acknowledged");
        let dead = format!("{}:dead", rig.stream);
        assert!(
            rig.dead_letters(&dead).await.is_empty(),
            "an applied charge is not dead-lettered"
        );

        // The database back, past `claim_idle`: the pending message is claimed again and
        // replays the committed charge.
        consumer.after_commit = None;
        pg.start().await;
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(
            consumer.poll(10).await.expect("poll"),
            Polled {
                replayed: 1,
                acked: 1,
                ..Polled::default()
            }
        );
        assert_eq!(rig.pending().await, 0);
        assert_eq!(
            rig.effects().await,
            HashMap::from([("ch_lost".to_owned(), 1)]),
            "applied once"
        );
    });
}

/// A rig on a Postgres of its own (store and ledger), which a test fault stops. The store's
/// default budgets: a short one would also bound the healthy calls (the first `begin` opens
/// the pool's first connection; the ledger is read just after the restart), which on a
/// loaded machine can miss it.
async fn stoppable_rig() -> Option<(Arc<services::Service>, Rig)> {
    if services::skipping() {
        return None;
    }
    let redis = services::redis().await?;
    let (pg, store) = idempotency_test::stores::stoppable_postgres_with(|b| b).await?;
    let client = redis::Client::open(redis.url()).expect("client");
    let rig = Rig {
        store,
        redis: client
            .get_multiplexed_async_connection()
            .await
            .expect("redis"),
        client,
        stream: idempotency_test::unique("charges"),
        ledger: idempotency_test::unique("ledger"),
    };
    Some((Arc::new(pg), rig))
}

/// A fault that stops `pg`.
fn stops(pg: Arc<services::Service>) -> AfterEffect {
    Arc::new(
        move |_charge: &str| -> Pin<Box<dyn Future<Output = ()> + Send>> {
            let pg = pg.clone();
            Box::pin(async move { pg.stop().await })
        },
    )
}

/// A fault that tells `reached` when the effect of `charge` got to it, then waits for
/// `go` (for ever, if nothing notifies it).
fn hold_at(charge: &'static str, reached: Arc<Notify>, go: Arc<Notify>) -> AfterEffect {
    Arc::new(
        move |id: &str| -> Pin<Box<dyn Future<Output = ()> + Send>> {
            let (reached, go, hit) = (reached.clone(), go.clone(), id == charge);
            Box::pin(async move {
                if hit {
                    reached.notify_one();
                    go.notified().await;
                }
            })
        },
    )
}

/// The consumer's poll is dropped in the middle of the effect — a shutdown's `select!`, an
/// outer timeout — after the ledger row was written and before anything was stored. The
/// row must not stay without its outcome: once the run's lease is given back, the message's
/// redelivery runs the effect, and the charge is applied once, not twice (the row was
/// written outside any transaction, and the redelivery wrote it again).
#[test]
fn a_poll_dropped_mid_effect_applies_the_charge_once() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut first = rig.consumer("c1").await;
        first.setup().await.expect("setup");
        let reached = Arc::new(Notify::new());
        first.after_effect = Some(hold_at("ch_drop", reached.clone(), Arc::new(Notify::new())));
        publish(&mut rig.redis, &rig.stream, "ch_drop", 500)
            .await
            .expect("publish");
        tokio::select! {
            polled = first.poll(10) => panic!("the effect is held: {polled:?}"),
            () = reached.notified() => {}
        }
        // The poll is gone; what it left to settle (its lease) is given back.
        first.drain().await;

        let mut second = rig.consumer("c2").await;
        second.claim_idle = Duration::from_millis(50);
        tokio::time::sleep(Duration::from_millis(150)).await;
        let polled = second.poll(10).await.expect("poll");
        assert_eq!(polled.acked, 1, "{polled:?}");
        assert_eq!(
            rig.effects().await,
            HashMap::from([("ch_drop".to_owned(), 1)]),
            "applied once"
        );
        assert_eq!(rig.pending().await, 0);
    });
}

/// Deliveries that never ran the effect — consumers that claimed the message and died
/// before handling it, or found it in flight on another — are not failures: a message is
/// dead-lettered after `max_failures` attempts that failed, not after that many claims.
/// Here three consumers claim it and vanish; the fourth delivery's attempt fails once, and
/// the message stays pending for another.
#[test]
fn claims_that_never_ran_the_effect_do_not_count_toward_dead_lettering() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        rig.capped_ledger().await;
        publish(&mut rig.redis, &rig.stream, "ch_huge", 5_000_000)
            .await
            .expect("publish");
        let options = redis::streams::StreamReadOptions::default()
            .group("ledger", "ghost-0")
            .count(10);
        let _: Option<redis::streams::StreamReadReply> =
            redis::AsyncCommands::xread_options(&mut rig.redis, &[&rig.stream], &[">"], &options)
                .await
                .expect("read");
        for ghost in ["ghost-1", "ghost-2"] {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _: redis::streams::StreamAutoClaimReply = redis::AsyncCommands::xautoclaim_options(
                &mut rig.redis,
                &rig.stream,
                "ledger",
                ghost,
                50,
                "0-0",
                redis::streams::StreamAutoClaimOptions::default(),
            )
            .await
            .expect("claim");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;

        let mut consumer = rig.consumer("c1").await;
        consumer.claim_idle = Duration::from_millis(50);
        consumer.max_failures = 3;
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(
            polled,
            Polled {
                failed: 1,
                ..Polled::default()
            },
            "one attempt failed, on the fourth delivery"
        );
        assert_eq!(rig.pending().await, 1, "left for another attempt");
        assert!(
            rig.dead_letters(&format!("{}:dead", rig.stream))
                .await
                .is_empty()
        );
    });
}

/// A charge's attempt whose worker died (its record left in flight, its lease run out) and
/// whose message was trimmed never finishes: a message naming that charge with another
/// amount waited for it on every delivery, for ever, neither applied nor dead-lettered. Each
/// such wait counts as a failure of the message now: it is dead-lettered after
/// `max_failures` deliveries, and nothing is applied. So too when the dead attempt is under
/// the previous scope of an upgrade (`with_previous_scope`), where it was waited for, for ever.
#[test]
fn a_mismatch_with_an_attempt_that_never_finishes_is_dead_lettered_in_the_end() {
    use idempotency::{Fingerprint, IdempotencyKey, RecordId, Store};
    block_on(async {
        for previous in [false, true] {
            let Some(mut rig) = rig().await else { return };
            let old = Consumer::group_scope(&rig.stream, "ledger");
            let mut consumer = rig.consumer("c1").await;
            if previous {
                consumer = consumer.with_previous_scope(old.clone());
            }
            consumer.setup().await.expect("setup");
            consumer.claim_idle = Duration::from_millis(50);
            consumer.max_failures = 3;
            // The dead worker's claim of `ch_dead` for 100, which it never finished.
            let scope = if previous { old } else { consumer.scope() };
            let id = RecordId::new(&scope, &IdempotencyKey::new("ch_dead").expect("key"));
            let fingerprint = Fingerprint::of(&100i64.to_be_bytes());
            let begun = rig
                .store
                .begin(&id, &fingerprint, Duration::from_millis(100))
                .await
                .expect("begin");
            assert!(matches!(begun, idempotency::Begin::Execute(_)), "{begun:?}");
            publish(&mut rig.redis, &rig.stream, "ch_dead", 200)
                .await
                .expect("publish");
            let mut dead_lettered = 0;
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(120)).await;
                let polled = consumer.poll(10).await.expect("poll");
                assert_eq!(polled.applied, 0, "{polled:?}");
                dead_lettered += polled.dead_lettered;
                if rig.pending().await == 0 {
                    break;
                }
            }
            assert_eq!(
                dead_lettered, 1,
                "previous scope {previous}: dead-lettered once"
            );
            assert_eq!(rig.pending().await, 0);
            let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
            assert_eq!(dead.len(), 1);
            assert!(
            dead[0]["reason"].starts_with("mismatch: charge ch_dead is held by an attempt with another amount whose lease ran out"),
            "{dead:?}"
        );
            assert_eq!(dead[0]["payload.amount"], "200");
            // The record to release to apply it, once its attempt is known dead.
            assert!(
                dead[0]["reason"].contains(&format!("under scope {} ", scope.as_str())),
                "{dead:?}"
            );
            assert!(rig.effects().await.is_empty(), "nothing applied");
        }
    });
}

/// Two messages name one charge with two amounts, and the first is still being applied when
/// the second arrives: the second is not dead-lettered as "already applied" (the first may
/// yet fail and be released), but deferred. Once the first is applied, the second's next
/// delivery is dead-lettered for the mismatch.
#[test]
fn a_mismatch_with_a_charge_still_in_flight_is_deferred_then_dead_lettered() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut first = rig.consumer("c1").await;
        first.setup().await.expect("setup");
        let (reached, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        first.after_effect = Some(hold_at("ch_twice", reached.clone(), go.clone()));
        publish(&mut rig.redis, &rig.stream, "ch_twice", 100)
            .await
            .expect("publish");
        let applying = tokio::spawn(async move { first.poll(10).await.expect("poll") });
        reached.notified().await;
        publish(&mut rig.redis, &rig.stream, "ch_twice", 999)
            .await
            .expect("publish");

        let mut second = rig.consumer("c2").await;
        second.claim_idle = Duration::from_millis(50);
        // A wait for a live attempt is no failure of the message: not dead-lettered even
        // on the first failure.
        second.max_failures = 1;
        let polled = second.poll(10).await.expect("poll");
        assert_eq!(
            polled,
            Polled {
                deferred: 1,
                ..Polled::default()
            },
            "the charge is still in flight"
        );

        go.notify_one();
        let polled = applying.await.expect("first consumer");
        assert_eq!(polled.applied, 1, "{polled:?}");
        tokio::time::sleep(Duration::from_millis(150)).await;
        let polled = second.poll(10).await.expect("poll");
        assert_eq!(polled.dead_lettered, 1, "{polled:?}");
        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        assert_eq!(dead.len(), 1);
        assert!(
            dead[0]["reason"].starts_with("mismatch: charge ch_twice"),
            "{dead:?}"
        );
        assert_eq!(dead[0]["payload.amount"], "999");
        assert_eq!(
            rig.effects().await,
            HashMap::from([("ch_twice".to_owned(), 1)])
        );
        assert_eq!(rig.pending().await, 0);
    });
}

/// The database goes down in the middle of the effect (after the ledger write, before the
/// commit): the transaction rolls back, nothing took effect, and that is no fault of the
/// message. It is not counted toward dead-lettering (here one failure would dead-letter),
/// stays pending, and is applied once when the database is back.
#[test]
fn a_database_outage_mid_effect_is_not_a_failure_of_the_message() {
    block_on(async {
        let Some((pg, mut rig)) = stoppable_rig().await else {
            return;
        };
        let mut consumer = rig.consumer("c1").await;
        consumer.setup().await.expect("setup");
        consumer.claim_idle = Duration::from_millis(50);
        consumer.max_failures = 1;
        consumer.after_effect = Some(stops(pg.clone()));
        publish(&mut rig.redis, &rig.stream, "ch_outage", 700)
            .await
            .expect("publish");

        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(
            polled,
            Polled {
                failed: 1,
                ..Polled::default()
            }
        );
        assert_eq!(rig.pending().await, 1, "left pending, not dead-lettered");

        consumer.after_effect = None;
        pg.start().await;
        consumer.drain().await; // the lease given back once the database answered
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut applied = 0;
        while applied == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            applied += consumer.poll(10).await.expect("poll").applied;
        }
        assert_eq!(applied, 1);
        assert_eq!(
            rig.effects().await,
            HashMap::from([("ch_outage".to_owned(), 1)]),
            "applied once"
        );
        assert!(
            rig.dead_letters(&format!("{}:dead", rig.stream))
                .await
                .is_empty()
        );
    });
}

/// A failed attempt of a message that another consumer acknowledged meanwhile (here the ack
/// lands while the effect runs, and the effect then fails) counts nothing: the ack dropped
/// the message's failure count, and an increment after it would stay in the hash for ever.
#[test]
fn a_failure_of_a_message_acknowledged_meanwhile_is_not_counted() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut consumer = rig.consumer("c1").await;
        consumer.setup().await.expect("setup");
        let id = publish(&mut rig.redis, &rig.stream, "ch_acked", 100)
            .await
            .expect("publish");
        let (redis, stream) = (rig.redis.clone(), rig.stream.clone());
        consumer.after_effect = Some(Arc::new(
            move |_charge: &str| -> Pin<Box<dyn Future<Output = ()> + Send>> {
                let (mut redis, stream, id) = (redis.clone(), stream.clone(), id.clone());
                Box::pin(async move {
                    let acked: u64 =
                        redis::AsyncCommands::xack(&mut redis, &stream, "ledger", &[&id])
                            .await
                            .expect("xack");
                    assert_eq!(acked, 1);
                    panic!("the effect fails after another consumer's ack");
                })
            },
        ));
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(polled.failed, 1, "{polled:?}");
        let counts = format!("{}:ledger:failures", rig.stream);
        let left: u64 = redis::AsyncCommands::hlen(&mut rig.redis, &counts)
            .await
            .expect("hlen");
        assert_eq!(left, 0, "a failure count outlived its message");
    });
}

/// Claiming looks at a bounded stretch of the pending list per poll (`XAUTOCLAIM` checks at
/// most ten entries per message asked for) and goes on from where it stopped: an idle
/// message behind a long run of live ones is reached. Always starting at the front, the
/// consumer never got past the live ones.
#[test]
fn an_idle_message_behind_many_live_ones_is_claimed() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut consumer = rig.consumer("c1").await;
        consumer.setup().await.expect("setup");
        // Far longer than the eight polls below (each blocks 100 ms reading): the live
        // ones stay unclaimable while they run.
        consumer.claim_idle = Duration::from_secs(4);
        let mut live = Vec::new();
        for n in 0..30 {
            live.push(
                publish(&mut rig.redis, &rig.stream, &format!("ch_live_{n}"), 1)
                    .await
                    .expect("publish"),
            );
        }
        publish(&mut rig.redis, &rig.stream, "ch_orphan", 1)
            .await
            .expect("publish");
        // A consumer reads them all and dies; a live one claims all but the last and works
        // on them (each claim makes an entry fresh again).
        let options = redis::streams::StreamReadOptions::default()
            .group("ledger", "dead")
            .count(100);
        let _: Option<redis::streams::StreamReadReply> =
            redis::AsyncCommands::xread_options(&mut rig.redis, &[&rig.stream], &[">"], &options)
                .await
                .expect("read");
        tokio::time::sleep(Duration::from_millis(4200)).await;
        let _: redis::Value = redis::cmd("XCLAIM")
            .arg(&rig.stream)
            .arg("ledger")
            .arg("busy")
            .arg(0)
            .arg(&live)
            .arg("JUSTID")
            .query_async(&mut rig.redis)
            .await
            .expect("xclaim");
        let mut claimed = false;
        for _ in 0..8 {
            consumer.poll(1).await.expect("poll");
            if rig.effects().await.contains_key("ch_orphan") {
                claimed = true;
                break;
            }
        }
        assert!(claimed, "the idle message was never claimed");
        assert_eq!(rig.effects().await["ch_orphan"], 1);
    });
}

/// A database that refuses the ledger write for its own reasons (here read-only, as a pool
/// left on a standby after a failover answers; a rotated password, a table not migrated do
/// the same) is an outage, not a fault of the message: nothing is dead-lettered, however
/// many deliveries fail, and the charge is applied once the database takes writes again.
/// Only classes 08, 40, 53 and 57 were outages: after `max_failures` deliveries the message
/// was dead-lettered and acknowledged, its charge never applied.
#[test]
fn a_database_refusing_writes_for_its_own_reasons_dead_letters_nothing() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        rig.consumer("setup").await.setup().await.expect("setup");
        let (function, table) = (format!("{}_read_only", rig.ledger), rig.ledger.clone());
        for statement in [
            format!(
                "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
                 RAISE EXCEPTION 'read-only' USING ERRCODE = '25006'; END $$"
            ),
            format!(
                "CREATE TRIGGER read_only BEFORE INSERT ON {table} FOR EACH ROW \
                 EXECUTE FUNCTION {function}()"
            ),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(rig.store.pool())
                .await
                .expect("trigger");
        }
        publish(&mut rig.redis, &rig.stream, "ch_1", 100)
            .await
            .expect("publish");
        let mut consumer = rig.consumer("c1").await;
        consumer.claim_idle = Duration::from_millis(50);
        consumer.max_failures = 1;
        for _ in 0..3 {
            let polled = consumer.poll(10).await.expect("poll");
            assert_eq!(polled.dead_lettered, 0, "{polled:?}");
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        assert!(
            rig.dead_letters(&format!("{}:dead", rig.stream))
                .await
                .is_empty()
        );
        assert_eq!(rig.pending().await, 1, "still pending");

        let drop = format!("DROP TRIGGER read_only ON {table}");
        sqlx::query(sqlx::AssertSqlSafe(drop))
            .execute(rig.store.pool())
            .await
            .expect("drop trigger");
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(polled.applied, 1, "{polled:?}");
        assert_eq!(rig.effects().await, HashMap::from([("ch_1".to_owned(), 1)]));
        assert_eq!(rig.pending().await, 0);
    });
}

/// A charge whose stored result no longer decodes fails on every delivery, for the
/// message's sake: it is dead-lettered after `max_failures`, as the crate's docs say. Read
/// as an outage (the review of the previous commit), it stayed pending for ever.
#[test]
fn a_charge_whose_stored_result_no_longer_decodes_is_dead_lettered() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut setup = rig.consumer("setup").await;
        setup.setup().await.expect("setup");
        garbled(&rig, &setup.scope(), "ch_1", 100).await;
        publish(&mut rig.redis, &rig.stream, "ch_1", 100)
            .await
            .expect("publish");
        let mut consumer = rig.consumer("c1").await;
        consumer.max_failures = 1;
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(polled.dead_lettered, 1, "{polled:?}");
        assert_eq!(rig.pending().await, 0);
    });
}

/// A charge's record lives as long as the ledger's row: a group created anew on the stream
/// (reset to its start) a day or a year later replays the charge. Kept for the default
/// retention of a day, its record expired and the charge was applied again. So it is with
/// the lease changed (`with_lease` keeps the retention, where `with_policy(Policy::default()
/// .with_lease(..))` brought back the day).
#[test]
fn a_charges_record_is_kept_for_good() {
    use idempotency::{IdempotencyKey, RecordId, Store};
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut default = rig.consumer("c1").await;
        default.setup().await.expect("setup");
        let leased = rig.consumer("c2").await.with_lease(Duration::from_secs(10));
        for (mut consumer, charge) in [(default, "ch_kept"), (leased, "ch_kept_leased")] {
            publish(&mut rig.redis, &rig.stream, charge, 100)
                .await
                .expect("publish");
            assert_eq!(consumer.poll(10).await.expect("poll").applied, 1);
            let key = IdempotencyKey::new(charge).expect("key");
            let record = rig
                .store
                .inspect(&RecordId::new(&consumer.scope(), &key))
                .await
                .expect("inspect")
                .expect("a record");
            let kept = record
                .expires_at
                .duration_since(std::time::SystemTime::now())
                .expect("in the future");
            assert!(
                kept > Duration::from_secs(50 * 365 * 86_400),
                "{charge}: kept for {kept:?} only"
            );
        }
    });
}

/// A message whose field name is not UTF-8 is dead-lettered on its own; the messages read
/// with it are applied. (Read as strings, the whole reply failed to parse: every message of
/// the batch stayed pending and came back with it, for ever.)
#[test]
fn a_field_name_that_is_not_utf8_dead_letters_its_message_only() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut consumer = rig.consumer("c1").await;
        consumer.setup().await.expect("setup");
        consumer.claim_idle = Duration::from_millis(50);
        publish(&mut rig.redis, &rig.stream, "ch_before", 100)
            .await
            .expect("publish");
        let bad: String = redis::cmd("XADD")
            .arg(&rig.stream)
            .arg("*")
            .arg(&b"\xffname"[..])
            .arg("1")
            .arg("charge_id")
            .arg("ch_bad")
            .arg("amount")
            .arg("5")
            .query_async(&mut rig.redis)
            .await
            .expect("xadd");
        publish(&mut rig.redis, &rig.stream, "ch_after", 200)
            .await
            .expect("publish");
        let mut applied = 0;
        for _ in 0..5 {
            if let Ok(polled) = consumer.poll(10).await {
                applied += polled.applied;
            }
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        assert_eq!(applied, 2);
        let effects = rig.effects().await;
        assert_eq!(
            (
                effects.get("ch_before"),
                effects.get("ch_after"),
                effects.get("ch_bad")
            ),
            (Some(&1), Some(&1), None)
        );
        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        assert_eq!(dead.len(), 1, "{dead:?}");
        assert_eq!(dead[0]["id"], bad);
        assert!(
            dead[0]["reason"].starts_with("malformed: a field name is not UTF-8"),
            "{:?}",
            dead[0]
        );
        assert_eq!(rig.pending().await, 0);
    });
}

/// A message trimmed from the stream while pending (its fields are gone) is dead-lettered
/// with its id, not dropped without a trace.
#[test]
fn a_message_trimmed_while_pending_is_dead_lettered() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut first = rig.consumer("c1").await;
        first.setup().await.expect("setup");
        let id = publish(&mut rig.redis, &rig.stream, "ch_trimmed", 100)
            .await
            .expect("publish");
        // Delivered to a consumer that dies before handling it.
        rig.deliver_to_a_consumer_that_dies().await;
        rig.trim_all().await;
        first.claim_idle = Duration::from_millis(50);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let polled = first.poll(10).await.expect("poll");
        assert_eq!(polled.dead_lettered, 1, "{polled:?}");
        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        assert_eq!(dead.len(), 1, "{dead:?}");
        assert_eq!(dead[0]["id"], id);
        assert!(dead[0]["reason"].starts_with("trimmed"), "{:?}", dead[0]);
        assert_eq!(rig.pending().await, 0);
        assert!(rig.effects().await.is_empty());
    });
}

/// Messages trimmed while pending whose dead letter cannot be written at once (here the
/// dead-letter key holds a string) stay pending, and are dead-lettered by a later poll —
/// here by another consumer, as after a restart: `XAUTOCLAIM` reports a trimmed id once,
/// and takes it off the pending list. Before, the failed poll took them off the list and
/// kept them in its process's memory only, so a restart lost them without a trace.
#[test]
fn trimmed_messages_whose_dead_letter_failed_are_dead_lettered_later() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut first = rig.consumer("c1").await;
        first.setup().await.expect("setup");
        let ids = trimmed_while_pending(&mut rig).await;
        let dead_key = format!("{}:dead", rig.stream);
        let _: () = redis::cmd("SET")
            .arg(&dead_key)
            .arg("in the way")
            .query_async(&mut rig.redis)
            .await
            .expect("set");
        first.claim_idle = Duration::from_millis(50);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            first.poll(10).await.is_err(),
            "the dead letter cannot be written"
        );
        drop(first); // a restart
        assert_eq!(rig.pending().await, 2, "nothing was taken off the list");

        let _: () = redis::cmd("DEL")
            .arg(&dead_key)
            .query_async(&mut rig.redis)
            .await
            .expect("del");
        let mut second = rig.consumer("c2").await;
        second.claim_idle = Duration::from_millis(50);
        let polled = second.poll(10).await.expect("poll");
        assert_eq!(polled.dead_lettered, 2, "{polled:?}");
        assert_eq!(dead_letter_ids(&mut rig, &dead_key).await, ids);
        assert_eq!(rig.pending().await, 0);
        assert!(rig.effects().await.is_empty());
    });
}

/// Messages trimmed while pending are dead-lettered even when the answer of the claim that
/// found them never arrives (a response timeout, or a poll dropped by a shutdown's
/// `select!`): the claim's own script wrote their dead letters. Before, they were written by
/// the poll after the answer came, and without it they were lost without a trace.
#[test]
fn trimmed_messages_are_dead_lettered_when_the_claims_answer_is_lost() {
    use idempotency_test::relay;

    block_on(async {
        let Some(mut rig) = rig().await else { return };
        rig.consumer("setup").await.setup().await.expect("setup");
        let ids = trimmed_while_pending(&mut rig).await;
        let url = services::redis().await.expect("redis").url().to_owned();
        let slow = relay::delaying_relay(relay::upstream(&url)).await;
        let through = redis::Client::open(relay::through(&url, slow.port)).expect("client");
        let mut consumer = rig.consumer_through(through, "c1");
        consumer.claim_idle = Duration::from_millis(50);
        consumer.setup().await.expect("connected"); // before the replies are held back
        tokio::time::sleep(Duration::from_millis(100)).await;
        slow.delay_replies(Duration::from_secs(2));
        let given_up = tokio::time::timeout(Duration::from_millis(300), consumer.poll(10)).await;
        assert!(
            given_up.is_err(),
            "the claim's answer is late: {given_up:?}"
        );
        drop(consumer);
        // The claim ran in Redis all the same.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(rig.pending().await, 0, "XAUTOCLAIM took them off the list");
        let dead_key = format!("{}:dead", rig.stream);
        assert_eq!(dead_letter_ids(&mut rig, &dead_key).await, ids);
        assert!(rig.effects().await.is_empty());
    });
}

/// Publishes two charges, delivers them to a consumer that dies, and trims the stream:
/// both are pending, with no fields left. Returns their ids.
async fn trimmed_while_pending(rig: &mut Rig) -> Vec<String> {
    let mut ids = Vec::new();
    for charge in ["ch_trimmed_1", "ch_trimmed_2"] {
        let id = publish(&mut rig.redis, &rig.stream, charge, 100)
            .await
            .expect("publish");
        ids.push(id);
    }
    rig.deliver_to_a_consumer_that_dies().await;
    rig.trim_all().await;
    ids
}

/// The ids the dead letters in `dead_key` name, sorted.
async fn dead_letter_ids(rig: &mut Rig, dead_key: &str) -> Vec<String> {
    let dead = rig.dead_letters(dead_key).await;
    let mut ids: Vec<_> = dead.iter().map(|d| d["id"].clone()).collect();
    ids.sort();
    ids
}

/// A message dead-lettered for its failures while another consumer still holds it (claimed
/// in a batch that consumer is working through) is not applied by that one afterwards, even
/// once the cause is gone: dead-lettering decides the charge, and every later delivery of
/// it replays the dead letter. It was dead-lettered and applied both.
#[test]
fn a_charge_dead_lettered_while_another_consumer_holds_it_is_not_applied() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        rig.consumer("setup").await.setup().await.expect("setup");
        // The ledger refuses the charges listed in `<ledger>_blocked` (a constraint, as a
        // missing foreign row would); deleting the row fixes the cause.
        let ledger = rig.ledger.clone();
        let ddl = format!(
            "CREATE TABLE {ledger}_blocked (charge_id text);
             INSERT INTO {ledger}_blocked VALUES ('ch_doomed');
             CREATE FUNCTION {ledger}_check() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF EXISTS (SELECT 1 FROM {ledger}_blocked WHERE charge_id = NEW.charge_id) THEN
                 RAISE EXCEPTION 'blocked' USING ERRCODE = '23514';
               END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER {ledger}_check BEFORE INSERT ON {ledger}
               FOR EACH ROW EXECUTE FUNCTION {ledger}_check();"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
            .execute(rig.store.pool())
            .await
            .expect("trigger");
        publish(&mut rig.redis, &rig.stream, "ch_first", 10)
            .await
            .expect("publish");
        let doomed = publish(&mut rig.redis, &rig.stream, "ch_doomed", 20)
            .await
            .expect("publish");
        // Both delivered to a consumer that died: pending.
        rig.deliver_to_a_consumer_that_dies().await;
        tokio::time::sleep(Duration::from_millis(100)).await;

        // B claims both. While it applies the first, A takes the second over, fails on it
        // and dead-letters it (its first failure is its last); then the cause goes.
        let mut a = rig.consumer("a").await;
        a.claim_idle = Duration::ZERO;
        a.max_failures = 1;
        let a = Arc::new(tokio::sync::Mutex::new(a));
        let pool = rig.store.pool().clone();
        let mut b = rig.consumer("b").await;
        b.claim_idle = Duration::from_millis(50);
        b.after_effect = Some(Arc::new(move |charge: &str| {
            let (a, pool, ledger) = (a.clone(), pool.clone(), ledger.clone());
            let first = charge == "ch_first";
            Box::pin(async move {
                if !first {
                    return;
                }
                let polled = a.lock().await.poll(10).await.expect("a polls");
                assert_eq!(polled.dead_lettered, 1, "{polled:?}");
                sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {ledger}_blocked")))
                    .execute(&pool)
                    .await
                    .expect("the cause goes");
            })
        }));
        b.poll(10).await.expect("b polls");

        let effects = rig.effects().await;
        assert_eq!(effects.get("ch_first"), Some(&1));
        assert_eq!(
            effects.get("ch_doomed"),
            None,
            "a dead-lettered charge was applied"
        );
        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        assert_eq!(dead.len(), 1, "{dead:?}");
        assert_eq!(dead[0]["id"], doomed);
        assert_eq!(rig.pending().await, 0);

        // Published again, it replays the dead letter: dead-lettered too, not applied.
        publish(&mut rig.redis, &rig.stream, "ch_doomed", 20)
            .await
            .expect("publish");
        let mut c = rig.consumer("c").await;
        let polled = c.poll(10).await.expect("poll");
        assert_eq!((polled.applied, polled.dead_lettered), (0, 1), "{polled:?}");
        assert_eq!(rig.effects().await.get("ch_doomed"), None);
        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        assert!(
            dead[1]["reason"].starts_with("dead-lettered ch_doomed: failed 1 times"),
            "{:?}",
            dead[1]
        );
    });
}

/// A message trimmed while pending is dead-lettered even when the poll that learns of it
/// fails later on (here a crash after another message's effect): `XAUTOCLAIM` reports a
/// trimmed id once, and it was handled last, so it was lost.
#[test]
fn a_trimmed_message_is_dead_lettered_before_the_poll_can_fail() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut first = rig.consumer("c1").await;
        first.setup().await.expect("setup");
        let trimmed = publish(&mut rig.redis, &rig.stream, "ch_trimmed", 100)
            .await
            .expect("publish");
        let kept = publish(&mut rig.redis, &rig.stream, "ch_crash", 200)
            .await
            .expect("publish");
        rig.deliver_to_a_consumer_that_dies().await;
        let _: u64 = redis::cmd("XTRIM")
            .arg(&rig.stream)
            .arg("MINID")
            .arg(&kept)
            .query_async(&mut rig.redis)
            .await
            .expect("xtrim");
        first.claim_idle = Duration::from_millis(50);
        first.crash_before_ack = Some("ch_crash".into());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(matches!(
            first.poll(10).await,
            Err(ConsumeError::Crashed(_))
        ));
        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        assert_eq!(dead.len(), 1, "{dead:?}");
        assert_eq!(dead[0]["id"], trimmed);
    });
}

/// A charge decided dead-lettered whose message was not moved yet (the consumer died, or its
/// poll was dropped, between the two: the decision is stored first) is dead-lettered on its
/// next delivery, not applied and not acknowledged as done.
#[test]
fn a_charge_decided_dead_lettered_dead_letters_its_pending_message() {
    block_on(decided_dead_lettered_dead_letters_its_message(false));
}

/// The same, decided by an earlier version under a previous scope (its group's, or the
/// ledger spelled otherwise): before, any completed record there read as "applied", and the
/// message was acknowledged, leaving no dead letter and no ledger row.
#[test]
fn a_charge_decided_dead_lettered_under_a_previous_scope_dead_letters_its_message() {
    block_on(decided_dead_lettered_dead_letters_its_message(true));
}

async fn decided_dead_lettered_dead_letters_its_message(previous: bool) {
    let Some(mut rig) = rig().await else { return };
    let mut consumer = rig.consumer("c1").await;
    let old = Consumer::group_scope(&rig.stream, "ledger");
    let scope = if previous {
        consumer = consumer.with_previous_scope(old.clone());
        old
    } else {
        consumer.scope()
    };
    consumer.setup().await.expect("setup");
    let id = publish(&mut rig.redis, &rig.stream, "ch_decided", 30)
        .await
        .expect("publish");
    // What the dead-lettering consumer stored before it died.
    let decided = "dead-lettered ch_decided: failed 5 times";
    recorded(&rig, &scope, "ch_decided", 30, decided).await;
    let polled = consumer.poll(10).await.expect("poll");
    assert_eq!(
        (polled.applied, polled.replayed, polled.dead_lettered),
        (0, 0, 1),
        "{polled:?}"
    );
    assert_eq!(rig.effects().await.get("ch_decided"), None);
    let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["id"], id);
    // Where the decision is, to release it there and apply the charge after all.
    let named = format!("(decided under scope {})", scope.as_str());
    assert!(!previous || dead[0]["reason"].ends_with(&named), "{dead:?}");
    assert_eq!(rig.pending().await, 0);
}

/// A message with more fields than a Lua script can unpack (about 8,000 values) is still
/// dead-lettered, its payload cut to what fits and marked so. The script acknowledged it
/// first and then failed on the copy: the message was gone, and no dead letter said so.
/// And with a hundred thousand, it is dead-lettered for its size, not parsed: the parse
/// compared each field name with every one before it, which held the consumer (and, once
/// claimed by each in turn, every consumer of the group) for a minute, then applied it.
#[test]
fn a_message_with_thousands_of_fields_is_dead_lettered_not_lost() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let mut consumer = rig.consumer("c1").await;
        consumer.setup().await.expect("setup");
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&rig.stream).arg("*");
        xadd.arg("charge_id").arg("ch_wide").arg("amount").arg(100);
        for i in 0..100_000 {
            xadd.arg(format!("f{i:06}")).arg("v");
        }
        let id: String = xadd.query_async(&mut rig.redis).await.expect("xadd");
        let polled = consumer.poll(10).await.expect("poll");
        assert_eq!(polled.dead_lettered, 1, "{polled:?}");
        let dead = rig.dead_letters(&format!("{}:dead", rig.stream)).await;
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0]["id"], id);
        assert!(
            dead[0]["reason"].starts_with("malformed: 100002 fields"),
            "{:?}",
            dead[0]["reason"]
        );
        assert_eq!(dead[0]["payload.charge_id"], "ch_wide");
        assert_eq!(dead[0]["payload.f000000"], "v");
        assert!(dead[0].contains_key("payload_omitted"), "the cut is marked");
        assert_eq!(rig.pending().await, 0);
        assert!(rig.effects().await.is_empty());
    });
}

/// A group destroyed and created again starts its messages' failure counts afresh, as it
/// does their deliveries: a count is never more than the deliveries the pending list
/// counts. The old group's count carried over, and a charge was dead-lettered after one
/// failed attempt in the new group.
#[test]
fn a_group_created_again_counts_failures_afresh() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        rig.capped_ledger().await;
        publish(&mut rig.redis, &rig.stream, "ch_huge", 5_000_000)
            .await
            .expect("publish");
        let mut admin = rig.redis.clone();
        let poll = |name: &'static str| {
            let rig = &rig;
            async move {
                let mut consumer = rig.consumer(name).await;
                consumer.claim_idle = Duration::from_millis(50);
                consumer.max_failures = 3;
                let polled = consumer.poll(10).await.expect("poll");
                tokio::time::sleep(Duration::from_millis(100)).await; // past `claim_idle`
                (polled.failed, polled.dead_lettered)
            }
        };
        assert_eq!(poll("c0").await, (1, 0));
        assert_eq!(poll("c1").await, (1, 0));
        for args in [["DESTROY", "ledger", ""], ["CREATE", "ledger", "0"]] {
            let mut cmd = redis::cmd("XGROUP");
            cmd.arg(args[0]).arg(&rig.stream).arg(args[1]);
            if !args[2].is_empty() {
                cmd.arg(args[2]);
            }
            let _: redis::Value = cmd.query_async(&mut admin).await.expect("xgroup");
        }
        assert_eq!(poll("c2").await, (1, 0), "the new group's first failure");
        assert_eq!(poll("c3").await, (1, 0));
        assert_eq!(poll("c4").await, (0, 1), "its third");
        assert!(rig.effects().await.is_empty());
    });
}

/// The cap by deliveries above holds a carried-over count down only until deliveries pass
/// it: a message deferred in the new group (its charge held elsewhere, Postgres down) gains
/// deliveries without failures, and the old count came back whole — dead-lettered, "failed 3
/// times", after one failure in the new group. A group `setup` creates starts with no
/// failure counts at all.
#[test]
fn a_group_setup_creates_again_starts_with_no_failure_counts() {
    use idempotency::{Fingerprint, IdempotencyKey, RecordId, Store};
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        rig.capped_ledger().await;
        publish(&mut rig.redis, &rig.stream, "ch_huge", 5_000_000)
            .await
            .expect("publish");
        let mut admin = rig.redis.clone();
        let poll = |name: &'static str| {
            let rig = &rig;
            async move {
                let mut consumer = rig.consumer(name).await;
                consumer.claim_idle = Duration::from_millis(50);
                consumer.max_failures = 3;
                let polled = consumer.poll(10).await.expect("poll");
                tokio::time::sleep(Duration::from_millis(100)).await; // past `claim_idle`
                polled
            }
        };
        assert_eq!(poll("c0").await.failed, 1);
        assert_eq!(poll("c1").await.failed, 1);
        let _: redis::Value = redis::cmd("XGROUP")
            .arg("DESTROY")
            .arg(&rig.stream)
            .arg("ledger")
            .query_async(&mut admin)
            .await
            .expect("xgroup destroy");
        let mut creator = rig.consumer("c2").await;
        creator.setup().await.expect("setup");
        // The charge held by another worker's live attempt: three deliveries, deferred.
        let id = RecordId::new(
            &creator.scope(),
            &IdempotencyKey::new("ch_huge").expect("key"),
        );
        let fingerprint = Fingerprint::of(&5_000_000i64.to_be_bytes());
        let idempotency::Begin::Execute(token) = rig
            .store
            .begin(&id, &fingerprint, Duration::from_secs(30))
            .await
            .expect("begin")
        else {
            panic!("a fresh charge")
        };
        for name in ["c3", "c4", "c5"] {
            assert_eq!(poll(name).await.deferred, 1);
        }
        rig.store.release(&id, token).await.expect("release");
        let polled = poll("c6").await;
        assert_eq!(
            (polled.failed, polled.dead_lettered),
            (1, 0),
            "the new group's first failure"
        );
        assert!(rig.effects().await.is_empty());
    });
}

/// A consumer that dies once it decided a charge dead-lettered, before it moved the message:
/// the message stays pending, and its next delivery, the cause since gone, dead-letters it
/// instead of applying the charge. (Moved first, a death there left the charge free.)
#[test]
fn a_consumer_dying_between_the_decision_and_the_dead_letter_applies_nothing() {
    block_on(async {
        let Some(mut rig) = rig().await else { return };
        rig.capped_ledger().await;
        publish(&mut rig.redis, &rig.stream, "ch_capped", 5_000_000)
            .await
            .expect("publish");
        let mut first = rig.consumer("c1").await;
        first.max_failures = 1;
        first.crash_before_dead_letter = Some("ch_capped".into());
        assert!(matches!(
            first.poll(10).await,
            Err(ConsumeError::Crashed(_))
        ));
        drop(first);
        assert_eq!(rig.pending().await, 1, "still pending");
        // The cause goes; the next delivery finds the charge decided.
        let uncap = format!("ALTER TABLE {} DROP CONSTRAINT amount_cap", rig.ledger);
        sqlx::query(sqlx::AssertSqlSafe(uncap))
            .execute(rig.store.pool())
            .await
            .expect("uncap");
        let mut second = rig.consumer("c2").await;
        second.claim_idle = Duration::from_millis(50);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let polled = second.poll(10).await.expect("poll");
        assert_eq!((polled.applied, polled.dead_lettered), (0, 1), "{polled:?}");
        assert!(
            rig.effects().await.is_empty(),
            "a dead-lettered charge was applied"
        );
        assert_eq!(rig.pending().await, 0);
    });
}

/// The consumer's connection closed under it (Redis restarted, a proxy or the network reset
/// it): the next poll makes a new one and goes on. Before, the consumer held one multiplexed
/// connection, which redis-rs never makes again: every poll after the reset failed, for
/// good, and the messages stayed pending.
#[test]
fn a_consumer_whose_connection_was_cut_goes_on_consuming() {
    use std::sync::atomic::AtomicBool;

    use idempotency_test::relay;

    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let url = services::redis().await.expect("redis").url().to_owned();
        let armed = Arc::new(AtomicBool::new(false));
        let port = relay::cutting_relay(relay::upstream(&url), armed.clone(), |_| true).await;
        let through = redis::Client::open(relay::through(&url, port)).expect("client");
        let mut consumer = rig.consumer_through(through, "c1");
        consumer.setup().await.expect("setup");
        // The next reply on the consumer's connection is lost, and the connection closed.
        armed.store(true, Ordering::SeqCst);
        let cut = consumer.poll(10).await;
        assert!(cut.is_err(), "the poll met the reset: {cut:?}");
        publish(&mut rig.redis, &rig.stream, "ch_after_reset", 100)
            .await
            .expect("publish");
        let polls = polls_until_applied(&mut consumer, 3).await;
        assert_eq!(
            rig.effects().await.get("ch_after_reset"),
            Some(&1),
            "the consumer stopped consuming: {polls:?}"
        );
    });
}

/// A failover that leaves the consumer's connection on the demoted primary (a proxy that
/// keeps its sessions, an operator's `REPLICAOF`): it answers `READONLY` to every claim and
/// acknowledgement. The consumer makes its connection again and reaches the new primary.
#[test]
fn a_consumer_left_on_a_demoted_primary_moves_to_the_new_one() {
    use idempotency_test::{relay, services::RedisOptions};

    block_on(async {
        let Some(rig) = rig().await else { return };
        let old = services::start_redis(RedisOptions::default()).await;
        let new = services::start_redis(RedisOptions::default()).await;
        let relay = relay::stalling_relay(relay::upstream(old.url())).await;
        let through = redis::Client::open(relay::through(old.url(), relay.port)).expect("client");
        let mut consumer = rig.consumer_through(through, "c1");
        consumer.setup().await.expect("setup");
        consumer.poll(10).await.expect("a poll on the primary");
        // The failover: the old primary becomes a replica (of a primary it cannot reach: it
        // answers reads, refuses writes); new connections go to the new one, which holds
        // the stream and its group, as replication would have left them.
        let connect = |url: &str| {
            let client = redis::Client::open(url).expect("client");
            async move {
                client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connection")
            }
        };
        old.demote().await;
        relay.redirect(relay::upstream(new.url()));
        let mut primary = connect(new.url()).await;
        let () =
            redis::AsyncCommands::xgroup_create_mkstream(&mut primary, &rig.stream, "ledger", "0")
                .await
                .expect("the group on the new primary");
        publish(&mut primary, &rig.stream, "ch_after_failover", 100)
            .await
            .expect("publish");
        let polls = polls_until_applied(&mut consumer, 5).await;
        assert_eq!(
            rig.effects().await.get("ch_after_failover"),
            Some(&1),
            "still on the demoted primary: {polls:?}"
        );
    });
}

/// A peer gone behind a proxy that keeps its session (nothing is answered, nothing closed),
/// and polls under an outer timeout shorter than the connection's response timeout: each
/// poll is dropped while it waits. The dropped call forgets the connection, and the next
/// poll reaches Redis on a new one. Before, the connection was forgotten only once a call
/// on it failed, which a dropped call never does: every poll queued on it, for good.
#[test]
fn a_consumer_whose_polls_are_cut_short_leaves_a_silent_connection() {
    use idempotency_test::relay;

    block_on(async {
        let Some(mut rig) = rig().await else { return };
        let url = services::redis().await.expect("redis").url().to_owned();
        let relay = relay::stalling_relay(relay::upstream(&url)).await;
        let through = redis::Client::open(relay::through(&url, relay.port)).expect("client");
        let config =
            redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(2)));
        let mut consumer = rig
            .consumer_through(through, "c1")
            .with_connection_config(config);
        consumer.setup().await.expect("setup");
        consumer
            .poll(10)
            .await
            .expect("a poll on the live connection");
        // Its host vanishes; a new one answers new connections.
        relay.vanish();
        relay.fail_over();
        publish(&mut rig.redis, &rig.stream, "ch_after_silence", 100)
            .await
            .expect("publish");
        let mut polls = Vec::new();
        for _ in 0..5 {
            let polled = tokio::time::timeout(Duration::from_secs(1), consumer.poll(10)).await;
            let applied = matches!(&polled, Ok(Ok(polled)) if polled.applied > 0);
            polls.push(polled.map(|p| p.map(|p| p.applied).map_err(|e| e.to_string())));
            if applied {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            rig.effects().await.get("ch_after_silence"),
            Some(&1),
            "every poll waited on the silent connection: {polls:?}"
        );
    });
}

/// Polls until one applies a charge, `n` polls at most, 100 ms apart: what each answered.
async fn polls_until_applied(
    consumer: &mut Consumer,
    n: usize,
) -> Vec<Result<Polled, ConsumeError>> {
    let mut polls = Vec::new();
    for _ in 0..n {
        let polled = consumer.poll(10).await;
        let applied = matches!(&polled, Ok(polled) if polled.applied > 0);
        polls.push(polled);
        if applied {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    polls
}
