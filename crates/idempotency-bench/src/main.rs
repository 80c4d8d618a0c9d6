//! Runs the benchmarks and writes the report.
//!
//! Run with: `cargo run --release -p idempotency-bench -- [--concurrency 32] [--seconds 5] [--smoke] [--only http-first] [--out target/bench]`
#![allow(clippy::print_stdout)]

use std::{path::PathBuf, time::Duration};

use idempotency_bench::{Settings, run};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut settings = Settings::full();
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
            other => return Err(format!("unknown flag {other:?}").into()),
        }
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
