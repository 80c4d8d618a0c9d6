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

/// The app around a hand-written handler.
fn raw_server<H, T>(handler: H, redis: redis::aio::MultiplexedConnection, pool: PgPool) -> Router
where
    H: axum::handler::Handler<T, Raw>,
    T: 'static,
{
    Router::new()
        .route("/charges", post(handler))
        .with_state(Raw { redis, pool })
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
    raw_server(handwritten, redis, pool)
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
    raw_server(handwritten_redis, redis, pool)
}

/// The fenced write of [`handwritten_redis_fenced`], on the store's record layout (state,
/// fingerprint, token, outcome): the outcome replaces the lease only if the lease is still
/// this claim's (`ARGV[1]`, its token). The least a Redis 7 store can do to refuse a late
/// completion: there is no compare-and-set without a script before Redis 8.4 (`SET … IFEQ`).
static FENCED_COMPLETE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 34, 49) == ARGV[1] then
  redis.call('SET', KEYS[1], '1' .. string.sub(v, 2, 49) .. ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
",
    )
});

/// The request's fingerprint as the layer takes it by default: method, path, body.
fn request_fingerprint(body: &[u8]) -> idempotency::Fingerprint {
    idempotency::Fingerprint::builder()
        .method("POST")
        .path_and_query("/charges")
        .body(body)
        .finish()
}

/// What [`charge`] answers, as an outcome to store.
fn charge_outcome() -> idempotency::Outcome {
    idempotency::Outcome::new(201)
        .with_header("content-type", "application/json")
        .with_body(BODY)
}

/// A stored outcome answered: its status, headers and body, and `Idempotent-Replayed`.
fn replayed(stored: &[u8]) -> Response {
    let Ok(outcome) = idempotency::Outcome::decode(stored) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let mut response = Response::new(axum::body::Body::from(outcome.body));
    *response.status_mut() = StatusCode::from_u16(outcome.status).unwrap_or(StatusCode::OK);
    for (name, value) in outcome.headers {
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::from_bytes(name.as_bytes()),
            axum::http::HeaderValue::from_maybe_shared(value),
        ) {
            response.headers_mut().append(name, value);
        }
    }
    response.headers_mut().insert(
        "idempotent-replayed",
        axum::http::HeaderValue::from_static("true"),
    );
    response
}

/// Hand-written Redis-only, fenced: what [`handwritten_redis`] must add to be correct, on the
/// store's record layout — the request fingerprinted (a key reused with another body is
/// refused), a token in the lease (`SET NX GET PX`, as the store claims), the outcome with
/// its status and headers, and a completion that checks the token (a script), so a lease
/// that ran out under a slow handler is not overwritten. Against the unfenced baseline it
/// measures what those cost on Redis 7; against the layer, what the framework costs beyond
/// them. Left out: what the layer adds for a caller that goes away (the operation in a task
/// of its own, a claim finished if its request is dropped), renewals, budgets, metrics.
async fn handwritten_redis_fenced(
    State(raw): State<Raw>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = format!("handf:{{{}}}", key_of(&headers));
    let fp = request_fingerprint(&body);
    let token = *uuid::Uuid::new_v4().as_bytes();
    let mut lease = Vec::with_capacity(49);
    lease.push(b'0');
    lease.extend_from_slice(fp.as_bytes());
    lease.extend_from_slice(&token);
    let mut conn = raw.redis.clone();
    let found: Result<Option<Vec<u8>>, _> = redis::cmd("SET")
        .arg(&key)
        .arg(&lease)
        .arg("NX")
        .arg("GET")
        .arg("PX")
        .arg(30_000)
        .query_async(&mut conn)
        .await;
    match found {
        Ok(None) => {}
        Ok(Some(record)) if record.len() >= 49 && record[1..33] != fp.as_bytes()[..] => {
            return StatusCode::UNPROCESSABLE_ENTITY.into_response();
        }
        Ok(Some(record)) if record.len() >= 49 && record[0] == b'1' => {
            return replayed(&record[49..]);
        }
        _ => return StatusCode::CONFLICT.into_response(),
    }
    let response = charge().await;
    // `EVALSHA` written directly, as the store does (an invocation copies its arguments).
    let script = &*FENCED_COMPLETE;
    let mut eval = redis::cmd("EVALSHA");
    eval.arg(script.get_hash())
        .arg(1)
        .arg(&key)
        .arg(&token[..])
        .arg(&charge_outcome().encode()[..])
        .arg(3_600_000);
    let done: redis::RedisResult<i64> = match eval.query_async(&mut conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            match script.load_async(&mut conn).await {
                Ok(_) => eval.query_async(&mut conn).await,
                Err(e) => Err(e),
            }
        }
        done => done,
    };
    match done {
        Ok(1) => response,
        _ => StatusCode::CONFLICT.into_response(),
    }
}

