//! The gateway's routes.

use std::{sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::{Path, Query, State},
    http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header, request::Parts},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use bytes::Bytes;
use idempotency::{
    Outcome, Scope,
    hybrid::HybridStore,
    tower::{IdempotencyContext, IdempotencyLayer, MaybeApplied, OutcomeUnknown, Problem},
};
use serde::Deserialize;
use serde_json::json;

use crate::{
    charges::{Charges, Created, NewCharge},
    config::Mode,
    orders::{Order, Orders, Placed},
};
use idempotency::postgres::Transition;

pub(crate) struct App {
    pub(crate) mode: Mode,
    pub(crate) charges: Charges,
    pub(crate) orders: Orders,
    pub(crate) pool: Option<sqlx::PgPool>,
    pub(crate) hybrid: Option<HybridStore>,
    pub(crate) redis: Option<idempotency::redis::RedisStore>,
    /// Renders what the library counted through the `metrics` facade.
    pub(crate) prometheus: metrics_exporter_prometheus::PrometheusHandle,
    /// `X-Demo-Crash` aborts the process only when the demo was started with `DEMO_CRASH=1`:
    /// otherwise anyone who can reach the demo could stop it.
    pub(crate) allow_crash: bool,
}

/// The scope of a key: the account. A stand-in for the authenticated principal.
/// `account_readable` has refused a header this cannot read: falling back to a shared scope
/// would replay one account's charge to another.
pub(crate) fn scope(parts: &Parts) -> Scope {
    Scope::new(
        parts
            .headers
            .get("x-account-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("anonymous"),
    )
}

/// Refuses an `X-Account-Id` that is empty or not visible ASCII (400): read as no account,
/// every such account would share the `anonymous` scope, and `josé` would be replayed
/// `zoë`'s charge under the same key.
async fn account_readable(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(account) = request.headers().get("x-account-id")
        && account.to_str().map_or(true, str::is_empty)
    {
        return problem(
            StatusCode::BAD_REQUEST,
            "invalid-account",
            "Unreadable account",
            "X-Account-Id must be 1 or more visible ASCII characters",
        );
    }
    next.run(request).await
}

/// The demo's routes, with the operator's (`admin`) when it has them.
pub(crate) fn router(app: Arc<App>, layer: IdempotencyLayer, admin: Option<Router>) -> Router {
    // Only the routes that create things carry the idempotency layer (key required): as a
    // route layer, so a request to no route (`POST /nope` with a key) claims nothing, and
    // its 404 is not stored as the key's outcome.
    let keyed = Router::new()
        .route("/charges", post(create_charge))
        .route("/orders", post(create_order))
        .route_layer(layer)
        .route_layer(axum::middleware::from_fn(account_readable))
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            demo_knobs_valid,
        ));
    Router::new()
        .route("/charges", get(list_charges))
        .route("/charges/{id}", get(get_charge))
        .route("/orders/{id}", get(get_order))
        .route("/orders/{id}/transitions", post(transition_order))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .merge(keyed)
        .with_state(app)
        .merge(admin.unwrap_or_default())
        // Last: over every route, the operator's included, and the fallback.
        .layer(axum::middleware::map_response(problems_only))
}

