"""Route sessions: what a server already delivered to a client's conversation, so it sends only the rest.

An agent loop sends turn after turn of one conversation; each prompt repeats the history. A
session (a client-chosen id) remembers the token sequence whose routes the server delivered;
the next request's routes start at the first position the client does not have yet: the common
prefix of the new prompt and that sequence, capped at the rows delivered (the last token of a
turn was never fed to the model, so it has no row yet). An edited history or a different
conversation under the same id restarts at the first differing position.

Each per-token array is tracked on its own: the ids (``routed_experts``) and any other array a
turn may or may not carry (``routing_weights``, sent only when a turn asks). A turn sent without
weights moves the ids forward but not the weights, so the next turn that asks for weights gets
them from where the client's weights end, which may be earlier than the ids' start.

Semantics a client relies on:
- every response states ``routed_experts_start``; the client keeps its ids ``[0, start)`` and
  appends the new ones (or replaces from ``start`` on when it is smaller than what it holds);
- rows from ``routed_experts_start`` on are no longer the client's for any array (the history
  changed there, or the client already holds them): it cuts every array it holds to at most
  that many rows; a response carrying ``routing_weights`` also states ``routing_weights_start``
  (never later than ``routed_experts_start``), exactly the length of the weights the client then
  holds: it keeps ``[0, routing_weights_start)`` and appends;
- sessions are kept in memory, least recently used first out, at most ``max_sessions`` of them
  and ``max_tokens`` tokens in all; a session that expired, or any session after a server
  restart, simply starts at 0 again (the full history): nothing is ever silently missing;
- the session advances only when a request finishes with routes (errors, aborts and
  disconnected streams leave it where it was);
- a session is one sequential conversation: a turn claims its session (``begin``) until it
  finishes (``delivered``) or fails (``release``); another turn of the same session meanwhile
  is refused with :class:`SessionBusyError` (HTTP 409), since it could only be answered from
  rows the first response has not delivered yet. Branches need their own ids;
- a session remembers the weights its rows were computed with (``weights_version``: a digest
  of the weights the server runs, :mod:`auxout.vllm.server.weights_version`); a turn served with other
  weights (after a weight sync, or on a replica not yet synced) starts at 0: the client's rows of
  the history came from the other weights and are replaced whole. Turns with the same weights,
  on any replica, go on with deltas;
- this store lives in one API-server process; :class:`auxout.vllm.server.redis_sessions.RedisSessionStore`
  has the same interface over a Redis every replica shares (any replica serves any turn).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from auxout.vllm.fields import ROUTES

"""The array every session turn carries (the expert ids): the one whose start follows the history."""


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D int arrays (vectorized)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


DEFAULT_TURN_LEASE = 600.0
"""Seconds a turn may hold its session: a turn never finished (its server died mid-turn) stops
blocking the session after this long."""


class SessionBusyError(RuntimeError):
    """Another turn of this session is in flight (HTTP 409): turns of one session go one after another."""

    def __init__(self, session: str, retry_after: float | None = None) -> None:
        self.session = session
        self.retry_after = retry_after
        left = "" if retry_after is None else f" (its claim lapses within {max(retry_after, 0.0):.0f} s)"
        super().__init__(
            f"routed_experts_session {session!r:.80} has another turn in flight{left}: a session is one sequential "
            "conversation, so send its next turn after the previous response arrived (branches and retries "
            "racing the first try need their own session id, or routed_experts_prompt_start)"
        )


class RouteSessions(Protocol):
    """What the server needs of a session store (in memory: ``SessionStore``; shared by replicas:
    ``auxout.vllm.server.redis_sessions.RedisSessionStore``)."""

    def starts_for(self, session: str, prompt: Sequence[int], arrays: Collection[str] = (), *,
                   weights_version: str = "") -> dict[str, int]: ...  # fmt: skip

    def begin(self, session: str, prompt: Sequence[int], arrays: Collection[str] = (), *, turn: str,
              weights_version: str = "") -> dict[str, int]: ...  # fmt: skip

    def delivered(self, session: str, tokens: Sequence[int], *, start: int = 0, arrays: Collection[str] = (),
                  turn: str | None = None, weights_version: str = "") -> None: ...  # fmt: skip

    def release(self, session: str, turn: str) -> None: ...

    def forget(self, session: str) -> None: ...


def from_zero(arrays: Collection[str]) -> dict[str, int]:
    """Every array's start at row 0: the turn sends the whole history."""
    return {ROUTES: 0, **dict.fromkeys(arrays, 0)}


def starts_from(delivered: np.ndarray, rows: Mapping[str, int], prompt: Sequence[int],
                arrays: Collection[str], same_weights: bool = True) -> dict[str, int]:  # fmt: skip
    """Per array, the first row a client holding ``delivered`` (and ``rows`` of other arrays) lacks
    for ``prompt``: the ids where the history differs or the delivered rows end; another array's
    never later, and earlier where the client's rows of it end. Rows of other weights
    (``same_weights`` false) are none of the turn's: every array starts at 0."""
    if not same_weights:
        return from_zero(arrays)
    rows_delivered = max(len(delivered) - 1, 0)
    start = min(common_prefix_len(delivered, np.asarray(prompt, dtype=np.int64)), rows_delivered)
    return {ROUTES: start, **{name: min(start, rows.get(name, 0)) for name in arrays}}


