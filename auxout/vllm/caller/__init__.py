"""The calling process (``vllm.LLM``, the API server's engine client): request checks and the
route fields of completion outputs."""
