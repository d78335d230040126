"""The engine core process: auxout's scheduler subclasses (the scheduler-side connector
inside vLLM's scheduler)."""
