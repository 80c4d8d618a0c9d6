//! `Idempotency<S>`: the protocol around one service.

use std::{
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Buf, Bytes};
use futures::{FutureExt, future::BoxFuture};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header, request::Parts};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotency_core::{
    Begin, BoxError, Error, Fingerprint, IdempotencyKey, LeaseToken, Outcome, RecordId, Scope,
    complete_or_keep_trying, detached_begin, end_orphan, finish_in_any_case, give_back_orphan,
    release_orphan,
};
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument;

use crate::{
    Body, BodyError, IdempotencyContext, Metrics, NoScope, OutcomeUnknown, ResponseFuture, full,
    full_with_trailers,
    key::{self, KeyProblem},
    layer::Config,
    problem::Problem,
};

/// Middleware that runs each keyed request's operation once, replaying its stored response to
/// every retry (an attempt that crashed before its response was stored is left to the
/// outcome-unknown policy, `IdempotencyLayer::on_outcome_unknown`). Built by
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

/// How many times one request asks again under the earlier fingerprint (see `decide`): the
/// key would have to change hands that often while it asks (then it is told to retry: 409).
const MAX_DETOURS: u8 = 4;

/// Headers never stored: hop-by-hop (RFC 9110 §7.6.1; so are those a response's
/// `Connection` names), recomputed (`content-length`), describing this response rather
/// than the outcome (`date`), or the layer's own marker of an outcome not stored (a
/// response that carries it, replayed from another layered service, is not that marker).
const NOT_STORED: [&str; 11] = [
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
    idempotency_core::OUTCOME_NOT_STORED,
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
        let grpc = request
            .headers()
            .get(header::CONTENT_TYPE)
            .filter(|v| crate::grpc::grpc_content_type(v.as_bytes()))
            .cloned();
        let handled = handle(self.config.clone(), inner, request);
        match grpc {
            None => ResponseFuture::new(handled),
            // The layer's own refusals in gRPC's terms.
            Some(content_type) => ResponseFuture::new(async move {
                let response = handled.await?;
                Ok(crate::grpc::refusal_as_status(response, content_type).await)
            }),
        }
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
    let key = match key::parse(request.headers(), &config.header) {
        Ok(Some(key)) => key,
        Ok(None) if !config.require_key => return pass_through(inner, request).await,
        Ok(None) => {
            Metrics::inc(&m.bad_keys, "idempotency_bad_keys_total");
            let detail = "this endpoint requires an Idempotency-Key header: send one unique key per operation";
            return Ok(Problem::MissingKey.refusal(detail, None));
        }
        Err(KeyProblem::Multiple) => {
            Metrics::inc(&m.bad_keys, "idempotency_bad_keys_total");
            let detail = "send the Idempotency-Key header exactly once";
            return Ok(Problem::InvalidKey.refusal(detail, None));
        }
        Err(KeyProblem::Invalid(why)) => {
            Metrics::inc(&m.bad_keys, "idempotency_bad_keys_total");
            return Ok(Problem::InvalidKey.refusal(&why, None));
        }
    };
    let (parts, body) = request.into_parts();
    // Before the body is read: a request that names nobody is refused at once. The
    // application's closures are caught if they panic: a 500 problem, nothing claimed, rather
    // than a connection reset with no answer.
    let scope = match std::panic::catch_unwind(AssertUnwindSafe(|| (config.scope)(&parts))) {
        Err(_panic) => {
            let detail = "the idempotency scope could not be determined; nothing was processed";
            return Ok(Problem::Internal.refusal(detail, None));
        }
        Ok(Ok(scope)) => scope,
        Ok(Err(NoScope::Unauthenticated(detail))) => {
            Metrics::inc(&m.unscoped, "idempotency_unscoped_total");
            return Ok(Problem::Unauthenticated.refusal(&detail, None));
        }
        Ok(Err(NoScope::Invalid(detail))) => {
            Metrics::inc(&m.unscoped, "idempotency_unscoped_total");
            return Ok(Problem::InvalidRequest.refusal(&detail, None));
        }
    };
    let body = match buffer_request(&config, &parts, body).await {
        Ok(body) => body,
        Err(Unread::TooLarge) => {
            Metrics::inc(&m.too_large, "idempotency_too_large_total");
            let detail = format!(
                "the request body is larger than {} bytes, the most this endpoint accepts",
                config.max_request_body
            );
            return Ok(Problem::PayloadTooLarge.refusal(&detail, None));
        }
        // Nothing ran, and resending the same request may well succeed: not a 413, which
        // clients take as final.
        Err(Unread::BrokeOff(error)) => {
            tracing::debug!(%error, "the request body broke off");
            let detail = "the request body could not be read in full (it broke off or timed \
                          out); nothing was processed: resend the request with the same key";
            return Ok(Problem::InvalidRequest.transient_refusal(detail));
        }
    };
    let id = RecordId::new(&scope, &key);
    let fingerprint = match std::panic::catch_unwind(AssertUnwindSafe(|| {
        config.fingerprint(&parts, &body)
    })) {
        Ok(fingerprint) => fingerprint,
        Err(_panic) => {
            let detail = "the request's fingerprint could not be computed; nothing was processed";
            return Ok(Problem::Internal.refusal(detail, None));
        }
    };
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
            took_over: false,
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

/// Why a request body was not read.
enum Unread {
    /// Over the limit.
    TooLarge,
    /// The body failed before its end: the client went away, an outer layer's read timeout,
    /// a malformed chunked encoding.
    BrokeOff(BoxError),
}

/// Buffers the request body for the fingerprint, within the limit (checked against
/// `Content-Length` before reading a byte, and while reading a chunked body).
async fn buffer_request<B>(config: &Config, parts: &Parts, body: B) -> Result<Bytes, Unread>
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
        return Err(Unread::TooLarge);
    }
    match Limited::new(body, config.max_request_body).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if over_a_limit(&*error) => Err(Unread::TooLarge),
        Err(error) => Err(Unread::BrokeOff(error)),
    }
}

/// Whether a body's error is a length limit: the layer's own, or one applied outside it
/// (tower-http's `RequestBodyLimitLayer` wraps a body of unknown length in `Limited`, whose
/// error axum boxes once or twice on its way to the route).
fn over_a_limit(error: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(error), |e| e.source()).any(|e| e.is::<LengthLimitError>())
}

struct Keyed {
    key: IdempotencyKey,
    scope: Scope,
    id: RecordId,
    fingerprint: Fingerprint,
    /// Whether the lease was taken over from an attempt whose outcome is unknown: a run
    /// under it that stores nothing ends the lease instead of releasing it (see
    /// [`give_back`]).
    took_over: bool,
}

