//! A tower/axum middleware speaking the IETF draft "The Idempotency-Key HTTP Header Field".
//!
//! Put [`IdempotencyLayer`] in front of handlers that create or change things (`POST
//! /charges`). The first request with a key runs and its response is stored; every retry
//! with the same key gets the stored response, marked `Idempotent-Replayed: true`, instead
//! of running again.
//!
//! ```
//! use std::sync::Arc;
//! use axum::{Router, routing::post, http::request::Parts};
//! use idempotency_core::{MemoryStore, Scope, Store};
//! use idempotency_tower::{IdempotencyContext, IdempotencyLayer, NoScope};
//!
//! async fn create_charge(ctx: axum::Extension<IdempotencyContext>) -> (axum::http::StatusCode, String) {
//!     // Store ctx.record_id on the charge row under a unique constraint: exactly once even
//!     // if the process dies between the charge and the stored outcome.
//!     (axum::http::StatusCode::CREATED, format!("charge for record {}", ctx.record_id))
//! }
//!
//! let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
//! let layer = IdempotencyLayer::new(store)
//!     .require_key(true)
//!     .try_scope_fn(|parts: &Parts| {
//!         // Who the key belongs to: in production, the authenticated principal. Nobody
//!         // named is refused (401), never given a scope others share.
//!         match parts.headers.get("x-account-id").and_then(|v| v.to_str().ok()) {
//!             Some(account) if !account.is_empty() => Ok(Scope::new(account)),
//!             _ => Err(NoScope::Unauthenticated("send X-Account-Id".into())),
//!         }
//!     });
//! // `route_layer`: a request to no route (a typo'd path) is not claimed, its 404 not stored.
//! let app: Router = Router::new()
//!     .route("/charges", post(create_charge))
//!     .route_layer(layer.clone());
//! // After `axum::serve(..).with_graceful_shutdown(..)` returns: handlers whose client left
//! // run on in tasks of their own; let them store their outcomes before the process exits
//! // (bounded: writes to a store that is down are retried for up to an hour).
//! # async fn after_serving(layer: IdempotencyLayer) {
//! let grace = std::time::Duration::from_secs(30);
//! let _ = tokio::time::timeout(grace, layer.drain()).await;
//! # }
//! ```
//!
//! # The protocol
//!
//! | situation | answer |
//! |---|---|
//! | method not configured (default: anything but POST, PATCH) | passed through untouched |
//! | no key, key optional (default) | passed through untouched |
//! | no key, key required | 400 `urn:idempotency:problem:missing-key` |
//! | no principal to scope the key to ([`IdempotencyLayer::try_scope_fn`]) | 401 `urn:idempotency:problem:unauthenticated` (or 400 when it cannot be read); nothing is claimed |
//! | key empty, > 255 chars, not printable ASCII, a space first or last or in a bare (unquoted) key, a list, a parameterised or non-string item, or several header lines | 400 `urn:idempotency:problem:invalid-key` |
//! | body over the limit (by `Content-Length`, or while reading a chunked body) | 413 `urn:idempotency:problem:payload-too-large` |
//! | body that breaks off before its end (a reset, an outer read timeout) | 400 `urn:idempotency:problem:invalid-request`; nothing runs, resend |
//! | first request | runs the handler; stores the response if cacheable |
//! | retry after completion | the stored response + `Idempotent-Replayed: true` |
//! | retry while the first still runs | 409 `urn:idempotency:problem:in-flight` + `Retry-After` (what is left of the layer's mean run time, not the lease) (or, with [`IdempotencyLayer::wait_for_in_flight`], waits for the replay) |
//! | same key, different method/path/body | 422 `urn:idempotency:problem:key-reused` |
//! | store down | 503 `urn:idempotency:problem:store-unavailable` + `Retry-After`; the handler does not run |
//! | handler panics | 500 `urn:idempotency:problem:internal`; the key is released, or, under an outcome-unknown policy other than `Reexecute` (or when this request took it over from an attempt whose outcome is unknown), kept as an attempt whose outcome is unknown (it may have had its effect), so that the retry meets that policy |
//! | handler answers a status not stored (a 5xx, a 409, a 429) | passed on; the key is released (or, when this request took it over from an attempt whose outcome is unknown, kept for that policy, which the next retry meets again), or, marked [`MaybeApplied`] by the handler, settled like a panic |
//! | handler answers `101 Switching Protocols` (an upgrade) | passed on; it ran, and its outcome, a connection, cannot be stored: settled like a panic |
//! | an earlier attempt's lease ran out before it stored an outcome (it crashed or hung) | per [`IdempotencyLayer::on_outcome_unknown`]: runs again (default); or 409 `urn:idempotency:problem:outcome-unknown` to every retry, the record kept unknown until an operator resolves it (`PUT` the outcome found, or `DELETE`); or the application's reconcile hook finds the effect and it is replayed |
//!
//! Keys are read as an RFC 8941 sf-string (`"abc"`) or a bare value (`abc`): both name the
//! same key. Every error body is `application/problem+json` (RFC 9457), except to a gRPC
//! request, which is answered with a gRPC status (below).
//!
//! # What the fingerprint covers
//! The method, the path and query as the client sent them (behind axum's `Router::nest`,
//! with its prefix: the `axum` feature, on by default, reads axum's `OriginalUri`), and the
//! body's bytes (or its canonical JSON, [`IdempotencyLayer::canonical_json`]); no header
//! unless named with [`IdempotencyLayer::fingerprint_headers`]. So a header that changes what the body means
//! belongs in the fingerprint or the [scope](IdempotencyLayer::scope_fn): an account header
//! (`On-Behalf-Of`, a connected account) or an API version, or the same key and body on
//! another account replay the first account's charge. So does the host (`Host`,
//! `:authority`), which the fingerprint leaves out: an application that picks its tenant by
//! host scopes keys by it.
//!
//! Layers that change the request or the response belong **outside** this one (added after
//! it, with axum's `.layer`), so that it sees what the handler sees and stores what every
//! client can read:
//! - request decompression: inside, the fingerprint covers the compressed bytes, and a client
//!   that compresses its retry again (gzip stamps the time) gets a 422, then, told to use a
//!   new key, may charge twice;
//! - response compression: inside, the response is stored compressed and replayed with its
//!   `Content-Encoding` to a retry that did not ask for it.
//!
//! # What is stored
//! 2xx, 3xx and 4xx responses except 401, 403, 406, 407, 408, 409, 411, 412, 415, 417, 421,
//! 423, 425, 428, 429 and 431 ([`Policy`](idempotency_core::Policy) decides; configure it with
//! [`IdempotencyLayer::policy`]). A 5xx or one of those statuses releases the key, so the retry
//! runs again: most of them depend on headers the fingerprint leaves out (credentials,
//! `Accept`, `If-Match`, `Content-Type`, framing), the others say "not now". A gRPC response
//! (`application/grpc…`, always HTTP 200) is decided by its `grpc-status`, in its headers or
//! its trailers, taken as the HTTP status it stands for (`UNAVAILABLE` 503, `UNAUTHENTICATED`
//! 401, `NOT_FOUND` 404, `CANCELLED` 408, …): a transient failure is not replayed to the
//! retries gRPC clients make of it. One that may have taken effect (`DEADLINE_EXCEEDED`,
//! `CANCELLED`, `UNKNOWN`, `INTERNAL`, `DATA_LOSS`) is kept for the outcome-unknown policy,
//! as a response marked `MaybeApplied` is (a gRPC handler cannot mark one). A streamed gRPC
//! body is stored at its end, where its status comes; over the stored-body limit it is
//! stored at the limit without its body or trailers, as any body is, and its replay is a
//! trailers-only `INTERNAL` (never a success without messages). Trailers
//! reach the first client only once the outcome is stored (they end its stream). The layer's
//! own refusals of a gRPC request are gRPC statuses too, trailers-only: a retry of a call
//! still running, or one whose request body broke off, is `UNAVAILABLE` (which gRPC retry
//! policies retry; `Retry-After` is sent as `grpc-retry-pushback-ms`), an outcome unknown
//! `FAILED_PRECONDITION`, a key reused for
//! another call or a missing or malformed key `INVALID_ARGUMENT`, the detail in
//! `grpc-message`. A handler's own responses, and replays, are left as they are.
//! A failure that may have taken effect
//! all the same (a processor that timed out) is marked [`MaybeApplied`] by its handler: its
//! key is then kept for the [`OutcomeUnknown`] policy instead of given back. Hop-by-hop
//! headers (and those the response's `Connection` names), `Content-Length`, `Date` and (by
//! default) `Set-Cookie` are not stored. Trailers (gRPC's status, a checksum) are stored under
//! the same rules, but for fields kept out of trailers (RFC 9110 §6.5.1: framing, content
//! type, authentication, `Cache-Control`, …), and replayed (chunked, with a `Trailer` header naming them, which HTTP/1.1
//! needs; hyper sends them only to a client that sent `TE: trailers`), except for a streamed
//! body stored before its end (at its declared length, or too large to keep), whose trailers
//! had not come yet.
//!
//! # Disconnects, cancellation, panics, long operations
//! The claim (`Store::begin`) and the handler run to their end whatever happens to the
//! request future: it can be dropped at any await — a client hang-up, an outer
//! `tower::timeout`, a `select!` — and no lease is left claimed by nobody. Dropped before the
//! claim lands, a lease granted meanwhile is released; dropped after, the handler still runs
//! once and its outcome is stored for the retry. A panicking handler answers 500 and
//! releases its lease (kept as outcome-unknown under `Reject` or `Reconcile`, see above). A
//! handler that runs longer than the lease renews it every third of the lease, counted from
//! the claim's ask (the store counts the lease from then). The renewals start at the
//! handler's first await: a first step that blocks its thread for longer than a lease
//! (`block_in_place`, a blocking client called before any await) is not renewed meanwhile,
//! and a retry may take the key over; call blocking code through `spawn_blocking(..).await`.
//!
//! **Put timeouts outside this layer, never between it and the handler.** A
//! `tower::timeout::TimeoutLayer` or `tower_http`'s `TimeoutLayer` inside it drops the
//! handler mid-operation and answers an error (or a 408) that this layer does not store: the
//! key is released, and the retry runs the operation a second time after its first run may
//! have charged the card. Outside, the timeout drops only this layer's future, and the
//! handler still runs to its end once.
//!
//! The handler's first step runs in the request's task; a handler that has to wait (almost
//! any) continues in a task of its own, so values a layer outside this one put in a
//! `tokio::task_local!` are not there after its first wait: pass them in request extensions.
//!
//! # Streaming and large responses
//! A cacheable response whose exact length is within the stored-body limit is read whole,
//! stored, then sent (the client never sees it before it is stored). So is, with no body, a
//! response whose framing ends with its head (a 204, a 304, one of `Content-Length: 0`),
//! whatever its body's size: its body is read to its end (what it does runs under the
//! lease), then the outcome is stored, then the head is sent.
//! Any other response streams to the first client as it is produced, with at most the limit
//! kept in memory:
//!
//! - it ends within the limit: stored whole before the client sees the end of the stream;
//! - it crosses the limit: stored at once without its body; replays carry the status and
//!   headers, an empty body and `Idempotent-Replay-Body: omitted`. Stored then, the record
//!   does not say how the rest of the stream went: `omitted` means "too large to keep", not
//!   "sent whole" (a body that fails past the limit cuts its first client off with an error,
//!   and is still replayed `omitted`). The lease is not held for the rest, so a slow reader
//!   of a large download is never cut off for its pace;
//! - its client leaves, stalls for a third of a lease, or the body fails, before the end
//!   (and before the limit):
//!   the first client's response is cut off (an error, never a clean truncated end), the rest
//!   is drained for at most half a lease, then stored; a body that has not ended by then is
//!   replayed empty with `Idempotent-Replay-Body: incomplete`.
//!
//! A retry never executes a second time, and a stream that never ends (server-sent events)
//! never holds its key longer than its client listens plus half a lease. Nor does a body of
//! known size that stalls before its end (an upstream's response passed through): read
//! whole, it is read for at most half a lease once its client left, then stored as
//! incomplete.
//!
//! # Handlers
//! Handlers find the [`IdempotencyContext`] (record id, scope, key) in the request
//! extensions; with the `axum` feature it is an extractor (a 500 problem+json, not a
//! panic, when the layer is missing; `Option<IdempotencyContext>` where a key is optional).
//!
//! # Features
#![doc = document_features::document_features!()]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "admin")]
mod admin;
mod canonical;
#[cfg(feature = "axum")]
mod extract;
mod future;
mod grpc;
mod key;
mod layer;
mod metrics;
mod problem;
mod retry_after;
mod service;
mod unknown;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use idempotency_core::{BoxError, IdempotencyKey, RecordId, Scope};

