//! Stores on the shared services, built once per test binary.

use std::sync::Arc;

use idempotency_postgres::{PostgresStore, PostgresStoreBuilder};
use tokio::sync::OnceCell;

use crate::services;

/// A migrated store on a Postgres container of its own, with short budgets (300 ms acquire,
/// 500 ms per call): for tests that stop the database mid-operation (`Service::stop`).
/// `None` when service tests are opted out.
pub async fn stoppable_postgres() -> Option<(services::Service, Arc<PostgresStore>)> {
    stoppable_postgres_with(|b| {
        b.acquire_timeout(std::time::Duration::from_millis(300))
            .call_timeout(std::time::Duration::from_millis(500))
    })
    .await
}

/// [`stoppable_postgres`] with the store built as `configure` says (the default budgets
/// when it changes nothing): for a test whose healthy calls must not race a short budget on
/// a loaded machine.
pub async fn stoppable_postgres_with(
    configure: impl FnOnce(PostgresStoreBuilder) -> PostgresStoreBuilder,
) -> Option<(services::Service, Arc<PostgresStore>)> {
    if services::skipping() {
        return None;
    }
    let pg = services::start_postgres().await;
    let store = configure(PostgresStore::builder(pg.url()))
        .connect()
        .await
        .expect("store");
    store.migrate().await.expect("migrate");
    Some((pg, Arc::new(store)))
}

/// The same as [`postgres`] without group commit: one statement per call, the store the
/// batched one must answer exactly like.
pub async fn postgres_per_request() -> Option<Arc<PostgresStore>> {
    static STORE: OnceCell<Arc<PostgresStore>> = OnceCell::const_new();
    shared_postgres(&STORE, |b| b.per_request()).await
}

/// The same as [`postgres`] on a key table of its own in a schema of its own,
/// [`OWN_TABLE`]: every statement and the migration rewritten for it.
pub async fn postgres_own_table() -> Option<Arc<PostgresStore>> {
    static STORE: OnceCell<Arc<PostgresStore>> = OnceCell::const_new();
    shared_postgres(&STORE, |b| b.table(OWN_TABLE)).await
}

/// The table of [`postgres_own_table`].
pub const OWN_TABLE: &str = "idem_test.charge_keys";

/// A migrated Postgres store on the binary's shared Postgres, with a pool large enough for the
/// concurrency tests (64 racing `begin`s, each on its own connection). `None` when service
/// tests are opted out.
pub async fn postgres() -> Option<Arc<PostgresStore>> {
    static STORE: OnceCell<Arc<PostgresStore>> = OnceCell::const_new();
    shared_postgres(&STORE, |b| b).await
}

async fn shared_postgres(
    cell: &'static OnceCell<Arc<PostgresStore>>,
    configure: fn(PostgresStoreBuilder) -> PostgresStoreBuilder,
) -> Option<Arc<PostgresStore>> {
    let pg = services::postgres().await?;
    Some(
        cell.get_or_init(|| async {
            let builder = PostgresStore::builder(pg.url()).max_connections(80);
            let store = configure(builder).connect().await.expect("postgres store");
            store.migrate().await.expect("migrations");
            Arc::new(store)
        })
        .await
        .clone(),
    )
}