async fn decide<S, ResBody>(
    config: Arc<Config>,
    inner: S,
    parts: Parts,
    body: Bytes,
    mut keyed: Keyed,
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
    // A mismatch is asked again under the fingerprint earlier versions gave this request
    // (see `Config::legacy_fingerprint`, only ever computed on a mismatch); while asking with
    // it, `current` keeps the request's own. A mismatch is final only when both answered it,
    // one right after the other: between two asks the key can change hands (given back, and
    // claimed by a duplicate of this request under either fingerprint), as often as a wait
    // for an attempt in flight lasts. `detours` bounds the back and forth.
    let mut mismatched_just_before = false;
    let mut detours = 0_u8;
    let mut current: Option<Fingerprint> = None;
    loop {
        // The lease counts from the ask, not from the answer: so do its renewals.
        let asked = Instant::now();
        match claim(&config, keyed.id, keyed.fingerprint, asked).await {
            Ok(Begin::Execute(token)) if current.is_some() => {
                mismatched_just_before = false;
                // The earlier fingerprint only finds what was stored under it (the key was
                // given back since the mismatch): run under it, and its record would replay
                // for every other request it stands for. Give the grant back and ask again
                // with the request's own, the give-back run to its end even if dropped.
                keyed.fingerprint = current.take().unwrap_or(keyed.fingerprint);
                let why = "granted under the earlier fingerprint";
                if settle_lease_in_any_case(&config, keyed.id, token, false, why).await {
                    continue;
                }
                // Still held (the give-back is being retried): asked now, the key would
                // answer a mismatch, a final 422 for a request that is the key's own.
                span.record("decision", "unavailable");
                Metrics::inc(&m.unavailable, "idempotency_unavailable_total");
                let detail = "the request was not processed because its idempotency could not \
                              be guaranteed; retry later with the same key";
                return Ok(Problem::StoreUnavailable.refusal(detail, Some(Duration::from_secs(1))));
            }
            Ok(Begin::TakeOver(token)) if current.is_some() => {
                // An attempt under the earlier fingerprint never finished (killed at an
                // upgrade). That fingerprint stands for this request under every prefix, so
                // whose attempt it was is unknown: run nothing under it, keep the record
                // unfinished (the lease ended), and say so without storing an answer.
                span.record("decision", "outcome_unknown");
                let why = "taken over under the earlier fingerprint";
                let _ = settle_lease_in_any_case(&config, keyed.id, token, true, why).await;
                let detail = "an earlier request with this Idempotency-Key, made before an \
                              upgrade, did not finish, and whether its operation took effect is \
                              unknown: it must be reconciled before this key can be used again";
                return Ok(Problem::OutcomeUnknown.refusal(detail, None));
            }
            Ok(Begin::Execute(token)) => {
                span.record("decision", "execute");
                return execute(config, inner, parts, body, keyed, token, asked).await;
            }
            Ok(Begin::TakeOver(token)) => {
                span.record("decision", "outcome_unknown");
                return outcome_unknown(config, inner, parts, body, keyed, token, asked).await;
            }
            Ok(Begin::Replay(outcome)) => {
                span.record("decision", "replay");
                Metrics::inc(&m.replays, "idempotency_replays_total");
                return Ok(replay(outcome));
            }
            Ok(Begin::Mismatch) => {
                if let Some(own) = current.take() {
                    // A mismatch under the earlier fingerprint too — or the key changed hands
                    // between the two asks (given back, then claimed by a duplicate of this
                    // very request under its own): asked once more with the request's own,
                    // which finds that duplicate in flight, or its replay. Only a mismatch
                    // under its own right after this one is final.
                    keyed.fingerprint = own;
                    mismatched_just_before = true;
                    continue;
                }
                // Stored, perhaps, before an upgrade, under the fingerprint earlier versions
                // gave this request: asked once more with that one.
                if !mismatched_just_before
                    && let Some(legacy) = config.legacy_fingerprint(&parts, &body)
                {
                    if detours == MAX_DETOURS {
                        // The key keeps changing hands between this request's asks: not
                        // known to be another request's, so not a final 422. Busy: retry.
                        span.record("decision", "in_flight");
                        Metrics::inc(&m.conflicts, "idempotency_conflicts_total");
                        let detail = "a request with this Idempotency-Key is still being \
                                      processed; retry after the indicated delay";
                        let wait = Some(Duration::from_secs(1));
                        return Ok(Problem::InFlight.refusal(detail, wait));
                    }
                    detours += 1;
                    current = Some(keyed.fingerprint);
                    keyed.fingerprint = legacy;
                    mismatched_just_before = true;
                    continue;
                }
                span.record("decision", "mismatch");
                Metrics::inc(&m.mismatches, "idempotency_mismatches_total");
                let detail = "this Idempotency-Key was already used for a different request \
                              (method, path or body differ); use a new key for a new operation";
                return Ok(Problem::Mismatch.refusal(detail, None));
            }
            Ok(Begin::InFlight { retry_after }) => {
                mismatched_just_before = false;
                if let Some(until) = wait_until {
                    let now = Instant::now();
                    if now < until {
                        let nap = retry_after.min(Duration::from_millis(50)).min(until - now);
                        tokio::time::sleep(nap).await;
                        continue;
                    }
                }
                span.record("decision", "in_flight");
                Metrics::inc(&m.conflicts, "idempotency_conflicts_total");
                let detail = "a request with this Idempotency-Key is still being processed; retry after the indicated delay";
                let wait = config
                    .run_time
                    .retry_after(config.policy.lease(), retry_after);
                return Ok(Problem::InFlight.refusal(detail, Some(wait)));
            }
            Err(Error::Unavailable(error)) => {
                span.record("decision", "unavailable");
                Metrics::inc(&m.unavailable, "idempotency_unavailable_total");
                tracing::warn!(%error, "idempotency store unavailable; refusing to run unguarded");
                let detail = "the request was not processed because its idempotency could not be guaranteed; retry later with the same key";
                return Ok(Problem::StoreUnavailable.refusal(detail, Some(Duration::from_secs(1))));
            }
            Err(error) => {
                span.record("decision", "error");
                tracing::error!(%error, "idempotency store failed");
                let detail = "the request was not processed; retry later with the same key";
                return Ok(Problem::Internal.refusal(detail, None));
            }
        }
    }
}

/// The key was taken over from an attempt that never stored its outcome: the layer's
/// [`OutcomeUnknown`] policy decides. This request owns the lease meanwhile; dropped before
/// it settles, the lease runs out and the next retry is asked the same question (the record
/// stays an expired lease, so it is taken over again, never a fresh `Execute`).
async fn outcome_unknown<S, ResBody>(
    config: Arc<Config>,
    inner: S,
    parts: Parts,
    body: Bytes,
    mut keyed: Keyed,
    token: LeaseToken,
    asked: Instant,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let policy = config.outcome_unknown.clone();
    let label = match &policy {
        OutcomeUnknown::Reject => "reject",
        OutcomeUnknown::Reconcile(_) => "reconcile",
        _ => "reexecute",
    };
    metrics::counter!("idempotency_outcome_unknown_total", "policy" => label).increment(1);
    tracing::warn!(record = %keyed.id, policy = label, "an earlier attempt's lease ran out before it stored an outcome");
    keyed.took_over = true;
    let id = keyed.id;
    match policy {
        OutcomeUnknown::Reject => {
            // The record stays what it is, an attempt whose outcome is unknown, for an
            // operator to resolve: its lease ended at once, so the next retry takes it over
            // and is told the same. Stored as this key's outcome, the 409 left the operator
            // no way to record what the attempt did (deleting it let the key run again) and
            // ran the operation again once its retention was over.
            let why = "an attempt whose outcome is unknown, kept for an operator";
            settle_lease_in_any_case(&config, id, token, true, why).await;
            let detail = "an earlier request with this Idempotency-Key did not finish, and \
                          whether its operation took effect is unknown: it must be reconciled \
                          before this key can be used again";
            Ok(Problem::OutcomeUnknown.refusal(detail, None))
        }
        OutcomeUnknown::Reconcile(hook) => {
            // In a task of its own, like the operation: a hook that found the effect gets
            // its outcome stored even if this request is gone by then.
            let unresolved = crate::Unresolved {
                record_id: id,
                method: parts.method.clone(),
                uri: parts.uri.clone(),
                headers: parts.headers.clone(),
                body: body.clone(),
            };
            let (task_config, hook) = (config.clone(), hook.clone());
            // Counted as running until its end, like an operation: `drain` waits for it.
            let running = config.detached.token();
            let (verdict, settled) = tokio::sync::oneshot::channel();
            let settled = Verdict {
                settled,
                lease: (config.clone(), id, token),
                runtime: tokio::runtime::Handle::current(),
            };
            tokio::spawn(async move {
                let _running = running;
                let config = task_config;
                let lease = config.policy.lease();
                // The lease is renewed while the hook runs, and the hook gets half a lease:
                // a hook that outlived the lease would let another retry take over and ask
                // (and maybe run) again meanwhile.
                let check = tokio::time::timeout(lease / 2, hook.check(unresolved));
                tokio::pin!(check);
                let mut renew = renewals(&config, asked);
                let found = loop {
                    tokio::select! {
                        found = &mut check => break found,
                        _ = renew.every.tick() => {
                            if let Err(error) = renew_lease(&config, &id, token, lease).await {
                                tracing::warn!(%error, "could not renew the idempotency lease");
                            }
                        }
                    }
                };
                let found = found.map(|r| r.map(|o| o.map(|o| hook_outcome(&config, o))));
                let reconciled = match found {
                    // Stored only if the policy stores its status. One it does not (a 5xx, a
                    // 409, a refusal the policy leaves out) is answered, and the key stays
                    // unresolved: the lease ended, the record kept, so the next retry asks
                    // the hook again rather than be replayed that answer for the retention.
                    // Judged as a handler's response would be (`cacheable`).
                    Ok(Ok(Some(outcome))) if hook_cacheable(&config.policy, &outcome) => {
                        let mut outcome = advertise_expiry_of(&config, outcome);
                        if !complete(&config, id, token, &outcome).await {
                            // Not stored (the lease was taken, the store stayed down): no
                            // date promised, as for a handler's answer.
                            let name = crate::IDEMPOTENCY_EXPIRES;
                            outcome
                                .headers
                                .retain(|(h, _)| !h.eq_ignore_ascii_case(name));
                        }
                        Reconciled::Found(outcome)
                    }
                    Ok(Ok(Some(outcome))) => {
                        let why = "a reconciled answer the policy does not store";
                        let _ = settle_lease(&config, id, token, true, why).await;
                        Reconciled::Found(outcome)
                    }
                    // Nothing happened: run, on a whole lease, if the key is still ours.
                    Ok(Ok(None)) => {
                        // The lease the operation runs on counts from this ask (see below).
                        let renewing = Instant::now();
                        match renew_lease(&config, &id, token, lease).await {
                            Ok(()) => Reconciled::Nothing(renewing),
                            Err(Error::LeaseLost) => Reconciled::Lost("lease lost".into()),
                            Err(error) => Reconciled::Unknown(error.to_string()),
                        }
                    }
                    Ok(Err(error)) => Reconciled::Unknown(error.to_string()),
                    Err(_) => Reconciled::Unknown(format!("no answer within {:?}", lease / 2)),
                };
                // The request went away while the hook looked: nobody is left to run the
                // operation on the lease just renewed for it. Ended (and kept, so the next
                // retry asks the hook again), not held: its retries would be told 409 for a
                // whole lease.
                if let Err(Reconciled::Nothing(_)) = verdict.send(reconciled) {
                    let why = "reconciled for a request that is gone";
                    let _ = settle_lease(&config, id, token, true, why).await;
                }
            });
            match settled.read().await {
                Ok(Reconciled::Found(outcome)) => {
                    Metrics::inc(&config.metrics.replays, "idempotency_replays_total");
                    return Ok(replay(outcome));
                }
                Ok(Reconciled::Nothing(renewed)) => {
                    // The verdict is read in this request's future, which may have been held
                    // without a poll past that lease: another retry may have taken the key
                    // over, asked the hook (which found nothing, nothing having run yet) and
                    // be running the operation. Read that late, it runs nothing, like a late
                    // grant (`within_lease`); the record stays, to be asked again, and the
                    // lease is ended, if still ours, rather than held for nobody.
                    let lease = config.policy.lease();
                    let answer = Ok(Begin::TakeOver(token));
                    let end = |_| {
                        let store = config.store.clone();
                        let end = async move { end_orphan(&*store, &id, token).await };
                        config.detached.spawn(end);
                    };
                    if idempotency_core::within_lease_with(&id, renewed, lease, answer, end).is_ok()
                    {
                        return execute(config, inner, parts, body, keyed, token, renewed).await;
                    }
                    let detail = "the request was not processed because its idempotency could \
                                  not be guaranteed; retry later with the same key";
                    return Ok(
                        Problem::StoreUnavailable.refusal(detail, Some(Duration::from_secs(1)))
                    );
                }
                Ok(Reconciled::Lost(error)) => {
                    tracing::warn!(%error, record = %id, "the key was taken over while reconciling");
                    let detail =
                        "a request with this Idempotency-Key is being processed; retry later";
                    // Taken over just now (a whole lease left): what is left of the mean run
                    // time, as every other in-flight answer advertises.
                    let lease = config.policy.lease();
                    let wait = config.run_time.retry_after(lease, lease);
                    return Ok(Problem::InFlight.refusal(detail, Some(wait)));
                }
                Ok(Reconciled::Unknown(error)) => {
                    tracing::error!(%error, record = %id, "the reconcile hook failed; the key stays unresolved");
                }
                Err(_panic) => {
                    tracing::error!(record = %id, "the reconcile hook panicked; the key stays unresolved");
                }
            }
            // Not released: released, the next `begin` would be a fresh `Execute` and skip
            // the question. The lease runs out, and the next retry asks again.
            let detail = "an earlier request with this Idempotency-Key did not finish, and \
                          whether it took effect could not be checked; retry later with the same key";
            Ok(Problem::StoreUnavailable.refusal(detail, Some(config.policy.lease())))
        }
        _ => execute(config, inner, parts, body, keyed, token, asked).await,
    }
}