/// Answers the router's own refusals — an unknown route or method, a query or path it
/// cannot read, a body past its limit — as problem+json, like every other error of the
/// demo (axum answers them in plain text, or with no body). Their headers stay (`Allow`).
async fn problems_only(response: Response) -> Response {
    let status = response.status();
    let problem_already = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
    if !(status.is_client_error() || status.is_server_error()) || problem_already {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let title = status.canonical_reason().unwrap_or("Error");
    let detail = match String::from_utf8_lossy(&text).trim() {
        "" => title.to_owned(),
        text => text.to_owned(),
    };
    let kind = title.to_ascii_lowercase().replace(' ', "-");
    let problem = problem(status, &kind, title, &detail);
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.extend(problem.headers().clone());
    Response::from_parts(parts, problem.into_body())
}

/// The demo's knobs, headers outside the fingerprint: `X-Demo-Delay-Ms` (0 to 10000, before
/// the charge), `X-Demo-Delay-After-Ms` (0 to 10000, after the charge, before the answer: the
/// window in which a crash leaves a charge whose outcome is not stored), `X-Demo-Fail: 503`,
/// `X-Demo-Crash: after-charge`.
#[derive(Debug, Default)]
struct Knobs {
    delay: Option<Duration>,
    delay_after: Option<Duration>,
    fail: bool,
    crash: bool,
}

impl Knobs {
    fn read(headers: &axum::http::HeaderMap) -> Result<Self, &'static str> {
        let millis = |name: &str, rule: &'static str| {
            headers
                .get(name)
                .map(|delay| {
                    delay
                        .to_str()
                        .ok()
                        .and_then(|v| v.parse::<u64>().ok())
                        .filter(|ms| *ms <= 10_000)
                        .map(Duration::from_millis)
                        .ok_or(rule)
                })
                .transpose()
        };
        let delay = millis(
            "x-demo-delay-ms",
            "X-Demo-Delay-Ms must be an integer from 0 to 10000",
        )?;
        let delay_after = millis(
            "x-demo-delay-after-ms",
            "X-Demo-Delay-After-Ms must be an integer from 0 to 10000",
        )?;
        let fail = match headers.get("x-demo-fail").map(|v| v.as_bytes()) {
            None => false,
            Some(b"503") => true,
            Some(_) => return Err("X-Demo-Fail supports only 503"),
        };
        let crash = match headers.get("x-demo-crash").map(|v| v.as_bytes()) {
            None => false,
            Some(b"after-charge") => true,
            Some(_) => return Err("X-Demo-Crash supports only after-charge"),
        };
        Ok(Self {
            delay,
            delay_after,
            fail,
            crash,
        })
    }
}

/// Refuses `X-Demo-Crash` (403) unless the demo was started with `DEMO_CRASH=1` (the header
/// aborts the process, and anyone who can reach the demo could send it), and a knob it
/// cannot read (400). Outside the idempotency layer, so the refusal is not stored as the
/// key's outcome: the same key without the header charges.
async fn demo_knobs_valid(
    State(app): State<Arc<App>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if !app.allow_crash && request.headers().contains_key("x-demo-crash") {
        return problem(
            StatusCode::FORBIDDEN,
            "demo-crash-disabled",
            "Crash header disabled",
            "X-Demo-Crash aborts the process and is off: start the demo with DEMO_CRASH=1 to allow it",
        );
    }
    if let Err(detail) = Knobs::read(request.headers()) {
        return invalid(detail);
    }
    next.run(request).await
}

/// The operator's routes under `/admin` (`GET`/`DELETE`/`PUT /admin/idempotency/scopes/{account}/keys/{key}`),
/// for requests bearing `Authorization: Bearer <token>`: the demo's stand-in for the
/// application's own operator authentication.
pub(crate) fn admin(layer: &IdempotencyLayer, token: String) -> Router {
    let token: Arc<str> = token.into();
    Router::new().nest(
        "/admin",
        // The layer's own routes: an outcome resolved without a `retention_seconds` is kept
        // as long as the layer keeps the outcomes it stores.
        layer.admin_router().layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let token = token.clone();
                async move {
                    let presented = request
                        .headers()
                        .get(header::AUTHORIZATION)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.strip_prefix("Bearer "));
                    // Compared in constant time: the token is a password.
                    let allowed = presented.is_some_and(|p| {
                        bool::from(subtle::ConstantTimeEq::ct_eq(
                            p.as_bytes(),
                            token.as_bytes(),
                        ))
                    });
                    if !allowed {
                        let mut denied = problem(
                            StatusCode::UNAUTHORIZED,
                            "unauthorized",
                            "Operator credentials required",
                            "send Authorization: Bearer <ADMIN_TOKEN>",
                        );
                        denied
                            .headers_mut()
                            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                        return denied;
                    }
                    next.run(request).await
                }
            },
        )),
    )
}

