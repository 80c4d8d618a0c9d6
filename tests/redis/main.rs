//! The Redis store against a real Redis and a real 3-master Redis Cluster: conformance
//! (including `stale_token_changes_nothing`: a stale owner cannot complete, release or renew,
//! and the new owner's record is intact), races, hung and stopped Redis, and the
//! eviction-policy check.

use std::{sync::Arc, time::Duration};

use idempotency_core::{Begin, Error, Outcome, Store};
use idempotency_redis::{EvictionCheck, RedisStore, Replaced};
use idempotency_test::{
    block_on,
    conformance::{LONG, execute, fp, fresh_id},
    services::{self, RedisOptions, Service},
};
use tokio::sync::OnceCell;

async fn store() -> Option<Arc<RedisStore>> {
    static STORE: OnceCell<Arc<RedisStore>> = OnceCell::const_new();
    let redis = services::redis().await?;
    Some(
        STORE
            .get_or_init(|| async {
                let store = RedisStore::builder(redis.url())
                    .prefix(idempotency_test::unique("t"))
                    .connect()
                    .await
                    .expect("store");
                Arc::new(store)
            })
            .await
            .clone(),
    )
}

/// A plain connection to the shared Redis, to look at or change what the store wrote.
async fn shared_connection() -> redis::aio::MultiplexedConnection {
    let redis = services::redis().await.expect("redis");
    redis::Client::open(redis.url())
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection")
}

idempotency_test::conformance_tests!(async { store().await.map(|s| s as Arc<dyn Store>) });

/// The same suite on a store made from the application's own `ConnectionManager` (built
/// with the `redis` crate the store re-exports, so the versions match).
mod own_connection {
    use super::*;
    use idempotency_redis::redis;

    async fn own_store() -> Option<Arc<RedisStore>> {
        static STORE: OnceCell<Arc<RedisStore>> = OnceCell::const_new();
        let redis = services::redis().await?;
        Some(
            STORE
                .get_or_init(|| async {
                    let client = redis::Client::open(redis.url()).expect("client");
                    let manager = redis::aio::ConnectionManager::new(client)
                        .await
                        .expect("manager");
                    let store = RedisStore::from_connection_manager(manager)
                        .prefix(idempotency_test::unique("own"))
                        .connect()
                        .await
                        .expect("store");
                    Arc::new(store)
                })
                .await
                .clone(),
        )
    }

    idempotency_test::conformance_tests!(async { own_store().await.map(|s| s as Arc<dyn Store>) });

    /// The record is in the application's Redis, under the configured prefix.
    #[test]
    fn records_land_on_the_given_connection() {
        block_on(async {
            let Some(store) = own_store().await else {
                return;
            };
            let id = fresh_id();
            let token = execute(&*store, &id, &fp("a"), LONG).await;
            store
                .complete(&id, token, &Outcome::new(201), LONG)
                .await
                .expect("complete");
            let mut conn = shared_connection().await;
            let value: Option<Vec<u8>> = redis::cmd("GET")
                .arg(store.key(&id))
                .query_async(&mut conn)
                .await
                .expect("get");
            assert!(store.key(&id).starts_with("own"), "{}", store.key(&id));
            let tag = format!(":{{{}}}", id.to_hex());
            assert!(store.key(&id).ends_with(&tag), "{}", store.key(&id));
            assert_eq!(value.and_then(|v| v.first().copied()), Some(b'1'));
        });
    }
}

/// The same suite on a Redis Cluster of three masters: every script touches one hash-tagged
/// key, so every call routes to one slot.
mod cluster {
    use super::*;

    /// The cluster this module's tests share, started once.
    async fn cluster() -> Option<&'static services::Service> {
        static CLUSTER: OnceCell<services::Service> = OnceCell::const_new();
        if services::skipping() {
            return None;
        }
        let cluster = CLUSTER
            .get_or_init(|| async { services::start_redis_cluster().await.expect("cluster") })
            .await;
        Some(cluster)
    }

    pub(crate) async fn cluster_store() -> Option<Arc<RedisStore>> {
        static STORE: OnceCell<Arc<RedisStore>> = OnceCell::const_new();
        let cluster = cluster().await?;
        Some(
            STORE
                .get_or_init(|| async { Arc::new(store_on(cluster.node_urls()).await) })
                .await
                .clone(),
        )
    }

    /// A store on the cluster at `urls`, with the timeouts of a test. Three Redis processes
    /// share CI's two cores with the rest of the suite: a reply can take longer than the
    /// 250 ms default response timeout, and this suite checks answers, not latency (a CI run
    /// failed two first claims with `Unavailable(timed out)`).
    async fn store_on(urls: Vec<String>) -> RedisStore {
        RedisStore::cluster_builder(urls)
            .connect_timeout(Duration::from_secs(1))
            .response_timeout(Duration::from_secs(1))
            .call_budget(Duration::from_secs(2))
            .connect()
            .await
            .expect("cluster store")
    }

    idempotency_test::conformance_tests!(async {
        cluster_store().await.map(|s| s as Arc<dyn Store>)
    });

    /// A key prefix with a `{` of its own is refused on a cluster: a record's keys (the
    /// record, a takeover's tombstone, an operator's receipt) share a slot by the store's
    /// hash tag, which must come first in each key. Before, a prefix such as `a{}b` (an
    /// empty tag hashes the whole key) was taken, and every takeover, cancel and operator's
    /// release of its records failed with `CROSSSLOT`.
    #[test]
    fn a_prefix_with_a_hash_tag_of_its_own_is_refused() {
        block_on(async {
            let Some(cluster) = cluster().await else {
                return;
            };
            for prefix in ["a{}b", "{payments}"] {
                let store = RedisStore::cluster_builder(cluster.node_urls())
                    .prefix(prefix)
                    .connect()
                    .await;
                assert!(
                    matches!(&store, Err(Error::Config(why)) if why.contains(prefix)),
                    "{prefix}: {store:?}"
                );
            }
            // A standalone Redis has no slots: any prefix will do there.
            let Some(one) = services::redis().await else {
                return;
            };
            RedisStore::builder(one.url())
                .prefix("{payments}")
                .connect()
                .await
                .expect("a standalone store");
        });
    }

    /// Where a second copy comes from: a cluster connection resends a script whose answer
    /// timed out.
    #[test]
    fn an_operators_release_sent_twice_deletes_once() {
        block_on(async {
            if let Some(store) = cluster_store().await {
                super::a_release_sent_twice_deletes_once(&store).await;
            }
        });
    }

    /// Claims a cluster shard refuses without running them (`NOREPLICAS` here: one master
    /// wants a replica to write and has none) each owe a cancel — the cluster client may have
    /// resent a claim whose first copy landed — and the cancels are refused too, as long as
    /// the refusal lasts. While they are, one of them probes, with backoff; the rest wait for
    /// its answer. Before, every refused claim's cancel retried on its own (from 50 ms apart
    /// to every 5 s, for an hour): writes into the shard that was refusing them, growing
    /// with every claim refused (401 for these 64 claims in two seconds). A cancel on a
    /// shard that takes writes does not wait for them: a retry of its key runs. Once the
    /// shard takes writes again, every cancel lands and the keys are free.
    #[test]
    fn cancels_owed_by_refused_claims_probe_one_at_a_time() {
        block_on(async {
            if services::skipping() {
                return;
            }
            // A cluster of its own: the module's is shared with its conformance tests.
            let cluster = services::start_redis_cluster().await.expect("cluster");
            let urls = cluster.node_urls();
            let store = store_on(urls.clone()).await;
            let mut masters = Vec::new();
            for url in &urls {
                let client = redis::Client::open(url.as_str()).expect("client");
                let conn = client.get_multiplexed_async_connection().await;
                masters.push(conn.expect("node"));
            }
            let replicas_to_write = |conn: &mut redis::aio::MultiplexedConnection, n: &str| {
                let (mut conn, n) = (conn.clone(), n.to_owned());
                async move {
                    let _: () = redis::cmd("CONFIG")
                        .arg("SET")
                        .arg("min-replicas-to-write")
                        .arg(n)
                        .query_async(&mut conn)
                        .await
                        .expect("config set");
                }
            };
            services::reset_command_stats(&mut masters[0]).await;
            replicas_to_write(&mut masters[0], "1").await;
            // Claims of fresh keys: the first master's are refused, the others' run.
            let (mut refused, mut ran) = (Vec::new(), Vec::new());
            while refused.len() < 64 {
                let ids: Vec<_> = (0..64).map(|_| fresh_id()).collect();
                let print = fp("a");
                let claims = ids.iter().map(|id| store.begin(id, &print, LONG));
                for (id, claim) in ids.iter().zip(futures::future::join_all(claims).await) {
                    match claim {
                        Ok(Begin::Execute(token)) => ran.push((*id, token)),
                        Err(Error::Unavailable(why)) if why.to_string().contains("NOREPLICAS") => {
                            refused.push(*id);
                        }
                        // A claim that timed out on a busy host: its cancel tries at once,
                        // once; the count below leaves room for it.
                        Err(Error::Unavailable(_)) => {}
                        other => panic!("{other:?}"),
                    }
                }
            }
            // A claim on a shard that takes writes, given up after its `SET` was sent (the
            // other masters pause writes, so it lands after its caller left): its cancel
            // does not wait for the refused ones' turns, and a retry of its key runs.
            let (id, token) = ran[0];
            store.release(&id, token).await.expect("release");
            for master in &mut masters[1..] {
                let _: () = redis::cmd("CLIENT")
                    .arg("PAUSE")
                    .arg(1000)
                    .arg("WRITE")
                    .query_async(master)
                    .await
                    .expect("pause");
            }
            let print = fp("a");
            let gone =
                tokio::time::timeout(Duration::from_millis(200), store.begin(&id, &print, LONG));
            assert!(gone.await.is_err(), "the claim waits for the paused master");
            // Within a lease (60 s): a lease that ran out would free the key without the
            // cancel. Polled: how soon depends on the host, not on the answer.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            loop {
                match store.begin(&id, &fp("a"), LONG).await {
                    Ok(Begin::Execute(_)) => break,
                    Ok(Begin::InFlight { .. }) | Err(Error::Unavailable(_))
                        if tokio::time::Instant::now() < deadline =>
                    {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    other => panic!("the given-up claim still holds its key: {other:?}"),
                }
            }
            let refusals = ["rejected_calls", "failed_calls"];
            let refused_cancels = services::script_calls(&mut masters[0], &refusals).await;
            assert!(
                (1..refused.len() as u64).contains(&refused_cancels),
                "{refused_cancels} cancels refused for {} claims refused",
                refused.len()
            );
            replicas_to_write(&mut masters[0], "0").await;
            tokio::time::timeout(Duration::from_secs(60), store.drain())
                .await
                .expect("every owed cancel lands once the shard takes writes");
            // Nothing of those claims holds its key: each is a first request again.
            for id in &refused {
                let again = store.begin(id, &fp("a"), LONG).await;
                assert!(matches!(again, Ok(Begin::Execute(_))), "{again:?}");
            }
        });
    }

    /// The eviction check asks every master: a cluster routes `CONFIG GET` to one node of
    /// its choosing, so one evicting master among three let the store start about two times
    /// in three, and a record evicted there executes a second time.
    #[test]
    fn one_evicting_master_is_refused_every_time() {
        block_on(async {
            if services::skipping() {
                return;
            }
            let cluster = services::start_redis_cluster().await.expect("cluster");
            let urls = cluster.node_urls();
            let client = redis::Client::open(urls[1].as_str()).expect("client");
            let mut one = client
                .get_multiplexed_async_connection()
                .await
                .expect("node");
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory-policy")
                .arg("allkeys-lru")
                .query_async(&mut one)
                .await
                .expect("config set");
            for attempt in 0..6 {
                match RedisStore::cluster_builder(urls.clone()).connect().await {
                    Err(Error::Config(why)) => assert!(why.contains("allkeys-lru"), "{why}"),
                    other => panic!("attempt {attempt}: expected a refusal, got {other:?}"),
                }
            }
            RedisStore::cluster_builder(urls)
                .eviction_check(EvictionCheck::Warn)
                .connect()
                .await
                .expect("accepted explicitly");
        });
    }
}

