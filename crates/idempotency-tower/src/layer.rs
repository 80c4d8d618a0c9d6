//! `IdempotencyLayer`: the configuration and its builder.

use std::{fmt, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderName, Method, request::Parts};
use idempotency_core::{Fingerprint, Policy, Scope, Store};
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

use crate::{Idempotency, Metrics};

type ScopeFn = dyn Fn(&Parts) -> Result<Scope, NoScope> + Send + Sync;
type FingerprintFn = dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync;

/// How the layer decides that two requests are "the same".
#[derive(Clone)]
pub(crate) enum BodyFingerprint {
    Raw,
    CanonicalJson,
    Custom(Arc<FingerprintFn>),
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) policy: Policy,
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    /// The header carrying the key (`Idempotency-Key` unless configured).
    pub(crate) header: http::HeaderName,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) body_fingerprint: BodyFingerprint,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_body: usize,
    pub(crate) store_set_cookie: bool,
    pub(crate) advertise_expiry: bool,
    /// Ask a mismatch again with the fingerprint earlier versions gave a nested request
    /// ([`IdempotencyLayer::replay_unprefixed_nested_records`]).
    pub(crate) unprefixed_nested: bool,
    pub(crate) outcome_unknown: crate::OutcomeUnknown,
    pub(crate) wait: Option<Duration>,
    pub(crate) metrics: Arc<Metrics>,
    /// Counts running operations (in their own tasks, or in their first step in the
    /// request's), the rest of a claim whose request went away, leases being given back (that
    /// claim's, a grant read too late), and the outcome-unknown work that settles a key in a
    /// task of its own (a reconcile hook, ending a `Reject` retry's lease), so shutdown can wait
    /// for them ([`IdempotencyLayer::drain`]).
    pub(crate) detached: TaskTracker,
    /// How long operations here take: the 409's `Retry-After`.
    pub(crate) run_time: Arc<crate::retry_after::RunTime>,
}

impl Config {
    pub(crate) fn fingerprint(&self, parts: &Parts, body: &Bytes) -> Fingerprint {
        if let BodyFingerprint::Custom(f) = &self.body_fingerprint {
            return f(parts, body);
        }
        self.fingerprint_of(request_uri(parts), parts, body)
    }

    /// The fingerprint earlier versions gave a request behind axum's `Router::nest` (the
    /// path without the nest's prefix), when it differs: a record stored under it before an
    /// upgrade is still the same request's, and must replay rather than answer 422 (which
    /// tells the client to use a new key, and so to run the operation again).
    pub(crate) fn legacy_fingerprint(&self, parts: &Parts, body: &Bytes) -> Option<Fingerprint> {
        if !self.unprefixed_nested
            || matches!(self.body_fingerprint, BodyFingerprint::Custom(_))
            || request_uri(parts) == &parts.uri
        {
            return None;
        }
        Some(self.fingerprint_of(&parts.uri, parts, body))
    }

    fn fingerprint_of(&self, uri: &http::Uri, parts: &Parts, body: &Bytes) -> Fingerprint {
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let mut fp = Fingerprint::builder()
            .method(parts.method.as_str())
            .path_and_query(path);
        for name in &self.fingerprint_headers {
            for value in parts.headers.get_all(name) {
                fp = fp.header(name.as_str(), value.as_bytes());
            }
        }
        match &self.body_fingerprint {
            BodyFingerprint::CanonicalJson => {
                // Not JSON: fall back to the bytes (the handler will refuse it anyway). The
                // bytes can never equal another body's canonical form: see `canonical`.
                match crate::canonical::canonical_json(body) {
                    Some(canonical) => fp.body(&canonical).finish(),
                    None => fp.body(body).finish(),
                }
            }
            _ => fp.body(body).finish(),
        }
    }
}

/// The URI the request came in with. Behind axum's `Router::nest` a layer on the inner router
/// sees the path without the nest's prefix: `/accounts/a/charges` and `/accounts/b/charges`
/// would both be `/charges`, and a key reused on the second would replay the first's answer
/// instead of answering 422. axum keeps the URI as received in `OriginalUri`.
fn request_uri(parts: &Parts) -> &http::Uri {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::OriginalUri(uri)) = parts.extensions.get() {
        return uri;
    }
    &parts.uri
}

