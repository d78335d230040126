"""Shared pytest configuration: hypothesis profiles (fast in `make test`, long in `make fuzz`)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "fast", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("AUXOUT_FUZZ_EXAMPLES", "10000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))
