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
use idempotency::{Store, tower::IdempotencyLayer};
use sqlx::PgPool;
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

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

/// A keep-alive HTTP/1.1 connection sending POSTs.
struct Client {
    reader: BufReader<TcpStream>,
}

impl Client {
    async fn connect(addr: SocketAddr) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self {
            reader: BufReader::new(stream),
        })
    }

    async fn post(&mut self, key: &str) -> std::io::Result<u16> {
        let body = r#"{"amount":1000,"currency":"eur","customer":"bench"}"#;
        let request = format!(
            "POST /charges HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\nidempotency-key: {key}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        self.reader.get_mut().write_all(request.as_bytes()).await?;
        let mut line = String::new();
        self.reader.read_line(&mut line).await?;
        let status = line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut length = 0usize;
        loop {
            line.clear();
            self.reader.read_line(&mut line).await?;
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body).await?;
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
    Measured::new(group, name, &h, errors, started.elapsed())
}
