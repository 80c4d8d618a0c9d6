//! `payments-demo storm`: the seed's lost-response scenario, many times over.
//!
//! Fires N logical charges at a running demo, each sent M times with one key: the first two
//! sends at once (a double-click, a proxy's `proxy_next_upstream`), the rest one after the
//! other. Every third charge asks the handler to take longer than the client waits
//! (`X-Demo-Delay-Ms` > `--client-timeout-ms`), so the client hangs up and retries while the
//! server is still charging. Then it reads the charges the demo recorded: each charge's
//! amount (`100 + i`, one per key) exactly once, and no wrong answer, or the exit status
//! says otherwise (a charge made twice and one never made do not cancel out).
//!
//! The table counts each send in one column: *executed (fresh 201)* a 201 without
//! `Idempotent-Replayed`; *replayed* a 201 the layer replayed; *ran again (200)* the 200 the
//! demo's handler answers when it runs a second time for a record id (its charge's unique
//! record id turns the second run into a read): the layer let it run again, which only a
//! record past its retention (`IDEMPOTENCY_RETENTION_MS`, a day by default) excuses, so it
//! fails the storm (`ran_again=` on the last line); *409 in flight* a send while another with the key ran;
//! *timed out* the client hung up; *errors* any other answer, or a failed connection. Of the
//! errors, a 502, 503 or 504 (a server or its proxy unavailable: a client retries it) or a
//! failed connection is not wrong; any other answer is (`wrong=` on the last line: a 422
//! for the one body the key was sent with, a 500, a 200 that does not say it replays).

use std::{
    process::ExitCode,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use indicatif::{ProgressBar, ProgressStyle};

use crate::client::{self, Failure};

/// Fires N logical charges at a running demo, each sent M times with one key, then checks
/// that the demo recorded each charge once and answered nothing wrong (exit status 0), or
/// says what it found.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The demo's base URL (plain HTTP/1.1), e.g. http://127.0.0.1:3000.
    #[arg(long, env = "STORM_URL")]
    url: String,
    /// Logical charges (distinct idempotency keys): at most 10,000, as many as the demo's
    /// `GET /charges` lists.
    #[arg(long, env = "STORM_CHARGES", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    charges: u64,
    /// Sends per charge, all with the charge's key (the first two at once).
    #[arg(long, env = "STORM_SENDS", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..))]
    sends: u64,
    /// How long the client waits for an answer before it hangs up and retries; every third
    /// charge asks the handler to take longer than this.
    #[arg(long = "client-timeout-ms", env = "STORM_CLIENT_TIMEOUT_MS", default_value_t = 500,
          value_parser = clap::value_parser!(u64).range(1..))]
    client_timeout_ms: u64,
    /// Logical charges in flight at once.
    #[arg(long, env = "STORM_CONCURRENCY", default_value_t = 32,
          value_parser = clap::value_parser!(u64).range(1..=65_536))]
    concurrency: u64,
}

#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    executed: AtomicU64,
    replayed: AtomicU64,
    ran_again: AtomicU64,
    conflicts: AtomicU64,
    timed_out: AtomicU64,
    errors: AtomicU64,
    /// Of the errors, the answers no retry of this storm should get (see [`Answer::Wrong`]).
    wrong: AtomicU64,
}

