"""Route counters that every process of a server adds to and its API server exposes on ``/metrics``.

What an operator watches happens in three processes: the API server encodes rows and advances
sessions, the engine core's scheduler clips prefix hits (recomputes), and the worker reads and
writes the route store and refuses impossible rows. vLLM's own metrics travel as per-step
stats objects to the API server's Prometheus registry; a counter written in the worker has no
such path. So each process adds to its own file of int64 counters (one ``numpy.memmap``, one
writer per file, one lock per process), in a directory the API server creates and names in
``AUXOUT_METRICS_DIR`` before vLLM starts its engine processes (they inherit it), and the API
server's Prometheus collector sums every file at scrape time. Counters only, so a process that
exits leaves its counts in the sum (as a Prometheus counter must: it never goes down).

vLLM's registry is left as vLLM configures it (no ``PROMETHEUS_MULTIPROC_DIR``, which would turn
every vLLM metric into a multiprocess one for the sake of these). Without ``AUXOUT_METRICS_DIR``
(an offline ``LLM``, tests) the counters live in process memory and cost the same.

Names follow vLLM's (``vllm:`` prefix, ``_total`` on counters, a ``model_name`` label).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ENV_DIR = "AUXOUT_METRICS_DIR"
PREFIX = "vllm:auxout_"
BACKENDS = ("arena", "shm", "redis", "mooncake")
FORMATS = ("npy", "sglang", "packed")  # (auxout.wire.FORMATS; a test checks they agree)


@dataclass(frozen=True)
class Counter:
    name: str  # without prefix and ``_total``
    documentation: str
    labels: tuple[str, ...] = ()
    values: tuple[tuple[str, ...], ...] = ((),)  # every label-value tuple (a fixed file layout)


def _each(*sets: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    out: list[tuple[str, ...]] = [()]
    for values in sets:
        out = [(*head, v) for head in out for v in values]
    return tuple(out)


COUNTERS: tuple[Counter, ...] = (
    Counter("routed_completions", "Completions (choices) that returned routes, by output: inline rows or a "
            "keys-only manifest", ("output",), _each(("inline", "keys"))),
    Counter("inline_fallbacks", "Keys-only completions answered with inline rows (the store could not take "
            "the manifest's rows, or a weight sync split them)"),
    Counter("route_rows", "Token rows of expert ids returned, by wire format", ("format",), _each(FORMATS)),
    Counter("route_bytes", "Bytes of route fields returned (base64 text of routed_experts and routing_weights), "
            "by wire format", ("format",), _each(FORMATS)),
    Counter("recomputed_prefix_tokens", "Prefix-hit tokens recomputed because their routes were not readable"),
    Counter("store_reads", "Route objects read back from the store (a prefix hit's rows)", ("backend",),
            _each(BACKENDS)),
    Counter("store_hits", "Route objects read back and found", ("backend",), _each(BACKENDS)),
    Counter("store_misses", "Route objects read back and missing (evicted, expired, never written): the "
            "request recomputes", ("backend",), _each(BACKENDS)),
    Counter("store_evictions", "Route objects the store evicted to make room (least recently used first; "
            "arena and shm: auxout's own eviction; Redis and Mooncake evict on their servers, counted there)",
            ("backend",), _each(BACKENDS)),
    Counter("store_errors", "Store operations that failed (unreachable, timed out, full): a read makes the "
            "request recompute, a write drops that batch", ("backend", "op"), _each(BACKENDS, ("read", "write"))),
    Counter("session_turns", "Session turns delivered (routed_experts_session)"),
    Counter("session_rows_saved", "Rows a session turn did not send because the client held them "
            "(routed_experts_start of each turn)"),
    Counter("session_conflicts", "Session turns refused (409) because another turn of the session was in flight"),
    Counter("invalid_rows_refused", "Request steps whose route rows no router can produce (an id out of range, "
            "an expert twice in a row), refused and recomputed"),
)
_INDEX: dict[tuple[str, tuple[str, ...]], int] = {}
for _c in COUNTERS:
    for _v in _c.values:
        _INDEX[(_c.name, _v)] = len(_INDEX)
SIZE = len(_INDEX)
LAYOUT = hashlib.sha256(repr(sorted(_INDEX.items(), key=lambda kv: kv[1])).encode()).hexdigest()[:12]
"""Names the file layout: files of another layout (another auxout version) are never summed in."""


class Counters:
    """This process's counters: in memory, or in its own file under ``AUXOUT_METRICS_DIR``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._values: np.ndarray = np.zeros(SIZE, dtype=np.int64)

    def _open(self) -> np.ndarray:
        """The counters of this process (a fork starts its own: a parent's file has one writer)."""
        pid = os.getpid()
        if pid != self._pid:
            self._pid = pid
            directory = os.environ.get(ENV_DIR)
            self._values = _new_file(Path(directory), pid) if directory else np.zeros(SIZE, dtype=np.int64)
        return self._values

    def add(self, name: str, value: int = 1, *labels: str) -> None:
        """Add ``value`` to counter ``name`` at ``labels`` (values as listed in ``COUNTERS``)."""
        if value <= 0:
            return
        i = _INDEX[(name, labels)]
        with self._lock:
            self._open()[i] += value

    def value(self, name: str, *labels: str) -> int:
        """This process's count (tests, ``auxout_rank_state``)."""
        with self._lock:
            return int(self._open()[_INDEX[(name, labels)]])


