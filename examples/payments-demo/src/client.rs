//! The storm tool's HTTP client: a hyper 1.x HTTP/1.1 connection per request, driven inside
//! the request's own future, so a client timeout really hangs up on the server (dropping the
//! future drops the socket), as a mobile client or a gateway would.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::{Request, body::Bytes};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

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
}

#[derive(Debug)]
pub(crate) enum Failure {
    TimedOut,
    Io(String),
}

/// `http://host:port` → `host:port`.
pub(crate) fn authority(base: &str) -> Result<String, String> {
    let rest = base
        .strip_prefix("http://")
        .ok_or_else(|| format!("{base}: only http:// URLs are supported"))?;
    Ok(rest.trim_end_matches('/').to_owned())
}

pub(crate) async fn request(
    authority: &str,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &str,
    timeout: Duration,
) -> Result<Reply, Failure> {
    let io = |e: &dyn std::fmt::Display| Failure::Io(e.to_string());
    let exchange = async {
        let stream = TcpStream::connect(authority).await.map_err(|e| io(&e))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| io(&e))?;
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", authority);
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_owned())))
            .map_err(|e| io(&e))?;
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
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, hyper::Error>(Reply {
                status,
                headers,
                body: String::from_utf8_lossy(&body).into_owned(),
            })
        };
        // The connection runs here, not in a task of its own: when this future is dropped,
        // the socket closes with it.
        tokio::select! {
            reply = exchange => reply.map_err(|e| io(&e)),
            ended = connection => Err(match ended {
                Ok(()) => Failure::Io("the server closed the connection".into()),
                Err(e) => io(&e),
            }),
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        // Dropping the exchange closes the socket: the server sees the client go away.
        Err(_) => Err(Failure::TimedOut),
    }
}
