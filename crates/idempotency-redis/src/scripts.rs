//! The record layout and the Lua scripts that need atomicity beyond one command.
//!
//! A record is one string at `{prefix}:{<record id hex>}` (the braces are a cluster hash tag,
//! so any key a record ever gets shares its slot):
//!
//! | bytes  | content                                                                  |
//! |--------|--------------------------------------------------------------------------|
//! | 0      | state: `0` a lease, `m` a lease mirrored from Postgres, `1` completed, `c` a cancelled claim |
//! | 1..33  | fingerprint                                                              |
//! | 33..49 | lease token (16 bytes)                                                   |
//! | 49..   | the encoded outcome (completed records); `t` (a lease that took an unfinished one over) |
//!
//! Lease and retention are key TTLs counted by Redis; no application clock is involved (but
//! for the hybrid's copies of outcomes, bounded by the instant their row expires too: see
//! [`cache_completed`]). A
//! lease (`0`) lives `lease + LATE_COMPLETION_GRACE`: its lease is over once less than the
//! grace is left (`PTTL <= grace`), and it is then taken over by the next `begin`, but until
//! that happens its owner's late `complete` or `release` still finds its token and is
//! accepted. A mirror (`m`) lives exactly its TTL.
//!
//! A claim is a plain `SET … NX GET PX` (a read of the record with its TTL follows only when
//! it finds a lease): no script on the common path. Scripts remain where the record must be checked and changed atomically: a
//! takeover, and the writes fenced on the token (`complete`, `release`, `renew`, `cancel`).
//!
//! Records written by earlier versions (a hash with fields `st`, `fp`, `tok`, `out`, `exp`)
//! are still read and written in their own layout until they expire, so an upgrade forgets
//! no key: a claim on such a key fails its `SET` (`WRONGTYPE`) and runs [`legacy_begin`],
//! and every script below branches on the key's type.

use redis::Script;

/// Byte offsets of the layout above.
pub(crate) const FP: std::ops::Range<usize> = 1..33;
pub(crate) const TOKEN: std::ops::Range<usize> = 33..49;
pub(crate) const OUTCOME: usize = 49;

/// The value of a record in state `state`.
pub(crate) fn value(state: u8, fp: &[u8; 32], token: &[u8; 16], outcome: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(OUTCOME + outcome.len());
    v.push(state);
    v.extend_from_slice(fp);
    v.extend_from_slice(token);
    v.extend_from_slice(outcome);
    v
}

/// Redis' clock in milliseconds (scripts replicate their effects, so `TIME` is allowed).
const NOW_MS: &str = "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
";

/// `KEYS[1]` record, `KEYS[2]` this claim's tombstone; `ARGV` the new lease's value, its TTL
/// (lease + grace) ms, grace ms, token. Takes the record over when there is none, its lease
/// is over (for the same fingerprint: an unfinished lease is not another request's), or it
/// is another claim's cancel marker. Returns `{'x'}` taken, `{'t'}` taken from a lease that
/// ran out unfinished (its outcome is unknown), `{'c'}` this very claim was
/// cancelled (its marker, or its tombstone: see [`cancel`]), or `{'v', value, pttl}`: the
/// live record, which answers.
pub(crate) fn takeover() -> Script {
    Script::new(
        r"
if redis.call('EXISTS', KEYS[2]) == 1 then return {'c'} end
if redis.call('TYPE', KEYS[1]).ok == 'hash' then return {'h'} end
local v = redis.call('GET', KEYS[1])
if v then
  local st = string.sub(v, 1, 1)
  local pttl = redis.call('PTTL', KEYS[1])
  if st == 'c' then
    if string.sub(v, 34, 49) == ARGV[4] then return {'c'} end
  elseif not (st == '0' and pttl ~= -1 and pttl <= tonumber(ARGV[3])) then
    return {'v', v, pttl}
  elseif string.sub(v, 2, 33) ~= string.sub(ARGV[1], 2, 33) then
    return {'v', v, pttl}
  end
end
if v and string.sub(v, 1, 1) == '0' then
  redis.call('SET', KEYS[1], ARGV[1] .. 't', 'PX', ARGV[2])
  return {'t'}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {'x'}
",
    )
}

