"""Every name auxout adds to vLLM's requests and outputs, offline and over HTTP, in one table.

========================  ==========================================  ========================================
what                      offline (``vllm.LLM``)                      HTTP (``auxout serve``)
========================  ==========================================  ========================================
routes on or off          extra_args return_routed_experts            vllm_xargs return_routed_experts
inline rows or manifest   extra_args routed_experts_output            vllm_xargs routed_experts_output
routing weights too       extra_args return_routing_weights           body return_routing_weights
rows from a position      SamplingParams routed_experts_prompt_start  body routed_experts_prompt_start
wire format               (arrays)                                    body routed_experts_format
route session             (none)                                      body routed_experts_session
the ids                   completion routed_experts                   choice routed_experts (+ _format,
                                                                      _dtype, _shape, _bits: auxout.wire)
first row's position      (the prompt start)                          choice routed_experts_start
the weights               completion routing_weights                  choice routing_weights (+ _format, ...),
                                                                      routing_weights_start
keys-only manifest        auxout_routes_manifest                      choice routed_experts_manifest
recomputed prefix tokens  auxout_recomputed_tokens                    choice routed_experts_recomputed_tokens
rows after a cache reset  auxout_routes_reset_at                      choice routed_experts_reset_at
why rows came inline      auxout_routes_inline_reason                 choice routed_experts_inline_reason
========================  ==========================================  ========================================

``extra_args``: ``SamplingParams.extra_args``; ``vllm_xargs``: its HTTP form; ``body``: the top level
of the HTTP request body; ``completion``: a ``CompletionOutput`` attribute; ``choice``: a field of
``choices[i]``. ``routed_experts``, ``routed_experts_prompt_start`` and the ``.npy`` encoding are
vLLM's own; auxout adds the rest.

The four per-completion facts at the bottom have two names each. Offline they are keys of
``RequestOutput.kv_transfer_params`` (where the engine core puts them and ``n=1`` callers read
them) and attributes of the ``CompletionOutput`` they belong to (``caller.completion_fields``):
``kv_transfer_params`` is shared with vLLM's KV connectors (``do_remote_decode``,
``remote_block_ids``, ...), so auxout's keys there carry its prefix. Over HTTP they are fields of
a choice next to ``routed_experts``, named like it. Renaming either side would break the clients
that read it. ``extra_args`` keys not in the table are auxout's internal ones
(:data:`WEIGHTS_SPLIT`, :data:`INTERNAL_KEY`), never accepted from a client.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence

# -- request fields -------------------------------------------------------------------------------
REQUEST_FLAG = "return_routed_experts"
"""``extra_args`` key (HTTP: ``vllm_xargs``) that opts one request in or out of returned routes."""
OUTPUT_FLAG = "routed_experts_output"
"""``extra_args`` key (HTTP: ``vllm_xargs``) choosing ``"inline"`` rows or a ``"keys"`` manifest."""
WEIGHTS_FLAG = "return_routing_weights"
"""``extra_args`` key (HTTP: top-level body field) asking for the routing weights too."""
PROMPT_START = "routed_experts_prompt_start"
"""vLLM's ``SamplingParams`` field (HTTP: top-level body field): rows start at this prompt position."""
FORMAT_FIELD = "routed_experts_format"
"""HTTP only, top level: the wire format of the rows (:mod:`auxout.wire`)."""
SESSION_FIELD = "routed_experts_session"
"""HTTP only, top level: a conversation whose turns get only the rows the client lacks."""

EXTRA_ARGS = (REQUEST_FLAG, OUTPUT_FLAG, WEIGHTS_FLAG)
"""auxout's ``SamplingParams.extra_args`` keys offline."""
TOP_LEVEL = (PROMPT_START, FORMAT_FIELD, SESSION_FIELD, WEIGHTS_FLAG)
"""auxout's fields that go at the top of an HTTP request body."""
IN_XARGS = (REQUEST_FLAG, OUTPUT_FLAG)
"""auxout's fields that go in ``vllm_xargs`` (vLLM's per-request ``extra_args``) over HTTP."""
HTTP_ONLY = (FORMAT_FIELD, SESSION_FIELD)
"""Request fields with no offline counterpart (offline, routes come back as arrays)."""

