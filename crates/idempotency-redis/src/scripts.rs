//! The Lua scripts: each operation is one atomic round trip.
//!
//! A record is one hash at `{prefix}:{<record id hex>}` (the braces are a cluster hash tag,
//! so any key a record ever gets shares its slot) with fields `st` (0 in flight, 1 completed),
//! `fp` (fingerprint), `tok` (lease token), `out` (encoded outcome) and, while in flight,
//! `exp` (the lease's end in milliseconds on Redis' own clock, `TIME`). No application clock
//! is involved.
//!
//! An in-flight record outlives its lease by `LATE_COMPLETION_GRACE` (`ARGV` `grace ms`): an
//! expired lease is taken over by the next `begin`, but until then the owner's late
//! `complete` or `release` still finds its token and is accepted. A completed record's TTL is
//! its retention. Mirrors the hybrid store writes (`cache_in_flight`) carry no `exp`: their
//! TTL is their whole life.

use redis::Script;

/// Redis' clock in milliseconds (scripts replicate their effects, so `TIME` is allowed).
const NOW_MS: &str = "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
";

/// `KEYS[1]` record, `KEYS[2]` this claim's tombstone; `ARGV` fingerprint, token, lease ms,
/// grace ms. Returns `{'x'}` execute, `{'r', outcome}` replay, `{'i', ms left}` in flight,
/// `{'m'}` mismatch, `{'c'}` cancelled (see [`cancel`]). An in-flight record past its `exp`
/// is taken over (replaced, so the old token is fenced off).
pub(crate) fn begin() -> Script {
    Script::new(&format!(
        r"{NOW_MS}
if redis.call('EXISTS', KEYS[2]) == 1 then return {{'c'}} end
local cur = redis.call('HMGET', KEYS[1], 'st', 'fp', 'out', 'exp')
local live = cur[1] and (cur[1] == '1' or not cur[4] or tonumber(cur[4]) > now)
if not live then
  local lease = tonumber(ARGV[3])
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'st', '0', 'fp', ARGV[1], 'tok', ARGV[2], 'exp', string.format('%.0f', now + lease))
  redis.call('PEXPIRE', KEYS[1], lease + tonumber(ARGV[4]))
  return {{'x'}}
end
if cur[2] ~= ARGV[1] then return {{'m'}} end
if cur[1] == '1' then return {{'r', cur[3]}} end
if cur[4] then return {{'i', tonumber(cur[4]) - now}} end
return {{'i', redis.call('PTTL', KEYS[1])}}
"
    ))
}

/// `KEYS[1]` record; `ARGV` token, outcome, retention ms. Returns 1, or 0 when the token
/// does not own the record (the fence). The lease may have run out: nobody took over, or the
/// token would differ. Completed by this token already: 1, and nothing changes.
pub(crate) fn complete() -> Script {
    Script::new(
        r"
local cur = redis.call('HMGET', KEYS[1], 'st', 'tok')
if cur[2] ~= ARGV[1] then return 0 end
if cur[1] == '1' then return 1 end
redis.call('HSET', KEYS[1], 'st', '1', 'out', ARGV[2])
redis.call('HDEL', KEYS[1], 'exp')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
",
    )
}

/// `KEYS[1]` record, `KEYS[2]` the claim's tombstone; `ARGV` token, tombstone ms. Undoes a
/// claim whose answer never arrived, whether or not it has run yet: deletes the record if
/// this token holds it, else leaves a tombstone that makes the claim refuse when it runs late.
/// (A plain release could overtake the claim: after a timeout the client reconnects, and the
/// two commands travel on different connections.)
pub(crate) fn cancel() -> Script {
    Script::new(
        r"
local cur = redis.call('HMGET', KEYS[1], 'st', 'tok')
if cur[1] == '0' and cur[2] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
return 0
",
    )
}

/// `KEYS[1]` record; `ARGV` token. Deletes the in-flight record the token owns.
pub(crate) fn release() -> Script {
    Script::new(
        r"
local cur = redis.call('HMGET', KEYS[1], 'st', 'tok')
if cur[1] ~= '0' or cur[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
",
    )
}

/// `KEYS[1]` record; `ARGV` token, lease ms, grace ms. Extends the lease the token owns (a
/// mirror without `exp` just gets the new TTL).
pub(crate) fn renew() -> Script {
    Script::new(&format!(
        r"{NOW_MS}
local cur = redis.call('HMGET', KEYS[1], 'st', 'tok', 'exp')
if cur[1] ~= '0' or cur[2] ~= ARGV[1] then return 0 end
local lease = tonumber(ARGV[2])
if cur[3] then
  redis.call('HSET', KEYS[1], 'exp', string.format('%.0f', now + lease))
  redis.call('PEXPIRE', KEYS[1], lease + tonumber(ARGV[3]))
else
  redis.call('PEXPIRE', KEYS[1], lease)
end
return 1
"
    ))
}

/// `KEYS[1]` record; `ARGV` fingerprint, token, lease ms. Mirrors a lease another store
/// granted, unless the record is already there.
pub(crate) fn cache_in_flight() -> Script {
    Script::new(
        r"
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'st', '0', 'fp', ARGV[1], 'tok', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
",
    )
}

/// `KEYS[1]` record; `ARGV` fingerprint, outcome, ttl ms. Caches an outcome another store
/// holds (it replaces any in-flight mirror: the outcome is the truth).
pub(crate) fn cache_completed() -> Script {
    Script::new(
        r"
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'st', '1', 'fp', ARGV[1], 'out', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
",
    )
}
