//! The fault schedule: one fault at a time, each held for a while and then cleared, drawn
//! from the seed.

use std::{future::Future, time::Duration};

use rand::{Rng, SeedableRng, rngs::StdRng, seq::SliceRandom};
use tokio::time::Instant;

use crate::cluster::Cluster;

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// `SIGSTOP` to redis-server, `SIGCONT` after the hold: a hung Redis.
    RedisStop,
    /// Redis killed (SIGKILL) and started again empty.
    RedisKill,
    /// `FLUSHALL`: every cached replay and mirror gone at once.
    RedisFlush,
    /// `CLIENT PAUSE <hold>`: Redis answers nothing for the hold.
    RedisClientPause,
    /// Postgres killed and started again (its data survives).
    PostgresStop,
    /// Postgres frozen (`docker pause`: every backend stops where it is) for longer than the
    /// lease, then thawed: statements their callers gave up commit late, renewals fail, and
    /// leases run out by its clock while their owners still hold them.
    PostgresPause,
    /// A gateway SIGKILLed mid-traffic and started again.
    GatewayKill(usize),
    /// A gateway sent SIGTERM mid-traffic, as a deploy does: it stops taking requests,
    /// finishes those in flight, drains its layer (outcomes of requests whose client left,
    /// give-backs), exits, and is started again. It strands nothing: a charge whose outcome
    /// it did not store is one the drain lost.
    GatewayTerm(usize),
    /// A gateway SIGSTOPped for longer than the lease, then SIGCONTed: its charges in flight
    /// are taken over by the other gateway while it still holds them, and it wakes up a
    /// zombie that goes on with them (its late writes must be fenced off).
    GatewayPause(usize),
}

/// When a fault held, whether it excuses a second run of a charge's handler, and whether it
/// can leave a charge whose outcome was not stored.
///
/// One fault excuses a second run, as the guarantee says: Postgres frozen while a charge's
/// insert was on its way (held in the frozen server, it lands after the lease ran out, and
/// after the retry that took the key over looked for it with the reconcile hook; the unique
/// record id keeps the charge single, and `charges.runs` counts the second run). Postgres
/// killed does not: a statement it had not committed never commits, and one it had is
/// found by the hook. Nor does a gateway killed mid-operation (the retry takes the key over,
/// and the hook finds the charge), nor a gateway paused past the lease (behind the lease gate
/// the holder does not run its effect when it wakes), nor Redis faults.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    pub(crate) start: Instant,
    pub(crate) end: Instant,
    pub(crate) excuse: Option<Excuse>,
    /// A gateway killed or paused, or Postgres down or frozen: a charge made then may have
    /// no stored outcome, and the retry that takes its key over finds it with the reconcile
    /// hook. With no such fault, a charge found so is an outcome the layer lost.
    pub(crate) strands: bool,
    /// The gateway the fault hit, if it hit one: it strands only the charges it had.
    pub(crate) gateway: Option<usize>,
}

/// Why a fault's window excuses a second run (the report counts each apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Excuse {
    /// Postgres frozen: a charge's insert may land after the retry looked for it.
    LostAnswer,
    /// Gateway `.0` paused past the lease: an owner still stalled when taken over.
    StalledOwner(usize),
}

/// Watches this process's own timers for the host stalling (the campaign shares 2 cores with
/// the services and both gateways): a stall of a second or more is a window that strands
/// charges as a fault does (a gateway starved past its lease is taken over, and the reconcile
/// hook finds its charge), recorded rather than reported as an outcome the layer lost.
pub(crate) struct StallWatch {
    stalls: std::sync::Arc<std::sync::Mutex<Vec<Window>>>,
    task: tokio::task::JoinHandle<()>,
}

impl StallWatch {
    const TICK: Duration = Duration::from_millis(100);
    const STALL: Duration = Duration::from_secs(1);