/// The claim of the earlier hash layout, for a key still holding such a record.
/// `KEYS[1]` record, `KEYS[2]` this claim's tombstone; `ARGV` fingerprint, token (text),
/// lease ms, grace ms. Returns `{'x'}` execute, `{'t'}` execute after a lease that ran out
/// unfinished (the new lease is marked `to`, so a [`cancel`] ends it rather than deleting
/// the only trace of that attempt), `{'r', outcome}` replay, `{'i', ms left}` in flight,
/// `{'m'}` mismatch, `{'c'}` cancelled, `{'s'}` no hash there any more (claim again). A live
/// lease under this claim's own token is its own (a cluster client resent the script; the
/// first copy landed): answered as that copy was.
pub(crate) fn legacy_begin() -> Script {
    Script::new(&format!(
        r"{NOW_MS}
if redis.call('EXISTS', KEYS[2]) == 1 then return {{'c'}} end
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return {{'s'}} end
local cur = redis.call('HMGET', KEYS[1], 'st', 'fp', 'out', 'exp', 'tok', 'to')
local live = cur[1] and (cur[1] == '1' or not cur[4] or tonumber(cur[4]) > now)
if not live and cur[1] == '0' and cur[2] ~= ARGV[1] then return {{'m'}} end
if not live then
  local lease = tonumber(ARGV[3])
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'st', '0', 'fp', ARGV[1], 'tok', ARGV[2], 'exp', string.format('%.0f', now + lease))
  redis.call('PEXPIRE', KEYS[1], lease + tonumber(ARGV[4]))
  if cur[1] == '0' then
    redis.call('HSET', KEYS[1], 'to', '1')
    return {{'t'}}
  end
  return {{'x'}}
end
if cur[2] ~= ARGV[1] then return {{'m'}} end
if cur[1] == '1' then return {{'r', cur[3]}} end
if cur[5] == ARGV[2] then
  if cur[6] == '1' then return {{'t'}} end
  return {{'x'}}
end
if cur[4] then return {{'i', tonumber(cur[4]) - now}} end
return {{'i', redis.call('PTTL', KEYS[1])}}
"
    ))
}

/// Reads the record of either layout for the fenced scripts: `st`, `tok` (`ARGV[1]` form for
/// the current layout, `ARGV[2]` — the token as text — for a legacy hash), the value, and
/// `took`: the lease took an unfinished one over.
///
/// One `GET` on the common path: a hash makes it fail (`WRONGTYPE`, caught by `pcall`), and
/// only then is the hash read. (A `TYPE` first cost Redis one more command per call.) Any
/// other type fails the `HMGET` as it failed the `GET` before. (Redis counts the caught
/// `WRONGTYPE` in `INFO errorstats`: a fenced write to a legacy record shows as one failed
/// `GET`, until those records expire.)
const READ_FENCED: &str = r"
local v = redis.pcall('GET', KEYS[1])
local legacy = type(v) == 'table'
local st, mine, took
if legacy then
  v = nil
  local cur = redis.call('HMGET', KEYS[1], 'st', 'tok', 'exp', 'to')
  st, mine, took = cur[1], cur[2] == ARGV[2], cur[4] == '1'
  if st == '0' and not cur[3] then st = 'm' end
else
  if v then
    st, mine = string.sub(v, 1, 1), string.sub(v, 34, 49) == ARGV[1]
    took = string.sub(v, 50, 50) == 't'
  end
end
";

/// `KEYS[1]` record; `ARGV` token, token text, outcome, retention ms. Returns 1, or 0 when
/// the token does not own the record (the fence). The lease may have run out: nobody took
/// over, or the token would differ. Completed by this token already: 1, and nothing changes.
///
/// `allow-oom`: a Redis full under `noeviction` still takes the outcome of an operation
/// that ran (its lease was written while there was room; the outcome replaces it). Refused,
/// it would be lost while renewals (`PEXPIRE`, which a full Redis allows) kept the lease
/// alive, and a retry after the memory was freed would run the operation again. New claims
/// are still refused, so a full Redis grows by the outcomes of the operations running.
pub(crate) fn complete() -> Script {
    Script::new(&format!(
        r"#!lua flags=allow-oom
{READ_FENCED}
if not mine then return 0 end
if st == '1' then return 1 end
if st ~= '0' and st ~= 'm' then return 0 end
if legacy then
  redis.call('HSET', KEYS[1], 'st', '1', 'out', ARGV[3])
  redis.call('HDEL', KEYS[1], 'exp')
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
else
  redis.call('SET', KEYS[1], '1' .. string.sub(v, 2, 49) .. ARGV[3], 'PX', ARGV[4])
end
return 1
"
    ))
}

/// `KEYS[1]` record; `ARGV` the completed record's value, its TTL ms, the instant it must
/// be gone by, and the instant it must land by (Unix ms, the sender's clock). A copy of an
/// outcome stored elsewhere (the hybrid's Postgres), replacing whatever is there; it lives
/// its TTL, but no longer than that instant by Redis' clock, so a copy that waited in a
/// stalled connection does not outlive its row by the stall. A copy that lands past its
/// deadline, or past that instant, deletes the key instead: its record may have been
/// released by an operator since (whose deletes allow for copies on their way for a while
/// only), and a lease's mirror must not answer "in flight" for a record that is over;
/// anything newer only costs its readers a Postgres round trip. Returns 1 written, 0
/// deleted.
pub(crate) fn cache_completed() -> Script {
    Script::new(&format!(
        r"{NOW_MS}
local o = 0
{WRITE_COPY}"
    ))
}

