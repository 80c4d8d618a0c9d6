//! The real `payments-demo` binary, started in each of its four modes against real
//! containers, exercised over HTTP: the contract of the demo and the storm tool's invariant.

use std::{
    net::TcpListener,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use idempotency_test::{block_on, services};

const BIN: &str = env!("CARGO_BIN_EXE_payments-demo");

/// A running demo, stopped with SIGTERM on drop.
struct Demo {
    child: Child,
    base: String,
}

impl Demo {
    fn start(env: &[(&str, &str)]) -> Demo {
        Self::start_with(env, Stdio::inherit())
    }

    /// Started with its log (stderr) sent to `stderr`.
    fn start_with(env: &[(&str, &str)], stderr: Stdio) -> Demo {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
            .port();
        let mut command = Command::new(BIN);
        command
            .env_remove("DATABASE_URL")
            .env_remove("REDIS_URL")
            .env_remove("IDEMPOTENCY_STORE")
            .env_remove("DEMO_CRASH")
            .env("BIND", format!("127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(stderr);
        for (k, v) in env {
            command.env(k, v);
        }
        let child = command.spawn().expect("spawn payments-demo");
        let demo = Demo {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let started = Instant::now();
        while call(&demo.base, "GET", "/healthz", &[], "").is_none() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "payments-demo did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        demo
    }

    /// SIGTERM, then the exit status: graceful shutdown exits 0.
    fn stop(mut self) -> i32 {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let status = self.child.wait().expect("wait");
        std::mem::forget(self);
        status.code().unwrap_or(-1)
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

use idempotency_test::http::Reply;

/// An HTTP/1.1 exchange on a fresh connection (the hyper client of `idempotency-test`).
fn call(
    base: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<Reply> {
    let authority = base.strip_prefix("http://").expect("http");
    let headers: Vec<(&str, String)> = headers.iter().map(|(n, v)| (*n, (*v).to_owned())).collect();
    block_on(idempotency_test::http::send(
        authority,
        method,
        path,
        &headers,
        body,
        Duration::from_secs(20),
    ))
    .ok()
}

fn post(demo: &Demo, key: Option<&str>, extra: &[(&str, &str)], body: &str) -> Reply {
    let mut headers = vec![("content-type", "application/json")];
    if let Some(key) = key {
        headers.push(("idempotency-key", key));
    }
    headers.extend_from_slice(extra);
    call(&demo.base, "POST", "/charges", &headers, body).expect("POST /charges")
}

/// `GET /charges?customer=…`, as JSON.
fn charges_of(base: &str, customer: &str) -> serde_json::Value {
    call(
        base,
        "GET",
        &format!("/charges?customer={customer}"),
        &[],
        "",
    )
    .expect("GET /charges")
    .json()
}

fn assert_problem(reply: &Reply, status: u16) {
    assert_eq!(reply.status, status, "{}", reply.body);
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    let json = reply.json();
    assert_eq!(json["status"], status);
    assert!(
        json["type"].as_str().is_some_and(|t| t.starts_with("urn:")),
        "{json}"
    );
}

/// The contract of issue 7, in one mode.
fn exercise(demo: &Demo, mode: &str) {
    let health = call(&demo.base, "GET", "/healthz", &[], "").expect("healthz");
    assert_eq!(health.status, 200);
    assert_eq!(health.json()["mode"], mode);

    let customer = format!("cust-{}", uuid::Uuid::new_v4().simple());
    let body = format!(r#"{{"amount": 1000, "currency": "eur", "customer": "{customer}"}}"#);
    let key = uuid::Uuid::new_v4().to_string();

    let created = post(demo, Some(&key), &[], &body);
    assert_eq!(created.status, 201, "{}", created.body);
    let charge = created.json();
    let id = charge["id"].as_str().expect("id").to_owned();
    assert!(id.starts_with("ch_"));
    assert_eq!(
        created.header("location"),
        Some(format!("/charges/{id}").as_str())
    );
    assert_eq!(
        (
            charge["amount"].as_i64(),
            charge["currency"].as_str(),
            charge["status"].as_str()
        ),
        (Some(1000), Some("eur"), Some("succeeded"))
    );
    assert!(chrono_like(
        charge["created_at"].as_str().expect("created_at")
    ));

    // The retry: the same charge, replayed.
    let replay = post(demo, Some(&key), &[], &body);
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.json()["id"], id.as_str());
    // Another account, same key: a different charge.
    let other = post(demo, Some(&key), &[("x-account-id", "acct_other")], &body);
    assert_eq!(other.status, 201);
    assert_ne!(other.json()["id"], id.as_str());
    // An account header the demo cannot read is refused, not taken for no account: every
    // such account shared the `anonymous` scope, and was replayed this charge.
    for unreadable in ["josé", ""] {
        let refused = post(demo, Some(&key), &[("x-account-id", unreadable)], &body);
        assert_problem(&refused, 400);
    }
    // Same key, different body: 422.
    assert_problem(
        &post(demo, Some(&key), &[], &body.replace("1000", "2000")),
        422,
    );
    // Missing key, bad JSON, bad fields: 400.
    assert_problem(&post(demo, None, &[], &body), 400);
    assert_problem(&post(demo, Some("bad-json"), &[], "{not json"), 400);
    assert_problem(
        &post(
            demo,
            Some("bad-amount"),
            &[],
            r#"{"amount": 0, "currency": "eur", "customer": "x"}"#,
        ),
        400,
    );
    assert_problem(
        &post(
            demo,
            Some("bad-currency"),
            &[],
            r#"{"amount": 1, "currency": "EUR", "customer": "x"}"#,
        ),
        400,
    );
    assert_problem(
        &post(
            demo,
            Some("bad-customer"),
            &[],
            &format!(
                r#"{{"amount": 1, "currency": "eur", "customer": "{}"}}"#,
                "x".repeat(65)
            ),
        ),
        400,
    );
    // A control character (NUL, which Postgres refuses in text) is bad input, not an outage:
    // a 503 told the client to retry what could never succeed.
    assert_problem(
        &post(
            demo,
            Some("nul-customer"),
            &[],
            r#"{"amount": 1, "currency": "eur", "customer": "a\u0000b"}"#,
        ),
        400,
    );

    // In flight: 409 with Retry-After while a slow first request runs.
    let slow_key = uuid::Uuid::new_v4().to_string();
    let slow = {
        let (base, key, body) = (demo.base.clone(), slow_key.clone(), body.clone());
        std::thread::spawn(move || {
            call(
                &base,
                "POST",
                "/charges",
                &[("idempotency-key", &key), ("x-demo-delay-ms", "800")],
                &body,
            )
            .expect("slow")
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let conflict = post(demo, Some(&slow_key), &[("x-demo-delay-ms", "800")], &body);
    assert_problem(&conflict, 409);
    assert!(conflict.header("retry-after").is_some());
    assert_eq!(slow.join().expect("thread").status, 201);

    // A 503 from the processor is not stored: the retry charges.
    let flaky = uuid::Uuid::new_v4().to_string();
    assert_problem(
        &post(demo, Some(&flaky), &[("x-demo-fail", "503")], &body),
        503,
    );
    let retried = post(demo, Some(&flaky), &[], &body);
    assert_eq!(retried.status, 201);
    assert_eq!(retried.header("idempotent-replayed"), None);

    // A demo knob the demo cannot read is refused before the key is claimed: its 400 is not
    // the key's outcome, and the same key without it charges (once: the last of the five).
    let knobbed = uuid::Uuid::new_v4().to_string();
    let knobbed_body = body.replace("1000", "1001");
    for (knob, value) in [
        ("x-demo-delay-ms", "99999"),
        ("x-demo-delay-after-ms", "soon"),
        ("x-demo-fail", "500"),
        ("x-demo-crash", "before-charge"),
    ] {
        let refused = post(demo, Some(&knobbed), &[(knob, value)], &knobbed_body);
        assert_problem(&refused, if knob == "x-demo-crash" { 403 } else { 400 });
    }
    let charged = post(demo, Some(&knobbed), &[], &knobbed_body);
    assert_eq!(charged.status, 201, "{}", charged.body);
    assert_eq!(charged.header("idempotent-replayed"), None);

    // A key sent to no route claims nothing: the 404 is not the key's outcome.
    let astray = uuid::Uuid::new_v4().to_string();
    let nowhere = call(
        &demo.base,
        "POST",
        "/nope",
        &[("idempotency-key", &astray)],
        &body,
    )
    .expect("call");
    assert_problem(&nowhere, 404);
    let charged = post(
        demo,
        Some(&astray),
        &[],
        &knobbed_body.replace("1001", "1002"),
    );
    assert_eq!(charged.status, 201, "{}", charged.body);

    // What the router itself refuses is a problem too: an unknown route or method, a query
    // it cannot read.
    for (method, path, body, status) in [
        ("GET", "/nope", "", 404),
        ("DELETE", "/charges", "", 405),
        ("GET", "/charges?customer=a&customer=b", "", 400),
    ] {
        let refused = call(&demo.base, method, path, &[], body).expect("call");
        assert_problem(&refused, status);
    }

    // Reads.
    let got = call(&demo.base, "GET", &format!("/charges/{id}"), &[], "").expect("get");
    assert_eq!(got.status, 200);
    assert_eq!(got.json()["id"], id.as_str());
    assert_problem(
        &call(&demo.base, "GET", "/charges/ch_missing", &[], "").expect("get"),
        404,
    );
    let list = charges_of(&demo.base, &customer);
    // created + other account + slow + flaky retried + knobbed + astray
    assert_eq!(list["count"], 6, "{list}");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(6));

    let metrics = call(&demo.base, "GET", "/metrics", &[], "").expect("metrics");
    assert_eq!(metrics.status, 200);
    assert!(
        metrics.body.contains("idempotency_replays_total"),
        "{}",
        metrics.body
    );
    // Through the `metrics` facade: the help text, and each store call's latency by store,
    // operation and answer.
    assert!(
        metrics
            .body
            .contains("# HELP idempotency_replays_total Requests answered with a stored outcome."),
        "{}",
        metrics.body
    );
    let begin = format!(
        "idempotency_store_call_seconds_count{{store=\"{mode}\",operation=\"begin\",answer=\"execute\"}}"
    );
    assert!(
        metrics.body.contains(&begin),
        "{begin} in\n{}",
        metrics.body
    );
    if mode == "hybrid" {
        assert!(
            metrics
                .body
                .contains("idempotency_breaker_state{state=\"closed\"} 1"),
            "{}",
            metrics.body
        );
    }

    exercise_orders(demo);

    // The storm tool's invariant against this mode.
    let storm = storm(demo, "40", "4");
    let out = String::from_utf8_lossy(&storm.stdout);
    assert!(
        storm.status.success(),
        "storm failed:\n{out}\n{}",
        String::from_utf8_lossy(&storm.stderr)
    );
    assert_eq!(
        out.lines().last(),
        Some("recorded=40 expected=40 duplicated=0 missing=0 ran_again=0 wrong=0"),
        "{out}"
    );
}

/// `payments-demo storm` against `demo`: `charges` charges, `sends` sends each, a client
/// that hangs up after 150 ms.
fn storm(demo: &Demo, charges: &str, sends: &str) -> std::process::Output {
    Command::new(BIN)
        .args(["storm", "--url", &demo.base, "--charges", charges])
        .args(["--sends", sends, "--client-timeout-ms", "150"])
        .output()
        .expect("storm")
}

/// The storm sees a second run of the handler: against a demo whose records expire at once
/// (every send after a charge's first runs the handler again, which finds the charge its
/// record id made and answers 200), it fails with `ran_again` counted. Before, that 200
/// counted as a replay and the storm passed: the charge table, one row per record id, cannot
/// show a second run.
#[test]
fn the_storm_fails_when_the_handler_runs_again() {
    let demo = Demo::start(&[("IDEMPOTENCY_RETENTION_MS", "1")]);
    let storm = storm(&demo, "6", "3");
    let out = String::from_utf8_lossy(&storm.stdout);
    assert!(!storm.status.success(), "the storm passed:\n{out}");
    let last = out.lines().last().unwrap_or_default();
    assert!(
        last.contains("duplicated=0") && !last.contains("ran_again=0"),
        "{out}"
    );
    assert_eq!(demo.stop(), 0, "graceful shutdown");
}

/// The orders contract of issue 9: create (idempotent), read with ETag, guarded transitions.
fn exercise_orders(demo: &Demo) {
    let key = uuid::Uuid::new_v4().to_string();
    let body = r#"{"customer": "dora", "amount": 2500}"#;
    let created = call(
        &demo.base,
        "POST",
        "/orders",
        &[("idempotency-key", &key)],
        body,
    )
    .expect("create");
    assert_eq!(created.status, 201, "{}", created.body);
    assert_eq!(created.header("etag"), Some("\"1\""));
    let order = created.json();
    let id = order["id"].as_str().expect("id").to_owned();
    assert!(id.starts_with("ord_"));
    assert_eq!(
        created.header("location"),
        Some(format!("/orders/{id}").as_str())
    );
    assert_eq!(
        (
            order["status"].as_str(),
            order["version"].as_i64(),
            order["amount"].as_i64()
        ),
        (Some("pending"), Some(1), Some(2500))
    );
    let again = call(
        &demo.base,
        "POST",
        "/orders",
        &[("idempotency-key", &key)],
        body,
    )
    .expect("replay");
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.json()["id"], id.as_str());
    assert_problem(
        &call(&demo.base, "POST", "/orders", &[], body).expect("no key"),
        400,
    );

    let got = call(&demo.base, "GET", &format!("/orders/{id}"), &[], "").expect("get");
    assert_eq!((got.status, got.header("etag")), (200, Some("\"1\"")));
    assert_problem(
        &call(&demo.base, "GET", "/orders/ord_missing", &[], "").expect("get"),
        404,
    );

    let path = format!("/orders/{id}/transitions");
    let to = |status: &str| format!(r#"{{"to": "{status}"}}"#);
    let step = |if_match: Option<&str>, status: &str| {
        let headers: Vec<(&str, &str)> =
            if_match.map(|m| vec![("if-match", m)]).unwrap_or_default();
        call(&demo.base, "POST", &path, &headers, &to(status)).expect("transition")
    };
    assert_problem(&step(None, "processing"), 428);
    assert_problem(&step(Some("\"x\""), "processing"), 400);
    // Not a status of orders: a bad body, 400. A status nothing leads to: forbidden, 409.
    assert_problem(&step(Some("\"1\""), "cancelled"), 400);
    let forbidden = step(Some("\"1\""), "pending");
    assert_problem(&forbidden, 409);
    assert_eq!(
        forbidden.json()["type"],
        "urn:payments-demo:problem:forbidden-transition"
    );
    let moved = step(Some("\"1\""), "processing");
    assert_eq!(
        (moved.status, moved.header("etag")),
        (200, Some("\"2\"")),
        "{}",
        moved.body
    );
    assert_eq!(moved.json()["status"], "processing");
    // The same transition again (a retry): 200 with the current order, no second move.
    let repeat = step(Some("\"1\""), "processing");
    assert_eq!(
        (repeat.status, repeat.json()["version"].as_i64()),
        (200, Some(2))
    );
    // Back to the start (processing -> pending): 409.
    assert_problem(&step(Some("\"2\""), "pending"), 409);
    // A stale If-Match: 412. A skip (processing -> completed): 409.
    assert_problem(&step(Some("\"1\""), "shipped"), 412);
    assert_problem(&step(Some("\"2\""), "completed"), 409);
    assert_eq!(step(Some("\"2\""), "shipped").status, 200);
    // Backwards: 409.
    assert_problem(&step(Some("\"3\""), "processing"), 409);
    let done = step(Some("\"3\""), "completed");
    assert_eq!(
        (
            done.status,
            done.json()["version"].as_i64(),
            done.header("etag")
        ),
        (200, Some(4), Some("\"4\""))
    );
    assert_problem(
        &call(
            &demo.base,
            "POST",
            "/orders/ord_missing/transitions",
            &[("if-match", "\"1\"")],
            &to("processing"),
        )
        .expect("t"),
        404,
    );
}

/// Runs `scenario` (blocking: it drives the real binary) with the environment `mode` needs:
/// `DATABASE_URL` and/or `REDIS_URL` of the harness's services. Returns what it returns, and
/// the Postgres URL when the mode has one; `None` when services are skipped.
fn in_mode<T: Send + 'static>(
    mode: &'static str,
    scenario: fn(&[(&str, &str)], &str) -> T,
) -> Option<(T, Option<String>)> {
    block_on(async {
        let pg = match mode {
            "postgres" | "hybrid" => Some(services::postgres().await?.url().to_owned()),
            _ => None,
        };
        let redis = match mode {
            "redis" | "hybrid" => Some(services::redis().await?.url().to_owned()),
            _ => None,
        };
        let db = pg.clone();
        let out = tokio::task::spawn_blocking(move || {
            let mut env = Vec::new();
            if let Some(url) = &pg {
                env.push(("DATABASE_URL", url.as_str()));
            }
            if let Some(url) = &redis {
                env.push(("REDIS_URL", url.as_str()));
            }
            scenario(&env, mode)
        })
        .await
        .unwrap_or_else(|e| panic!("{mode} mode: {e}"));
        Some((out, db))
    })
}

/// The whole contract against the real binary in one mode, then a graceful shutdown.
fn exercise_mode(env: &[(&str, &str)], mode: &str) {
    let demo = Demo::start(env);
    exercise(&demo, mode);
    assert_eq!(demo.stop(), 0, "graceful shutdown");
}

/// A key reused after its record's retention (1 s here) ended: the handler runs again, and
/// the charge its record id already made decides. Another body is the layer's 422 (not the
/// old charge as a new 201); the same body is that charge, 200 and replayed.
fn reuse_after_retention(env: &[(&str, &str)], mode: &str) {
    let mut env = env.to_vec();
    env.push(("IDEMPOTENCY_RETENTION_MS", "1000"));
    let demo = Demo::start(&env);
    assert_eq!(
        call(&demo.base, "GET", "/healthz", &[], "")
            .expect("healthz")
            .json()["mode"],
        mode
    );
    let customer = format!("cust-{}", uuid::Uuid::new_v4().simple());
    let a = format!(r#"{{"amount": 1000, "currency": "eur", "customer": "{customer}"}}"#);
    let b = a.replace("1000", "2500");
    let key = uuid::Uuid::new_v4().to_string();
    let charges = || charges_of(&demo.base, &customer);

    let created = post(&demo, Some(&key), &[], &a);
    assert_eq!(created.status, 201, "{}", created.body);
    let id = created.json()["id"].as_str().expect("id").to_owned();

    std::thread::sleep(Duration::from_millis(1500)); // past the record's retention

    let other = post(&demo, Some(&key), &[], &b);
    assert_problem(&other, 422);
    assert_eq!(other.json()["type"], "urn:idempotency:problem:key-reused");
    let list = charges();
    assert_eq!(list["count"], 1, "no second charge: {list}");
    assert_eq!(list["data"][0]["id"], id.as_str());
    assert_eq!(list["data"][0]["amount"], 1000);

    let same = post(&demo, Some(&key), &[], &a);
    assert_eq!(same.status, 200, "{}", same.body);
    assert_eq!(same.header("idempotent-replayed"), Some("true"));
    assert_eq!(same.json()["id"], id.as_str());
    assert_eq!(same.json()["amount"], 1000);
    assert_eq!(charges()["count"], 1);
    assert_eq!(demo.stop(), 0);
}

#[test]
fn memory_mode_reuse_after_retention() {
    in_mode("memory", reuse_after_retention);
}

#[test]
fn postgres_mode_reuse_after_retention() {
    in_mode("postgres", reuse_after_retention);
}

#[test]
fn redis_mode_reuse_after_retention() {
    in_mode("redis", reuse_after_retention);
}

#[test]
fn hybrid_mode_reuse_after_retention() {
    in_mode("hybrid", reuse_after_retention);
}

fn order_reuse_after_retention(env: &[(&str, &str)], mode: &str) -> String {
    let mut env = env.to_vec();
    env.push(("IDEMPOTENCY_RETENTION_MS", "1000"));
    let demo = Demo::start(&env);
    assert_eq!(
        call(&demo.base, "GET", "/healthz", &[], "")
            .expect("healthz")
            .json()["mode"],
        mode
    );
    let customer = format!("cust-{}", uuid::Uuid::new_v4().simple());
    let a = format!(r#"{{"customer": "{customer}", "amount": 2500}}"#);
    let b = a.replace("2500", "9900");
    let key = uuid::Uuid::new_v4().to_string();
    let order = |body: &str| {
        call(
            &demo.base,
            "POST",
            "/orders",
            &[("idempotency-key", &key)],
            body,
        )
        .expect("POST /orders")
    };

    let created = order(&a);
    assert_eq!(created.status, 201, "{}", created.body);
    let id = created.json()["id"].as_str().expect("id").to_owned();
    // Moved on since: the replay after retention answers the order as it is now.
    let moved = call(
        &demo.base,
        "POST",
        &format!("/orders/{id}/transitions"),
        &[("if-match", "\"1\"")],
        r#"{"to": "processing"}"#,
    )
    .expect("transition");
    assert_eq!(moved.status, 200, "{}", moved.body);

    std::thread::sleep(Duration::from_millis(1500)); // past the record's retention

    let other = order(&b);
    assert_problem(&other, 422);
    assert_eq!(other.json()["type"], "urn:idempotency:problem:key-reused");
    let got = call(&demo.base, "GET", &format!("/orders/{id}"), &[], "").expect("get");
    assert_eq!(got.json()["amount"], 2500, "the order is untouched");

    let same = order(&a);
    assert_eq!(same.status, 200, "{}", same.body);
    assert_eq!(same.header("idempotent-replayed"), Some("true"));
    assert_eq!(same.header("etag"), Some("\"2\""));
    assert_eq!(
        same.header("location"),
        Some(format!("/orders/{id}").as_str())
    );
    let json = same.json();
    assert_eq!(
        (
            json["id"].as_str(),
            json["amount"].as_i64(),
            json["status"].as_str()
        ),
        (Some(id.as_str()), Some(2500), Some("processing"))
    );
    assert_eq!(demo.stop(), 0);
    customer
}

#[test]
fn memory_mode_order_reuse_after_retention() {
    in_mode("memory", order_reuse_after_retention);
}

#[test]
fn postgres_mode_order_reuse_after_retention() {
    let Some((customer, Some(db))) = in_mode("postgres", order_reuse_after_retention) else {
        return;
    };
    block_on(async {
        let pool = sqlx::PgPool::connect(&db).await.expect("connect");
        let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE customer = $1")
            .bind(&customer)
            .fetch_one(&pool)
            .await
            .expect("count");
        assert_eq!(orders, 1, "one order, however often the key came back");
    });
}

#[test]
fn hybrid_mode_order_reuse_after_retention() {
    in_mode("hybrid", order_reuse_after_retention);
}

#[test]
fn a_retention_that_is_not_milliseconds_is_a_clear_startup_error() {
    let err = startup_error("IDEMPOTENCY_RETENTION_MS", "1h");
    assert!(err.contains("IDEMPOTENCY_RETENTION_MS"), "{err}");
}

#[test]
fn a_demo_crash_that_is_not_a_switch_is_a_clear_startup_error() {
    let err = startup_error("DEMO_CRASH", "yes please");
    assert!(err.contains("DEMO_CRASH"), "{err}");
}

/// A variable set but empty (a secret that did not arrive) is a startup error, not "unset":
/// an empty `DATABASE_URL` quietly chose the memory store. And a lease outside 100 ms to a
/// day is refused (at 1 ms, a network store answered nearly every charge 503).
#[test]
fn an_empty_variable_or_an_unusable_lease_is_a_clear_startup_error() {
    for name in ["DATABASE_URL", "REDIS_URL", "ADMIN_TOKEN"] {
        let err = startup_error(name, "");
        assert!(err.contains(&format!("{name} is set but empty")), "{err}");
    }
    for lease in ["1", "99", "86400001"] {
        let err = startup_error("IDEMPOTENCY_LEASE_MS", lease);
        assert!(err.contains("IDEMPOTENCY_LEASE_MS"), "{lease}: {err}");
    }
}

/// Starts the demo in memory mode with `name=value`, expects it to refuse to start, and
/// returns what it wrote to stderr.
fn startup_error(name: &str, value: &str) -> String {
    let out = Command::new(BIN)
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .env_remove("IDEMPOTENCY_STORE")
        .env_remove("DEMO_CRASH")
        .env(name, value)
        // Never serves, even if the variable were ignored.
        .env("BIND", "not-an-address")
        .output()
        .expect("run");
    assert!(!out.status.success(), "{name}={value:?} started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn chrono_like(t: &str) -> bool {
    t.len() >= 20
        && t.as_bytes()[4] == b'-'
        && t.contains('T')
        && (t.ends_with('Z') || t.contains('+'))
}

#[test]
fn memory_mode() {
    in_mode("memory", exercise_mode);
}

#[test]
fn postgres_mode() {
    in_mode("postgres", exercise_mode);
}

#[test]
fn redis_mode() {
    in_mode("redis", exercise_mode);
}

#[test]
fn hybrid_mode() {
    in_mode("hybrid", exercise_mode);
}

/// Redis mode without `DATABASE_URL` keeps the charges (the second check, by record id) in
/// the process: it says so at startup, so nobody runs two gateways so believing otherwise.
#[test]
fn redis_mode_without_a_database_says_its_charges_stay_in_the_process() {
    in_mode("redis", |env, _| {
        let log = std::env::temp_dir().join(format!("demo-{}.log", std::process::id()));
        let file = std::fs::File::create(&log).expect("log file");
        let demo = Demo::start_with(env, Stdio::from(file));
        assert_eq!(demo.stop(), 0, "graceful shutdown");
        let written = std::fs::read_to_string(&log).expect("log");
        let _ = std::fs::remove_file(&log);
        assert!(
            written.contains("kept in this process's memory") && written.contains("DATABASE_URL"),
            "{written}"
        );
    });
}

#[test]
fn a_mode_without_its_url_is_a_clear_startup_error() {
    let out = Command::new(BIN)
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .env("IDEMPOTENCY_STORE", "hybrid")
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs DATABASE_URL"), "{err}");
}

/// `--help` documents the commands and every storm flag; a bad value is a usage error
/// (exit 2) that names the flag, before anything is sent.
#[test]
fn the_cli_documents_its_flags_and_refuses_bad_ones() {
    let run = |args: &[&str]| Command::new(BIN).args(args).output().expect("run");
    let help = run(&["--help"]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success(), "{text}");
    for word in ["serve", "storm", "DATABASE_URL", "IDEMPOTENCY_STORE"] {
        assert!(text.contains(word), "--help lacks {word}:\n{text}");
    }
    let storm_help = run(&["storm", "--help"]);
    let text = String::from_utf8_lossy(&storm_help.stdout);
    assert!(storm_help.status.success(), "{text}");
    for flag in [
        "--url",
        "--charges",
        "--sends",
        "--client-timeout-ms",
        "--concurrency",
    ] {
        assert!(text.contains(flag), "storm --help lacks {flag}:\n{text}");
    }
    let bad = run(&["storm", "--url", "http://127.0.0.1:9", "--charges", "0"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--charges"));
    let missing = run(&["storm"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("--url"));
}

/// `payments-demo admin <args> --scope <account> --key <key>`, with only `env`'s variables
/// naming the store.
fn admin_cli(
    env: &[(&str, &str)],
    account: &str,
    key: &str,
    args: &[&str],
) -> std::process::Output {
    let mut command = Command::new(BIN);
    command
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .env_remove("IDEMPOTENCY_STORE")
        .arg("admin")
        .args(args)
        .args(["--scope", account, "--key", key]);
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("run payments-demo admin")
}

/// The operator's surface, over HTTP and from the command line, against the same store: a
/// charge's record seen completed, kept against a plain release, deleted when asked; the
/// routes refuse anyone without the token, and are not there at all without `ADMIN_TOKEN`.
fn admin_surface(env: &[(&str, &str)], _mode: &str) {
    let mut with_token = env.to_vec();
    with_token.push(("ADMIN_TOKEN", "s3cret-operator-token"));
    let demo = Demo::start(&with_token);
    let account = format!("acct-{}", uuid::Uuid::new_v4().simple());
    let key = uuid::Uuid::new_v4().to_string();
    let body = format!(r#"{{"amount": 1000, "currency": "eur", "customer": "{account}"}}"#);
    let created = post(&demo, Some(&key), &[("x-account-id", &account)], &body);
    assert_eq!(created.status, 201, "{}", created.body);

    let path = format!("/admin/idempotency/scopes/{account}/keys/{key}");
    let admin = |method: &str, path: &str, token: Option<&str>| {
        let bearer = token.map(|t| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> = bearer
            .iter()
            .map(|b| ("authorization", b.as_str()))
            .collect();
        call(&demo.base, method, path, &headers, "").expect("admin call")
    };
    for token in [
        None,
        Some("wrong"),
        Some("s3cret-operator-token-but-longer"),
    ] {
        let denied = admin("GET", &path, token);
        assert_problem(&denied, 401);
        assert_eq!(denied.header("www-authenticate"), Some("Bearer"));
    }
    let view = admin("GET", &path, Some("s3cret-operator-token"));
    assert_eq!(view.status, 200, "{}", view.body);
    let json = view.json();
    assert_eq!(json["state"], "completed", "{json}");
    assert_eq!(json["status"], 201, "{json}");
    assert_eq!(json["scope"], account.as_str());
    assert!(
        json["expires_at"].as_str().is_some_and(chrono_like),
        "{json}"
    );
    let kept = admin("DELETE", &path, Some("s3cret-operator-token"));
    assert_problem(&kept, 409);

    // The command line, on the store the server runs on.
    let cli_for = |args: &[&str], key: &str| admin_cli(env, &account, key, args);
    let cli = |args: &[&str]| cli_for(args, &key);
    let inspected = cli(&["inspect"]);
    assert_eq!(inspected.status.code(), Some(0), "{inspected:?}");
    let json: serde_json::Value = serde_json::from_slice(&inspected.stdout).expect("JSON");
    assert_eq!(json["state"], "completed", "{json}");
    assert_eq!(json["record_id"], view.json()["record_id"]);
    // The key as the header carries it in its draft's form, copied from a request log: the
    // same record, as the layer and the routes read it.
    let quoted = cli_for(&["inspect"], &format!("\"{key}\""));
    assert_eq!(quoted.status.code(), Some(0), "{quoted:?}");
    let json: serde_json::Value = serde_json::from_slice(&quoted.stdout).expect("JSON");
    assert_eq!(json["record_id"], view.json()["record_id"]);
    let refused = cli(&["release"]);
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--completed"));
    let deleted = cli(&["release", "--completed"]);
    assert_eq!(deleted.status.code(), Some(0), "{deleted:?}");
    assert_eq!(cli(&["inspect"]).status.code(), Some(1));
    assert_problem(&admin("GET", &path, Some("s3cret-operator-token")), 404);
    // With the operator's routes, a route that does not exist is still a problem.
    assert_problem(&admin("GET", "/nope", None), 404);
    assert_eq!(demo.stop(), 0, "graceful shutdown");

    // Without ADMIN_TOKEN the routes do not exist.
    let plain = Demo::start(env);
    let absent = call(
        &plain.base,
        "GET",
        &path,
        &[("authorization", "Bearer s3cret-operator-token")],
        "",
    )
    .expect("call");
    assert_eq!(absent.status, 404);
    assert_eq!(plain.stop(), 0);
}

#[test]
fn hybrid_mode_admin_surface() {
    in_mode("hybrid", admin_surface);
}

#[test]
fn the_admin_cli_refuses_the_memory_store() {
    let out = Command::new(BIN)
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .env_remove("IDEMPOTENCY_STORE")
        .args(["admin", "inspect", "--scope", "a", "--key", "k"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("DATABASE_URL"));
}

/// The process dies right after a charge committed, before its outcome was stored
/// (`X-Demo-Crash: after-charge`). Restarted, and one lease later, the retry of the same
/// key and body is that charge, replayed (the reconcile hook found it by its record id):
/// not a second charge, not a 500.
fn crash_after_charge(env: &[(&str, &str)], _mode: &str) {
    let mut env = env.to_vec();
    env.push(("IDEMPOTENCY_LEASE_MS", "1000"));
    env.push(("DEMO_CRASH", "1"));
    let customer = format!("crash-{}", uuid::Uuid::new_v4().simple());
    let body = format!(r#"{{"amount": 1000, "currency": "eur", "customer": "{customer}"}}"#);
    let key = uuid::Uuid::new_v4().to_string();

    let mut demo = Demo::start(&env);
    let crashed = call(
        &demo.base,
        "POST",
        "/charges",
        &[
            ("content-type", "application/json"),
            ("idempotency-key", &key),
            ("x-demo-crash", "after-charge"),
        ],
        &body,
    );
    assert!(
        crashed.is_none(),
        "the process died before answering: {crashed:?}"
    );
    let status = demo.child.wait().expect("wait");
    assert!(!status.success(), "aborted: {status:?}");
    drop(demo);

    let demo = Demo::start(&env);
    std::thread::sleep(Duration::from_millis(1_200)); // the crashed attempt's lease runs out
    let retry = post(&demo, Some(&key), &[], &body);
    assert_eq!(retry.status, 201, "{}", retry.body);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    let charge = retry.json()["id"].as_str().expect("id").to_owned();
    let again = post(&demo, Some(&key), &[], &body);
    assert_eq!(again.json()["id"], charge.as_str());

    let listed = charges_of(&demo.base, &customer);
    assert_eq!(listed["count"], 1, "charged once: {listed}");
    assert_eq!(listed["data"][0]["id"], charge.as_str());
    assert_eq!(demo.stop(), 0);
}

/// The crash header aborts the process: anyone who can reach the demo could stop it. Unless
/// the demo was started with `DEMO_CRASH=1`, the header is refused (403 problem+json),
/// nothing is charged, and the process goes on serving.
#[test]
fn the_crash_header_is_refused_unless_the_demo_allows_it() {
    let demo = Demo::start(&[]);
    let customer = format!("nocrash-{}", uuid::Uuid::new_v4().simple());
    let body = format!(r#"{{"amount": 1000, "currency": "eur", "customer": "{customer}"}}"#);
    let key = uuid::Uuid::new_v4().to_string();
    let refused = post(
        &demo,
        Some(&key),
        &[("x-demo-crash", "after-charge")],
        &body,
    );
    assert_problem(&refused, 403);
    assert!(
        refused.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("DEMO_CRASH=1")),
        "{}",
        refused.body
    );
    // Still serving: the list answers.
    let listed = charges_of(&demo.base, &customer);
    assert_eq!(listed["count"], 0, "nothing charged: {listed}");
    // The refusal is not the key's outcome: the same key without the header charges.
    let created = post(&demo, Some(&key), &[], &body);
    assert_eq!(created.status, 201, "{}", created.body);
    assert_eq!(created.header("idempotent-replayed"), None);
    assert_eq!(demo.stop(), 0, "graceful shutdown");
}

#[test]
fn postgres_mode_crash_after_charge_is_reconciled() {
    in_mode("postgres", crash_after_charge);
}

#[test]
fn hybrid_mode_crash_after_charge_is_reconciled() {
    in_mode("hybrid", crash_after_charge);
}

/// `admin release --completed` in hybrid mode while Redis refuses writes: nothing is released
/// (Redis still holds the copy, which would replay the record), and the command says so and
/// exits 2; run again once Redis answers, it deletes the record and its copy. (Postgres
/// deleted the record before and the command said "call again": a repeat after a request had
/// run under the key since released that request's record, which ran again.)
#[test]
fn hybrid_mode_a_cli_release_redis_refused_releases_nothing_until_it_answers() {
    use idempotency::{IdempotencyKey, RecordId, Scope, redis::redis};

    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        // A Redis of its own: its writes are paused below.
        let redis_service = services::start_redis(services::RedisOptions::default()).await;
        let env = [
            ("DATABASE_URL", pg.url().to_owned()),
            ("REDIS_URL", redis_service.url().to_owned()),
        ];
        let account = format!("acct-{}", uuid::Uuid::new_v4().simple());
        let key = uuid::Uuid::new_v4().to_string();
        let id = RecordId::new(
            &Scope::new(account.clone()),
            &IdempotencyKey::new(key.clone()).expect("key"),
        );
        let keys = idempotency::redis::RedisStore::builder(redis_service.url())
            .prefix("payments-demo")
            .connect()
            .await
            .expect("redis store");
        let record = keys.key(&id);
        let mut conn = redis::Client::open(redis_service.url())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection");
        let (env2, account2, key2) = (env.clone(), account.clone(), key.clone());
        tokio::task::spawn_blocking(move || {
            let env: Vec<(&str, &str)> = env2.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let demo = Demo::start(&env);
            let body =
                format!(r#"{{"amount": 1000, "currency": "eur", "customer": "{account2}"}}"#);
            let created = post(&demo, Some(&key2), &[("x-account-id", &account2)], &body);
            assert_eq!(created.status, 201, "{}", created.body);
            assert_eq!(demo.stop(), 0, "graceful shutdown");
        })
        .await
        .expect("demo");
        let copied: bool = redis::cmd("EXISTS")
            .arg(&record)
            .query_async(&mut conn)
            .await
            .expect("exists");
        assert!(copied, "the charge's outcome was copied into Redis");

        let _: () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(1500)
            .arg("WRITE")
            .query_async(&mut conn)
            .await
            .expect("CLIENT PAUSE");
        let cli = |args: &'static [&'static str]| {
            let (env, account, key) = (env.clone(), account.clone(), key.clone());
            tokio::task::spawn_blocking(move || {
                let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
                admin_cli(&env, &account, &key, args)
            })
        };
        let released = cli(&["release", "--completed"]).await.expect("cli");
        assert_eq!(released.status.code(), Some(2), "{released:?}");
        assert!(
            String::from_utf8_lossy(&released.stderr).contains("nothing was released"),
            "{released:?}"
        );
        // The pause is over: the record is still there, completed.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let inspected = cli(&["inspect"]).await.expect("cli");
        assert_eq!(inspected.status.code(), Some(0), "{inspected:?}");
        assert!(
            String::from_utf8_lossy(&inspected.stdout).contains(r#""state":"completed""#),
            "{inspected:?}"
        );
        let released = cli(&["release", "--completed"]).await.expect("cli");
        assert_eq!(released.status.code(), Some(0), "{released:?}");
        let left: bool = redis::cmd("EXISTS")
            .arg(&record)
            .query_async(&mut conn)
            .await
            .expect("exists");
        assert!(
            !left,
            "the deleted record's copy is left in Redis to replay it"
        );
    });
}
