//! The operator's routes: read a key's record, release a stuck one, resolve an attempt whose
//! outcome is unknown.
//!
//! Mount [`admin_router`] behind the application's own authentication: it answers for any
//! scope it is asked about.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, SystemTime},
};

use axum::{
    Router,
    body::Bytes,
    extract::{
        Path, RawQuery, State,
        rejection::{BytesRejection, PathRejection},
    },
    response::{IntoResponse, Response},
    routing::{any, get},
};
use http::{HeaderValue, StatusCode, header};
use idempotency_core::{
    Error, ForceReleased, IdempotencyKey, Inspection, Outcome, Policy, RecordId, RecordState,
    ReleaseScope, Resolved, Scope, Store,
};

use crate::Problem;

/// The admin routes over `store`, to nest under a prefix of the application's choice:
///
/// - `GET /idempotency/scopes/{scope}/keys/{key}`: `200` with the record as JSON (below), or
///   `404` problem+json when there is none;
/// - `DELETE /idempotency/scopes/{scope}/keys/{key}`: `204` after releasing an in-flight record
///   whose lease ran out (the holder's late completion is refused); `409` problem+json for a
///   live lease unless the query says `?live=true`, and for a completed record unless it
///   says `?completed=true` (then it is deleted, and the key runs again on its next request);
///   `404` when there is none. Whether the lease ran out is checked by the store with the
///   delete, so a retry that took the key over since you looked keeps its lease;
/// - `PUT /idempotency/scopes/{scope}/keys/{key}`: resolves an attempt whose outcome is
///   unknown (an in-flight record whose lease ran out) as having taken effect: the JSON body
///   is the response its retries get from now on, stored as the key's outcome, and `204`
///   (below). `409` problem+json for a live lease (its holder, or a retry being told the
///   outcome is unknown, holds it: look again), for a completed record, and for a record
///   another request (another body, method, path…) made after the attempt's was released since it was read
///   (`record-replaced`); `404` when there is none, and when the record was released (by
///   another operator's `DELETE`) or purged since it was read. It runs to its end in a task
///   of its own: an operator who hangs up does not leave it half done;
/// - the same three at `/idempotency/keys/{key}` for the global scope.
///
/// **Resolving.** Under [`OutcomeUnknown::Reject`](crate::OutcomeUnknown::Reject) an
/// attempt that never stored its outcome is kept, and its retries are told `409`
/// outcome-unknown, until an operator reconciles it: found its effect (the card was
/// charged) — `PUT` the response the retries should get; found none — `DELETE`, and the next
/// request runs. The `PUT` is [`resolve_unknown`](idempotency_core::resolve_unknown): it takes
/// the record over under the attempt's own fingerprint and completes it, so a retry that took
/// the key over meanwhile keeps it (`409`), and the attempt's own late completion is
/// refused. Its body:
///
/// ```json
/// {"status": 201, "headers": {"content-type": "application/json"},
///  "body": "{\"id\":\"ch_1\"}", "retention_seconds": 86400}
/// ```
///
/// `status` is 200 to 599; `headers` (optional; at most 100, each name once, in any case)
/// are sent with every replay, except those the server sets itself (`content-length`,
/// `transfer-encoding`, `date`, hop-by-hop fields), a proxy's, `content-encoding` (the
/// body is text) and `Idempotency-Expires` (a date the store would not keep to), which are
/// a `400`; `body` (optional) is text; `retention_seconds` (optional) is how long the
/// outcome is kept: by default the layer's retention from
/// [`IdempotencyLayer::admin_router`](crate::IdempotencyLayer::admin_router) (prefer it: the
/// key's retries come as long as the layer keeps outcomes), a day from this function, which
/// does not know the layer's.
///
/// **Releasing a live lease (`?live=true`) lets the operation run again while its holder may
/// still be running it.** Fencing refuses the holder's later writes to the store (its outcome
/// is not stored), not its side effects. Release a live lease only when you know its holder is
/// stuck (it renews its lease while it runs). Release even a lease that ran out only after
/// reconciling its attempt: afterwards the key runs again as new, not as "outcome unknown".
///
/// **A `503` does not say nothing happened.** The store did not answer in time: its delete
/// may have committed all the same. Do not repeat the `DELETE` blindly: `GET` the record
/// first. A `404`, or a record that is not the one you meant (another `created_at`: a
/// request ran under the key since), says yours was released — a repeated `DELETE
/// ?completed=true` or `?live=true` would release the new request's record and let it run
/// again. (The hybrid store keeps a completed record while Redis is unreachable, and
/// answers `503` having changed nothing: the record's copy in Redis would go on replaying
/// it. An in-flight record it releases whether or not Redis answers, and says so; the
/// process that answered deletes the lease's mirror once Redis is back; and a `404` from it
/// says Postgres has no record, not that Redis was told: a copy a release cut short left
/// there replays until that process's delete gets through. A copy another
/// gateway wrote back while the release ran is deleted by that process too, tried for an
/// hour: stop it sooner, and the copy may replay the released record until Redis drops it.)
///
/// `{scope}` is what the layer's scope function returns for the requests that use the key,
/// and `{key}` is the `Idempotency-Key` value, each percent-encoded in the path (a key may
/// hold `/`: `order/42` is `order%2F42`). The key is read as the layer reads the header: the
/// sf-string `"order-42"` (`%22order-42%22`) and the bare `order-42` name one record. A path
/// with a segment too many (a `/` left unencoded) is `400`, never another record:
/// `/idempotency/keys/a/b` does not name key `b` of scope `a`. A scope or key that is `.` or
/// `..` is sent as `%2E` / `%2E%2E` by a client that leaves dot-segments alone (`curl
/// --path-as-is`): most clients remove them, even encoded, so `scopes/../keys/k` would
/// arrive as `keys/k`, the global scope's key. A malformed key is `400`, an unreachable store `503`, a path under the
/// routes that names nothing `404` (`400` under `idempotency/scopes/`, most often an
/// unencoded `/`), a method they do not take `405` with `Allow`, a `PUT` body over the
/// router's body limit (axum's `DefaultBodyLimit`, 2 MB unless set) `413`: all problem+json.
///
/// The JSON view:
///
/// ```json
/// {"scope": "acct_1", "key": "order-42", "record_id": "…64 hex…",
///  "state": "in_flight", "fingerprint": "…64 hex…",
///  "created_at": "2026-12-01T05:40:00.123Z", "expires_at": "2026-12-01T05:40:30.123Z",
///  "lease_remaining_ms": 29874}
/// ```
///
/// A completed record has `"state": "completed"` and `"status": 201` instead of
/// `lease_remaining_ms`; `created_at` is `null` where the store does not keep it (Redis).
/// Times are the store's clock, RFC 3339 in UTC.
///
/// The routes carry no authentication of their own (in production, compare a token in
/// constant time, as the demo does with `subtle`):
///
/// ```
/// use std::sync::Arc;
/// use axum::{Router, extract::Request, http::StatusCode, middleware::{self, Next}, response::Response};
/// use idempotency_core::{MemoryStore, Store};
///
/// async fn operators_only(request: Request, next: Next) -> Result<Response, StatusCode> {
///     let bearer = request.headers().get("authorization").and_then(|v| v.to_str().ok());
///     if bearer != Some("Bearer s3cret") {
///         return Err(StatusCode::UNAUTHORIZED);
///     }
///     Ok(next.run(request).await)
/// }
///
/// let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
/// let app: Router = Router::new().nest(
///     "/admin",
///     idempotency_tower::admin_router(store).layer(middleware::from_fn(operators_only)),
/// );
/// ```
pub fn admin_router(store: Arc<dyn Store>) -> Router {
    routes(Routes {
        store,
        retention: Policy::default().retention(),
        advertise_expiry: false,
        detached: None,
    })
}

