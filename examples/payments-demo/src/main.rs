//! A payments gateway whose `POST /charges` runs once per `Idempotency-Key`.
//!
//! Run with: `cargo run --release -p payments-demo` (embedded memory store, no services), or
//! with `DATABASE_URL` and/or `REDIS_URL` for the Postgres, Redis or hybrid store. The
//! retry-storm tool: `cargo run --release -p payments-demo -- storm --url http://127.0.0.1:3000`.
#![allow(clippy::print_stdout)]

mod admin;
mod app;
mod charges;
mod client;
mod config;
mod orders;
mod storm;

use std::{process::ExitCode, sync::Arc, time::Duration};

use clap::Parser;

use idempotency::{
    MemoryStore, Policy, Store, hybrid::HybridStore, postgres::PostgresStore, redis::RedisStore,
    tower::IdempotencyLayer,
};

use crate::{
    app::App,
    charges::Charges,
    config::{Config, Mode},
    orders::Orders,
};

/// A payments gateway whose `POST /charges` runs once per `Idempotency-Key`.
#[derive(Debug, clap::Parser)]
#[command(
    name = "payments-demo",
    version,
    after_help = "`serve` (the default) is configured by the environment:\n  \
        BIND                      listen address (default 127.0.0.1:3000)\n  \
        DATABASE_URL              Postgres: the guarantee (with REDIS_URL: the hybrid store)\n  \
        REDIS_URL                 Redis: the fast path\n  \
        IDEMPOTENCY_STORE         memory | postgres | redis | hybrid (default: from the URLs)\n  \
        IDEMPOTENCY_LEASE_MS      how long a first request holds its key (100 ms to a day; default 30 s)\n  \
        IDEMPOTENCY_RETENTION_MS  how long an outcome is replayed\n  \
        ADMIN_TOKEN               mounts /admin/idempotency/scopes/{account}/keys/{key} (GET, DELETE, PUT)\n                            for Authorization: Bearer <ADMIN_TOKEN>\n  \
        DEMO_CRASH                1: X-Demo-Crash: after-charge aborts the process (off: 403)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Serve the demo (the default).
    Serve,
    /// The retry storm: many charges, each sent several times with one key, against a
    /// running demo; exits 0 only if each was charged once.
    Storm(storm::Args),
    /// The operator's tools on the store named by DATABASE_URL / REDIS_URL (as `serve`
    /// picks it): inspect a key's record, release a stuck one.
    #[command(subcommand)]
    Admin(admin::Command),
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Cli::parse().command {
        Some(Command::Storm(args)) => storm::main(args).await,
        Some(Command::Admin(command)) => admin::main(command).await,
        None | Some(Command::Serve) => match serve().await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("payments-demo: {error}");
                ExitCode::FAILURE
            }
        },
    }
}

/// The stores `serve` (and `admin`) run on, as the configuration names them.
pub(crate) struct Stores {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) postgres: Option<PostgresStore>,
    pub(crate) hybrid: Option<HybridStore>,
    pub(crate) redis: Option<RedisStore>,
}

/// Connects the configured store (no migrations: `serve` runs them).
pub(crate) async fn connect(config: &Config) -> Result<Stores, Box<dyn std::error::Error>> {
    let postgres = match &config.database_url {
        Some(url) => Some(
            PostgresStore::builder(url.as_str())
                .max_connections(20)
                // A crash is remembered (outcome unknown) as long as a charge would be.
                .unknown_outcome_retention(
                    config.retention.max(idempotency::UNKNOWN_OUTCOME_RETENTION),
                )
                .connect()
                .await?,
        ),
        None => None,
    };
    let redis_builder = config.redis_url.as_ref().map(|url| {
        RedisStore::builder(url.as_str())
            .prefix("payments-demo")
            .call_budget(Duration::from_millis(200))
    });
    let (store, hybrid, redis): (Arc<dyn Store>, _, _) = match config.mode {
        // A crash is remembered (outcome unknown) as long as a charge would be.
        Mode::Memory => (
            Arc::new(MemoryStore::new().with_unknown_outcome_retention(
                config.retention.max(idempotency::UNKNOWN_OUTCOME_RETENTION),
            )),
            None,
            None,
        ),
        Mode::Postgres => (
            Arc::new(postgres.clone().ok_or("no DATABASE_URL")?),
            None,
            None,
        ),
        Mode::Redis => {
            let redis = redis_builder.ok_or("no REDIS_URL")?.connect().await?;
            (Arc::new(redis.clone()), None, Some(redis))
        }
        Mode::Hybrid => {
            let pg = postgres.clone().ok_or("no DATABASE_URL")?;
            let hybrid = HybridStore::connect(pg, redis_builder.ok_or("no REDIS_URL")?).await?;
            let redis = hybrid.redis().clone();
            (Arc::new(hybrid.clone()), Some(hybrid), Some(redis))
        }
    };
    Ok(Stores {
        store,
        postgres,
        hybrid,
        redis,
    })
}

