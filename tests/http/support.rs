//! A test application, and the hyper client of `idempotency-test` (whose dropped requests
//! really hang up).

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode, request::Parts},
    response::{IntoResponse, Response},
    routing,
};
use idempotency_core::{Scope, Store};
use idempotency_tower::{IdempotencyContext, IdempotencyLayer, Metrics};

/// Counts how often the handler really ran.
#[derive(Clone, Default)]
pub(crate) struct Calls(pub(crate) Arc<AtomicUsize>);

impl Calls {
    pub(crate) fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// The count so far, starting again from zero.
    pub(crate) fn take(&self) -> usize {
        self.0.swap(0, Ordering::SeqCst)
    }
}

/// `POST /charges`: counts a call; `x-delay-ms` sleeps first, `x-fail: <status>` answers
/// that status, `x-panic` panics. Answers 201 with the call number.
async fn charge(
    State(calls): State<Calls>,
    ctx: Option<axum::Extension<IdempotencyContext>>,
    headers: HeaderMap,
) -> Response {
    if let Some(ms) = headers
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    assert!(
        headers.get("x-panic").is_none(),
        "handler panics on purpose"
    );
    let n = calls.0.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(status) = headers
        .get("x-fail")
        .and_then(|v| v.to_str().ok()?.parse::<u16>().ok())
    {
        let mut failed = (StatusCode::from_u16(status).expect("status"), "failed").into_response();
        if headers.contains_key("x-maybe-applied") {
            failed
                .extensions_mut()
                .insert(idempotency_tower::MaybeApplied);
        }
        return failed;
    }
    let record = ctx.map(|c| c.record_id.to_hex()).unwrap_or_default();
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        axum::response::AppendHeaders([
            ("set-cookie", "session=abc"),
            ("x-multi", "one"),
            ("x-multi", "two"),
        ]),
        format!(r#"{{"charge":{n},"record":"{record}"}}"#),
    )
        .into_response()
}

pub(crate) fn layer(store: Arc<dyn Store>) -> IdempotencyLayer {
    IdempotencyLayer::new(store)
        .require_key(true)
        .scope_fn(|parts: &Parts| {
            Scope::new(
                parts
                    .headers
                    .get("x-account-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("anonymous"),
            )
        })
}

pub(crate) fn app(layer: IdempotencyLayer) -> (Router, Calls, Arc<Metrics>) {
    let calls = Calls::default();
    let metrics = layer.metrics();
    let router = Router::new()
        .route(
            "/charges",
            routing::post(charge).get(|State(c): State<Calls>| async move {
                c.0.fetch_add(1, Ordering::SeqCst);
                "list"
            }),
        )
        .route(
            "/charges/{id}",
            axum::routing::put(|State(c): State<Calls>| async move {
                c.0.fetch_add(1, Ordering::SeqCst);
                "put"
            })
            .delete(|State(c): State<Calls>| async move {
                c.0.fetch_add(1, Ordering::SeqCst);
                "deleted"
            }),
        )
        .layer(layer)
        .with_state(calls.clone());
    (router, calls, metrics)
}

/// Serves `router` on 127.0.0.1 and returns its address.
pub(crate) async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    addr
}

pub(crate) use idempotency_test::http::Reply;

fn owned<'a>(headers: &[(&'a str, &str)]) -> Vec<(&'a str, String)> {
    headers.iter().map(|(n, v)| (*n, (*v).to_owned())).collect()
}

/// Sends one POST and reads the whole response (the hyper client of `idempotency-test`).
pub(crate) async fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let addr = addr.to_string();
    let headers = owned(headers);
    idempotency_test::http::send(&addr, "POST", path, &headers, body, Duration::from_secs(30))
        .await
        .expect("a complete response")
}

/// Sends one POST and hangs up after `after` unless answered first: a client timeout.
pub(crate) async fn post_and_hang_up(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    after: Duration,
) {
    let addr = addr.to_string();
    let headers = owned(headers);
    let _ = idempotency_test::http::send(&addr, "POST", path, &headers, body, after).await;
}

/// A memory store with faults to arm: a renewal that finds its lease released by an operator
/// (released live, then `LeaseLost`, telling the test when), and a release or an end (a
/// renewal for zero) that panics once.
#[derive(Default)]
pub(crate) struct Rigged {
    pub(crate) inner: idempotency_core::MemoryStore,
    /// Armed: the next renewal releases the live lease, sends, and answers `LeaseLost`.
    pub(crate) lose_next_renewal: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    /// Armed: the next release, or renewal for zero, panics.
    pub(crate) panic_next_give_back: std::sync::atomic::AtomicBool,
    /// How long each `complete` takes (a store a round trip away).
    pub(crate) complete_takes: Duration,
    /// How much faster than the gateway's the store's clock runs (1.0 or unset: as fast): a
    /// lease asked for is kept that many times shorter, as the gateway counts.
    pub(crate) store_clock_rate: Option<f64>,
    /// Set: renewals fail (`Unavailable`: the store out of reach).
    pub(crate) renewals_unavailable: std::sync::atomic::AtomicBool,
    /// Armed: right after the next `inspect` read, the record is released and another
    /// request (this fingerprint) claims the key.
    pub(crate) replace_after_inspect: std::sync::Mutex<Option<idempotency_core::Fingerprint>>,
    /// Armed: right after the next `inspect` read, the record is released (another
    /// operator's `DELETE`).
    pub(crate) release_after_inspect: std::sync::atomic::AtomicBool,
    /// Armed: the next `complete` first releases the record (live lease and all), and
    /// another request (this fingerprint) claims and completes the key.
    pub(crate) replace_before_complete: std::sync::Mutex<Option<idempotency_core::Fingerprint>>,
    /// The next this many releases answer `Unavailable` (a connection reset), changing
    /// nothing.
    pub(crate) releases_unavailable: std::sync::atomic::AtomicUsize,
}

