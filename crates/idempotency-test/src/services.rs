//! Real Postgres and Redis for the integration suite.
//!
//! How a test gets its services, in order:
//! 1. `IDEMPOTENCY_TEST_POSTGRES_URL` / `IDEMPOTENCY_TEST_REDIS_URL`: services the user runs.
//!    Tests that inject faults (stop, pause) need containers and fail with a message.
//! 2. Otherwise Docker via testcontainers. By default the official `postgres:16-alpine` and
//!    `redis:7-alpine` images with a port published on 127.0.0.1
//!    (`IDEMPOTENCY_TEST_POSTGRES_IMAGE` / `IDEMPOTENCY_TEST_REDIS_IMAGE` override them).
//!    `IDEMPOTENCY_TEST_IMAGE=name:tag` selects instead one locally built Debian image holding
//!    both servers (what `.ci/docker.sh` builds on machines without a registry), and
//!    `IDEMPOTENCY_TEST_NETWORK=host` runs containers on the host network for engines without
//!    a bridge.
//! 3. No Docker: the test panics and says how to provide services, unless
//!    `IDEMPOTENCY_TEST_SKIP_SERVICES=1` explicitly opts out (the test then prints that it
//!    skipped and passes without asserting anything).
//!
//! Every URL names 127.0.0.1: the harness never uses `get_host()`, which returns a bridge
//! gateway address when the tests run inside a container.

use std::{
    net::TcpListener,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use testcontainers::{
    ContainerAsync, GenericImage, ImageExt,
    core::{ContainerPort, WaitFor},
    runners::AsyncRunner,
};
use tokio::sync::OnceCell;

use crate::tls::TestCa;

/// The label on every container the harness starts, so CI can remove leftovers of a run
/// that was killed before it could clean up.
pub const LABEL: &str = "io.idempotency.test";

/// The label holding the id of the process that started the container.
pub const PID_LABEL: &str = "io.idempotency.test.pid";

/// Which server a [`Service`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// PostgreSQL.
    Postgres,
    /// Redis, standalone.
    Redis,
    /// A Redis Cluster of three masters in one container.
    RedisCluster,
}

/// Options for a Redis the harness starts.
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// Extra `redis-server` arguments, e.g. `["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"]`.
    pub args: Vec<String>,
}

/// A running service: its URL and, when the harness started it, the container to inject
/// faults into.
#[derive(Debug)]
pub struct Service {
    kind: Kind,
    url: String,
    ports: Vec<u16>,
    container: Option<ContainerAsync<GenericImage>>,
    /// The CA the server's certificate chains to, when it speaks TLS.
    tls_ca: Option<String>,
}

impl Service {
    /// The connection URL, always on 127.0.0.1. For a cluster, the first node's.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Every node's URL (one for standalone services).
    pub fn node_urls(&self) -> Vec<String> {
        let scheme = match self.kind {
            Kind::Postgres => return vec![self.url.clone()],
            Kind::Redis | Kind::RedisCluster if self.tls_ca.is_some() => "rediss",
            Kind::Redis | Kind::RedisCluster => "redis",
        };
        self.ports
            .iter()
            .map(|p| format!("{scheme}://127.0.0.1:{p}/"))
            .collect()
    }

    fn container(&self) -> &ContainerAsync<GenericImage> {
        self.container.as_ref().expect(
            "this test injects faults (stop/pause) and needs a container the harness started; \
             unset IDEMPOTENCY_TEST_POSTGRES_URL / IDEMPOTENCY_TEST_REDIS_URL to let it start one",
        )
    }

    /// The container's id, for faults the harness has no method for (`docker kill -s STOP`);
    /// `None` for a service given by URL.
    pub fn container_id(&self) -> Option<&str> {
        self.container.as_ref().map(|c| c.id())
    }

    /// Stops the server: clients get "connection refused". SIGKILL, like a crash.
    pub async fn stop(&self) {
        self.container()
            .stop_with_timeout(Some(0))
            .await
            .expect("stopping the container");
    }

    /// Starts a stopped server again (on the same port) and waits until it answers.
    /// Its data is what survived the stop: Redis here keeps nothing (no persistence).
    pub async fn start(&self) {
        self.container()
            .start()
            .await
            .expect("starting the container");
        wait_ready(
            self.kind,
            &self.node_urls(),
            self.tls_ca.as_deref(),
            Duration::from_secs(60),
        )
        .await;
    }

