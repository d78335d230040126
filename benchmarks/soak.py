"""Soak ``auxout serve``: N concurrent clients for a set time, then the same load against plain vLLM.

The load mixes what an RL rollout fleet sends and meets: greedy and seeded sampled requests,
multi-turn continuations (prefix hits with ``routed_experts_prompt_start``), streamed requests
(``n`` of 1-2, a prompt start anywhere up to the prompt's end, routing weights half the time: each
choice's chunks stitched and checked whole), clients that hang up before the answer (disconnects)
or drop a stream after the first chunk (aborts), bad requests (must be 400) and, with
``--reset-every``, weight syncs mid-load (pause, reset the prefix cache, resume). The KV cache is
kept small (``--kv-blocks``), so long prompts preempt each other, and the route store is sized
from it, so it runs full. Every ``--check-every``-th
answer's routes are compared with transformers' full forward of the same tokens (expert sets
per token and layer).

Prints: requests by outcome, wrong routes (must be 0), failed requests (5xx or a dead
connection where none was asked for), the server's RSS over time (growth after warm-up must be
< 5%), and p50/p99 latency of completed requests with routes on vs a plain vLLM server (same
load, same seed, run afterwards for ``--off-duration``). With routes on, ``--packed-share`` of the
non-streamed completions ask ``routed_experts_format: packed`` (the rest ``npy``, decoded and checked
the same way): their p50/p99 side by side, in one run.

    python benchmarks/soak.py [--duration 600] [--clients 8] [--off-duration 120] [--reset-every 30]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from auxout.testing.servers import free_port
from auxout.wire import decode_routes


@dataclass
class Tally:
    """What the clients saw; shared by their threads."""

    outcomes: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    by_format: dict[str, list[float]] = field(default_factory=dict)  # routes-on completions, by wire format
    failures: list[str] = field(default_factory=list)
    checked: int = 0
    wrong: int = 0
    ties: int = 0  # rows that differ only at a near-tie of router logits (see RouteChecker)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, latency: float | None = None, failure: str | None = None, fmt: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if latency is not None:
                self.latencies.append(latency)
                if fmt is not None:
                    self.by_format.setdefault(fmt, []).append(latency)
            if failure is not None and len(self.failures) < 50:
                self.failures.append(failure)

    def add_check(self, wrong: int, ties: int, failure: str) -> None:
        """One answer's routes checked: ``wrong`` and near-tie rows; ``failure`` says where if any."""
        with self.lock:
            self.checked += 1
            self.wrong += wrong
            self.ties += ties
            if wrong or ties:
                self.failures.append(failure)


TIE_GAP = 1e-4
"""Router-logit distance from the k-th largest below which a differing expert is a near-tie."""


def _first_2d(out: Any) -> Any:
    """The router logits ``[tokens, experts]`` among a router module's outputs."""
    for t in out if isinstance(out, tuple | list) else (out,):
        if hasattr(t, "ndim") and t.ndim == 2 and t.is_floating_point():
            return t.detach().float().clone()
    return None


