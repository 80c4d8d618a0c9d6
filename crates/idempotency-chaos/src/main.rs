//! `idempotency-chaos`: a seeded fault campaign against the real thing.
//!
//! It starts Postgres and Redis (the test harness's containers, or URLs you give), N
//! payments-demo gateways in hybrid mode — one of them under `faketime`, its clock ten minutes
//! off — and nginx in front with `proxy_next_upstream error timeout non_idempotent` and a
//! short upstream timeout, so nginx itself retries a slow charge on the other gateway. Clients
//! send charges through nginx, each with one key and retries on it; some hang up mid-request,
//! and some requests wait between their charge and their answer (`X-Demo-Delay-After-Ms`).
//! On a schedule drawn from the seed it injects: Redis SIGSTOP/SIGCONT, kill and restart,
//! `FLUSHALL` and `CLIENT PAUSE`; Postgres stop and start, and frozen past the lease; a
//! gateway SIGKILLed and restarted; a gateway stopped by SIGTERM (it must drain and exit
//! cleanly) and restarted; a gateway SIGSTOPped past the lease and resumed, a zombie whose
//! charges were taken over.
//!
//! It records every attempt (key, attempt, status, charge id) and checks the history against
//! the charges table: **duplicates** (two charges for one key, or the charge handler run
//! twice for one key, as the demo counts it in `charges.runs`), **lost** (a 2xx whose charge
//! is not in the table; a charge the demo's reconcile hook answered with, `charges.reconciled`,
//! that no fault stranding one explains, nor a stall of the host), **wrong** (a 2xx carrying
//! another key's charge, another status or body than the key's first 2xx, or a 422), **stuck**
//! (a key whose final probe, one lease after the last fault, gets no 2xx; or one answered 409
//! on end for more than two leases that no fault explains: a client follows a run of 409s
//! past that, told by the fault schedule until when its faults explain one). Every key is probed twice: then again with Redis emptied, answered from
//! Postgres alone. Before the probes, every key answered a 2xx must be completed in Postgres'
//! own table with that answer (**lost** if not, **wrong** if with another): a probe would
//! have the demo's reconcile hook rebuild it. A gateway that exits on its own fails the
//! campaign. The last line is
//!
//! ```text
//! chaos: seed=<s> duration=<d>s requests=<n> faults=<f> duplicates=<d> lost=<l> wrong=<w> stuck=<k>
//! ```
//!
//! and the exit status is 0 only when the last four are 0.

// A command-line tool: its report is its standard output.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod cluster;
mod drive;
mod faults;
mod http;

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::Parser;

/// How long an outcome answered while its store was down may take to be written once every
/// fault is cleared (the layer retries it in the background, at most 5 s apart).
const SETTLE: Duration = Duration::from_secs(30);

/// A seeded fault campaign: payments-demo gateways behind nginx on real Postgres and Redis.
#[derive(Debug, Clone, Parser)]
#[command(version, about, long_about = None)]
struct Args {
    /// Seed of the fault schedule and the clients' choices (printed on the last line).
    #[arg(long, env = "CHAOS_SEED", default_value_t = 1)]
    seed: u64,
    /// How long clients send new charges, in seconds (then the faults stop and the history
    /// is settled and checked).
    #[arg(long, default_value_t = 60)]
    duration_s: u64,
    /// How many payments-demo gateways nginx balances over (the second runs under faketime).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=8))]
    gateways: u16,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// The gateways' idempotency lease (`IDEMPOTENCY_LEASE_MS`), in milliseconds.
    #[arg(long, default_value_t = 3000)]
    lease_ms: u64,
    /// Use this Postgres instead of starting a container (Postgres faults are then skipped).
    #[arg(long, env = "CHAOS_POSTGRES_URL")]
    postgres_url: Option<String>,
    /// Use this Redis instead of starting a container (Redis faults are then skipped).
    #[arg(long, env = "CHAOS_REDIS_URL")]
    redis_url: Option<String>,
    /// The payments-demo binary (default: next to this one; `cargo build -p payments-demo`).
    #[arg(long, env = "CHAOS_DEMO_BIN")]
    demo_bin: Option<PathBuf>,
    /// Where logs and the nginx configuration go (default: `target/chaos/<seed>`).
    #[arg(long)]
    work_dir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("chaos: {error}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<bool, String> {
    let lease = Duration::from_millis(args.lease_ms);
    let mut cluster = cluster::Cluster::start(&args).await?;
    println!(
        "chaos: seed={} gateways={} (gateway 2 under faketime {}) nginx={} postgres={} redis={}",
        args.seed,
        args.gateways,
        cluster.skew_label(),
        cluster.nginx_url(),
        cluster.postgres_url(),
        cluster.redis_url()
    );
    let explained = faults::Explained::new();
    let stalls = faults::StallWatch::start();
    let drive = drive::Driver::new(&args, &cluster.nginx_url(), explained.clone());
    let duration = Duration::from_secs(args.duration_s);
    let run = drive.run(duration);
    let faults = faults::run(&mut cluster, args.seed, duration, &explained, run).await;
    let (history, windows, faults) = faults?;
    // Every fault is cleared; wait one lease past the last one, then ask every key again.
    tokio::time::sleep(lease + Duration::from_secs(1)).await;
    let before_probes = drive::runs_before_probes(&history, cluster.postgres_url()).await?;
    // Before any probe: a probe of a record left unsettled would settle it (the reconcile hook).
    let (unsettled, kept_otherwise) =
        drive::outcomes_kept(&history, drive.scope(), cluster.postgres_url(), SETTLE).await?;
    let mut probes = drive.probe_all(&history).await;
    // Those may have been answered from Redis' copies: Redis emptied, every key is asked
    // again, answered from Postgres alone — its stored outcome, the same body, no run.
    if cluster.redis.is_some() {
        faults::redis_command(cluster.redis_url(), &["FLUSHALL"]).await?;
        probes.extend(drive.probe_all(&history).await);
    }
    cluster.gateways_alive()?;
    let reached = cluster.keys_reached()?;
    let mut windows = windows;
    windows.extend(stalls.stop());
    let mut report = drive::check(
        &history,
        &probes,
        &before_probes,
        &reached,
        &windows,
        lease,
        cluster.postgres_url(),
    )
    .await?;
    cluster.stop().await;
    report.lost += unsettled;
    report.wrong += kept_otherwise;
    println!(
        "{} outcomes-not-in-postgres={unsettled} outcomes-stored-otherwise={kept_otherwise}",
        report.details
    );
    let clean =
        report.duplicates == 0 && report.lost == 0 && report.wrong == 0 && report.stuck == 0;
    println!(
        "chaos: seed={} duration={}s requests={} faults={} duplicates={} lost={} wrong={} stuck={}",
        args.seed,
        args.duration_s,
        report.requests,
        faults,
        report.duplicates,
        report.lost,
        report.wrong,
        report.stuck
    );
    Ok(clean)
}
