//! TLS to Postgres and Redis, as managed services require: servers from the test image that
//! accept TLS only, with a certificate from a CA made at test time (rcgen), and the stores
//! connecting with their `tls-rustls` features — verify-full for Postgres, `rediss://` with
//! the CA for Redis. The conformance suite runs on both; a server whose certificate chains
//! to another CA, or a plaintext client, is refused.

use std::{sync::Arc, time::Duration};

use idempotency_core::{Begin, Error, Fingerprint, Outcome, Store};
use idempotency_hybrid::{BreakerConfig, HybridStore};
use idempotency_postgres::PostgresStore;
use idempotency_redis::RedisStore;
use idempotency_test::{
    block_on,
    conformance::fresh_id,
    services::{self, Service},
    tls::TestCa,
};
use tokio::sync::OnceCell;

/// One CA, one TLS Postgres and one TLS Redis for the binary.
struct Tls {
    ca: TestCa,
    postgres: Service,
    redis: Service,
}

async fn tls() -> Option<&'static Tls> {
    static TLS: OnceCell<Tls> = OnceCell::const_new();
    if services::skipping() {
        return None;
    }
    Some(
        TLS.get_or_init(|| async {
            let ca = TestCa::generate();
            let postgres = services::start_postgres_tls(&ca).await;
            let redis = services::start_redis_tls(&ca).await;
            Tls {
                ca,
                postgres,
                redis,
            }
        })
        .await,
    )
}

async fn postgres(tls: &Tls) -> PostgresStore {
    assert!(
        tls.postgres.url().contains("sslmode=verify-full"),
        "{}",
        tls.postgres.url()
    );
    let store = PostgresStore::builder(tls.postgres.url())
        .connect()
        .await
        .expect("Postgres over TLS");
    store.migrate().await.expect("migrate");
    store
}

async fn redis(tls: &Tls) -> idempotency_redis::RedisStoreBuilder {
    assert!(
        tls.redis.url().starts_with("rediss://"),
        "{}",
        tls.redis.url()
    );
    RedisStore::builder(tls.redis.url())
        .prefix(idempotency_test::unique("tls"))
        .tls_root_certificates(tls.ca.ca_pem())
}

mod postgres_over_tls {
    use super::*;

    async fn store() -> Option<Arc<PostgresStore>> {
        static STORE: OnceCell<Arc<PostgresStore>> = OnceCell::const_new();
        let tls = tls().await?;
        Some(
            STORE
                .get_or_init(|| async { Arc::new(postgres(tls).await) })
                .await
                .clone(),
        )
    }

    idempotency_test::conformance_tests!(async { store().await.map(|s| s as Arc<dyn Store>) });
}

mod redis_over_tls {
    use super::*;

    async fn store() -> Option<Arc<RedisStore>> {
        static STORE: OnceCell<Arc<RedisStore>> = OnceCell::const_new();
        let tls = tls().await?;
        Some(
            STORE
                .get_or_init(|| async {
                    Arc::new(redis(tls).await.connect().await.expect("Redis over TLS"))
                })
                .await
                .clone(),
        )
    }

    idempotency_test::conformance_tests!(async { store().await.map(|s| s as Arc<dyn Store>) });
}

/// The headline mode with both sides on TLS: the first request executes, the retry is
/// replayed by Redis alone.
#[test]
fn the_hybrid_store_runs_with_tls_on_both_sides() {
    block_on(async {
        let Some(tls) = tls().await else { return };
        let redis = redis(tls)
            .await
            .eviction_check(idempotency_redis::EvictionCheck::Skip);
        let store = HybridStore::new(
            postgres(tls).await,
            redis.connect().await.expect("Redis over TLS"),
            BreakerConfig::default(),
        );
        let (id, fp) = (fresh_id(), Fingerprint::of(b"tls"));
        let Begin::Execute(token) = store
            .begin(&id, &fp, Duration::from_secs(30))
            .await
            .expect("begin")
        else {
            panic!("the first request executes")
        };
        let outcome = Outcome::new(201).with_body("charged over TLS");
        store
            .complete(&id, token, &outcome, Duration::from_secs(600))
            .await
            .expect("complete");
        for _ in 0..2 {
            assert_eq!(
                store
                    .begin(&id, &fp, Duration::from_secs(30))
                    .await
                    .expect("retry"),
                Begin::Replay(outcome.clone())
            );
        }
        let m = store.metrics();
        assert!(m.redis_hits >= 1 && m.redis_errors == 0, "{m:?}");
    });
}

