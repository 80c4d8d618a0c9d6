//! Configuration from the environment.

use std::{fmt, time::Duration};

/// Which idempotency store the demo runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Memory,
    Postgres,
    Redis,
    Hybrid,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Memory => "memory",
            Mode::Postgres => "postgres",
            Mode::Redis => "redis",
            Mode::Hybrid => "hybrid",
        })
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) bind: String,
    pub(crate) database_url: Option<String>,
    pub(crate) redis_url: Option<String>,
    pub(crate) mode: Mode,
    /// How long a completed outcome is replayed: the layer's retention.
    pub(crate) retention: Duration,
    /// How long one attempt holds its key before a retry may take it over.
    pub(crate) lease: Duration,
    /// The bearer token of the operator's routes under `/admin`; unset, they are not mounted.
    pub(crate) admin_token: Option<String>,
    /// Whether `X-Demo-Crash` may abort the process (`DEMO_CRASH=1`); off, it is refused.
    pub(crate) allow_crash: bool,
}

/// A positive number of milliseconds from `name`, or `default`.
fn millis_var(name: &str, value: Option<String>, default: Duration) -> Result<Duration, String> {
    match value {
        None => Ok(default),
        Some(ms) => ms
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis)
            .ok_or_else(|| format!("{name}={ms:?} is not a positive whole number of milliseconds")),
    }
}

impl Config {
    /// Reads `BIND`, `DATABASE_URL`, `REDIS_URL`, `IDEMPOTENCY_STORE`,
    /// `IDEMPOTENCY_RETENTION_MS`, `IDEMPOTENCY_LEASE_MS`, `ADMIN_TOKEN` and `DEMO_CRASH`.
    pub(crate) fn from_env() -> Result<Self, String> {
        // Set but empty is a mistake (a secret that did not arrive), not "unset": read as
        // unset, an empty `DATABASE_URL` quietly chose a store that keeps nothing durable.
        let var = |name: &str| -> Result<Option<String>, String> {
            match std::env::var(name) {
                Ok(value) if value.trim().is_empty() => Err(format!(
                    "{name} is set but empty: give it a value, or unset it"
                )),
                Ok(value) => Ok(Some(value)),
                Err(_) => Ok(None),
            }
        };
        let database_url = var("DATABASE_URL")?;
        let redis_url = var("REDIS_URL")?;
        let mode = match var("IDEMPOTENCY_STORE")?.as_deref() {
            None => match (&database_url, &redis_url) {
                (Some(_), Some(_)) => Mode::Hybrid,
                (Some(_), None) => Mode::Postgres,
                (None, Some(_)) => Mode::Redis,
                (None, None) => Mode::Memory,
            },
            Some("memory") => Mode::Memory,
            Some("postgres") => Mode::Postgres,
            Some("redis") => Mode::Redis,
            Some("hybrid") => Mode::Hybrid,
            Some(other) => {
                return Err(format!(
                    "IDEMPOTENCY_STORE={other:?} is not one of memory, postgres, redis, hybrid"
                ));
            }
        };
        let needs_db = matches!(mode, Mode::Postgres | Mode::Hybrid);
        let needs_redis = matches!(mode, Mode::Redis | Mode::Hybrid);
        if needs_db && database_url.is_none() {
            return Err(format!(
                "IDEMPOTENCY_STORE={mode} needs DATABASE_URL (a Postgres URL)"
            ));
        }
        if needs_redis && redis_url.is_none() {
            return Err(format!(
                "IDEMPOTENCY_STORE={mode} needs REDIS_URL (a Redis URL)"
            ));
        }
        let retention = millis_var(
            "IDEMPOTENCY_RETENTION_MS",
            var("IDEMPOTENCY_RETENTION_MS")?,
            Duration::from_secs(24 * 3600),
        )?;
        let lease = millis_var(
            "IDEMPOTENCY_LEASE_MS",
            var("IDEMPOTENCY_LEASE_MS")?,
            Duration::from_secs(30),
        )?;
        // A lease is a round trip or two at least (a grant that arrives with half of it gone
        // is given back: under 100 ms, a network store answers nearly every charge 503), and
        // at most what a crashed attempt may hold its key for.
        if !(Duration::from_millis(100)..=Duration::from_secs(24 * 3600)).contains(&lease) {
            return Err(format!(
                "IDEMPOTENCY_LEASE_MS={} is outside 100 ms to a day",
                lease.as_millis()
            ));
        }
        let allow_crash = match var("DEMO_CRASH")?.as_deref().map(str::trim) {
            None | Some("0" | "false") => false,
            Some("1" | "true") => true,
            Some(other) => {
                return Err(format!("DEMO_CRASH={other:?} is not 1, true, 0 or false"));
            }
        };
        Ok(Self {
            bind: var("BIND")?.unwrap_or_else(|| "127.0.0.1:3000".into()),
            database_url,
            redis_url,
            mode,
            retention,
            lease,
            admin_token: var("ADMIN_TOKEN")?,
            allow_crash,
        })
    }
}
