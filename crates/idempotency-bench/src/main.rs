//! Runs the benchmarks and writes the report.
//!
//! Run with: `cargo run --release -p idempotency-bench -- [--concurrency 32] [--seconds 5] [--rounds 5] [--smoke] [--only http-first] [--out target/bench]`
//! Scale (its own Postgres, millions of rows): `-- --scale [--scale-rows 10000000] [--scale-expired 1000000]`
//! The same on the memory store: `-- --scale-memory --scale-rows 1000000 --scale-expired 100000`
//! Every flag: `-- --help`.
#![allow(clippy::print_stdout)]

use std::{path::PathBuf, time::Duration};

use clap::Parser;
use idempotency_bench::{Report, ScaleSettings, Settings, run, run_scale, run_scale_memory};

/// The benchmarks: the stores and the HTTP layer against hand-written baselines, on real
/// Postgres and Redis containers (or the services named by IDEMPOTENCY_TEST_POSTGRES_URL /
/// IDEMPOTENCY_TEST_REDIS_URL), as ratios within one run.
#[derive(Debug, clap::Parser)]
#[command(name = "idempotency-bench", version)]
struct Cli {
    /// A short run of every scenario (what the smoke test runs).
    #[arg(long)]
    smoke: bool,
    /// Concurrent clients in the concurrent scenarios [default: 16].
    #[arg(long, env = "BENCH_CONCURRENCY", value_parser = clap::value_parser!(u64).range(1..=4096))]
    concurrency: Option<u64>,
    /// Seconds per timed scenario [default: 5].
    #[arg(long, env = "BENCH_SECONDS")]
    seconds: Option<f64>,
    /// Rounds of each side-by-side group (A B B A, each slot a quarter of --seconds); their
    /// ratios are reported as the median over rounds [default: 5].
    #[arg(long, env = "BENCH_ROUNDS", value_parser = clap::value_parser!(u64).range(1..=1000))]
    rounds: Option<u64>,
    /// Operations per sequential scenario [default: 2000].
    #[arg(long, env = "BENCH_OPS")]
    ops: Option<u64>,
    /// Where the report (results.json, charts) goes.
    #[arg(long, env = "BENCH_OUT", default_value = "target/bench")]
    out: PathBuf,
    /// Run only the groups whose name starts with this (repeatable): store-seq, store-conc,
    /// http-first, http-replay, fault.
    #[arg(long)]
    only: Vec<String>,
    /// Instead of the groups: the scale run (its own Postgres, millions of rows).
    #[arg(long)]
    scale: bool,
    /// The scale run on the memory store instead of Postgres (no containers).
    #[arg(long)]
    scale_memory: bool,
    /// Rows in the table for the scale run [default: 10000000]; implies --scale.
    #[arg(long)]
    scale_rows: Option<u64>,
    /// Expired rows among them, for the purge [default: 1000000]; implies --scale.
    #[arg(long)]
    scale_expired: Option<u64>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    // The library's warnings (a store failing under load) go to stderr; RUST_LOG filters.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut settings = if cli.smoke {
        Settings::smoke()
    } else {
        Settings::full()
    };
    if let Some(c) = cli.concurrency {
        settings.concurrency = usize::try_from(c)?;
    }
    if let Some(seconds) = cli.seconds {
        settings.duration = Duration::try_from_secs_f64(seconds)
            .map_err(|e| format!("--seconds {seconds}: {e}"))?;
    }
    if let Some(rounds) = cli.rounds {
        settings.rounds = usize::try_from(rounds)?;
    }
    if let Some(ops) = cli.ops {
        settings.sequential_ops = ops;
    }
    settings.only = cli.only;
    let out = cli.out;
    let scale =
        (cli.scale || cli.scale_memory || cli.scale_rows.is_some() || cli.scale_expired.is_some())
            .then(|| {
                let mut scale = ScaleSettings::default();
                if let Some(rows) = cli.scale_rows {
                    scale.rows = rows;
                }
                if let Some(expired) = cli.scale_expired {
                    scale.expired = expired;
                }
                scale
            });
    if let Some(scale) = scale {
        let (measured, ratios) = if cli.scale_memory {
            idempotency_test::block_on(run_scale_memory(scale))?
        } else {
            idempotency_test::block_on(run_scale(scale))?
        };
        let report = Report {
            settings: serde_json::json!({
                "store": if cli.scale_memory { "memory" } else { "postgres" },
                "rows": scale.rows,
                "expired": scale.expired,
                "concurrency": scale.concurrency,
                "duration_ms": scale.duration.as_millis() as u64,
                "purge_batch": scale.purge_batch,
                "purge_pause": scale.purge_pause,
            }),
            measured,
            ratios,
            timeline: Vec::new(),
        };
        println!("{}", report.markdown());
        std::fs::create_dir_all(&out)?;
        let file = if cli.scale_memory {
            "scale-memory.json"
        } else {
            "scale.json"
        };
        std::fs::write(out.join(file), serde_json::to_vec_pretty(&report)?)?;
        println!("wrote {}/{file}", out.display());
        return Ok(());
    }
    // The harness's runtime: its containers and pools live on it.
    let report = idempotency_test::block_on(run(settings))?;
    println!("{}", report.markdown());
    report.write(&out)?;
    println!(
        "wrote {}/results.json, throughput.png, fault_timeline.png",
        out.display()
    );
    Ok(())
}