/// What the routes act on: the store, and how long a resolved outcome is kept when the `PUT`
/// does not say (the layer's retention, from
/// [`IdempotencyLayer::admin_router`](crate::IdempotencyLayer::admin_router); a day from
/// [`admin_router`]).
#[derive(Clone)]
pub(crate) struct Routes {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) retention: Duration,
    /// Whether a resolved outcome carries `Idempotency-Expires`, as the layer's do
    /// ([`IdempotencyLayer::advertise_expiry`](crate::IdempotencyLayer::advertise_expiry)).
    pub(crate) advertise_expiry: bool,
    /// Where a resolution runs (the layer's tasks, which its `drain` waits for); `None`: a
    /// task of its own.
    pub(crate) detached: Option<tokio_util::task::TaskTracker>,
}

pub(crate) fn routes(state: Routes) -> Router {
    // The scoped and the global routes differ in more than a segment's count: were they
    // `keys/{scope}/{key}` and `keys/{key}`, a global key `a/b` sent unencoded would name key
    // `b` of scope `a`, and a `?live=true` release another record's live lease. (The global
    // scope, the layer's default, is the empty string: an empty path segment that proxies
    // merging slashes would lose.)
    Router::new()
        .route(
            "/idempotency/scopes/{scope}/keys/{key}",
            get(inspect).delete(release).put(resolve),
        )
        .route(
            "/idempotency/keys/{key}",
            get(inspect).delete(release).put(resolve),
        )
        .route("/idempotency/keys/{key}/{*rest}", any(too_many_segments))
        .route(
            "/idempotency/scopes/{scope}/keys/{key}/{*rest}",
            any(too_many_segments),
        )
        // Problems too, not the router's plain, empty answers. (Routes, not a fallback:
        // merged into an application that has a fallback of its own, a second one panics.)
        .route("/idempotency", any(no_such_route))
        .route("/idempotency/", any(no_such_route))
        .route("/idempotency/{*rest}", any(no_such_route))
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// A method the path does not take (the router adds the `Allow` header to a 405).
async fn method_not_allowed() -> Response {
    problem(
        Problem::MethodNotAllowed,
        "a record is read with GET, released with DELETE and resolved with PUT",
    )
}

/// A path that names no admin resource; under `idempotency/scopes/`, most often a scope with
/// a `/` left unencoded, or a path that stops short of the key: a 400 that says so.
async fn no_such_route(uri: http::Uri) -> Response {
    if uri.path().starts_with("/idempotency/scopes/") {
        return problem(
            Problem::InvalidRequest,
            "the path does not name a scope and a key: a scope's key is at \
             idempotency/scopes/{scope}/keys/{key}; percent-encode a '/' in a scope or a key \
             (%2F)",
        );
    }
    problem(
        Problem::NoSuchRoute,
        "the admin routes are idempotency/scopes/{scope}/keys/{key} and \
         idempotency/keys/{key} (the global scope)",
    )
}

/// A path with a segment after the key: a `/` in a key or a scope left unencoded.
async fn too_many_segments() -> Response {
    problem(
        Problem::InvalidRequest,
        "the path has a segment after the key: percent-encode a '/' in a key or a scope \
         (%2F); a scope's key is at idempotency/scopes/{scope}/keys/{key}, a global key at \
         idempotency/keys/{key}",
    )
}

/// The scope and key named by the path (no scope segment: the global scope).
type Named = Result<Path<HashMap<String, String>>, PathRejection>;

fn problem(problem: Problem, detail: &str) -> Response {
    problem.response(detail, None).map(axum::body::Body::new)
}

fn store_problem(error: &Error) -> Response {
    match error {
        Error::Unavailable(_) => problem(
            Problem::StoreUnavailable,
            &format!("the store did not answer: {error}"),
        ),
        _ => problem(Problem::Internal, &format!("the store failed: {error}")),
    }
}

/// The scope, key and record the path names; a path that does not decode, or a malformed
/// key, is a 400 problem.
fn record_id(named: Named) -> Result<(String, IdempotencyKey, RecordId), Box<Response>> {
    let Path(mut params) = named.map_err(|rejection| {
        Box::new(problem(
            Problem::InvalidRequest,
            &format!("the path does not name a scope and key: {rejection}"),
        ))
    })?;
    let scope = params.remove("scope").unwrap_or_default();
    let key = params.remove("key").unwrap_or_default();
    // Read as the layer reads the header (an sf-string or a bare key): the quoted form an
    // operator copies from a request log names the record the layer wrote.
    let key = crate::key::parse_value(key.as_bytes()).map_err(|e| {
        let why = match e {
            crate::key::KeyProblem::Invalid(why) => why,
            crate::key::KeyProblem::Multiple => "more than one key".to_owned(),
        };
        Box::new(problem(
            Problem::InvalidKey,
            &format!("{key:?} is not a valid key: {why}"),
        ))
    })?;
    let id = RecordId::new(&Scope::new(scope.clone()), &key);
    Ok((scope, key, id))
}

fn rfc3339(t: SystemTime) -> String {
    jiff::Timestamp::try_from(t)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// The JSON view of a record that `GET /idempotency/scopes/{scope}/keys/{key}` answers (see
/// [`admin_router`]), for tools that read the store themselves (a CLI, a log line).
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use idempotency_core::{Fingerprint, IdempotencyKey, Inspection, RecordId, Scope};
///
/// let key = IdempotencyKey::new("order-42").unwrap();
/// let id = RecordId::new(&Scope::new("acct_1"), &key);
/// let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_567_600);
/// let record = Inspection::completed(Fingerprint::of(b"body"), None, at, 201);
/// let view = idempotency_tower::record_view("acct_1", &key, &id, &record);
/// assert_eq!(view["state"], "completed");
/// assert_eq!(view["status"], 201);
/// assert_eq!(view["expires_at"], "2025-12-01T05:40:00Z");
/// ```
pub fn record_view(
    scope: &str,
    key: &IdempotencyKey,
    id: &RecordId,
    record: &Inspection,
) -> serde_json::Value {
    let key = key.as_str();
    let mut view = serde_json::json!({
        "scope": scope,
        "key": key,
        "record_id": id.to_hex(),
        "fingerprint": record.fingerprint.to_hex(),
        "created_at": record.created_at.map(rfc3339),
        "expires_at": rfc3339(record.expires_at),
    });
    match record.state {
        RecordState::InFlight { lease_remaining } => {
            view["state"] = "in_flight".into();
            view["lease_remaining_ms"] = (lease_remaining.as_millis() as u64).into();
        }
        RecordState::Completed { status } => {
            view["state"] = "completed".into();
            view["status"] = status.into();
        }
        // A state a newer core knows: shown by name, without its details.
        other => view["state"] = format!("{other:?}").into(),
    }
    view
}

async fn inspect(State(Routes { store, .. }): State<Routes>, named: Named) -> Response {
    let (scope, key, id) = match record_id(named) {
        Ok(named) => named,
        Err(response) => return *response,
    };
    match store.inspect(&id).await {
        Ok(Some(record)) => {
            let mut response = record_view(&scope, &key, &id, &record)
                .to_string()
                .into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
        Ok(None) => problem(
            Problem::RecordNotFound,
            "no live record for this scope and key (never used, released, or past its retention)",
        ),
        Err(error) => store_problem(&error),
    }
}

async fn release(
    State(Routes { store, .. }): State<Routes>,
    named: Named,
    RawQuery(query): RawQuery,
) -> Response {
    let (mut completed, mut live) = (false, false);
    for pair in query.as_deref().unwrap_or("").split('&') {
        match pair.split_once('=').unwrap_or((pair, "")) {
            ("", _) => {}
            ("completed", "true") => completed = true,
            ("completed", "false") => completed = false,
            ("live", "true") => live = true,
            ("live", "false") => live = false,
            _ => {
                return problem(
                    Problem::InvalidRequest,
                    &format!(
                        "unknown query {pair:?}: the parameters are live=true|false and completed=true|false"
                    ),
                );
            }
        }
    }
    let mut scope = ReleaseScope::default();
    if live {
        scope = scope.with_live();
    }
    if completed {
        scope = scope.with_completed();
    }
    let (_, _, id) = match record_id(named) {
        Ok(named) => named,
        Err(response) => return *response,
    };
    match store.force_release(&id, scope).await {
        Ok(ForceReleased::Released | ForceReleased::Deleted) => {
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(ForceReleased::Completed) => problem(
            Problem::RecordCompleted,
            "the record is completed: its outcome replays to retries; delete it with ?completed=true to let the key run again",
        ),
        Ok(ForceReleased::Live) => problem(
            Problem::LeaseLive,
            "the record's lease is live: its holder renews it while the operation runs; release it with ?live=true only if you know the holder is stuck (the operation may then run twice)",
        ),
        Ok(ForceReleased::Absent) => problem(
            Problem::RecordNotFound,
            "no live record for this scope and key (never used, released, or past its retention)",
        ),
        // `ForceReleased` may grow: an answer this version does not know changed nothing it
        // can vouch for.
        Ok(other) => problem(Problem::Internal, &format!("unexpected answer {other:?}")),
        Err(error) => store_problem(&error),
    }
}

/// Fields a stored outcome never carries: those the server sets itself (framing, hop-by-hop,
/// `date`), those of a proxy, and `content-encoding` (the body given is text, not encoded).
const NOT_STORED: [&str; 12] = [
    "connection",
    "content-encoding",
    "content-length",
    "date",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Header fields a `PUT` outcome may name: as many as a client reads in a response by
/// default (hyper's limit). Unbounded, an outcome could name more than a response holds
/// (24,576), and every replay of its key would fail.
const MAX_HEADERS: usize = 100;

/// The outcome and retention a `PUT` body names; a 400 problem when it does not.
fn resolution(body: &[u8], retention: Duration) -> Result<(Outcome, Duration), Box<Response>> {
    let bad = |detail: String| Box::new(problem(Problem::InvalidRequest, &detail));
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("the body is not JSON: {e}")))?;
    let Some(fields) = value.as_object() else {
        return Err(bad("the body is a JSON object: {\"status\": 201, …}".into()));
    };
    if let Some(unknown) = fields
        .keys()
        .find(|name| !["status", "headers", "body", "retention_seconds"].contains(&name.as_str()))
    {
        return Err(bad(format!(
            "unknown field {unknown:?}: the fields are status, headers, body and retention_seconds"
        )));
    }
    let status = fields
        .get("status")
        .and_then(serde_json::Value::as_u64)
        .and_then(|status| u16::try_from(status).ok())
        .filter(|status| (200..=599).contains(status))
        .ok_or_else(|| bad("\"status\" is a number from 200 to 599".into()))?;
    let mut outcome = Outcome::new(status);
    match fields.get("headers") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(headers)) if headers.len() > MAX_HEADERS => {
            return Err(bad(format!(
                "{} headers: an outcome names {MAX_HEADERS} at most",
                headers.len()
            )));
        }
        Some(serde_json::Value::Object(headers)) => {
            for (name, value) in headers {
                let lower = name.to_ascii_lowercase();
                let value = value.as_str().ok_or_else(|| {
                    bad(format!(
                        "the header {name:?} has a value that is not a string"
                    ))
                })?;
                if http::HeaderName::from_bytes(lower.as_bytes()).is_err()
                    || HeaderValue::from_str(value).is_err()
                {
                    return Err(bad(format!("{name:?}: {value:?} is not a valid header")));
                }
                if lower == idempotency_core::OUTCOME_NOT_STORED {
                    return Err(bad(format!(
                        "{name:?} is the layer's own marker of an outcome it could not store"
                    )));
                }
                if lower == crate::IDEMPOTENCY_EXPIRES {
                    return Err(bad(format!(
                        "{name:?} is not stored: a date given here would outlive the \
                         retention the store keeps (retention_seconds says how long)"
                    )));
                }
                if NOT_STORED.contains(&lower.as_str()) {
                    return Err(bad(format!(
                        "{name:?} is not stored: the server frames each replay itself, and \
                         the body given is text"
                    )));
                }
                if outcome.headers.iter().any(|(stored, _)| *stored == lower) {
                    return Err(bad(format!("the header {name:?} is given twice")));
                }
                outcome = outcome.with_header(lower, value.to_owned());
            }
        }
        Some(_) => {
            return Err(bad(
                "\"headers\" is an object of names and string values".into()
            ));
        }
    }
    match fields.get("body") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::String(body)) => outcome = outcome.with_body(body.clone()),
        Some(_) => return Err(bad("\"body\" is a string".into())),
    }
    let retention = match fields.get("retention_seconds") {
        None | Some(serde_json::Value::Null) => retention,
        Some(seconds) => seconds
            .as_u64()
            .filter(|seconds| *seconds > 0)
            // As every store keeps it: at most "for good" (a century).
            .map(|seconds| Duration::from_secs(seconds).min(idempotency_core::FOR_GOOD))
            .ok_or_else(|| bad("\"retention_seconds\" is a whole number above 0".into()))?,
    };
    Ok((outcome, retention))
}

