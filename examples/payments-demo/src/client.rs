//! A minimal HTTP/1.1 client over TCP for the storm tool: one connection per request, so a
//! client timeout really hangs up on the server, as a mobile client or a gateway would.

use std::time::Duration;

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

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
    let exchange = async {
        let mut stream = TcpStream::connect(authority)
            .await
            .map_err(|e| Failure::Io(e.to_string()))?;
        let mut text = format!(
            "{method} {path} HTTP/1.1\r\nhost: {authority}\r\nconnection: close\r\ncontent-length: {}\r\n",
            body.len()
        );
        for (name, value) in headers {
            text.push_str(&format!("{name}: {value}\r\n"));
        }
        text.push_str("\r\n");
        text.push_str(body);
        stream
            .write_all(text.as_bytes())
            .await
            .map_err(|e| Failure::Io(e.to_string()))?;
        let mut raw = Vec::new();
        stream
            .read_to_end(&mut raw)
            .await
            .map_err(|e| Failure::Io(e.to_string()))?;
        parse(&raw).ok_or_else(|| Failure::Io("malformed response".into()))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        // Dropping the exchange closes the socket: the server sees the client go away.
        Err(_) => Err(Failure::TimedOut),
    }
}

fn parse(raw: &[u8]) -> Option<Reply> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Some(Reply {
        status,
        headers,
        body: body.to_owned(),
    })
}
