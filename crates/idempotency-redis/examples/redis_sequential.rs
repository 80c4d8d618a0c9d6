//! Measures sequential begin + complete pairs against a real Redis, and the memory one
//! completed record with a 1 KiB outcome takes.
//!
//! Run with: `cargo run --release -p idempotency-redis --example redis_sequential -- redis://127.0.0.1:6379/ 10000`
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use idempotency_core::{Begin, Fingerprint, IdempotencyKey, Outcome, RecordId, Scope, Store};
use idempotency_redis::RedisStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().ok_or("usage: sequential <redis-url> [pairs]")?;
    let pairs: usize = args
        .next()
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(10_000);
    let store = RedisStore::builder(url.as_str())
        .prefix("bench")
        .connect()
        .await?;
    let scope = Scope::new(uuid::Uuid::new_v4().to_string());
    let fp = Fingerprint::of(b"bench");
    let outcome = Outcome::new(201)
        .with_header("content-type", "application/json")
        .with_body(vec![b'x'; 1024]);
    let lease = Duration::from_secs(30);
    let started = Instant::now();
    let mut last = None;
    for i in 0..pairs {
        let id = RecordId::new(&scope, &IdempotencyKey::new(format!("k{i}"))?);
        let Begin::Execute(token) = store.begin(&id, &fp, lease).await? else {
            return Err("expected Execute".into());
        };
        store
            .complete(&id, token, &outcome, Duration::from_secs(3600))
            .await?;
        last = Some(id);
    }
    let elapsed = started.elapsed();
    let id = last.ok_or("no pairs")?;
    let mut conn = redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let bytes: i64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(store.key(&id))
        .query_async(&mut conn)
        .await?;
    println!(
        "{pairs} sequential begin+complete pairs: {elapsed:.2?} ({:.0} µs/pair); one record with a 1 KiB outcome: {bytes} bytes (MEMORY USAGE)",
        elapsed.as_micros() as f64 / pairs as f64
    );
    Ok(())
}