impl Rigged {
    /// `lease` as the store keeps it, by the gateway's clock.
    fn kept(&self, lease: Duration) -> Duration {
        lease.div_f64(self.store_clock_rate.unwrap_or(1.0))
    }
}

#[async_trait::async_trait]
impl Store for Rigged {
    async fn begin(
        &self,
        id: &idempotency_core::RecordId,
        fp: &idempotency_core::Fingerprint,
        lease: Duration,
    ) -> idempotency_core::Result<idempotency_core::Begin> {
        self.inner.begin(id, fp, self.kept(lease)).await
    }
    async fn complete(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::LeaseToken,
        outcome: &idempotency_core::Outcome,
        retention: Duration,
    ) -> idempotency_core::Result<()> {
        if !self.complete_takes.is_zero() {
            tokio::time::sleep(self.complete_takes).await;
        }
        let armed = self.replace_before_complete.lock().expect("lock").take();
        if let Some(another) = armed {
            let scope = idempotency_core::ReleaseScope::default().with_live();
            self.inner.force_release(id, scope).await?;
            let begun = self
                .inner
                .begin(id, &another, Duration::from_secs(30))
                .await?;
            let idempotency_core::Begin::Execute(theirs) = begun else {
                panic!("the other request's claim: {begun:?}");
            };
            let done = idempotency_core::Outcome::new(202);
            self.inner.complete(id, theirs, &done, retention).await?;
        }
        self.inner.complete(id, token, outcome, retention).await
    }
    async fn release(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::LeaseToken,
    ) -> idempotency_core::Result<()> {
        if self.panic_next_give_back.swap(false, Ordering::SeqCst) {
            panic!("the store's release panics on purpose");
        }
        let unavailable =
            self.releases_unavailable
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                    left.checked_sub(1)
                });
        if unavailable.is_ok() {
            return Err(idempotency_core::Error::unavailable("connection reset"));
        }
        self.inner.release(id, token).await
    }
    async fn renew(
        &self,
        id: &idempotency_core::RecordId,
        token: idempotency_core::LeaseToken,
        lease: Duration,
    ) -> idempotency_core::Result<()> {
        if lease.is_zero() && self.panic_next_give_back.swap(false, Ordering::SeqCst) {
            panic!("the store's end of a lease panics on purpose");
        }
        let armed = self.lose_next_renewal.lock().expect("lock").take();
        if let Some(tell) = armed {
            let scope = idempotency_core::ReleaseScope::default().with_live();
            self.inner.force_release(id, scope).await?;
            let _ = tell.send(());
            return Err(idempotency_core::Error::LeaseLost);
        }
        if !lease.is_zero() && self.renewals_unavailable.load(Ordering::SeqCst) {
            return Err(idempotency_core::Error::unavailable(
                "the store is out of reach",
            ));
        }
        self.inner.renew(id, token, self.kept(lease)).await
    }
    async fn purge_expired(&self, batch: usize) -> idempotency_core::Result<u64> {
        self.inner.purge_expired(batch).await
    }
    async fn inspect(
        &self,
        id: &idempotency_core::RecordId,
    ) -> idempotency_core::Result<Option<idempotency_core::Inspection>> {
        let read = self.inner.inspect(id).await;
        let armed = self.replace_after_inspect.lock().expect("lock").take();
        let release = self.release_after_inspect.swap(false, Ordering::SeqCst);
        if armed.is_some() || release {
            let scope = idempotency_core::ReleaseScope::default()
                .with_live()
                .with_completed();
            self.inner.force_release(id, scope).await?;
        }
        if let Some(another) = armed {
            self.inner
                .begin(id, &another, Duration::from_secs(30))
                .await?;
        }
        read
    }
    async fn force_release(
        &self,
        id: &idempotency_core::RecordId,
        scope: idempotency_core::ReleaseScope,
    ) -> idempotency_core::Result<idempotency_core::ForceReleased> {
        self.inner.force_release(id, scope).await
    }
    fn name(&self) -> &'static str {
        "rigged"
    }
    fn begin_settles_when_dropped(&self) -> bool {
        true
    }
}