pub(crate) fn handwritten_redis_only_fenced(
    redis: redis::aio::MultiplexedConnection,
    pool: PgPool,
) -> Router {
    raw_server(handwritten_redis_fenced, redis, pool)
}

/// Hand-written replay, checked: what a replay must do besides the `GET` — read the request
/// body and fingerprint it (a reused key with another body is refused, not replayed), and
/// answer with the stored status and headers. The record is the fingerprint, then the
/// encoded [`Outcome`](idempotency::Outcome). A replay-only baseline: a miss (each
/// connection's first request) stores the outcome and runs the handler, with no claim.
async fn checked_replay(State(raw): State<Raw>, headers: HeaderMap, body: Bytes) -> Response {
    let key = format!("handc:{{{}}}", key_of(&headers));
    let fp = request_fingerprint(&body);
    let mut conn = raw.redis.clone();
    let record: Option<Vec<u8>> = match redis::cmd("GET").arg(&key).query_async(&mut conn).await {
        Ok(record) => record,
        Err(_) => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
    };
    let Some(record) = record else {
        let mut value = fp.as_bytes().to_vec();
        value.extend_from_slice(&charge_outcome().encode());
        store_level::cache_write(&mut conn, &key, &value).await;
        return charge().await;
    };
    if record.len() < 32 || record[..32] != fp.as_bytes()[..] {
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    }
    replayed(&record[32..])
}

pub(crate) fn checked_replay_server(
    redis: redis::aio::MultiplexedConnection,
    pool: PgPool,
) -> Router {
    raw_server(checked_replay, redis, pool)
}

/// Hand-written replay: one Redis GET of the cached response (what a replay minimally costs).
/// A miss (each connection's first request) caches the response and runs the handler.
async fn single_get(State(raw): State<Raw>, headers: HeaderMap) -> Response {
    let key = format!("hand:{{{}}}", key_of(&headers));
    let mut conn = raw.redis.clone();
    match redis::cmd("GET")
        .arg(&key)
        .query_async::<Option<Vec<u8>>>(&mut conn)
        .await
    {
        Ok(Some(body)) => (StatusCode::CREATED, body).into_response(),
        _ => {
            store_level::cache_write(&mut conn, &key, BODY.as_bytes()).await;
            charge().await
        }
    }
}

pub(crate) fn single_get_replay(redis: redis::aio::MultiplexedConnection, pool: PgPool) -> Router {
    raw_server(single_get, redis, pool)
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
    let _window = Window::open(group, name);
    let (h, errors, elapsed) = drive_raw(addr, keys, concurrency, duration).await;
    Measured::new(group, name, &h, errors, elapsed)
}

/// One timed window of one scenario, logged at its start and its end (target
/// `idempotency_bench::window`, level debug, wall-clock timestamps): with
/// `RUST_LOG=idempotency_bench::window=debug` and `perf record -k CLOCK_REALTIME`, a
/// system-wide profile can be split by scenario (docs/performance/profile.md).
pub(crate) struct Window<'a> {
    group: &'a str,
    name: &'a str,
}

impl<'a> Window<'a> {
    pub(crate) fn open(group: &'a str, name: &'a str) -> Self {
        tracing::debug!(target: "idempotency_bench::window", group, name, "start");
        Self { group, name }
    }
}

