"""Conformance kit for engine integrators: a fake MoE router, a simulated engine, an oracle."""

from auxout.testing.fake_moe import FakeMoE
from auxout.testing.sim_engine import SimEngine, SimKVConnector, SimResult, oracle_routes

__all__ = ["FakeMoE", "SimEngine", "SimKVConnector", "SimResult", "oracle_routes"]
