//! Stores on the shared services, built once per test binary.

use std::sync::Arc;

use idempotency_postgres::PostgresStore;
use tokio::sync::OnceCell;

use crate::services;

/// A migrated Postgres store on the binary's shared Postgres, with a pool large enough for the
/// concurrency tests (64 racing `begin`s, each on its own connection). `None` when service
/// tests are opted out.
pub async fn postgres() -> Option<Arc<PostgresStore>> {
    static STORE: OnceCell<Arc<PostgresStore>> = OnceCell::const_new();
    let pg = services::postgres().await?;
    Some(
        STORE
            .get_or_init(|| async {
                let store = PostgresStore::builder(pg.url())
                    .max_connections(80)
                    .connect()
                    .await
                    .expect("postgres store");
                store.migrate().await.expect("migrations");
                Arc::new(store)
            })
            .await
            .clone(),
    )
}
