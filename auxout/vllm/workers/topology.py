"""What each worker rank of a parallel vLLM engine does for routes, and how PP stages merge.

- **Tensor parallel.** Every TP rank runs the same router on the same (all-reduced) hidden
  states, so the top-k ids are identical on all ranks. Only TP rank 0 captures.
- **Pipeline parallel.** Each stage holds only its own decoder layers, so each stage captures
  its own MoE layers, into the columns those layers have in *model* order (learned once, at
  load, by gathering every stage's layer ids over the PP group). A non-last stage ships its
  capture rows downstream inside the ``IntermediateTensors`` vLLM already sends to the next
  stage (one extra ``uint8`` tensor of ``tokens x layers x top_k`` ids, a few percent of the
  hidden states it rides with); the next stage loads them into its buffer before its own
  forward fills its own columns. The last stage thus holds every MoE layer of every token.
  Because ``send_tensor_dict`` may split a tensor across the TP ranks of the stage, every TP
  rank of a non-last stage captures (their ids are identical); on the last stage only TP
  rank 0 does.
- **Output rank** (last PP stage, TP rank 0: the rank whose ``ModelRunnerOutput`` vLLM returns)
  alone builds the worker connector and the store, and publishes.
- **Data parallel**: every DP rank is its own engine (scheduler, workers, KV cache); with
  DP > 1 its store keys live under ``<namespace>/dp<rank>`` (:func:`dp_keyspace`).
- **Expert parallel** changes nothing here: vLLM's router reports logical expert ids (before
  any EPLB logical-to-physical mapping) to ``capture_fn`` on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from auxout.keys import KeySpace

ROWS_KEY = "auxout_routes"
"""Key of the capture rows inside the ``IntermediateTensors`` sent between PP stages."""


@dataclass(frozen=True)
class RankRole:
    """Route duties of one worker rank."""

    captures: bool
    owns_routes: bool  # builds the worker connector and store; its output reaches the scheduler
    pp_size: int
    last_stage: bool

    @property
    def ships_rows(self) -> bool:
        return self.captures and not self.last_stage


def role_of(tp_rank: int, pp_size: int, first_stage: bool, last_stage: bool) -> RankRole:
    """The route duties of the rank at ``tp_rank`` of its stage (see the module docstring)."""
    del first_stage  # every stage captures its own layers
    captures = tp_rank == 0 or (pp_size > 1 and not last_stage)
    return RankRole(captures=captures, owns_routes=last_stage and tp_rank == 0, pp_size=pp_size, last_stage=last_stage)


def current_role() -> RankRole:
    """This worker's role, from vLLM's initialized parallel groups."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    pp = get_pp_group()
    return role_of(get_tp_group().rank_in_group, pp.world_size, pp.is_first_rank, pp.is_last_rank)


def dp_keyspace(namespace: str, parallel_config: Any) -> KeySpace:
    """Store keys of this engine: one namespace per data-parallel rank when DP > 1.

    Each DP rank has its own KV cache, so it only ever reads keys it wrote; separate namespaces
    lose no sharing and guarantee two ranks never write one key (routes of the same prefix can
    differ in bytes between ranks: batch composition changes MoE numerics at near-ties).
    ``data_parallel_index`` is the engine's DP rank even where vLLM resets
    ``data_parallel_rank`` (dense models).
    """
    if int(getattr(parallel_config, "data_parallel_size", 1)) <= 1:
        return KeySpace(namespace)
    rank = getattr(parallel_config, "data_parallel_index", None)
    if rank is None:
        rank = parallel_config.data_parallel_rank
    return KeySpace.for_instance(namespace, int(rank))


def moe_columns(local_layer_ids: list[int], pp_size: int) -> tuple[int, list[int]]:
    """``(number of MoE layers in the whole model, model-order column of each local layer)``.

    With PP, every stage contributes its MoE layer ids over the PP group's CPU group; the
    model's MoE layers are their sorted union (layer ids are global decoder-layer indices).
    """
    if pp_size == 1:
        return len(local_layer_ids), list(range(len(local_layer_ids)))
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_pp_group

    gathered: list[Any] = [None] * pp_size
    dist.all_gather_object(gathered, list(local_layer_ids), group=get_pp_group().cpu_group)
    every = sorted({int(i) for stage in gathered for i in stage})
    total = sum(len(stage) for stage in gathered)
    if len(every) != total:
        raise ValueError(f"auxout: PP stages report overlapping MoE layer ids {gathered}")
    index = {layer: col for col, layer in enumerate(every)}
    return total, [index[i] for i in local_layer_ids]


def install_pipeline_rows(runner: Any, load_rows: Any, rows_tensor: Any) -> None:
    """Wrap this worker's ``runner.execute_model`` to receive and forward capture rows.

    ``load_rows(bytes_tensor)`` writes received rows into the capture buffer before the
    forward; ``rows_tensor(n)`` returns this stage's first ``n`` rows (as bytes) to send on.
    Ranks that do not capture pass ``None`` for both: they only drop the received entry.
    The received entry is removed before vLLM's runner sees the tensors (it copies every
    entry into its own preallocated buffers, which have no such key).
    """
    from vllm.sequence import IntermediateTensors

    inner = runner.execute_model

    def execute_model(scheduler_output: Any, intermediate_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
        n = int(scheduler_output.total_num_scheduled_tokens)
        if intermediate_tensors is not None:
            received = intermediate_tensors.tensors.pop(ROWS_KEY, None)
            if received is not None and n and load_rows is not None:
                load_rows(received[:n])
        out = inner(scheduler_output, intermediate_tensors, *args, **kwargs)
        if isinstance(out, IntermediateTensors) and n and rows_tensor is not None:
            out.tensors[ROWS_KEY] = rows_tensor(n)
        return out

    runner.execute_model = execute_model
