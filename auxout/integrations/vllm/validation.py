"""Frontend-side check of auxout's per-request option, so bad values fail with HTTP 400.

vLLM already rejects a bad ``routed_experts_prompt_start`` in its input processor (type via the
OpenAI protocol, range against the prompt length). The ``return_routed_experts`` flag rides in
``extra_args`` (``vllm_xargs`` over HTTP), which vLLM does not inspect; without this check a
non-boolean would only fail later, inside the engine, as ``finish_reason="error"``.
"""

from __future__ import annotations

from typing import Any

from auxout.integrations.vllm.options import OUTPUT_FLAG, REQUEST_FLAG, normalize_flag

_INSTALLED = False


def check_request_flag(params: Any) -> None:
    """Raise vLLM's validation error (HTTP 400) for a non-bool opt-in/out flag or an unknown output mode."""
    from vllm.exceptions import VLLMValidationError

    extra = getattr(params, "extra_args", None) or {}
    if REQUEST_FLAG in extra and not isinstance(normalize_flag(extra[REQUEST_FLAG]), bool):
        raise VLLMValidationError(
            f"{REQUEST_FLAG} must be a boolean", parameter=REQUEST_FLAG, value=extra[REQUEST_FLAG]
        )
    if OUTPUT_FLAG in extra and extra[OUTPUT_FLAG] not in ("inline", "keys"):
        raise VLLMValidationError(
            f"{OUTPUT_FLAG} must be 'inline' or 'keys'", parameter=OUTPUT_FLAG, value=extra[OUTPUT_FLAG]
        )


def install_request_validation() -> None:
    """Wrap vLLM's ``InputProcessor._validate_params`` with :func:`check_request_flag` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params

    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        check_request_flag(params)
        return original(self, params, *args, **kwargs)

    InputProcessor._validate_params = _validate_params  # type: ignore[method-assign]
    _INSTALLED = True
