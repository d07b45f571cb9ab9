"""The worker's Lua scripts: every write about a job is fenced by ownership of its pending entry.

The fencing token of an attempt is (consumer name, delivery count) of the job's pending entry in
the consumer group. XACK alone does not check the owner, so a worker that was paused, had its job
reclaimed and woke up again could otherwise write into (or ack) another worker's attempt. Each
script checks the token and does its writes in one atomic step.
"""

from __future__ import annotations

from typing import Any

import redis

from producer.protocol import Keys, ProtocolError, validate_name

# A fence counter outlives any attempt it guards (it is bumped at every claim from its worker).
FENCE_TTL_S = 7 * 24 * 3600
DEAD_LETTER_MAXLEN = 10_000  # per model (FINISH_LUA)

# The fencing tokens this worker holds: entry id -> delivery count, from ONE XPENDING over its
# own pending entries (one call per script run instead of one per job). Its pending entries are
# bounded by its capacity (reads ask for no more).
_OWNED = """
local function owned_entries(stream, group, me)
  local owned = {}
  for _, p in ipairs(redis.call('XPENDING', stream, group, '-', '+', 2147483647, me)) do
    owned[p[1]] = tonumber(p[4])
  end
  return owned
end
"""

# Token (and started) events of many jobs in one call. The events travel as ONE blob plus a
# msgpack index, so a step with 256 running jobs is a handful of arguments, not a thousand.
# KEYS: jobs stream, this worker's fence counter, reply key of job 1..k.
# ARGV: group, me, reply ttl, index = msgpack [[entry id, deliveries, [event lengths], refresh
#       ttl, check], ...] (one per reply key, same order), blob = the encoded events
#       concatenated, the fence counter's value at the writer's last full check ('' for none;
#       '-': a writer without a counter, KEYS[2] unused, always walks).
# Ownership: every claim of entries from a worker bumps its fence counter (RECLAIM_LUA). When the
# counter reads otherwise than at the writer's last full check (or with ''/'-'), the script walks
# all of the worker's pending entries once (XPENDING) and checks every job of the call; the writer
# then trusts only those, and flags `check` on any other entry's next write. While the counter
# stands still, only flagged entries are checked, each on its own (an XPENDING of one id): at
# steady state none, so a token event does not pay for a walk of every pending entry. The writer
# passes '' at start, after a connection error and at least once a second.
# The reply key's TTL is set when the writer asks (its first event, then now and then), not on
# every event; the terminal event sets it again.
# A reply key that holds something other than a stream (WRONGTYPE: not genq's writing) fails
# only its own job's XADDs (pcall): the other jobs of the call are written. Any other refusal
# (out of memory, a replica) fails the call, as before: the writer retries it whole.
# Returns {fence counter value, the entry ids this worker no longer owns (not written), the
# entry ids whose reply key is not a stream (not written)}.
WRITE_EVENTS_LUA = _OWNED + """
local group, me, ttl = ARGV[1], ARGV[2], ARGV[3]
local index = cmsgpack.unpack(ARGV[4])
local blob = ARGV[5]
local fence, owned = '', nil
if ARGV[6] ~= '-' then fence = redis.call('GET', KEYS[2]) or '0' end
if fence == '' or fence ~= ARGV[6] then owned = owned_entries(KEYS[1], group, me) end
local lost, unwritable = {}, {}
local offset = 1
for k = 3, #KEYS do
  local job = index[k - 2]
  local lengths = job[3]
  local ours
  if owned ~= nil then
    ours = owned[job[1]] == tonumber(job[2])
  elseif job[5] then
    local p = redis.call('XPENDING', KEYS[1], group, job[1], job[1], 1)[1]
    ours = p ~= nil and p[2] == me and tonumber(p[4]) == tonumber(job[2])
  else
    ours = true
  end
  if ours then
    local bad = false
    for i = 1, #lengths do
      if not bad then
        local r = redis.pcall('XADD', KEYS[k], '*', 'e',
                              string.sub(blob, offset, offset + lengths[i] - 1))
        if type(r) == 'table' and r.err then
          if string.sub(r.err, 1, 9) ~= 'WRONGTYPE' then return r end  -- (OOM...: retried)
          bad = true
          table.insert(unwritable, job[1])
        end
      end
      offset = offset + lengths[i]
    end
    if job[4] and not bad then redis.call('EXPIRE', KEYS[k], ttl) end
  else
    for i = 1, #lengths do offset = offset + lengths[i] end
    table.insert(lost, job[1])
  end
end
return {fence, lost, unwritable}
"""