/// What a reconcile hook settled.
enum Reconciled {
    /// The earlier attempt's effect, now the stored outcome.
    Found(Outcome),
    /// No effect: the operation runs (the lease is renewed and still ours), renewed by a
    /// call asked at this instant.
    Nothing(Instant),
    /// No effect, but another attempt took the key over meanwhile.
    Lost(String),
    /// The hook failed, panicked or took too long.
    Unknown(String),
}

/// Where a request waits for its reconcile hook's verdict. Dropped with a `Nothing` verdict
/// sent but not read (the request went away as the hook answered), it ends the lease that
/// was renewed for the operation, as the hook's task does when it finds the request gone.
struct Verdict {
    settled: tokio::sync::oneshot::Receiver<Reconciled>,
    lease: (Arc<Config>, RecordId, LeaseToken),
    /// The request's runtime: a future may be dropped on a thread outside it.
    runtime: tokio::runtime::Handle,
}

impl Verdict {
    /// The verdict; `Err` if the hook's task died (a panic).
    async fn read(mut self) -> Result<Reconciled, ()> {
        (&mut self.settled).await.map_err(|_| ())
    }
}

impl Drop for Verdict {
    fn drop(&mut self) {
        let (config, id, token) = &self.lease;
        // Closed first: a verdict sent from now on is refused (the task ends the lease
        // itself), and one sent before is here to read. Read first, a verdict sent in
        // between would be accepted and then dropped with the channel, unread.
        self.settled.close();
        let Ok(Reconciled::Nothing(_)) = self.settled.try_recv() else {
            return;
        };
        let (store, id, token) = (config.store.clone(), *id, *token);
        let end = async move { end_orphan(&*store, &id, token).await };
        config.detached.spawn_on(end, &self.runtime);
    }
}

/// `begin`, run to its end even if the request future is dropped (a client hang-up, an outer
/// timeout): a lease granted to a request that is gone is released. A store that guarantees
/// this itself ([`Store::begin_settles_when_dropped`](idempotency_core::Store::begin_settles_when_dropped):
/// those of this workspace) is called directly; over any other `Store` the claim is wrapped
/// here, which keeps the layer safe whatever the store does. Between this
/// answer and the operation's first step (and its spawn, see [`execute`]) there is no yield
/// point, so no lease is lost there.
///
/// `drain` counts what a claim leaves running in the background (the rest of one whose
/// request went away, a lease given back) until it has settled: a shutdown that cut a
/// release short would leave the key claimed, and it would come back as an attempt whose
/// outcome is unknown (409 under `Reject`) for an operation that never ran.
///
/// `asked` is when the caller asked: the lease counts from then, not from the answer, so one
/// read late is given back (see `within_lease`).
async fn claim(
    config: &Config,
    id: RecordId,
    fingerprint: Fingerprint,
    asked: Instant,
) -> Result<Begin, Error> {
    let lease = config.policy.lease();
    let answer = if config.store.begin_settles_when_dropped() {
        config.store.begin(&id, &fingerprint, lease).await
    } else {
        let store = config.store.clone();
        let claim = async move { store.begin(&id, &fingerprint, lease).await };
        detached_begin(config.store.clone(), id, claim)
            .tracked_by(&config.detached)
            .await
    };
    idempotency_core::within_lease_with(&id, asked, lease, answer, |grant| {
        let store = config.store.clone();
        config
            .detached
            .spawn(async move { give_back_orphan(&*store, &id, grant).await });
    })
}

/// Runs the operation so that a client that disconnects does not cancel it: the card is
/// charged once and the retry gets the replay (the double-charge scenario).
///
/// The handler's first step runs here, in the request's task, in the same poll that got the
/// lease: no yield point, so no drop, lies between the claim and what follows.
///
/// - A handler that has to wait moves into a task of its own at once ([`run_detached`]).
///   The request future only waits for the response head; the task owns the lease until the
///   outcome is stored or released, renewing it whatever the request's caller does — drops
///   the future, or holds it without polling it.
/// - A handler that answered in its first step has run; what is left is to store its
///   outcome (or give its lease back). That goes on in the request's future, with no
///   hand-off to a task and back, which on a busy server costs more than the store's round
///   trip. Dropped before it ends (a hang-up, an outer timeout), or not finished within
///   [`HANDOVER_AFTER`](idempotency_core::HANDOVER_AFTER) (a caller holding the future
///   without polling it, a slow store), it moves into a task of its own and stores the
///   outcome all the same ([`finish_in_any_case`]), counted by `drain`: the lease it is
///   written under cannot lapse for want of a poll.
/// - A streamed body is forwarded by a task of its own either way (see [`stream`]).
async fn execute<S, ResBody>(
    config: Arc<Config>,
    inner: S,
    mut parts: Parts,
    body: Bytes,
    keyed: Keyed,
    token: LeaseToken,
    leased: Instant,
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
    let (id, took_over) = (keyed.id, keyed.took_over);
    // Counted as running until its end, in whichever task that is (see
    // `IdempotencyLayer::drain`).
    let running = config.detached.token();
    let started = Instant::now();
    // Told by the operation's task when the first client goes away.
    let (left, gone) = tokio::sync::watch::channel(false);
    let mut produce = produce(inner, request, &config, gone);
    // `poll!` polls once and never yields itself: the handler has made its first step (or
    // found the task's cooperative budget spent) before this future can be dropped. Unless
    // the lease may already have run out (the process was frozen since it was asked for):
    // then the handler waits for a renewal in its task, as in `run_detached`.
    let fresh = Instant::now() < leased + config.policy.surely_held();
    let first = if fresh {
        futures::poll!(&mut produce)
    } else {
        Poll::Pending
    };
    let result = match first {
        Poll::Ready(result) => result,
        Poll::Pending => {
            let (reply, answer) = tokio::sync::oneshot::channel();
            let run = async move {
                let _running = running;
                let run = run_detached(
                    config,
                    produce,
                    (id, token, took_over),
                    (leased, started),
                    (reply, left),
                );
                // A panic outside the handler (which is caught itself) drops the reply:
                // answered below.
                let _ = AssertUnwindSafe(run).catch_unwind().await;
            };
            tokio::spawn(run.in_current_span());
            return head(answer).await;
        }
    };
    let settle = async move {
        let running = running;
        match settle(&config, (id, token, took_over), started, result).await {
            Settled::Answer(answer) => answer,
            Settled::Stream(parts, body) => {
                let (reply, answer) = tokio::sync::oneshot::channel();
                let renew = renewals(&config, leased);
                let forward = async move {
                    let _running = running;
                    let (mut renew, lease) = (renew, (id, token, took_over));
                    stream(&config, lease, parts, body, reply, &mut renew).await;
                };
                tokio::spawn(forward.in_current_span());
                head(answer).await
            }
        }
    };
    // Dropped or held without polling before the outcome is stored, it is stored all the
    // same, in a task.
    let settle = finish_in_any_case(settle.in_current_span());
    match AssertUnwindSafe(settle).catch_unwind().await {
        Ok(answer) => answer,
        Err(_panic) => Ok(Problem::Internal.refusal(FAILED, None)),
    }
}