#[test]
fn concurrent_begins_execute_once_per_key() {
    block_on(async {
        let Some(store) = store().await else { return };
        idempotency_test::conformance::concurrent_begins_execute_once_per_key(store, 100).await;
    });
}

/// Claims given up on a hung Redis (paused: it takes what is sent and runs it when it
/// resumes) each owe a cancel, retried until Redis answers. On a direct connection replies
/// come in order, so while one call hangs every call behind it does: at most a few cancels
/// retry at once there, rather than every cancel on its own, each try another script queued
/// into the hung Redis (256 claims given up for six seconds: about ten cancel scripts run
/// per claim when it resumed). Every cancel still lands once Redis is back, and the keys
/// are free.
#[test]
fn a_hung_redis_is_sent_a_bounded_number_of_cancel_retries() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::start_redis(RedisOptions::default()).await;
        let store = RedisStore::builder(redis.url())
            .call_budget(Duration::from_millis(300))
            .connect()
            .await
            .expect("store");
        execute(&store, &fresh_id(), &fp("a"), LONG).await; // connected
        // One claim given up first, so that the cancel script is loaded, as it is on a Redis
        // that served cancels before (on a fresh one each cancel queued while it hung would
        // be refused `NOSCRIPT` when it resumed, and change nothing).
        redis.pause().await;
        let given_up = store.begin(&fresh_id(), &fp("a"), LONG).await;
        assert!(
            matches!(given_up, Err(Error::Unavailable(_))),
            "{given_up:?}"
        );
        redis.unpause().await;
        store.drain().await;
        let mut conn = services::command_stats_from_now(redis.url()).await;
        redis.pause().await;
        let ids: Vec<_> = (0..256).map(|_| fresh_id()).collect();
        let print = fp("a");
        let claims = ids.iter().map(|id| store.begin(id, &print, LONG));
        for claim in futures::future::join_all(claims).await {
            assert!(matches!(claim, Err(Error::Unavailable(_))), "{claim:?}");
        }
        // Long enough for every cancel retrying on its own to have tried seven times (each
        // try a budget, 25 ms to 7.5 s apart).
        tokio::time::sleep(Duration::from_secs(6)).await;
        redis.unpause().await;
        tokio::time::timeout(Duration::from_secs(60), store.drain())
            .await
            .expect("every owed cancel lands once Redis is back");
        // Each claim's cancel runs three times once Redis resumes, however it waited: its
        // first try, queued behind the claim (it cancels the lease, but its answer comes too
        // late), the try that answers (it finds the lease cancelled already), and the second
        // cancel of one that did not find its lease (see `cancel_later`). The retries sent
        // while Redis hung add about six per claim retrying on its own, a number that does
        // not grow with the claims when a few retry at a time.
        let cancels = services::script_calls(&mut conn, &["calls"]).await;
        assert!(
            cancels < 4 * ids.len() as u64,
            "{cancels} cancel scripts run for {} claims given up",
            ids.len()
        );
        for id in &ids {
            let again = store.begin(id, &fp("a"), LONG).await;
            assert!(matches!(again, Ok(Begin::Execute(_))), "{again:?}");
        }
    });
}

