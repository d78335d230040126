"""Route sessions in a Redis every replica shares: any replica serves any turn with a correct delta.

The same interface as :class:`auxout.vllm.server.sessions.SessionStore` (``starts_for``, ``begin``,
``delivered``, ``release``, ``forget``), and the same rules (see :mod:`auxout.vllm.server.sessions`); what
changes is where a session lives:

- one Redis hash per session (``tok``: the delivered tokens as little-endian int32, ``rows``:
  the other arrays' rows as JSON, ``wv``: the weights version the rows were computed with, ``ver``:
  how many turns were recorded, and while a turn is in
  flight ``turn``/``until``: its claim and lease deadline, in the Redis server's clock);
- ``begin`` claims the session in one Lua script (a turn of another claim still in its lease gets
  :class:`~auxout.vllm.server.sessions.SessionBusyError`); ``delivered`` records the turn in one Lua script
  only if the claim is still this turn's, or nobody claimed or advanced the session since (a
  compare-and-set on ``ver``): two replicas can never both advance a session. A turn that lost
  its claim (its lease ran out and another turn took the session) is not recorded: the session
  then holds what the later turn delivered, and a client's next turn starts at or before the
  rows it holds, never past them;
- bounds: each session expires ``ttl`` seconds after its last use; ``max_sessions`` and
  ``max_tokens`` bound all sessions of a namespace and model together (an index sorted by last
  use, the least recently used evicted first, in the same script that records a turn); a
  history longer than ``max_tokens`` is not kept. Expired or evicted sessions start again at 0.
- keys: ``auxout:sessions:{<namespace>}:<model>:...`` (one hash tag: every key of a namespace in
  one Redis Cluster slot). Sessions of different served models never meet.

If Redis cannot be reached, the server answers from position 0 (the whole history: never a
wrong delta) and records nothing (:class:`SessionStoreError`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from auxout.credentials import redact, resolve_credentials
from auxout.vllm.server.sessions import (
    DEFAULT_TURN_LEASE,
    SessionBusyError,
    from_zero,
    rows_after,
    starts_from,
)

DEFAULT_TTL = 3600.0
"""Seconds a session lives after its last turn (an idle conversation then starts again at 0)."""

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) "

_BEGIN = _NOW + """
local f = redis.call('HMGET', KEYS[1], 'turn', 'until', 'tok', 'rows', 'ver', 'wv')
if f[1] and f[1] ~= ARGV[1] and tonumber(f[2]) > now then
  return {0, tostring(tonumber(f[2]) - now)}
end
local lease = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'turn', ARGV[1], 'until', now + lease)
if f[3] then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + lease)
else
  redis.call('PEXPIRE', KEYS[1], lease)
end
return {1, f[3] or '', f[4] or '', f[5] or '0', f[6] or ''}
"""

_DROP = """
local function drop(id)
  local n = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HDEL', KEYS[3], id)
  redis.call('ZREM', KEYS[2], id)
  return n
end
"""

_COMMIT = _NOW + _DROP + """
local f = redis.call('HMGET', KEYS[1], 'turn', 'until', 'ver')
local mine = f[1] == ARGV[1]
local free = (not f[1]) or tonumber(f[2]) <= now
local ver = tonumber(f[3] or '0')
if ARGV[1] ~= '' and not (mine or (free and ver == tonumber(ARGV[2]))) then
  return -1
end
local ttl = tonumber(ARGV[6])
local total = tonumber(redis.call('GET', KEYS[4]) or '0')
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do
  total = total - drop(id)
end
total = total - drop(ARGV[9])
if tonumber(ARGV[5]) < 0 then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[4], total)
  return ver
end
redis.call('HSET', KEYS[1], 'tok', ARGV[3], 'rows', ARGV[4], 'ver', ver + 1, 'wv', ARGV[11])
redis.call('HDEL', KEYS[1], 'turn', 'until')
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], now, ARGV[9])
redis.call('HSET', KEYS[3], ARGV[9], ARGV[5])
total = total + tonumber(ARGV[5])
local max_sessions, max_tokens = tonumber(ARGV[7]), tonumber(ARGV[8])
while redis.call('ZCARD', KEYS[2]) > 1 and (redis.call('ZCARD', KEYS[2]) > max_sessions or total > max_tokens) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if oldest == ARGV[9] then break end
  total = total - drop(oldest)
  redis.call('DEL', ARGV[10] .. oldest)
end
redis.call('SET', KEYS[4], total)
return ver + 1
"""

_RELEASE = """
if redis.call('HGET', KEYS[1], 'turn') == ARGV[1] then
  if redis.call('HEXISTS', KEYS[1], 'tok') == 1 then
    redis.call('HDEL', KEYS[1], 'turn', 'until')
  else
    redis.call('DEL', KEYS[1])
  end
