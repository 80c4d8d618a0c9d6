//! The system under test: Postgres, Redis, the gateways and nginx, as real processes.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use idempotency_test::services::{self, RedisOptions, Service};
use tokio::process::{Child, Command};

use crate::{Args, http};

/// A gateway: the payments-demo binary on its own port.
pub(crate) struct Gateway {
    port: u16,
    /// Clock skew under faketime, e.g. `+10m`; `None` for the true clock.
    skew: Option<String>,
    child: Option<Child>,
}

pub(crate) struct Cluster {
    pub(crate) postgres: Option<Service>,
    pub(crate) redis: Option<Service>,
    postgres_url: String,
    redis_url: String,
    pub(crate) gateways: Vec<Gateway>,
    nginx: Child,
    nginx_port: u16,
    demo_bin: PathBuf,
    dir: PathBuf,
    lease_ms: u64,
}

/// Deletes the semaphore and shared memory `faketime` names after its own pid
/// (`sem.faketime_sem_<pid>`, `faketime_shm_<pid>`) for pids no longer running. A wrapper
/// killed with its gateway (`SIGKILL`) cannot delete them, and a later wrapper given the
/// same pid then fails at once ("sem_open: File exists"): its gateway never comes up.
fn clear_stale_faketime_files(shm: &Path) {
    let Ok(entries) = std::fs::read_dir(shm) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if let Some(pid) = faketime_pid(&name.to_string_lossy())
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The pid a `faketime` wrapper's semaphore or shared memory is named after.
fn faketime_pid(name: &str) -> Option<u32> {
    name.strip_prefix("sem.faketime_sem_")
        .or_else(|| name.strip_prefix("faketime_shm_"))?
        .parse()
        .ok()
}

/// SIGKILLs a child's whole process group: `faketime` runs the gateway as its own child, and
/// nginx's workers outlive a killed master. Every child here leads a group of its own.
fn kill_group(child: &Child) {
    // Best effort: a group already gone has nothing left to kill.
    let _ = signal_group(child, "KILL");
}

/// Sends `signal` (`KILL`, `STOP`, `CONT`) to a child's whole process group.
///
/// The form matters: `kill -s KILL -- -PGID`. procps' `kill` does not read `kill -KILL -PGID`
/// as a group; in a rehearsal that form killed every process on the machine.
fn signal_group(child: &Child, signal: &str) -> Result<(), String> {
    let pid = child
        .id()
        .filter(|pid| *pid > 1)
        .ok_or("the process has exited")?;
    let status = std::process::Command::new("kill")
        .args(["-s", signal, "--", &format!("-{pid}")])
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("kill: {e}"))?;
    status
        .success()
        .then_some(())
        .ok_or_else(|| format!("kill -s {signal} -- -{pid} failed"))
}

/// Whether a process of group `pgid` is still running: read from `/proc/<pid>/stat` (its
/// state, then its group), a zombie not counted (`kill -0` counts one, and an orphan's is
/// reaped only if this machine's pid 1 reaps).
fn group_alive(pgid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            return false;
        };
        // `pid (comm) state ppid pgrp ...`; `comm` may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            return false;
        };
        let mut fields = rest.split(' ');
        let (state, _ppid, group) = (fields.next(), fields.next(), fields.next());
        state != Some("Z") && group == Some(pgid.to_string().as_str())
    })
}

/// Reads nginx's `keys` log (`<Idempotency-Key> <upstream_addr>` a line): each key, with the
/// gateways (indices into `ports`) it reached. A request nginx retried names both (`a, b`;
/// `a : b` across upstream groups); one that reached none (`-`) names nothing.
fn keys_reached(log: &str, ports: &[u16]) -> HashMap<String, HashSet<usize>> {
    let index: HashMap<String, usize> = (ports.iter().enumerate())
        .map(|(i, port)| (format!("127.0.0.1:{port}"), i))
        .collect();
    let mut reached: HashMap<String, HashSet<usize>> = HashMap::new();
    for line in log.lines() {
        let Some((key, upstreams)) = line.split_once(' ') else {
            continue;
        };
        reached.entry(key.to_owned()).or_default().extend(
            upstreams
                .replace(" : ", ", ")
                .split(',')
                .filter_map(|addr| index.get(addr.trim()).copied()),
        );
    }
    reached
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

fn log_file(dir: &Path, name: &str) -> Result<std::fs::File, String> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(name))
        .map_err(|e| format!("cannot open {}: {e}", dir.join(name).display()))
}