/// Every call on a hung (paused) or stopped Redis returns `Unavailable` within the store's
/// budget, and the same store value works again once Redis is back.
#[test]
fn a_hung_or_stopped_redis_is_unavailable_then_recovers() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::start_redis(RedisOptions::default()).await;
        let store = RedisStore::builder(redis.url())
            .call_budget(Duration::from_millis(400))
            .connect()
            .await
            .expect("store");
        let id = fresh_id();
        let token = execute(&store, &id, &fp("a"), LONG).await;
        // A guard that turns a hang into a failure message; the budget under test is 400 ms.
        let guard = Duration::from_secs(20);
        let all_unavailable = |store: RedisStore| async move {
            let other = fresh_id();
            let calls: Vec<Result<(), Error>> = vec![
                store.begin(&other, &fp("a"), LONG).await.map(|_| ()),
                store.complete(&id, token, &Outcome::new(201), LONG).await,
                store.renew(&id, token, LONG).await,
                store.release(&id, token).await,
                store.peek(&id, &fp("a")).await.map(|_| ()),
            ];
            for call in calls {
                assert!(matches!(call, Err(Error::Unavailable(_))), "{call:?}");
            }
        };

        redis.pause().await;
        tokio::time::timeout(guard, all_unavailable(store.clone()))
            .await
            .expect("no hang while paused");
        redis.unpause().await;
        store
            .complete(&id, token, &Outcome::new(201), LONG)
            .await
            .expect("works after unpause");

        redis.stop().await;
        tokio::time::timeout(guard, all_unavailable(store.clone()))
            .await
            .expect("no hang while stopped");
        redis.start().await;
        // Redis came back empty (no persistence): the record is gone, the store works.
        let mut recovered = false;
        for _ in 0..50 {
            if let Ok(Begin::Execute(_)) = store.begin(&fresh_id(), &fp("a"), LONG).await {
                recovered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(recovered, "the same store value works after Redis restarts");
    });
}

/// A claim dropped as its caller's runtime shuts down, its `SET` still on its way to Redis,
/// is cancelled from the runtime the store was made on. The cancel was spawned on the
/// caller's runtime alone, which was dropping its tasks: the `SET` landed, and the key was
/// held by nobody (`InFlight` for a lease, then an unknown outcome for an operation that
/// never ran).
#[test]
fn a_claim_dropped_as_its_runtime_shuts_down_is_cancelled() {
    use idempotency_test::relay;

    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::redis().await.expect("redis");
        let relay = relay::delaying_relay(relay::upstream(redis.url())).await;
        // Made on this runtime: its home, where its connection's driver runs.
        let store = RedisStore::builder(relay::through(redis.url(), relay.port))
            .prefix(idempotency_test::unique("t"))
            .connect()
            .await
            .expect("store");
        let store = Arc::new(store);
        execute(&*store, &fresh_id(), &fp("warm"), LONG).await; // connected
        // The claim's `SET … NX GET PX` reaches Redis late, and what follows behind it.
        relay.delay_requests_containing(Duration::from_millis(800), b"NX");
        let id = fresh_id();
        let doomed = idempotency_test::doomed_runtime();
        let claim = {
            let store = store.clone();
            doomed.spawn(async move { store.begin(&id, &fp("a"), LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        doomed.shutdown_background();
        assert!(claim.await.is_err(), "the caller is gone");
        tokio::time::sleep(Duration::from_millis(800)).await; // the claim lands
        relay.delay_requests(Duration::ZERO);
        store.drain().await;
        let again = store.begin(&id, &fp("a"), LONG).await;
        assert!(matches!(again, Ok(Begin::Execute(_))), "{again:?}");
    });
}

/// A failover whose old primary keeps this store's connection (a proxy that keeps its
/// sessions, a managed failover, an operator's `REPLICAOF`) while new connections reach the
/// new primary: the demoted node answers every write `READONLY`, which the client library
/// takes for a recoverable error and keeps the connection. The store replaces it then, and
/// serves again from the new primary. Before, every claim on that connection was
/// `Unavailable` (a 503) until the process restarted, and the operations running there
/// could neither renew nor store their outcomes.
#[test]
fn a_connection_left_on_a_demoted_primary_is_replaced() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let old = services::start_redis(RedisOptions::default()).await;
        let new = services::start_redis(RedisOptions::default()).await;
        let relay =
            idempotency_test::relay::stalling_relay(idempotency_test::relay::upstream(old.url()))
                .await;
        let store = RedisStore::builder(idempotency_test::relay::through(old.url(), relay.port))
            .call_budget(Duration::from_millis(500))
            .connect()
            .await
            .expect("store");
        execute(&store, &fresh_id(), &fp("before"), LONG).await;
        // The failover: the old primary becomes a replica (of a primary it cannot reach: it
        // answers reads, refuses writes), new connections go to the new one.
        old.demote().await;
        relay.redirect(idempotency_test::relay::upstream(new.url()));
        let id = fresh_id();
        let mut answers = Vec::new();
        for _ in 0..20 {
            let answer = store.begin(&id, &fp("after"), LONG).await;
            let granted = matches!(answer, Ok(Begin::Execute(_)));
            answers.push(answer);
            if granted {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        assert!(
            matches!(answers.last(), Some(Ok(Begin::Execute(_)))),
            "still on the demoted primary: {answers:?}"
        );
        // The refusals before: `Unavailable`, nothing else (no grant on a replica).
        for refused in &answers[..answers.len() - 1] {
            assert!(matches!(refused, Err(Error::Unavailable(_))), "{refused:?}");
        }
    });
}

/// A Redis that answers late but within the call budget (clients paused for a failover, a
/// slow script) is waited for: the budget bounds every call, and no shorter timer per
/// command cuts the answer off. Before, the client's 250 ms response timeout answered
/// `Unavailable` (a 503) to a call its own budget still allowed.
#[test]
fn a_late_answer_within_the_call_budget_is_waited_for() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::start_redis(RedisOptions::default()).await;
        let store = RedisStore::builder(redis.url())
            .call_budget(Duration::from_secs(10))
            .connect()
            .await
            .expect("store");
        // Connected before the pause (a connection's handshake would be paused too).
        execute(&store, &fresh_id(), &fp("warm"), LONG).await;
        let mut admin = redis::Client::open(redis.url())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection");
        // Every client's commands wait for the pause to end: 800 ms, far past 250 ms.
        let () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(800)
            .arg("ALL")
            .query_async(&mut admin)
            .await
            .expect("CLIENT PAUSE");
        let id = fresh_id();
        let answer = store.begin(&id, &fp("a"), LONG).await;
        let Ok(Begin::Execute(token)) = answer else {
            panic!("a claim answered within its budget is granted, got {answer:?}");
        };
        store
            .complete(&id, token, &Outcome::new(201), LONG)
            .await
            .expect("complete");
    });
}

/// A Redis that refuses writes at its `maxmemory` (`noeviction`; fill it with [`fill`]),
/// and a store on it.
async fn noeviction_redis() -> (Service, RedisStore) {
    let redis = services::start_redis(RedisOptions {
        args: ["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]
            .map(String::from)
            .to_vec(),
    })
    .await;
    let store = RedisStore::builder(redis.url())
        .connect()
        .await
        .expect("store");
    (redis, store)
}

/// A store on `redis` through a delaying relay, with calls of `budget`.
async fn relayed(
    redis: &Service,
    budget: Duration,
) -> (idempotency_test::relay::DelayingRelay, RedisStore) {
    let relay =
        idempotency_test::relay::delaying_relay(idempotency_test::relay::upstream(redis.url()))
            .await;
    let store = RedisStore::builder(idempotency_test::relay::through(redis.url(), relay.port))
        .call_budget(budget)
        .eviction_check(EvictionCheck::Skip)
        .connect()
        .await
        .expect("the relayed store");
    (relay, store)
}

/// Fills a [`noeviction_redis`] until it refuses a small write: a connection of its own and
/// the filler keys, to free the memory again.
async fn fill(url: &str) -> (redis::aio::MultiplexedConnection, Vec<String>) {
    let client = redis::Client::open(url).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    // Large values, then small ones: a large command's own buffer counts, so its
    // refusal alone does not mean a small write is refused too.
    let mut fillers = Vec::new();
    for size in [64 * 1024, 64] {
        let filler = vec![b'x'; size];
        loop {
            let key = format!("filler:{}", fillers.len());
            let set: redis::RedisResult<()> = redis::cmd("SET")
                .arg(&key)
                .arg(&filler)
                .query_async(&mut conn)
                .await;
            match set {
                Ok(()) => assert!(fillers.len() < 200_000, "Redis never filled up"),
                Err(error) if error.code() == Some("OOM") => break,
                Err(error) => panic!("filling Redis: {error}"),
            }
            fillers.push(key);
        }
    }
    (conn, fillers)
}

/// A full Redis (`noeviction`, at `maxmemory`) still takes the outcome of an operation that
/// ran: it replaces the lease the claim wrote while there was room. Before, the `complete`
/// script's `SET` was refused (`OOM`) while renewals (`PEXPIRE`) went through, so the
/// executor and the layer counted a store up and refusing the outcome, gave the lease up
/// after three refusals, and a retry once memory was freed took the key over and ran the
/// operation again.
#[test]
fn a_full_redis_still_takes_the_outcome_of_an_operation_that_ran() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let (full, store) = noeviction_redis().await;
        let id = fresh_id();
        let token = execute(&store, &id, &fp("a"), LONG).await;
        let (mut conn, fillers) = fill(full.url()).await;
        // Full: a new claim is refused...
        let refused = store.begin(&fresh_id(), &fp("b"), LONG).await;
        assert!(matches!(refused, Err(Error::Unavailable(_))), "{refused:?}");
        // ...a lease that ran is renewed, and its outcome is taken.
        store.renew(&id, token, LONG).await.expect("renew");
        store
            .complete(&id, token, &Outcome::new(201).with_body("ran"), LONG)
            .await
            .expect("a full Redis takes the outcome");
        let _: i64 = redis::cmd("DEL")
            .arg(&fillers)
            .query_async(&mut conn)
            .await
            .expect("free the memory");
        assert_eq!(
            store.begin(&id, &fp("a"), LONG).await.expect("begin"),
            Begin::Replay(Outcome::new(201).with_body("ran"))
        );
    });
}