pub(crate) async fn main(args: Args) -> ExitCode {
    let client_timeout = Duration::from_millis(args.client_timeout_ms);
    let concurrency = usize::try_from(args.concurrency).unwrap_or(1);
    let authority = match client::authority(&args.url) {
        Ok(a) => a,
        Err(error) => {
            eprintln!("storm: {error}");
            return ExitCode::from(2);
        }
    };
    let run = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let customer = format!("storm-{run}");
    let tally = Arc::new(Tally::default());
    let progress = ProgressBar::new(args.charges);
    progress.set_style(
        ProgressStyle::with_template("{spinner} storm [{bar:40}] {pos}/{len} charges {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let limit = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..args.charges {
        let permit = limit.clone().acquire_owned().await;
        let (tally, authority, customer, progress) = (
            tally.clone(),
            authority.clone(),
            customer.clone(),
            progress.clone(),
        );
        let (sends, timeout) = (args.sends, client_timeout);
        let key = format!("storm-{run}-{i}");
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            logical_charge(&authority, &key, &customer, i, sends, timeout, &tally).await;
            progress.inc(1);
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    progress.finish_with_message(format!("in {:.1?}", started.elapsed()));

    // Slow charges may still be running server-side: wait for them, then for the list to
    // settle.
    let recorded = settle(&authority, &customer, args.charges, client_timeout).await;
    let t = |c: &AtomicU64| c.load(Ordering::Relaxed);
    println!();
    println!(
        "| requests sent | executed (fresh 201) | replayed | ran again (200) | 409 in flight | timed out | errors | charges recorded |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {} | {} | {} | {} | {} | {} | {} |",
        t(&tally.sent),
        t(&tally.executed),
        t(&tally.replayed),
        t(&tally.ran_again),
        t(&tally.conflicts),
        t(&tally.timed_out),
        t(&tally.errors),
        recorded.map_or_else(|| "?".into(), |v| v.recorded.to_string())
    );
    println!();
    match recorded {
        Some(v) => {
            let (wrong, ran_again) = (t(&tally.wrong), t(&tally.ran_again));
            println!(
                "recorded={} expected={} duplicated={} missing={} ran_again={ran_again} wrong={wrong}",
                v.recorded, args.charges, v.duplicated, v.missing
            );
            if v.exact() && wrong == 0 && ran_again == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        None => {
            println!(
                "recorded=? expected={} wrong={}",
                args.charges,
                t(&tally.wrong)
            );
            ExitCode::FAILURE
        }
    }
}

/// What the demo recorded against what the storm sent: charge `i` is the one charge of
/// amount `100 + i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Verdict {
    recorded: u64,
    /// Charges recorded more than once (each extra record counts).
    duplicated: u64,
    /// Charges never recorded.
    missing: u64,
}

impl Verdict {
    fn of(amounts: &[i64], expected: u64) -> Self {
        let mut seen = vec![0u64; usize::try_from(expected).unwrap_or(usize::MAX)];
        let mut duplicated = 0;
        for &amount in amounts {
            let slot = usize::try_from(amount - 100)
                .ok()
                .and_then(|i| seen.get_mut(i));
            match slot {
                Some(count) => {
                    duplicated += u64::from(*count > 0);
                    *count += 1;
                }
                None => duplicated += 1, // an amount the storm never sent
            }
        }
        Self {
            recorded: amounts.len() as u64,
            duplicated,
            missing: seen.iter().filter(|&&n| n == 0).count() as u64,
        }
    }

    fn exact(&self) -> bool {
        self.duplicated == 0 && self.missing == 0
    }
}

/// Which column of the table an answer to `POST /charges` counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// A fresh 201: the charge ran now.
    Executed,
    /// The charge it made before, a 201 the layer replayed.
    Replayed,
    /// A 200 with `Idempotent-Replayed`: the handler ran a second time and found the charge
    /// its record id made (the unique record id keeps it single). The charge table cannot
    /// show that run; this can.
    RanAgain,
    /// 409: another send with the key is running.
    InFlight,
    /// 502, 503, 504: the server, or a proxy in front of it, could not answer now; a client
    /// retries with the same key.
    Unavailable,
    /// Anything else, a 200 without `Idempotent-Replayed` included: every send of a charge
    /// carries the same body and headers, so a 422 (another request under the key), a 400 or
    /// a 500 says the server got something wrong.
    Wrong,
}

/// Classifies one answer by its status and whether it carried `Idempotent-Replayed`.
fn classify(status: u16, replayed: bool) -> Answer {
    match (status, replayed) {
        (201, true) => Answer::Replayed,
        (200, true) => Answer::RanAgain,
        (201, false) => Answer::Executed,
        (409, _) => Answer::InFlight,
        (502..=504, _) => Answer::Unavailable,
        _ => Answer::Wrong,
    }
}

async fn logical_charge(
    authority: &str,
    key: &str,
    customer: &str,
    i: u64,
    sends: u64,
    timeout: Duration,
    tally: &Tally,
) {
    let slow = i.is_multiple_of(3);
    let delay_ms = if slow {
        timeout.as_millis() as u64 + 250
    } else {
        (i % 5) * 20
    };
    let body = format!(
        r#"{{"amount": {}, "currency": "eur", "customer": "{customer}"}}"#,
        100 + i
    );
    let headers = [
        ("idempotency-key", key.to_owned()),
        ("content-type", "application/json".to_owned()),
        ("x-account-id", "storm-account".to_owned()),
        ("x-demo-delay-ms", delay_ms.to_string()),
    ];
    let send = || async {
        tally.sent.fetch_add(1, Ordering::Relaxed);
        match client::request(authority, "POST", "/charges", &headers, &body, timeout).await {
            Ok(reply) => {
                let replayed = reply.header("idempotent-replayed").is_some();
                match classify(reply.status, replayed) {
                    Answer::Executed => &tally.executed,
                    Answer::Replayed => &tally.replayed,
                    Answer::RanAgain => {
                        tracing::warn!(body = %reply.body, "the handler ran a second time");
                        &tally.ran_again
                    }
                    Answer::InFlight => &tally.conflicts,
                    Answer::Unavailable => {
                        tracing::warn!(status = reply.status, body = %reply.body, "unavailable");
                        &tally.errors
                    }
                    Answer::Wrong => {
                        tracing::warn!(status = reply.status, body = %reply.body, "wrong answer");
                        tally.wrong.fetch_add(1, Ordering::Relaxed);
                        &tally.errors
                    }
                }
            }
            Err(Failure::TimedOut) => &tally.timed_out,
            Err(Failure::Io(error)) => {
                tracing::warn!(%error, "request failed");
                &tally.errors
            }
        }
        .fetch_add(1, Ordering::Relaxed);
    };
    let burst = sends.min(2);
    futures::future::join_all((0..burst).map(|_| send())).await;
    for _ in burst..sends {
        tokio::time::sleep(Duration::from_millis(50)).await;
        send().await;
    }
}

/// Reads the customer's charges until every one is there once, or until a deadline: first
/// past the longest a handler may still run (a slow charge whose client hung up as the
/// storm ended), so that a late duplicate is seen.
async fn settle(
    authority: &str,
    customer: &str,
    expected: u64,
    timeout: Duration,
) -> Option<Verdict> {
    tokio::time::sleep(timeout + Duration::from_millis(500)).await;
    let deadline = Instant::now() + timeout + Duration::from_secs(5);
    let mut last = None;
    loop {
        let path = format!("/charges?customer={customer}");
        if let Ok(reply) =
            client::request(authority, "GET", &path, &[], "", Duration::from_secs(5)).await
        {
            last = serde_json::from_str::<serde_json::Value>(&reply.body)
                .ok()
                .and_then(|v| {
                    v["data"]
                        .as_array()?
                        .iter()
                        .map(|charge| charge["amount"].as_i64())
                        .collect::<Option<Vec<i64>>>()
                })
                .map(|amounts| Verdict::of(&amounts, expected));
        }
        if last.is_some_and(|v| v.exact()) || Instant::now() > deadline {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::{Answer, Verdict, classify};

    /// A charge made twice and one never made leave the count right: the verdict is by
    /// charge.
    #[test]
    fn a_duplicate_and_a_missing_charge_do_not_cancel_out() {
        let v = Verdict::of(&[100, 101, 101], 3);
        assert_eq!(
            v,
            Verdict {
                recorded: 3,
                duplicated: 1,
                missing: 1
            }
        );
        assert!(!v.exact());
        assert!(Verdict::of(&[102, 100, 101], 3).exact());
        assert!(!Verdict::of(&[100, 101, 102, 7], 3).exact(), "a stranger");
    }

    /// The demo's 200 is its handler's second run: counted apart, and failing the storm.
    /// Before, it counted as a replay, and a layer that ran every retry again passed.
    #[test]
    fn a_second_run_is_not_a_replay() {
        assert_eq!(classify(200, true), Answer::RanAgain);
    }

    #[test]
    fn the_other_columns_keep_their_meaning() {
        assert_eq!(classify(201, false), Answer::Executed);
        assert_eq!(classify(201, true), Answer::Replayed);
        assert_eq!(classify(409, false), Answer::InFlight);
        assert_eq!(classify(409, true), Answer::InFlight);
        // A 200 that does not say it replays is not a charge the storm can account for.
        for status in [502, 503, 504] {
            assert_eq!(classify(status, false), Answer::Unavailable, "{status}");
        }
        for (status, replayed) in [(200, false), (422, false), (400, false), (500, true)] {
            assert_eq!(
                classify(status, replayed),
                Answer::Wrong,
                "{status} {replayed}"
            );
        }
    }
}
