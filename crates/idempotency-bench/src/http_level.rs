//! An axum server in several variants, driven over keep-alive connections on 127.0.0.1.

use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::{Request, client::conn::http1::SendRequest};
use hyper_util::rt::TokioIo;
use idempotency::{Store, tower::IdempotencyLayer};
use sqlx::PgPool;
use tokio::net::TcpStream;

use crate::{
    stats::{self, Measured},
    store_level,
};

const BODY: &str =
    r#"{"id":"ch_0123456789abcdef","amount":1000,"currency":"eur","status":"succeeded"}"#;

async fn charge() -> Response {
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        BODY,
    )
        .into_response()
}

/// No idempotency at all: the ceiling.
pub(crate) fn plain() -> Router {
    Router::new().route("/charges", post(charge))
}

/// The framework's layer over a store.
pub(crate) fn layered(store: Arc<dyn Store>) -> Router {
    Router::new()
        .route("/charges", post(charge))
        .layer(IdempotencyLayer::new(store).require_key(true))
}

#[derive(Clone)]
struct Raw {
    redis: redis::aio::MultiplexedConnection,
    pool: PgPool,
}

fn key_of(headers: &HeaderMap) -> String {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_owned()
}

/// Hand-written hybrid: Redis GET; on a miss the Postgres claim, the handler, the Postgres
/// completion and the Redis cache write. The minimal I/O of the design, without the framework.
async fn handwritten(State(raw): State<Raw>, headers: HeaderMap) -> Response {
    let key = key_of(&headers);
    let mut conn = raw.redis.clone();
    let cache_key = format!("hand:{{{key}}}");
    if let Ok(Some(body)) = redis::cmd("GET")
        .arg(&cache_key)
        .query_async::<Option<Vec<u8>>>(&mut conn)
        .await
    {
        return (StatusCode::CREATED, body).into_response();
    }
    let id = idempotency::RecordId::new(
        &idempotency::Scope::global(),
        &idempotency::IdempotencyKey::new(format!("hand-{key}"))
            .unwrap_or_else(|e| unreachable!("{e}")),
    );
    if !store_level::postgres_claim(&raw.pool, &id).await {
        return StatusCode::CONFLICT.into_response();
    }
    let response = charge().await;
    store_level::postgres_complete(&raw.pool, &id, BODY.as_bytes()).await;
    store_level::cache_write(&mut conn, &cache_key, BODY.as_bytes()).await;
    response
}

pub(crate) fn handwritten_hybrid(redis: redis::aio::MultiplexedConnection, pool: PgPool) -> Router {
    Router::new()
        .route("/charges", post(handwritten))
        .with_state(Raw { redis, pool })
}

/// Hand-written Redis-only: `SET NX PX` claims, the handler runs, `SET EX` stores the
/// response; a key already set answers from a `GET`. What a careful hand-rolled Redis
/// idempotency check costs.
async fn handwritten_redis(State(raw): State<Raw>, headers: HeaderMap) -> Response {
    let key = format!("handr:{{{}}}", key_of(&headers));
    let mut conn = raw.redis.clone();
    if !store_level::redis_claim(&mut conn, &key).await {
        return match redis::cmd("GET")
            .arg(&key)
            .query_async::<Option<Vec<u8>>>(&mut conn)
            .await
        {
            Ok(Some(body)) if !body.is_empty() => (StatusCode::CREATED, body).into_response(),
            _ => StatusCode::CONFLICT.into_response(),
        };
    }
    let response = charge().await;
    store_level::cache_write(&mut conn, &key, BODY.as_bytes()).await;
    response
}

pub(crate) fn handwritten_redis_only(
    redis: redis::aio::MultiplexedConnection,
    pool: PgPool,
) -> Router {
    Router::new()
        .route("/charges", post(handwritten_redis))
        .with_state(Raw { redis, pool })
}

/// Hand-written replay: one Redis GET of the cached response (what a replay minimally costs).
async fn single_get(State(raw): State<Raw>, headers: HeaderMap) -> Response {
    let mut conn = raw.redis.clone();
    match redis::cmd("GET")
        .arg(format!("hand:{{{}}}", key_of(&headers)))
        .query_async::<Option<Vec<u8>>>(&mut conn)
        .await
    {
        Ok(Some(body)) => (StatusCode::CREATED, body).into_response(),
        _ => charge().await,
    }
}