    /// Demotes a Redis primary, as a failover does to the old one: it becomes a replica of a
    /// primary it cannot reach, answers reads, and refuses every write with `READONLY`.
    /// Connections already made to it stay open.
    pub async fn demote(&self) {
        assert!(
            self.kind == Kind::Redis && self.tls_ca.is_none(),
            "only a standalone Redis without TLS is demoted"
        );
        let mut connection = redis::Client::open(self.url.as_str())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection");
        let () = redis::cmd("REPLICAOF")
            .arg("127.0.0.1")
            .arg(1)
            .query_async(&mut connection)
            .await
            .expect("REPLICAOF");
    }

    /// Freezes the server: connections stay open and calls hang (the "hung server" fault).
    pub async fn pause(&self) {
        self.container()
            .pause()
            .await
            .expect("pausing the container");
    }

    /// Thaws a paused server.
    pub async fn unpause(&self) {
        self.container()
            .unpause()
            .await
            .expect("unpausing the container");
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Whether the user opted out of service-backed tests with `IDEMPOTENCY_TEST_SKIP_SERVICES=1`.
pub fn skipping() -> bool {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let skip = env("IDEMPOTENCY_TEST_SKIP_SERVICES").is_some_and(|v| v != "0");
    if skip && !WARNED.swap(true, Ordering::Relaxed) {
        eprintln!(
            "IDEMPOTENCY_TEST_SKIP_SERVICES is set: tests needing Postgres or Redis pass without running"
        );
    }
    skip
}

/// A connection of the test's own to the Redis at `url`, its command statistics reset
/// ([`reset_command_stats`]).
pub async fn command_stats_from_now(url: &str) -> redis::aio::MultiplexedConnection {
    let mut conn = redis::Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    reset_command_stats(&mut conn).await;
    conn
}

/// Resets the command statistics of the Redis `conn` is connected to: what runs after is
/// what [`script_calls`] counts.
pub async fn reset_command_stats(conn: &mut impl redis::aio::ConnectionLike) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(conn)
        .await
        .expect("resetstat");
}

/// The calls of scripts (`EVAL`, `EVALSHA`) that `INFO commandstats` counts in `fields`
/// (`calls`, `rejected_calls`, `failed_calls`) on the Redis `conn` is connected to.
pub async fn script_calls(conn: &mut impl redis::aio::ConnectionLike, fields: &[&str]) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("info");
    info.lines()
        .filter(|line| line.starts_with("cmdstat_evalsha:") || line.starts_with("cmdstat_eval:"))
        .flat_map(|line| line.split([':', ',']))
        .filter_map(|field| {
            let (name, value) = field.split_once('=')?;
            fields.contains(&name).then(|| value.parse::<u64>().ok())?
        })
        .sum()
}

/// The Postgres shared by every test of this test binary.
pub async fn postgres() -> Option<&'static Service> {
    static PG: OnceCell<Service> = OnceCell::const_new();
    if skipping() {
        return None;
    }
    Some(
        PG.get_or_init(|| async {
            match env("IDEMPOTENCY_TEST_POSTGRES_URL") {
                Some(url) => external(Kind::Postgres, url),
                None => start_postgres().await,
            }
        })
        .await,
    )
}

/// The Redis shared by every test of this test binary (standalone, `noeviction`).
pub async fn redis() -> Option<&'static Service> {
    static REDIS: OnceCell<Service> = OnceCell::const_new();
    if skipping() {
        return None;
    }
    Some(
        REDIS
            .get_or_init(|| async {
                match env("IDEMPOTENCY_TEST_REDIS_URL") {
                    Some(url) => external(Kind::Redis, url),
                    None => start_redis(RedisOptions::default()).await,
                }
            })
            .await,
    )
}

fn external(kind: Kind, url: String) -> Service {
    Service {
        kind,
        url,
        ports: Vec::new(),
        tls_ca: None,
        container: None,
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0 to pick a free port")
}

fn local_image() -> Option<(String, String)> {
    env("IDEMPOTENCY_TEST_IMAGE").map(|image| match image.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name.to_owned(), tag.to_owned()),
        _ => (image, "latest".to_owned()),
    })
}

fn split_image(var: &str, default: &str) -> (String, String) {
    let image = env(var).unwrap_or_else(|| default.to_owned());
    match image.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name.to_owned(), tag.to_owned()),
        _ => (image, "latest".to_owned()),
    }
}

fn host_network() -> bool {
    env("IDEMPOTENCY_TEST_NETWORK").as_deref() == Some("host")
}

/// Starts a dedicated Postgres container (owned by the caller, removed on drop).
pub async fn start_postgres() -> Service {
    start_postgres_with(None).await
}

