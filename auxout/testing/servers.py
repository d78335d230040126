"""Start and stop real servers on loopback free ports, for tests and benchmarks: the stores, and
(``HttpServer``) ``auxout serve`` replicas and ``vllm-router`` for the fleet soak.

Real servers, not mocks: the Redis and Mooncake backends are only trusted when they ran against
the real daemons. Every server binds 127.0.0.1 (Mooncake also listens on 0.0.0.0 for some
ports; traffic still goes to 127.0.0.1), gets fresh free ports, is waited on until it answers,
and is killed (process group, SIGKILL fallback) on exit, including when the test body raises;
if the starting process itself is killed, the kernel kills the daemon too (PR_SET_PDEATHSIG).

    with redis_server() as srv:        # srv.url == "redis://127.0.0.1:<port>"
        ...
    with redis_server(password="pw") as srv:  # requirepass: srv.auth_url carries the password
        ...
    with mooncake_master() as m:       # m.master_addr == "127.0.0.1:<port>"
        ...

``restart()`` on either handle kills the daemon and starts it again on the same port (fault tests).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks it; a tiny reuse race remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((LOOPBACK, port)) == 0


def _die_with_parent() -> None:
    """preexec_fn: the kernel SIGKILLs the daemon when the process that started it dies, so a
    test run killed by a timeout or signal (no ``finally``) leaves no server behind. Linux only."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(proc: subprocess.Popen[bytes] | None, grace: float = 2.0) -> None:
    """Terminate the process group, then SIGKILL it if it lingers; always reaps."""
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL at once (simulates a crash)."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@dataclass
class _Server:
    argv: list[str]
    port: int
    log_path: str
    ready_timeout: float = 20.0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    env: dict[str, str] | None = field(default=None, repr=False)  # (None: this process's environment)
    poll_s: float = 0.05  # between readiness checks
    stop_grace: float = 2.0  # seconds from SIGTERM to SIGKILL
    name: str = ""  # in errors (default: the binary)

    def _ready(self) -> bool:
        return _port_open(self.port)

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        try:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread() else None,
                env=self.env,
            )
        finally:
            log.close()
        name = self.name or self.argv[0]
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: {self.log_tail()}")
            if self._ready():
                return
            time.sleep(self.poll_s)
        _stop(self.proc, self.stop_grace)
        raise RuntimeError(f"{name} not ready on port {self.port} after {self.ready_timeout}s: {self.log_tail()}")

    def stop(self) -> None:
        _stop(self.proc, self.stop_grace)

    def kill(self) -> None:
        """SIGKILL the daemon (crash simulation); ``start()`` brings it back on the same ports."""
        _kill(self.proc)

    def restart(self) -> None:
        self.kill()
        self.start()

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""


@dataclass
class RedisServer(_Server):
    password: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The server's URL, without its password."""
        return f"redis://{LOOPBACK}:{self.port}"

    @property
    def auth_url(self) -> str:
        """The server's URL with its password (``url`` when it has none)."""
        return self.url if self.password is None else f"redis://:{quote(self.password, safe='')}@{LOOPBACK}:{self.port}"


@dataclass
class HttpServer(_Server):
    """An HTTP server on 127.0.0.1 (``auxout serve``, ``vllm-router``) in its own process group
    (``kill`` takes it whole, as a lost machine); ready when ``GET /health`` answers 200.

    Its own session is also its own CPU share where the kernel schedules sessions as autogroups
    (``/proc/sys/kernel/sched_autogroup_enabled``): replicas sharing one machine compete as
    machines would. The vLLM tests start ``auxout serve`` in the test's own session instead: in
    sessions of their own the fleet tests ran about 20% slower on a 2-core machine, and their
    concurrent-turn race lost its margin.
    """

    ready_timeout: float = 600.0
    poll_s: float = 1.0
    stop_grace: float = 30.0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _ready(self) -> bool:
        return self.healthy()


@dataclass
class MooncakeMaster(_Server):
    metrics_port: int = 0

    @property
    def master_addr(self) -> str:
        return f"{LOOPBACK}:{self.port}"


def redis_binary() -> str:
    path = shutil.which("redis-server") or shutil.which("valkey-server")
    if path is None:
        raise RuntimeError("redis-server (or valkey-server) not found; run scripts/install.sh")
    return path


def mooncake_master_binary() -> str:
    """The ``mooncake_master`` shipped inside the installed mooncake wheel."""
    import mooncake

    path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"mooncake_master not found or not executable at {path}")
    return path


@contextlib.contextmanager
def redis_server(port: int | None = None, *, password: str | None = None) -> Iterator[RedisServer]:
    """A throwaway redis-server on 127.0.0.1 without persistence; killed on exit. ``password``:
    the server requires it (``requirepass``, in a config file: not on the command line)."""
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="auxout-redis-") as d:
        argv = [redis_binary()]
        if password is not None:  # (a config file: the password stays out of the process list)
            conf = os.path.join(d, "redis.conf")
            with open(conf, "w") as fh:
                fh.write(f'requirepass "{password}"\n')
            argv.append(conf)
        argv += ["--bind", LOOPBACK, "--port", str(port), "--save", "", "--appendonly", "no",
                 "--dir", d, "--protected-mode", "yes"]  # fmt: skip
        srv = RedisServer(argv=argv, port=port, log_path=os.path.join(d, "redis.log"), password=password)
        try:
            srv.start()
            yield srv
        finally:
            srv.stop()


@contextlib.contextmanager
def mooncake_master(port: int | None = None, *, lease_ttl_ms: int = 10_000) -> Iterator[MooncakeMaster]:
    """A ``mooncake_master`` on 127.0.0.1 (no HTTP metadata server: clients use P2PHANDSHAKE)."""
    port = port or free_port()
    metrics = free_port()
    with tempfile.TemporaryDirectory(prefix="auxout-mooncake-") as d:
        argv = [
            mooncake_master_binary(),
            f"--rpc_address={LOOPBACK}", f"--rpc_port={port}",
            "--enable_http_metadata_server=false",
            f"--metrics_host={LOOPBACK}", f"--metrics_port={metrics}",
            f"--default_kv_lease_ttl={lease_ttl_ms}",
            f"--log_dir={d}",
        ]
        srv = MooncakeMaster(argv=argv, port=port, log_path=os.path.join(d, "master.log"), metrics_port=metrics)
        try:
            srv.start()
            yield srv
        finally:
            srv.stop()


def vllm_router_server(args: Sequence[str], log_path: str, *, ready_timeout: float = 120) -> HttpServer:
    """``vllm-router`` on a free port with ``args`` (workers and policy, or P/D mode); not started."""
    binary = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    port = free_port()
    return HttpServer(argv=[binary, "--host", LOOPBACK, "--port", str(port), *args], port=port, log_path=log_path,
                      ready_timeout=ready_timeout, poll_s=0.5, stop_grace=10, name="vllm-router")  # fmt: skip


def pause(server: _Server) -> None:
    """SIGSTOP the daemon: it keeps its sockets open but answers nothing (hung-server fault)."""
    if server.proc is not None:
        os.killpg(server.proc.pid, signal.SIGSTOP)


def resume(server: _Server) -> None:
    if server.proc is not None:
        os.killpg(server.proc.pid, signal.SIGCONT)