# The ends of many attempts in one call. Per attempt: optional terminal event, optional dead
# letter, optional re-add (a draining worker handing the job back), then XACK + XDEL; all or
# nothing, and only if this worker still owns the entry.
# KEYS: jobs stream, dead-letter stream, reply key of finish 1..k (the jobs stream when none),
#       idem key of finish 1..k (the jobs stream when none).
# ARGV: group, me, reply ttl, dead ttl,
#       index = msgpack [[entry id, deliveries, event length, dead fields, re-add fields], ...]
#       (field lists flat: name, value, ...; one per finish, same order),
#       blob = the terminal events concatenated (length 0: no event).
# The dead-letter stream keeps about the newest DEAD_LETTER_MAXLEN letters (MAXLEN ~: each may
# hold a raw job of up to --max-job-bytes; a trickle of bad jobs must not grow it without end).
# A job's terminal event also marks its idempotency key (if it is still there: SET XX KEEPTTL)
# 'ended': a client that finds no reply stream and that mark knows the result expired instead
# of waiting for a job that will never write again (producer/client.py ResultExpired). (A worker
# user whose ACL predates the mark, without ~genq:idem:*, is refused the call: the writer then
# finishes without idem keys.)
# Each entry's owner is checked on its own (XPENDING of that one id: a few finishes among many
# held entries cost a few lookups, not a walk over all of them); no fence counter shortcut here.
# A reply key that is not a stream (WRONGTYPE) takes no terminal event: the job is dead-lettered
# (code reply_unwritable) and acked, and the other finishes of the call are written.
# Returns per finish 1 when written, 2 when acked but dead-lettered instead of its terminal
# event (its reply key is not a stream), 0 when the entry is no longer this worker's.
FINISH_LUA = f"""
local DEAD_LETTER_MAXLEN = {DEAD_LETTER_MAXLEN}
""" + """
local group, me, ttl, dead_ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local index = cmsgpack.unpack(ARGV[5])
local blob = ARGV[6]
local function owns(id, deliveries)
  local p = redis.call('XPENDING', KEYS[1], group, id, id, 1)[1]
  return p ~= nil and p[2] == me and tonumber(p[4]) == deliveries
end
local done = {}
local offset = 1
local m = (#KEYS - 2) / 2
for i = 1, m do
  local f = index[i]
  local id, n = f[1], f[3]
  local event = string.sub(blob, offset, offset + n - 1)
  offset = offset + n
  if owns(id, tonumber(f[2])) then  -- (acked below: a second finish of it here is a no-op)
    local wrote = 1
    if n > 0 then
      local r = redis.pcall('XADD', KEYS[2 + i], '*', 'e', event)
      if type(r) == 'table' and r.err then  -- not a stream: the job goes to the dead letters
        if string.sub(r.err, 1, 9) ~= 'WRONGTYPE' then return r end  -- (OOM...: retried)
        redis.call('XADD', KEYS[2], 'MAXLEN', '~', DEAD_LETTER_MAXLEN, '*', 'reason',
                   'its reply key ' .. KEYS[2 + i] .. ' is not a stream (' .. r.err ..
                   '): its end could not be written', 'code', 'reply_unwritable',
                   'entry', id, 'worker', me)
        redis.call('EXPIRE', KEYS[2], dead_ttl)
        wrote = 2
      else
        redis.call('EXPIRE', KEYS[2 + i], ttl)
        if KEYS[2 + m + i] ~= KEYS[1] then
          redis.call('SET', KEYS[2 + m + i], 'ended', 'XX', 'KEEPTTL')
        end
      end
    end
    if #f[4] > 0 then
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', DEAD_LETTER_MAXLEN, '*', unpack(f[4]))
      redis.call('EXPIRE', KEYS[2], dead_ttl)
    end
    if #f[5] > 0 then
      redis.call('XADD', KEYS[1], '*', unpack(f[5]))
    end
    redis.call('XACK', KEYS[1], group, id)
    redis.call('XDEL', KEYS[1], id)
    done[#done + 1] = wrote
  else
    done[#done + 1] = 0
  end
end
return done
"""

