//! The clients, the history they record, and the check of that history against the charges
//! table.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::Duration,
};

use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::time::Instant;

use crate::{
    Args,
    faults::Excuse,
    http::{self, NoReply},
};

/// One charge: its key and what it was created from. Every key has its own customer, so the
/// charges table says which key a charge belongs to.
#[derive(Debug, Clone)]
pub(crate) struct Charge {
    key: String,
    customer: String,
    amount: u32,
}

/// One request of the history.
#[derive(Debug, Clone)]
pub(crate) struct Attempt {
    charge: usize,
    attempt: u32,
    sent: Instant,
    answered: Instant,
    answer: Result<u16, NoReply>,
    /// `Idempotent-Replayed: true`.
    replayed: bool,
    /// The charge id of a 2xx.
    charge_id: Option<String>,
    /// The body of a 2xx, as JSON (`Null` when it is not JSON): every 2xx of one key must
    /// carry the same charge, as it was asked for.
    body: Option<serde_json::Value>,
}

#[derive(Debug, Default)]
pub(crate) struct History {
    charges: Vec<Charge>,
    attempts: Vec<Attempt>,
}

pub(crate) struct Driver {
    addr: String,
    seed: u64,
    clients: usize,
    lease: Duration,
    /// The scope of this run's keys (`X-Account-Id`) and its customers' prefix.
    run: String,
    /// Until when the faults explain a 409 (see [`crate::faults::Explained`]).
    explained: crate::faults::Explained,
}

/// The most attempts on one key; a key still without a definitive answer is left to the final
/// probe. Unless it answers 409: see [`gives_up`].
const MAX_ATTEMPTS: u32 = 15;

/// Whether a client stops retrying a key after `attempts`, its answers 409 without a break
/// since `in_flight_since` (`None`: the last answer was not a 409), faults explaining 409s
/// until `explained_until` (a lease after the last one ended; later while one is on). A run
/// of 409s is followed for more than [`STUCK_AFTER_LEASES`] leases past what explains it,
/// as [`in_flight_streaks`] counts, so that a key stuck that long is seen stuck even if it
/// is freed before the final probe: fifteen attempts 100–500 ms apart last about four
/// seconds, under two leases, and that check could never fire. Bounded all the same (a key
/// stuck for good is the probe's to find).
fn gives_up(
    attempts: u32,
    in_flight_since: Option<Instant>,
    explained_until: Instant,
    lease: Duration,
) -> bool {
    const MOST: u32 = 10_000;
    let following = in_flight_since.is_some_and(|since| {
        Instant::now() <= since.max(explained_until) + lease * (STUCK_AFTER_LEASES + 1)
    });
    attempts >= MOST || (attempts >= MAX_ATTEMPTS && !following)
}

impl Driver {
    /// The scope (`X-Account-Id`) of this run's keys.
    pub(crate) fn scope(&self) -> &str {
        &self.run
    }

