//! Runs the benchmarks and writes the report.
//!
//! Run with: `cargo run --release -p idempotency-bench -- [--concurrency 32] [--seconds 5] [--smoke] [--only http-first] [--out target/bench]
//! Scale (its own Postgres, millions of rows): `-- --scale [--scale-rows 10000000] [--scale-expired 1000000]``
#![allow(clippy::print_stdout)]

use std::{path::PathBuf, time::Duration};

use idempotency_bench::{Report, ScaleSettings, Settings, run, run_scale};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut settings = Settings::full();
    let mut scale: Option<ScaleSettings> = None;
    let mut out = PathBuf::from("target/bench");
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--smoke" => settings = Settings::smoke(),
            "--concurrency" => settings.concurrency = value()?.parse()?,
            "--seconds" => settings.duration = Duration::from_secs_f64(value()?.parse()?),
            "--ops" => settings.sequential_ops = value()?.parse()?,
            "--out" => out = PathBuf::from(value()?),
            "--only" => settings.only.push(value()?),
            "--scale" => scale = Some(scale.unwrap_or_default()),
            "--scale-rows" => {
                scale.get_or_insert_with(ScaleSettings::default).rows = value()?.parse()?;
            }
            "--scale-expired" => {
                scale.get_or_insert_with(ScaleSettings::default).expired = value()?.parse()?;
            }
            other => return Err(format!("unknown flag {other:?}").into()),
        }
    }
    if let Some(scale) = scale {
        let (measured, ratios) = idempotency_test::block_on(run_scale(scale))?;
        let report = Report {
            settings: serde_json::json!({
                "rows": scale.rows,
                "expired": scale.expired,
                "concurrency": scale.concurrency,
                "duration_ms": scale.duration.as_millis() as u64,
                "purge_batch": scale.purge_batch,
            }),
            measured,
            ratios,
            timeline: Vec::new(),
        };
        println!("{}", report.markdown());
        std::fs::create_dir_all(&out)?;
        std::fs::write(out.join("scale.json"), serde_json::to_vec_pretty(&report)?)?;
        println!("wrote {}/scale.json", out.display());
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