def rows_after(old: Mapping[str, int] | None, n_tokens: int, start: int, arrays: Collection[str]) -> dict[str, int]:
    """Rows of each array other than the ids a client holds after a turn of ``n_tokens`` tokens
    sent from ``start`` with ``arrays``: those arrays to the end, every other cut at ``start``."""
    kept = {name: min(n, start) for name, n in (old or {}).items()}
    kept.update(dict.fromkeys(arrays, max(n_tokens - 1, 0)))
    kept.pop(ROUTES, None)
    return kept


@dataclass
class _Held:
    """What a session's client holds: the routes of ``tokens[:-1]``, and of other arrays the rows
    ``[0, rows[name])`` (the ids' rows are ``len(tokens) - 1``)."""

    tokens: np.ndarray
    rows: dict[str, int] = field(default_factory=dict)
    weights_version: str = ""  # (the digest of the weights the rows were computed with)


class SessionStore:
    """LRU map from session id to what its client holds, bounded in sessions and tokens."""

    def __init__(self, max_sessions: int = 4096, max_tokens: int = 64 * 1024 * 1024) -> None:
        if max_sessions <= 0 or max_tokens <= 0:
            raise ValueError(f"max_sessions and max_tokens must be positive, got {max_sessions}, {max_tokens}")
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._tokens: OrderedDict[str, _Held] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()
        self._turns: dict[str, tuple[str, float]] = {}  # session -> (turn in flight, its lease deadline)
        self.turn_lease = DEFAULT_TURN_LEASE

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def total_tokens(self) -> int:
        return self._total

    def start_for(self, session: str, prompt: Sequence[int], *, weights_version: str = "") -> int:
        """First route position this session's client lacks for ``prompt`` (0 for an unknown session)."""
        return self.starts_for(session, prompt, weights_version=weights_version)[ROUTES]

    def starts_for(self, session: str, prompt: Sequence[int], arrays: Collection[str] = (), *,
                   weights_version: str = "") -> dict[str, int]:  # fmt: skip
        """Per array (the ids, ``ROUTES``, and each of ``arrays``), the first row this session's
        client lacks for ``prompt``: the ids' start is where the history differs or the delivered
        rows end; another array's is never later, and earlier where the client's rows of it end.
        ``weights_version``: the digest of the weights this turn runs; a session recorded with others starts at 0."""
        with self._lock:
            held = self._tokens.get(session)
            if held is None:
                return from_zero(arrays)
            self._tokens.move_to_end(session)
        return starts_from(held.tokens, held.rows, prompt, arrays, held.weights_version == weights_version)

    def begin(self, session: str, prompt: Sequence[int], arrays: Collection[str] = (), *, turn: str,
              weights_version: str = "") -> dict[str, int]:  # fmt: skip
        """``starts_for``, claiming the session for ``turn`` until ``delivered`` or ``release``;
        ``SessionBusyError`` while another turn holds it (for at most ``turn_lease`` seconds)."""
        now = time.monotonic()
        with self._lock:
            held = self._turns.get(session)
            if held is not None and held[0] != turn and held[1] > now:
                raise SessionBusyError(session, held[1] - now)
            self._turns[session] = (turn, now + self.turn_lease)
        return self.starts_for(session, prompt, arrays, weights_version=weights_version)

    def release(self, session: str, turn: str) -> None:
        """End ``turn``'s claim without advancing the session (the turn failed or was aborted)."""
        with self._lock:
            if self._turns.get(session, ("",))[0] == turn:
                del self._turns[session]

    def delivered(
        self, session: str, tokens: Sequence[int], *, start: int = 0, arrays: Collection[str] = (),
        turn: str | None = None, weights_version: str = "",
    ) -> None:  # fmt: skip
        """Record a finished turn: the client now holds the ids of ``tokens[:-1]`` (prompt + output),
        sent from ``start`` (the turn's ``routed_experts_start``), and the rows of each of ``arrays``
        as far; every other array it held keeps at most ``start`` rows (the client cuts there).
        ``turn``: the claim ``begin`` made, ended here; ``weights_version``: those the turn ran."""
        arr = np.asarray(tokens, dtype=np.int64)
        with self._lock:  # (state and claim change together: the next turn sees this one's state)
            if turn is not None:
                holder = self._turns.get(session)
                if holder is not None and holder[0] != turn:  # (its lease ran out; a later turn took over)
                    return
                self._turns.pop(session, None)
            old = self._tokens.pop(session, None)
            if old is not None:
                self._total -= len(old.tokens)
            if len(arr) > self.max_tokens:  # cannot keep it: forgotten, so the next turn starts at 0
                return
            kept = rows_after(None if old is None else old.rows, len(arr), start, arrays)
            self._tokens[session] = _Held(arr, kept, weights_version)
            self._total += len(arr)
            while len(self._tokens) > self.max_sessions or self._total > self.max_tokens:
                _, gone = self._tokens.popitem(last=False)
                self._total -= len(gone.tokens)

    def forget(self, session: str) -> None:
        with self._lock:
            old = self._tokens.pop(session, None)
            if old is not None:
                self._total -= len(old.tokens)