/// The layer's reconcile hook: the charge a crashed attempt made, answered as the 201 that
/// attempt would have answered (replayed); no charge, the request runs.
pub(crate) fn reconcile(app: Arc<App>) -> OutcomeUnknown {
    OutcomeUnknown::reconcile(move |unresolved| {
        let app = app.clone();
        async move {
            // Only charges are looked for. The orders handler creates once per record id (a
            // unique constraint), so running it again answers the order a crashed attempt
            // made; a charge found under an order's record id (the key charged before its
            // record expired) is no answer to an order.
            if unresolved.uri.path() != "/charges" {
                return Ok(None);
            }
            let Some(charge) = app.charges.by_record(&unresolved.record_id).await? else {
                return Ok(None);
            };
            // The record id charged before, perhaps for another request that used the key
            // before its record expired: answer with the charge only if it is this one's.
            let asked = validate(&unresolved.body).ok();
            if !asked.is_some_and(|new| {
                charge.amount == new.amount
                    && charge.currency == new.currency
                    && charge.customer == new.customer
            }) {
                let reused = Problem::Mismatch;
                let body = json!({
                    "type": reused.type_uri(),
                    "title": reused.title(),
                    "status": reused.status().as_u16(),
                    "detail": "this Idempotency-Key already created a charge for a different request; use a new key for a new charge",
                });
                return Ok(Some(
                    Outcome::new(reused.status().as_u16())
                        .with_header("content-type", "application/problem+json")
                        .with_body(body.to_string()),
                ));
            }
            tracing::info!(charge = %charge.id, "an attempt crashed after charging: its charge is the outcome");
            // For the fault campaign (see `count_reconciled`); never holds up the answer.
            let (counted, id) = (app.clone(), charge.id.clone());
            tokio::spawn(async move {
                let count = counted.charges.count_reconciled(&id);
                if let Ok(Err(error)) = tokio::time::timeout(Duration::from_secs(5), count).await {
                    tracing::warn!(%error, charge = %id, "counting a reconciled charge failed");
                }
            });
            Ok(Some(
                Outcome::new(201)
                    .with_header("content-type", "application/json")
                    .with_header("location", format!("/charges/{}", charge.id))
                    .with_body(serde_json::to_vec(&charge)?),
            ))
        }
    })
}

pub(crate) fn problem(status: StatusCode, kind: &str, title: &str, detail: &str) -> Response {
    problem_of_type(
        status,
        &format!("urn:payments-demo:problem:{kind}"),
        title,
        detail,
    )
}

fn problem_of_type(status: StatusCode, type_uri: &str, title: &str, detail: &str) -> Response {
    let body = json!({
        "type": type_uri,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

fn invalid(detail: &str) -> Response {
    problem(
        StatusCode::BAD_REQUEST,
        "invalid-request",
        "Invalid request",
        detail,
    )
}

/// The layer's own 422 for a key reused for another request (same type, status and title),
/// for when only the charge or order remembers the first request: the key's record has
/// expired.
fn key_reused(detail: &str) -> Response {
    let reused = Problem::Mismatch;
    problem_of_type(reused.status(), reused.type_uri(), reused.title(), detail)
}

fn storage_down(error: &sqlx::Error) -> Response {
    tracing::warn!(%error, "charges storage failed");
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "storage-unavailable",
        "Charges storage unavailable",
        "the charge was not created; retry with the same Idempotency-Key",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// A charge's or order's insert that failed. A statement the database refused wrote
/// nothing; one whose answer was lost (the connection broke, the server went down, a pooler
/// answered an error for a server connection that broke after the commit) may have
/// committed: that 503 is marked [`MaybeApplied`], so the layer keeps the key for the
/// reconcile hook (which finds the row, or runs again) instead of giving it back to a retry
/// that runs the handler a second time. Which is which is the store's own rule
/// ([`may_have_committed`](idempotency::postgres::may_have_committed)): a database error is
/// not by itself a refusal.
fn write_failed(error: &sqlx::Error) -> Response {
    if !idempotency::postgres::may_have_committed(error) {
        return storage_down(error);
    }
    tracing::warn!(%error, "charges storage failed; the write may have committed");
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "storage-unavailable",
        "Charges storage unavailable",
        "the write may have been made: retry with the same Idempotency-Key, which finds it \
         or makes it",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response.extensions_mut().insert(MaybeApplied);
    response
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChargeRequest {
    amount: serde_json::Value,
    currency: serde_json::Value,
    customer: serde_json::Value,
}

/// The field rules charges and orders share; the error says what is allowed.
fn amount_of(value: &serde_json::Value) -> Result<i64, &'static str> {
    value
        .as_i64()
        .filter(|a| (1..=100_000_000).contains(a))
        .ok_or("amount must be an integer from 1 to 100000000 (minor units)")
}

/// A customer: 1 to 64 characters, none of them a control character (NUL among them, which
/// Postgres refuses in text: a database error taken for an outage, 503 on every retry).
fn customer_of(value: &serde_json::Value) -> Result<String, &'static str> {
    value
        .as_str()
        .filter(|c| (1..=64).contains(&c.chars().count()) && !c.chars().any(char::is_control))
        .map(str::to_owned)
        .ok_or("customer must be a string of 1 to 64 characters, none of them a control character")
}

fn currency_of(value: &serde_json::Value) -> Result<String, &'static str> {
    value
        .as_str()
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_lowercase()))
        .map(str::to_owned)
        .ok_or("currency must be 3 lowercase letters, e.g. \"eur\"")
}

