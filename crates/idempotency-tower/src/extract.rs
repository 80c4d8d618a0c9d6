//! An axum extractor for [`IdempotencyContext`] (feature `axum`).

use axum_core::{
    extract::{FromRequestParts, OptionalFromRequestParts},
    response::{IntoResponse, Response},
};
use http::request::Parts;

use crate::{IdempotencyContext, Problem};

/// The rejection of the [`IdempotencyContext`] extractor: the handler runs behind no
/// [`IdempotencyLayer`](crate::IdempotencyLayer), or for a request the layer passes through
/// (a method it does not guard, no key where none is required). A server-side mistake, so
/// a 500 problem+json; use `Option<IdempotencyContext>` where a key is optional.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MissingIdempotencyLayer;

impl std::fmt::Display for MissingIdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "no idempotency context on this request: the handler is not behind an \
             IdempotencyLayer that guards it",
        )
    }
}

impl std::error::Error for MissingIdempotencyLayer {}

impl IntoResponse for MissingIdempotencyLayer {
    fn into_response(self) -> Response {
        tracing::error!("{self}");
        let (parts, body) = Problem::Internal
            .response(
                "the request could not be processed: its idempotency is not configured",
                None,
            )
            .into_parts();
        Response::from_parts(parts, axum_core::body::Body::new(body))
    }
}

/// ```
/// use axum::{Router, routing::post};
/// use idempotency_tower::{IdempotencyContext, IdempotencyLayer};
/// # use std::sync::Arc;
///
/// async fn create_charge(ctx: IdempotencyContext) -> String {
///     // Store `ctx.record_id` on the charge, under a unique constraint.
///     format!("charged once for key {}", ctx.key.as_str())
/// }
///
/// let store = Arc::new(idempotency_core::MemoryStore::new());
/// let app: Router = Router::new()
///     .route("/charges", post(create_charge))
///     .route_layer(IdempotencyLayer::new(store).require_key(true));
/// ```
impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
    type Rejection = MissingIdempotencyLayer;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyContext>()
            .cloned()
            .ok_or(MissingIdempotencyLayer)
    }
}

/// `Option<IdempotencyContext>`: `None` where the layer passed the request through.
impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyContext {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<IdempotencyContext>().cloned())
    }
}
