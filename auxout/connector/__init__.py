"""The connector pair, engine-agnostic and numpy only.

- :mod:`~auxout.connector.scheduler`: the scheduler side (control plane). Decides per step what
  each request's routes need (prefix reads, writes, outputs) and sends it as a payload-free
  :class:`~auxout.connector.messages.StepMetadata`.
- :mod:`~auxout.connector.worker`: the worker side (data plane). Takes each step's captured rows,
  publishes filled hash blocks to the store and assembles each request's output.
- :mod:`~auxout.connector.messages`: the messages between the two.

Beside them: staging (rows of blocks not yet filled), the route index, held rows, keys-only
output and the per-step row check. Stores are in :mod:`auxout.stores`; an engine binding (such as
:mod:`auxout.vllm`) drives the pair from the engine's own hooks.
"""