/// A full Redis (`noeviction`, at `maxmemory`) still takes what an operator's release and a
/// cancel write beside what they delete: a release's receipt, a cancel's marker in place
/// of its lease. Refused (the first versions of both), the release that kept a live lease
/// answered `Unavailable` instead of `Live`, and the cancel failed and was retried for an
/// hour while the lease nobody held answered "in flight".
#[test]
fn a_full_redis_still_takes_a_release_and_a_cancel() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let (full, store) = noeviction_redis().await;
        let (relay, late) = relayed(&full, Duration::from_secs(2)).await;
        let live = fresh_id();
        execute(&store, &live, &fp("a"), LONG).await;
        // A claim whose answer comes after its caller gave up, and so is cancelled.
        let lost = fresh_id();
        late.inspect(&lost).await.expect("connected");
        relay.delay_replies(Duration::from_secs(3));
        let claim = tokio::spawn({
            let late = late.clone();
            async move { late.begin(&lost, &fp("a"), LONG).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (mut conn, _) = fill(full.url()).await;
        let kept = store
            .force_release(&live, idempotency_core::ReleaseScope::default())
            .await;
        assert_eq!(
            kept.expect("release"),
            idempotency_core::ForceReleased::Live
        );
        let gave_up = claim.await.expect("the claim's task");
        assert!(matches!(gave_up, Err(Error::Unavailable(_))), "{gave_up:?}");
        relay.delay_replies(Duration::ZERO);
        let drained = tokio::time::timeout(Duration::from_secs(20), late.drain()).await;
        assert!(drained.is_ok(), "the cancel is still retrying");
        let marker: Vec<u8> = redis::cmd("GET")
            .arg(store.key(&lost))
            .query_async(&mut conn)
            .await
            .expect("get");
        assert_eq!(marker.first(), Some(&b'c'), "the cancel's marker");
    });
}

/// A full Redis (`noeviction`, at `maxmemory`) answers a claim `OOM`: the claim did not run,
/// so nothing is left to cancel. Before, every refused claim started a cancel that wrote a
/// marker and a tombstone (kept for an hour) into the Redis that was full, and ran it again
/// three budgets later; a cancel refused in turn was retried for an hour, which `drain` (a
/// graceful shutdown) waited for.
#[test]
fn a_claim_refused_by_a_full_redis_leaves_nothing_running() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let (full, store) = noeviction_redis().await;
        let (mut conn, _) = fill(full.url()).await;
        let id = fresh_id();
        let refused = store.begin(&id, &fp("a"), LONG).await;
        assert!(matches!(refused, Err(Error::Unavailable(_))), "{refused:?}");
        let drained = tokio::time::timeout(Duration::from_secs(10), store.drain()).await;
        assert!(
            drained.is_ok(),
            "a cancel of the refused claim is still retrying"
        );
        // Nothing written for it either: no cancel marker on a Redis that is full.
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("*{}*", id.to_hex()))
            .query_async(&mut conn)
            .await
            .expect("keys");
        assert!(keys.is_empty(), "{keys:?}");
    });
}

/// A full `noeviction` Redis refuses every `SET`, even one that would not have written (the
/// key exists): it checks memory before it runs the command. A retry of a stored operation
/// is still answered from what Redis holds (its outcome; a live lease's 409; another
/// request's mismatch) rather than `Unavailable` until TTLs free memory. Before, every one
/// of them was `Unavailable`.
#[test]
fn a_full_redis_still_answers_what_it_holds() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let (full, store) = noeviction_redis().await;
        let (done, running) = (fresh_id(), fresh_id());
        let Ok(Begin::Execute(token)) = store.begin(&done, &fp("a"), LONG).await else {
            panic!("a fresh key executes")
        };
        let outcome = Outcome::new(201).with_body("charged");
        store
            .complete(&done, token, &outcome, LONG)
            .await
            .expect("complete");
        let Ok(Begin::Execute(_)) = store.begin(&running, &fp("a"), LONG).await else {
            panic!("a fresh key executes")
        };
        let _filled = fill(full.url()).await;
        assert_eq!(
            store.begin(&done, &fp("a"), LONG).await.expect("a replay"),
            Begin::Replay(outcome)
        );
        assert!(matches!(
            store.begin(&done, &fp("b"), LONG).await,
            Ok(Begin::Mismatch)
        ));
        let live = store.begin(&running, &fp("a"), LONG).await;
        assert!(matches!(live, Ok(Begin::InFlight { .. })), "{live:?}");
        // A new key cannot be claimed: that stays `Unavailable`.
        let new = store.begin(&fresh_id(), &fp("a"), LONG).await;
        assert!(matches!(new, Err(Error::Unavailable(_))), "{new:?}");
    });
}

/// A claim a full Redis refused to run, whose read of the key (what it answers instead) runs
/// out of budget, wrote nothing: nothing is cancelled. Cancelled as a claim that may have
/// landed, it wrote a cancel marker and a tombstone into the Redis that was full.
#[test]
fn a_refused_claim_whose_read_times_out_writes_nothing() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let (full, _store) = noeviction_redis().await;
        let (relay, late) = relayed(&full, Duration::from_millis(500)).await;
        let id = fresh_id();
        late.inspect(&id).await.expect("connected");
        let (mut conn, _) = fill(full.url()).await;
        // The plain `GET` of the key, not the claim's `SET … GET`.
        relay.delay_requests_containing(Duration::from_secs(2), b"*2\r\n$3\r\nGET\r\n");
        let refused = late.begin(&id, &fp("a"), LONG).await;
        assert!(matches!(refused, Err(Error::Unavailable(_))), "{refused:?}");
        let drained = tokio::time::timeout(Duration::from_secs(10), late.drain()).await;
        assert!(drained.is_ok(), "a cancel is still retrying");
        tokio::time::sleep(Duration::from_secs(2)).await; // the delayed read has landed
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("*{}*", id.to_hex()))
            .query_async(&mut conn)
            .await
            .expect("keys");
        assert!(keys.is_empty(), "{keys:?}");
    });
}