/// Waits until `GET path` on `addr` answers 200.
async fn wait_healthy(addr: &str, path: &str, within: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let reply = http::send(addr, "GET", path, &[], "", Duration::from_secs(2)).await;
        if reply.is_ok_and(|r| r.status == 200) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "{addr}{path} did not become healthy within {within:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Cluster {
    pub(crate) async fn start(args: &Args) -> Result<Self, String> {
        let dir = args.work_dir.clone().unwrap_or_else(|| {
            PathBuf::from(format!("target/chaos/{}-{}", args.seed, std::process::id()))
        });
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let demo_bin = match &args.demo_bin {
            Some(bin) => bin.clone(),
            None => std::env::current_exe()
                .map_err(|e| e.to_string())?
                .with_file_name("payments-demo"),
        };
        if !demo_bin.exists() {
            return Err(format!(
                "no payments-demo binary at {} (build it: cargo build -p payments-demo, or pass --demo-bin)",
                demo_bin.display()
            ));
        }
        for tool in ["nginx", "faketime", "docker"] {
            let found = std::process::Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !found && (tool != "docker" || args.postgres_url.is_none()) {
                return Err(format!(
                    "`{tool}` is not installed (Debian: apt-get install nginx-light faketime docker.io)"
                ));
            }
        }
        let (postgres, postgres_url) = match &args.postgres_url {
            Some(url) => (None, url.clone()),
            None => {
                let pg = services::start_postgres().await;
                let url = pg.url().to_owned();
                (Some(pg), url)
            }
        };
        let (redis, redis_url) = match &args.redis_url {
            Some(url) => (None, url.clone()),
            None => {
                let redis = services::start_redis(RedisOptions::default()).await;
                let url = redis.url().to_owned();
                (Some(redis), url)
            }
        };
        // The second gateway's clock is ten minutes off, the sign drawn from the seed.
        let skew = if args.seed.is_multiple_of(2) {
            "+10m"
        } else {
            "-10m"
        };
        let gateways: Vec<Gateway> = (0..args.gateways)
            .map(|i| Gateway {
                port: free_port(),
                skew: (i == 1).then(|| skew.to_owned()),
                child: None,
            })
            .collect();
        let nginx_port = free_port();
        let nginx = Self::start_nginx(&dir, nginx_port, &gateways_ports(&gateways))?;
        let mut cluster = Self {
            postgres,
            redis,
            postgres_url,
            redis_url,
            gateways,
            nginx,
            nginx_port,
            demo_bin,
            dir,
            lease_ms: args.lease_ms,
        };
        for i in 0..cluster.gateways.len() {
            cluster.start_gateway(i).await?;
        }
        wait_healthy(&cluster.nginx_addr(), "/healthz", Duration::from_secs(30)).await?;
        Ok(cluster)
    }

    fn start_nginx(dir: &Path, port: u16, upstreams: &[u16]) -> Result<Child, String> {
        let dir = std::fs::canonicalize(dir).map_err(|e| e.to_string())?;
        let servers: String = upstreams
            .iter()
            .map(|p| format!("        server 127.0.0.1:{p} max_fails=0;\n"))
            .collect();
        let d = dir.display();
        // A short upstream timeout and `non_idempotent`: nginx retries a slow POST on the next
        // gateway, with the same Idempotency-Key — the gateway-retry scenario.
        let conf = format!(
            "worker_processes 1;
user root;
pid {d}/nginx.pid;
error_log {d}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    # Which gateways each key reached (a retried request lists both): a paused gateway
    # excuses a second run only of a key it had.
    log_format keys '$http_idempotency_key $upstream_addr';
    access_log {d}/nginx-keys.log keys;
    client_body_temp_path {d}/nginx-body;
    proxy_temp_path {d}/nginx-proxy;
    fastcgi_temp_path {d}/nginx-fastcgi;
    uwsgi_temp_path {d}/nginx-uwsgi;
    scgi_temp_path {d}/nginx-scgi;
    upstream gateways {{
{servers}    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://gateways;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_connect_timeout 300ms;
            proxy_send_timeout 1s;
            proxy_read_timeout 1s;
            proxy_next_upstream error timeout non_idempotent;
            proxy_next_upstream_tries 2;
        }}
    }}
}}
"
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).map_err(|e| format!("{}: {e}", path.display()))?;
        Command::new("nginx")
            .arg("-p")
            .arg(&dir)
            .arg("-e")
            .arg(dir.join("nginx-error.log"))
            .arg("-c")
            .arg(&path)
            .args(["-g", "daemon off;"])
            .process_group(0)
            .stdout(log_file(&dir, "nginx.log")?)
            .stderr(log_file(&dir, "nginx.log")?)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start nginx: {e}"))
    }

    pub(crate) async fn start_gateway(&mut self, i: usize) -> Result<(), String> {
        let gateway = &self.gateways[i];
        let mut command = match &gateway.skew {
            Some(skew) => {
                clear_stale_faketime_files(Path::new("/dev/shm"));
                let mut c = Command::new("faketime");
                // Only the wall clock is off: the monotonic clock drives timers, and a
                // skewed one would just be another process's clock.
                c.arg("-f").arg(skew).arg(&self.demo_bin);
                c.env("DONT_FAKE_MONOTONIC", "1");
                c
            }
            None => Command::new(&self.demo_bin),
        };
        command
            .env("BIND", format!("127.0.0.1:{}", gateway.port))
            .env("DATABASE_URL", &self.postgres_url)
            .env("REDIS_URL", &self.redis_url)
            .env("IDEMPOTENCY_STORE", "hybrid")
            .env("IDEMPOTENCY_LEASE_MS", self.lease_ms.to_string())
            // The demo's own info lines too: its "stopped", after a clean drain.
            .env("RUST_LOG", "warn,payments_demo=info")
            .process_group(0)
            .stdout(log_file(&self.dir, &format!("gateway-{}.log", i + 1))?)
            .stderr(log_file(&self.dir, &format!("gateway-{}.log", i + 1))?)
            .kill_on_drop(true);
        let child = command
            .spawn()
            .map_err(|e| format!("cannot start gateway {}: {e}", i + 1))?;
        self.gateways[i].child = Some(child);
        let addr = format!("127.0.0.1:{}", self.gateways[i].port);
        wait_healthy(&addr, "/healthz", Duration::from_secs(60)).await
    }

    /// Freezes gateway `i` (`SIGSTOP`, its whole group) or thaws it (`SIGCONT`): a process
    /// that stalls with its work half done — a long GC-like pause, a VM migrated, a host
    /// swapping — and then goes on as if nothing happened. A signal not delivered is an
    /// error: a pause that never happened must not excuse anything, and a gateway left
    /// frozen must not go unnoticed.
    pub(crate) fn freeze_gateway(&self, i: usize, frozen: bool) -> Result<(), String> {
        let child = self.gateways[i]
            .child
            .as_ref()
            .ok_or_else(|| format!("gateway {} is not running", i + 1))?;
        signal_group(child, if frozen { "STOP" } else { "CONT" })
            .map_err(|e| format!("gateway {}: {e}", i + 1))
    }

    /// Fails if a gateway exited on its own (a crash the campaign did not inject): nginx
    /// would quietly send everything to the other, and a pause "delivered" to an exited
    /// (unreaped) process would excuse second runs it never caused.
    pub(crate) fn gateways_alive(&mut self) -> Result<(), String> {
        for (i, gateway) in self.gateways.iter_mut().enumerate() {
            if let Some(child) = &mut gateway.child
                && let Some(status) = child
                    .try_wait()
                    .map_err(|e| format!("gateway {}: {e}", i + 1))?
            {
                return Err(format!(
                    "gateway {} exited on its own ({status}): see gateway-{}.log",
                    i + 1,
                    i + 1
                ));
            }
        }
        Ok(())
    }

    /// Every key nginx passed on, with the gateways (by index) it reached.
    pub(crate) fn keys_reached(&self) -> Result<HashMap<String, HashSet<usize>>, String> {
        let ports: Vec<u16> = self.gateways.iter().map(|g| g.port).collect();
        let path = self.dir.join("nginx-keys.log");
        let log = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(keys_reached(&log, &ports))
    }

    /// The gateways' idempotency lease.
    pub(crate) fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }

    /// SIGKILL, like a crash: no graceful shutdown, no drain.
    pub(crate) async fn kill_gateway(&mut self, i: usize) {
        if let Some(mut child) = self.gateways[i].child.take() {
            kill_group(&child);
            let _ = child.wait().await;
        }
    }

    /// SIGTERM, as a deploy stops it: it finishes what it has in flight, drains, and exits.
    /// To its whole group: under `faketime` the gateway is the wrapper's child, and the
    /// wrapper dies of the signal at once while the gateway drains (so its status is the
    /// wrapper's: SIGTERM there, 0 from a gateway run directly); done once no process of the
    /// group is left. Fails if that takes more than `STOP_WITHIN` (killed then), if a gateway
    /// run directly exits with an error, or unless what the gateway logged meanwhile says it
    /// stopped (its last line, after its drain) and neither that its drain gave up nor that
    /// something panicked (seen for both gateways, the wrapped one's status being the
    /// wrapper's): a graceful stop that hangs, or fails, is a defect.
    pub(crate) async fn stop_gateway(&mut self, i: usize) -> Result<(), String> {
        const STOP_WITHIN: Duration = Duration::from_secs(45);
        let wrapped = self.gateways[i].skew.is_some();
        let Some(mut child) = self.gateways[i].child.take() else {
            return Err(format!("gateway {} is not running", i + 1));
        };
        let group = child.id().ok_or("the gateway has exited")?;
        let name = format!("gateway {} (see gateway-{}.log)", i + 1, i + 1);
        let log = self.dir.join(format!("gateway-{}.log", i + 1));
        let logged_before = std::fs::metadata(&log).map_or(0, |m| m.len());
        signal_group(&child, "TERM").map_err(|e| format!("{name}: {e}"))?;
        let stopped = async {
            let status = child.wait().await.map_err(|e| format!("{name}: {e}"))?;
            // The wrapper reaped, the group is empty once the gateway it ran exits.
            while group_alive(group) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok::<_, String>(status)
        };
        let ended = |status: &std::process::ExitStatus| {
            status.success()
                || (wrapped && std::os::unix::process::ExitStatusExt::signal(status) == Some(15))
        };
        match tokio::time::timeout(STOP_WITHIN, stopped).await {
            Ok(Ok(status)) if ended(&status) => {
                let logged = std::fs::read(&log).unwrap_or_default();
                let since = String::from_utf8_lossy(
                    logged.get(logged_before as usize..).unwrap_or_default(),
                );
                let stopped = since
                    .lines()
                    .any(|line| line.trim_end().ends_with("payments_demo: stopped"));
                match since.lines().find(|line| {
                    line.contains("stopped before every outcome") || line.contains("panicked")
                }) {
                    Some(line) => Err(format!("{name} did not stop cleanly: {line}")),
                    None if !stopped => Err(format!(
                        "{name} exited without logging that it stopped (its drain did not end)"
                    )),
                    None => Ok(()),
                }
            }
            Ok(Ok(status)) => Err(format!("{name} stopped with {status} after SIGTERM")),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                let _ = std::process::Command::new("kill")
                    .args(["-s", "KILL", "--", &format!("-{group}")])
                    .stderr(Stdio::null())
                    .status();
                Err(format!(
                    "{name} did not stop within {STOP_WITHIN:?} of SIGTERM"
                ))
            }
        }
    }

    pub(crate) fn nginx_addr(&self) -> String {
        format!("127.0.0.1:{}", self.nginx_port)
    }

    pub(crate) fn nginx_url(&self) -> String {
        format!("http://{}", self.nginx_addr())
    }

    pub(crate) fn postgres_url(&self) -> &str {
        &self.postgres_url
    }

    pub(crate) fn redis_url(&self) -> &str {
        &self.redis_url
    }

    pub(crate) fn skew_label(&self) -> &str {
        self.gateways
            .iter()
            .find_map(|g| g.skew.as_deref())
            .unwrap_or("(none: one gateway)")
    }

    pub(crate) async fn stop(mut self) {
        for i in 0..self.gateways.len() {
            self.kill_gateway(i).await;
        }
        kill_group(&self.nginx);
        let _ = self.nginx.wait().await;
        // The containers go with their handles.
        drop(self.postgres.take());
        drop(self.redis.take());
    }
}

