"""Bytes on the wire and client decode time per turn of a 6-turn conversation, per mode and format.

The conversation: each turn adds 64 tokens of new text to the prompt and generates 256. Modes:
``full`` (every response carries the whole history's routes), ``prompt_start`` (the client
states where its rows end), ``session`` (the server remembers: same rows as prompt_start, no
client bookkeeping), ``session+w`` (the same rows with their routing weights,
``return_routing_weights``), ``keys`` (a route manifest; the rows stay in the store). Each inline mode is
measured in every wire format of :mod:`auxout.wire` (the base64 text the response carries, plus
its metadata fields). Profiles: the tiny Qwen3-MoE test model (2 MoE layers, top-4 of 16) with
the routes transformers computes for it, and a Qwen3-30B-A3B shape (48 layers, top-8 of 128) on
synthetic uniform routes (the worst case for compression). The baseline for every ratio is
``full`` + ``npy`` (what vLLM returns today), measured in the same run.

Then ``packed`` against ``npy`` for one 320-row delta at the Qwen3-30B-A3B shape, encode and
decode, the two formats interleaved (ABBA) over ``--rounds`` rounds: the median per-round ratio
and its 10th-90th percentile spread, for uniform routes and for skewed ones (where DEFLATE runs).

    python benchmarks/wire.py [--repeats 20] [--rounds 41] [--ratio-only]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

import numpy as np

from auxout.manifest import RouteManifest
from auxout.wire import FORMATS, decode_routes, encode

TURNS = 6
NEW_TEXT = 64
GENERATED = 256
BLOCK = 16
MODES = ("full", "prompt_start", "session", "session+w", "keys")


def tiny_routes(total: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Routes and routing weights of the tiny Qwen3-MoE test model over ``total`` tokens
    (transformers full forward: its routers' own top-k ids and combine weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from auxout.testing.models import build_tiny_moe

    model = AutoModelForCausalLM.from_pretrained(build_tiny_moe("qwen3_moe"), dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(3, 1000, size=total).tolist()
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [r.register_forward_hook(lambda mod, a, out: outs.append((out[2].clone(), out[1].clone()))) for r in routers]
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]), use_cache=False)
    for h in hooks:
        h.remove()
    ids = torch.stack([i for i, _ in outs], dim=1).numpy().astype(np.uint8)
    weights = torch.stack([w for _, w in outs], dim=1).float().numpy()
    return ids, weights, 16


def synthetic_routes(
    total: int, layers: int = 48, top_k: int = 8, experts: int = 128
) -> tuple[np.ndarray, np.ndarray, int]:
    """Uniform random routes; weights: softmax of normal logits over the top-k, renormalized."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((total, layers, experts), dtype=np.float32)
    ids = np.argsort(-logits, axis=-1)[..., :top_k]
    top = np.exp(np.take_along_axis(logits, ids, axis=-1))
    return ids.astype(np.uint8), (top / top.sum(-1, keepdims=True)).astype(np.float32), experts


def manifest_bytes(start: int, num_rows: int, shape: tuple[int, ...]) -> int:
    offset = start % BLOCK
    keys = max(1, math.ceil((offset + num_rows) / BLOCK))
    last = offset + num_rows - (keys - 1) * BLOCK
    m = RouteManifest(
        tuple(f"auxout/r3/local/g0/{i:032x}" for i in range(keys)), start - offset, num_rows, offset, last, BLOCK,
        shape, "|u1", "redis://127.0.0.1:6379",
    )  # fmt: skip
    return len(json.dumps({"routed_experts_manifest": m.to_dict()}, separators=(",", ":")))


def payload_bytes(fields: dict[str, Any]) -> int:
    return len(json.dumps(fields, separators=(",", ":")))


def run(name: str, routes: np.ndarray, weights: np.ndarray, experts: int, repeats: int) -> list[dict[str, Any]]:
    rows_out = []
    prompt = 0
    for turn in range(TURNS):
        prompt += NEW_TEXT
        end = prompt + GENERATED - 1  # rows of prompt + output (the last token has no row yet)
        start = max(prompt - NEW_TEXT - 1, 0) if turn else 0
        for mode in MODES:
            first = 0 if mode == "full" else start
            rows = routes[first:end]
            w = weights[first:end] if mode == "session+w" else None
            if mode == "keys":
                rows_out.append({"profile": name, "turn": turn + 1, "mode": mode, "format": "-",
                                 "bytes": manifest_bytes(first, len(rows), routes.shape[1:]), "decode_us": 0.0,
                                 "encode_us": 0.0})
                continue
            for fmt in FORMATS:
                enc = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fields = encode(rows, fmt, num_experts=experts)
                    if w is not None:
                        fields.update(encode(w, fmt, name="routing_weights"))
                    enc.append(time.perf_counter() - t0)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    got = decode_routes(fields)
                    got_w = decode_routes(fields, "routing_weights") if w is not None else None
                    times.append(time.perf_counter() - t0)
                assert got is not None and np.array_equal(got, rows)
                assert w is None or np.array_equal(got_w, w)
                rows_out.append({"profile": name, "turn": turn + 1, "mode": mode, "format": fmt,
                                 "bytes": payload_bytes(fields), "decode_us": statistics.median(times) * 1e6,
                                 "encode_us": statistics.median(enc) * 1e6})
        prompt += GENERATED
    return rows_out


