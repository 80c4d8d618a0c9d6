//! TCP relays that misbehave on purpose. [`cutting_relay`] loses one reply: the server has
//! done the work, the client only sees its connection break. It is how the suite reaches the
//! "it landed, but the answer was lost" path of every store without touching the service.
//! [`stalling_relay`] freezes the connections it carries, as a host that vanished does.

use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The `host:port` a service URL (`postgres://…`, `redis://…`) connects to: a relay's
/// upstream.
///
/// ```
/// let url = "postgres://app:secret@127.0.0.1:5432/app?sslmode=disable";
/// assert_eq!(idempotency_test::relay::upstream(url), "127.0.0.1:5432");
/// assert_eq!(idempotency_test::relay::upstream("redis://127.0.0.1:6379/"), "127.0.0.1:6379");
/// ```
pub fn upstream(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host)
        .to_owned()
}

/// `url` going through a relay on `127.0.0.1:port` instead of its own host.
///
/// ```
/// let url = "postgres://app@127.0.0.1:5432/app";
/// assert_eq!(
///     idempotency_test::relay::through(url, 40000),
///     "postgres://app@127.0.0.1:40000/app"
/// );
/// ```
pub fn through(url: &str, port: u16) -> String {
    let relayed = url.replacen(&upstream(url), &format!("127.0.0.1:{port}"), 1);
    assert_ne!(relayed, url, "the URL goes through the relay");
    relayed
}

/// Starts a relay on `127.0.0.1` to `upstream` (`host:port`) and returns its port.
///
/// While `armed` is false, bytes pass both ways untouched. Once it is set, the first chunk
/// the server sends for which `cut` is true is dropped, both sides of that connection are
/// closed, and `armed` is cleared: exactly one reply is lost.
///
/// ```no_run
/// # async fn demo() {
/// use std::sync::{Arc, atomic::AtomicBool};
/// let armed = Arc::new(AtomicBool::new(false));
/// // Lose the first Postgres reply that completes a statement.
/// let port = idempotency_test::relay::cutting_relay("127.0.0.1:5432".into(), armed.clone(), |reply| {
///     reply.windows(7).any(|w| w == b"SELECT ")
/// })
/// .await;
/// # let _ = port;
/// # }
/// ```
pub async fn cutting_relay(
    upstream: String,
    armed: Arc<AtomicBool>,
    cut: fn(&[u8]) -> bool,
) -> u16 {
    replacing_relay(upstream, armed, cut, Vec::new()).await
}

/// A [`cutting_relay`] that sends `instead` in place of the reply it drops, then closes both
/// sides: the server did the work, the client is told it failed ([`postgres_error`]: what a
/// pooler such as PgBouncer sends when its server connection broke after the statement ran).
///
/// ```no_run
/// # async fn demo() {
/// use std::sync::{Arc, atomic::AtomicBool};
/// let armed = Arc::new(AtomicBool::new(true));
/// let port = idempotency_test::relay::replacing_relay(
///     "127.0.0.1:5432".into(),
///     armed,
///     |reply| reply.windows(7).any(|w| w == b"SELECT "),
///     idempotency_test::relay::postgres_error("08P01", "server conn crashed?"),
/// )
/// .await;
/// # let _ = port;
/// # }
/// ```
pub async fn replacing_relay(
    upstream: String,
    armed: Arc<AtomicBool>,
    cut: fn(&[u8]) -> bool,
    instead: Vec<u8>,
) -> u16 {
    let (listener, port) = listen().await;
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let (armed, instead) = (armed.clone(), instead.clone());
            tokio::spawn(async move {
                let (mut client_rx, mut client_tx) = client.into_split();
                let (mut server_rx, mut server_tx) = server.into_split();
                let upward = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_rx, &mut server_tx).await;
                });
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match server_rx.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let reply = &buf[..n];
                    if cut(reply) && armed.swap(false, Ordering::SeqCst) {
                        // The reply is dropped (or replaced) and both sides are closed.
                        let _ = client_tx.write_all(&instead).await;
                        break;
                    }
                    if client_tx.write_all(reply).await.is_err() {
                        break;
                    }
                }
                upward.abort();
            });
        }
    });
    port
}

