"""Engine start-up failures say what is wrong and what to do."""

from __future__ import annotations

import pytest
from routes_oracle import make_llm

pytestmark = pytest.mark.vllm


@pytest.mark.slow  # a full engine start-up (40-190 s here); the unit test in test_integration_units is quick
def test_mla_model_on_cpu_says_why_vllm_cpu_cannot_serve_its_routes(capfd):
    """DeepSeek-V3 (MLA): without AMX vLLM-CPU turns prefix caching off whatever was asked; with AMX
    it picks a bfloat16, DeepSeek-shaped-only backend that fails in a kernel on the tiny model. The
    message must name whichever applies to this host, before vLLM's own misleading failure.

    The worker's error is raised in the engine-core process; vLLM's exception in the caller only
    says the engine failed, so the reason is read from the engine's output (what the user sees).
    """
    import torch

    from auxout.testing.models import build_tiny_moe

    path = build_tiny_moe("deepseek_v3")
    with pytest.raises(RuntimeError):
        make_llm(path, max_model_len=256, enable_prefix_caching=True)
    out, err = capfd.readouterr()
    if torch.cpu._is_amx_tile_supported():
        expected = "this model (deepseek_v3) has dtype float32 and kv_lora_rank + qk_rope_head_dim = 32 + 16 = 48"
    else:
        expected = "vLLM-CPU turns prefix caching (and chunked prefill) off for models with multi-head latent"
    assert expected in out + err
    assert "needs prefix caching (enable_prefix_caching=True)" not in out + err
    assert "invalid weight input features" not in out + err


def test_expert_parallel_over_several_ranks_is_refused_naming_the_layout():
    """vLLM-CPU's fused-MoE experts ignore ``expert_map``: expert parallelism over more than one rank
    segfaults in the first forward. One rank (no expert_map) runs, and is let through."""
    from types import SimpleNamespace

    from auxout.vllm.workers.cpu import check_cpu_config

    moe = SimpleNamespace(use_mla=False, get_num_experts=lambda: 16)
    dense = SimpleNamespace(use_mla=False, get_num_experts=lambda: 0)

    def cfg(model=moe, ep=True, tp=1, dp=1, pcp=1):
        parallel = SimpleNamespace(enable_expert_parallel=ep, tensor_parallel_size=tp, data_parallel_size=dp,
                                   prefill_context_parallel_size=pcp)  # fmt: skip
        return SimpleNamespace(model_config=model, parallel_config=parallel)

    for tp, pcp, layout in ((2, 1, "tensor_parallel_size=2"), (1, 2, "prefill_context_parallel_size=2"),
                            (4, 2, "tensor_parallel_size=4, prefill_context_parallel_size=2")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"expert parallelism \(enable_expert_parallel with {tp * pcp} ranks: "
                           rf"{layout}\).*ignore expert_map"):  # fmt: skip
            check_cpu_config(cfg(tp=tp, pcp=pcp))
    check_cpu_config(cfg(tp=1))  # one rank holds every expert
    check_cpu_config(cfg(ep=False, tp=2))  # tensor parallelism alone shards every expert
    check_cpu_config(cfg(model=dense, tp=2))  # no experts to split
    with pytest.raises(ValueError, match="data_parallel_size=2.*no all_gatherv"):  # (DP is refused first)
        check_cpu_config(cfg(dp=2))


def test_auxout_serve_refuses_layouts_vllm_cpu_cannot_run_before_any_engine_starts(tmp_path):
    """``auxout serve`` checks vLLM's engine config in the API-server process: data parallelism and
    expert parallelism over two ranks exit with status 2 and the reason, and no engine process
    starts (an engine would take minutes to start, then die at the first request)."""
    import subprocess
    import sys

    from auxout.testing.models import build_tiny_moe

    path = build_tiny_moe("qwen3_moe")
    cases = {
        "dp": (["--data-parallel-size", "2"], "with data parallelism (data_parallel_size=2)"),
        "ep": (["--tensor-parallel-size", "2", "--enable-expert-parallel"],
               "expert parallelism (enable_expert_parallel with 2 ranks: tensor_parallel_size=2)"),
    }  # fmt: skip
    procs = {}
    for name, (args, _) in cases.items():  # (both at once: most of each is importing vLLM)
        cmd = [sys.executable, "-m", "auxout.cli", "serve", path, "--port", "0", "--dtype", "float32",
               "--block-size", "32", "--enforce-eager", *args]  # fmt: skip
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 2, out[-3000:]
        assert f"auxout serve: error: vLLM-CPU cannot run {'a mixture-of-experts model ' if name == 'dp' else ''}" \
            f"{cases[name][1]}" in out, out[-3000:]
        assert "(EngineCore" not in out and "(Worker" not in out, out[-3000:]  # refused before any engine process
