//! The protocol on the embedded memory store, no services needed.
//!
//! It shows the store's answers, one at a time. To run an operation, use an `Executor` or
//! the HTTP layer: they renew the lease while it runs and stop it when the lease is lost, so
//! a slow attempt and a retry that took its key over never both run; a raw `begin` …
//! `complete` does neither.
//!
//! Run with: `cargo run -p idempotency --example quickstart`
#![allow(clippy::print_stdout)]

use std::time::Duration;

use idempotency::{
    Begin, Fingerprint, IdempotencyKey, MemoryStore, Outcome, RecordId, Scope, Store,
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = MemoryStore::new();
    let id = RecordId::new(&Scope::new("acct_1"), &IdempotencyKey::new("charge-42")?);
    let request = Fingerprint::of(br#"{"amount":1000,"currency":"eur"}"#);
    let mut charges = 0;

    // The client sends the same request three times (its first response was lost).
    for attempt in 1..=3 {
        match store.begin(&id, &request, Duration::from_secs(30)).await? {
            Begin::Execute(token) => {
                charges += 1;
                let outcome = Outcome::new(201).with_body(r#"{"id":"ch_1","status":"succeeded"}"#);
                store
                    .complete(&id, token, &outcome, Duration::from_secs(86_400))
                    .await?;
                println!("attempt {attempt}: executed, card charged");
            }
            Begin::Replay(outcome) => println!(
                "attempt {attempt}: replayed {} {}",
                outcome.status,
                String::from_utf8_lossy(&outcome.body)
            ),
            other => println!("attempt {attempt}: {other:?}"),
        }
    }
    let other = Fingerprint::of(br#"{"amount":9999,"currency":"eur"}"#);
    let reuse = store.begin(&id, &other, Duration::from_secs(30)).await?;
    println!("same key, different body: {reuse:?}");
    println!("charges made: {charges}");
    Ok(())
}
