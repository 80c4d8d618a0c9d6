//! An HTTP/1.1 client for the tests and the fault campaign: a hyper 1.x connection per
//! request, driven inside the request's own future, so giving up on a request (its timeout,
//! or dropping the future) really hangs up on the server, as a client timeout does.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::{Request, body::Bytes};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// What came back.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// The headers, names in lowercase, in the order received.
    pub headers: Vec<(String, String)>,
    /// The body, as text (lossy).
    pub body: String,
    /// The trailers, names in lowercase, in the order received (none for most responses).
    pub trailers: Vec<(String, String)>,
}

impl Reply {
    /// The first header named `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON; panics (a test failure) when it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// Why there is no reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoReply {
    /// The client gave up (hung up) after its timeout.
    HungUp,
    /// Connecting, writing or reading failed, or the answer was not HTTP.
    Failed,
}

/// Sends `method path` with `headers` and `body` to `addr` (`host:port`) on a connection of
/// its own, giving up (hanging up) after `timeout`.
pub async fn send(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &str,
    timeout: Duration,
) -> Result<Reply, NoReply> {
    let exchange = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|_| NoReply::Failed)?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|_| NoReply::Failed)?;
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr);
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_owned())))
            .map_err(|_| NoReply::Failed)?;
        let exchange = async {
            let response = sender.send_request(request).await?;
            let status = response.status().as_u16();
            let headers = response
                .headers()
                .iter()
                .map(|(n, v)| {
                    let value = String::from_utf8_lossy(v.as_bytes()).into_owned();
                    (n.as_str().to_owned(), value)
                })
                .collect();
            let collected = response.into_body().collect().await?;
            let trailers = collected.trailers().map_or_else(Vec::new, |map| {
                map.iter()
                    .map(|(n, v)| {
                        let value = String::from_utf8_lossy(v.as_bytes()).into_owned();
                        (n.as_str().to_owned(), value)
                    })
                    .collect()
            });
            let body = collected.to_bytes();
            Ok::<_, hyper::Error>(Reply {
                status,
                headers,
                body: String::from_utf8_lossy(&body).into_owned(),
                trailers,
            })
        };
        // The connection runs here, not in a task of its own: when this future is dropped,
        // the socket closes with it.
        tokio::select! {
            reply = exchange => reply.map_err(|_| NoReply::Failed),
            _ = connection => Err(NoReply::Failed),
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or(Err(NoReply::HungUp))
}