    pub(crate) fn start() -> Self {
        let stalls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = stalls.clone();
        let task = tokio::spawn(async move {
            loop {
                let start = Instant::now();
                tokio::time::sleep(Self::TICK).await;
                let late = start.elapsed().saturating_sub(Self::TICK);
                if late >= Self::STALL {
                    println!("chaos: the host stalled for {late:?}");
                    seen.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(Window {
                            start,
                            end: Instant::now(),
                            excuse: None,
                            strands: true,
                            gateway: None,
                        });
                }
            }
        });
        Self { stalls, task }
    }

    /// The stalls seen since the start.
    pub(crate) fn stop(self) -> Vec<Window> {
        self.task.abort();
        std::mem::take(
            &mut *self
                .stalls
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

/// Until when the faults explain a key answered 409: a lease after the last one ended, and
/// for as long as one is on. Shared with the clients, who follow a run of 409s past it.
#[derive(Debug, Clone)]
pub(crate) struct Explained(std::sync::Arc<std::sync::Mutex<Instant>>);

impl Explained {
    pub(crate) fn new() -> Self {
        Self(std::sync::Arc::new(std::sync::Mutex::new(Instant::now())))
    }

    pub(crate) fn until(&self) -> Instant {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set(&self, until: Instant) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = until;
    }
}

/// Runs `driver` while injecting faults for `duration`; returns the driver's output, the
/// fault windows, and how many faults there were (the skewed gateway's clock counts as one).
/// `explained` is kept up to date as faults come and go.
pub(crate) async fn run<T>(
    cluster: &mut Cluster,
    seed: u64,
    duration: Duration,
    explained: &Explained,
    driver: impl Future<Output = T>,
) -> Result<(T, Vec<Window>, u64), String> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x0fau64);
    let standing = u64::from(cluster.gateways.len() > 1);
    // Every kind of fault once first, in an order drawn from the seed, then drawn at random:
    // a short campaign (CI's minute) still meets each kind.
    let mut first_round = every_fault(cluster);
    first_round.shuffle(&mut rng);
    let schedule = async {
        let started = Instant::now();
        let mut windows = Vec::new();
        loop {
            let gap = Duration::from_millis(rng.random_range(1_000..4_000));
            if started.elapsed() + gap >= duration {
                break;
            }
            tokio::time::sleep(gap).await;
            let Some(fault) = first_round.pop().or_else(|| pick(&mut rng, cluster)) else {
                continue;
            };
            let mut hold = Duration::from_millis(rng.random_range(300..2_000));
            if let Fault::GatewayPause(_) | Fault::PostgresPause = fault {
                // Past the lease: the key is taken over meanwhile (by the other gateway, or
                // by whichever reaches the thawed Postgres first).
                hold += cluster.lease();
            }
            println!(
                "chaos: t={:>5.1}s fault {fault:?} for {hold:?}",
                started.elapsed().as_secs_f64()
            );
            let start = Instant::now();
            explained.set(start + Duration::from_secs(24 * 3600));
            let injected = inject(cluster, fault, hold).await;
            explained.set(Instant::now() + cluster.lease());
            injected?;
            windows.push(Window {
                start,
                end: Instant::now(),
                excuse: match fault {
                    Fault::PostgresPause => Some(Excuse::LostAnswer),
                    Fault::GatewayPause(i) => Some(Excuse::StalledOwner(i)),
                    _ => None,
                },
                strands: matches!(
                    fault,
                    Fault::PostgresStop
                        | Fault::PostgresPause
                        | Fault::GatewayKill(_)
                        | Fault::GatewayPause(_)
                ),
                gateway: match fault {
                    Fault::GatewayKill(i) | Fault::GatewayTerm(i) | Fault::GatewayPause(i) => {
                        Some(i)
                    }
                    _ => None,
                },
            });
        }
        Ok::<_, String>(windows)
    };
    let (output, windows) = tokio::join!(driver, schedule);
    let windows = windows?;
    let count = windows.len() as u64 + standing;
    Ok((output, windows, count))
}

fn pick(rng: &mut StdRng, cluster: &Cluster) -> Option<Fault> {
    let mut choices = service_faults(cluster);
    if cluster.gateways.len() > 1 {
        let gateway = rng.random_range(0..cluster.gateways.len());
        choices.extend([
            Fault::GatewayKill(gateway),
            Fault::GatewayTerm(gateway),
            Fault::GatewayPause(gateway),
        ]);
    }
    (!choices.is_empty()).then(|| choices[rng.random_range(0..choices.len())])
}

/// The faults of the services this cluster runs in containers.
fn service_faults(cluster: &Cluster) -> Vec<Fault> {
    let mut faults = Vec::new();
    if cluster.redis.is_some() {
        faults.extend([
            Fault::RedisStop,
            Fault::RedisKill,
            Fault::RedisFlush,
            Fault::RedisClientPause,
        ]);
    }
    if cluster.postgres.is_some() {
        faults.extend([Fault::PostgresStop, Fault::PostgresPause]);
    }
    faults
}

/// Every fault this cluster can be given, each gateway's included.
fn every_fault(cluster: &Cluster) -> Vec<Fault> {
    let mut faults = service_faults(cluster);
    if cluster.gateways.len() > 1 {
        for gateway in 0..cluster.gateways.len() {
            faults.extend([
                Fault::GatewayKill(gateway),
                Fault::GatewayTerm(gateway),
                Fault::GatewayPause(gateway),
            ]);
        }
    }
    faults
}

async fn docker_signal(container: &str, signal: &str) -> Result<(), String> {
    let status = tokio::process::Command::new("docker")
        .args(["kill", "--signal", signal, container])
        .stdout(std::process::Stdio::null())
        .status()
        .await
        .map_err(|e| format!("docker kill: {e}"))?;
    status
        .success()
        .then_some(())
        .ok_or_else(|| format!("docker kill --signal {signal} failed"))
}

pub(crate) async fn redis_command(url: &str, args: &[&str]) -> Result<(), String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("redis: {e}"))?;
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    let _: redis::Value = cmd
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("redis {}: {e}", args.join(" ")))?;
    Ok(())
}

