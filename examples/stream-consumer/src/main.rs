//! Publishes charges (with duplicates) to a Redis stream and applies them exactly once.
//!
//! Run with: `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run -p stream-consumer`
#![allow(clippy::print_stdout)]

use std::sync::Arc;

use idempotency::postgres::PostgresStore;
use stream_consumer::{Consumer, publish};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The library reports through `tracing` (a span per store call, warnings when a store
    // fails): without a subscriber they would vanish. RUST_LOG filters, e.g.
    // `RUST_LOG=info,idempotency_core=debug` for the store spans.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let db = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let redis_url = std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL")?;
    let store = PostgresStore::builder(db).connect().await?;
    store.migrate().await?;
    let client = redis::Client::open(redis_url)?;
    // The producer's connection; the consumer makes its own.
    let mut redis = client.get_multiplexed_async_connection().await?;
    let mut consumer = Consumer::new(
        client,
        Arc::new(store),
        "charges",
        "ledger",
        "consumer-1",
        "ledger_entries",
    );
    consumer.setup().await?;
    for i in 0..10 {
        publish(&mut redis, "charges", &format!("ch_{i}"), 100 + i).await?;
        if i % 3 == 0 {
            publish(&mut redis, "charges", &format!("ch_{i}"), 100 + i).await?; // a producer retry
        }
    }
    let polled = consumer.poll(100).await?;
    println!(
        "applied {} charges, acknowledged {} duplicates without a second effect",
        polled.applied, polled.replayed
    );
    // Before exiting, what dropped runs left to settle (a lease given back, an outcome's
    // second write) gets a bounded wait, as a shutdown deadline would give it. Cut off, it
    // is still safe: a lease runs out, and an applied charge committed with its result.
    let _ = tokio::time::timeout(std::time::Duration::from_secs(20), consumer.drain()).await;
    Ok(())
}