const FAILED: &str = "the request failed; retry with the same key";

/// The response head sent by the task that owns the lease.
async fn head<E>(
    answer: tokio::sync::oneshot::Receiver<Result<Response<Body>, E>>,
) -> Result<Response<Body>, E> {
    match answer.await {
        Ok(result) => result,
        // The operation died (a panic outside the handler): the lease expires on its own.
        Err(_) => Ok(Problem::Internal.refusal(FAILED, None)),
    }
}

/// What the handler produced, before its body is streamed.
enum Produced<ResBody> {
    /// A body of known size within the stored-body limit, read whole, and its trailers.
    Buffered(
        http::response::Parts,
        Result<(Bytes, Option<HeaderMap>), BoxError>,
    ),
    /// Any other body: streamed to the client, at most the limit kept for the store.
    Streaming(http::response::Parts, ResBody),
}

/// What running the handler came to: a panic, the service's error, or what it produced.
type Ran<ResBody, E> = std::thread::Result<Result<Produced<ResBody>, E>>;

type Reply<E> = tokio::sync::oneshot::Sender<Result<Response<Body>, E>>;

/// The handler (and, for a small body of known size, reading it), guarded against panics.
///
/// `gone` says when the first client went away: a body read whole is then read for at most
/// half a lease more, as a streamed one is drained ([`stream`]), and stored as incomplete if
/// it did not end by then (a body that stalls would hold its key for ever otherwise).
fn produce<S, ResBody>(
    mut inner: S,
    request: Request<Body>,
    config: &Config,
    gone: tokio::sync::watch::Receiver<bool>,
) -> BoxFuture<'static, Ran<ResBody, S::Error>>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let limit = config.max_stored_body;
    let policy = config.policy.clone();
    let drain = policy.lease() / 2;
    Box::pin(
        AssertUnwindSafe(async move {
            let response = inner.call(request).await?;
            let (parts, body) = response.into_parts();
            let exact = body.size_hint().exact().filter(|&n| n <= limit as u64);
            // A response whose framing ends with its head (a 204, a 304, or one of
            // `Content-Length: 0`): no body goes on the wire, and over HTTP/1 its client has
            // it whole once the head is sent. Streamed, it was stored only once its body
            // (never sent) ended: a retry meanwhile got a 409 for a response its client had.
            // Read to its end as a buffered body is (what the body does, it may stream the
            // handler's work, runs under the lease, before the outcome is stored), its frames
            // discarded, then stored with no body, then sent. Not gRPC, whose status may come
            // in trailers.
            let ends_with_head = exact.is_none()
                && !crate::grpc::is_grpc(&parts.headers)
                && (matches!(
                    parts.status,
                    http::StatusCode::NO_CONTENT | http::StatusCode::NOT_MODIFIED
                ) || parts
                    .headers
                    .get(header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                    == Some(0));
            if ends_with_head && cacheable(&policy, &parts, None) {
                let read = read_body(read_to_end(body), gone, drain).await;
                return Ok(Produced::Buffered(
                    parts,
                    read.map(|trailers| (Bytes::new(), trailers)),
                ));
            }
            if let Some(declared) = exact
                && cacheable(&policy, &parts, None)
            {
                // The handler has run: a panic while reading its body is a broken body
                // (stored as incomplete), not a failed operation (released, so run again);
                // so is a body of another length than it declared (hyper would have framed
                // it by that length, and aborted the response).
                let body = read_body(Limited::new(body, limit).collect(), gone, drain).await;
                let body = body
                    .map(|c| {
                        // An empty trailers frame is none: framed the same as its replay.
                        let trailers = c.trailers().filter(|t| !t.is_empty()).cloned();
                        (c.to_bytes(), trailers)
                    })
                    .and_then(|(bytes, trailers)| {
                        if bytes.len() as u64 == declared {
                            Ok((bytes, trailers))
                        } else {
                            Err(format!(
                                "the response body has {} bytes, its size hint said {declared}",
                                bytes.len()
                            )
                            .into())
                        }
                    });
                return Ok(Produced::Buffered(parts, body));
            }
            Ok(Produced::Streaming(parts, body))
        })
        .catch_unwind(),
    )
}

/// Reads a response body with `read`, a panic in it an error, for at most `drain` once the
/// first client left (`gone`): a body that stalls would hold its key for ever otherwise.
async fn read_body<T>(
    read: impl Future<Output = Result<T, BoxError>>,
    gone: tokio::sync::watch::Receiver<bool>,
    drain: Duration,
) -> Result<T, BoxError> {
    tokio::select! {
        biased;
        read = AssertUnwindSafe(read).catch_unwind() => {
            read.unwrap_or_else(|_| Err("the response body panicked".into()))
        }
        () = left_for(gone, drain) => Err(format!(
            "the response body did not end within {drain:?} after its client left"
        )
        .into()),
    }
}

