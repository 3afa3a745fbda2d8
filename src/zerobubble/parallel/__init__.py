"""Parallel dimensions applied per stage before the runtime runs it: mesh, dp, FSDP, tp, ep."""