fn validate(body: &Bytes) -> Result<NewCharge, Box<Response>> {
    let request: ChargeRequest = serde_json::from_slice(body).map_err(|e| {
        Box::new(invalid(&format!(
            "the body must be JSON {{\"amount\": <integer>, \"currency\": \"<3 letters>\", \"customer\": \"<name>\"}}: {e}"
        )))
    })?;
    let field = |rule: &'static str| Box::new(invalid(rule));
    Ok(NewCharge {
        amount: amount_of(&request.amount).map_err(field)?,
        currency: currency_of(&request.currency).map_err(field)?,
        customer: customer_of(&request.customer).map_err(field)?,
    })
}

async fn create_charge(
    State(app): State<Arc<App>>,
    ctx: IdempotencyContext,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let new = match validate(&body) {
        Ok(new) => new,
        Err(response) => return *response,
    };
    // Demo knobs, outside the fingerprint: open the in-flight window, or fail like a
    // flaky processor. (Read before the key was claimed: see `demo_knobs_valid`.)
    let knobs = Knobs::read(&headers).unwrap_or_default();
    if let Some(delay) = knobs.delay {
        tokio::time::sleep(delay).await;
    }
    if knobs.fail {
        let mut response = problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "processor-unavailable",
            "Payment processor unavailable",
            "the card was not charged (X-Demo-Fail); retry with the same Idempotency-Key",
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return response;
    }
    let crash = knobs.crash;
    let created = app.charges.create(&ctx.record_id, &new).await;
    if let (Some(delay), Ok(_), false) = (knobs.delay_after, &created, crash) {
        tokio::time::sleep(delay).await;
    }
    match created {
        Ok(Created::New(_)) if crash => {
            // The charge row is committed; the outcome is not stored: the process dies as a
            // crash would, and the key's lease runs out unfinished (outcome unknown).
            tracing::warn!("X-Demo-Crash: after-charge: aborting the process");
            std::process::abort();
        }
        Ok(Created::New(charge)) => {
            let location = format!("/charges/{}", charge.id);
            (
                StatusCode::CREATED,
                [(header::LOCATION, location)],
                Json(charge),
            )
                .into_response()
        }
        // The same operation again, its stored outcome gone: the charge it made, not a new
        // one, and not 201 — the client must not count it twice.
        Ok(Created::Existing(charge)) => {
            let location = format!("/charges/{}", charge.id);
            (
                StatusCode::OK,
                [
                    (header::LOCATION, location),
                    (
                        HeaderName::from_static("idempotent-replayed"),
                        "true".into(),
                    ),
                ],
                Json(charge),
            )
                .into_response()
        }
        Ok(Created::Conflict(existing)) => {
            tracing::info!(charge = %existing.id, "a key whose record expired was reused for another charge");
            key_reused(
                "this Idempotency-Key already created a charge for a different request \
                 (amount, currency or customer differ); use a new key for a new charge",
            )
        }
        Err(error) => write_failed(&error),
    }
}

