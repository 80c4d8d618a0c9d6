//! `Idempotency<S>`: the protocol around one service.

use std::{
    panic::AssertUnwindSafe,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Buf, Bytes};
use futures::FutureExt;
use http::{HeaderValue, Request, Response, StatusCode, header, request::Parts};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotency_core::{
    Begin, BoxError, Error, Fingerprint, IdempotencyKey, LeaseToken, Outcome, RecordId, Scope,
    complete_retrying,
};
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument;

use crate::{
    Body, BodyError, IdempotencyContext, Metrics, ResponseFuture, full,
    key::{self, KeyProblem},
    layer::Config,
    problem::Problem,
};

/// Middleware that runs each keyed request's operation at most once. Built by
/// [`IdempotencyLayer`](crate::IdempotencyLayer).
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &self.config.store.name())
            .finish_non_exhaustive()
    }
}

impl<S> Idempotency<S> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// Headers never stored: hop-by-hop (RFC 9110 §7.6.1), recomputed (`content-length`), or
/// describing this response rather than the outcome (`date`).
const NOT_STORED: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "date",
];

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: HttpBody + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // tower's rule: the service that was driven to readiness is the one that is called.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(handle(self.config.clone(), inner, request))
    }
}

fn boxed<B>(body: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(BodyError::new).boxed_unsync()
}

async fn handle<S, ReqBody, ResBody>(
    config: Arc<Config>,
    inner: S,
    request: Request<ReqBody>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: HttpBody + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let m = &config.metrics;
    if !config.methods.contains(request.method()) {
        return pass_through(inner, request).await;
    }
    let key = match key::parse(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if !config.require_key => return pass_through(inner, request).await,
        Ok(None) => {
            Metrics::inc(&m.bad_keys);
            let detail = "this endpoint requires an Idempotency-Key header: send one unique key per operation";
            return Ok(Problem::MissingKey.response(detail, None));
        }
        Err(KeyProblem::Multiple) => {
            Metrics::inc(&m.bad_keys);
            let detail = "send the Idempotency-Key header exactly once";
            return Ok(Problem::InvalidKey.response(detail, None));
        }
        Err(KeyProblem::Invalid(why)) => {
            Metrics::inc(&m.bad_keys);
            return Ok(Problem::InvalidKey.response(&why, None));
        }
    };
    let (parts, body) = request.into_parts();
    let Some(body) = buffer_request(&config, &parts, body).await else {
        Metrics::inc(&m.too_large);
        let detail = format!(
            "the request body is larger than {} bytes, the most this endpoint accepts",
            config.max_request_body
        );
        return Ok(Problem::PayloadTooLarge.response(&detail, None));
    };
    let scope = (config.scope)(&parts);
    let id = RecordId::new(&scope, &key);
    let fingerprint = config.fingerprint(&parts, &body);
    let span = tracing::info_span!("idempotency", record = %id, store = config.store.name(), decision = tracing::field::Empty);
    decide(
        config,
        inner,
        parts,
        body,
        Keyed {
            key,
            scope,
            id,
            fingerprint,
        },
    )
    .instrument(span)
    .await
}

async fn pass_through<S, ReqBody, ResBody>(
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ReqBody: HttpBody + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let request = request.map(|b| {
        b.map_frame(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining())))
            .map_err(BodyError::new)
            .boxed_unsync()
    });
    Ok(inner.call(request).await?.map(boxed))
}

/// Buffers the request body for the fingerprint; `None` when it exceeds the limit (checked
/// against `Content-Length` before reading a byte, and while reading a chunked body).
async fn buffer_request<B>(config: &Config, parts: &Parts, body: B) -> Option<Bytes>
where
    B: HttpBody + Send + 'static,
    B::Error: Into<BoxError>,
{
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > config.max_request_body as u64) {
        return None;
    }
    match Limited::new(body, config.max_request_body).collect().await {
        Ok(collected) => Some(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => None,
        // The client's body broke off: nothing to run. An empty fingerprint body would be
        // wrong, so treat it like an over-long body and let the client resend.
        Err(_) => None,
    }
}

struct Keyed {
    key: IdempotencyKey,
    scope: Scope,
    id: RecordId,
    fingerprint: Fingerprint,
}

async fn decide<S, ResBody>(
    config: Arc<Config>,
    inner: S,
    parts: Parts,
    body: Bytes,
    keyed: Keyed,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let m = &config.metrics;
    let span = tracing::Span::current();
    let wait_until = config.wait.map(|w| Instant::now() + w);
    loop {
        match config
            .store
            .begin(&keyed.id, &keyed.fingerprint, config.policy.lease())
            .await
        {
            Ok(Begin::Execute(token)) => {
                span.record("decision", "execute");
                return execute(config, inner, parts, body, keyed, token).await;
            }
            Ok(Begin::Replay(outcome)) => {
                span.record("decision", "replay");
                Metrics::inc(&m.replays);
                return Ok(replay(outcome));
            }
            Ok(Begin::Mismatch) => {
                span.record("decision", "mismatch");
                Metrics::inc(&m.mismatches);
                let detail = "this Idempotency-Key was already used for a different request \
                              (method, path or body differ); use a new key for a new operation";
                return Ok(Problem::Mismatch.response(detail, None));
            }
            Ok(Begin::InFlight { retry_after }) => {
                if let Some(until) = wait_until {
                    let now = Instant::now();
                    if now < until {
                        let nap = retry_after.min(Duration::from_millis(50)).min(until - now);
                        tokio::time::sleep(nap).await;
                        continue;
                    }
                }
                span.record("decision", "in_flight");
                Metrics::inc(&m.conflicts);
                let detail = "a request with this Idempotency-Key is still being processed; retry after the indicated delay";
                return Ok(Problem::InFlight.response(detail, Some(retry_after)));
            }
            Err(Error::Unavailable(error)) => {
                span.record("decision", "unavailable");
                Metrics::inc(&m.unavailable);
                tracing::warn!(%error, "idempotency store unavailable; refusing to run unguarded");
                let detail = "the request was not processed because its idempotency could not be guaranteed; retry later with the same key";
                return Ok(Problem::StoreUnavailable.response(detail, Some(Duration::from_secs(1))));
            }
            Err(error) => {
                span.record("decision", "error");
                tracing::error!(%error, "idempotency store failed");
                let detail = "the request was not processed; retry later with the same key";
                return Ok(Problem::Internal.response(detail, None));
            }
        }
    }
}