def _new_file(directory: Path, pid: int) -> np.ndarray:
    """A zeroed counter file for this process, made whole before it becomes visible to readers."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "wb") as fh:
        fh.write(bytes(8 * SIZE))
    path = directory / f"auxout-{LAYOUT}-{pid}-{os.urandom(4).hex()}.i64"
    os.replace(tmp, path)
    return np.memmap(path, dtype=np.int64, mode="r+", shape=(SIZE,))


COUNTS = Counters()
"""The process's counters (``auxout.metrics.COUNTS.add(...)``)."""


def store_backend(store: Any) -> str:
    """The backend label of a store (wrappers unwrapped): one of ``BACKENDS``."""
    seen = 0
    while store is not None and seen < 8:
        name = type(store).__name__
        if name == "ArenaStore":
            return "arena"
        if name in ("SharedMemoryStore", "ReadThroughStore"):
            return "shm"
        if name == "RedisStore":
            return "redis"
        if name == "MooncakeStore":
            return "mooncake"
        store = getattr(store, "inner", None)
        seen += 1
    return "arena"


def totals(directory: str | os.PathLike[str]) -> np.ndarray:
    """The sum over every process's counter file in ``directory`` (files of another layout skipped)."""
    total = np.zeros(SIZE, dtype=np.int64)
    for path in Path(directory).glob(f"auxout-{LAYOUT}-*.i64"):
        try:
            values = np.fromfile(path, dtype=np.int64)
        except OSError:  # (removed meanwhile)
            continue
        if values.shape == (SIZE,):
            total += values
    return total


class RouteMetricsCollector:
    """A Prometheus collector of the summed counters, under vLLM-style names with ``model_name``."""

    def __init__(self, directory: str | os.PathLike[str], model_name: str) -> None:
        self.directory = directory
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        total = totals(self.directory)
        for c in COUNTERS:
            family = CounterMetricFamily(PREFIX + c.name, c.documentation, labels=["model_name", *c.labels])
            for values in c.values:
                family.add_metric([self.model_name, *values], float(total[_INDEX[(c.name, values)]]))
            yield family


def serve_metrics(model_name: str) -> str:
    """In the API server, before vLLM starts its engines: make the counter directory (removed at
    exit), name it in the environment the engine processes inherit, and register the collector
    with prometheus_client's default registry (the one vLLM's ``/metrics`` serves). Returns the
    directory."""
    import atexit
    import shutil

    from prometheus_client import REGISTRY

    directory = tempfile.mkdtemp(prefix="auxout-metrics-")
    atexit.register(shutil.rmtree, directory, True)
    os.environ[ENV_DIR] = directory
    COUNTS._pid = -1  # (this process's own counts go to the directory too)
    REGISTRY.register(RouteMetricsCollector(directory, model_name))
    return directory
