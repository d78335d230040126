"""Bytes on the response path per request: inline route arrays vs keys-only manifests.

Runs the multi-turn workload of `dataplane.py` (each turn's prompt = history + 256 new tokens,
full output from position 0) on `SimEngine` twice, inline and keys-only, with the same seed, and
prints what the engine hands back per request: the route array's bytes, or the manifest's JSON.
Every manifest is fetched and compared with the inline array, so the saving is not bought with
wrong data.
"""

from __future__ import annotations

import argparse

import numpy as np

from auxout.manifest import fetch
from auxout.testing import FakeMoE, SimEngine


def run(output: str, convs: int, turns: int, new: int, gen: int) -> tuple[SimEngine, dict]:
    model = FakeMoE(num_layers=48, top_k=8, num_experts=128, vocab_size=32000, seed=0)
    eng = SimEngine(model, block_size=16, max_num_batched_tokens=8192, max_num_seqs=64, num_kv_blocks=16384)
    rng = np.random.default_rng(0)
    history: dict[int, list[int]] = {}
    results = {}
    for t in range(turns):
        for c in range(convs):
            prompt = history.get(c, []) + rng.integers(0, 32000, new).tolist()
            eng.add_request(f"t{t}c{c}", prompt, gen, output=output)
        for rid, res in eng.run().items():
            assert res.error is None, res.error
            results[rid] = res
            history[int(rid.split("c")[1])] = res.tokens
    return eng, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--gen", type=int, default=8)
    a = ap.parse_args()
    _, inline = run("inline", a.convs, a.turns, a.new, a.gen)
    eng, keyed = run("keys", a.convs, a.turns, a.new, a.gen)
    inline_bytes = [r.routed_experts.nbytes for r in inline.values()]
    manifest_bytes = [len(r.manifest.to_json()) for r in keyed.values()]
    for rid, res in keyed.items():
        assert np.array_equal(fetch(res.manifest, store=eng.store), inline[rid].routed_experts), rid
    n = len(inline_bytes)
    print(f"{n} requests ({a.convs} conversations x {a.turns} turns, +{a.new} tokens/turn, full output from 0)")
    print(f"inline     : {sum(inline_bytes) / 1e6:9.2f} MB total, {np.mean(inline_bytes) / 1e3:9.1f} KB/request")
    print(f"keys-only  : {sum(manifest_bytes) / 1e6:9.3f} MB total, {np.mean(manifest_bytes) / 1e3:9.1f} KB/request")
    print(f"ratio inline/keys-only: {sum(inline_bytes) / sum(manifest_bytes):.0f}x (every manifest fetched == inline)")


if __name__ == "__main__":
    main()
