"""Measurement: per-layer and per-stage costs, latency, stage balancing, idle-time breakdown."""