/// Once the first client has been gone for `wait` (never, if nobody can say it left).
async fn left_for(mut gone: tokio::sync::watch::Receiver<bool>, wait: Duration) {
    if gone.wait_for(|gone| *gone).await.is_err() {
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(wait).await;
}

/// The lease's renewals, on the schedule that started when the lease was asked for (or last
/// renewed): the store counts the lease from then, so a slow claim or a slow reconcile hook
/// leaves the handler as many renewals before the lease runs out as a quick one. One already
/// due fires at once.
fn renewals(config: &Config, leased: Instant) -> Renewals {
    let every = config.policy.renew_every();
    Renewals {
        every: tokio::time::interval_at(leased + every, every),
        alive_until: leased + config.policy.surely_held(),
        lease: config.policy.lease(),
        sure: config.policy.surely_held(),
    }
}

/// A lease's renewals, and until when the lease surely lives ([`Policy::surely_held`](idempotency_core::Policy::surely_held) after
/// it or its last renewal was asked for).
///
/// Past `alive_until` another attempt may hold the key, so the work under the
/// lease (a handler, a body that streams its work) is not polled again until a renewal says
/// this attempt still holds it. A process frozen past its lease (SIGSTOP, a paused VM, a
/// starved host) wakes with its work and its overdue renewal both ready: the work must not
/// go first.
struct Renewals {
    every: tokio::time::Interval,
    alive_until: Instant,
    lease: Duration,
    sure: Duration,
}

/// What a renewal said.
enum Renewed {
    /// The lease is this attempt's, for another lease from when it was asked.
    Kept,
    /// The key is another attempt's now (this one's renewals failed for a whole lease and a
    /// retry took over), or an operator released it.
    Lost,
    /// No answer (the store down, a blip): the lease is what it was.
    Unanswered,
}

impl Renewals {
    /// Whether the lease may have run out.
    fn may_be_over(&self) -> bool {
        Instant::now() >= self.alive_until
    }

    /// Renews the lease now.
    async fn renew(&mut self, config: &Config, id: &RecordId, token: LeaseToken) -> Renewed {
        let asked = Instant::now();
        match renew_lease(config, id, token, self.lease).await {
            Ok(()) => {
                self.alive_until = asked + self.sure;
                Renewed::Kept
            }
            Err(Error::LeaseLost) => Renewed::Lost,
            // Not a store out of reach but one that cannot renew (a record it cannot read,
            // its table gone): once the lease may be over, no renewal may come, and another
            // attempt may hold the key. Taken as lost then, not asked again for ever by
            // `confirm`. (Before that, it may be a blip: a table swapped, a pooler's stale
            // search path. The work goes on, and the next tick asks again.)
            Err(error @ (Error::Corrupt(_) | Error::Config(_))) if self.may_be_over() => {
                tracing::error!(%error, record = %id, "the store cannot renew the idempotency lease");
                Renewed::Lost
            }
            Err(error) => {
                tracing::warn!(%error, record = %id, "could not renew the idempotency lease");
                Renewed::Unanswered
            }
        }
    }

    /// Once the lease may have run out: renews it, and while the store does not answer,
    /// waits and asks again — the work stays unpolled (a store down longer than a lease
    /// holds the work that outlived its lease, rather than let it run beside a takeover).
    /// `true` when the lease is this attempt's.
    async fn confirm(&mut self, config: &Config, id: &RecordId, token: LeaseToken) -> bool {
        loop {
            match self.renew(config, id, token).await {
                Renewed::Kept if !self.may_be_over() => return true,
                Renewed::Lost => return false,
                // Kept, but answered so late that the renewed lease may be over already (a
                // store slower than a lease, a starved runtime): asked again after a pause,
                // as when unanswered, not at once in a loop.
                Renewed::Kept | Renewed::Unanswered => {
                    let pause = config.policy.renew_every().min(Duration::from_secs(1));
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }
}

/// `work`, not polled from `alive_until` on ([`Renewals`]; `None`: always polled): the
/// caller selects on a timer for that instant beside it, which wakes it to renew first.
fn gated<F: Future + Unpin>(
    alive_until: impl Into<Option<Instant>>,
    work: &mut F,
) -> impl Future<Output = F::Output> + '_ {
    let alive_until = alive_until.into();
    std::future::poll_fn(move |cx| {
        if alive_until.is_some_and(|until| Instant::now() >= until) {
            return Poll::Pending;
        }
        Pin::new(&mut *work).poll(cx)
    })
}

/// The operation, in a task of its own once its handler had to wait: renews the lease
/// while the handler runs, then settles it and sends the response.
async fn run_detached<ResBody, E>(
    config: Arc<Config>,
    mut produce: BoxFuture<'static, Ran<ResBody, E>>,
    (id, token, took_over): (RecordId, LeaseToken, bool),
    (leased, started): (Instant, Instant),
    (mut reply, left): (Reply<E>, tokio::sync::watch::Sender<bool>),
) where
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // Renew the lease while the handler runs, so a slow operation is not taken over. Not
    // biased: a handler that keeps its task's cooperative budget spent must not starve the
    // renewals (see `a_handler_that_spends_its_budget_still_has_its_lease_renewed`).
    let mut renew = renewals(&config, leased);
    let result = loop {
        let alive_until = renew.alive_until;
        let kept = tokio::select! {
            result = gated(alive_until, &mut produce) => break result,
            _ = renew.every.tick() => !matches!(renew.renew(&config, &id, token).await, Renewed::Lost),
            // Past it the handler is not polled: asked now whether it may go on.
            () = tokio::time::sleep_until(alive_until) => renew.confirm(&config, &id, token).await,
            // The handler runs on; a body it reads whole from now on is bounded (`produce`).
            () = reply.closed(), if !*left.borrow() => {
                left.send_replace(true);
                true
            }
        };
        if kept {
            continue;
        }
        // The key is another attempt's now, or an operator released it: the handler is
        // stopped at its await, before effects it has not reached, which the other attempt
        // runs. Nothing to give back: the token is fenced off. Not polled once more to see
        // whether it finished meanwhile: a poll cannot tell "finished" from "woken", and a
        // woken handler would run its next step beside the attempt that holds the key (see
        // `a_handler_woken_while_its_lease_is_lost_is_not_polled_again`). One that did
        // finish is answered 503 like the rest; its retry gets the holder's outcome.
        tracing::warn!(record = %id, "the idempotency lease was lost while the handler ran; stopping it");
        let detail = "this attempt lost its idempotency lease to another \
                      attempt and was stopped; retry later with the same key";
        let stopped = Problem::StoreUnavailable.refusal(detail, Some(Duration::from_secs(1)));
        let _ = reply.send(Ok(stopped));
        return;
    };
    match settle(&config, (id, token, took_over), started, result).await {
        Settled::Answer(answer) => {
            let _ = reply.send(answer);
        }
        // The same renewal schedule goes on: no gap at the handover.
        Settled::Stream(parts, body) => {
            let lease = (id, token, took_over);
            stream(&config, lease, parts, body, reply, &mut renew).await;
        }
    }
}

/// What is left once the handler has run.
enum Settled<ResBody, E> {
    /// The outcome is stored (or the lease given back): the answer.
    Answer(Result<Response<Body>, E>),
    /// A cacheable response whose body is to be streamed, and stored as it goes.
    Stream(http::response::Parts, ResBody),
}

/// Stores the outcome of a handler that ran (or gives its lease back), and makes the answer;
/// a cacheable body to be streamed is left to [`stream`].
async fn settle<ResBody, E>(
    config: &Config,
    (id, token, took_over): (RecordId, LeaseToken, bool),
    started: Instant,
    result: Ran<ResBody, E>,
) -> Settled<ResBody, E>
where
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let m = &config.metrics;
    let produced = match result {
        // A panic may come after the effect: its outcome is unknown, unlike a 5xx the handler
        // chose to answer.
        Err(_panic) => {
            Metrics::inc(&m.panics, "idempotency_panics_total");
            give_up(config, id, token, took_over, "handler panicked").await;
            let detail = "the request failed and was not completed; retry with the same key";
            return Settled::Answer(Ok(Problem::Internal.refusal(detail, None)));
        }
        // A service error is most often a refusal before anything ran (load shed, a closed
        // buffer): released, so the retry runs, as before. Kept as outcome-unknown, one such
        // blip would lock a key under `Reject` for its retention.
        Ok(Err(error)) => {
            give_back(config, id, token, took_over, "service error").await;
            return Settled::Answer(Err(error));
        }
        Ok(Ok(produced)) => {
            config.run_time.record(started.elapsed());
            produced
        }
    };
    let (mut parts, body) = match produced {
        Produced::Buffered(parts, Ok(read)) => (parts, read),
        Produced::Buffered(parts, Err(error)) => {
            // The handler ran and answered; its body broke off. Never a second execution:
            // store what is known, marked incomplete.
            tracing::warn!(%error, "the handler's response body failed");
            let outcome = to_outcome(config, &parts, None, BodyMark::Incomplete);
            // Not stored (the lease lost, the store still down): the retry gets whatever the
            // key holds then, so no promise of this outcome.
            let detail = if complete(config, id, token, &outcome).await {
                "the response could not be produced in full; its outcome is stored"
            } else {
                "the response could not be produced in full; retry with the same key"
            };
            return Settled::Answer(Ok(Problem::Internal.refusal(detail, None)));
        }
        Produced::Streaming(mut parts, body) => {
            if cacheable(&config.policy, &parts, None) {
                // Not for gRPC, whose status (in its trailers) may yet say "not stored".
                if !crate::grpc::is_grpc(&parts.headers) {
                    advertise_expiry(config, &mut parts);
                }
                return Settled::Stream(parts, body);
            }
            not_stored(config, id, token, took_over, maybe_applied(&parts, None)).await;
            return Settled::Answer(Ok(Response::from_parts(parts, boxed(body))));
        }
    };
    let (body, trailers) = body;
    if cacheable(&config.policy, &parts, trailers.as_ref()) {
        advertise_expiry(config, &mut parts);
        let mut outcome = to_outcome(config, &parts, Some(&body), BodyMark::Whole);
        outcome.trailers = trailers.as_ref().map(trailer_fields).unwrap_or_default();
        if !complete(config, id, token, &outcome).await {
            // Not stored: the date would promise a replay that a retry will not get.
            parts
                .headers
                .remove(http::HeaderName::from_static(crate::IDEMPOTENCY_EXPIRES));
        }
    } else {
        let unknown = maybe_applied(&parts, trailers.as_ref());
        not_stored(config, id, token, took_over, unknown).await;
    }
    Settled::Answer(Ok(Response::from_parts(
        parts,
        full_with_trailers(body, trailers),
    )))
}

/// Reads a body to its end, discarding its data: one whose framing ends with its head (see
/// [`produce`]), whose data goes on no wire. Its trailers are kept (HTTP/2 sends them), as
/// a body read whole keeps them.
async fn read_to_end<B>(body: B) -> Result<Option<HeaderMap>, BoxError>
where
    B: HttpBody,
    B::Error: Into<BoxError>,
{
    tokio::pin!(body);
    // The body's own error type need not be `Send`: converted before the next await.
    while let Some(frame) = body
        .frame()
        .await
        .map(|f| f.map_err(Into::<BoxError>::into))
    {
        if let Ok(trailers) = frame?.into_trailers() {
            // Trailers end the body, as they do for hyper; an empty frame is none.
            return Ok(Some(trailers).filter(|t| !t.is_empty()));
        }
    }
    Ok(None)
}

/// Whether the policy stores a response: by its status, or for gRPC by the status its
/// `grpc-status` stands for (in its headers, or in `trailers` once they came; see
/// [`grpc::status`](crate::grpc::status)).
fn cacheable(
    policy: &idempotency_core::Policy,
    parts: &http::response::Parts,
    trailers: Option<&HeaderMap>,
) -> bool {
    // Never a `1xx` (`101 Switching Protocols`), whatever the policy says: its outcome is a
    // connection, and a replayed `101` upgrades nothing.
    if parts.status.is_informational() {
        return false;
    }
    let status = crate::grpc::status(&parts.headers, trailers);
    policy.is_cacheable(status.unwrap_or(parts.status.as_u16()))
}

/// [`cacheable`] for a reconcile hook's answer: never a `1xx`, a gRPC failure in its fields
/// judged by the status it stands for, and never a status past 599 (replayed as a 500).
fn hook_cacheable(policy: &idempotency_core::Policy, outcome: &Outcome) -> bool {
    let Some(status) = (200..600)
        .contains(&outcome.status)
        .then(|| StatusCode::from_u16(outcome.status).ok())
        .flatten()
    else {
        return false;
    };
    let (mut parts, ()) = Response::new(()).into_parts();
    parts.status = status;
    parts.headers = field_map(outcome.headers.clone(), |_| true);
    let trailers =
        (!outcome.trailers.is_empty()).then(|| field_map(outcome.trailers.clone(), |_| true));
    cacheable(policy, &parts, trailers.as_ref())
}

/// Whether the handler marked its response [`MaybeApplied`](crate::MaybeApplied), or it is a
/// gRPC failure that may have taken effect (`DEADLINE_EXCEEDED`, `CANCELLED`, `UNKNOWN`,
/// `INTERNAL`, `DATA_LOSS`: see [`grpc::may_have_applied`](crate::grpc::may_have_applied)),
/// which a gRPC handler has no way to mark, or a `1xx` (`101 Switching Protocols`): the
/// handler accepted the request and ran, and its outcome is a connection no store can replay.
fn maybe_applied(parts: &http::response::Parts, trailers: Option<&HeaderMap>) -> bool {
    parts.status.is_informational()
        || parts.extensions.get::<crate::MaybeApplied>().is_some()
        || crate::grpc::status(&parts.headers, trailers).is_some_and(crate::grpc::may_have_applied)
}

/// Settles the lease of a response the policy does not store: given back, so the retry runs
/// again ([`give_back`]); or, marked [`MaybeApplied`](crate::MaybeApplied) by its handler,
/// settled like a panic, for the outcome-unknown policy.
async fn not_stored(
    config: &Config,
    id: RecordId,
    token: LeaseToken,
    took_over: bool,
    maybe_applied: bool,
) {
    if maybe_applied {
        give_up(
            config,
            id,
            token,
            took_over,
            "a failure that may have taken effect",
        )
        .await;
        return;
    }
    Metrics::inc(&config.metrics.released, "idempotency_released_total");
    give_back(config, id, token, took_over, "outcome not cacheable").await;
}

/// Streams a cacheable response to the first client while keeping at most the stored-body
/// limit, and stores the outcome:
///
/// - the body ends within the limit: stored whole, *before* the client sees the end, so a
///   client that read the whole response and retries gets the replay;
/// - the body crosses the limit: stored at once without its body (`Idempotent-Replay-Body:
///   omitted`), and the rest is only forwarded — the lease is not held for it, and how the
///   rest went is not recorded (a body failing past the limit is still `omitted`);
/// - the first client goes away (or stops reading for a third of a lease), or the body fails:
///   the rest is drained for at most half a lease, then stored; a body that did not end by
///   then is stored without its body (`Idempotent-Replay-Body: incomplete`);
/// - trailers end the stream for the client (hyper sends them with its end): they are held
///   until the outcome is stored, and forwarded after it;
/// - gRPC within the limit: stored at the end, whose trailers carry its status; a status the
///   policy does not store (see [`cacheable`]) settles the lease as a response not stored
///   does. Over the limit it is stored as any body is, at the limit, without its body or
///   trailers, as a trailers-only `INTERNAL` (see `mark`): never a success without messages.
///
/// Until the outcome is stored the lease is renewed on the handler's schedule — while
/// waiting for the body, while a slow client takes a frame, and while draining — so no retry
/// can take the key over from a response still being produced; and once the first client is
/// gone, the key is answerable within half a lease.
async fn stream<ResBody, E>(
    config: &Config,
    (id, token, took_over): (RecordId, LeaseToken, bool),
    parts: http::response::Parts,
    body: ResBody,
    reply: Reply<E>,
    renew: &mut Renewals,
) where
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (policy, limit) = (&config.policy, config.max_stored_body);
    let head = to_outcome(config, &parts, None, BodyMark::Whole);
    let grpc = crate::grpc::is_grpc(&parts.headers);
    let maybe_applied = maybe_applied(&parts, None);
    // gRPC's status, from its trailers once they come.
    let mut grpc_status = None;
    // The trailers frame, the body's last: forwarded once the outcome is stored.
    let mut last: Option<http_body::Frame<Bytes>> = None;
    // With a declared length the client has the whole response once the last byte arrives,
    // before the stream's end: store before forwarding the frame that completes it. Declared
    // by a header, or by the body's exact size (which hyper sends as `Content-Length`).
    let declared: Option<usize> = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .or_else(|| usize::try_from(body.size_hint().exact()?).ok());
    let mut forwarded = 0usize;
    let (frames, receiver) = tokio::sync::mpsc::channel(4);
    let whole = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let streamed = Streamed {
        frames: receiver,
        whole: whole.clone(),
        length: declared.map(|n| n as u64),
    };
    let mut client = (reply
        .send(Ok(Response::from_parts(parts, streamed.boxed_unsync())))
        .is_ok())
    .then_some(frames);
    // Gives up on the first client: its stream ends in an error, never a clean (truncated)
    // end, as it does when this function stops for any reason before its end (a panic, its
    // task dropped): only the end below says the client had it all.
    let abandon = |client: &mut Option<Sender>| {
        client.take();
    };
    let mut kept = bytes::BytesMut::new();
    let mut trailers = Vec::new();
    let mut stored = false;
    let mut drain_until: Option<Instant> = client
        .is_none()
        .then(|| Instant::now() + policy.lease() / 2);
    let mut lost = false;
    // Whether the outcome written mid-body (at its declared length, or its head once over
    // the limit) was stored.
    let mut written = true;
    tokio::pin!(body);
    let ended = loop {
        // The body's own error type need not be `Send`: convert it inside the future, before
        // the result is held across any await.
        let next = async {
            let frame = AssertUnwindSafe(body.frame()).catch_unwind().await;
            frame.map(|o| o.map(|r| r.map_err(BodyError::new)))
        };
        tokio::pin!(next);
        // A body that streams its work is held, as a handler is, once its lease may have run
        // out (see `Renewals`); once stored, the lease protects nothing.
        let alive_until = (!stored).then_some(renew.alive_until);
        let frame = tokio::select! {
            frame = gated(alive_until, &mut next) => frame,
            _ = renew.every.tick(), if !stored => {
                if matches!(renew.renew(config, &id, token).await, Renewed::Lost) {
                    lost = true;
                    break false;
                }
                continue;
            }
            () = sleep_until_some(alive_until) => {
                if !renew.confirm(config, &id, token).await {
                    lost = true;
                    break false;
                }
                continue;
            }
            // A client that hangs up while the body is quiet (server-sent events between
            // two events) is gone now, not at the next frame.
            _ = closed(&client) => {
                client = None;
                drain_until = Some(Instant::now() + policy.lease() / 2);
                continue;
            }
            _ = sleep_until_some(drain_until) => break false,
        };
        let frame = match frame {
            Ok(Some(Ok(frame))) => frame,
            Ok(None) => break true,
            Ok(Some(Err(error))) => {
                tracing::warn!(%error, "the handler's response body failed mid-stream");
                abandon(&mut client);
                break false;
            }
            Err(_panic) => {
                Metrics::inc(&config.metrics.panics, "idempotency_panics_total");
                abandon(&mut client);
                break false;
            }
        };
        // Every frame is counted, stored or not: a body stored without its bytes (too large)
        // still ends cleanly only once it reached its declared length.
        if let Some(data) = frame.data_ref() {
            forwarded += data.len();
            if declared.is_some_and(|n| forwarded > n) {
                // More than the declared length: a broken body, not a replayable one.
                tracing::warn!("the response body is longer than its Content-Length");
                abandon(&mut client);
                break false;
            }
        }
        // Trailers end the body, as they do for hyper (which polls no further: tonic's body
        // would go on polling a handler's stream after an error's trailers). Kept for an
        // outcome stored now (one stored before, at a declared length or over the limit,
        // has none), and held until it is: they end the stream for the client.
        if let Some(map) = frame.trailers_ref() {
            trailers.extend(trailer_fields(map));
            grpc_status = crate::grpc::status_in(map);
            last = Some(frame);
            break true;
        }
        if let (Some(data), false) = (frame.data_ref(), stored) {
            if kept.len() + data.len() <= limit {
                kept.extend_from_slice(data);
                // Not gRPC's, whose status is still to come.
                if declared == Some(forwarded) && !grpc {
                    stored = true;
                    let mut outcome = head.clone();
                    outcome.body = std::mem::take(&mut kept).freeze();
                    written = complete(config, id, token, &outcome).await;
                }
            } else {
                // Too large to replay: store the head now, before the client can have it all.
                stored = true;
                kept = bytes::BytesMut::new();
                let mut outcome = head.clone();
                mark(&mut outcome, BodyMark::Omitted);
                written = complete(config, id, token, &outcome).await;
            }
            // Not written (the lease lost, or the store down for a lease): the body is not
            // polled on unguarded, beside an attempt that may hold the key now; it is
            // stopped as after a lost renewal (a write still being retried may land).
            if !written {
                lost = true;
                break false;
            }
        }
        let delivered = match &client {
            None => true,
            // Stored: no lease to protect; a slow reader just reads slowly.
            Some(sender) if stored => sender.send(Ok(frame)).await.is_ok(),
            Some(sender) => {
                // A client that takes no frame for a third of a lease counts as gone: the
                // lease is renewed meanwhile, but is not held hostage by a stalled reader.
                let send = sender.send(Ok(frame));
                let stall = tokio::time::sleep(policy.lease() / 3);
                tokio::pin!(send, stall);
                loop {
                    tokio::select! {
                        sent = &mut send => break sent.is_ok(),
                        _ = renew.every.tick() => {
                            if matches!(renew.renew(config, &id, token).await, Renewed::Lost) {
                                lost = true;
                                break false;
                            }
                        }
                        _ = &mut stall => break false,
                    }
                }
            }
        };
        if lost {
            break false;
        }
        if !delivered {
            abandon(&mut client);
            drain_until = Some(Instant::now() + policy.lease() / 2);
        }
    };
    if lost {
        // As a handler is (`run_detached`): stopped at its await, before the work it has not
        // reached, which the attempt that holds the key now runs; its client's stream is cut
        // off. Nothing to store or give back: the token is fenced off.
        tracing::warn!(record = %id, "the idempotency lease was lost while the response streamed; stopping it");
        abandon(&mut client);
        return;
    }
    // A body shorter than its declared length ended early: not the whole response.
    let all = ended && declared.is_none_or(|n| forwarded == n);
    if !stored {
        let mut outcome = head;
        if !all {
            mark(&mut outcome, BodyMark::Incomplete);
            complete(config, id, token, &outcome).await;
        } else if grpc && grpc_status.is_some_and(|status| !config.policy.is_cacheable(status)) {
            // A failure gRPC reported in its trailers (`UNAVAILABLE`, `UNAUTHENTICATED`):
            // not stored, as the HTTP status it stands for would not be.
            let unknown = maybe_applied || grpc_status.is_some_and(crate::grpc::may_have_applied);
            not_stored(config, id, token, took_over, unknown).await;
        } else {
            outcome.body = kept.freeze();
            outcome.trailers = trailers;
            complete(config, id, token, &outcome).await;
        }
    }
    // The trailers, now that the outcome is settled (not after a body shorter than its
    // declared length: they would end it cleanly); a client that went away meanwhile missed
    // them, and reading on must see an error.
    if let (Some(frame), Some(sender), true) = (last, &client, all)
        && sender.send(Ok(frame)).await.is_err()
    {
        client = None;
    }
    // Whole for the client only if it was still being fed: one given up on (stalled, gone)
    // missed the frames forwarded after that, and reading on it must see an error.
    if all && client.is_some() {
        whole.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    drop(client); // the client sees the end only now, after the outcome is stored
}

type Sender = tokio::sync::mpsc::Sender<Result<http_body::Frame<Bytes>, BodyError>>;

/// Resolves when the first client's end of the stream is gone; never without a client.
async fn closed(client: &Option<Sender>) {
    match client {
        Some(sender) => sender.closed().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until the deadline, or forever when there is none.
async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The streamed response body: frames forwarded by the task that owns the lease. The end of
/// the frames is clean only when that task said it forwarded the whole body (`whole`, set
/// before its sender is dropped); any other end (it gave up on the response, panicked, or
/// was dropped) is an error, so hyper aborts the response instead of ending it cleanly: a
/// client never takes a truncated body for a whole one.
///
/// Its length, when the handler's body declared one, is its exact size: hyper frames it by
/// `Content-Length`, so an abort shows as a short body. Without it an HTTP/1.0 response (a
/// proxy's default upstream protocol) is framed by the connection's close, and an abort is
/// a clean end: a client took a truncated body for the whole response.
struct Streamed {
    frames: tokio::sync::mpsc::Receiver<Result<http_body::Frame<Bytes>, BodyError>>,
    whole: Arc<std::sync::atomic::AtomicBool>,
    length: Option<u64>,
}

impl HttpBody for Streamed {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BodyError>>> {
        match self.frames.poll_recv(cx) {
            Poll::Ready(None) if !self.whole.load(std::sync::atomic::Ordering::SeqCst) => {
                Poll::Ready(Some(Err(BodyError::new(
                    "the response was cut off before its end",
                ))))
            }
            other => other,
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.length.map_or_else(
            http_body::SizeHint::default,
            http_body::SizeHint::with_exact,
        )
    }
}

/// Renews the lease; a store that panics is taken for a failed call (`Unavailable`), as the
/// executor's renewals take it: unwound, the panic would stop the handler (or the response
/// stream) the renewal runs beside, mid-effect, and the retry after the lease would run it
/// again.
async fn renew_lease(
    config: &Config,
    id: &RecordId,
    token: LeaseToken,
    lease: Duration,
) -> Result<(), Error> {
    let renew = config.store.renew(id, token, lease);
    idempotency_core::panic_as_unavailable(renew, "the store's renew panicked").await
}

/// Gives back the lease of a run that stored nothing, so that a retry runs again: released;
/// or, when this run took the key over from an attempt whose outcome is unknown, ended and
/// kept (renewed for zero), as the executor does: the retry is taken over in turn and the
/// outcome-unknown policy asked again (a reconcile hook may find that attempt's effect by
/// then), where a released key would be a fresh run that asks nothing.
async fn give_back(
    config: &Config,
    id: RecordId,
    token: LeaseToken,
    took_over: bool,
    why: &'static str,
) {
    let _ = settle_lease(config, id, token, took_over, why).await;
}

/// Settles the lease of a handler whose outcome is unknown (it panicked, or answered a failure
/// marked [`MaybeApplied`](crate::MaybeApplied)): released under [`OutcomeUnknown::Reexecute`](crate::OutcomeUnknown), so the
/// retry runs again; under the other policies ended and kept (renewed for zero), so that the
/// retry is taken over and the policy decides, as after a crash. A lease `took_over` from an
/// attempt whose outcome is unknown is ended under every policy: released, the record of that
/// attempt would go with it (as [`give_back`] keeps it, and the executor does).
async fn give_up(
    config: &Config,
    id: RecordId,
    token: LeaseToken,
    took_over: bool,
    why: &'static str,
) {
    let end = took_over || !matches!(config.outcome_unknown, crate::OutcomeUnknown::Reexecute);
    if end {
        tracing::warn!(why, record = %id, "the outcome is unknown: the key is kept for the outcome-unknown policy");
    }
    let _ = settle_lease(config, id, token, end, why).await;
}

/// [`settle_lease`] run to its end even if the request future is dropped meanwhile, and
/// counted by `drain`; says whether the lease is settled now (or was no longer this one's).
async fn settle_lease_in_any_case(
    config: &Arc<Config>,
    id: RecordId,
    token: LeaseToken,
    end: bool,
    why: &'static str,
) -> bool {
    let (config, running) = (config.clone(), config.detached.token());
    let settle = async move {
        let _running = running;
        settle_lease(&config, id, token, end, why).await
    };
    finish_in_any_case(settle.in_current_span()).await
}

/// Releases the lease, or ends it and keeps its record (`end`). A call that fails is retried
/// in a task of its own (counted by `drain`): left to run out, the lease would answer the
/// retries `409` for a whole lease, and a released one would then come back as an attempt
/// whose outcome is unknown. Says whether the lease is settled now (`false`: still held
/// while the retries go on).
async fn settle_lease(
    config: &Config,
    id: RecordId,
    token: LeaseToken,
    end: bool,
    why: &'static str,
) -> bool {
    // A store that panics is taken for a failed call, as everywhere in the layer: unwound,
    // the panic replaced the handler's answer with a 500 and left the lease to run out.
    let settled = if end {
        let end = config.store.renew(&id, token, Duration::ZERO);
        idempotency_core::panic_as_unavailable(end, "the store's renew panicked").await
    } else {
        let release = config.store.release(&id, token);
        idempotency_core::panic_as_unavailable(release, "the store's release panicked").await
    };
    if let Err(error) = settled
        && !matches!(error, Error::LeaseLost)
    {
        tracing::warn!(%error, why, "could not give the idempotency lease back; retrying");
        let store = config.store.clone();
        config.detached.spawn(async move {
            if end {
                end_orphan(&*store, &id, token).await;
            } else {
                release_orphan(&*store, &id, token).await;
            }
        });
        return false;
    }
    true
}

/// Stores the outcome; says whether it was. A store blip must not lose it (the retry would
/// run the operation again), so an unavailable store is retried, renewing the lease, for up
/// to one lease; the response then goes out, and the write goes on in a task of its own
/// ([`complete_or_keep_trying`], counted by `drain`) until the store takes it.
async fn complete(config: &Config, id: RecordId, token: LeaseToken, outcome: &Outcome) -> bool {
    let m = &config.metrics;
    let (store, tracker, policy) = (config.store.clone(), &config.detached, &config.policy);
    match complete_or_keep_trying(store, tracker, id, token, outcome, policy).await {
        Ok(()) => {
            Metrics::inc(&m.executions, "idempotency_executions_total");
            true
        }
        Err(Error::LeaseLost) => {
            Metrics::inc(&m.lease_lost, "idempotency_lease_lost_total");
            tracing::error!("lease lost before completion: another attempt owns the key now");
            false
        }
        Err(error @ Error::Unavailable(_)) => {
            tracing::error!(%error, "the outcome could not be stored within a lease; still trying in the background");
            false
        }
        Err(error) => {
            tracing::error!(%error, "the store refused the outcome; still trying in the background (a marker in its place if it keeps refusing it)");
            false
        }
    }
}

/// Adds `Idempotency-Expires` to a response about to be stored, when configured: stored with
/// it, every replay says the same date. Read before the outcome is written, so the date is
/// never after the store's own expiry (clock skew aside).
fn advertise_expiry(config: &Config, parts: &mut http::response::Parts) {
    if let Some(value) = expiry(config) {
        parts.headers.insert(
            http::HeaderName::from_static(crate::IDEMPOTENCY_EXPIRES),
            value,
        );
    }
}

/// [`advertise_expiry`] for an outcome the layer stores itself (what a reconcile hook
/// found), in place of any such header it had.
fn advertise_expiry_of(config: &Config, mut outcome: Outcome) -> Outcome {
    if let Some(value) = expiry(config) {
        let name = crate::IDEMPOTENCY_EXPIRES;
        outcome
            .headers
            .retain(|(header, _)| !header.eq_ignore_ascii_case(name));
        outcome = outcome.with_header(name, Bytes::copy_from_slice(value.as_bytes()));
    }
    outcome
}

/// The `Idempotency-Expires` of an outcome stored now, if configured.
fn expiry(config: &Config) -> Option<HeaderValue> {
    if !config.advertise_expiry {
        return None;
    }
    expires_after(config.policy.retention())
}

/// `Idempotency-Expires` for an outcome stored now and kept `retention`; none past what an
/// HTTP-date can say (the year 9999: `httpdate` panics there), which is kept for good anyway.
pub(crate) fn expires_after(retention: std::time::Duration) -> Option<HeaderValue> {
    /// 9999-12-31T23:59:59Z, in seconds since the Unix epoch.
    const LAST_HTTP_DATE: u64 = 253_402_300_799;
    let until = std::time::SystemTime::now().checked_add(retention)?;
    let since_epoch = until.duration_since(std::time::UNIX_EPOCH).ok()?;
    (since_epoch.as_secs() <= LAST_HTTP_DATE)
        .then(|| HeaderValue::from_str(&httpdate::fmt_http_date(until)).ok())
        .flatten()
}

/// How much of the body an outcome carries; replays say so in `Idempotent-Replay-Body`.
#[derive(Clone, Copy)]
enum BodyMark {
    /// The whole body.
    Whole,
    /// None: larger than the stored-body limit.
    Omitted,
    /// None: the body did not end (the first client left, or it failed) in time.
    Incomplete,
}

fn mark(outcome: &mut Outcome, body: BodyMark) {
    let value = match body {
        BodyMark::Whole => return,
        BodyMark::Omitted => "omitted",
        BodyMark::Incomplete => "incomplete",
    };
    outcome.body = Bytes::new();
    // Headers that describe the body that is not there would mislead a replay's client.
    outcome.headers.retain(|(name, _)| {
        !matches!(
            name.as_str(),
            "content-encoding"
                | "content-range"
                | "content-md5"
                | "digest"
                | "content-digest"
                | "repr-digest"
                | "etag"
        )
    });
    outcome.headers.push((
        "idempotent-replay-body".into(),
        Bytes::from_static(value.as_bytes()),
    ));
    // gRPC: a replay without its messages says so in its status (a trailers-only `INTERNAL`);
    // with no `grpc-status` at all, some clients took it for a success without messages.
    crate::grpc::mark_not_replayable(outcome, value);
}

fn to_outcome(
    config: &Config,
    parts: &http::response::Parts,
    body: Option<&Bytes>,
    whole: BodyMark,
) -> Outcome {
    let mut outcome = Outcome::new(parts.status.as_u16());
    let named = named_by_connection(
        parts
            .headers
            .get_all(http::header::CONNECTION)
            .iter()
            .map(|value| value.as_bytes()),
    );
    for (name, value) in &parts.headers {
        if stored_header(config, name.as_str(), &named) {
            outcome.headers.push((
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            ));
        }
    }
    match body {
        Some(body) if body.len() <= config.max_stored_body => outcome.body = body.clone(),
        Some(_) => mark(&mut outcome, BodyMark::Omitted),
        None => mark(&mut outcome, whole),
    }
    outcome
}

/// The headers the `Connection` values name, lowercase: hop-by-hop for this response too
/// (RFC 9110 §7.6.1), meant for the next hop of the first answer, not for a retry's client.
/// Split as bytes: a part that is not a header name (obs-text) names nothing, and the
/// value's other parts still count.
fn named_by_connection<'a>(values: impl Iterator<Item = &'a [u8]>) -> Vec<String> {
    values
        .flat_map(|value| value.split(|&byte| byte == b','))
        .filter_map(|name| std::str::from_utf8(name.trim_ascii()).ok())
        .map(str::to_ascii_lowercase)
        .filter(|name| !name.is_empty())
        .collect()
}

/// Whether a response header (its lowercase `name`) is stored with the outcome.
fn stored_header(config: &Config, name: &str, named_by_connection: &[String]) -> bool {
    !(NOT_STORED.contains(&name)
        || (name == "set-cookie" && !config.store_set_cookie)
        || named_by_connection.iter().any(|named| named == name))
}

/// A reconcile hook's answer with the headers a handler's response would have had dropped
/// ([`to_outcome`]): a hook that copies a processor's response must not store its framing.
fn hook_outcome(config: &Config, mut outcome: Outcome) -> Outcome {
    let named = named_by_connection(
        outcome
            .headers
            .iter()
            .filter(|(name, _)| name.eq_ignore_ascii_case("connection"))
            .map(|(_, value)| &value[..]),
    );
    outcome
        .headers
        .retain(|(name, _)| stored_header(config, &name.to_ascii_lowercase(), &named));
    outcome
}

/// Whether a trailer (its lowercase name) may be sent: not a field RFC 9110 §6.5.1 keeps out
/// of trailers (framing, routing, authentication, response control, how to read the
/// content), which hyper drops over HTTP/1.1, nor a connection-specific one, for which h2
/// resets the stream.
fn replayable_trailer(name: &str) -> bool {
    const NEVER: [&str; 13] = [
        "authorization",
        "cache-control",
        "content-encoding",
        "content-length",
        "content-range",
        "content-type",
        "host",
        "max-forwards",
        "set-cookie",
        "trailer",
        "transfer-encoding",
        "te",
        "proxy-connection",
    ];
    !NEVER.contains(&name) && !NOT_STORED.contains(&name)
}

/// Trailers as an outcome's fields, in order, but those that may not be sent
/// ([`replayable_trailer`]).
fn trailer_fields(map: &HeaderMap) -> Vec<(String, Bytes)> {
    map.iter()
        .filter(|(name, _)| replayable_trailer(name.as_str()))
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}

/// An outcome's fields as a header map, in order, but those `keep` leaves out or that are not
/// a valid name and value.
fn field_map(fields: Vec<(String, Bytes)>, keep: impl Fn(&str) -> bool) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in fields {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) && keep(name.as_str())
        {
            if map.len() >= REPLAYED_FIELDS {
                tracing::warn!(
                    "a stored outcome has more than {REPLAYED_FIELDS} header fields; the rest are not replayed"
                );
                break;
            }
            map.append(name, value);
        }
    }
    map
}

/// Header fields (and trailers) a replay carries at most. A record may hold more than a
/// response can (24,576 in all, past which adding one panics): one stored by an older
/// version's unbounded operator `PUT`, or a reconcile hook's answer. Bounded well under that,
/// so the fields the layers add to a replay still fit; unbounded, every retry of the key
/// panicked for its retention.
const REPLAYED_FIELDS: usize = 4096;

fn replay(outcome: Outcome) -> Response<Body> {
    // The layer's own marker, not a handler's answer: a gRPC client gets it as a status.
    let marker = outcome.is_not_stored();
    // Filtered again: a reconcile hook's answer, or a record stored before the filter, may
    // hold trailers that would reset an HTTP/2 stream on every replay.
    let trailers = field_map(outcome.trailers, replayable_trailer);
    let trailers = (!trailers.is_empty()).then_some(trailers);
    // HTTP/1.1 sends only the trailers a `Trailer` header names (not stored: it names the
    // stored trailers here, once each).
    let announced = trailers.as_ref().and_then(|map| {
        let names: Vec<&str> = map.keys().map(http::HeaderName::as_str).collect();
        HeaderValue::from_str(&names.join(", ")).ok()
    });
    let mut response = Response::new(full_with_trailers(outcome.body, trailers));
    *response.status_mut() =
        StatusCode::from_u16(outcome.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    headers.extend(field_map(outcome.headers, |_| true));
    if let Some(announced) = announced {
        headers.insert(header::TRAILER, announced);
    }
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    if marker {
        response.extensions_mut().insert(crate::problem::Refused {
            problem: Problem::Internal,
            transient: false,
        });
    }
    response
}