impl Drop for Window<'_> {
    fn drop(&mut self) {
        let (group, name) = (self.group, self.name);
        tracing::debug!(target: "idempotency_bench::window", group, name, "end");
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency_test::services;

    /// One POST on `client`: its status and whether it says it was replayed.
    async fn post(client: &mut Client, key: &str, body: &'static str) -> (u16, bool) {
        let request = Request::post("/charges")
            .header("host", "bench")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("request");
        client.sender.ready().await.expect("ready");
        let response = client.sender.send_request(request).await.expect("send");
        let replayed = response.headers().contains_key("idempotent-replayed");
        let status = response.status().as_u16();
        response.into_body().collect().await.expect("body");
        (status, replayed)
    }

    /// A connection to the tests' Redis (Docker).
    async fn redis_conn() -> redis::aio::MultiplexedConnection {
        let redis = services::redis()
            .await
            .expect("Redis (Docker) for the bench's baselines");
        redis::Client::open(redis.url())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("Redis")
    }

    async fn client_of(router: fn(redis::aio::MultiplexedConnection, PgPool) -> Router) -> Client {
        let conn = redis_conn().await;
        // The Redis-only baselines never touch the pool.
        let pool = PgPool::connect_lazy("postgres://unused@127.0.0.1:1/unused").expect("lazy pool");
        Client::connect(serve(router(conn, pool)).await)
            .await
            .expect("connect")
    }

    /// The baselines the targets are measured against do what their names say: a replay
    /// baseline replays (a first version of the single `GET` never stored anything, so it
    /// measured a miss), and the correct ones refuse a key reused with another body.
    #[test]
    fn the_correct_baselines_replay_and_refuse_another_body() {
        if services::skipping() {
            return;
        }
        idempotency_test::block_on(async {
            for router in [checked_replay_server, handwritten_redis_only_fenced] {
                let mut client = client_of(router).await;
                let key = uuid::Uuid::new_v4().to_string();
                assert_eq!(post(&mut client, &key, REQUEST_BODY).await, (201, false));
                assert_eq!(post(&mut client, &key, REQUEST_BODY).await, (201, true));
                assert_eq!(post(&mut client, &key, "{}").await.0, 422);
            }
        });
    }

    /// A live lease of the same request answers 409; of another request, 422.
    #[test]
    fn the_fenced_baseline_answers_a_live_lease_with_409() {
        if services::skipping() {
            return;
        }
        idempotency_test::block_on(async {
            let mut client = client_of(handwritten_redis_only_fenced).await;
            let key = uuid::Uuid::new_v4().to_string();
            let mut lease = vec![b'0'];
            lease.extend_from_slice(request_fingerprint(REQUEST_BODY.as_bytes()).as_bytes());
            lease.extend_from_slice(&[7; 16]);
            let mut conn = redis_conn().await;
            let () = redis::cmd("SET")
                .arg(format!("handf:{{{key}}}"))
                .arg(&lease)
                .arg("PX")
                .arg(30_000)
                .query_async(&mut conn)
                .await
                .expect("SET");
            assert_eq!(post(&mut client, &key, REQUEST_BODY).await, (409, false));
            assert_eq!(post(&mut client, &key, "{}").await.0, 422);
        });
    }

    #[test]
    fn the_single_get_baseline_answers_replays_from_redis() {
        if services::skipping() {
            return;
        }
        idempotency_test::block_on(async {
            let mut client = client_of(single_get_replay).await;
            let key = uuid::Uuid::new_v4().to_string();
            assert_eq!(post(&mut client, &key, REQUEST_BODY).await, (201, false));
            let mut conn = redis_conn().await;
            let cached: Option<Vec<u8>> = redis::cmd("GET")
                .arg(format!("hand:{{{key}}}"))
                .query_async(&mut conn)
                .await
                .expect("GET");
            assert_eq!(cached.as_deref(), Some(BODY.as_bytes()));
            assert_eq!(post(&mut client, &key, REQUEST_BODY).await.0, 201);
        });
    }
}
