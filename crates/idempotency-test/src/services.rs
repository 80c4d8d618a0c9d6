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

/// The label on every container the harness starts, so CI can remove leftovers of a run
/// that was killed before it could clean up.
pub const LABEL: &str = "io.idempotency.test";

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
        wait_ready(self.kind, &self.ports, Duration::from_secs(60)).await;
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
    let port = free_port();
    let request = match local_image() {
        Some((name, tag)) => {
            // The Debian package's cluster only allows peer/scram: trust the loopback test
            // client, and run the server directly so it is the process that receives signals.
            // fsync=off is safe for the crash tests (a killed process leaves its writes in the
            // page cache); synchronous_commit=off would not be: it loses acknowledged commits.
            let script = format!(
                "set -e; sed -i '1i host all all 127.0.0.1/32 trust' /etc/postgresql/15/main/pg_hba.conf; \
                 mkdir -p /var/run/postgresql; chown postgres /var/run/postgresql; \
                 exec setpriv --reuid=postgres --regid=postgres --init-groups \
                 /usr/lib/postgresql/15/bin/postgres -c config_file=/etc/postgresql/15/main/postgresql.conf \
                 -c listen_addresses=127.0.0.1 -c port={port} -c ssl=off -c fsync=off \
                 -c full_page_writes=off -c max_connections=300"
            );
            GenericImage::new(name, tag)
                .with_wait_for(WaitFor::message_on_stderr(
                    "database system is ready to accept connections",
                ))
                .with_cmd(["sh", "-c", &script])
        }
        None => {
            let (name, tag) = split_image("IDEMPOTENCY_TEST_POSTGRES_IMAGE", "postgres:16-alpine");
            GenericImage::new(name, tag)
                .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
                .with_cmd(["postgres", "-c", "fsync=off", "-c", "max_connections=300"])
        }
    };
    let container = run(request, Kind::Postgres, port, 5432).await;
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    wait_ready(Kind::Postgres, &[port], Duration::from_secs(90)).await;
    Service {
        kind: Kind::Postgres,
        url,
        ports: vec![port],
        container: Some(container),
    }
}

/// Starts a dedicated standalone Redis container (owned by the caller, removed on drop).
pub async fn start_redis(options: RedisOptions) -> Service {
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
    let request = match local_image() {
        Some((name, tag)) => {
            args.extend(["--bind", "127.0.0.1", "--port"].map(String::from));
            args.push(port.to_string());
            args.extend(options.args);
            GenericImage::new(name, tag)
                .with_wait_for(WaitFor::message_on_stdout("Ready to accept connections"))
                .with_cmd(args)
        }
        None => {
            let (name, tag) = split_image("IDEMPOTENCY_TEST_REDIS_IMAGE", "redis:7-alpine");
            if host_network() {
                args.extend(["--bind", "127.0.0.1", "--port"].map(String::from));
                args.push(port.to_string());
            }
            args.extend(options.args);
            GenericImage::new(name, tag)
                .with_wait_for(WaitFor::message_on_stdout("Ready to accept connections"))
                .with_cmd(args)
        }
    };
    let container = run(request, Kind::Redis, port, 6379).await;
    wait_ready(Kind::Redis, &[port], Duration::from_secs(60)).await;
    Service {
        kind: Kind::Redis,
        url: format!("redis://127.0.0.1:{port}/"),
        ports: vec![port],
        container: Some(container),
    }
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

/// Waits until the server speaks its protocol on every port (a published port accepts TCP
/// before the server inside listens, so a TCP connect proves nothing).
async fn wait_ready(kind: Kind, ports: &[u16], limit: Duration) {
    let started = Instant::now();
    for port in ports {
        loop {
            let ready = match kind {
                Kind::Postgres => {
                    use sqlx::Connection;
                    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
                    match sqlx::PgConnection::connect(&url).await {
                        Ok(conn) => conn.close().await.is_ok(),
                        Err(_) => false,
                    }
                }
                Kind::Redis | Kind::RedisCluster => {
                    let url = format!("redis://127.0.0.1:{port}/");
                    async {
                        let client = redis::Client::open(url).ok()?;
                        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
                        let pong: String = redis::cmd("PING").query_async(&mut conn).await.ok()?;
                        Some(pong == "PONG")
                    }
                    .await
                    .unwrap_or(false)
                }
            };
            if ready {
                break;
            }
            assert!(
                started.elapsed() < limit,
                "{kind:?} on 127.0.0.1:{port} did not become ready within {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
