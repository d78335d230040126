"""The cost of ``weights_digest`` (once per prefix-cache reset) against the plain sum it replaced.

The digest reads every element where it sits (position-weighted sums of
1024-element rows and of columns, ``_bits_digest``) instead of one wrapping sum of the bits,
which two swapped elements left unchanged. The baseline here is that plain-sum digest, measured
in the same run on the same tensors (bf16, CPU), alternating, so the ratio is what counts.

    python benchmarks/weights_digest.py --params 4 --elements 100663296 --repeats 2
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

from auxout.vllm.config import weights_digest


def plain_sum_digest(model: torch.nn.Module) -> str:
    """A plain-sum digest: samples plus the wrapping sum of each parameter's bits."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        n = flat.numel()
        h.update(f"{name}\0{tuple(p.shape)}\0{p.dtype}\0".encode())
        k = min(n, 256)
        idx = torch.arange(k, dtype=torch.int64) * (n - 1) // max(k - 1, 1)
        h.update(flat.index_select(0, idx).contiguous().view(torch.uint8).numpy().tobytes())
        h.update(str(int(torch.sum(flat.contiguous().view(torch.int16), dtype=torch.int64))).encode())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=4, help="bf16 parameters")
    ap.add_argument("--elements", type=int, default=64 * 3 * 512 * 1024, help="elements per parameter")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.p = torch.nn.ParameterList(  # type: ignore[assignment]
        [torch.nn.Parameter(torch.randn(args.elements, dtype=torch.bfloat16), requires_grad=False)
         for _ in range(args.params)]
    )  # fmt: skip
    gb = args.params * args.elements * 2 / 1e9
    times: dict[str, list[float]] = {"plain sum": [], "weights_digest": []}
    for _ in range(args.repeats):
        for name, fn in (("plain sum", plain_sum_digest), ("weights_digest", weights_digest)):
            t = time.perf_counter()
            assert fn(model)
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["plain sum"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:15s} {gb:.2f} GB: median {med:.3f} s of {[round(x, 3) for x in ts]}  ratio {med / base:.2f}")


if __name__ == "__main__":
    main()
