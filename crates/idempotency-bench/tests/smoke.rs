//! A few seconds of every scenario against real services, so the harness never rots.
//! Asserts that everything ran and the files were written — never how fast.

use idempotency_bench::{ScaleSettings, Settings, run, run_scale};

#[test]
fn every_scenario_runs_and_the_report_is_written() {
    idempotency_test::block_on(async {
        if idempotency_test::services::skipping() {
            return;
        }
        let report = run(Settings::smoke()).await.expect("bench run");
        let groups = ["store-seq", "store-conc", "http-first", "http-replay"];
        for group in groups {
            assert!(
                report.measured.iter().any(|m| m.group == group),
                "{group} missing"
            );
        }
        for m in &report.measured {
            assert!(m.ops > 0, "{} / {} completed nothing", m.group, m.name);
        }
        assert_eq!(
            report
                .measured
                .iter()
                .filter(|m| m.group == "store-seq")
                .count(),
            12
        );
        let rounds = Settings::smoke().rounds;
        for (group, servers) in [
            ("http-first-c1", 2),
            ("http-first-abba", 6),
            ("http-first-gc", 3),
            ("http-replay-abba", 3),
        ] {
            let side_by_side: Vec<_> = report
                .measured
                .iter()
                .filter(|m| m.group == group)
                .collect();
            assert_eq!(side_by_side.len(), servers, "the servers of {group}");
            for m in side_by_side {
                assert_eq!(m.rounds.len(), rounds, "the rounds of {group} / {}", m.name);
                // Only 201s count as done: a baseline answering 409 or 422 would measure
                // something else.
                assert_eq!(m.errors, 0, "the errors of {group} / {}", m.name);
                assert!(
                    m.rounds.iter().all(|r| r.ops_per_sec > 0.0),
                    "every round of {group} / {} completed requests",
                    m.name
                );
            }
        }
        // Every side-by-side ratio is there: a round in which a side completed nothing would
        // have refused it.
        for ratio in [
            "first, side by side: layer hybrid / layer postgres",
            "first, side by side: layer hybrid (adaptive) / layer postgres",
            "first, side by side: layer redis / hand-written redis",
            "first, side by side: layer redis / hand-written redis (fenced)",
            "first, side by side: hand-written redis (fenced) / hand-written redis",
            "first, side by side: layer postgres / layer postgres (per-request)",
            "first, side by side: layer postgres (2 in flight) / layer postgres",
            "replay, side by side: layer hybrid / hand-written single GET",
            "replay, side by side: layer hybrid / hand-written replay (checked)",
            "replay, side by side: hand-written replay (checked) / hand-written single GET",
            "1 connection, p99 latency: layer postgres / per-request",
        ] {
            assert!(
                report.ratios.iter().any(|r| r.what.ends_with(ratio)
                    && r.range
                        .is_some_and(|(low, high)| low <= r.value && r.value <= high)),
                "{ratio} missing: {:?}",
                report.ratios
            );
        }
        assert!(
            report.timeline.iter().any(|b| b.redis_paused),
            "the fault timeline paused Redis"
        );
        assert!(report.timeline.iter().map(|b| b.ops).sum::<u64>() > 0);
        assert!(!report.ratios.is_empty());
        assert!(report.markdown().contains("| store-seq | postgres |"));
        let dir = std::env::temp_dir().join(format!("idempotency-bench-{}", std::process::id()));
        report.write(&dir).expect("write");
        for file in ["results.json", "throughput.png", "fault_timeline.png"] {
            let len = std::fs::metadata(dir.join(file))
                .map(|m| m.len())
                .unwrap_or(0);
            assert!(len > 0, "{file} written");
        }
    });
}

#[test]
fn the_scale_scenario_runs() {
    idempotency_test::block_on(async {
        if idempotency_test::services::skipping() {
            return;
        }
        let settings = ScaleSettings {
            rows: 30_000,
            expired: 5_000,
            concurrency: 4,
            duration: std::time::Duration::from_millis(300),
            purge_batch: 1_000,
            purge_pause: 0.5,
        };
        let (measured, ratios) = run_scale(settings).await.expect("scale run");
        for m in &measured {
            assert!(m.ops > 0, "{} / {} completed nothing", m.group, m.name);
        }
        let purge = ratios
            .iter()
            .find(|r| r.what.starts_with("purge:"))
            .expect("the purge ratio");
        assert!(purge.what.contains("5000 rows purged"), "{}", purge.what);
    });
}

/// `--help` documents every flag, and a wrong flag is a usage error (exit 2), not a run.
#[test]
fn the_cli_documents_its_flags_and_refuses_unknown_ones() {
    let bin = env!("CARGO_BIN_EXE_idempotency-bench");
    let help = std::process::Command::new(bin)
        .arg("--help")
        .output()
        .expect("run --help");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success(), "{text}");
    for flag in [
        "--smoke",
        "--concurrency",
        "--seconds",
        "--rounds",
        "--ops",
        "--out",
        "--only",
        "--scale",
        "--scale-rows",
        "--scale-expired",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
    let wrong = std::process::Command::new(bin)
        .args(["--concurrency", "0"])
        .output()
        .expect("run with a bad value");
    assert_eq!(wrong.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("--concurrency"));
}