#[test]
fn an_evicting_redis_is_refused_unless_accepted() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let lru = services::start_redis(RedisOptions {
            args: ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]
                .map(String::from)
                .to_vec(),
        })
        .await;
        let refused = RedisStore::builder(lru.url()).connect().await;
        match refused {
            Err(Error::Config(why)) => {
                assert!(
                    why.contains("allkeys-lru") && why.contains("noeviction"),
                    "{why}"
                );
            }
            other => panic!("expected a configuration error, got {other:?}"),
        }
        // RESP3 answers CONFIG GET with a map, not an array: still read, still refused
        // (before, the map failed to decode and the check passed with a warning).
        let resp3 = format!("{}?protocol=resp3", lru.url());
        match RedisStore::builder(resp3.as_str()).connect().await {
            Err(Error::Config(why)) => assert!(why.contains("allkeys-lru"), "{why}"),
            other => panic!("RESP3: expected a configuration error, got {other:?}"),
        }
        // The same through a connection the application made itself.
        let client = idempotency_redis::redis::Client::open(resp3.as_str()).expect("client");
        let manager = idempotency_redis::redis::aio::ConnectionManager::new(client)
            .await
            .expect("manager");
        assert!(matches!(
            RedisStore::from_connection_manager(manager).connect().await,
            Err(Error::Config(_))
        ));
        RedisStore::builder(lru.url())
            .eviction_check(EvictionCheck::Warn)
            .connect()
            .await
            .expect("accepted explicitly");

        let Some(noeviction) = services::redis().await else {
            return;
        };
        RedisStore::builder(noeviction.url())
            .connect()
            .await
            .expect("noeviction starts");
    });
}

/// A Redis that refuses `CONFIG` (managed Redis: ElastiCache renames it away, and its default
/// policy, `volatile-lru`, evicts records, each of which has a TTL) is checked through `INFO
/// memory`: refused when it evicts, started when it does not. Before, any refusal of `CONFIG`
/// started the store with a warning, even under `EvictionCheck::Refuse`.
#[test]
fn an_evicting_redis_that_refuses_config_is_refused_too() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let without_config = |policy: &str| RedisOptions {
            args: [
                "--maxmemory",
                "64mb",
                "--maxmemory-policy",
                policy,
                "--rename-command",
                "CONFIG",
                "",
            ]
            .map(String::from)
            .to_vec(),
        };
        let lru = services::start_redis(without_config("volatile-lru")).await;
        let mut conn = redis::Client::open(lru.url())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection");
        let config: redis::RedisResult<redis::Value> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(&mut conn)
            .await;
        assert!(config.is_err(), "CONFIG is renamed away: {config:?}");
        match RedisStore::builder(lru.url()).connect().await {
            Err(Error::Config(why)) => assert!(why.contains("volatile-lru"), "{why}"),
            other => panic!("expected a configuration error, got {other:?}"),
        }
        RedisStore::builder(lru.url())
            .eviction_check(EvictionCheck::Warn)
            .connect()
            .await
            .expect("accepted explicitly");
        let kept = services::start_redis(without_config("noeviction")).await;
        RedisStore::builder(kept.url())
            .connect()
            .await
            .expect("noeviction starts without CONFIG");
    });
}

/// A `begin` that answered `Unavailable` must leave nothing behind that changes the next
/// answer. A hung Redis (paused) runs the queued claim when it resumes; before, that claim
/// held the key "in flight" for the whole lease with a token nobody had. Now the claim is
/// cancelled: the cancel, queued behind it, deletes the lease it granted.
#[test]
fn an_unavailable_begin_that_lands_late_leaves_no_claim() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::start_redis(RedisOptions::default()).await;
        let store = RedisStore::builder(redis.url())
            .prefix(idempotency_test::unique("late"))
            .call_budget(Duration::from_millis(300))
            .connect()
            .await
            .expect("store");
        // Load the scripts, so the late call is the claim itself, not a NOSCRIPT retry.
        let warm = fresh_id();
        execute(&store, &warm, &fp("a"), LONG).await;

        let id = fresh_id();
        redis.pause().await;
        let answer = store.begin(&id, &fp("a"), LONG).await;
        assert!(matches!(answer, Err(Error::Unavailable(_))), "{answer:?}");
        // A graceful shutdown now: `drain` waits while Redis is still paused, until the
        // queued claim has run (granting a lease to nobody) and the cancel behind it has
        // deleted that lease.
        let resume = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            redis.unpause().await;
        };
        let drained = async {
            store.drain().await;
            store.inspect(&id).await.expect("inspect")
        };
        let (after_drain, ()) = tokio::join!(drained, resume);
        assert!(
            after_drain.is_none(),
            "drain returned before the late claim was given back: {after_drain:?}"
        );
        match idempotency_test::conformance::answer_within(&store, &id, &fp("a")).await {
            Begin::Execute(_) => {}
            other => panic!("the late claim was left behind: {other:?}"),
        }
    });
}

/// Records written by the earlier layout (one hash per record) are still served after an
/// upgrade, until they expire: a completed one replays, a live lease is in flight and its
/// owner (holding the token from before the upgrade) can still complete it, a lease past its
/// end is taken over. Forgetting them would execute again every key retried across a deploy.
#[test]
fn records_of_the_earlier_layout_are_still_served() {
    block_on(async {
        let Some(store) = store().await else { return };
        let mut conn = shared_connection().await;
        let now_ms: u64 = {
            let (s, us): (u64, u64) = redis::cmd("TIME")
                .query_async(&mut conn)
                .await
                .expect("time");
            s * 1000 + us / 1000
        };
        let outcome = Outcome::new(201).with_body("from before the upgrade");
        let (done, live, over, over_zero) = (fresh_id(), fresh_id(), fresh_id(), fresh_id());
        let token = idempotency_core::LeaseToken::generate();
        let fp_a = fp("a");
        let hset = |id: &idempotency_core::RecordId, fields: Vec<(&str, Vec<u8>)>| {
            let mut cmd = redis::cmd("HSET");
            cmd.arg(store.key(id));
            for (name, value) in fields {
                cmd.arg(name).arg(value);
            }
            cmd
        };
        let fp_bytes = fp_a.as_bytes().to_vec();
        let _: i64 = hset(
            &done,
            vec![
                ("st", b"1".to_vec()),
                ("fp", fp_bytes.clone()),
                ("tok", token.to_string().into_bytes()),
                ("out", outcome.encode().to_vec()),
            ],
        )
        .query_async(&mut conn)
        .await
        .expect("hset");
        let _: i64 = hset(
            &live,
            vec![
                ("st", b"0".to_vec()),
                ("fp", fp_bytes.clone()),
                ("tok", token.to_string().into_bytes()),
                ("exp", (now_ms + 60_000).to_string().into_bytes()),
            ],
        )
        .query_async(&mut conn)
        .await
        .expect("hset");
        for id in [&over, &over_zero] {
            let _: i64 = hset(
                id,
                vec![
                    ("st", b"0".to_vec()),
                    ("fp", fp_bytes.clone()),
                    ("tok", token.to_string().into_bytes()),
                    ("exp", (now_ms - 1_000).to_string().into_bytes()),
                ],
            )
            .query_async(&mut conn)
            .await
            .expect("hset");
        }
        for id in [&done, &live, &over, &over_zero] {
            let _: i64 = redis::cmd("PEXPIRE")
                .arg(store.key(id))
                .arg(3_600_000)
                .query_async(&mut conn)
                .await
                .expect("pexpire");
        }

        assert_eq!(
            store.begin(&done, &fp_a, LONG).await.expect("begin"),
            Begin::Replay(outcome.clone())
        );
        assert_eq!(
            store.peek(&done, &fp_a).await.expect("peek"),
            idempotency_redis::Peek::Found(Begin::Replay(outcome.clone()))
        );
        assert_eq!(
            store.begin(&done, &fp("b"), LONG).await.expect("begin"),
            Begin::Mismatch
        );
        assert!(matches!(
            store.begin(&live, &fp_a, LONG).await.expect("begin"),
            Begin::InFlight { .. }
        ));
        store
            .renew(&live, token, LONG)
            .await
            .expect("the old owner renews");
        store
            .complete(&live, token, &outcome, LONG)
            .await
            .expect("the old owner completes");
        assert_eq!(
            store.begin(&live, &fp_a, LONG).await.expect("begin"),
            Begin::Replay(outcome.clone())
        );
        let taken = idempotency_test::conformance::take_over(&*store, &over, &fp_a, LONG).await;
        assert!(matches!(
            store.complete(&over, token, &outcome, LONG).await,
            Err(Error::LeaseLost)
        ));
        store
            .release(&over, taken)
            .await
            .expect("the new owner releases");
        execute(&*store, &over, &fp_a, LONG).await;
        // Taken over for a lease of zero: over at once, as in the current layout (it was
        // written for 1 ms, and the next claim within it heard `InFlight`).
        idempotency_test::conformance::take_over(&*store, &over_zero, &fp_a, Duration::ZERO).await;
        idempotency_test::conformance::take_over(&*store, &over_zero, &fp_a, LONG).await;
    });
}