def summarize(results: list[dict[str, Any]]) -> None:
    for profile in dict.fromkeys(r["profile"] for r in results):
        sel = [r for r in results if r["profile"] == profile]
        base = sum(r["bytes"] for r in sel if r["mode"] == "full" and r["format"] == "npy")
        print(f"\n## {profile}: 6 turns, bytes summed over turns (ratio to full+npy), client decode and server encode per turn (medians)")
        print(f"{'mode':14s} {'format':8s} {'total bytes':>12s} {'ratio':>7s} {'turn-6 bytes':>12s} {'decode us/turn':>15s} {'encode us/turn':>15s}")
        for mode in MODES:
            for fmt in (*FORMATS, "-"):
                part = [r for r in sel if r["mode"] == mode and r["format"] == fmt]
                if not part:
                    continue
                total = sum(r["bytes"] for r in part)
                last = part[-1]["bytes"]
                dec = statistics.median(r["decode_us"] for r in part)
                enc = statistics.median(r["encode_us"] for r in part)
                print(f"{mode:14s} {fmt:8s} {total:12d} {total / base:7.3f} {last:12d} {dec:15.1f} {enc:15.1f}")


def _timed(fn: Any, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def packed_vs_npy(label: str, ids: np.ndarray, experts: int, rounds: int, calls: int = 20) -> None:
    """Encode and decode time of ``packed`` over ``npy`` for ``ids``, ABBA-interleaved, same run."""
    fields = {fmt: encode(ids, fmt, num_experts=experts) for fmt in ("npy", "packed")}
    for f in fields.values():
        got = decode_routes(f)
        assert got is not None and np.array_equal(got, ids)
    times: dict[tuple[str, str], list[float]] = {(op, fmt): [] for op in ("encode", "decode") for fmt in fields}
    for r in range(rounds):
        order = ("npy", "packed", "packed", "npy") if r % 2 == 0 else ("packed", "npy", "npy", "packed")
        per: dict[tuple[str, str], list[float]] = {k: [] for k in times}
        for fmt in order:
            per["encode", fmt].append(_timed(lambda f=fmt: encode(ids, f, num_experts=experts), calls))
            per["decode", fmt].append(_timed(lambda f=fmt: decode_routes(fields[f]), calls))
        for k, v in per.items():
            times[k].append(statistics.mean(v))
    print(f"\n## packed vs npy, {label}: {list(ids.shape)} {ids.dtype}, {rounds} ABBA rounds x {calls} calls")
    print(f"{'op':7s} {'npy us':>9s} {'packed us':>10s} {'ratio (median)':>15s} {'p10-p90':>13s}")
    for op in ("encode", "decode"):
        ratios = sorted(p / n for p, n in zip(times[op, "packed"], times[op, "npy"], strict=True))
        lo, hi = ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10]
        print(f"{op:7s} {statistics.median(times[op, 'npy']) * 1e6:9.1f} {statistics.median(times[op, 'packed']) * 1e6:10.1f} "
              f"{statistics.median(ratios):15.3f} {lo:6.3f}-{hi:6.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=41, help="ABBA rounds of the packed/npy ratio")
    p.add_argument("--ratio-only", action="store_true", help="only the packed/npy ratio (no conversation, no torch)")
    args = p.parse_args()
    delta = synthetic_routes(320)[0]
    skewed = np.minimum(np.random.default_rng(2).geometric(0.05, size=delta.shape) - 1, 127).astype(np.uint8)
    packed_vs_npy("Qwen3-30B-A3B shape, 320-row delta, uniform routes", delta, 128, args.rounds)
    packed_vs_npy("Qwen3-30B-A3B shape, 320-row delta, skewed routes (geometric, p=0.05)", skewed, 128, args.rounds)
    if args.ratio_only:
        return
    total = TURNS * (NEW_TEXT + GENERATED)
    results = []
    tiny, tiny_w, e = tiny_routes(total)
    results += run("tiny qwen3_moe (2 layers, top-4 of 16, real routes)", tiny, tiny_w, e, args.repeats)
    big, big_w, e = synthetic_routes(total)
    results += run("Qwen3-30B-A3B shape (48 layers, top-8 of 128, uniform synthetic)", big, big_w, e, args.repeats)
    summarize(results)


if __name__ == "__main__":
    main()
