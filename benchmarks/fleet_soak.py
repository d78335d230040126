"""Soak a fleet: two ``auxout serve`` replicas behind vllm-router, one Redis for routes and sessions, disturbed.

For ``--duration`` seconds, ``--clients`` agent loops talk through vLLM's router (``round_robin``: the
turns of one conversation alternate between the replicas). Each loop runs route sessions: a
conversation of completions whose prompts repeat the history, stitched the way a client does it
(keep its rows ``[0, routed_experts_start)``, append the new ones); a quarter of the requests are
plain completions without a session. Meanwhile:

- at 20% one replica is killed (its whole process group, SIGKILL) and started again;
- at 45% Redis restarts empty (every route object and session is gone);
- at 65% a rolling weight sync: ``POST /auxout/update_weights`` to one replica, ``--sync-gap``
  seconds later to the other, with weights changed enough to reroute tokens.

Checked on every answer: the start is where the client's rows stop being valid, or 0 (a session
lost with Redis, or a turn under other weights than its rows); never past the rows the client
holds; and the stitched rows equal transformers' full forward of the whole conversation under one
weights version (old or new: a turn that mixed the two, or a delta stitched across a sync,
matches neither). Reports requests by outcome, wrong rows (must be 0), failed requests by when
they happened (only those in flight on the killed replica, or while Redis was down, may fail),
session turns sent as deltas after each event (sessions go on), and each replica's RSS.

    python benchmarks/fleet_soak.py [--duration 600] [--clients 4] [--sync-gap 30]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from soak import RouteChecker, pct, rss_bytes

from auxout.testing.servers import HttpServer, free_port, redis_server, vllm_router_server
from auxout.vllm.server.sessions import common_prefix_len
from auxout.wire import decode_routes

MODEL = "tiny"


@dataclass
class Log:
    """What the clients saw and when (seconds since the start); shared by their threads."""

    t0: float = field(default_factory=time.monotonic)
    outcomes: Counter = field(default_factory=Counter)
    matched: Counter = field(default_factory=Counter)  # answers checked, by the weights version they equal
    failures: list[tuple[float, str]] = field(default_factory=list)
    deltas: list[float] = field(default_factory=list)  # when a session turn came as a delta (start > 0)
    restarts: list[float] = field(default_factory=list)  # when one restarted at 0 with rows held
    latencies: list[float] = field(default_factory=list)
    wrong: int = 0
    wrong_detail: list[str] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, outcome: str, failure: str | None = None, latency: float | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if failure is not None:
                self.failures.append((self.now(), failure))
            if latency is not None:
                self.latencies.append(latency)

    def event(self, name: str) -> None:
        with self.lock:
            self.events[name] = self.now()
        print(f"  [{self.now():6.1f} s] {name}", flush=True)


def make_replica(name: str, path: str, args: list[str], logdir: Path, cpu: int) -> HttpServer:
    """One ``auxout serve``, its OMP threads on core ``cpu`` (as one replica per machine), with vLLM's
    dev-mode endpoints (``/auxout/update_weights``)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpu)}  # fmt: skip
    argv = [sys.executable, "-m", "auxout.cli", "serve", path, "--port", str(port), *args]
    return HttpServer(argv=argv, port=port, log_path=str(logdir / f"{name}.log"), env=env, name=name)