/// A takeover of an earlier-layout record whose answer is lost on the way back: the claim is
/// `Unavailable` to its caller and cancelled, and the cancel must end the takeover's lease,
/// not delete it. Deleted, the next retry would hear `Execute` for an operation whose first
/// attempt may have run: the unfinished lease it took over is the only trace of that attempt.
#[test]
fn a_lost_takeover_of_an_earlier_layout_record_keeps_the_outcome_unknown() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::redis().await.expect("redis");
        let prefix = idempotency_test::unique("lost");
        let direct = RedisStore::builder(redis.url())
            .prefix(prefix.clone())
            .connect()
            .await
            .expect("store");
        let upstream = idempotency_test::relay::upstream(redis.url());
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // The legacy claim's reply to a takeover is the array `{'t'}`.
        let port = idempotency_test::relay::cutting_relay(upstream.clone(), armed.clone(), |r| {
            r.windows(5).any(|w| w == b"\r\nt\r\n")
        })
        .await;
        let store = RedisStore::builder(idempotency_test::relay::through(redis.url(), port))
            .prefix(prefix)
            .connect()
            .await
            .expect("store through the relay");
        let mut conn = redis::Client::open(redis.url())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection");
        let fp_a = fp("a");
        let (warm, over) = (fresh_id(), fresh_id());
        for id in [&warm, &over] {
            earlier_layout_lease_ran_out(&mut conn, &store, id, &fp_a).await;
        }
        // Loads the legacy script, so the armed call below is the takeover itself.
        idempotency_test::conformance::take_over(&store, &warm, &fp_a, LONG).await;

        armed.store(true, std::sync::atomic::Ordering::SeqCst);
        let lost = store.begin(&over, &fp_a, LONG).await;
        assert!(matches!(lost, Err(Error::Unavailable(_))), "{lost:?}");
        assert!(
            !armed.load(std::sync::atomic::Ordering::SeqCst),
            "the takeover's reply was the one lost"
        );
        match idempotency_test::conformance::answer_within(&direct, &over, &fp_a).await {
            Begin::TakeOver(_) => {}
            other => panic!("the first attempt's trace was deleted: {other:?}"),
        }
    });
}

/// Writes, under `id`, a lease of the earlier (hash) layout for `fp` that ran out unfinished
/// long ago; the key itself is kept an hour.
async fn earlier_layout_lease_ran_out(
    conn: &mut redis::aio::MultiplexedConnection,
    store: &RedisStore,
    id: &idempotency_core::RecordId,
    fp: &idempotency_core::Fingerprint,
) {
    let () = redis::pipe()
        .cmd("HSET")
        .arg(store.key(id))
        .arg("st")
        .arg("0")
        .arg("fp")
        .arg(fp.as_bytes().to_vec())
        .arg("tok")
        .arg(idempotency_core::LeaseToken::generate().to_string())
        .arg("exp")
        .arg("1")
        .ignore()
        .cmd("PEXPIRE")
        .arg(store.key(id))
        .arg(3_600_000)
        .ignore()
        .query_async(conn)
        .await
        .expect("an earlier-layout lease");
}

/// A claim of a record of the earlier (hash) layout sent twice, as a cluster connection
/// resends a script whose answer came later than its response timeout: the second copy finds
/// the lease the first one wrote, and that lease is the claim's own. Before, it answered
/// `InFlight` (a 409 for the caller's own claim), and the lease, held by nobody, kept every
/// retry out until it ran out.
#[test]
fn a_claim_of_an_earlier_layout_record_sent_twice_owns_its_lease() {
    block_on(async {
        let Some(store) = store().await else { return };
        let mut conn = shared_connection().await;
        let fp_a = fp("a");
        let over = fresh_id();
        earlier_layout_lease_ran_out(&mut conn, &store, &over, &fp_a).await;
        let token = idempotency_core::LeaseToken::generate();
        for copy in ["first", "second"] {
            let claimed = store.claim_legacy(&over, &fp_a, LONG, token).await;
            assert_eq!(
                claimed.expect("claim"),
                Begin::TakeOver(token),
                "the {copy} copy of the takeover"
            );
        }
    });
}

/// Redis forgets its scripts on a restart or a `SCRIPT FLUSH`: the next call loads its script
/// again and lands (the store writes its `EVALSHA` itself, with that fallback).
#[test]
fn a_flushed_script_cache_fails_no_call() {
    block_on(async {
        let Some(store) = store().await else { return };
        let mut conn = shared_connection().await;
        let id = fresh_id();
        let token = execute(&*store, &id, &fp("a"), LONG).await;
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .expect("script flush");
        store
            .complete(&id, token, &Outcome::new(201), LONG)
            .await
            .expect("complete after the flush");
        assert_eq!(
            store.begin(&id, &fp("a"), LONG).await.expect("begin"),
            Begin::Replay(Outcome::new(201))
        );
    });
}

/// `cache_completed_within` writes the copy while its deadline is ahead, and past it deletes
/// the key, whatever is there: a copy sent after its bound (counted from the Postgres read it
/// copies, however late its task ran) must not land after an operator's release.
#[test]
fn a_copy_past_its_deadline_deletes_instead_of_writing() {
    block_on(async {
        let Some(store) = store().await else { return };
        let (id, fp) = (fresh_id(), fp("a"));
        let outcome = Outcome::new(201).with_body("ch_1");
        let now = tokio::time::Instant::now();
        assert!(
            store
                .cache_completed_within(&id, &fp, &outcome, now + LONG, now + LONG)
                .await
                .expect("copy")
        );
        assert_eq!(
            store.begin(&id, &fp, LONG).await.expect("begin"),
            Begin::Replay(outcome.clone())
        );
        let late = tokio::time::Instant::now();
        assert!(
            !store
                .cache_completed_within(&id, &fp, &outcome, late + LONG, late)
                .await
                .expect("late copy")
        );
        let mut conn = shared_connection().await;
        let exists: bool = redis::cmd("EXISTS")
            .arg(store.key(&id))
            .query_async(&mut conn)
            .await
            .expect("exists");
        assert!(!exists, "a copy past its deadline left the key");
    });
}

/// The hybrid's copy of a completion replaces its own lease's mirror and nothing else: an
/// empty key is left empty (the caller decides), another lease's mirror is deleted, not
/// overwritten; past its deadline the copy deletes its mirror instead.
#[test]
fn a_copy_replaces_only_its_own_leases_mirror() {
    block_on(async {
        let Some(store) = store().await else { return };
        let conn = shared_connection().await;
        let exists = |id: idempotency_core::RecordId| {
            let (mut conn, key) = (conn.clone(), store.key(&id));
            async move {
                let exists: bool = redis::cmd("EXISTS")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .expect("exists");
                exists
            }
        };
        let (id, fp) = (fresh_id(), fp("a"));
        let outcome = Outcome::new(201).with_body("ch_1");
        let (mine, other) = (
            idempotency_core::LeaseToken::generate(),
            idempotency_core::LeaseToken::generate(),
        );
        let now = tokio::time::Instant::now();
        let replace =
            |token| store.replace_mirror(&id, token, &fp, &outcome, now + LONG, now + LONG);
        assert_eq!(replace(mine).await.expect("no mirror"), Replaced::Absent);
        assert!(!exists(id).await, "written on an empty key");
        store
            .cache_in_flight(&id, &fp, other, LONG)
            .await
            .expect("another lease's mirror");
        assert_eq!(
            replace(mine).await.expect("another's mirror"),
            Replaced::Not
        );
        assert!(
            !exists(id).await,
            "another lease's mirror is deleted, not overwritten"
        );
        store
            .cache_in_flight(&id, &fp, mine, LONG)
            .await
            .expect("this lease's mirror");
        assert_eq!(
            replace(mine).await.expect("its own mirror"),
            Replaced::Written
        );
        assert_eq!(
            store.begin(&id, &fp, LONG).await.expect("begin"),
            Begin::Replay(outcome.clone())
        );

        let late_id = fresh_id();
        store
            .cache_in_flight(&late_id, &fp, mine, LONG)
            .await
            .expect("a mirror");
        let late = tokio::time::Instant::now();
        assert_eq!(
            store
                .replace_mirror(&late_id, mine, &fp, &outcome, late + LONG, late)
                .await
                .expect("late copy"),
            Replaced::Not
        );
        assert!(
            !exists(late_id).await,
            "a copy past its deadline left the mirror"
        );
    });
}