/// A Postgres `ErrorResponse` message with SQLSTATE `code`, for [`replacing_relay`].
///
/// ```
/// let error = idempotency_test::relay::postgres_error("08P01", "server conn crashed?");
/// assert_eq!(error[0], b'E');
/// assert_eq!(u32::from_be_bytes(error[1..5].try_into().unwrap()) as usize, error.len() - 1);
/// ```
pub fn postgres_error(code: &str, message: &str) -> Vec<u8> {
    let mut fields = Vec::new();
    for (tag, value) in [
        (b'S', "ERROR"),
        (b'V', "ERROR"),
        (b'C', code),
        (b'M', message),
    ] {
        fields.push(tag);
        fields.extend_from_slice(value.as_bytes());
        fields.push(0);
    }
    fields.push(0);
    let mut error = vec![b'E'];
    let len = u32::try_from(fields.len() + 4).expect("a short message");
    error.extend_from_slice(&len.to_be_bytes());
    error.extend_from_slice(&fields);
    error
}

/// A relay whose upstream can vanish and come back elsewhere: see [`stalling_relay`].
#[derive(Debug, Clone)]
pub struct StallingRelay {
    /// The relay's port on `127.0.0.1`.
    pub port: u16,
    /// Bumped by `vanish`: a connection born in an older epoch is frozen.
    epoch: Arc<AtomicU64>,
    /// Between `vanish` and `fail_over`: new connections are frozen from birth.
    vanished: Arc<AtomicBool>,
    /// Set by `cut_off`: frozen connections are closed rather than held, and new ones
    /// refused, until `fail_over`.
    closing: Arc<AtomicBool>,
    /// Where new connections go (`redirect` changes it).
    upstream: Arc<std::sync::Mutex<String>>,
}

impl StallingRelay {
    /// The upstream host vanishes: every connection, open or opened from now on, is frozen —
    /// nothing passes either way, and neither side is closed or reset (no RST, as when a
    /// host is gone: only TCP's own timeout would end them).
    pub fn vanish(&self) {
        self.vanished.store(true, Ordering::SeqCst);
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// The upstream host goes down and says so: every open connection is closed, and new
    /// ones are closed as they come, until [`fail_over`](Self::fail_over) (a server that
    /// crashed and restarts: calls fail at once rather than hang).
    pub fn cut_off(&self) {
        self.closing.store(true, Ordering::SeqCst);
        self.vanish();
    }

    /// A new primary answers: connections opened from now on pass. Those frozen stay so.
    pub fn fail_over(&self) {
        self.vanished.store(false, Ordering::SeqCst);
        self.closing.store(false, Ordering::SeqCst);
    }

    /// New connections go to `upstream` (`host:port`) from now on; open ones stay where they
    /// are and pass on (a failover's virtual IP or DNS name moved, but a proxy that keeps
    /// its sessions, or a client that keeps its connection, still reaches the old primary).
    pub fn redirect(&self, upstream: String) {
        *self
            .upstream
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = upstream;
    }
}

/// Starts a relay on `127.0.0.1` to `upstream` (`host:port`) whose connections pass bytes
/// both ways untouched until [`StallingRelay::vanish`]; [`StallingRelay::redirect`] sends
/// new connections elsewhere.
///
/// ```no_run
/// # async fn demo() {
/// let relay = idempotency_test::relay::stalling_relay("127.0.0.1:5432".into()).await;
/// // … connect through 127.0.0.1:{relay.port} …
/// relay.vanish(); // every connection hangs
/// relay.fail_over(); // new connections pass again
/// relay.redirect("127.0.0.1:5433".into()); // … to another server
/// # }
/// ```
pub async fn stalling_relay(upstream: String) -> StallingRelay {
    let (listener, port) = listen().await;
    let relay = StallingRelay {
        port,
        epoch: Arc::new(AtomicU64::new(0)),
        vanished: Arc::new(AtomicBool::new(false)),
        closing: Arc::new(AtomicBool::new(false)),
        upstream: Arc::new(std::sync::Mutex::new(upstream)),
    };
    let (epoch, vanished, closing, to) = (
        relay.epoch.clone(),
        relay.vanished.clone(),
        relay.closing.clone(),
        relay.upstream.clone(),
    );
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            if closing.load(Ordering::SeqCst) {
                continue; // closed as it comes
            }
            let upstream = to
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            // Born frozen while the host is gone: an epoch that is never current.
            let born = if vanished.load(Ordering::SeqCst) {
                u64::MAX
            } else {
                epoch.load(Ordering::SeqCst)
            };
            let (client_rx, client_tx) = client.into_split();
            let (server_rx, server_tx) = server.into_split();
            let frozen = Frozen {
                epoch: epoch.clone(),
                born,
                closing: closing.clone(),
            };
            tokio::spawn(pass_until_frozen(client_rx, server_tx, frozen.clone()));
            tokio::spawn(pass_until_frozen(server_rx, client_tx, frozen));
        }
    });
    relay
}

