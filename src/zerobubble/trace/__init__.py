"""Executed traces: the event format, the offline checker, cross-rank clock alignment (no torch)."""