/// Starts a dedicated Postgres that accepts TLS connections only, with a certificate `ca`
/// signed for 127.0.0.1. The URL asks for `sslmode=verify-full` against the CA's file.
pub async fn start_postgres_tls(ca: &TestCa) -> Service {
    start_postgres_with(Some(ca)).await
}

async fn start_postgres_with(tls: Option<&TestCa>) -> Service {
    let port = free_port();
    // The server's key must belong to the server's user, readable by it alone.
    let (install_tls, ssl_args) = match tls {
        Some(_) => (
            "install -o postgres -g postgres -m 600 /tls/server.key /tmp/server.key; \
             install -o postgres -g postgres -m 644 /tls/server.crt /tmp/server.crt;",
            "-c ssl=on -c ssl_cert_file=/tmp/server.crt -c ssl_key_file=/tmp/server.key",
        ),
        None => ("", "-c ssl=off"),
    };
    let request = match local_image() {
        Some((name, tag)) => {
            // The Debian package's cluster only allows peer/scram: trust the loopback test
            // client (over TLS only, when TLS is on), and run the server directly so it is
            // the process that receives signals. fsync=off is safe for the crash tests (a
            // killed process leaves its writes in the page cache); synchronous_commit=off
            // would not be: it loses acknowledged commits.
            let hba = match tls {
                Some(_) => {
                    "sed -i '1i hostssl all all 127.0.0.1/32 trust' /etc/postgresql/15/main/pg_hba.conf; \
                     sed -i '1i hostnossl all all all reject' /etc/postgresql/15/main/pg_hba.conf;"
                }
                None => {
                    "sed -i '1i host all all 127.0.0.1/32 trust' /etc/postgresql/15/main/pg_hba.conf;"
                }
            };
            let script = format!(
                "set -e; {hba} {install_tls} \
                 mkdir -p /var/run/postgresql; chown postgres /var/run/postgresql; \
                 exec setpriv --reuid=postgres --regid=postgres --init-groups \
                 /usr/lib/postgresql/15/bin/postgres -c config_file=/etc/postgresql/15/main/postgresql.conf \
                 -c listen_addresses=127.0.0.1 -c port={port} {ssl_args} -c fsync=off \
                 -c full_page_writes=off -c max_connections=300"
            );
            GenericImage::new(name, tag)
                .with_wait_for(WaitFor::message_on_stderr(
                    "database system is ready to accept connections",
                ))
                .with_cmd(["sh", "-c", &script])
        }
        None => {
            // The official image: TLS is offered (its entrypoint writes pg_hba.conf, which
            // trusts any connection), and the URL's verify-full still checks the server.
            let (name, tag) = split_image("IDEMPOTENCY_TEST_POSTGRES_IMAGE", "postgres:16-alpine");
            let ssl_args = ssl_args.replace("/tmp/", "/var/lib/postgresql/");
            let install_tls = install_tls.replace("/tmp/", "/var/lib/postgresql/");
            let script = format!(
                "set -e; {install_tls} exec docker-entrypoint.sh postgres {ssl_args} \
                 -c fsync=off -c max_connections=300"
            );
            GenericImage::new(name, tag)
                .with_wait_for(WaitFor::message_on_stderr(
                    "database system is ready to accept connections",
                ))
                .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
                .with_cmd(["sh", "-c", &script])
        }
    };
    let request = with_server_certificate(request, tls);
    let container = run(request, Kind::Postgres, port, 5432).await;
    let url = match tls {
        Some(ca) => format!(
            "postgres://postgres@127.0.0.1:{port}/postgres?sslmode=verify-full&sslrootcert={}",
            ca.ca_path().display()
        ),
        None => format!("postgres://postgres@127.0.0.1:{port}/postgres"),
    };
    let tls_ca = tls.map(|ca| ca.ca_pem().to_owned());
    wait_ready(
        Kind::Postgres,
        std::slice::from_ref(&url),
        tls_ca.as_deref(),
        Duration::from_secs(90),
    )
    .await;
    Service {
        kind: Kind::Postgres,
        url,
        ports: vec![port],
        container: Some(container),
        tls_ca,
    }
}

/// Copies the server's certificate and key (and the CA) to `/tls/` in the container.
fn with_server_certificate(
    request: impl Into<testcontainers::ContainerRequest<GenericImage>>,
    tls: Option<&TestCa>,
) -> testcontainers::ContainerRequest<GenericImage> {
    let request = request.into();
    match tls {
        Some(ca) => request
            .with_copy_to("/tls/server.crt", ca.server_cert_pem().as_bytes().to_vec())
            .with_copy_to("/tls/server.key", ca.server_key_pem().as_bytes().to_vec())
            .with_copy_to("/tls/ca.crt", ca.ca_pem().as_bytes().to_vec()),
        None => request,
    }
}