/// Writes a copy whose arguments start after `ARGV[o]` (value, TTL ms, gone-by and land-by
/// instants), or deletes the key past either instant (see [`cache_completed`]).
const WRITE_COPY: &str = r"
local ttl = math.min(tonumber(ARGV[o + 2]), tonumber(ARGV[o + 3]) - now)
if ttl <= 0 or now > tonumber(ARGV[o + 4]) then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('SET', KEYS[1], ARGV[o + 1], 'PX', ttl)
return 1
";

/// `KEYS[1]` record; `ARGV` token, token text, then as [`cache_completed`]: the completed
/// record's value, its TTL ms, the instant it must be gone by, the instant it must land by.
/// [`cache_completed`] fenced on the lease's mirror: the outcome replaces the mirror of the
/// token that completed the record. Anything else there (another lease's mirror, which may
/// be a newer attempt's after an operator's release; an outcome) is not overwritten: another
/// lease's mirror is deleted (a cache miss, where it would answer "in flight"), the rest
/// left. Returns 1 written; 0 not (past its deadline, the mirror is deleted); 2 the key is
/// empty, nothing written (the mirror expired, or never landed, or a release deleted it:
/// the caller decides).
pub(crate) fn replace_mirror() -> Script {
    Script::new(&format!(
        r"{NOW_MS}{READ_FENCED}
if not st then return 2 end
if st == 'm' and not mine then
  redis.call('DEL', KEYS[1])
  return 0
end
if not mine or st ~= 'm' then return 0 end
local o = 2
{WRITE_COPY}"
    ))
}

/// `KEYS[1]` record; `ARGV` token, token text. Deletes the lease (or mirror) the token owns.
pub(crate) fn release() -> Script {
    Script::new(&format!(
        r"{READ_FENCED}
if not mine or (st ~= '0' and st ~= 'm') then return 0 end
redis.call('DEL', KEYS[1])
return 1
"
    ))
}

/// `KEYS[1]` record; `ARGV` token, token text, lease ms, grace ms. Extends the lease the
/// token owns by `lease` from now (a mirror just gets the new TTL).
pub(crate) fn renew() -> Script {
    Script::new(&format!(
        r"{NOW_MS}{READ_FENCED}
if not mine or (st ~= '0' and st ~= 'm') then return 0 end
local lease = tonumber(ARGV[3])
if st == 'm' then
  redis.call('PEXPIRE', KEYS[1], lease)
elseif legacy then
  redis.call('HSET', KEYS[1], 'exp', string.format('%.0f', now + lease))
  redis.call('PEXPIRE', KEYS[1], lease + tonumber(ARGV[4]))
else
  redis.call('PEXPIRE', KEYS[1], lease + tonumber(ARGV[4]))
end
return 1
"
    ))
}

/// `KEYS[1]` record, `KEYS[2]` the claim's tombstone; `ARGV` token, token text, marker ms,
/// grace ms. Undoes a claim whose answer never arrived, whether or not it has run yet: if
/// this token holds the lease, the cancel marker takes its place; a lease that took an
/// unfinished one over (marked `t` after the token, or `to` in a legacy hash) is ended
/// instead (its TTL becomes the grace) and kept, so the next `begin` still reports the
/// unfinished attempt, and the claim's tombstone is left. Either way the claim written again
/// (a cluster connection resends a command whose answer timed out) grants nothing: its `SET
/// NX` fails on the marker, the takeover script refuses on the tombstone. Else, when the key
/// is free, it leaves a cancel marker there: the late claim's `SET NX` fails on it, and the
/// takeover script refuses for this token.
/// When someone else's record is there, it leaves the claim's tombstone, which the takeover
/// and the legacy claim check; a late plain `SET NX` fails as long as that record is there
/// (one gap remains: that record gone, then the late `SET NX`. It runs nothing, but holds the
/// key "in flight" for a lease, and then looks like an attempt whose outcome is unknown:
/// under `OutcomeUnknown::Reject` its retries are told `409` until an operator releases it,
/// under `Reconcile` the hook is asked, under the default `Reexecute` the retry runs).
///
/// `allow-oom`: a Redis full under `noeviction` still takes the marker (or the tombstone) in
/// place of a lease it holds; refused, the script failed and the cancel was retried for an
/// hour while the lease answered "in flight", then `TakeOver` for an operation that never
/// ran.
pub(crate) fn cancel() -> Script {
    Script::new(&format!(
        r"#!lua flags=allow-oom
{NOW_MS}{READ_FENCED}
if mine and st == '0' and took then
  if legacy then redis.call('HSET', KEYS[1], 'exp', string.format('%.0f', now)) end
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
  return 1
end
if mine and (st == '0' or st == 'm') then
  redis.call('SET', KEYS[1], 'c' .. string.rep('\0', 32) .. ARGV[1], 'PX', ARGV[3])
  return 1
end
if st then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
else
  redis.call('SET', KEYS[1], 'c' .. string.rep('\0', 32) .. ARGV[1], 'PX', ARGV[3])
end
return 0
"
    ))
}