# Heartbeat-gated reclaim: claim up to `count` pending entries of consumers whose heartbeat key
# is gone (and, when include_self is 1, this worker's own entries: a restart under the same name
# re-reads them). A live worker is never robbed, however long its generation. Consumers that are
# gone and own nothing are deleted from the group and from the model's worker registry.
# Each consumer something was claimed from gets its fence counter bumped (WRITE_EVENTS_LUA).
# Every key it touches is declared (a cluster routes by them, and refuses undeclared ones): the
# caller names the consumers it saw (XINFO CONSUMERS) with their heartbeat and fence keys, all in
# the stream's slot; a consumer that appears between that look and this call waits for the next.
# KEYS: jobs stream, worker registry set, then per named consumer: heartbeat key, fence key.
# ARGV: group, me, count, include_self, fence counter ttl, consumer name 1..c.
# Returns {entry id, fields, deliveries} per claimed entry.
RECLAIM_LUA = """
local group, me = ARGV[1], ARGV[2]
local budget = tonumber(ARGV[3])
local claimed = {}
if budget <= 0 then return claimed end
local pending_of = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], group)) do
  local name, pending = nil, 0
  for i = 1, #c, 2 do
    if c[i] == 'name' then name = c[i + 1] elseif c[i] == 'pending' then pending = c[i + 1] end
  end
  pending_of[name] = pending
end
for k = 6, #ARGV do
  local name = ARGV[k]
  local heartbeat, fence = KEYS[2 * (k - 5) + 1], KEYS[2 * (k - 5) + 2]
  local pending = pending_of[name]
  local mine = name == me
  local gone = pending ~= nil and ((mine and ARGV[4] == '1') or
                                   (not mine and redis.call('EXISTS', heartbeat) == 0))
  if gone and pending > 0 then
    local entries = redis.call('XPENDING', KEYS[1], group, '-', '+', budget, name)
    if #entries > 0 then  -- before the claims: the loop below may return early
      redis.call('INCR', fence)
      redis.call('EXPIRE', fence, ARGV[5])
    end
    for _, e in ipairs(entries) do
      local got = redis.call('XCLAIM', KEYS[1], group, me, 0, e[1])
      if got[1] then
        table.insert(claimed, {got[1][1], got[1][2], e[4] + 1})
        budget = budget - 1
      end
      if budget == 0 then return claimed end
    end
  elseif gone and pending == 0 and not mine then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], group, name)
    redis.call('SREM', KEYS[2], name)
  end
end
return claimed
"""

# An attempt whose write Redis refused for good (worker/io_thread.py) counts as failed: while this
# worker still owns the entry at that delivery count, it claims the entry again, which adds a
# delivery. The worker drops the attempt and adopts the entry again as its next attempt, so past
# --max-attempts it ends in the dead letters instead of running again and again.
# KEYS: jobs stream. ARGV: group, me, then per attempt: entry id, deliveries.
# Returns the entry ids claimed again.
FAIL_ATTEMPTS_LUA = """
local group, me = ARGV[1], ARGV[2]
local failed = {}
for i = 3, #ARGV, 2 do
  local id = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], group, id, id, 1)[1]
  if p ~= nil and p[2] == me and tonumber(p[4]) == tonumber(ARGV[i + 1]) then
    redis.call('XCLAIM', KEYS[1], group, me, 0, id)
    failed[#failed + 1] = id
  end
end
return failed
"""


def reclaim_call(keys: Keys, model: str, jobs_key: str, me: str, consumers: list[str],
                 count: int, include_self: bool, shard: int = 0) -> tuple[list[str], list[Any]]:
    """The KEYS and ARGV of RECLAIM_LUA for the consumers seen in the group of `jobs_key`, one
    of the streams (a priority lane) of `model`'s `shard`: the worker keys are that shard's,
    in its slot."""
    names = [name for name in consumers if name == me or _valid_name(name)]
    call_keys = [jobs_key, keys.workers(model, shard)]
    for name in names:
        call_keys += [keys.worker(model, name, shard), keys.fence(model, name, shard)]
    return call_keys, [keys.group, me, count, "1" if include_self else "0", FENCE_TTL_S, *names]


def _valid_name(name: str) -> bool:
    """A consumer name a worker could have (another client may add odd ones to the group: those
    are left alone, as no heartbeat key can be named for them)."""
    try:
        validate_name(name, "worker name")
    except ProtocolError:
        return False
    return True


class Scripts:
    """The scripts registered on one client (redis-py re-loads them after a NOSCRIPT)."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self.write_events = conn.register_script(WRITE_EVENTS_LUA)
        self.finish = conn.register_script(FINISH_LUA)
        self.reclaim = conn.register_script(RECLAIM_LUA)
        self.fail_attempts = conn.register_script(FAIL_ATTEMPTS_LUA)

    @staticmethod
    def queue(pipe: Any, script: Any, keys: list[Any], args: list[Any]) -> None:
        """EVALSHA `script` in `pipe` as is. redis-py checks every pipelined script with a
        SCRIPT EXISTS round trip per execute; callers of this instead catch NoScriptError,
        `load()` and run the pipeline again (the scripts are fenced: a rerun is safe)."""
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)

    def load(self) -> None:
        for script in (self.write_events, self.finish, self.reclaim, self.fail_attempts):
            self.conn.script_load(script.script)  # its sha is the script's digest: unchanged


def flatten_fields(fields: dict[str, bytes] | dict[bytes, bytes]) -> list[Any]:
    out: list[Any] = []
    for key, value in fields.items():
        out += [key, value]
    return out