fn demo_migrator() -> sqlx::migrate::Migrator {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.dangerous_set_table_name("_payments_demo_migrations");
    migrator
}

async fn serve() -> Result<(), Box<dyn std::error::Error>> {
    let config = Config::from_env()?;
    tracing::info!(mode = %config.mode, bind = %config.bind, "starting payments-demo");
    // The recorder first: the stores and the layer count through the `metrics` facade from
    // the moment they exist (the breaker publishes its state when it is built).
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("installing the metrics recorder: {e}"))?;
    idempotency::tower::Metrics::describe();
    HybridStore::describe_metrics();

    let Stores {
        store,
        postgres,
        hybrid,
        redis,
    } = connect(&config).await?;
    if let Some(pg) = &postgres {
        pg.migrate()
            .await
            .map_err(|e| format!("migrating the key table: {e}"))?;
        demo_migrator()
            .run(pg.pool())
            .await
            .map_err(|e| format!("migrating the charges table: {e}"))?;
    }
    let purger = idempotency::Purger::new(store.clone())
        .every(Duration::from_secs(60))
        .spawn();

    // Not the charge and order handlers' own 422: they answer a key reused after its record
    // expired, from the charges or orders table. Stored, it would bind the key to the different request and
    // refuse the retry of the one that made the charge; released, the next request asks the
    // table again. (The layer's own 422s are never stored.)
    let policy = Policy::default()
        .with_retention(config.retention)
        .with_lease(config.lease)
        .with_cacheable(|status| idempotency::default_cacheable(status) && status != 422);
    let pool = postgres.as_ref().map(|pg| pg.pool().clone());
    if config.mode == Mode::Redis && pool.is_none() {
        // Keys live in Redis, shared by every gateway; the charges do not.
        tracing::warn!(
            "charges and orders are kept in this process's memory: their record-id check does \
             not span gateways or restarts (set DATABASE_URL to keep them in Postgres)"
        );
    }
    let app = Arc::new(App {
        mode: config.mode,
        charges: match &pool {
            Some(pool) => Charges::Postgres(pool.clone()),
            None => Charges::Memory(Default::default()),
        },
        orders: match &pool {
            Some(pool) => Orders::Postgres(pool.clone(), orders::machine()),
            None => Orders::Memory(Default::default()),
        },
        pool,
        hybrid,
        redis,
        prometheus,
        allow_crash: config.allow_crash,
    });
    // An attempt that crashed between the charge and its stored outcome (its lease ran out
    // unfinished): the charge row, found by its unique record id, is the outcome.
    let layer = IdempotencyLayer::new(store.clone())
        .require_key(true)
        .scope_fn(app::scope)
        .policy(policy)
        .on_outcome_unknown(app::reconcile(app.clone()));
    let admin = config
        .admin_token
        .clone()
        .map(|token| app::admin(&layer, token));
    let router = app::router(app, layer.clone(), admin);
    let listener = tokio::net::TcpListener::bind(&config.bind).await?;
    let addr = listener.local_addr()?;
    println!(
        "payments-demo listening on http://{addr} (store: {})",
        config.mode
    );
    println!("try:");
    println!(
        "  curl -i -X POST http://{addr}/charges -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' \\"
    );
    println!("       -d '{{\"amount\": 1000, \"currency\": \"eur\", \"customer\": \"alice\"}}'");
    println!("  (send it again: same charge, Idempotent-Replayed: true; change the amount: 422)");
    println!("  curl -s http://{addr}/charges?customer=alice");

    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    // Requests whose client hung up keep running detached: let them store their outcomes.
    // Bounded: a store that stays down would keep its releases retrying.
    tracing::info!("draining in-flight operations");
    if tokio::time::timeout(Duration::from_secs(30), layer.drain())
        .await
        .is_err()
    {
        tracing::warn!("stopped before every outcome and release was stored");
    }
    purger.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down: finishing in-flight requests");
}
