"""`auxout verify` end to end: bf16 rollout, fp32 training forward, replay closes the routing gap."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import build_tiny

from auxout.trainer.verify import main


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "qwen3_moe"
    build_tiny("qwen3_moe", seed=3).save_pretrained(path)
    return str(path)


def _report(out: Path) -> dict:
    assert (out / "disagreement.png").stat().st_size > 1000
    return json.loads((out / "verify.json").read_text())


def test_verify_hf_bf16_end_to_end(tiny_path, tmp_path, capsys):
    rc = main(["--model", tiny_path, "--rollout", "hf-bf16", "--num-prompts", "2", "--prompt-len", "40",
               "--max-new-tokens", "40", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    rep = _report(tmp_path)
    w, r = rep["without_replay"], rep["with_replay"]
    assert rep["rollout"] == "hf-bf16" and rep["num_moe_layers"] == 2
    assert w["token_layers"] == r["token_layers"] == 2 * (40 + 40 - 1) * 2
    assert r["agreement"] == 1.0 and r["disagreement_per_layer"] == [0.0, 0.0]
    assert w["agreement"] < 1.0  # bf16 rollout vs fp32 training really disagrees without replay
    assert r["fallback_rows"] == 2 * 2  # only each sequence's last token (no route returned) per layer
    assert r["kl_k3"] >= 0 and r["max_abs_log_ratio"] > 0
    assert "with replay:    agreement 100.0000%" in capsys.readouterr().out


@pytest.mark.parametrize(
    "corrupt, says",
    [
        (lambda r: np.roll(r, 1, axis=0), "do not belong to these tokens"),  # off by one position
        (lambda r: (r + 1) % 8, "do not belong to these tokens"),  # other experts (8 in this model)
        (lambda r: np.zeros_like(r), "replay refused the rollout's routes"),  # zero-filled (vllm#44214)
        (lambda r: r[:-3], "replay refused the rollout's routes"),  # rows missing
    ],
)
def test_routes_that_are_not_the_rollouts_fail(tiny_path, tmp_path, capsys, monkeypatch, corrupt, says):
    """Replay forces any well-formed rows, so its 100% alone would pass wrong routes: the model's
    own routing (without replay) and replay's checks catch them, exit 1 with the reason."""
    import auxout.trainer.verify as verify

    real = verify.rollout_hf_bf16

    def corrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        return [dataclasses.replace(r, routes=corrupt(r.routes)) for r in real(*args, **kwargs)]

    monkeypatch.setattr(verify, "rollout_hf_bf16", corrupted)
    rc = main(["--model", tiny_path, "--rollout", "hf-bf16", "--num-prompts", "1", "--prompt-len", "30",
               "--max-new-tokens", "20", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1 and "auxout verify: FAILED" in out and says in out, out


@pytest.mark.vllm
def test_verify_with_real_vllm_engine(tmp_path):
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("auxout.vllm") is None:
        pytest.skip("vllm / auxout.vllm not installed")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "AUXOUT_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "auxout.cli", "verify", "--rollout", "vllm", "--num-prompts", "3", "--prompt-len", "32",
         "--max-new-tokens", "32", "--out", str(tmp_path / "out"), "--no-progress"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = _report(tmp_path / "out")
    assert rep["rollout"] == "vllm"
    assert rep["with_replay"]["agreement"] == 1.0
    assert rep["with_replay"]["token_layers"] == 3 * (32 + 32 - 1) * rep["num_moe_layers"]


@pytest.mark.vllm
@pytest.mark.slow  # (the docs example end to end; its pieces run in the default tier)
def test_docs_trainer_example_runs(tmp_path):
    """The complete example in docs/trainer.md runs as written (vLLM rollout, replayed training step)."""
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("auxout.vllm") is None:
        pytest.skip("vllm / auxout.vllm not installed")
    doc = (Path(__file__).parents[2] / "docs" / "trainer.md").read_text()
    code = doc.split("## 4.")[1].split("```python\n")[1].split("```")[0]
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "AUXOUT_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("loss "))
    assert "fallbacks 4" in line and float(line.split("router grad norm ")[1].split()[0]) > 0


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--num-prompts", "0"], "--num-prompts: must be at least 1, got 0"),
        (["--max-new-tokens", "-3"], "--max-new-tokens: must be at least 1"),
        (["--temperature", "-1"], "--temperature: must be >= 0"),
        (["--arch", "gpt4"], "--arch: invalid choice: 'gpt4'"),
        (["--model", "/no/such/checkpoint"], "is not a checkpoint directory"),
    ],
)
def test_bad_arguments_are_usage_errors_not_tracebacks(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_a_dense_model_is_a_usage_error_before_any_rollout(tmp_path, capsys):
    """A checkpoint without MoE layers: exit 2 naming the model and why, not a traceback."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tmp_path / "dense"), "--rollout", "hf-bf16", "--num-prompts", "1",
              "--out", str(tmp_path / "out"), "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "auxout verify: error: --model" in err and "no MoE router" in err, err
    assert not (tmp_path / "out").exists()


def test_mla_model_on_cpu_rolls_out_with_transformers(tmp_path, capsys):
    """vLLM-CPU turns prefix caching off for MLA (deepseek_v3): ``--rollout vllm`` is a usage error
    naming why before any engine starts, and ``auto`` picks the transformers rollout."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU vLLM runs MLA with prefix caching")
    with pytest.raises(SystemExit) as exc:
        main(["--arch", "deepseek_v3", "--rollout", "vllm", "--out", str(tmp_path / "a"), "--no-progress"])
    assert exc.value.code == 2
    assert "multi-head latent attention" in capsys.readouterr().err
    rc = main(["--arch", "deepseek_v3", "--num-prompts", "1", "--prompt-len", "16", "--max-new-tokens", "8",
               "--out", str(tmp_path / "b"), "--no-progress"])
    assert rc == 0 and _report(tmp_path / "b")["rollout"] == "hf-bf16"