    pub(crate) fn new(args: &Args, nginx_url: &str, explained: crate::faults::Explained) -> Self {
        let run = format!(
            "chaos-{}-{}",
            args.seed,
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        Self {
            addr: nginx_url.trim_start_matches("http://").to_owned(),
            seed: args.seed,
            clients: args.clients,
            lease: Duration::from_millis(args.lease_ms),
            run,
            explained,
        }
    }

    /// Clients send new charges for `duration`, each retried on its key until it has a
    /// definitive answer; then the history.
    pub(crate) async fn run(&self, duration: Duration) -> History {
        let started = Instant::now();
        let clients = (0..self.clients).map(|c| self.client(c, started, duration));
        let mut history = History::default();
        for (charges, attempts) in futures_join_all(clients).await {
            let offset = history.charges.len();
            history.charges.extend(charges);
            history.attempts.extend(attempts.into_iter().map(|mut a| {
                a.charge += offset;
                a
            }));
        }
        history
    }

    async fn client(
        &self,
        c: usize,
        started: Instant,
        duration: Duration,
    ) -> (Vec<Charge>, Vec<Attempt>) {
        let mut rng = StdRng::seed_from_u64(self.seed.wrapping_mul(1_000_003) + c as u64);
        let (mut charges, mut attempts) = (Vec::new(), Vec::new());
        while started.elapsed() < duration {
            let n = charges.len();
            let charge = Charge {
                key: format!("{}-{c}-{n}", self.run),
                customer: format!("{}-{c}-{n}", self.run),
                amount: rng.random_range(1..100_000),
            };
            let mut in_flight_since = None;
            for attempt in 1.. {
                // Most requests are quick; some are slower than nginx's upstream timeout (it
                // then retries them on the other gateway), and some clients hang up.
                let delay = match rng.random_range(0..10) {
                    0..7 => 0,
                    7..9 => rng.random_range(50..400),
                    _ => 1_200,
                };
                // And some wait after their charge, before their outcome is stored: the
                // window a fault must hit for the reconcile hook, late completions and
                // fencing to matter (a fault before the charge only makes a plain rerun).
                let delay_after = if rng.random_range(0..10) < 2 {
                    rng.random_range(50..400)
                } else {
                    0
                };
                let timeout = if rng.random_range(0..10) == 0 {
                    Duration::from_millis(rng.random_range(50..1_000))
                } else {
                    Duration::from_secs(8)
                };
                // And some meet a processor that fails before charging (`X-Demo-Fail: 503`):
                // a 5xx is not stored, so the key runs again on its next attempt, and no
                // later answer may replay that 503.
                let fail = rng.random_range(0..20) == 0;
                let sent = Instant::now();
                let answer = self
                    .send(&charge, (delay, delay_after), fail, timeout)
                    .await;
                let done = matches!(&answer, Ok(reply) if (200..300).contains(&reply.status) || reply.status == 422);
                let pause = match &answer {
                    Ok(reply) if reply.status == 409 => Duration::from_millis(
                        rng.random_range(100..500).min(
                            reply
                                .header("retry-after")
                                .and_then(|s| s.parse::<u64>().ok())
                                .map_or(500, |s| s * 1000),
                        ),
                    ),
                    _ => Duration::from_millis(rng.random_range(100..400)),
                };
                let in_flight = matches!(&answer, Ok(reply) if reply.status == 409);
                in_flight_since = in_flight.then(|| in_flight_since.unwrap_or(sent));
                attempts.push(record(n, attempt, sent, answer));
                let explained_until = self.explained.until();
                if done || gives_up(attempt, in_flight_since, explained_until, self.lease) {
                    break;
                }
                tokio::time::sleep(pause).await;
            }
            charges.push(charge);
        }
        (charges, attempts)
    }

    async fn send(
        &self,
        charge: &Charge,
        (delay_ms, delay_after_ms): (u64, u64),
        fail: bool,
        timeout: Duration,
    ) -> Result<http::Reply, NoReply> {
        let body = format!(
            r#"{{"amount": {}, "currency": "eur", "customer": "{}"}}"#,
            charge.amount, charge.customer
        );
        let mut headers = vec![
            ("idempotency-key", charge.key.clone()),
            ("x-account-id", self.run.clone()),
            ("content-type", "application/json".to_owned()),
        ];
        if delay_ms > 0 {
            headers.push(("x-demo-delay-ms", delay_ms.to_string()));
        }
        if delay_after_ms > 0 {
            headers.push(("x-demo-delay-after-ms", delay_after_ms.to_string()));
        }
        if fail {
            headers.push(("x-demo-fail", "503".to_owned()));
        }
        http::send(&self.addr, "POST", "/charges", &headers, &body, timeout).await
    }

    /// One more request per key, after every fault has been cleared for a lease: a 409 now
    /// is a key stuck past its lease.
    pub(crate) async fn probe_all(&self, history: &History) -> Vec<Attempt> {
        let mut probes = Vec::new();
        for batch in history.charges.chunks(16).enumerate() {
            let (b, charges) = batch;
            let sends = charges.iter().enumerate().map(|(i, charge)| async move {
                let sent = Instant::now();
                let answer = self.send(charge, (0, 0), false, self.lease * 2).await;
                record(b * 16 + i, 0, sent, answer)
            });
            probes.extend(futures_join_all(sends).await);
        }
        probes
    }
}

fn record(
    charge: usize,
    attempt: u32,
    sent: Instant,
    answer: Result<http::Reply, NoReply>,
) -> Attempt {
    let replayed = matches!(&answer, Ok(r) if r.header("idempotent-replayed") == Some("true"));
    let body = match &answer {
        Ok(reply) if (200..300).contains(&reply.status) => Some(
            serde_json::from_str::<serde_json::Value>(&reply.body)
                .unwrap_or(serde_json::Value::Null),
        ),
        _ => None,
    };
    let charge_id = body
        .as_ref()
        .and_then(|v| v["id"].as_str().map(str::to_owned));
    Attempt {
        charge,
        attempt,
        sent,
        answered: Instant::now(),
        answer: answer.map(|r| r.status),
        replayed,
        charge_id,
        body,
    }
}

/// Joins futures on the current task, in order.
async fn futures_join_all<F: std::future::Future>(
    futures: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    let mut set: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = (0..set.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, future) in set.iter_mut().enumerate() {
            if outputs[i].is_none() {
                match future.as_mut().poll(cx) {
                    std::task::Poll::Ready(out) => outputs[i] = Some(out),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs
        .into_iter()
        .map(|o| o.expect("every future finished"))
        .collect()
}

/// What one answer says about its key's charge.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Not a final answer, or the key's charge as it was asked for.
    Right,
    /// A 2xx whose charge id is not in the table.
    Lost,
    /// A 422, a 2xx naming no charge or another key's, or one whose charge is not what the
    /// client asked for (amount, currency, customer, or the table's amount), or whose body is
    /// not the key's first 2xx body (a replay of something else than the stored outcome).
    Wrong,
}

fn verdict(
    attempt: &Attempt,
    charge: &Charge,
    table: &HashMap<&str, (&str, i64)>,
    first: Option<(u16, &serde_json::Value)>,
) -> Verdict {
    if attempt.answer == Ok(422) {
        return Verdict::Wrong; // one body per key: "reused for a different request" is wrong
    }
    // Every outcome stored here is a 2xx: a replayed failure (a processor's 503 stored)
    // would keep the key from ever charging. (The layer's one replayed non-2xx by design,
    // the 500 `outcome-not-stored` marker of a run whose outcome the store refused for a
    // lease, is wrong here too: nothing in this campaign should make a store refuse one.)
    if attempt.replayed && !matches!(attempt.answer, Ok(200..300)) {
        return Verdict::Wrong;
    }
    let Some(body) = &attempt.body else {
        return Verdict::Right;
    };
    let Some(id) = &attempt.charge_id else {
        return Verdict::Wrong; // a 2xx that names no charge
    };
    let Some((customer, amount)) = table.get(id.as_str()) else {
        return Verdict::Lost;
    };
    let asked = *customer == charge.customer
        && *amount == i64::from(charge.amount)
        && body["amount"].as_i64() == Some(i64::from(charge.amount))
        && body["currency"] == "eur"
        && body["customer"] == charge.customer.as_str();
    // The status too, unless either is the 200 of a second run (judged as a duplicate).
    let same = first.is_some_and(|(status, first)| {
        first == body
            && (attempt.answer == Ok(status) || attempt.answer == Ok(200) || status == 200)
    });
    if asked && same {
        Verdict::Right
    } else {
        Verdict::Wrong
    }
}

/// A key's attempts and the faults around them, one line: what a second run followed.
fn timeline(
    charge: &Charge,
    attempts: &[&Attempt],
    reached: &HashMap<String, HashSet<usize>>,
    windows: &[crate::faults::Window],
) -> String {
    let Some(t0) = attempts.iter().map(|a| a.sent).min() else {
        return format!("chaos: second run of {}: no attempts", charge.key);
    };
    let at = |t: Instant| {
        let ms = |d: Duration| d.as_millis() as i64;
        ms(t.saturating_duration_since(t0)) - ms(t0.saturating_duration_since(t))
    };
    let tried: Vec<String> = attempts
        .iter()
        .map(|a| {
            let answer = match a.answer {
                Ok(status) if a.replayed => format!("{status}r"),
                Ok(status) => status.to_string(),
                Err(NoReply::HungUp) => "hung-up".into(),
                Err(NoReply::Failed) => "failed".into(),
            };
            format!("{}ms..{}ms:{answer}", at(a.sent), at(a.answered))
        })
        .collect();
    let end = attempts.iter().map(|a| a.answered).max().unwrap_or(t0);
    let faults: Vec<String> = windows
        .iter()
        .filter(|w| w.start <= end + Duration::from_secs(5) && t0 <= w.end + Duration::from_secs(5))
        .map(|w| {
            let what = w
                .gateway
                .map_or("store".to_owned(), |g| format!("gateway {g}"));
            format!("{what} {:?} {}ms..{}ms", w.excuse, at(w.start), at(w.end))
        })
        .collect();
    format!(
        "chaos: second run of {} (gateways {:?}): attempts [{}] faults [{}]",
        charge.key,
        reached.get(&charge.key),
        tried.join(" "),
        faults.join(", ")
    )
}

/// What the check found.
pub(crate) struct Report {
    pub(crate) requests: usize,
    pub(crate) duplicates: usize,
    pub(crate) lost: usize,
    pub(crate) wrong: usize,
    pub(crate) stuck: usize,
    pub(crate) details: String,
}

/// How long "in flight" may last, in leases, once no fault explains it: a live owner renews
/// its lease only while its handler runs (about a second here), and a dead one's runs out
/// within a lease.
const STUCK_AFTER_LEASES: u32 = 2;

/// Keys stuck for a while during the campaign, even if freed later (the final probe sees
/// only the end): runs of 409 answers (from the first one's sending to the last one's
/// answer) that went on for more than [`STUCK_AFTER_LEASES`] leases after every fault that
/// could explain them was over — a lease after its window ended (a killed or frozen owner's
/// lease runs out by then). Faults come every few seconds, so this is the part of a run
/// that no fault covers. Returns how many, and the longest such part (stuck or not).
fn in_flight_streaks(
    by_charge: &[Vec<&Attempt>],
    windows: &[crate::faults::Window],
    lease: Duration,
) -> (usize, Duration) {
    let (mut stuck, mut longest) = (0, Duration::ZERO);
    for attempts in by_charge {
        let mut streaks = Vec::new();
        let mut streak: Option<(Instant, Instant)> = None;
        for attempt in attempts {
            if attempt.answer == Ok(409) {
                let start = streak.map_or(attempt.sent, |(start, _)| start);
                streak = Some((start, attempt.answered));
            } else if let Some(done) = streak.take() {
                streaks.push(done);
            }
        }
        streaks.extend(streak);
        for (start, end) in streaks {
            // From when no fault that began before the run's end explains it any more.
            let explained_until = windows
                .iter()
                .filter(|w| w.start <= end)
                .map(|w| w.end + lease)
                .fold(start, Instant::max);
            let unexplained = end.saturating_duration_since(explained_until);
            longest = longest.max(unexplained);
            if unexplained > lease * STUCK_AFTER_LEASES {
                stuck += 1;
            }
        }
    }
    (stuck, longest)
}

/// The campaign's charges as the demo recorded them: id, customer, runs of the handler,
/// amount.
/// A charge row: its id, customer, how many times the handler ran for its record id, its
/// amount, and how many times the reconcile hook found it.
type ChargeRow = (String, String, i32, i64, i32);

async fn charge_rows(history: &History, postgres_url: &str) -> Result<Vec<ChargeRow>, String> {
    let pool = sqlx::PgPool::connect(postgres_url)
        .await
        .map_err(|e| format!("connecting to Postgres for the check: {e}"))?;
    let prefix = history
        .charges
        .first()
        .map(|c| {
            c.customer
                .rsplitn(3, '-')
                .last()
                .unwrap_or_default()
                .to_owned()
        })
        .unwrap_or_default();
    let rows = sqlx::query_as(
        "SELECT id, customer, runs, amount, reconciled FROM charges WHERE customer LIKE $1 || '-%'",
    )
    .bind(&prefix)
    .fetch_all(&pool)
    .await
    .map_err(|e| format!("reading charges: {e}"));
    pool.close().await;
    rows
}

/// What Postgres holds for a key a client was answered a 2xx for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kept {
    /// Completed, with the status and body of the key's first 2xx.
    Same,
    /// No record, or a record still in flight: the outcome a client was given is not stored.
    Unsettled,
    /// Completed with another status or body.
    Other,
}

/// A record as read for [`outcomes_kept`]: its state, status and encoded outcome.
type KeyRow = (i32, Option<i32>, Option<Vec<u8>>);
/// The same, after its record id.
type IdRow = (Vec<u8>, i32, Option<i32>, Option<Vec<u8>>);

fn kept(status: u16, body: &serde_json::Value, row: Option<&KeyRow>) -> Kept {
    let Some((1, stored, response)) = row else {
        return Kept::Unsettled;
    };
    let outcome = response
        .as_deref()
        .and_then(|bytes| idempotency_core::Outcome::decode(bytes).ok());
    let same = outcome.is_some_and(|outcome| {
        let stored_body: serde_json::Value =
            serde_json::from_slice(&outcome.body).unwrap_or_default();
        *stored == Some(i32::from(status)) && outcome.status == status && stored_body == *body
    });
    if same { Kept::Same } else { Kept::Other }
}

/// Every key a client was answered a 2xx for must be completed in Postgres with that answer:
/// the status and body of the key's first 2xx. Read from the table itself, before any probe:
/// a record left in flight (its outcome lost, its lease run out) would be answered to a probe
/// by the demo's reconcile hook, which rebuilds the same body from the charge row and stores
/// it, so the probes alone cannot tell a lost outcome from a kept one. An outcome still being
/// written in the background (answered while the store was down: the layer keeps trying) is
/// waited for, up to `settle`. Returns the keys not completed (lost) and those completed with
/// another answer (wrong).
pub(crate) async fn outcomes_kept(
    history: &History,
    scope: &str,
    postgres_url: &str,
    settle: Duration,
) -> Result<(usize, usize), String> {
    use idempotency_core::{IdempotencyKey, RecordId, Scope};
    let scope = Scope::new(scope);
    let mut due: HashMap<Vec<u8>, (u16, &serde_json::Value)> = HashMap::new();
    for attempt in &history.attempts {
        if let (Ok(status @ 200..=299), Some(body)) = (attempt.answer, &attempt.body) {
            let key = IdempotencyKey::new(history.charges[attempt.charge].key.as_str())
                .map_err(|e| format!("a campaign key: {e}"))?;
            let id = RecordId::new(&scope, &key).as_bytes().to_vec();
            due.entry(id).or_insert((status, body));
        }
    }
    let pool = sqlx::PgPool::connect(postgres_url)
        .await
        .map_err(|e| format!("connecting to Postgres for the check: {e}"))?;
    let deadline = Instant::now() + settle;
    let mut other = 0;
    loop {
        let ids: Vec<Vec<u8>> = due.keys().cloned().collect();
        let rows: Vec<IdRow> = sqlx::query_as(
            "SELECT record_id, state::int4, status::int4, response FROM idempotency_keys
             WHERE record_id = ANY($1)",
        )
        .bind(&ids)
        .fetch_all(&pool)
        .await
        .map_err(|e| format!("reading the idempotency records: {e}"))?;
        let rows: HashMap<Vec<u8>, KeyRow> = rows
            .into_iter()
            .map(|(id, state, status, response)| (id, (state, status, response)))
            .collect();
        due.retain(
            |id, (status, body)| match kept(*status, body, rows.get(id)) {
                Kept::Same => false,
                Kept::Other => {
                    other += 1;
                    false
                }
                Kept::Unsettled => true,
            },
        );
        if due.is_empty() || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    pool.close().await;
    Ok((due.len(), other))
}

/// How many times the handler ran for each charge, read before the final probes: a probe
/// that runs it again shows as a count that grew.
pub(crate) async fn runs_before_probes(
    history: &History,
    postgres_url: &str,
) -> Result<HashMap<String, i32>, String> {
    Ok(charge_rows(history, postgres_url)
        .await?
        .into_iter()
        .map(|(_, customer, runs, _, _)| (customer, runs))
        .collect())
}

/// Charges the reconcile hook answered with (`charges.reconciled`: their attempt left the key
/// in flight, charged) that no fault stranding one explains: outcomes the layer lost, which
/// the hook rebuilt byte for byte (and an application without such a hook would have run
/// again). A fault (or a stall of the host) strands a charge whose handler was running when
/// it began — on the gateway it hit, if it hit one: nginx's log says which the key reached —;
/// a handler outlives its client by its demo delays (at most 1.6 s) and a lease of storing
/// its outcome. `tried` holds each charge's attempts, probes included.
fn rebuilt_unexplained(
    rows: &[ChargeRow],
    history: &History,
    tried: &[Vec<&Attempt>],
    windows: &[crate::faults::Window],
    reached: &HashMap<String, HashSet<usize>>,
    lease: Duration,
) -> usize {
    let outlives = lease + Duration::from_millis(1_600);
    rows.iter()
        .filter(|(_, _, _, _, reconciled)| *reconciled > 0)
        .filter(|(_, customer, _, _, _)| {
            let Some(i) = history.charges.iter().position(|c| &c.customer == customer) else {
                return true;
            };
            let key = &history.charges[i].key;
            !windows.iter().any(|w| {
                w.strands
                    && w.gateway.is_none_or(|g| {
                        reached
                            .get(key)
                            .is_some_and(|gateways| gateways.contains(&g))
                    })
                    && tried[i]
                        .iter()
                        .any(|a| a.sent <= w.end && w.start <= a.answered + outlives)
            })
        })
        .count()
}

/// Checks the history against the charges table.
///
/// - **duplicates**: a key with two charge rows; or a key whose charge handler ran twice —
///   counted by the demo itself (`charges.runs`, so a second run shows even when its answer
///   never reached a client), or seen by a client as the 200 the handler answers a second
///   run with (the unique record id turns the second charge into a read) — unless a
///   Postgres freeze began during one of that key's attempts or within a lease after it
///   ended (its handler may outlive its client): an insert held up in the frozen server,
///   to land after the retry's reconcile hook looked. Not Postgres killed (a statement it
///   had not committed never lands; one it had, the hook finds). Never a run a final
///   probe saw (every fault was long cleared by then), and the final probes do not time a
///   run. A gateway killed after its charge committed excuses nothing (the retry takes the
///   key over and the demo's reconcile hook finds the charge), nor does a gateway paused
///   past the lease while it held the key (behind the lease gate it does not run its effect
///   when it wakes), nor do Redis faults.
/// - **lost**: a 2xx whose charge id is not in the table (and, checked apart by
///   [`outcomes_kept`], a 2xx whose outcome Postgres does not hold completed); or a charge
///   the reconcile hook found (`charges.reconciled`: its attempt left the key in flight)
///   with no fault that strands one during its attempts (a gateway killed or paused,
///   Postgres down or frozen): an outcome the layer lost, which the hook rebuilt.
/// - **wrong**: a 2xx carrying another key's charge, or no charge id at all, or a charge of
///   another amount, currency or customer than its client asked for (or than the table
///   holds), or a body or a status other than the key's first 2xx's (every retry gets the
///   stored outcome, byte for byte once parsed); or a 422 (every client sends one body per key:
///   "key reused for a different request" is a wrong answer, and refuses a charged client
///   for good); or a replayed answer that is not a 2xx (one attempt in twenty asks the
///   demo's processor to fail with a 503 before charging: such a failure is never stored).
/// - **stuck**: a key whose final probe, a lease after every fault was cleared, answers
///   anything but 2xx (or 422, counted as wrong); or a key told 409 on end during the
///   campaign for more than two leases that no fault explains (see [`in_flight_streaks`]).
pub(crate) async fn check(
    history: &History,
    probes: &[Attempt],
    before_probes: &HashMap<String, i32>,
    reached: &HashMap<String, HashSet<usize>>,
    windows: &[crate::faults::Window],
    lease: Duration,
    postgres_url: &str,
) -> Result<Report, String> {
    let rows = charge_rows(history, postgres_url).await?;
    let mut per_customer: HashMap<&str, usize> = HashMap::new();
    for (_, customer, _, _, _) in &rows {
        *per_customer.entry(customer).or_default() += 1;
    }
    let two_rows = per_customer.values().filter(|n| **n > 1).count();
    let ran_twice: HashSet<&str> = rows
        .iter()
        .filter(|(_, _, runs, _, _)| *runs > 1)
        .map(|(_, customer, _, _, _)| customer.as_str())
        .collect();
    // Each charge's attempts, in the order its client made them.
    let mut by_charge: Vec<Vec<&Attempt>> = vec![Vec::new(); history.charges.len()];
    for attempt in &history.attempts {
        by_charge[attempt.charge].push(attempt);
    }
    let (mut lost_answer, mut stalled_owner, mut reexecuted) = (0, 0, 0);
    // What each unexcused second run followed, for whoever reads a red campaign.
    let mut second_runs = Vec::new();
    for (i, charge) in history.charges.iter().enumerate() {
        // The campaign's attempts only: the final probes come after every fault, and timed
        // by them any second run would overlap some window.
        let mine = &by_charge[i];
        // A probe that ran the handler again (a 200 not replayed) did so with every fault
        // long cleared: nothing excuses it.
        // (Its 200 carries `Idempotent-Replayed` as a stored one does: the runs counted
        // before the probes tell them apart.)
        let probe_ran = rows.iter().any(|(_, customer, runs, _, _)| {
            *customer == charge.customer
                && before_probes
                    .get(customer)
                    .map_or(*runs > 1, |before| runs > before)
        });
        let seen = mine.iter().find(|a| a.answer == Ok(200));
        let probe_saw = probes.iter().any(|p| p.charge == i && p.answer == Ok(200));
        if seen.is_none() && !probe_saw && !ran_twice.contains(charge.customer.as_str()) {
            continue;
        }
        let Some(first) = mine.iter().map(|a| a.sent).min() else {
            continue;
        };
        // When the second run was answered; seen by nobody in the campaign (counted by the
        // demo, or replayed to a probe), it was answered by the end of the key's last
        // attempt (a zombie's run, after its pause, is bounded by the pause instead).
        let second = seen.map_or_else(
            || mine.iter().map(|a| a.answered).max().unwrap_or(first),
            |a| a.answered,
        );
        // A write whose answer was lost (or held up, to land late): an attempt of the key was
        // in progress during the outage — its handler possibly a lease past its client, who
        // may have hung up — and the second run came after the outage began.
        let lost = windows.iter().any(|w| {
            w.excuse == Some(Excuse::LostAnswer)
                && w.start <= second
                && mine
                    .iter()
                    .any(|a| a.sent <= w.end && w.start <= a.answered + lease)
        });
        // A stalled owner: the paused gateway had the key (nginx's log), an attempt claimed
        // it shortly before the pause froze it (sent within a lease before it), and the run
        // that took it over came after. Not an excuse: behind the lease gate a holder frozen
        // past its lease does not run its effect when it wakes (model property (j)); counted
        // apart only to say what such a second run followed.
        let stalled = windows.iter().any(|w| match w.excuse {
            Some(Excuse::StalledOwner(gateway)) => {
                reached
                    .get(&charge.key)
                    .is_some_and(|gateways| gateways.contains(&gateway))
                    && w.start <= second
                    && mine
                        .iter()
                        .any(|a| a.sent < w.start && w.start <= a.sent + lease)
            }
            _ => false,
        });
        if !lost || probe_ran {
            second_runs.push(timeline(charge, mine, reached, windows));
        }
        if probe_ran {
            reexecuted += 1;
        } else if lost {
            lost_answer += 1;
        } else if stalled {
            stalled_owner += 1;
            reexecuted += 1;
        } else {
            reexecuted += 1;
        }
    }
    let duplicates = two_rows + reexecuted;
    // Charges the reconcile hook answered with, with no fault that strands one.
    let reconciled = rows.iter().filter(|row| row.4 > 0).count();
    // Probes count only where one ran the handler (its runs grew over the probes): one
    // answered by the hook recovered a charge stranded before, and was not stranded itself.
    let mut tried = by_charge.clone();
    for probe in probes {
        let customer = history.charges[probe.charge].customer.as_str();
        let ran = rows.iter().any(|(_, c, runs, _, _)| {
            c == customer && before_probes.get(c).is_some_and(|before| runs > before)
        });
        if ran {
            tried[probe.charge].push(probe);
        }
    }
    let rebuilt = rebuilt_unexplained(&rows, history, &tried, windows, reached, lease);
    let table: HashMap<&str, (&str, i64)> = rows
        .iter()
        .map(|(id, customer, _, amount, _)| (id.as_str(), (customer.as_str(), *amount)))
        .collect();
    // Each key's first 2xx, its status and body: every other 2xx of the key must be the same.
    let mut first_body: Vec<Option<(u16, &serde_json::Value)>> = vec![None; history.charges.len()];
    for attempt in history.attempts.iter().chain(probes) {
        if let (Some(body), Ok(status), slot @ None) = (
            &attempt.body,
            attempt.answer,
            &mut first_body[attempt.charge],
        ) {
            *slot = Some((status, body));
        }
    }
    let (mut lost, mut wrong) = (rebuilt, 0);
    for attempt in history.attempts.iter().chain(probes) {
        match verdict(
            attempt,
            &history.charges[attempt.charge],
            &table,
            first_body[attempt.charge],
        ) {
            Verdict::Right => {}
            Verdict::Lost => lost += 1,
            Verdict::Wrong => wrong += 1,
        }
    }
    // Once per key, however many of its probes (two rounds) found it stuck.
    let stuck_at_the_end = probes
        .iter()
        .filter(
            |p| !matches!(p.answer, Ok(status) if (200..300).contains(&status) || status == 422),
        )
        .map(|p| p.charge)
        .collect::<HashSet<_>>()
        .len();
    let (stuck_in_run, longest_unexplained_409s) = in_flight_streaks(&by_charge, windows, lease);
    let stuck = stuck_at_the_end + stuck_in_run;
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for attempt in &history.attempts {
        let label = match attempt.answer {
            Ok(status) if attempt.replayed => format!("{status} replayed"),
            Ok(status) => status.to_string(),
            Err(NoReply::HungUp) => "client hung up".into(),
            Err(NoReply::Failed) => "connection failed".into(),
        };
        *statuses.entry(label).or_default() += 1;
    }
    let probed: BTreeMap<String, usize> = probes.iter().fold(BTreeMap::new(), |mut m, p| {
        *m.entry(format!("{:?}", p.answer)).or_default() += 1;
        m
    });
    let without_answer = history
        .charges
        .iter()
        .enumerate()
        .filter(|(i, _)| {
            !history
                .attempts
                .iter()
                .chain(probes)
                .any(|a| a.charge == *i && a.charge_id.is_some())
        })
        .count();
    let details = format!(
        "chaos: charges={} charged={} second-runs-excused-after-a-postgres-freeze={lost_answer} second-runs-after-a-gateway-pause={stalled_owner} outcomes-rebuilt-by-the-hook={reconciled} of-them-no-fault-explains={rebuilt} answers={statuses:?} probes={probed:?} keys-never-answered-2xx={without_answer} longest-409s-no-fault-explains={longest_unexplained_409s:.1?} attempts-max={}",
        history.charges.len(),
        rows.len(),
        history
            .attempts
            .iter()
            .map(|a| a.attempt)
            .max()
            .unwrap_or(0),
    );
    let details = second_runs
        .iter()
        .take(5)
        .fold(details, |details, run| details + "\n" + run);
    Ok(Report {
        requests: history.attempts.len() + probes.len(),
        duplicates,
        lost,
        wrong,
        stuck,
        details,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::Window;

    fn answered(charge: usize, sent_ms: u64, took_ms: u64, status: u16, at: Instant) -> Attempt {
        let sent = at + Duration::from_millis(sent_ms);
        Attempt {
            charge,
            attempt: 1,
            sent,
            answered: sent + Duration::from_millis(took_ms),
            answer: Ok(status),
            replayed: false,
            charge_id: None,
            body: None,
        }
    }

    /// A key answered 2xx must be completed in Postgres with that answer: a record left in
    /// flight (its lease run out, its outcome lost) is lost, though a probe would be answered
    /// the same body by the reconcile hook; another status or body is wrong.
    #[test]
    fn a_2xx_whose_outcome_postgres_does_not_hold_is_lost() {
        let body = serde_json::json!({"id": "ch_1", "amount": 5});
        let stored = |status: u16, body: &serde_json::Value| {
            let outcome =
                idempotency_core::Outcome::new(status).with_body(serde_json::to_vec(body).unwrap());
            (1, Some(i32::from(status)), Some(outcome.encode().to_vec()))
        };
        assert_eq!(kept(201, &body, Some(&stored(201, &body))), Kept::Same);
        assert_eq!(kept(201, &body, None), Kept::Unsettled);
        assert_eq!(kept(201, &body, Some(&(0, None, None))), Kept::Unsettled);
        assert_eq!(kept(201, &body, Some(&stored(200, &body))), Kept::Other);
        let other = serde_json::json!({"id": "ch_2", "amount": 5});
        assert_eq!(kept(201, &body, Some(&stored(201, &other))), Kept::Other);
        assert_eq!(
            kept(201, &body, Some(&(1, Some(201), Some(b"junk".to_vec())))),
            Kept::Other
        );
    }

    /// Every 2xx of a key carries the key's charge as it was asked for, the same body each
    /// time; an id the table does not hold is lost.
    #[test]
    fn answers_carry_the_charge_asked_for_and_the_first_body() {
        let at = Instant::now();
        let charge = Charge {
            key: "k".into(),
            customer: "run-0-0".into(),
            amount: 1_250,
        };
        let body = |id: &str, amount: i64, created: &str| {
            serde_json::json!({"id": id, "amount": amount, "currency": "eur",
                "customer": "run-0-0", "status": "succeeded", "created_at": created})
        };
        let with = |status: u16, body: serde_json::Value| Attempt {
            charge_id: body["id"].as_str().map(str::to_owned),
            body: Some(body),
            ..answered(0, 0, 10, status, at)
        };
        let table: HashMap<&str, (&str, i64)> = [
            ("ch_1", ("run-0-0", 1_250)),
            ("ch_2", ("run-0-1", 1_250)),
            ("ch_3", ("run-0-0", 9_999)),
        ]
        .into_iter()
        .collect();
        let first = body("ch_1", 1_250, "t0");
        let check = |attempt: &Attempt| verdict(attempt, &charge, &table, Some((201, &first)));
        assert_eq!(check(&with(201, first.clone())), Verdict::Right);
        assert_eq!(check(&with(200, first.clone())), Verdict::Right);
        assert_eq!(check(&answered(0, 0, 10, 409, at)), Verdict::Right);
        assert_eq!(check(&answered(0, 0, 10, 422, at)), Verdict::Wrong);
        // A failure replayed: stored, though the layer stores no 5xx.
        let replayed_503 = Attempt {
            replayed: true,
            ..answered(0, 0, 10, 503, at)
        };
        assert_eq!(check(&replayed_503), Verdict::Wrong);
        assert_eq!(check(&answered(0, 0, 10, 503, at)), Verdict::Right);
        // Replayed with another amount, or another body, than the key's charge.
        assert_eq!(check(&with(201, body("ch_1", 1_000, "t0"))), Verdict::Wrong);
        assert_eq!(check(&with(201, body("ch_1", 1_250, "t1"))), Verdict::Wrong);
        // Another key's charge, a charge the table holds for another amount, none at all.
        assert_eq!(check(&with(201, body("ch_2", 1_250, "t0"))), Verdict::Wrong);
        assert_eq!(check(&with(201, body("ch_3", 1_250, "t0"))), Verdict::Wrong);
        assert_eq!(check(&with(201, serde_json::Value::Null)), Verdict::Wrong);
        assert_eq!(check(&with(201, body("ch_9", 1_250, "t0"))), Verdict::Lost);
        // The first body with another 2xx status than the first (a 200 is a second run's,
        // judged as a duplicate).
        assert_eq!(check(&with(202, first.clone())), Verdict::Wrong);
    }

    /// A charge the reconcile hook answered with is lost unless a fault that strands one
    /// began while one of its attempts ran (or within a lease and the demo's delays after):
    /// a gateway's fault only for keys that reached that gateway.
    #[test]
    fn a_charge_the_hook_rebuilt_is_lost_unless_a_stranding_fault_explains_it() {
        let (at, lease) = (Instant::now(), Duration::from_secs(3));
        let history = History {
            charges: vec![Charge {
                key: "k".into(),
                customer: "run-0-0".into(),
                amount: 1_250,
            }],
            attempts: Vec::new(),
        };
        let attempt = answered(0, 0, 100, 201, at);
        let tried = vec![vec![&attempt]];
        let rows = vec![("ch_1".to_owned(), "run-0-0".to_owned(), 1, 1_250, 1)];
        let window = |from_ms: u64, strands: bool, gateway: Option<usize>| Window {
            start: at + Duration::from_millis(from_ms),
            end: at + Duration::from_millis(from_ms + 500),
            excuse: None,
            strands,
            gateway,
        };
        let reached = |gateways: &[usize]| {
            HashMap::from([("k".to_owned(), gateways.iter().copied().collect())])
        };
        let lost = |windows: &[Window], reached: &HashMap<String, HashSet<usize>>| {
            rebuilt_unexplained(&rows, &history, &tried, windows, reached, lease)
        };
        assert_eq!(lost(&[], &reached(&[0])), 1, "no fault at all");
        assert_eq!(lost(&[window(1_000, true, None)], &reached(&[0])), 0);
        assert_eq!(
            lost(&[window(1_000, false, None)], &reached(&[0])),
            1,
            "a Redis fault"
        );
        assert_eq!(
            lost(&[window(10_000, true, None)], &reached(&[0])),
            1,
            "long after"
        );
        assert_eq!(
            lost(&[window(1_000, true, Some(1))], &reached(&[0])),
            1,
            "the other gateway"
        );
        assert_eq!(lost(&[window(1_000, true, Some(1))], &reached(&[0, 1])), 0);
        let never = vec![("ch_1".to_owned(), "run-0-0".to_owned(), 1, 1_250, 0)];
        let no_windows: &[Window] = &[];
        assert_eq!(
            rebuilt_unexplained(&never, &history, &tried, no_windows, &reached(&[0]), lease),
            0,
            "never answered by the hook"
        );
    }

    /// A client retries a key that answers 409 for more than the leases after which such a
    /// run counts as stuck; other answers, fifteen attempts. Before, it gave up after fifteen
    /// whatever they were (about four seconds of 409s, under the two leases of the check).
    #[test]
    fn a_client_follows_a_run_of_409_past_the_stuck_threshold() {
        let lease = Duration::from_secs(3);
        let now = Instant::now();
        let ago = |ago: Duration| now.checked_sub(ago).expect("an instant");
        let long_ago = ago(lease * 20);
        assert!(!gives_up(14, None, long_ago, lease));
        assert!(gives_up(15, None, long_ago, lease));
        let since = Some(ago(Duration::from_secs(4)));
        assert!(!gives_up(15, since, long_ago, lease));
        let since = Some(ago(lease * STUCK_AFTER_LEASES));
        assert!(!gives_up(40, since, long_ago, lease));
        let since = Some(ago(lease * (STUCK_AFTER_LEASES + 2)));
        assert!(gives_up(40, since, long_ago, lease));
        // A fault that explains the run's start: followed past what it explains.
        assert!(!gives_up(40, since, ago(lease * STUCK_AFTER_LEASES), lease));
        assert!(
            gives_up(10_000, Some(now), now, lease),
            "bounded all the same"
        );
    }

    /// 409s for more than two leases that no fault explains are stuck, even when the key
    /// answered in the end; shorter, explained, or broken by another answer, they are not.
    #[test]
    fn long_runs_of_409_no_fault_explains_are_stuck() {
        let at = Instant::now();
        let lease = Duration::from_secs(1);
        let long: Vec<Attempt> = (0..8)
            .map(|i| answered(0, i * 500, 10, 409, at))
            .chain([answered(0, 4_000, 10, 201, at)])
            .collect();
        let short: Vec<Attempt> = (0..4)
            .map(|i| answered(1, i * 500, 10, 409, at))
            .chain([answered(1, 2_000, 10, 201, at)])
            .collect();
        let broken: Vec<Attempt> = [409, 409, 409, 503, 409, 409, 409]
            .iter()
            .enumerate()
            .map(|(i, status)| answered(2, i as u64 * 600, 10, *status, at))
            .collect();
        let by_charge: Vec<Vec<&Attempt>> = [&long, &short, &broken]
            .iter()
            .map(|attempts| attempts.iter().collect())
            .collect();
        let (stuck, longest) = in_flight_streaks(&by_charge, &[], lease);
        assert_eq!(stuck, 1);
        assert_eq!(longest, Duration::from_millis(3_510));
        // A fault explains a run until a lease after it ended; one that began after the run
        // explains nothing.
        let fault = |from_ms| Window {
            start: at + Duration::from_millis(from_ms),
            end: at + Duration::from_millis(from_ms + 500),
            excuse: None,
            strands: false,
            gateway: None,
        };
        assert_eq!(in_flight_streaks(&by_charge, &[fault(1_000)], lease).0, 0);
        assert_eq!(
            in_flight_streaks(&by_charge, &[fault(0)], lease).0,
            1,
            "2.01 s left"
        );
        assert_eq!(in_flight_streaks(&by_charge, &[fault(3_600)], lease).0, 1);
    }
}