/// A first request on a Postgres store at `url` (the pool connects lazily, on first use).
async fn first_begin(url: String) -> Result<Begin, Error> {
    let store = PostgresStore::builder(url)
        .acquire_timeout(Duration::from_secs(5))
        .connect()
        .await?;
    store
        .begin(
            &fresh_id(),
            &Fingerprint::of(b"refused"),
            Duration::from_secs(30),
        )
        .await
}

/// verify-full (and verify-ca) and `rediss://` check the server: a certificate from a CA the
/// client does not trust is refused, with an error that says so, and nothing runs.
#[test]
fn a_server_certificate_from_another_ca_is_refused() {
    block_on(async {
        let Some(tls) = tls().await else { return };
        let stranger = TestCa::generate();

        let url = tls.postgres.url().replace(
            &tls.ca.ca_path().display().to_string(),
            &stranger.ca_path().display().to_string(),
        );
        // verify-ca checks the chain as verify-full does (not the host name).
        for url in [url.clone(), url.replace("verify-full", "verify-ca")] {
            let refused = first_begin(url)
                .await
                .expect_err("Postgres with a certificate from an untrusted CA");
            assert!(matches!(refused, Error::Unavailable(_)), "{refused:?}");
            assert!(
                refused.to_string().to_lowercase().contains("certificate"),
                "{refused}"
            );
        }
        // `require` encrypts (the server takes TLS only) and checks nothing: what the README
        // warns of.
        let require = url
            .split('?')
            .next()
            .map(|base| format!("{base}?sslmode=require"))
            .expect("url");
        let unchecked = PostgresStore::builder(require)
            .connect()
            .await
            .expect("lazy pool");
        unchecked
            .migrate()
            .await
            .expect("require checks no certificate");

        let refused = RedisStore::builder(tls.redis.url())
            .tls_root_certificates(stranger.ca_pem())
            .connect()
            .await
            .expect_err("Redis with a certificate from an untrusted CA");
        assert!(matches!(refused, Error::Unavailable(_)), "{refused:?}");
        assert!(
            refused.to_string().to_lowercase().contains("certificate"),
            "{refused}"
        );
    });
}

/// The servers take TLS only: a client that does not ask for it is refused (what a managed
/// service does, and what makes the tests above prove the stores really use TLS).
#[test]
fn a_plaintext_client_is_refused() {
    block_on(async {
        let Some(tls) = tls().await else { return };
        let plain = tls
            .postgres
            .url()
            .split('?')
            .next()
            .map(|base| format!("{base}?sslmode=disable"))
            .expect("url");
        let refused = first_begin(plain).await.expect_err("plaintext Postgres");
        assert!(matches!(refused, Error::Unavailable(_)), "{refused:?}");
        assert!(
            refused.to_string().contains("no encryption") || refused.to_string().contains("reject"),
            "{refused}"
        );

        let plain = tls.redis.url().replace("rediss://", "redis://");
        let refused = RedisStore::builder(plain)
            .connect()
            .await
            .expect_err("plaintext Redis");
        assert!(matches!(refused, Error::Unavailable(_)), "{refused:?}");
    });
}

/// Roots given for a URL without TLS would protect nothing, and `#insecure` would check
/// nothing: configuration errors, before any connection.
#[test]
fn tls_roots_for_a_plaintext_url_are_a_configuration_error() {
    block_on(async {
        let ca = TestCa::generate();
        let refused = RedisStore::builder("redis://127.0.0.1:1/")
            .tls_root_certificates(ca.ca_pem())
            .connect()
            .await
            .expect_err("roots for redis://");
        assert!(matches!(refused, Error::Config(_)), "{refused:?}");
        // `#insecure` would turn certificate checks off (where the redis crate allows it).
        let refused = RedisStore::builder("rediss://127.0.0.1:1/#insecure")
            .connect()
            .await
            .expect_err("#insecure");
        assert!(matches!(refused, Error::Config(_)), "{refused:?}");
    });
}
