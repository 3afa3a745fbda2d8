"""The package's layers, bottom to top: the one statement of its import rule.

A *room* is a subpackage of ``zerobubble`` or a module at its top (``__init__`` is the
package's own front). :data:`LAYERS` lists the rooms from the bottom up; a module may import
its own room and the rooms of lower layers, never a room of its own layer or of a higher one.
The models a pipeline trains, ours (:mod:`zerobubble.models`) and the adapters of other
libraries' (:mod:`zerobubble.interop`), sit above the library that runs them
(:data:`MODEL_SIDE`): the library takes a model only through the layer contract, the hooks a
layer or a loss exposes (docs/layer-contract.md). :data:`TORCH_FREE` rooms never import
torch. ``tests/test_layers.py`` reads every module's imports and holds them to this table
(docs/architecture.md, "The import rule", says how it counts them).

Pure data, read-only, importing nothing.
"""

from __future__ import annotations

__all__ = ["LAYERS", "MODEL_SIDE", "TORCH_FREE"]

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "architecture",
        "composition",
        "schedule",
    ),  # what to run, in which order (no torch); the tables
    ("program",),  # each rank's instructions: the builder, its passes, the final check (no torch)
    ("trace",),  # the trace format, its offline check and clock alignment (no torch)
    ("runtime",),  # how to run one stage and one instruction: split, stage, p2p, interpreter
    ("parallel",),  # mesh, dp, FSDP, tp, ep, ties: transforms applied per stage
    ("executor", "reference"),  # one rank set up and run; the single-process ground truth
    ("optim",),  # synchronous optimizer semantics, post-validation, checkpoints
    ("profile",),  # costs and memory measured, idle time broken down
    ("viz",),  # pictures of schedules and of measured iterations
    ("pipeline",),  # the front door: one rank's stages of a model, trained step by step
    ("models", "interop"),  # models: ours, and adapters of other libraries' (the contract's side)
    ("train",),  # the end-to-end job: profile, plan, train, measure
    ("cli", "launch", "__init__"),  # the command, the local launcher, the package's front
)
"""The rooms of each layer, from the bottom up."""

MODEL_SIDE: tuple[str, ...] = ("models", "interop")
"""The rooms that implement the layer contract: no room below them imports them."""

TORCH_FREE: tuple[str, ...] = ("architecture", "composition", "schedule", "program", "trace")
"""The rooms that never import torch (the schedule commands stay fast and torch-less)."""