class RouteChecker:
    """transformers fp32 full forward of the served checkpoint (one at a time: it is the oracle, not the load)."""

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.lock = threading.Lock()

    def wrong_rows(self, tokens: list[int], got: np.ndarray, start: int) -> tuple[int, int, list[str]]:
        """``(wrong rows, near-tie rows, details)`` of ``got`` against the full forward.

        A row whose expert sets differ only where the full forward's router logits of the swapped
        experts lie within ``TIE_GAP`` of the k-th largest is a near-tie: the engine's batched fp32
        kernels and transformers' unbatched forward round differently, and the engine's choice is
        the route it actually computed. Anything else (a misaligned or stale row) is wrong.
        """
        import torch

        from auxout.trainer.hf import capture_routes, moe_layers

        logits: list[torch.Tensor] = []
        with self.lock:  # hooks too: a hook registered by another client thread would see this forward
            handles = [
                layer.router.register_forward_hook(lambda _m, _a, out: logits.append(_first_2d(out)))
                for layer in moe_layers(self.model)
            ]
            try:
                want = capture_routes(self.model, tokens)[start : len(tokens) - 1]
            finally:
                for h in handles:
                    h.remove()
        if got.shape != want.shape:
            return max(len(want), 1), 0, [f"shape {got.shape} != {want.shape}"]
        differs = ~(np.sort(got, -1) == np.sort(want, -1)).all(-1)  # [rows, layers]
        wrong = ties = 0
        details: list[str] = []
        replayed: np.ndarray | None = None
        for r in np.flatnonzero(differs.any(-1)).tolist():
            layers = np.flatnonzero(differs[r]).tolist()
            gaps = [_swap_gap(logits[layer][start + r] if layer < len(logits) else None, got[r, layer], want[r, layer])
                    for layer in layers]  # fmt: skip
            tie = max(gaps) < TIE_GAP
            note = ""
            if not tie:  # a near-tie in one layer changes every later layer's input: judge on the engine's path
                if replayed is None:
                    replayed = self.replayed_gaps(tokens, got, start)
                tie = float(replayed[r].max()) < TIE_GAP
                note = f"; replaying the engine's routes, gaps {[f'{g:.1e}' for g in replayed[r, layers]]}"
            ties += tie
            wrong += not tie
            details.append(
                f"position {start + r}: layers {layers} differ, logit gaps "
                f"{[f'{g:.1e}' for g in gaps]}{note} -> {'near-tie' if tie else 'WRONG'}"
            )
        return wrong, ties, details

    def replayed_gaps(self, tokens: list[int], got: np.ndarray, start: int) -> np.ndarray:
        """``[rows, layers]``: for each of the engine's rows, how far its experts are from the top-k
        of the router logits when the forward replays the engine's own routes (Rollout Routing
        Replay: every layer gets the experts the engine used). 0 where they are the top-k.

        A near-tie at one layer sends the engine and the plain full forward down different paths,
        so the plain forward cannot judge later layers of that token (or later tokens). Under
        replay each router sees the engine's path, so a right row is the top-k up to fp32
        rounding, and a misaligned or stale row still lands far from it.
        """
        import torch

        from auxout.trainer.hf import moe_layers, replay

        n = len(tokens) - 1
        routes = np.full((n, *got.shape[1:]), -1, dtype=np.int64)  # (rows before start: the router decides)
        routes[start:] = got
        logits: list[torch.Tensor] = []
        with self.lock:
            handles = [
                layer.router.register_forward_hook(lambda _m, _a, out: logits.append(_first_2d(out)))
                for layer in moe_layers(self.model)
            ]  # (before replay's own hooks: these see the router's logits, which replay leaves as they are)
            try:
                with replay(self.model, routes), torch.no_grad():
                    self.model(torch.tensor([tokens[:-1]]))
            finally:
                for h in handles:
                    h.remove()
        k = got.shape[-1]
        gaps = np.zeros(got.shape[:2])
        for layer, lg in enumerate(logits[: got.shape[1]]):
            top = torch.topk(lg[start:n], k).indices.numpy()
            for r in np.flatnonzero(~(np.sort(top, -1) == np.sort(got[:, layer], -1)).all(-1)).tolist():
                gaps[r, layer] = _swap_gap(lg[start + r], got[r, layer], top[r])
        return gaps


def _swap_gap(logits: Any, got: np.ndarray, want: np.ndarray) -> float:
    """How far the experts in one set but not the other lie from the k-th largest router logit."""
    import torch

    if logits is None:
        return float("inf")
    kth = torch.topk(logits, len(want)).values[-1]
    swapped = sorted(set(got.tolist()) ^ set(want.tolist()))
    return float((logits[swapped] - kth).abs().max())


