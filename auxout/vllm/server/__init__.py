"""``auxout serve``: vLLM's OpenAI server with route fields, body checks and route sessions."""