/// When a relayed connection freezes: see [`pass_until_frozen`].
#[derive(Clone)]
struct Frozen {
    epoch: Arc<AtomicU64>,
    born: u64,
    closing: Arc<AtomicBool>,
}

impl Frozen {
    fn now(&self) -> bool {
        self.epoch.load(Ordering::SeqCst) != self.born
    }
}

/// Copies `from` to `to` until the connection is frozen (its epoch is not the current one),
/// then holds both halves open, passing nothing, for good — or closes them, when cut off.
async fn pass_until_frozen(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Frozen,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let read = tokio::select! {
            read = from.read(&mut buf) => read,
            // Cut off while idle: closed at once, as a crashed server's connections are.
            () = cut_off(&frozen) => return,
        };
        let n = match read {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.now() {
            if frozen.closing.load(Ordering::SeqCst) {
                return;
            }
            // Both halves stay open, and nothing passes, for good.
            return std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Ends once the connection is frozen by a cut-off (polled every 10 ms).
async fn cut_off(frozen: &Frozen) {
    while !(frozen.now() && frozen.closing.load(Ordering::SeqCst)) {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// A relay whose replies, or requests, can be held back: see [`delaying_relay`].
#[derive(Debug, Clone)]
pub struct DelayingRelay {
    /// The relay's port on `127.0.0.1`.
    pub port: u16,
    delay_ms: Arc<AtomicU64>,
    request_delay_ms: Arc<AtomicU64>,
    /// Only the replies, or requests, that contain it are held back, when set.
    reply_needle: Needle,
    request_needle: Needle,
    /// Whether a held request is cut at its needle, the bytes before it passed at once.
    split_requests: Arc<AtomicBool>,
}

type Needle = Arc<std::sync::Mutex<Option<Vec<u8>>>>;

impl DelayingRelay {
    /// From now on, each chunk the server sends reaches the client `delay` after it was sent
    /// (in order: a slow network, a server answering late). Zero passes them at once.
    pub fn delay_replies(&self, delay: std::time::Duration) {
        hold(&self.delay_ms, &self.reply_needle, delay, None);
    }

    /// From now on, each chunk the server sends that contains `needle` (a command tag:
    /// `DELETE 1`) reaches the client `delay` after it was sent, and the chunks after it
    /// wait behind it; the others pass at once.
    pub fn delay_replies_containing(&self, delay: std::time::Duration, needle: &[u8]) {
        let needle = Some(needle.to_vec());
        hold(&self.delay_ms, &self.reply_needle, delay, needle);
    }

    /// From now on, each chunk the client sends reaches the server `delay` after it was sent
    /// (in order: a partition TCP retransmits across once it heals, a stalled host). Zero
    /// passes later ones at once; chunks already held keep their due time.
    pub fn delay_requests(&self, delay: std::time::Duration) {
        hold(&self.request_delay_ms, &self.request_needle, delay, None);
    }

    /// From now on, each chunk the client sends that contains `needle` (a bound parameter's
    /// bytes: a prepared statement's execution names the statement, not its text) reaches
    /// the server `delay` after it was sent, and the chunks after it wait behind it (in
    /// order, as TCP delivers them); the others pass at once.
    pub fn delay_requests_containing(&self, delay: std::time::Duration, needle: &[u8]) {
        self.split_requests.store(false, Ordering::SeqCst);
        let needle = Some(needle.to_vec());
        hold(&self.request_delay_ms, &self.request_needle, delay, needle);
    }

    /// From now on, each chunk the client sends that contains `needle` is cut where the
    /// needle begins: what comes before it reaches the server at once, the rest `delay`
    /// later (and the chunks after it wait behind it). The server then reads one write of
    /// the client's (a pipeline) in two, as a slow network can make it.
    pub fn split_requests_at(&self, delay: std::time::Duration, needle: &[u8]) {
        self.split_requests.store(true, Ordering::SeqCst);
        let needle = Some(needle.to_vec());
        hold(&self.request_delay_ms, &self.request_needle, delay, needle);
    }
}

/// Holds back one direction's chunks (only those with `needle`, if given) by `delay`.
fn hold(delay_ms: &AtomicU64, held: &Needle, delay: std::time::Duration, needle: Option<Vec<u8>>) {
    *held
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = needle;
    let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    delay_ms.store(ms, Ordering::SeqCst);
}

/// Starts a relay on `127.0.0.1` to `upstream` (`host:port`) that passes requests and
/// replies at once until [`DelayingRelay::delay_replies`] (the server has done the work, and
/// the client hears of it late) or [`DelayingRelay::delay_requests`] (the server hears of
/// the work late).
///
/// ```no_run
/// # async fn demo() {
/// let relay = idempotency_test::relay::delaying_relay("127.0.0.1:5432".into()).await;
/// relay.delay_replies(std::time::Duration::from_secs(3));
/// # }
/// ```
pub async fn delaying_relay(upstream: String) -> DelayingRelay {
    let (listener, port) = listen().await;
    let relay = DelayingRelay {
        port,
        delay_ms: Arc::new(AtomicU64::new(0)),
        request_delay_ms: Arc::new(AtomicU64::new(0)),
        reply_needle: Needle::default(),
        request_needle: Needle::default(),
        split_requests: Arc::new(AtomicBool::new(false)),
    };
    let replies = (
        relay.delay_ms.clone(),
        relay.reply_needle.clone(),
        Arc::new(AtomicBool::new(false)),
    );
    let requests = (
        relay.request_delay_ms.clone(),
        relay.request_needle.clone(),
        relay.split_requests.clone(),
    );
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let (client_rx, client_tx) = client.into_split();
            let (server_rx, server_tx) = server.into_split();
            tokio::spawn(delayed_copy(client_rx, server_tx, requests.clone()));
            tokio::spawn(delayed_copy(server_rx, client_tx, replies.clone()));
        }
    });
    relay
}

/// Copies `from` to `to`, each chunk `delay_ms` (read when it arrives) after it arrived, or
/// only those that contain the needle, if one is set (from the needle on, when `split`).
async fn delayed_copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    (delay_ms, needle, split): (Arc<AtomicU64>, Needle, Arc<AtomicBool>),
) {
    // Each chunk is stamped when it arrives and handed on at its due time, by a queue: a
    // late chunk does not hold back the reading of the next.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let forward = tokio::spawn(async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            let chunk: Vec<u8> = chunk;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // Where the held part begins: 0 for the whole chunk, `n` for none of it.
        let from_byte = match &*needle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(needle) => match buf[..n]
                .windows(needle.len())
                .position(|w| w == &needle[..])
            {
                Some(at) if split.load(Ordering::SeqCst) => at,
                Some(_) => 0,
                None => n,
            },
            None => 0,
        };
        let now = tokio::time::Instant::now();
        let delay = std::time::Duration::from_millis(delay_ms.load(Ordering::SeqCst));
        if from_byte > 0 && tx.send((now, buf[..from_byte].to_vec())).is_err() {
            break;
        }
        if from_byte < n && tx.send((now + delay, buf[from_byte..n].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = forward.await;
}

/// A listener on a free port of `127.0.0.1`, and that port.
async fn listen() -> (tokio::net::TcpListener, u16) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("relay listens");
    let port = listener.local_addr().expect("relay address").port();
    (listener, port)
}