async fn get_charge(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match app.charges.get(&id).await {
        Ok(Some(charge)) => Json(charge).into_response(),
        Ok(None) => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Charge not found",
            &format!("no charge {id}"),
        ),
        Err(error) => storage_down(&error),
    }
}

#[derive(Deserialize)]
struct ListQuery {
    customer: Option<String>,
}

async fn list_charges(State(app): State<Arc<App>>, Query(query): Query<ListQuery>) -> Response {
    match app.charges.list(query.customer.as_deref()).await {
        Ok(data) => Json(json!({ "count": data.len(), "data": data })).into_response(),
        Err(error) => storage_down(&error),
    }
}

async fn healthz(State(app): State<Arc<App>>) -> Response {
    let mut stores = serde_json::Map::new();
    if let Some(pool) = &app.pool {
        let up = tokio::time::timeout(
            Duration::from_secs(1),
            sqlx::query("SELECT 1").execute(pool),
        )
        .await
        .is_ok_and(|r| r.is_ok());
        stores.insert("postgres".into(), json!(if up { "up" } else { "down" }));
    }
    if let Some(redis) = &app.redis {
        let up = redis.ping().await.is_ok();
        let state = match &app.hybrid {
            Some(h) if h.metrics().breaker_state != idempotency::hybrid::BreakerState::Closed => {
                "breaker_open"
            }
            _ if up => "up",
            _ => "down",
        };
        stores.insert("redis".into(), json!(state));
    }
    if app.mode == Mode::Memory {
        stores.insert("memory".into(), json!("up"));
    }
    Json(json!({ "mode": app.mode.to_string(), "stores": stores })).into_response()
}

/// The Prometheus exposition of every counter, gauge and histogram the library recorded
/// (the layer's decisions, the hybrid store's Redis use and breaker, each store call's
/// latency).
async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.prometheus.render(),
    )
        .into_response()
}

fn with_etag(status: StatusCode, order: &Order) -> Response {
    let etag = format!("\"{}\"", order.version);
    (status, [(header::ETAG, etag)], Json(order)).into_response()
}

fn order_not_found(id: &str) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "not-found",
        "Order not found",
        &format!("no order {id}"),
    )
}

async fn create_order(
    State(app): State<Arc<App>>,
    ctx: IdempotencyContext,
    body: Bytes,
) -> Response {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct NewOrder {
        customer: serde_json::Value,
        amount: serde_json::Value,
    }
    let Ok(new) = serde_json::from_slice::<NewOrder>(&body) else {
        return invalid("the body must be JSON {\"customer\": \"<name>\", \"amount\": <integer>}");
    };
    let (customer, amount) = match (customer_of(&new.customer), amount_of(&new.amount)) {
        (Ok(customer), Ok(amount)) => (customer, amount),
        (Err(rule), _) | (_, Err(rule)) => return invalid(rule),
    };
    let located = |status: StatusCode, order: &Order| {
        let mut response = with_etag(status, order);
        if let Ok(location) = HeaderValue::from_str(&format!("/orders/{}", order.id)) {
            response.headers_mut().insert(header::LOCATION, location);
        }
        response
    };
    match app.orders.create(&ctx.record_id, &customer, amount).await {
        Ok(Placed::New(order)) => located(StatusCode::CREATED, &order),
        // The same operation again, its stored outcome gone: the order it created (as it is
        // now), not a new one, and not 201 — the client must not count it twice.
        Ok(Placed::Existing(order)) => {
            let mut response = located(StatusCode::OK, &order);
            response.headers_mut().insert(
                HeaderName::from_static("idempotent-replayed"),
                HeaderValue::from_static("true"),
            );
            response
        }
        Ok(Placed::Conflict(existing)) => {
            tracing::info!(order = %existing.id, "a key whose record expired was reused for another order");
            key_reused(
                "this Idempotency-Key already created an order for a different request \
                 (customer or amount differ); use a new key for a new order",
            )
        }
        Err(error) => write_failed(&error),
    }
}