/// Runs the operation in its own task, so a client that disconnects does not cancel it:
/// the card is charged once and the retry gets the replay (the double-charge scenario).
async fn execute<S, ResBody>(
    config: Arc<Config>,
    inner: S,
    mut parts: Parts,
    body: Bytes,
    keyed: Keyed,
    token: LeaseToken,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    parts.extensions.insert(IdempotencyContext {
        record_id: keyed.id,
        scope: keyed.scope,
        key: keyed.key,
    });
    let request = Request::from_parts(parts, full(body));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let id = keyed.id;
    let running = config.detached.enter();
    tokio::spawn(
        async move {
            let _running = running;
            let result = run_detached(config, inner, request, id, token).await;
            let _ = tx.send(result); // the client may be gone: the outcome is stored anyway
        }
        .in_current_span(),
    );
    match rx.await {
        Ok(result) => result,
        // The task itself died (a panic outside the handler): the lease expires on its own.
        Err(_) => {
            Ok(Problem::Internal.response("the request failed; retry with the same key", None))
        }
    }
}

async fn run_detached<S, ResBody>(
    config: Arc<Config>,
    mut inner: S,
    request: Request<Body>,
    id: RecordId,
    token: LeaseToken,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let store = &config.store;
    let m = &config.metrics;
    let lease = config.policy.lease();
    // The handler and the buffering of its response, guarded against panics.
    let operation = AssertUnwindSafe(async move {
        let response = inner.call(request).await?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(Into::into);
        Ok::<_, S::Error>((parts, body))
    })
    .catch_unwind();
    tokio::pin!(operation);
    // Renew the lease while the handler runs, so a slow operation is not taken over.
    let every = config.policy.renew_every();
    let mut renew = tokio::time::interval_at(Instant::now() + every, every);
    let result = loop {
        tokio::select! {
            result = &mut operation => break result,
            _ = renew.tick() => {
                if let Err(error) = store.renew(&id, token, lease).await {
                    tracing::warn!(%error, "could not renew the idempotency lease");
                }
            }
        }
    };
    let (parts, body) = match result {
        Err(_panic) => {
            Metrics::inc(&m.panics);
            release(&config, id, token, "handler panicked").await;
            let detail = "the request failed and was not completed; retry with the same key";
            return Ok(Problem::Internal.response(detail, None));
        }
        Ok(Err(error)) => {
            release(&config, id, token, "service error").await;
            return Err(error);
        }
        Ok(Ok((_, Err(error)))) => {
            release(&config, id, token, "response body failed").await;
            tracing::warn!(%error, "the handler's response body failed");
            let detail = "the response could not be produced; retry with the same key";
            return Ok(Problem::Internal.response(detail, None));
        }
        Ok(Ok((parts, Ok(body)))) => (parts, body),
    };
    if config.policy.is_cacheable(parts.status.as_u16()) {
        let outcome = to_outcome(&config, &parts, &body);
        complete(&config, id, token, &outcome).await;
    } else {
        Metrics::inc(&m.released);
        release(&config, id, token, "outcome not cacheable").await;
    }
    Ok(Response::from_parts(parts, full(body)))
}

async fn release(config: &Config, id: RecordId, token: LeaseToken, why: &'static str) {
    if let Err(error) = config.store.release(&id, token).await {
        tracing::warn!(%error, why, "could not release the idempotency lease; it expires by itself");
    }
}

/// Stores the outcome. A store blip must not lose it (the retry would run the operation
/// again), so an unavailable store is retried, renewing the lease, for up to one lease.
async fn complete(config: &Config, id: RecordId, token: LeaseToken, outcome: &Outcome) {
    let m = &config.metrics;
    match complete_retrying(&*config.store, &id, token, outcome, &config.policy).await {
        Ok(()) => Metrics::inc(&m.executions),
        Err(Error::LeaseLost) => {
            Metrics::inc(&m.lease_lost);
            tracing::error!("lease lost before completion: another attempt owns the key now");
        }
        Err(error) => {
            tracing::error!(%error, "the outcome could not be stored; a retry after the lease expires runs again");
        }
    }
}

fn to_outcome(config: &Config, parts: &http::response::Parts, body: &Bytes) -> Outcome {
    let mut outcome = Outcome::new(parts.status.as_u16());
    for (name, value) in &parts.headers {
        let name = name.as_str();
        if NOT_STORED.contains(&name) || (name == "set-cookie" && !config.store_set_cookie) {
            continue;
        }
        outcome
            .headers
            .push((name.to_owned(), Bytes::copy_from_slice(value.as_bytes())));
    }
    if body.len() <= config.max_stored_body {
        outcome.body = body.clone();
    } else {
        outcome.headers.push((
            "idempotent-replay-body".into(),
            Bytes::from_static(b"omitted"),
        ));
    }
    outcome
}

fn replay(outcome: Outcome) -> Response<Body> {
    let mut response = Response::new(full(outcome.body));
    *response.status_mut() =
        StatusCode::from_u16(outcome.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in outcome.headers {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    response
}