/// `PUT`: stores the outcome an operator found for an attempt whose outcome is unknown (see
/// [`admin_router`]).
async fn resolve(
    State(Routes {
        store,
        retention,
        advertise_expiry,
        detached,
    }): State<Routes>,
    named: Named,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (_, _, id) = match record_id(named) {
        Ok(named) => named,
        Err(response) => return *response,
    };
    let body = match body {
        Ok(body) => body,
        // Over axum's body limit (2 MB unless the router sets `DefaultBodyLimit`): 413, so
        // the operator knows it is the size, not the shape.
        Err(rejection) if rejection.status() == http::StatusCode::PAYLOAD_TOO_LARGE => {
            return problem(
                Problem::PayloadTooLarge,
                &format!("the body is larger than the routes take: {rejection}"),
            );
        }
        Err(rejection) => {
            return problem(
                Problem::InvalidRequest,
                &format!("the body could not be read: {rejection}"),
            );
        }
    };
    let (outcome, retention) = match resolution(&body, retention) {
        Ok(resolution) => resolution,
        Err(response) => return *response,
    };
    // As the layer dates what it stores: from now, before the store counts its retention.
    let expires = advertise_expiry
        .then(|| crate::service::expires_after(retention))
        .flatten();
    let outcome = match expires {
        Some(date) => outcome.with_header(crate::IDEMPOTENCY_EXPIRES, date.as_bytes().to_vec()),
        None => outcome,
    };
    // In a task of its own: an operator who hangs up mid-way (an interrupted `curl`) does not
    // leave it half done — its takeover held and its outcome not stored, the key then read
    // as an attempt whose outcome is unknown once the resolving lease ran out.
    // So too what it leaves running (a claim whose give-back failed, retried): the layer's
    // drain waits for both.
    let tracker = detached.unwrap_or_default();
    let settling = tracker.clone();
    let resolution = async move {
        idempotency_core::resolve_unknown_tracked(&store, &id, &outcome, retention, &settling).await
    };
    let resolved = tracker.spawn(resolution).await;
    let resolved = match resolved {
        Ok(resolved) => resolved,
        Err(failed) => {
            return problem(
                Problem::Internal,
                &format!("the resolution failed: {failed}; GET the record before trying again"),
            );
        }
    };
    match resolved {
        Ok(Resolved::Stored) => StatusCode::NO_CONTENT.into_response(),
        Ok(Resolved::Live) => problem(
            Problem::LeaseLive,
            "the record's lease is live: its holder may still be running the operation, or a \
             retry is being told its outcome is unknown; look again once the lease ran out",
        ),
        Ok(Resolved::Completed) => problem(
            Problem::RecordCompleted,
            "the record is completed: its outcome replays to retries already",
        ),
        Ok(Resolved::Replaced) => problem(
            Problem::RecordReplaced,
            "the attempt's record was released since it was read, and another request (another \
             body, method, path or fingerprinted header) holds the key now: nothing was stored",
        ),
        Ok(Resolved::Absent) => problem(
            Problem::RecordNotFound,
            "no live record for this scope and key (never used, released, or past its retention)",
        ),
        // `Resolved` may grow: an answer this version does not know changed nothing it can
        // vouch for.
        Ok(other) => problem(Problem::Internal, &format!("unexpected answer {other:?}")),
        Err(error) => store_problem(&error),
    }
}
