//! The consumer on a real Redis (streams) and a real Postgres (executor store, ledger).

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use idempotency::postgres::PostgresStore;
use idempotency_test::{block_on, services};
use stream_consumer::{ConsumeError, Consumer, publish};

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
    /// A consumer on its own connection: `XREADGROUP BLOCK` holds the connection it runs on.
    async fn consumer(&self, name: &str) -> Consumer {
        let conn = self
            .client
            .get_multiplexed_async_connection()
            .await
            .expect("redis");
        Consumer::new(
            conn,
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
    });
}
