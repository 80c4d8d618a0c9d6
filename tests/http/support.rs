//! A test application and a raw HTTP/1.1 client over TCP (so a test can really hang up).

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
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// Counts how often the handler really ran.
#[derive(Clone, Default)]
pub(crate) struct Calls(pub(crate) Arc<AtomicUsize>);

impl Calls {
    pub(crate) fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
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
        return (StatusCode::from_u16(status).expect("status"), "failed").into_response();
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

/// A response read off the socket.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

fn request_text(path: &str, headers: &[(&str, &str)], body: &str) -> String {
    let mut text = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        text.push_str(&format!("{n}: {v}\r\n"));
    }
    text.push_str("\r\n");
    text.push_str(body);
    text
}

/// Sends one POST and reads the whole response (the server closes the connection).
pub(crate) async fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(request_text(path, headers, body).as_bytes())
        .await
        .expect("write");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    parse(&raw)
}

/// Sends one POST and hangs up after `after`, without reading the answer: a client timeout.
pub(crate) async fn post_and_hang_up(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    after: Duration,
) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(request_text(path, headers, body).as_bytes())
        .await
        .expect("write");
    tokio::time::sleep(after).await;
    drop(stream);
}

fn parse(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").expect("a complete response");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Reply {
        status,
        headers,
        body: body.to_owned(),
    }
}