/// Starts a dedicated standalone Redis container (owned by the caller, removed on drop).
pub async fn start_redis(options: RedisOptions) -> Service {
    start_redis_with(options, None).await
}

/// Starts a dedicated Redis that speaks TLS only (`rediss://`), with a certificate `ca`
/// signed for 127.0.0.1; clients need not present one.
pub async fn start_redis_tls(ca: &TestCa) -> Service {
    start_redis_with(RedisOptions::default(), Some(ca)).await
}

async fn start_redis_with(options: RedisOptions, tls: Option<&TestCa>) -> Service {
    let port = free_port();
    let mut args: Vec<String> = [
        "redis-server",
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory-policy",
        "noeviction",
    ]
    .map(String::from)
    .to_vec();
    let port_args = |args: &mut Vec<String>| {
        args.extend(["--bind", "127.0.0.1"].map(String::from));
        match tls {
            Some(_) => args.extend(
                [
                    "--port",
                    "0",
                    "--tls-port",
                    &port.to_string(),
                    "--tls-cert-file",
                    "/tls/server.crt",
                    "--tls-key-file",
                    "/tls/server.key",
                    "--tls-ca-cert-file",
                    "/tls/ca.crt",
                    "--tls-auth-clients",
                    "no",
                ]
                .map(String::from),
            ),
            None => args.extend(["--port".to_owned(), port.to_string()]),
        }
    };
    let request = match local_image() {
        Some((name, tag)) => {
            port_args(&mut args);
            args.extend(options.args);
            GenericImage::new(name, tag)
                .with_wait_for(WaitFor::message_on_stdout("Ready to accept connections"))
                .with_cmd(args)
        }
        None => {
            let (name, tag) = split_image("IDEMPOTENCY_TEST_REDIS_IMAGE", "redis:7-alpine");
            if host_network() || tls.is_some() {
                port_args(&mut args);
            }
            args.extend(options.args);
            GenericImage::new(name, tag)
                .with_wait_for(WaitFor::message_on_stdout("Ready to accept connections"))
                .with_cmd(args)
        }
    };
    let request = with_server_certificate(request, tls);
    let container = run(request, Kind::Redis, port, port_in_container(tls, port)).await;
    let scheme = if tls.is_some() { "rediss" } else { "redis" };
    let url = format!("{scheme}://127.0.0.1:{port}/");
    let tls_ca = tls.map(|ca| ca.ca_pem().to_owned());
    wait_ready(
        Kind::Redis,
        std::slice::from_ref(&url),
        tls_ca.as_deref(),
        Duration::from_secs(60),
    )
    .await;
    Service {
        kind: Kind::Redis,
        url,
        ports: vec![port],
        container: Some(container),
        tls_ca,
    }
}

/// The port Redis listens on inside its container: 6379, unless the TLS variant chose the
/// published one.
fn port_in_container(tls: Option<&TestCa>, port: u16) -> u16 {
    if tls.is_some() { port } else { 6379 }
}

/// Starts a Redis Cluster of three masters (no replicas) in one container on the host
/// network, and waits until every slot is served.
///
/// Needs host networking (`IDEMPOTENCY_TEST_NETWORK=host`): cluster nodes announce their own
/// addresses, which must be the 127.0.0.1 ports the client reaches.
pub async fn start_redis_cluster() -> Option<Service> {
    if skipping() {
        return None;
    }
    assert!(
        host_network() || local_image().is_some(),
        "the Redis Cluster test needs IDEMPOTENCY_TEST_NETWORK=host (nodes announce 127.0.0.1)"
    );
    let ports = [free_port(), free_port(), free_port()];
    let mut script = String::from("set -e; ");
    for p in ports {
        script.push_str(&format!(
            "mkdir -p /tmp/{p}; cd /tmp/{p}; redis-server --bind 127.0.0.1 --port {p} --cluster-enabled yes \
             --cluster-config-file nodes.conf --save '' --appendonly no --daemonize yes; "
        ));
    }
    script.push_str("for p in");
    for p in ports {
        script.push_str(&format!(" {p}"));
    }
    script.push_str("; do until redis-cli -p $p ping >/dev/null 2>&1; do sleep 0.1; done; done; ");
    script.push_str("redis-cli --cluster create");
    for p in ports {
        script.push_str(&format!(" 127.0.0.1:{p}"));
    }
    script.push_str(" --cluster-replicas 0 --cluster-yes; ");
    script.push_str(&format!(
        "until redis-cli -p {} cluster info | grep -q cluster_state:ok; do sleep 0.1; done; echo CLUSTER-READY; \
         exec sleep infinity",
        ports[0]
    ));
    let (name, tag) = local_image()
        .unwrap_or_else(|| split_image("IDEMPOTENCY_TEST_REDIS_IMAGE", "redis:7-alpine"));
    let request = GenericImage::new(name, tag)
        .with_wait_for(WaitFor::message_on_stdout("CLUSTER-READY"))
        .with_cmd(["sh", "-c", &script]);
    let container = run(request, Kind::RedisCluster, ports[0], 6379).await;
    Some(Service {
        kind: Kind::RedisCluster,
        url: format!("redis://127.0.0.1:{}/", ports[0]),
        ports: ports.to_vec(),
        container: Some(container),
        tls_ca: None,
    })
}