/// A record whose TTL was removed from outside (`PERSIST`, a restore without TTLs) never
/// expires: `begin` and `force_release` read its lease as live, and `inspect` says the same
/// (a lease that never ends, a record kept for good). It said the lease had ended, so an
/// operator was shown a crashed attempt that the release then refused as live.
#[test]
fn a_record_without_a_ttl_is_live_to_inspect_as_to_every_other_call() {
    block_on(async {
        let Some(store) = store().await else { return };
        let mut conn = shared_connection().await;
        let (held, done) = (fresh_id(), fresh_id());
        let _held_token = execute(&*store, &held, &fp("a"), LONG).await;
        let other = execute(&*store, &done, &fp("a"), LONG).await;
        store
            .complete(&done, other, &Outcome::new(201), LONG)
            .await
            .expect("complete");
        for id in [&held, &done] {
            let persisted: i64 = redis::cmd("PERSIST")
                .arg(store.key(id))
                .query_async(&mut conn)
                .await
                .expect("persist");
            assert_eq!(persisted, 1);
        }
        let years = std::time::SystemTime::now() + Duration::from_secs(100 * 365 * 24 * 3600);
        let seen = store.inspect(&held).await.expect("inspect").expect("kept");
        let idempotency_core::RecordState::InFlight { lease_remaining } = seen.state else {
            panic!("{seen:?}")
        };
        assert!(lease_remaining > LONG, "{seen:?}");
        assert!(seen.expires_at > years, "{seen:?}");
        let again = store.begin(&held, &fp("a"), LONG).await.expect("begin");
        assert!(matches!(again, Begin::InFlight { .. }), "{again:?}");
        let released = store
            .force_release(&held, idempotency_core::ReleaseScope::default())
            .await
            .expect("release");
        assert_eq!(released, idempotency_core::ForceReleased::Live);
        let kept = store.inspect(&done).await.expect("inspect").expect("kept");
        assert!(kept.is_completed() && kept.expires_at > years, "{kept:?}");
    });
}

/// Packets to `port` on the loopback interface dropped (not refused: no reset, no
/// acknowledgement, as when a host is gone) until dropped itself. Needs `iptables` and root,
/// and says so loudly.
struct Blackhole {
    port: u16,
}

impl Blackhole {
    /// Tags its rules, so that one a killed test run left behind is found and removed.
    const TAG: &str = "idempotency-test-blackhole";

    fn on(port: u16) -> Self {
        Self::clear_leftovers();
        Self::rule("-I", port).expect("iptables -I");
        Self { port }
    }

    fn iptables(args: &[String]) -> std::io::Result<std::process::Output> {
        std::process::Command::new("iptables").args(args).output()
    }

