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
- a session is one sequential conversation: the client holds what every earlier response of
  it carried, so concurrent requests on one session (branches, a retry racing the first try)
  may be answered from rows only the other response carried: branches need their own ids;
- sessions belong to one API-server process: with several (``--api-server-count``), send a
  session's turns to the same one, or use ``routed_experts_prompt_start``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

ROUTES = "routed_experts"
"""The array every session turn carries (the expert ids): the one whose start follows the history."""


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D int arrays (vectorized)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class _Held:
    """What a session's client holds: the routes of ``tokens[:-1]``, and of other arrays the rows
    ``[0, rows[name])`` (the ids' rows are ``len(tokens) - 1``)."""

    tokens: np.ndarray
    rows: dict[str, int] = field(default_factory=dict)


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

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def total_tokens(self) -> int:
        return self._total

    def start_for(self, session: str, prompt: Sequence[int]) -> int:
        """First route position this session's client lacks for ``prompt`` (0 for an unknown session)."""
        return self.starts_for(session, prompt)[ROUTES]

    def starts_for(self, session: str, prompt: Sequence[int], arrays: Collection[str] = ()) -> dict[str, int]:
        """Per array (the ids, ``ROUTES``, and each of ``arrays``), the first row this session's
        client lacks for ``prompt``: the ids' start is where the history differs or the delivered
        rows end; another array's is never later, and earlier where the client's rows of it end."""
        with self._lock:
            held = self._tokens.get(session)
            if held is None:
                return {ROUTES: 0, **dict.fromkeys(arrays, 0)}
            self._tokens.move_to_end(session)
        delivered = held.tokens
        rows_delivered = max(len(delivered) - 1, 0)
        start = min(common_prefix_len(delivered, np.asarray(prompt, dtype=np.int64)), rows_delivered)
        return {ROUTES: start, **{name: min(start, held.rows.get(name, 0)) for name in arrays}}

    def delivered(
        self, session: str, tokens: Sequence[int], *, start: int = 0, arrays: Collection[str] = ()
    ) -> None:
        """Record a finished turn: the client now holds the ids of ``tokens[:-1]`` (prompt + output),
        sent from ``start`` (the turn's ``routed_experts_start``), and the rows of each of ``arrays``
        as far; every other array it held keeps at most ``start`` rows (the client cuts there)."""
        arr = np.asarray(tokens, dtype=np.int64)
        if len(arr) > self.max_tokens:  # cannot keep it: forget, so the next turn starts at 0
            self.forget(session)
            return
        rows = max(len(arr) - 1, 0)
        with self._lock:
            old = self._tokens.pop(session, None)
            kept: dict[str, int] = {}
            if old is not None:
                self._total -= len(old.tokens)
                kept = {name: min(n, start) for name, n in old.rows.items()}
            kept.update(dict.fromkeys(arrays, rows))
            kept.pop(ROUTES, None)
            self._tokens[session] = _Held(arr, kept)
            self._total += len(arr)
            while len(self._tokens) > self.max_sessions or self._total > self.max_tokens:
                _, gone = self._tokens.popitem(last=False)
                self._total -= len(gone.tokens)

    def forget(self, session: str) -> None:
        with self._lock:
            old = self._tokens.pop(session, None)
            if old is not None:
                self._total -= len(old.tokens)
