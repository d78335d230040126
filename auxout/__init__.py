"""auxout: routed-experts capture, storage and replay for MoE RL."""
