//! `payments-demo admin`: the operator's tools, run against the store itself (the server's
//! `/admin` routes do the same over HTTP).

use std::{process::ExitCode, time::Duration};

use idempotency::{ForceReleased, IdempotencyKey, RecordId, ReleaseScope, Scope};

use crate::config::{Config, Mode};

/// Which record: the account (the demo's scope, its `X-Account-Id`) and the key.
#[derive(Debug, clap::Args)]
pub(crate) struct Record {
    /// The account the key belongs to (the `X-Account-Id` of its requests; `anonymous`
    /// when they sent none).
    #[arg(long)]
    scope: String,
    /// The `Idempotency-Key` value.
    #[arg(long)]
    key: String,
}

#[derive(Debug, clap::Subcommand)]
pub(crate) enum Command {
    /// Prints the key's record as JSON; exits 1 when there is none.
    Inspect(Record),
    /// Releases the key's in-flight record whose lease ran out (its holder's late completion
    /// is refused), so the next request runs as new, not as "outcome unknown": check first
    /// whether that attempt took effect. Exits 1 when there is none, or its lease is live and
    /// --live was not given, or it is completed and --completed was not given.
    Release {
        #[command(flatten)]
        record: Record,
        /// Release a live lease too. Its holder may still be running the charge, which then
        /// runs twice: only for a holder you know is stuck.
        #[arg(long)]
        live: bool,
        /// Delete a completed record too: the key then runs again on its next request.
        #[arg(long)]
        completed: bool,
    },
}

pub(crate) async fn main(command: Command) -> ExitCode {
    match run(command).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("payments-demo admin: {error}");
            ExitCode::from(2)
        }
    }
}

async fn run(command: Command) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let config = Config::from_env()?;
    if config.mode == Mode::Memory {
        return Err(
            "the memory store lives inside the server process: set DATABASE_URL and/or \
                    REDIS_URL, or use the server's /admin routes (ADMIN_TOKEN)"
                .into(),
        );
    }
    let stores = crate::connect(&config).await?;
    let store = stores.store;
    let named = |record: &Record| -> Result<(IdempotencyKey, RecordId), String> {
        // Read as the layer reads the header: `"order-42"`, copied from a request log, is
        // the key `order-42`.
        let key = idempotency::tower::parse_key(record.key.as_bytes())
            .map_err(|e| format!("--key {:?}: {e}", record.key))?;
        let id = RecordId::new(&Scope::new(record.scope.clone()), &key);
        Ok((key, id))
    };
    match command {
        Command::Inspect(record) => {
            let (key, id) = named(&record)?;
            match store.inspect(&id).await? {
                Some(found) => {
                    let view = idempotency::tower::record_view(&record.scope, &key, &id, &found);
                    println!("{view}");
                    Ok(ExitCode::SUCCESS)
                }
                None => {
                    eprintln!("no live record for this scope and key");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::Release {
            record,
            live,
            completed,
        } => {
            let (_, id) = named(&record)?;
            let mut scope = ReleaseScope::default();
            if live {
                scope = scope.with_live();
            }
            if completed {
                scope = scope.with_completed();
            }
            let released = store.force_release(&id, scope).await;
            // The hybrid store deletes its Redis copy again once copies on their way have
            // landed: exiting before that could leave one replaying a released record. So
            // too after an error: Postgres may have deleted the record all the same.
            if tokio::time::timeout(Duration::from_secs(30), store.drain())
                .await
                .is_err()
            {
                match stores.hybrid.as_ref() {
                    Some(hybrid) => eprintln!(
                        "warning: the release's last Redis delete did not finish within 30 s: \
                         Redis may still hold a copy of the record, which would replay it; once \
                         Redis answers, delete it with `DEL {}` (a copy is only a cache: \
                         deleting it never runs anything)",
                        hybrid.redis().key(&id)
                    ),
                    None => eprintln!(
                        "warning: the store's background writes did not finish within 30 s"
                    ),
                }
            }
            Ok(match released? {
                ForceReleased::Released => {
                    println!(
                        "released: the in-flight record is gone, the next request runs as new \
                         (if the earlier attempt took effect, it takes effect twice)"
                    );
                    ExitCode::SUCCESS
                }
                ForceReleased::Deleted => {
                    println!("deleted: the completed record is gone, the next request runs again");
                    ExitCode::SUCCESS
                }
                ForceReleased::Live => {
                    eprintln!(
                        "the record's lease is live (its holder is running the charge): pass \
                         --live to release it only if you know the holder is stuck"
                    );
                    ExitCode::FAILURE
                }
                ForceReleased::Completed => {
                    eprintln!(
                        "the record is completed (its outcome replays): pass --completed to delete it"
                    );
                    ExitCode::FAILURE
                }
                ForceReleased::Absent => {
                    eprintln!("no live record for this scope and key");
                    ExitCode::FAILURE
                }
                other => {
                    eprintln!("unexpected answer {other:?}");
                    ExitCode::FAILURE
                }
            })
        }
    }
}