#[cfg(feature = "admin")]
#[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
pub use admin::{admin_router, record_view};
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use extract::MissingIdempotencyLayer;
pub use future::ResponseFuture;
pub use key::{IDEMPOTENCY_EXPIRES, IDEMPOTENCY_KEY, InvalidKey, parse_key};
pub use layer::{IdempotencyLayer, NoScope};
pub use metrics::{Metrics, MetricsSnapshot};
pub use problem::Problem;
pub use service::Idempotency;
pub use unknown::{MaybeApplied, OutcomeUnknown, Reconcile, Unresolved};

/// The body type the middleware hands to the inner service and returns.
pub type Body = UnsyncBoxBody<Bytes, BodyError>;

/// The error of a [`Body`]: whatever the wrapped body failed with.
///
/// A concrete type rather than a `Box<dyn Error>` in the body's type: a trait object there
/// trips a compiler limitation (higher-ranked `Send`) when the middleware makes the handler
/// able to move into a task of its own.
#[derive(Debug)]
pub struct BodyError(BoxError);

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for BodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl BodyError {
    pub(crate) fn new(error: impl Into<BoxError>) -> Self {
        Self(error.into())
    }
}

pub(crate) fn full(bytes: Bytes) -> Body {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// [`full`], then `trailers` when there are any. With trailers the body declares no size, so
/// that HTTP/1.1 sends it chunked, the only framing that carries trailers (hyper drops them
/// from a body sent with a `Content-Length`).
pub(crate) fn full_with_trailers(bytes: Bytes, trailers: Option<http::HeaderMap>) -> Body {
    match trailers {
        None => full(bytes),
        Some(trailers) => {
            let frames = futures::stream::iter([
                Ok::<_, std::convert::Infallible>(http_body::Frame::data(bytes)),
                Ok(http_body::Frame::trailers(trailers)),
            ]);
            http_body_util::StreamBody::new(frames)
                .map_err(|never| match never {})
                .boxed_unsync()
        }
    }
}

/// What a handler learns about the key of the request it runs for (a request extension).
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    /// The record id: store it on business rows under a unique constraint.
    pub record_id: RecordId,
    /// The scope the key belongs to.
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
}
