"""Single-process ground truths: what a pipelined step must reproduce bitwise."""