def start_server(cmd: list[str], log: Path, port: int) -> subprocess.Popen:
    import httpx

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_SERVER_DEV_MODE": "1"}  # (--reset-every: vLLM's /pause, /reset_prefix_cache, /resume)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"server not ready in 400 s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_bytes(proc: subprocess.Popen) -> dict[str, int]:
    """Resident memory of the server's processes (API server, engine core, workers) by role, and their total."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"total": 0}
    out: dict[str, int] = {}
    for i, p in enumerate(procs):
        with contextlib.suppress(psutil.NoSuchProcess):
            role = "api" if i == 0 else p.name() or f"child{i}"
            out[role] = out.get(role, 0) + p.memory_info().rss
    out["total"] = sum(out.values())
    return out


def client_loop(
    cid: int, base: str, model: str, routes: bool, stop_at: float, args: argparse.Namespace, tally: Tally,
    checker: RouteChecker | None,
) -> None:  # fmt: skip
    """One client: a random mix of request kinds until ``stop_at``."""
    import httpx

    rng = random.Random(args.seed * 1000 + cid)
    mix = dict(item.split("=") for item in args.mix.split(","))
    kinds, weights = list(mix), [float(w) for w in mix.values()]
    history: list[int] = []  # the conversation so far (multi-turn continuations)
    n = 0
    with httpx.Client(base_url=base, timeout=300) as client:
        while time.monotonic() < stop_at:
            n += 1
            kind = rng.choices(kinds, weights=weights)[0]
            if kind == "turn" and history and len(history) < 700:
                prompt = history + [rng.randrange(3, 1000) for _ in range(rng.randint(5, 40))]
                start = len(history) - 1
            else:
                prompt = [rng.randrange(3, 1000) for _ in range(rng.choice([24, 64, 150, 300, 480]))]
                start = 0
                kind = "greedy" if kind == "turn" else kind
            body: dict[str, Any] = {
                "model": model, "prompt": prompt, "max_tokens": rng.choice([8, 16, 32]), "ignore_eos": True,
                "return_token_ids": True, "temperature": 0,
            }  # fmt: skip
            if kind == "seeded":  # plain vLLM-CPU dies on seeded chunked prefills: sampled, unseeded there
                seed = rng.randrange(1 << 30)
                body.update(temperature=1.0, **({"seed": seed} if routes else {}))
            if routes and start:
                body["routed_experts_prompt_start"] = start
            fmt = "packed" if routes and rng.random() < args.packed_share else "npy"
            if fmt == "packed":
                body["routed_experts_format"] = "packed"
            t0 = time.perf_counter()
            try:
                if kind == "disconnect":
                    try:
                        client.post("/v1/completions", json=body, timeout=rng.uniform(0.02, 0.3))
                        tally.add("disconnect-late")  # answered before we hung up
                    except httpx.TimeoutException:
                        tally.add("disconnect")
                    continue
                if kind == "abort":
                    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        for _ in r.iter_lines():
                            break
                    tally.add("abort")
                    continue
                if kind == "stream":
                    stream_request(client, body, routes, rng, prompt, tally, checker if n % args.check_every == 0 else None)
                    continue
                if kind == "bad":
                    bad = rng.choice([
                        {"routed_experts_prompt_start": True}, {"prompt": [10**6]},
                        {"vllm_xargs": {"return_routed_experts": 0}}, {"routed_experts_prompt_start": "3"},
                    ])  # fmt: skip
                    if not routes:
                        bad = {"prompt": -5}
                    r = client.post("/v1/completions", json={**body, **bad})
                    ok = r.status_code == 400
                    tally.add("bad-400" if ok else "failed", failure=None if ok else f"bad {bad}: {r.status_code}")
                    continue
                r = client.post("/v1/completions", json=body)
            except httpx.HTTPError as exc:
                tally.add("failed", failure=f"{kind}: {type(exc).__name__}: {exc}")
                continue
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                tally.add("failed", failure=f"{kind}: {r.status_code} {r.text[:300]}")
                continue
            choice = r.json()["choices"][0]
            tally.add(kind, latency=dt, fmt=fmt if routes else None)
            out = list(choice["token_ids"])
            if kind == "greedy" or kind == "turn" or kind == "seeded":
                history = (prompt + out) if rng.random() < 0.7 else []
            if not routes or checker is None or n % args.check_every:
                continue
            b64 = choice.get("routed_experts")
            if b64 is None:
                tally.add("failed", failure=f"{kind}: no routes in a 200 answer")
                continue
            got = decode_routes(choice) if fmt == "packed" else np.load(io.BytesIO(base64.b64decode(b64)))
            bad_rows, tie_rows, details = checker.wrong_rows(prompt + out, got, start)
            if bad_rows and args.dump is not None:
                args.dump.mkdir(parents=True, exist_ok=True)
                case = {"kind": kind, "body": body, "choice": choice, "details": details}
                (args.dump / f"case-{cid}-{n}.json").write_text(json.dumps(case))
            tally.add_check(bad_rows, tie_rows, f"{kind}: {bad_rows} wrong and {tie_rows} near-tie route rows "
                            f"(prompt {len(prompt)}, start {start}): " + "; ".join(details[:4]))  # fmt: skip


def stream_request(
    client: Any, body: dict[str, Any], routes: bool, rng: random.Random, prompt: list[int], tally: Tally,
    checker: RouteChecker | None,
) -> None:  # fmt: skip
    """A streamed request with n of 1-2 (sampled), a prompt start anywhere up to the prompt's end
    and, half the time, routing weights: each choice's chunks are stitched and checked whole."""
    from auxout.wire import decode_routes

    n = rng.choice([1, 2])
    body = {**body, "stream": True, "n": n}
    if n > 1:
        body.update(temperature=1.0, **({"seed": rng.randrange(1 << 30)} if routes else {}))
    start = 0
    if routes:
        start = rng.choice([0, rng.randint(0, len(prompt)), len(prompt)])
        body["routed_experts_prompt_start"] = start
        if rng.random() < 0.5:
            body["return_routing_weights"] = True
    t0 = time.perf_counter()
    choices: dict[int, dict[str, Any]] = {i: {"out": [], "ids": [], "w": [], "next": None, "end": None} for i in range(n)}
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            tally.add("failed", failure=f"stream: {r.status_code} {r.read()[:300]!r}")
            return
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                tally.add("failed", failure=f"stream: error event {event['error']}")
                return
            for c in event.get("choices", []):
                d = choices[c["index"]]
                d["out"] += c.get("token_ids") or []
                if c.get("routed_experts") is not None:
                    if d["next"] is not None and c["routed_experts_start"] != d["next"]:
                        tally.add("failed", failure=f"stream: rows at {c['routed_experts_start']}, expected {d['next']}")
                        return
                    rows = decode_routes(c)
                    d["ids"].append(rows)
                    d["next"] = c["routed_experts_start"] + len(rows)
                    if body.get("return_routing_weights"):
                        d["w"].append(decode_routes(c, "routing_weights"))
                d["end"] = c.get("finish_reason") or d["end"]
    tally.add("stream", latency=time.perf_counter() - t0)
    for i, d in choices.items():
        if d["end"] is None:
            tally.add("failed", failure=f"stream: choice {i} never finished")
            continue
        if not routes:
            continue
        ids = np.concatenate(d["ids"]) if d["ids"] else np.zeros((0, 0, 0), np.uint8)
        tokens = prompt + d["out"]
        if len(ids) != max(len(tokens) - 1 - start, 0):
            tally.add("failed", failure=f"stream: {len(ids)} rows for {len(tokens)} tokens from {start}")
            continue
        if body.get("return_routing_weights"):
            w = np.concatenate(d["w"]) if d["w"] else np.zeros((0,), np.float32)
            if w.shape != ids.shape or not np.isfinite(w).all():
                tally.add("failed", failure=f"stream: weights {w.shape} for ids {ids.shape}")
                continue
        if checker is None or not len(ids):
            continue
        bad_rows, tie_rows, details = checker.wrong_rows(tokens, ids, start)
        tally.add_check(bad_rows, tie_rows, f"stream: {bad_rows} wrong and {tie_rows} near-tie route rows "
                        f"(prompt {len(prompt)}, start {start}): " + "; ".join(details[:4]))  # fmt: skip


