//! `application/problem+json` (RFC 9457) responses with stable type URIs.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

use crate::Body;

/// The problems this middleware answers with. `type` URIs are stable URNs: match on them.
///
/// One more type reaches clients, in a replay rather than from the layer: an outcome the
/// store kept refusing to take is stored as [`Outcome::not_stored`]'s marker, and every retry
/// is answered `500` `urn:idempotency:problem:outcome-not-stored` with `Idempotent-Replayed:
/// true` — the request was carried out, and this key will not carry it out again.
///
/// [`Outcome::not_stored`]: idempotency_core::Outcome::not_stored
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// 400: the key is required and missing.
    MissingKey,
    /// 400: the key is malformed, too long, a list, or sent on several header lines.
    InvalidKey,
    /// 409: another request with this key is in flight.
    InFlight,
    /// 422: this key was used for a different request.
    Mismatch,
    /// 413: the request body is larger than the fingerprint buffer.
    PayloadTooLarge,
    /// 503: the idempotency store is unavailable; the request did not run.
    StoreUnavailable,
    /// 500: the handler panicked or the store failed unexpectedly; the key was released, or,
    /// under an outcome-unknown policy other than `Reexecute`, kept as an attempt whose
    /// outcome is unknown. Or the handler answered and its response body broke off: what is
    /// known is stored, and retries replay the handler's status and headers with an empty
    /// body and `Idempotent-Replay-Body: incomplete`.
    Internal,
    /// 404 (admin routes): no live record for this scope and key.
    RecordNotFound,
    /// 409 (admin routes): the record is completed; deleting it needs `?completed=true`.
    RecordCompleted,
    /// 409 (admin routes): the record's lease is live, its holder may still be running;
    /// releasing it needs `?live=true`.
    LeaseLive,
    /// 400: a request the layer cannot read (a body that breaks off, a principal that
    /// cannot be read), or (admin routes) a query parameter this API does not know.
    InvalidRequest,
    /// 409: an earlier attempt with this key never stored its outcome; an operator must
    /// reconcile it ([`OutcomeUnknown::Reject`](crate::OutcomeUnknown::Reject)).
    OutcomeUnknown,
    /// 401: the request names no principal to scope its key to
    /// ([`NoScope::Unauthenticated`](crate::NoScope::Unauthenticated)).
    Unauthenticated,
    /// 404 (admin routes): the path names no admin resource.
    NoSuchRoute,
    /// 405 (admin routes): a method the path does not take (`Allow` lists those it does).
    MethodNotAllowed,
    /// 409 (admin routes): the record to resolve was released since it was read, and
    /// another request (another fingerprint: body, method, path…) holds the key now;
    /// nothing was stored.
    RecordReplaced,
}

impl Problem {
    /// The stable `type` URI.
    pub fn type_uri(self) -> &'static str {
        match self {
            Self::MissingKey => "urn:idempotency:problem:missing-key",
            Self::InvalidKey => "urn:idempotency:problem:invalid-key",
            Self::InFlight => "urn:idempotency:problem:in-flight",
            Self::Mismatch => "urn:idempotency:problem:key-reused",
            Self::PayloadTooLarge => "urn:idempotency:problem:payload-too-large",
            Self::StoreUnavailable => "urn:idempotency:problem:store-unavailable",
            Self::Internal => "urn:idempotency:problem:internal",
            Self::RecordNotFound => "urn:idempotency:problem:record-not-found",
            Self::RecordCompleted => "urn:idempotency:problem:record-completed",
            Self::LeaseLive => "urn:idempotency:problem:lease-live",
            Self::InvalidRequest => "urn:idempotency:problem:invalid-request",
            Self::OutcomeUnknown => "urn:idempotency:problem:outcome-unknown",
            Self::Unauthenticated => "urn:idempotency:problem:unauthenticated",
            Self::NoSuchRoute => "urn:idempotency:problem:no-such-route",
            Self::MethodNotAllowed => "urn:idempotency:problem:method-not-allowed",
            Self::RecordReplaced => "urn:idempotency:problem:record-replaced",
        }
    }

    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey | Self::InvalidRequest => StatusCode::BAD_REQUEST,
            Self::InFlight
            | Self::RecordCompleted
            | Self::LeaseLive
            | Self::OutcomeUnknown
            | Self::RecordReplaced => StatusCode::CONFLICT,
            Self::RecordNotFound | Self::NoSuchRoute => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The short human-readable summary.
    pub fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key header missing",
            Self::InvalidKey => "Invalid Idempotency-Key header",
            Self::InFlight => "A request with this Idempotency-Key is in progress",
            Self::Mismatch => "Idempotency-Key reused for a different request",
            Self::PayloadTooLarge => "Request body too large",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::Internal => "Internal error",
            Self::RecordNotFound => "No record for this Idempotency-Key",
            Self::RecordCompleted => "The record is completed",
            Self::LeaseLive => "The record's lease is live",
            Self::InvalidRequest => "Invalid request",
            Self::OutcomeUnknown => "The outcome of an earlier attempt is unknown",
            Self::Unauthenticated => "No principal to scope the Idempotency-Key to",
            Self::NoSuchRoute => "No such admin route",
            Self::MethodNotAllowed => "Method not allowed",
            Self::RecordReplaced => "Another request holds the key",
        }
    }

    /// [`response`](Self::response), marked as the layer's own refusal ([`Refused`]).
    pub(crate) fn refusal(self, detail: &str, retry_after: Option<Duration>) -> Response<Body> {
        self.marked(detail, retry_after, false)
    }

    /// [`refusal`](Self::refusal) of a request that may well succeed if sent again as it
    /// is (nothing ran): a gRPC client is told `UNAVAILABLE`, which its retry policy retries.
    pub(crate) fn transient_refusal(self, detail: &str) -> Response<Body> {
        self.marked(detail, None, true)
    }

    fn marked(
        self,
        detail: &str,
        retry_after: Option<Duration>,
        transient: bool,
    ) -> Response<Body> {
        let mut response = self.response(detail, retry_after);
        response.extensions_mut().insert(Refused {
            problem: self,
            transient,
        });
        response
    }

    /// Builds the response; `retry_after` adds a `Retry-After` header (whole seconds, at
    /// least 1).
    pub fn response(self, detail: &str, retry_after: Option<Duration>) -> Response<Body> {
        let body = serde_json::json!({
            "type": self.type_uri(),
            "title": self.title(),
            "status": self.status().as_u16(),
            "detail": detail,
        });
        let mut response = Response::new(crate::full(Bytes::from(body.to_string())));
        *response.status_mut() = self.status();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(wait) = retry_after {
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        response
    }
}

/// Marks a response the layer made itself to refuse a request (never a handler's, nor a
/// replay of a stored outcome, but the replay of the layer's own marker for an outcome not
/// stored, [`Outcome::not_stored`](idempotency_core::Outcome::not_stored)): only those are
/// put in gRPC's terms for a gRPC client
/// ([`refusal_as_status`](crate::grpc::refusal_as_status)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Refused {
    pub(crate) problem: Problem,
    /// Sent again as it is, the request may well succeed.
    pub(crate) transient: bool,
}