/// On every path out (an error half-way included), no gateway, faketime or nginx process is
/// left running.
impl Drop for Cluster {
    fn drop(&mut self) {
        for child in self.gateways.iter().filter_map(|g| g.child.as_ref()) {
            kill_group(child);
        }
        kill_group(&self.nginx);
    }
}

fn gateways_ports(gateways: &[Gateway]) -> Vec<u16> {
    gateways.iter().map(|g| g.port).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_is_alive_while_a_process_of_it_runs_not_once_it_is_a_zombie() {
        use std::os::unix::process::CommandExt;
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .expect("sleep");
        let group = child.id();
        assert!(group_alive(group));
        child.kill().expect("kill");
        // Not reaped yet: a zombie, which counts for nothing (once the signal took it).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while group_alive(group) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!group_alive(group));
        child.wait().expect("reap");
        assert!(!group_alive(group));
    }

    #[test]
    fn faketime_files_are_told_by_their_pid() {
        assert_eq!(faketime_pid("sem.faketime_sem_1234"), Some(1234));
        assert_eq!(faketime_pid("faketime_shm_77"), Some(77));
        assert_eq!(faketime_pid("faketime_shm_x"), None);
        assert_eq!(faketime_pid("sem.other_1"), None);
    }

    /// Only the files of pids no longer running go.
    #[test]
    fn stale_faketime_files_are_cleared() {
        let dir = std::env::temp_dir().join(format!("shm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let alive = std::process::id();
        // Above any pid_max (4194304 at most): never running.
        let dead = 4_194_305;
        let names = [
            format!("sem.faketime_sem_{alive}"),
            format!("faketime_shm_{alive}"),
            format!("sem.faketime_sem_{dead}"),
            format!("faketime_shm_{dead}"),
            "unrelated".to_owned(),
        ];
        for name in &names {
            std::fs::write(dir.join(name), b"").expect("write");
        }
        clear_stale_faketime_files(&dir);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .expect("read")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut want = vec![names[0].clone(), names[1].clone(), names[4].clone()];
        want.sort();
        assert_eq!(left, want);
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn the_keys_log_names_every_gateway_a_key_reached() {
        let log = "k1 127.0.0.1:4001\n\
                   k2 127.0.0.1:4001, 127.0.0.1:4002\n\
                   k3 -\n\
                   k1 127.0.0.1:4002 : 127.0.0.1:4001\n\
                   k4 127.0.0.1:9999\n";
        let reached = keys_reached(log, &[4001, 4002]);
        assert_eq!(reached["k1"], HashSet::from([0, 1]));
        assert_eq!(reached["k2"], HashSet::from([0, 1]));
        assert!(reached["k3"].is_empty());
        assert!(reached["k4"].is_empty(), "not a gateway of the cluster");
        assert!(!reached.contains_key("k5"));
    }
}
