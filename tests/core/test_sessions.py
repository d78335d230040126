"""Route sessions: resume where the client's rows end or the history differs; bounded, LRU."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from auxout.sessions import SessionStore, common_prefix_len


@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.integers(0, 5), max_size=30))
def test_common_prefix_len_matches_a_loop(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_len(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)) == n


def test_start_is_rows_delivered_when_the_prompt_extends_the_history() -> None:
    s = SessionStore()
    assert s.start_for("a", [1, 2, 3]) == 0  # unknown session (new, expired, server restarted): all rows
    s.delivered("a", [1, 2, 3, 4, 5])  # rows of positions 0..3 delivered (5 has no row yet)
    assert s.start_for("a", [1, 2, 3, 4, 5, 6, 7]) == 4
    assert s.start_for("a", [1, 2, 9, 4, 5, 6]) == 2  # edited history: from the first difference
    assert s.start_for("a", [7, 7]) == 0  # another conversation under the same id
    assert s.start_for("a", [1, 2]) == 2  # a shorter prompt: never past its own length


def test_sessions_are_bounded_lru_in_count_and_tokens() -> None:
    s = SessionStore(max_sessions=2, max_tokens=10)
    s.delivered("a", [1, 2, 3])
    s.delivered("b", [1, 2, 3])
    s.start_for("a", [1, 2, 3])  # touch a: b is now least recently used
    s.delivered("c", [1, 2, 3])
    assert len(s) == 2 and s.start_for("b", [1, 2, 3, 4]) == 0 and s.start_for("a", [1, 2, 3, 4]) == 2
    s.delivered("d", list(range(9)))  # 9 + 3 > 10 tokens: the oldest goes
    assert s.total_tokens <= 10
    s.delivered("e", list(range(11)))  # larger than the whole budget: not kept, next turn starts at 0
    assert s.start_for("e", list(range(12))) == 0
    with pytest.raises(ValueError):
        SessionStore(max_sessions=0)