/// `KEYS[1]` record: `{value, pttl}`, read together (a pipeline of `GET` and `PTTL` can be
/// split by Redis between two reads of its socket, with another client's completion run in
/// between: a lease with the TTL of a retention). `value` is empty when there is none (a
/// Lua `false` would reach a RESP3 client as a boolean).
pub(crate) fn read_with_ttl() -> Script {
    Script::new("return {redis.call('GET', KEYS[1]) or '', redis.call('PTTL', KEYS[1])}")
}

/// `KEYS[1]` record. The operator's read: `{'n', now}` no record, `{'v', now, pttl, value}`,
/// or `{'h', now, pttl, st, fp, out, exp}` for the earlier hash layout; every element a
/// string, `now` Redis' clock in ms.
pub(crate) fn inspect() -> Script {
    Script::new(&format!(
        r"{NOW_MS}
local pttl = tostring(redis.call('PTTL', KEYS[1]))
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  local cur = redis.call('HMGET', KEYS[1], 'st', 'fp', 'out', 'exp')
  return {{'h', tostring(now), pttl, cur[1] or '', cur[2] or '', cur[3] or '', cur[4] or ''}}
end
local v = redis.call('GET', KEYS[1])
if not v then return {{'n', tostring(now)}} end
return {{'v', tostring(now), pttl, v}}
"
    ))
}

/// `KEYS[1]` a record, for the node that holds it: Redis' clock there, in milliseconds.
pub(crate) fn clock() -> Script {
    Script::new(&format!("{NOW_MS}return now"))
}

/// `KEYS[1]` record, `KEYS[2]` this release's receipt; `ARGV[1]` `1` to delete a live lease
/// too, `ARGV[2]` `1` to delete a completed record too, `ARGV[3]` grace ms, `ARGV[4]` the
/// instant (Redis' clock, ms) past which it is too late. The operator's release: the token
/// goes with the record, so the owner's late fenced writes find nothing. Returns 1 a lease
/// (or mirror) deleted, 2 a completed record deleted, 3 a completed record kept, 4 a live
/// lease kept, 0 none (a cancel marker counts as none), 5 too late: nothing deleted (the call
/// that sent it gave up; a record there now may have come since). A mirror is live while it
/// exists.
///
/// Runs once per receipt: its answer is kept there until it is too late anyway, and a copy
/// of the same call run again answers it and touches nothing. A cluster connection sends a
/// script whose answer timed out again; a second copy that found the record its first copy
/// deleted replaced by a new attempt's lease deleted that too. The receipt is kept ten
/// seconds past the deadline, so a copy that comes just after it, while its caller still
/// waits, is answered what the first did, not "too late".
///
/// `allow-oom`: a Redis full under `noeviction` still takes the receipt (refused, a release
/// that deleted nothing failed as a whole).
pub(crate) fn force_release() -> Script {
    Script::new(&format!(
        r"#!lua flags=allow-oom
{NOW_MS}
local done = redis.call('GET', KEYS[2])
if done then return tonumber(done) end
if now >= tonumber(ARGV[4]) then return 5 end
local function release()
local st, live
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  local cur = redis.call('HMGET', KEYS[1], 'st', 'exp')
  st = cur[1]
  live = not cur[2] or tonumber(cur[2]) > now
else
  local v = redis.call('GET', KEYS[1])
  if v then
    st = string.sub(v, 1, 1)
    -- No TTL (-1: persisted from outside) is live, as `begin` reads it.
    local pttl = redis.call('PTTL', KEYS[1])
    live = st == 'm' or pttl == -1 or pttl > tonumber(ARGV[3])
  end
end
if st == '0' or st == 'm' then
  if live and ARGV[1] ~= '1' then return 4 end
  redis.call('DEL', KEYS[1])
  return 1
end
if st == '1' then
  if ARGV[2] == '1' then
    redis.call('DEL', KEYS[1])
    return 2
  end
  return 3
end
return 0
end
local found = release()
redis.call('SET', KEYS[2], found, 'PX', tonumber(ARGV[4]) - now + 10000)
return found
"
    ))
}
