"""The data-plane benchmark's replays, as a test: both of auxout's drivers (the per-request path and
the path the vLLM bridge takes: ``take_step`` and ``HeldRows``) must return, bit for bit, the rows
fed in, over its decode, prefill and multi-turn workloads (no timing is asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_dataplane_drivers_return_the_rows_fed_in(capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import dataplane
    finally:
        sys.path.remove(str(BENCHMARKS))
    rc = dataplane.main(["--quick", "--no-vllm", "--bridge", "--repeats", "1"])
    out = capsys.readouterr().out
    for workload in dataplane.WORKLOADS:
        for driver in ("auxout", "auxout-bridge"):
            assert f"PASS  {workload}: {driver} outputs equal the rows fed in" in out, out[-3000:]
    assert rc == 0 and "MISMATCH" not in out, out[-3000:]
