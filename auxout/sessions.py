"""Route sessions: what a server already delivered to a client's conversation, so it sends only the rest.

An agent loop sends turn after turn of one conversation; each prompt repeats the history. A
session (a client-chosen id) remembers the token sequence whose routes the server delivered;
the next request's routes start at the first position the client does not have yet: the common
prefix of the new prompt and that sequence, capped at the rows delivered (the last token of a
turn was never fed to the model, so it has no row yet). An edited history or a different
conversation under the same id restarts at the first differing position.

Semantics a client relies on:
- every response states ``routed_experts_start``; the client keeps its rows ``[0, start)`` and
  appends the new ones (or replaces from ``start`` on when it is smaller than what it holds);
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
from collections.abc import Sequence

import numpy as np


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D int arrays (vectorized)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class SessionStore:
    """LRU map from session id to the delivered token sequence, bounded in sessions and tokens."""

    def __init__(self, max_sessions: int = 4096, max_tokens: int = 64 * 1024 * 1024) -> None:
        if max_sessions <= 0 or max_tokens <= 0:
            raise ValueError(f"max_sessions and max_tokens must be positive, got {max_sessions}, {max_tokens}")
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._tokens: OrderedDict[str, np.ndarray] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def total_tokens(self) -> int:
        return self._total

    def start_for(self, session: str, prompt: Sequence[int]) -> int:
        """First route position this session's client lacks for ``prompt`` (0 for an unknown session)."""
        with self._lock:
            delivered = self._tokens.get(session)
            if delivered is None:
                return 0
            self._tokens.move_to_end(session)
        rows_delivered = max(len(delivered) - 1, 0)
        return min(common_prefix_len(delivered, np.asarray(prompt, dtype=np.int64)), rows_delivered)

    def delivered(self, session: str, tokens: Sequence[int]) -> None:
        """Record that the client now holds the routes of ``tokens[:-1]`` (prompt + output)."""
        arr = np.asarray(tokens, dtype=np.int64)
        if len(arr) > self.max_tokens:  # cannot keep it: forget, so the next turn starts at 0
            self.forget(session)
            return
        with self._lock:
            old = self._tokens.pop(session, None)
            if old is not None:
                self._total -= len(old)
            self._tokens[session] = arr
            self._total += len(arr)
            while len(self._tokens) > self.max_sessions or self._total > self.max_tokens:
                _, gone = self._tokens.popitem(last=False)
                self._total -= len(gone)

    def forget(self, session: str) -> None:
        with self._lock:
            old = self._tokens.pop(session, None)
            if old is not None:
                self._total -= len(old)