    fn rule(action: &str, port: u16) -> Result<(), String> {
        let args: Vec<String> = [action, "INPUT", "-i", "lo", "-p", "tcp", "--dport"]
            .into_iter()
            .map(String::from)
            .chain([port.to_string()])
            .chain(["-m", "comment", "--comment", Self::TAG, "-j", "DROP"].map(String::from))
            .collect();
        let out = Self::iptables(&args)
            .unwrap_or_else(|e| panic!("this test needs iptables (and root): {e}"));
        out.status.success().then_some(()).ok_or_else(|| {
            format!(
                "iptables {action}: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }

    fn clear_leftovers() {
        let listed = Self::iptables(&["-S".into(), "INPUT".into()])
            .unwrap_or_else(|e| panic!("this test needs iptables (and root): {e}"));
        assert!(
            listed.status.success(),
            "this test needs iptables (and root): {}",
            String::from_utf8_lossy(&listed.stderr)
        );
        for line in String::from_utf8_lossy(&listed.stdout).lines() {
            if let Some(rule) = line.strip_prefix("-A ")
                && line.contains(Self::TAG)
            {
                let mut args = vec!["-D".to_owned()];
                args.extend(rule.split_whitespace().map(String::from));
                let _ = Self::iptables(&args);
            }
        }
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        // Not a second panic while the test is failing already: that would abort the binary.
        if let Err(error) = Self::rule("-D", self.port)
            && !std::thread::panicking()
        {
            panic!("{error}");
        }
    }
}

/// A failover whose old primary vanished (or a NAT that dropped the flow): the connection
/// stays open with nothing acknowledged, and only TCP's own retries (about 15 minutes) would
/// end it. redis-rs reconnects on an error it sees, never on a call given up by its budget.
/// Before, the store answered `Unavailable` to every call until then, and its running
/// operations could neither renew nor complete, so a retry served by another process took
/// their keys over and ran them a second time. The store now has the kernel end a connection
/// whose data goes unacknowledged when asked to (`dead_connection_after`), and redis-rs
/// reconnects.
#[test]
fn a_connection_whose_server_vanished_is_ended_and_replaced() {
    use idempotency_test::relay;

    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::redis().await.expect("redis");
        let relay = relay::stalling_relay(relay::upstream(redis.url())).await;
        let store = RedisStore::builder(relay::through(redis.url(), relay.port))
            .prefix(idempotency_test::unique("t"))
            .call_budget(Duration::from_millis(300))
            .dead_connection_after(Duration::from_secs(1))
            .eviction_check(EvictionCheck::Skip)
            .connect()
            .await
            .expect("store");
        let held = fresh_id();
        let Begin::Execute(token) = store.begin(&held, &fp("a"), LONG).await.expect("begin") else {
            panic!("a fresh key executes")
        };
        // The host is gone: nothing the store sends is acknowledged, and the relay (the old
        // primary) answers nothing more on the connections it had.
        let gone = Blackhole::on(relay.port);
        relay.vanish();
        for _ in 0..8 {
            let hung = store.begin(&fresh_id(), &fp("a"), LONG).await;
            assert!(matches!(hung, Err(Error::Unavailable(_))), "{hung:?}");
        }
        // A new primary at the same address.
        drop(gone);
        relay.fail_over();
        let mut last = None;
        for _ in 0..40 {
            match store.begin(&fresh_id(), &fp("a"), LONG).await {
                Ok(Begin::Execute(_)) => {
                    last = None;
                    break;
                }
                other => last = Some(other),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        assert!(last.is_none(), "the store never served again: {last:?}");
        store
            .renew(&held, token, LONG)
            .await
            .expect("the running operation renews its lease again");
    });
}

/// One operator's release that reaches Redis twice deletes once. A cluster connection sends
/// a script whose answer timed out again: when the first copy deleted a stuck lease and a
/// retry claimed the key before the second copy came, that copy deleted the new attempt's
/// live lease (the scope said live leases too), and the next request ran the operation a
/// second time. Now each release has a receipt, and a second copy answers what the first
/// did.
async fn a_release_sent_twice_deletes_once(store: &RedisStore) {
    let id = fresh_id();
    execute(store, &id, &fp("a"), LONG).await; // the stuck lease
    let scope = idempotency_core::ReleaseScope::default().with_live();
    let receipt = idempotency_core::LeaseToken::generate();
    let released = idempotency_core::ForceReleased::Released;
    let first = store.force_release_once(&id, scope, receipt).await;
    assert_eq!(first.expect("release"), released);
    let retry = execute(store, &id, &fp("a"), LONG).await;
    let again = store.force_release_once(&id, scope, receipt).await;
    assert_eq!(again.expect("the same release again"), released);
    store
        .complete(&id, retry, &Outcome::new(201), LONG)
        .await
        .expect("the retry still holds the key");
    assert!(matches!(
        store.begin(&id, &fp("a"), LONG).await,
        Ok(Begin::Replay(_))
    ));
}

#[test]
fn an_operators_release_sent_twice_deletes_once() {
    block_on(async {
        if let Some(store) = store().await {
            a_release_sent_twice_deletes_once(&store).await;
        }
    });
}

/// A store, and a second store on the same records through a delaying relay, with `budget`
/// per call.
async fn relayed_operator(
    budget: Duration,
) -> Option<(
    RedisStore,
    idempotency_test::relay::DelayingRelay,
    RedisStore,
)> {
    let redis = services::redis().await?;
    let prefix = idempotency_test::unique("t");
    let store = RedisStore::builder(redis.url())
        .prefix(&prefix)
        .connect()
        .await
        .expect("store");
    let relay =
        idempotency_test::relay::delaying_relay(idempotency_test::relay::upstream(redis.url()))
            .await;
    let relayed = RedisStore::builder(idempotency_test::relay::through(redis.url(), relay.port))
        .prefix(&prefix)
        .call_budget(budget)
        .eviction_check(EvictionCheck::Skip)
        .connect()
        .await
        .expect("the relayed store");
    Some((store, relay, relayed))
}

/// A duplicate that finds a lease reads the lease's TTL with it, atomically. Read as a
/// pipeline of `GET` and `PTTL`, which Redis can read from its socket in two (another
/// client's completion run in between), the lease came with the TTL of the outcome's
/// retention: a 409 whose `Retry-After` was a day, for a key whose outcome could be
/// replayed.
#[test]
fn a_lease_is_read_with_its_own_ttl() {
    block_on(async {
        let Some((store, relay, duplicate)) = relayed_operator(Duration::from_secs(3)).await else {
            return;
        };
        let id = fresh_id();
        let lease = Duration::from_secs(5);
        let token = execute(&store, &id, &fp("a"), lease).await;
        duplicate.inspect(&id).await.expect("connected");
        relay.split_requests_at(Duration::from_millis(400), b"PTTL");
        let asking = tokio::spawn({
            let (duplicate, id) = (duplicate.clone(), id);
            async move { duplicate.begin(&id, &fp("a"), lease).await }
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
        let day = Duration::from_secs(86_400);
        store
            .complete(&id, token, &Outcome::new(201), day)
            .await
            .expect("complete");
        match asking.await.expect("the duplicate's task") {
            Ok(Begin::InFlight { retry_after }) => assert!(retry_after <= lease, "{retry_after:?}"),
            Ok(Begin::Replay(_)) => {}
            other => panic!("{other:?}"),
        }
    });
}

/// A claim whose answer was lost, cancelled by its store, then written again grants nothing.
/// A cluster connection sends a command whose answer timed out again; when the cancel ran
/// between the two copies, it deleted the claim's lease, and the second copy wrote it back:
/// a lease nobody held answered "in flight" for its whole length, then `TakeOver` (outcome
/// unknown) for an operation that never ran. Now the cancel leaves its marker in the lease's
/// place, on which the second copy's `SET NX` fails.
#[test]
fn a_claim_written_again_after_its_cancel_grants_nothing() {
    block_on(async {
        let Some((store, relay, late)) = relayed_operator(Duration::from_millis(500)).await else {
            return;
        };
        let id = fresh_id();
        // Connected first: the handshake's answers are not held back.
        late.inspect(&id).await.expect("inspect");
        // The claim's answer comes after its caller gave up.
        relay.delay_replies(Duration::from_millis(700));
        let claim = tokio::spawn({
            let (late, id) = (late.clone(), id);
            async move { late.begin(&id, &fp("a"), LONG).await }
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
        let mut redis = shared_connection().await;
        let key = store.key(&id);
        let (lease, ttl): (Vec<u8>, i64) = redis::pipe()
            .cmd("GET")
            .arg(&key)
            .cmd("PTTL")
            .arg(&key)
            .query_async(&mut redis)
            .await
            .expect("the claim's lease");
        assert!(!lease.is_empty(), "the claim landed");
        let gave_up = claim.await.expect("the claim's task");
        assert!(matches!(gave_up, Err(Error::Unavailable(_))), "{gave_up:?}");
        relay.delay_replies(Duration::ZERO);
        late.drain().await; // the cancel has run
        // The claim's second copy.
        let _: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(&lease)
            .arg("NX")
            .arg("PX")
            .arg(ttl)
            .query_async(&mut redis)
            .await
            .expect("the second copy");
        let next = store.begin(&id, &fp("a"), LONG).await;
        assert!(matches!(next, Ok(Begin::Execute(_))), "{next:?}");
    });
}

/// An operator's release that reaches Redis after the call gave up (its bytes held up by the
/// network, then delivered) must delete nothing: by then the operator was told
/// `Unavailable`, may have released the key again, and a new request may have run and
/// completed under it. Before, the late script took that new outcome, and the next retry of
/// the key ran the operation a second time.
#[test]
fn an_operators_release_that_arrives_after_its_call_gave_up_deletes_nothing() {
    block_on(async {
        let Some((store, relay, late)) = relayed_operator(Duration::from_millis(300)).await else {
            return;
        };
        let id = fresh_id();
        let first = execute(&store, &id, &fp("a"), LONG).await;
        store
            .complete(&id, first, &Outcome::new(201).with_body("first"), LONG)
            .await
            .expect("complete");
        // Only the release's own script is held back (the one with a receipt).
        let scope = idempotency_core::ReleaseScope::default().with_completed();
        relay.delay_requests_containing(Duration::from_secs(2), b":released:");
        let gave_up = late.force_release(&id, scope).await;
        assert!(matches!(gave_up, Err(Error::Unavailable(_))), "{gave_up:?}");

        // The operator releases the key again, and a new request runs under it.
        let outcome = idempotency_test::conformance::released_and_run_again(&store, &id).await;
        // The first release has reached Redis by then.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            store.begin(&id, &fp("a"), LONG).await.expect("begin"),
            Begin::Replay(outcome),
            "the late release took the new outcome"
        );
    });
}

/// A lease mirror of the earlier layout (a hash with `st` 0 and no `exp`: the hybrid wrote
/// it) never answers `Mismatch` to a peek with another body, as a mirror of the current
/// layout does not: it may outlive its lease (a failed delete, an outcome completed
/// elsewhere), and Postgres decides for another request. It answered a final 422 right after
/// an upgrade. A lease of the earlier layout (with `exp`: the Redis store's own) still does.
#[test]
fn a_mirror_of_the_earlier_layout_never_answers_mismatch() {
    block_on(async {
        let Some(store) = store().await else { return };
        let mut conn = shared_connection().await;
        let (mirror, lease) = (fresh_id(), fresh_id());
        let token = idempotency_core::LeaseToken::generate().to_string();
        let far = "99999999999999";
        for (id, exp) in [(&mirror, None), (&lease, Some(far))] {
            let mut hset = redis::cmd("HSET");
            hset.arg(store.key(id))
                .arg("st")
                .arg("0")
                .arg("fp")
                .arg(&fp("a").as_bytes()[..])
                .arg("tok")
                .arg(&token);
            if let Some(exp) = exp {
                hset.arg("exp").arg(exp);
            }
            let _: i64 = hset.query_async(&mut conn).await.expect("hset");
            let _: i64 = redis::cmd("PEXPIRE")
                .arg(store.key(id))
                .arg(5_000)
                .query_async(&mut conn)
                .await
                .expect("pexpire");
        }
        let peeked = store.peek(&mirror, &fp("b")).await.expect("peek");
        assert!(
            matches!(peeked, idempotency_redis::Peek::Absent),
            "{peeked:?}"
        );
        let same = store.peek(&mirror, &fp("a")).await.expect("peek");
        assert!(
            matches!(same, idempotency_redis::Peek::Found(Begin::InFlight { .. })),
            "{same:?}"
        );
        let other = store.peek(&lease, &fp("b")).await.expect("peek");
        assert!(
            matches!(other, idempotency_redis::Peek::Found(Begin::Mismatch)),
            "{other:?}"
        );
    });
}