pub(crate) fn single_get_replay(redis: redis::aio::MultiplexedConnection, pool: PgPool) -> Router {
    Router::new()
        .route("/charges", post(single_get))
        .with_state(Raw { redis, pool })
}

pub(crate) async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("bind: {e}"));
    let addr = listener
        .local_addr()
        .unwrap_or_else(|e| panic!("addr: {e}"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    addr
}

const REQUEST_BODY: &str = r#"{"amount":1000,"currency":"eur","customer":"bench"}"#;

/// A keep-alive HTTP/1.1 connection sending POSTs: a hyper 1.x client connection, its
/// connection task spawned beside it.
///
/// It replaced a hand-written client after a measurement (A B B A, 16 clients, 3 s each, in a
/// group `http-client` that drove both, since removed): hyper drove the bare router at
/// 0.86–0.88× the hand-written client's 55–65k req/s, and the layered hybrid server at
/// 0.97–1.02× (noise). Every ratio the bench reports compares servers under the same client,
/// and none runs near the bare router's rate, so the hand-written one was not needed.
struct Client {
    sender: SendRequest<Full<Bytes>>,
}

impl Client {
    async fn connect(addr: SocketAddr) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(connection);
        Ok(Self { sender })
    }

    async fn post(&mut self, key: &str) -> std::io::Result<u16> {
        let request = Request::post("/charges")
            .header("host", "bench")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(REQUEST_BODY.as_bytes())))
            .map_err(std::io::Error::other)?;
        self.sender.ready().await.map_err(std::io::Error::other)?;
        let response = self
            .sender
            .send_request(request)
            .await
            .map_err(std::io::Error::other)?;
        let status = response.status().as_u16();
        response
            .into_body()
            .collect()
            .await
            .map_err(std::io::Error::other)?;
        Ok(status)
    }
}

/// Which keys the clients send.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Keys {
    /// A new key per request: every request executes.
    Unique,
    /// One key per client, repeated: the first executes, the rest replay.
    PerClient,
}

/// `concurrency` keep-alive clients for `duration`.
pub(crate) async fn drive(
    group: &str,
    name: &str,
    addr: SocketAddr,
    keys: Keys,
    concurrency: usize,
    duration: Duration,
) -> Measured {
    let (h, errors, elapsed) = drive_raw(addr, keys, concurrency, duration).await;
    Measured::new(group, name, &h, errors, elapsed)
}

/// [`drive`]'s latencies, errors and elapsed time, unsummarised (the side-by-side groups
/// merge them over slots).
pub(crate) async fn drive_raw(
    addr: SocketAddr,
    keys: Keys,
    concurrency: usize,
    duration: Duration,
) -> (Histogram<u64>, u64, Duration) {
    let run = uuid::Uuid::new_v4().simple().to_string();
    let started = Instant::now();
    let clients = (0..concurrency).map(|c| {
        let run = run.clone();
        tokio::spawn(async move {
            let mut h = stats::histogram();
            let mut errors = 0u64;
            let Ok(mut client) = Client::connect(addr).await else {
                return (h, 1);
            };
            let mut n = 0u64;
            while started.elapsed() < duration {
                let key = match keys {
                    Keys::Unique => format!("{run}-{c}-{n}"),
                    Keys::PerClient => format!("{run}-{c}"),
                };
                let t = Instant::now();
                match client.post(&key).await {
                    Ok(201) => stats::record(&mut h, t.elapsed()),
                    Ok(_) => errors += 1,
                    Err(_) => {
                        errors += 1;
                        match Client::connect(addr).await {
                            Ok(c) => client = c,
                            Err(_) => return (h, errors),
                        }
                    }
                }
                n += 1;
            }
            (h, errors)
        })
    });
    let mut h = stats::histogram();
    let mut errors = 0;
    for (part, e) in futures::future::join_all(clients)
        .await
        .into_iter()
        .flatten()
    {
        let _ = h.add(&part);
        errors += e;
    }
    (h, errors, started.elapsed())
}
