"""The program layer: each rank's instructions, built by one builder and checked (no torch)."""