async fn inject(cluster: &mut Cluster, fault: Fault, hold: Duration) -> Result<(), String> {
    cluster.gateways_alive()?;
    match fault {
        Fault::RedisStop => {
            let id = cluster
                .redis
                .as_ref()
                .and_then(|r| r.container_id())
                .ok_or("no Redis container")?
                .to_owned();
            docker_signal(&id, "STOP").await?;
            tokio::time::sleep(hold).await;
            docker_signal(&id, "CONT").await?;
        }
        Fault::RedisKill => {
            let redis = cluster.redis.as_ref().ok_or("no Redis container")?;
            redis.stop().await;
            tokio::time::sleep(hold).await;
            redis.start().await;
        }
        Fault::RedisFlush => redis_command(cluster.redis_url(), &["FLUSHALL"]).await?,
        Fault::RedisClientPause => {
            let ms = hold.as_millis().to_string();
            redis_command(cluster.redis_url(), &["CLIENT", "PAUSE", &ms]).await?;
            tokio::time::sleep(hold).await;
        }
        Fault::PostgresStop => {
            let pg = cluster.postgres.as_ref().ok_or("no Postgres container")?;
            pg.stop().await;
            tokio::time::sleep(hold).await;
            pg.start().await;
        }
        Fault::PostgresPause => {
            let pg = cluster.postgres.as_ref().ok_or("no Postgres container")?;
            pg.pause().await;
            tokio::time::sleep(hold).await;
            pg.unpause().await;
        }
        Fault::GatewayKill(i) => {
            cluster.kill_gateway(i).await;
            tokio::time::sleep(hold).await;
            cluster.start_gateway(i).await?;
        }
        Fault::GatewayTerm(i) => {
            cluster.stop_gateway(i).await?;
            tokio::time::sleep(hold).await;
            cluster.start_gateway(i).await?;
        }
        Fault::GatewayPause(i) => {
            cluster.freeze_gateway(i, true)?;
            tokio::time::sleep(hold).await;
            cluster.freeze_gateway(i, false)?;
        }
    }
    Ok(())
}
