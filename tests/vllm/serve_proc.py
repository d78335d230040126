"""Start ``auxout serve`` as a real subprocess on 127.0.0.1 for a test module, and stop it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from auxout.testing.servers import free_port

__all__ = ["auxout_server", "auxout_servers", "free_port", "vllm_router"]


@contextmanager
def auxout_server(
    model_path: str, args: Sequence[str], log: Path, ready_s: float = 420, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yield ``(base_url, process)`` once ``/health`` answers 200; raise with the log's tail if it does not.

    ``env``: extra environment variables for the server (e.g. ``AUXOUT_VLLM_OPTIONS``).
    """
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "auxout.cli", "serve", model_path, "--host", "127.0.0.1", "--port", str(port), *args]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {ready_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def auxout_servers(
    model_path: str, specs: Sequence[tuple[Sequence[str], Path, dict[str, str] | None]], ready_s: float = 600
) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """Several ``auxout serve`` processes started at once (``specs``: args, log, env of each), yielded
    as ``[(base_url, process), ...]`` once every one answers ``/health``; all stopped on exit."""
    import threading
    from contextlib import ExitStack

    results: list[tuple[str, subprocess.Popen] | BaseException | None] = [None] * len(specs)
    stops = [threading.Event() for _ in specs]
    ready = [threading.Event() for _ in specs]

    def run(i: int) -> None:
        args, log, env = specs[i]
        try:
            with auxout_server(model_path, args, log, ready_s, env) as started:
                results[i] = started
                ready[i].set()
                stops[i].wait()
        except BaseException as exc:  # noqa: BLE001 - reported in the caller's thread
            results[i] = exc
            ready[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(specs))]
    with ExitStack() as stack:
        for i, t in enumerate(threads):
            t.start()
            stack.callback(t.join, 60)
            stack.callback(stops[i].set)
        for event in ready:
            event.wait()
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        yield [r for r in results if isinstance(r, tuple)]


@contextmanager
def vllm_router(args: Sequence[str], log: Path, *, timeout: float = 120) -> Iterator[str]:
    """``vllm-router`` on a free port with ``args`` (workers and policy, or P/D mode); yields its URL
    once ``/health`` answers, stops it on exit."""
    import shutil

    import httpx

    binary = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    port = free_port()
    with open(log, "wb") as fh:
        proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), *args], stdout=fh,
                                stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