/// Applies the Idempotency-Key protocol to the requests of a service. See the
/// [crate docs](crate) for the protocol and an example.
///
/// Cheap to clone; every clone shares one configuration and one [`Metrics`].
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.config.store.name())
            .field("methods", &self.config.methods)
            .field("require_key", &self.config.require_key)
            .field("policy", &self.config.policy)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults: POST and PATCH, key optional, one global scope
    /// (single-tenant APIs only: see [`IdempotencyLayer::scope_fn`]), fingerprint of method,
    /// path and query and body bytes, 1 MiB request and stored-body limits, the default
    /// [`Policy`].
    ///
    /// The path is the one the request came in on. Behind axum's `Router::nest`, a layer on
    /// the inner router sees it without the nest's prefix; with the `axum` feature (on by
    /// default) the fingerprint takes axum's `OriginalUri` instead, and without it, put the
    /// layer on the outer router (or scope keys by the prefix's parameters with
    /// [`scope_fn`](IdempotencyLayer::scope_fn)). Records stored before that change, under
    /// the path without the prefix, answer 422 unless
    /// [`replay_unprefixed_nested_records`](IdempotencyLayer::replay_unprefixed_nested_records)
    /// is on.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            config: Arc::new(Config {
                store,
                policy: Policy::default(),
                methods: vec![Method::POST, Method::PATCH],
                require_key: false,
                header: http::HeaderName::from_static(crate::IDEMPOTENCY_KEY),
                scope: Arc::new(|_| Ok(Scope::global())),
                body_fingerprint: BodyFingerprint::Raw,
                fingerprint_headers: Vec::new(),
                max_request_body: 1 << 20,
                max_stored_body: 1 << 20,
                store_set_cookie: false,
                advertise_expiry: false,
                unprefixed_nested: false,
                outcome_unknown: crate::OutcomeUnknown::Reexecute,
                wait: None,
                metrics: Arc::new(Metrics::default()),
                detached: TaskTracker::new(),
                run_time: Arc::default(),
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        // Builders run before the layer is cloned, so this rarely copies; if it was cloned,
        // the clones keep their configuration (and share the counters, which are Arcs).
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// Lease, retention and which statuses are stored (default: [`Policy::default`]).
    pub fn policy(self, policy: Policy) -> Self {
        self.edit(|c| c.policy = policy)
    }

    /// The methods the protocol applies to (default POST and PATCH); others pass through.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.edit(|c| c.methods = methods)
    }

    /// Reads the key from another header than `Idempotency-Key` (for an API that already
    /// names it, say, `X-Request-Key`). The draft's header is then not read at all.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use http::HeaderName;
    /// use idempotency_tower::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new(Arc::new(idempotency_core::MemoryStore::new()))
    ///     .header_name(HeaderName::from_static("x-request-key"));
    /// ```
    pub fn header_name(self, name: http::HeaderName) -> Self {
        self.edit(|c| c.header = name)
    }

    /// Refuse requests without a key with 400 (default: let them pass through unprotected).
    pub fn require_key(self, require: bool) -> Self {
        self.edit(|c| c.require_key = require)
    }

    /// Who a key belongs to: a function of the request (tenant, account, authenticated
    /// principal from an extension set by your auth layer).
    ///
    /// **Set this in any multi-tenant API.** With the default single scope, two clients that
    /// send the same key share one record: the second gets the first one's response — a data
    /// leak, and an easy one, since many clients use predictable keys.
    ///
    /// A function that cannot always name the principal should refuse instead of falling
    /// back to a shared scope: see [`try_scope_fn`](IdempotencyLayer::try_scope_fn).
    pub fn scope_fn(self, f: impl Fn(&Parts) -> Scope + Send + Sync + 'static) -> Self {
        self.edit(|c| c.scope = Arc::new(move |parts| Ok(f(parts))))
    }

    /// Who a key belongs to, or why the request names nobody: a [`NoScope`] is answered as
    /// problem+json (401 or 400) before any key is claimed or the handler runs. Fail closed:
    /// a fallback scope (`"anonymous"`) for requests without a principal is shared by every
    /// such request, and by a client that sends that name.
    ///
    /// It guards the keyed path only: a request the layer passes through (a method it does
    /// not cover, no key while keys are optional) is not asked, and a malformed key is
    /// answered first. It is not authentication: the 401 carries no `WWW-Authenticate`
    /// challenge (the authentication layer in front of this one sends that).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use http::request::Parts;
    /// use idempotency_core::{MemoryStore, Scope};
    /// use idempotency_tower::{IdempotencyLayer, NoScope};
    ///
    /// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new())).try_scope_fn(
    ///     |parts: &Parts| match parts.headers.get("x-account-id").map(|v| v.to_str()) {
    ///         Some(Ok(account)) if !account.is_empty() => Ok(Scope::new(account)),
    ///         Some(_) => Err(NoScope::Invalid("X-Account-Id is not readable".into())),
    ///         None => Err(NoScope::Unauthenticated("send X-Account-Id".into())),
    ///     },
    /// );
    /// ```
    pub fn try_scope_fn(
        self,
        f: impl Fn(&Parts) -> Result<Scope, NoScope> + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.scope = Arc::new(f))
    }

    /// Fingerprint the body as canonical JSON, so object key order, whitespace and string
    /// escapes do not make two equal requests differ.
    ///
    /// Numbers count as sent: `1`, `1.0`, `1e0` and `-0` are different requests, because
    /// treating them as numbers (RFC 8785 goes through `f64`) would make `9007199254740993`
    /// equal `9007199254740992` and replay one request's outcome to another. Duplicate keys
    /// are kept. A body that is not JSON is fingerprinted as raw bytes.
    ///
    /// Every body that parses as JSON is fingerprinted so, whatever its `Content-Type`: put
    /// this layer only on routes whose handlers read their bodies as JSON, by a parser that
    /// tells apart only what JSON tells apart. A handler that uses the bytes as sent (stored
    /// as text, or checked against a signature of them) takes `{"b":1,"a":2}` and
    /// `{"a":2,"b":1}` for two requests, and here they are one: the second would be replayed
    /// the first's answer. So would two bodies whose keys differ only in a way such a parser
    /// folds (Unicode normalisation, a key cut at a NUL), for the same reason.
    pub fn canonical_json(self) -> Self {
        self.edit(|c| c.body_fingerprint = BodyFingerprint::CanonicalJson)
    }

    /// Also fingerprint these request headers (for example `content-type`, a tenant header).
    pub fn fingerprint_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names = names.into_iter().collect();
        self.edit(|c| c.fingerprint_headers = names)
    }

    /// Replace the fingerprint with your own function of the request parts and body.
    pub fn fingerprint_fn(
        self,
        f: impl Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.body_fingerprint = BodyFingerprint::Custom(Arc::new(f)))
    }

    /// The largest request body buffered for the fingerprint (default 1 MiB); larger → 413.
    pub fn max_request_body(self, bytes: usize) -> Self {
        self.edit(|c| c.max_request_body = bytes)
    }

    /// The largest response body stored for replays (default 1 MiB), and the most of one
    /// response held in memory. A larger response streams to its client and still completes
    /// the record — a retry never executes again — but its replay has the stored status and
    /// headers, an empty body and `Idempotent-Replay-Body: omitted` (see the crate docs,
    /// "Streaming and large responses").
    pub fn max_stored_body(self, bytes: usize) -> Self {
        self.edit(|c| c.max_stored_body = bytes)
    }

    /// Store and replay `Set-Cookie` headers (default: dropped, since a replay may reach
    /// another client session).
    pub fn store_set_cookie(self, store: bool) -> Self {
        self.edit(|c| c.store_set_cookie = store)
    }

    /// Say until when the outcome replays: a stored response (the first one, and every
    /// replay of it) carries `Idempotency-Expires` (see [`IDEMPOTENCY_EXPIRES`](crate::IDEMPOTENCY_EXPIRES)), an
    /// HTTP-date. Off by default.
    ///
    /// The date is this server's clock when the handler answered, plus the policy's
    /// retention. The store counts the retention from when the outcome lands (its own
    /// clock, a moment later), so the advertised date is never later than the real expiry
    /// — up to the clock skew between this server and the store. A retry sent before it
    /// replays; one sent after it may run the operation again.
    ///
    /// A buffered response whose outcome could not be stored (its lease was taken, or the
    /// store stayed down) carries no date. A streamed one (larger than the stored-body
    /// limit) sends its head before the outcome is stored, so it carries the date whenever
    /// its status is stored; a streamed gRPC response does not, its status (which may say
    /// "not stored") coming in its trailers.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idempotency_core::MemoryStore;
    /// use idempotency_tower::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new())).advertise_expiry(true);
    /// ```
    pub fn advertise_expiry(self, advertise: bool) -> Self {
        self.edit(|c| c.advertise_expiry = advertise)
    }

    /// The operator's routes ([`admin_router`](crate::admin_router)) over this layer's store,
    /// where an outcome an operator resolves without a `retention_seconds` is kept for this
    /// layer's retention, as the layer keeps the outcomes it stores (and carries
    /// `Idempotency-Expires` when the layer [advertises it](Self::advertise_expiry)). (From `admin_router`
    /// it is kept a day: with a layer keeping outcomes a week, a retry on the second day
    /// found no record and ran the operation again.) Nest it behind your operators'
    /// authentication.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotency_core::{MemoryStore, Policy};
    /// use idempotency_tower::IdempotencyLayer;
    ///
    /// let week = Duration::from_secs(7 * 86_400);
    /// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()))
    ///     .policy(Policy::default().with_retention(week));
    /// let admin: axum::Router = layer.admin_router(); // nest under "/admin", authenticated
    /// ```
    #[cfg(feature = "admin")]
    #[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
    pub fn admin_router(&self) -> axum::Router {
        crate::admin::routes(crate::admin::Routes {
            store: self.config.store.clone(),
            retention: self.config.policy.retention(),
            advertise_expiry: self.config.advertise_expiry,
            detached: Some(self.config.detached.clone()),
        })
    }

    /// For one retention period after upgrading from a version whose fingerprint took the
    /// path without `Router::nest`'s prefix (a version before `OriginalUri` was read, or a
    /// build without the `axum` feature, which was off by default before it was on): a
    /// request behind a nest whose fingerprint does
    /// not match its key's record is asked again with the fingerprint that version gave it,
    /// so that a retry of a request stored before the upgrade replays instead of answering 422
    /// (which tells the client to use a new key, and so to run the operation again). Nothing
    /// is ever run under that fingerprint. Off by default.
    ///
    /// Turn it off again once the records stored before the upgrade have expired: while it is
    /// on, a key reused between a top-level route and a nested one over the same inner path
    /// (`/charges` and `/accounts/{account}/charges`), with the same body, replays the
    /// other route's answer instead of answering 422, as every prefix did before the upgrade.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idempotency_core::MemoryStore;
    /// use idempotency_tower::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()))
    ///     .replay_unprefixed_nested_records(true);
    /// ```
    pub fn replay_unprefixed_nested_records(self, replay: bool) -> Self {
        self.edit(|c| c.unprefixed_nested = replay)
    }

    /// What to do when an earlier attempt with the request's key never stored its outcome
    /// (its lease ran out: it crashed or hung, and may have had its effect): see
    /// [`OutcomeUnknown`](crate::OutcomeUnknown). Default: run again.
    pub fn on_outcome_unknown(self, policy: crate::OutcomeUnknown) -> Self {
        self.edit(|c| c.outcome_unknown = policy)
    }

    /// Instead of 409, wait up to `wait` for an in-flight attempt to finish and answer with
    /// its replay. A wait longer than [`FOR_GOOD`](idempotency_core::FOR_GOOD) (such as
    /// `Duration::MAX`) is that: waiting for as long as it takes.
    pub fn wait_for_in_flight(self, wait: Duration) -> Self {
        self.edit(|c| c.wait = Some(wait.min(idempotency_core::FOR_GOOD)))
    }

    /// Waits until every operation started through this layer has finished and stored its
    /// outcome — including those whose client already hung up, and those the store refused
    /// for a whole lease, still written in the background until it takes them — every
    /// [`OutcomeUnknown`](crate::OutcomeUnknown) reconcile or verdict has been stored, and
    /// every lease this layer must give back (a claim whose request went away, a grant read
    /// too late to act on) has been given back. Call it after the server's graceful
    /// shutdown, before the process exits.
    ///
    /// A lease cut off mid-release would stay claimed until it ran out, and the key would
    /// come back as an attempt whose outcome is unknown, for an operation that never ran.
    /// Then it waits for the store's own background writes (`Store::drain`: a claim the store
    /// gave up waiting for after its own call budget, answered 503, and what that claim
    /// granted), including those other users of the same store left. Writes are retried
    /// while the store is unavailable, so bound the wait by your shutdown deadline:
    /// `tokio::time::timeout(grace, layer.drain())`.
    pub async fn drain(&self) {
        self.config.detached.close();
        self.config.detached.wait().await;
        self.config.store.drain().await;
    }

    /// The counters every service of this layer updates.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.config.metrics.clone()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::from_config(inner, self.config.clone())
    }
}

/// Why a request names no scope ([`IdempotencyLayer::try_scope_fn`]); the detail is the
/// problem's `detail`, for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NoScope {
    /// 401 ([`Problem::Unauthenticated`](crate::Problem::Unauthenticated)): the request does
    /// not say who sends it. (Put the authentication layer that answers with
    /// `WWW-Authenticate` outside this one; this refusal is the guard behind it.)
    Unauthenticated(String),
    /// 400 ([`Problem::InvalidRequest`](crate::Problem::InvalidRequest)): what names the
    /// principal cannot be read.
    Invalid(String),
}