def changed_weights(path: str, out: Path, seed: int) -> str:
    """The checkpoint with every weight moved (a trainer's next policy), saved where replicas read it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (p.std() if p.numel() > 1 else 0.0) * 0.5)
    model.save_pretrained(out)
    return str(out)


def client_loop(cid: int, router: str, stop_at: float, checkers: list[tuple[str, RouteChecker]], log: Log,
                seed: int) -> None:  # fmt: skip
    """One agent loop: route sessions through the router, a plain completion now and then."""
    import httpx

    rng = random.Random(seed * 1000 + cid)
    conv = 0
    tokens: list[int] = []  # the conversation so far (prompt + outputs)
    held = np.zeros((0, 0, 0), np.uint8)  # its rows, stitched
    session = ""
    with httpx.Client(base_url=router, timeout=300) as client:
        while time.monotonic() < stop_at:
            plain = rng.random() < 0.25
            if plain or not tokens or len(tokens) > 600 or rng.random() < 0.15:
                if not plain:  # a new conversation
                    conv += 1
                    session, tokens, held = f"c{cid}-{conv}", [], np.zeros((0, 0, 0), np.uint8)
                prompt = [rng.randrange(3, 1000) for _ in range(rng.choice([24, 64, 150]))]
            else:
                prompt = tokens + [rng.randrange(3, 1000) for _ in range(rng.randint(5, 40))]
            body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": rng.choice([8, 16]),
                                    "ignore_eos": True, "return_token_ids": True, "temperature": 0}  # fmt: skip
            if not plain:
                body["routed_experts_session"] = session
            t = time.perf_counter()
            try:
                r = client.post("/v1/completions", json=body)
            except httpx.HTTPError as exc:
                log.add("failed", f"{'plain' if plain else 'turn'}: {type(exc).__name__}: {exc}")
                continue
            if r.status_code == 409 and not plain:  # (a turn claimed by a killed replica: its lease runs out)
                log.add("409, retried later")
                time.sleep(2)
                continue
            if r.status_code != 200:
                log.add("failed", f"{'plain' if plain else 'turn'}: HTTP {r.status_code} {r.text[:240]}")
                continue
            latency = time.perf_counter() - t
            choice = r.json()["choices"][0]
            out, start = list(choice["token_ids"]), int(choice["routed_experts_start"])
            rows = decode_routes(choice)
            if plain:
                log.add("plain", latency=latency)
                check(log, checkers, prompt + out, rows, "plain")
                continue
            expected = min(common_prefix_len(np.array(tokens), np.array(prompt)), len(held))
            if start > expected:  # (the session advanced by a turn whose answer never arrived)
                log.add("gap: new session")
                conv += 1
                session, tokens, held = f"c{cid}-{conv}", [], np.zeros((0, 0, 0), np.uint8)
                continue
            outcome = "turn: delta" if start == expected and start > 0 else "turn: first" if expected == 0 else \
                "turn: restarted at 0"  # fmt: skip
            log.add(outcome, latency=latency)
            with log.lock:
                if start > 0:
                    log.deltas.append(log.now())
                elif expected > 0:
                    log.restarts.append(log.now())
            tokens = prompt + out
            held = np.concatenate([held[:start], rows]) if start else rows
            check(log, checkers, tokens, held, session)


def check(log: Log, checkers: list[tuple[str, RouteChecker]], tokens: list[int], rows: np.ndarray, what: str) -> None:
    """The rows must equal the full forward of ``tokens`` under one weights version, wholly."""
    details = []
    for version, checker in checkers:
        wrong, ties, detail = checker.wrong_rows(tokens, rows, 0)
        if wrong == 0:
            with log.lock:
                log.matched[version + (" (near-ties)" if ties else "")] += 1
            return
        details.append(f"{version}: {wrong} wrong rows, e.g. {detail[:2]}")
    with log.lock:
        log.wrong += 1
        if len(log.wrong_detail) < 10:
            log.wrong_detail.append(f"{what} ({len(tokens)} tokens): " + "; ".join(details))


def post_sync(replica: HttpServer, weights: str, log: Log) -> str:
    """``POST /auxout/update_weights`` to ``replica`` once it is up; its new weights version."""
    import httpx

    deadline = time.monotonic() + 600
    while not replica.healthy() and time.monotonic() < deadline:  # (a replica restarting is synced when back)
        time.sleep(1)
    try:
        r = httpx.post(replica.url + "/auxout/update_weights", json={"weights_path": weights}, timeout=600)
    except httpx.HTTPError as exc:
        log.add("failed", f"sync of {replica.name}: {type(exc).__name__}: {exc}")
        return ""
    if r.status_code != 200:
        log.add("failed", f"sync of {replica.name}: HTTP {r.status_code} {r.text[:300]}")
        return ""
    return str(r.json()["weights_version"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--sync-gap", type=float, default=30, help="seconds between syncing the first and the second replica")
    p.add_argument("--session-lease", type=float, default=20, help="--auxout-session-lease of the replicas")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from auxout.testing.models import build_tiny_moe

    path = build_tiny_moe("qwen3_moe")
    logdir = Path(tempfile.mkdtemp(prefix="auxout-fleet-soak-"))
    new_weights = changed_weights(path, logdir / "new-weights", args.seed + 1)
    checkers = [("old weights", RouteChecker(path)), ("new weights", RouteChecker(new_weights))]
    log = Log()
    with redis_server() as redis:
        store = f'{{"url": "{redis.url}/0", "namespace": "soak"}}'
        common = [
            "--host", "127.0.0.1", "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
            "--block-size", "32", "--max-model-len", "1024", "--max-num-batched-tokens", "256", "--max-num-seqs", "8",
            "--seed", "0", "--served-model-name", MODEL, "--disable-uvicorn-access-log", "--no-async-scheduling",
            "--auxout-store", "redis", "--auxout-store-options", store, "--auxout-namespace", "fleet",
            "--auxout-session-store", "redis", "--auxout-session-lease", str(args.session_lease),
        ]  # fmt: skip
        cpus = os.cpu_count() or 1
        replicas = [make_replica(name, path, common, logdir, i % cpus) for i, name in enumerate(("replica-a", "replica-b"))]
        starters = [threading.Thread(target=r.start) for r in replicas]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        router = vllm_router_server(["--policy", "round_robin", "--worker-urls", *(r.url for r in replicas),
                                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                                    str(logdir / "router.log"))  # fmt: skip
        router.start()
        print(f"fleet: {[r.url for r in replicas]} behind {router.url}, logs {logdir}")
        log.t0 = time.monotonic()
        stop_at = log.t0 + args.duration
        clients = [threading.Thread(target=client_loop, args=(c, router.url, stop_at, checkers, log, args.seed),
                                    daemon=True)
                   for c in range(args.clients)]  # fmt: skip
        for t in clients:
            t.start()
        rss: dict[str, list[tuple[float, int]]] = {r.name: [] for r in replicas}
        plan = [(0.20, "kill"), (0.45, "redis"), (0.65, "sync")]
        a, b = replicas
        try:
            while any(t.is_alive() for t in clients):
                now = log.now()
                while plan and now >= plan[0][0] * args.duration:
                    _, what = plan.pop(0)
                    if what == "kill":
                        log.event(f"{b.name} killed (SIGKILL, its process group)")
                        b.kill()
                        threading.Thread(target=lambda: (b.start(), log.event(f"{b.name} back")), daemon=True).start()
                    elif what == "redis":
                        log.event("redis restarting (empty)")
                        redis.restart()
                        log.event("redis back")
                    else:
                        def rolling() -> None:
                            log.event(f"sync {a.name}")
                            log.event(f"{a.name} on {post_sync(a, new_weights, log)}")
                            time.sleep(args.sync_gap)
                            log.event(f"sync {b.name}")
                            log.event(f"{b.name} on {post_sync(b, new_weights, log)}")

                        threading.Thread(target=rolling, daemon=True).start()
                for r in replicas:
                    if r.proc is not None and r.proc.poll() is None:
                        rss[r.name].append((now, rss_bytes(r.proc)["total"]))
                time.sleep(5)
            for t in clients:
                t.join(330)
        finally:
            router.stop()
            for r in replicas:
                r.stop()
    return report(log, rss, args.duration)


def report(log: Log, rss: dict[str, list[tuple[float, int]]], duration: float) -> int:
    total = sum(log.outcomes.values())
    print(f"\n== fleet soak: {total} requests in {duration:.0f} s through vllm-router (round_robin), 2 replicas")
    print("   events: " + ", ".join(f"{k} at {v:.0f} s" for k, v in log.events.items()))
    print("   outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(log.outcomes.items())))
    print("   answers equal to the full forward, by weights: " + ", ".join(f"{k} {v}" for k, v in sorted(log.matched.items())))
    print(f"   wrong answers (stitched rows equal to no weights version): {log.wrong}")
    for d in log.wrong_detail:
        print(f"     - {d}")
    kill = log.events.get(next((k for k in log.events if "killed" in k), ""), None)
    back = log.events.get(next((k for k in log.events if k.endswith(" back") and "redis" not in k), ""), None)
    redis_down, redis_up = log.events.get("redis restarting (empty)"), log.events.get("redis back")

    def window(t: float) -> str:
        if kill is not None and kill <= t <= kill + 10:  # (answers cut off by the kill reach clients late)
            return "in flight on the killed replica"
        if kill is not None and back is not None and kill <= t <= back:
            return "while the killed replica was down"
        if redis_down is not None and redis_up is not None and redis_down <= t <= redis_up + 5:
            return "while redis restarted"
        return "elsewhere"

    by_window = Counter(window(t) for t, _ in log.failures)
    print(f"   failed requests: {len(log.failures)} (" + ", ".join(f"{k} {v}" for k, v in by_window.items()) + ")")
    seen: set[str] = set()
    for t, f in log.failures:
        key = f[:60]
        if key not in seen and len(seen) < 8:
            seen.add(key)
            print(f"     - {t:.0f} s [{window(t)}]: {f}")
    marks = sorted(log.events.values())
    print("   session turns after each event, until the next: sent as deltas / restarted at 0 with rows held")
    for name, t in sorted(log.events.items(), key=lambda kv: kv[1]):
        nxt = next((m for m in marks if m > t), duration)
        deltas, restarts = sum(t < d <= nxt for d in log.deltas), sum(t < d <= nxt for d in log.restarts)
        print(f"     {t:5.0f} s {name}: {deltas} / {restarts}")
    print(f"   latency: p50 {pct(log.latencies, 50):.3f} s, p99 {pct(log.latencies, 99):.3f} s")
    growth_ok = True
    back = back if back is not None else duration
    for name, samples in rss.items():
        killed = name == "replica-b"  # (its second life: from a minute after it was back)
        warm = [(t, v) for t, v in samples if t >= (back + 60 if killed else duration * 0.25)]
        if len(warm) < 4:
            continue
        k = max(1, len(warm) // 10)
        first, last = float(np.median([v for _, v in warm[:k]])), float(np.median([v for _, v in warm[-k:]]))
        growth = last / first - 1
        since = "a minute after its restart" if killed else "warm-up (25%)"
        print(f"   RSS {name} after {since}: {first / 2**20:.0f} -> {last / 2**20:.0f} MiB ({growth * 100:+.2f}%)")
        growth_ok = growth_ok and growth < 0.05
    allowed = ("in flight on the killed replica", "while redis restarted")
    elsewhere = sum(n for w, n in by_window.items() if w not in allowed)
    verdict = log.wrong == 0 and elsewhere == 0 and growth_ok
    print(f"\nverdict: {'PASS' if verdict else 'FAIL'} (wrong answers 0, failures only on the killed replica or "
          "while redis restarted, RSS growth < 5%)")  # fmt: skip
    return 0 if verdict else 1


if __name__ == "__main__":
    raise SystemExit(main())
