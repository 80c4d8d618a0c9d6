//! The Lua scripts: each operation is one atomic round trip.
//!
//! A record is one hash at `{prefix}:{<record id hex>}` (the braces are a cluster hash tag,
//! so any key a record ever gets shares its slot) with fields `st` (0 in flight, 1 completed),
//! `fp` (fingerprint), `tok` (lease token) and `out` (encoded outcome). Its TTL is the lease
//! while in flight and the retention once completed, both set by Redis (`PEXPIRE`): no
//! application clock is involved, and an expired lease is simply an absent key.

use redis::Script;

/// `KEYS[1]` record; `ARGV` fingerprint, token, lease ms.
/// Returns `{'x'}` execute, `{'r', outcome}` replay, `{'i', pttl}` in flight, `{'m'}` mismatch.
pub(crate) fn begin() -> Script {
    Script::new(
        r"
local cur = redis.call('HMGET', KEYS[1], 'st', 'fp', 'out')
if not cur[1] then
  redis.call('HSET', KEYS[1], 'st', '0', 'fp', ARGV[1], 'tok', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'x'}
end
if cur[2] ~= ARGV[1] then return {'m'} end
if cur[1] == '1' then return {'r', cur[3]} end
return {'i', redis.call('PTTL', KEYS[1])}
",
    )
}

/// `KEYS[1]` record; `ARGV` token, outcome, retention ms. Returns 1, or 0 when the token
/// does not own an in-flight record (the fence).
pub(crate) fn complete() -> Script {
    Script::new(
        r"
local cur = redis.call('HMGET', KEYS[1], 'st', 'tok')
if cur[1] ~= '0' or cur[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'st', '1', 'out', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
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

/// `KEYS[1]` record; `ARGV` token, lease ms. Extends the lease the token owns.
pub(crate) fn renew() -> Script {
    Script::new(
        r"
local cur = redis.call('HMGET', KEYS[1], 'st', 'tok')
if cur[1] ~= '0' or cur[2] ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
",
    )
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