end
return 0
"""


class SessionStoreError(RuntimeError):
    """The shared session store could not be reached or answered wrongly (the turn then starts at 0)."""


def _pack(tokens: Sequence[int]) -> bytes | None:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**31):
        return None  # (no tokenizer has such ids; such a history is not kept)
    return arr.astype("<i4").tobytes()


class RedisSessionStore:
    """Route sessions in Redis, shared by every server pointed at it (see the module docstring)."""

    remote = True  # (the server calls it off its event loop)

    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        model: str,
        max_sessions: int = 4096,
        max_tokens: int = 64 * 1024 * 1024,
        ttl: float = DEFAULT_TTL,
        turn_lease: float = DEFAULT_TURN_LEASE,
        timeout: float = 5.0,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        import redis

        if max_sessions <= 0 or max_tokens <= 0:
            raise ValueError(f"max_sessions and max_tokens must be positive, got {max_sessions}, {max_tokens}")
        if not ttl > 0 or not turn_lease > 0 or not timeout > 0:
            raise ValueError(f"ttl, turn_lease and timeout must be positive seconds, got {ttl}, {turn_lease}, {timeout}")
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"session namespace must be non-empty without braces, got {namespace!r}")
        url, username, password = resolve_credentials(url, username=username, password=password)
        self.url = url  # (without credentials)
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.ttl = ttl
        self.turn_lease = turn_lease
        self._prefix = f"auxout:sessions:{{{namespace}}}:{model}:"
        self._index = [self._prefix + "lru", self._prefix + "len", self._prefix + "total"]
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError,)
        self._client: Any = redis.Redis.from_url(
            url, username=username, password=password, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self._begin = self._client.register_script(_BEGIN)
        self._commit = self._client.register_script(_COMMIT)
        self._release = self._client.register_script(_RELEASE)
        self._seen: dict[str, dict[str, Any]] = {}  # turn -> what begin read (version, rows)
        self._lock = threading.Lock()

    def _key(self, session: str) -> str:
        return self._prefix + "s:" + session

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._errors as exc:
            raise SessionStoreError(f"route session store {redact(self.url)} could not {what}: {type(exc).__name__}: "
                                    f"{redact(str(exc))}") from None  # fmt: skip

    @staticmethod
    def _state(tok: bytes, rows: bytes) -> tuple[np.ndarray, dict[str, int]]:
        tokens = np.frombuffer(tok, dtype="<i4").astype(np.int64)
        return tokens, ({str(k): int(v) for k, v in json.loads(rows).items()} if rows else {})

    def starts_for(self, session: str, prompt: Sequence[int], arrays: Collection[str] = (), *,
                   weights_version: str = "") -> dict[str, int]:  # fmt: skip
        """Per array, the first row this session's client lacks for ``prompt`` (no claim)."""
        tok, rows, wv = self._call("read a session", self._client.hmget, self._key(session), "tok", "rows", "wv")
        if tok is None:
            return from_zero(arrays)
        tokens, held = self._state(tok, rows or b"")
        return starts_from(tokens, held, prompt, arrays, (wv or b"").decode() == weights_version)

    def begin(self, session: str, prompt: Sequence[int], arrays: Collection[str] = (), *, turn: str,
              weights_version: str = "") -> dict[str, int]:  # fmt: skip
        """``starts_for``, claiming the session for ``turn`` (``SessionBusyError`` while another
        turn holds it), atomically on the Redis server."""
        reply = self._call("claim a session", self._begin, keys=[self._key(session)],
                           args=[turn, int(self.turn_lease * 1000), int(self.ttl * 1000)])  # fmt: skip
        if int(reply[0]) == 0:
            raise SessionBusyError(session, int(reply[1]) / 1000)
        tok, rows, ver, wv = reply[1], reply[2], int(reply[3]), reply[4]
        tokens, held = self._state(tok, rows) if tok else (np.zeros(0, np.int64), {})
        with self._lock:
            self._seen[turn] = {"ver": ver, "rows": held}
        if not tok:
            return from_zero(arrays)
        return starts_from(tokens, held, prompt, arrays, (wv or b"").decode() == weights_version)

    def release(self, session: str, turn: str) -> None:
        """End ``turn``'s claim without advancing the session."""
        with self._lock:
            self._seen.pop(turn, None)
        self._call("release a session", self._release, keys=[self._key(session)], args=[turn])

    def delivered(
        self, session: str, tokens: Sequence[int], *, start: int = 0, arrays: Collection[str] = (),
        turn: str | None = None, weights_version: str = "",
    ) -> None:  # fmt: skip
        """Record a finished turn (as ``SessionStore.delivered``): only while ``turn``'s claim holds,
        or nobody advanced the session since ``begin``; ``turn=None`` records unconditionally."""
        with self._lock:
            seen = self._seen.pop(turn, None) if turn is not None else None
        packed = _pack(tokens)
        keep = packed is not None and len(tokens) <= self.max_tokens
        if turn is None:
            old = self._call("read a session", self._client.hget, self._key(session), "rows")
            held = self._state(b"", old)[1] if old else None
            ver_seen = 0
        else:
            held = None if seen is None else seen["rows"]
            ver_seen = -1 if seen is None else int(seen["ver"])
        rows = rows_after(held, len(tokens), start, arrays)
        self._call("record a session turn", self._commit, keys=[self._key(session), *self._index], args=[
            turn or "", ver_seen, packed if keep else b"", json.dumps(rows), len(tokens) if keep else -1,
            int(self.ttl * 1000), self.max_sessions, self.max_tokens, session, self._prefix + "s:", weights_version,
        ])  # fmt: skip

    def forget(self, session: str) -> None:
        self._call("forget a session", self._commit, keys=[self._key(session), *self._index], args=[
            "", 0, b"", "{}", -1, int(self.ttl * 1000), self.max_sessions, self.max_tokens, session,
            self._prefix + "s:", "",
        ])  # fmt: skip

    def __len__(self) -> int:
        return int(self._call("count sessions", self._client.zcard, self._index[0]))

    @property
    def total_tokens(self) -> int:
        return int(self._call("count session tokens", self._client.get, self._index[2]) or 0)

    def close(self) -> None:
        self._client.close()
