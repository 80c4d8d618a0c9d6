//! A TCP relay that loses one reply on purpose: the server has done the work, the client only
//! sees its connection break. It is how the suite reaches the "it landed, but the answer was
//! lost" path of every store without touching the service.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("relay listens");
    let port = listener.local_addr().expect("relay address").port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let armed = armed.clone();
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
                        break; // the reply is dropped and both sides are closed
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