# -- output fields --------------------------------------------------------------------------------
ROUTES = "routed_experts"
"""vLLM's ``CompletionOutput`` attribute and HTTP choice field holding the expert ids."""
WEIGHTS_OUTPUT = "routing_weights"
"""``CompletionOutput`` attribute (HTTP: choice field) holding the weights: float32, shaped like the ids."""
START_FIELD = "routed_experts_start"
"""HTTP choice field: the position of the first row sent."""
WEIGHTS_START_FIELD = "routing_weights_start"
"""HTTP choice field: the position of the first weights row sent (a session turn may start them earlier)."""

MANIFEST_FIELD = "auxout_routes_manifest"
"""Offline: the keys-only route manifest (``kv_transfer_params`` key and ``CompletionOutput`` attribute)."""
RECOMPUTED_FIELD = "auxout_recomputed_tokens"
"""Offline: prefix-hit tokens recomputed for lack of routes (in a finished request's output)."""
RESET_AT_FIELD = "auxout_routes_reset_at"
"""Offline: per prefix-cache reset that hit the running request (an in-flight weight sync), the
first position whose rows come from after it."""
INLINE_REASON_FIELD = "auxout_routes_inline_reason"
"""Offline: why a keys-only request got its rows inline (manifest unpublishable)."""
COMPLETION_FACTS = (MANIFEST_FIELD, RECOMPUTED_FIELD, INLINE_REASON_FIELD, RESET_AT_FIELD)
"""The engine core's per-request facts, copied onto each ``CompletionOutput`` (``n > 1``)."""

MANIFEST_HTTP = "routed_experts_manifest"
RECOMPUTED_HTTP = "routed_experts_recomputed_tokens"
RESET_AT_HTTP = "routed_experts_reset_at"
INLINE_REASON_HTTP = "routed_experts_inline_reason"
CHOICE_FACTS = (
    (INLINE_REASON_FIELD, INLINE_REASON_HTTP),  # keys-only asked, rows inline: why
    (RESET_AT_FIELD, RESET_AT_HTTP),  # where each weight sync mid-request begins the new weights' rows
    (RECOMPUTED_FIELD, RECOMPUTED_HTTP),  # prefix-hit tokens recomputed for lack of routes
)
"""Per-choice facts the engine reports at finish (offline name, HTTP name); streamed: on the last
chunk. The manifest is sent with the rows' fields instead (``routed_experts_start`` beside it)."""

# -- internal ``extra_args`` keys ------------------------------------------------------------------
WEIGHTS_SPLIT = "auxout_weights_split"
"""Set by auxout's request validation: the process that made the request splits (id, weight) rows
for the user. Without it (a frontend auxout did not hook) the engine sends the ids alone and
warns, never raw byte rows."""
INTERNAL_KEY = "auxout_http"
"""The server's checked HTTP fields of a request, from ``to_sampling_params`` to ``generate``;
never accepted from a client (the body checks refuse it)."""


def misspelt_route_field(name: str, known: Sequence[str], where: Mapping[str, str] | None = None) -> str | None:
    """What to say about ``name``, a field named like auxout's that is none of ``known`` (a typo
    vLLM would silently ignore); None when it is known or not named like a route field.
    ``where``: for a field meant that belongs in another place, where it goes."""
    squashed = name.lower().replace("_", "").replace("-", "")  # (camelCase and kebab-case too)
    if name in known or ("routedexpert" not in squashed and "routingweight" not in squashed):
        return None
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower().replace("-", "_")  # routedExperts -> routed_experts
    if snake == ROUTES:
        return (
            f"{ROUTES} is the output field: routes come back by default; opt a request out with "
            f"{REQUEST_FLAG}=false (extra_args offline, vllm_xargs over HTTP)"
        )
    close = [snake] if snake in known else difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not close:
        return "auxout's fields are " + ", ".join(known)
    place = (where or {}).get(close[0])
    return f"did you mean {close[0]}?" + (f" ({place})" if place else "")


def normalize_flag(value: object) -> object:
    """The flag as a bool when it is one in disguise: HTTP ``vllm_xargs`` turn ``false`` into ``0``."""
    if not isinstance(value, bool) and type(value) is int and value in (0, 1):
        return bool(value)
    return value