async fn get_order(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match app.orders.get(&id).await {
        Ok(Some(order)) => with_etag(StatusCode::OK, &order),
        Ok(None) => order_not_found(&id),
        Err(error) => storage_down(&error),
    }
}

/// `If-Match: "<version>"` (a weak `W/` prefix is tolerated: versions compare exactly).
fn if_match_version(headers: &HeaderMap) -> Option<Result<i64, ()>> {
    let value = headers.get(header::IF_MATCH)?;
    let parsed = value
        .to_str()
        .ok()
        .map(|v| v.trim().trim_start_matches("W/").trim_matches('"'))
        .and_then(|v| v.parse::<i64>().ok())
        .ok_or(());
    Some(parsed)
}

async fn transition_order(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let expected = match if_match_version(&headers) {
        None => {
            return problem(
                StatusCode::PRECONDITION_REQUIRED,
                "precondition-required",
                "If-Match required",
                "send If-Match with the order's ETag (its version) to change its status",
            );
        }
        Some(Err(())) => return invalid("If-Match must be the order's ETag, e.g. \"3\""),
        Some(Ok(version)) => version,
    };
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Move {
        to: String,
    }
    // Any status of the machine is well-formed; whether the move is allowed is the
    // machine's answer (409), not a matter of syntax (400).
    let to = match serde_json::from_slice::<Move>(&body) {
        Ok(m) if crate::orders::machine().is_state(&m.to) => m.to,
        _ => {
            return invalid(
                "the body must be {\"to\": \"pending\" | \"processing\" | \"shipped\" | \"completed\"}",
            );
        }
    };
    let outcome = match app.orders.transition(&id, &to, expected).await {
        Ok(outcome) => outcome,
        Err(idempotency::postgres::TransitionError::Database(error)) => {
            return storage_down(&error);
        }
        Err(error) => return invalid(&error.to_string()),
    };
    match outcome {
        // Applied, or repeated: both answer with the order as it is now.
        Transition::Applied { .. } | Transition::AlreadyApplied { .. } => {
            match app.orders.get(&id).await {
                Ok(Some(order)) => with_etag(StatusCode::OK, &order),
                Ok(None) => order_not_found(&id),
                Err(error) => storage_down(&error),
            }
        }
        Transition::NotFound => order_not_found(&id),
        Transition::Conflict { status, version } if version != expected => problem(
            StatusCode::PRECONDITION_FAILED,
            "stale-version",
            "The order changed",
            &format!(
                "the order is at version {version} (status {status}), not {expected}: read it again"
            ),
        ),
        Transition::Conflict { status, .. } => problem(
            StatusCode::CONFLICT,
            "forbidden-transition",
            "Transition not allowed",
            &format!(
                "an order cannot move from {status} to {to}: the path is pending -> processing -> shipped -> completed"
            ),
        ),
        // A transition answer this demo does not know yet: say so rather than guess.
        _ => problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "unexpected-transition",
            "Unexpected transition answer",
            "the order's state machine answered in a way this server does not handle",
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;

    /// A database error as a pooler or the server sends it, with its SQLSTATE.
    #[derive(Debug)]
    struct Sqlstate(&'static str);

    impl std::fmt::Display for Sqlstate {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SQLSTATE {}", self.0)
        }
    }

    impl std::error::Error for Sqlstate {}

    impl sqlx::error::DatabaseError for Sqlstate {
        fn message(&self) -> &str {
            "an error"
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    /// A database error is not by itself "nothing was written": PgBouncer answers `08P01`
    /// when its server connection broke, which can be after the insert committed. Before,
    /// every database error was answered "the charge was not created" and the key given
    /// back, and the retry ran the handler again.
    #[test]
    fn a_database_error_that_may_follow_the_commit_is_maybe_applied() {
        for (code, maybe) in [
            ("08P01", true),
            ("57P01", true),
            ("23505", false),
            ("55P03", false),
        ] {
            let error = sqlx::Error::Database(Box::new(Sqlstate(code)));
            let answer = write_failed(&error);
            assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE, "{code}");
            assert_eq!(
                answer.extensions().get::<MaybeApplied>().is_some(),
                maybe,
                "{code}"
            );
        }
    }
}
