//! Measures sequential begin + complete pairs against a real Postgres.
//!
//! Run with: `cargo run --release -p idempotency-postgres --example pg_sequential -- postgres://postgres@127.0.0.1:5432/postgres 1000`
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use idempotency_core::{Begin, Fingerprint, IdempotencyKey, Outcome, RecordId, Scope, Store};
use idempotency_postgres::PostgresStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .ok_or("usage: sequential <postgres-url> [pairs]")?;
    let pairs: usize = args.next().map(|n| n.parse()).transpose()?.unwrap_or(1000);
    let store = PostgresStore::builder(url)
        .max_connections(1)
        .connect()
        .await?;
    store.migrate().await?;
    let scope = Scope::new(uuid::Uuid::new_v4().to_string());
    let fp = Fingerprint::of(b"bench");
    let outcome = Outcome::new(201).with_body(vec![b'x'; 256]);
    let lease = Duration::from_secs(30);
    let started = Instant::now();
    for i in 0..pairs {
        let id = RecordId::new(&scope, &IdempotencyKey::new(format!("k{i}"))?);
        let Begin::Execute(token) = store.begin(&id, &fp, lease).await? else {
            return Err("expected Execute".into());
        };
        store
            .complete(&id, token, &outcome, Duration::from_secs(3600))
            .await?;
    }
    let elapsed = started.elapsed();
    let replays = Instant::now();
    for i in 0..pairs {
        let id = RecordId::new(&scope, &IdempotencyKey::new(format!("k{i}"))?);
        let Begin::Replay(_) = store.begin(&id, &fp, lease).await? else {
            return Err("expected Replay".into());
        };
    }
    let replay_elapsed = replays.elapsed();
    println!(
        "{pairs} sequential begin+complete pairs: {elapsed:.2?} ({:.0} µs/pair); {pairs} replays: {replay_elapsed:.2?} ({:.0} µs/replay)",
        elapsed.as_micros() as f64 / pairs as f64,
        replay_elapsed.as_micros() as f64 / pairs as f64,
    );
    Ok(())
}