async fn run(
    image: impl Into<testcontainers::ContainerRequest<GenericImage>>,
    kind: Kind,
    host_port: u16,
    container_port: u16,
) -> ContainerAsync<GenericImage> {
    let mut request: testcontainers::ContainerRequest<GenericImage> = image.into();
    request = request
        .with_label(LABEL, "1")
        // Whose it is: `.ci/docker.sh` removes leftovers of processes that are gone only.
        .with_label(PID_LABEL, std::process::id().to_string())
        .with_startup_timeout(Duration::from_secs(120));
    if host_network() || local_image().is_some() {
        request = request.with_network("host");
    } else {
        request = request.with_mapped_port(host_port, ContainerPort::Tcp(container_port));
    }
    match request.start().await {
        Ok(container) => {
            reap_on_exit(container.id());
            container
        }
        Err(error) => panic!(
            "could not start a {kind:?} container: {error}\n\n\
             The integration tests need real Postgres and Redis. Either:\n\
             - run a Docker engine (on a machine without a registry: `bash .ci/docker.sh` installs one and \
               builds the local image, then export IDEMPOTENCY_TEST_IMAGE and IDEMPOTENCY_TEST_NETWORK=host), or\n\
             - point the tests at your own services with IDEMPOTENCY_TEST_POSTGRES_URL and IDEMPOTENCY_TEST_REDIS_URL, or\n\
             - opt out explicitly with IDEMPOTENCY_TEST_SKIP_SERVICES=1 (service tests then run nothing)."
        ),
    }
}

/// Containers shared by a test binary live in statics, which Rust never drops. A detached
/// shell waits for this process to exit and removes them, so `cargo test` leaves nothing
/// behind. (Dedicated containers are removed on drop as well; removing twice is harmless.)
fn reap_on_exit(id: &str) {
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; docker rm -f -v {id} >/dev/null 2>&1",
        pid = std::process::id()
    );
    // Without a docker CLI there is no reaper; CI also removes labelled leftovers.
    let _ = std::process::Command::new("sh")
        .args(["-c", &script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
}

/// Waits until the server speaks its protocol at every URL (a published port accepts TCP
/// before the server inside listens, so a TCP connect proves nothing). `tls_ca`: the CA a
/// `rediss://` server's certificate chains to (a Postgres URL names its own).
async fn wait_ready(kind: Kind, urls: &[String], tls_ca: Option<&str>, limit: Duration) {
    let started = Instant::now();
    for url in urls {
        loop {
            let ready = match kind {
                Kind::Postgres => {
                    use sqlx::Connection;
                    match sqlx::PgConnection::connect(url).await {
                        Ok(conn) => conn.close().await.is_ok(),
                        Err(_) => false,
                    }
                }
                Kind::Redis | Kind::RedisCluster => async {
                    let client = match tls_ca {
                        Some(ca) => redis::Client::build_with_tls(
                            url.as_str(),
                            redis::TlsCertificates {
                                client_tls: None,
                                root_cert: Some(ca.as_bytes().to_vec()),
                            },
                        )
                        .ok()?,
                        None => redis::Client::open(url.as_str()).ok()?,
                    };
                    let mut conn = client.get_multiplexed_async_connection().await.ok()?;
                    let pong: String = redis::cmd("PING").query_async(&mut conn).await.ok()?;
                    Some(pong == "PONG")
                }
                .await
                .unwrap_or(false),
            };
            if ready {
                break;
            }
            assert!(
                started.elapsed() < limit,
                "{kind:?} at {url} did not become ready within {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
