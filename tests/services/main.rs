//! The harness itself: real Postgres and Redis start (or are found) and hold a value, and the
//! fault handles do what the fault-injection suites rely on.

use std::time::Duration;

use idempotency_test::{block_on, services};
use sqlx::Connection;

#[test]
fn postgres_round_trips_a_value() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        assert!(pg.url().contains("127.0.0.1"), "{}", pg.url());
        let mut conn = sqlx::PgConnection::connect(pg.url())
            .await
            .expect("connect");
        let table = idempotency_test::unique("smoke");
        let create = format!("CREATE TABLE {table} (v bytea NOT NULL)");
        sqlx::query(sqlx::AssertSqlSafe(create))
            .execute(&mut conn)
            .await
            .expect("create");
        let insert = format!("INSERT INTO {table} (v) VALUES ($1)");
        sqlx::query(sqlx::AssertSqlSafe(insert))
            .bind(&b"\x00hello\xff"[..])
            .execute(&mut conn)
            .await
            .expect("insert");
        let select = format!("SELECT v FROM {table}");
        let (v,): (Vec<u8>,) = sqlx::query_as(sqlx::AssertSqlSafe(select))
            .fetch_one(&mut conn)
            .await
            .expect("select");
        assert_eq!(v, b"\x00hello\xff");
    });
}

#[test]
fn redis_round_trips_a_value() {
    block_on(async {
        let Some(redis) = services::redis().await else {
            return;
        };
        assert!(redis.url().contains("127.0.0.1"), "{}", redis.url());
        let client = redis::Client::open(redis.url()).expect("client");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        let key = idempotency_test::unique("smoke");
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg(&b"\x00hello\xff"[..])
            .arg("PX")
            .arg(60_000)
            .query_async(&mut conn)
            .await
            .expect("set");
        let v: Vec<u8> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("get");
        assert_eq!(v, b"\x00hello\xff");
        let policy: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(&mut conn)
            .await
            .expect("config get");
        assert_eq!(policy[1], "noeviction");
    });
}

#[test]
fn a_paused_then_stopped_redis_comes_back_on_the_same_url() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::start_redis(services::RedisOptions::default()).await;
        let client = redis::Client::open(redis.url()).expect("client");

        redis.pause().await;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(300)))
            .set_response_timeout(Some(Duration::from_millis(300)));
        let hung = client
            .get_multiplexed_async_connection_with_config(&config)
            .await;
        assert!(hung.is_err(), "a paused Redis must not answer");
        redis.unpause().await;

        redis.stop().await;
        assert!(
            client.get_multiplexed_async_connection().await.is_err(),
            "a stopped Redis refuses"
        );
        redis.start().await;
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("reconnect");
        let pong: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .expect("ping");
        assert_eq!(pong, "PONG");
    });
}

#[test]
fn a_stopped_postgres_comes_back_on_the_same_url() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::start_postgres().await;
        pg.stop().await;
        assert!(sqlx::PgConnection::connect(pg.url()).await.is_err());
        pg.start().await;
        let mut conn = sqlx::PgConnection::connect(pg.url())
            .await
            .expect("reconnect");
        let (one,): (i32,) = sqlx::query_as("SELECT 1")
            .fetch_one(&mut conn)
            .await
            .expect("select");
        assert_eq!(one, 1);
    });
}
