"""Measuring: per-call metrics, fidelity against dense, calibration, timing and environment."""