def resetter(base: str, every: float, stop_at: float, tally: Tally) -> None:
    """A weight sync every ``every`` seconds, as an RL trainer does it through vLLM's dev API:
    pause (keep requests), reset the prefix cache with the running requests, resume."""
    import httpx

    with httpx.Client(base_url=base, timeout=120) as client:
        while time.monotonic() + every < stop_at:
            time.sleep(every)
            for path, params in (("/pause", {"mode": "keep", "clear_cache": "false"}),
                                 ("/reset_prefix_cache", {"reset_running_requests": "true"}), ("/resume", {})):
                r = client.post(path, params=params)
                if r.status_code != 200:
                    tally.add("failed", failure=f"reset: {path} answered {r.status_code} {r.text[:200]}")
                    break
            else:
                tally.add("weight-sync")


def run_phase(
    name: str, cmd: list[str], port: int, model: str, routes: bool, duration: float, args: argparse.Namespace,
    checker: RouteChecker | None, log: Path,
) -> tuple[Tally, list[tuple[float, dict[str, int]]]]:  # fmt: skip
    proc = start_server(cmd, log, port)
    tally = Tally()
    samples: list[tuple[float, dict[str, int]]] = []
    t_start = time.monotonic()
    stop_at = t_start + duration
    threads = [
        threading.Thread(
            target=client_loop,
            args=(c, f"http://127.0.0.1:{port}", model, routes, stop_at, args, tally, checker),
            daemon=True,
        )
        for c in range(args.clients)
    ]
    if args.reset_every:
        threads.append(threading.Thread(
            target=resetter, args=(f"http://127.0.0.1:{port}", args.reset_every, stop_at, tally), daemon=True,
        ))  # fmt: skip
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        samples.append((time.monotonic() - t_start, rss_bytes(proc)))
        if proc.poll() is not None:
            tally.add("failed", failure=f"{name}: server died with {proc.returncode}")
            break
        time.sleep(args.rss_every)
    for t in threads:
        t.join(timeout=330)
    alive = proc.poll() is None
    stop(proc)
    if not alive:
        print(f"[{name}] SERVER DIED; log tail:\n{log.read_text()[-3000:]}")
    return tally, samples


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def report(name: str, tally: Tally, samples: list[tuple[float, dict[str, int]]], duration: float) -> float | None:
    total = sum(tally.outcomes.values())
    print(f"\n== {name}: {total} requests in {duration:.0f} s ({total / duration:.1f}/s)")
    print("   outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items())))
    print(
        f"   routes checked against transformers: {tally.checked}, wrong route rows: {tally.wrong}, "
        f"near-tie rows (router logits within {TIE_GAP:g} of the k-th; the engine's own choice): {tally.ties}"
    )
    print(f"   failed requests: {tally.outcomes.get('failed', 0)}")
    for f in tally.failures[:10]:
        print(f"     - {f}")
    print(f"   latency of completed requests: p50 {pct(tally.latencies, 50):.3f} s, p99 {pct(tally.latencies, 99):.3f} s")
    if "packed" in tally.by_format and "npy" in tally.by_format:
        npy, packed = tally.by_format["npy"], tally.by_format["packed"]
        print(f"   non-streamed completions by route format: npy {len(npy)} (p50 {pct(npy, 50):.3f} s, p99 "
              f"{pct(npy, 99):.3f} s), packed {len(packed)} (p50 {pct(packed, 50):.3f} s, p99 {pct(packed, 99):.3f} s); "
              f"packed/npy p99 {pct(packed, 99) / pct(npy, 99):.3f} (target <= 1.1)")
    warm = [(t, r) for t, r in samples if t >= duration * 0.25]
    if len(warm) < 4:
        return None
    step = max(1, len(samples) // 12)
    print("   RSS total (MiB) over time: " + ", ".join(f"{t:.0f}s {r['total'] / 2**20:.0f}" for t, r in samples[::step]))
    k = max(1, len(warm) // 10)
    growth = 0.0
    for role in warm[-1][1]:
        base = float(np.median([r.get(role, 0) for _, r in warm[:k]]))
        end = float(np.median([r.get(role, 0) for _, r in warm[-k:]]))
        if base > 0:
            print(f"   RSS {role} after warm-up (25%): {base / 2**20:.0f} -> {end / 2**20:.0f} MiB ({(end / base - 1) * 100:+.2f}%)")
            if role == "total":
                growth = end / base - 1
    print(f"   RSS growth after warm-up: {growth * 100:+.2f}%  (must be < 5%)")
    return growth


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600, help="seconds of load with routes on (default 600)")
    p.add_argument("--off-duration", type=float, default=None, help="seconds against plain vLLM (default duration/4)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--arch", default="qwen3_moe")
    p.add_argument("--kv-blocks", type=int, default=64, help="KV cache blocks of 32 tokens (preemption pressure)")
    p.add_argument("--check-every", type=int, default=3, help="check every Nth answer's routes per client")
    p.add_argument("--rss-every", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mix", default="greedy=25,seeded=15,turn=20,stream=15,disconnect=8,abort=8,bad=4",
        help="request kinds and their weights",
    )  # fmt: skip
    p.add_argument("--packed-share", type=float, default=0.5,
                   help="share of non-streamed completions asking routed_experts_format=packed (the rest npy)")
    p.add_argument("--reset-every", type=float, default=0, help="a weight sync (pause, reset, resume) every S seconds")
    p.add_argument("--dump", type=Path, default=None, help="write each mismatching answer here (JSON) to replay it")
    args = p.parse_args()
    off_duration = args.duration / 4 if args.off_duration is None else args.off_duration

    from auxout.testing.models import build_tiny_moe

    path = build_tiny_moe(args.arch)
    common = [
        "--host", "127.0.0.1", "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
        "--block-size", "32", "--max-model-len", "1024", "--max-num-batched-tokens", "256",
        "--max-num-seqs", "8", "--num-gpu-blocks-override", str(args.kv_blocks), "--seed", "0",
        "--disable-uvicorn-access-log", "--enable-prefix-caching", "--no-async-scheduling",
    ]  # fmt: skip
    checker = RouteChecker(path)
    logdir = Path(tempfile.mkdtemp(prefix="auxout-soak-"))
    results = {}
    for name, routes, duration in (("routes on (auxout serve)", True, args.duration), ("routes off (plain vLLM)", False, off_duration)):
        if duration <= 0:
            continue
        port = free_port()
        if routes:
            cmd = [sys.executable, "-m", "auxout.cli", "serve", path, "--port", str(port), *common,
                   "--auxout-routing-weights", "true"]
        else:
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port), *common]
        print(f"[{name}] {duration:.0f} s, {args.clients} clients, log {logdir}")
        tally, samples = run_phase(name, cmd, port, path, routes, duration, args, checker if routes else None, logdir / f"{routes}.log")
        growth = report(name, tally, samples, duration)
        results[routes] = (tally, growth)
    if True in results and False in results:
        on, off = results[True][0].latencies, results[False][0].latencies
        print(
            f"\nlatency ratio on/off: p50 {pct(on, 50) / pct(off, 50):.3f}, p99 {pct(on, 99) / pct(off, 99):.3f}"
        )
    on_tally, growth = results.get(True, (Tally(), None))
    verdict = on_tally.wrong == 0 and on_tally.outcomes.get("failed", 0) == 0 and (growth is None or growth < 0.05)
    print(f"\nverdict: {'PASS' if verdict else 'FAIL'} (wrong routes 0, failed requests 0, RSS growth < 5%)")
    return 0 if verdict else 1


if __name__ == "__main__":
    raise SystemExit(main())
