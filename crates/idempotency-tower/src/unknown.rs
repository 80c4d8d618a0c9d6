//! What the layer does when an earlier attempt's outcome is unknown ([`Begin::TakeOver`]).
//!
//! [`Begin::TakeOver`]: idempotency_core::Begin::TakeOver

use std::{fmt, future::Future, sync::Arc};

use futures::future::BoxFuture;
use idempotency_core::{BoxError, Outcome, RecordId};

type Hook =
    dyn Fn(Unresolved) -> BoxFuture<'static, Result<Option<Outcome>, BoxError>> + Send + Sync;

/// What a reconcile hook is asked about: the key's record, and the request retrying it (the
/// same request as the unfinished attempt: an unfinished lease is taken over by the same
/// fingerprint only). A hook compares what it finds with the request before answering
/// with it: a record id can outlive its retention and be reused by another operation.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Unresolved {
    /// The record whose earlier attempt never stored an outcome.
    pub record_id: RecordId,
    /// The retry's method.
    pub method: http::Method,
    /// The retry's URI.
    pub uri: http::Uri,
    /// The retry's headers.
    pub headers: http::HeaderMap,
    /// The retry's body.
    pub body: bytes::Bytes,
}

/// A response extension a handler adds to a failure whose effect may have happened all the
/// same: a processor that timed out after it may have charged, a commit whose answer was lost.
/// A response the policy does not store (a 5xx, a 409, a 429) gives its key back, and the
/// retry runs again; with this extension the key is settled like a handler that panicked:
/// under [`OutcomeUnknown::Reject`] and [`OutcomeUnknown::Reconcile`] it is kept, and the
/// retry meets an attempt whose outcome is unknown (409, or the reconcile hook); under
/// [`OutcomeUnknown::Reexecute`] it is given back as before (unless the request took the key
/// over from an attempt whose outcome is unknown: that record is kept). A response the policy stores is
/// stored: its outcome is known.
///
/// An inner service's `Err` carries no extension, and the layer cannot look into it: it is
/// taken for a refusal before anything ran (load shed, a closed buffer) and gives the key
/// back under every policy. A service that forwards the request (a proxy's client) fails so
/// after the upstream may have acted: map such errors to a response marked with this
/// extension inside the layer (a `502`, say), or the retry runs the operation again.
///
/// ```
/// use idempotency_tower::MaybeApplied;
///
/// // The processor did not answer in time: it may have charged.
/// let mut response = http::Response::builder().status(504).body("try again later").unwrap();
/// response.extensions_mut().insert(MaybeApplied);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaybeApplied;

/// The policy for a request whose key was held by an earlier attempt that never stored an
/// outcome: its lease ran out (the process crashed mid-operation, or hung). Was the card
/// charged? The store cannot know; this decides who finds out.
///
/// The store remembers such an attempt until its purge: in memory and on Postgres for a day
/// by default ([`UNKNOWN_OUTCOME_RETENTION`](idempotency_core::UNKNOWN_OUTCOME_RETENTION); set
/// the store's unknown-outcome retention to the longest retention of your policies), on Redis
/// alone for an hour ([`LATE_COMPLETION_GRACE`](idempotency_core::LATE_COMPLETION_GRACE)).
/// A retry once it is gone runs as a new request whatever this says.
///
/// ```
/// use std::sync::Arc;
/// use idempotency_core::{MemoryStore, Outcome};
/// use idempotency_tower::{IdempotencyLayer, OutcomeUnknown};
///
/// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new())).on_outcome_unknown(
///     OutcomeUnknown::reconcile(|unresolved| async move {
///         // Look for the effect the crashed attempt may have had, by its record id:
///         // `SELECT id FROM charges WHERE record_id = $1`. Found (for this request): its
///         // response.
///         let _ = unresolved.record_id;
///         let charged: Option<String> = None;
///         Ok(charged.map(|id| Outcome::new(201).with_body(format!(r#"{{"id":"{id}"}}"#))))
///     }),
/// );
/// ```
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum OutcomeUnknown {
    /// Run the operation again (the default). Right when the operation is idempotent by
    /// itself: its effect is keyed by the record id under a unique constraint.
    #[default]
    Reexecute,
    /// Answer `409` problem+json `urn:idempotency:problem:outcome-unknown`, and keep the
    /// record what it is, an attempt whose outcome is unknown (its lease ended at once), so
    /// every retry is told the same until an operator reconciles the operation: found its
    /// effect — store the response its retries should get (the admin routes' `PUT`,
    /// [`resolve_unknown`](idempotency_core::resolve_unknown)), and they replay it; found
    /// none — release the record (`DELETE`), and the next request runs. The record is kept
    /// as long as the store keeps an unfinished attempt, counted from the last retry (see
    /// above: on Postgres and in memory its unknown-outcome retention, a day by default —
    /// set it to the longest retention of your policies; **on Redis alone an hour**, so use
    /// Postgres or the hybrid with `Reject`); past that the key runs as new: reconcile within
    /// it. Before 6 December 2026 the `409` was stored as the key's outcome, for the
    /// policy's retention: such a verdict cannot be resolved as found (it answers `409`
    /// until its retention ends, or runs again once deleted with `DELETE
    /// …?completed=true`).
    Reject,
    /// Ask the application first: the hook gets the record id and the request
    /// ([`Unresolved`]) and looks for the earlier attempt's effect. `Some(outcome)`: the effect happened; the outcome is stored and
    /// answered as a replay (`Idempotent-Replayed: true`), and the operation does not run
    /// again (an outcome the policy would not store from a handler — its status, a gRPC
    /// failure in its fields, a `1xx` — is answered, not stored: the next retry asks again;
    /// its headers are kept as a handler's would be, without hop-by-hop headers,
    /// `Content-Length`, `Date`, the layer's own marker of an outcome not stored or, unless
    /// the layer stores it, `Set-Cookie`). `None`: nothing happened; the operation runs. `Err`, a panic, or no answer
    /// within half a lease: nobody knows yet; the answer is `503` with `Retry-After` and the
    /// key stays unresolved (the next retry asks again once this attempt's lease ran out).
    /// The lease is renewed while the hook runs.
    Reconcile(Reconcile),
}

/// The hook of [`OutcomeUnknown::Reconcile`]; build it with [`OutcomeUnknown::reconcile`].
#[derive(Clone)]
pub struct Reconcile(Arc<Hook>);

impl Reconcile {
    pub(crate) async fn check(&self, unresolved: Unresolved) -> Result<Option<Outcome>, BoxError> {
        (self.0)(unresolved).await
    }
}

impl OutcomeUnknown {
    /// [`OutcomeUnknown::Reconcile`] with `hook`.
    pub fn reconcile<F, Fut>(hook: F) -> Self
    where
        F: Fn(Unresolved) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Option<Outcome>, BoxError>> + Send + 'static,
    {
        Self::Reconcile(Reconcile(Arc::new(move |id| Box::pin(hook(id)))))
    }
}

impl fmt::Debug for OutcomeUnknown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Reexecute => "Reexecute",
            Self::Reject => "Reject",
            Self::Reconcile(_) => "Reconcile(..)",
        })
    }
}
