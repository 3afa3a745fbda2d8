"""Import PyTorch pipelining's built-in schedules as zerobubble schedules.

PyTorch lists its schedules as per-rank action tables
(``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``).
Rendering each action with ``str()`` gives exactly the compute-only CSV cells
that :mod:`zerobubble.schedule.formats.torch_csv` reads, so this is a thin
adapter: it is how we validate and simulate that peer's schedules.
"""

from __future__ import annotations

from zerobubble.schedule.formats import torch_csv
from zerobubble.schedule.ir import Schedule

#: PyTorch's schedule class names (as ``get_schedule_class`` accepts them).
TORCH_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)


def torch_rows(
    name: str, num_devices: int, num_microbatches: int, stages_per_rank: int | None = None
) -> list[list[str]]:
    """PyTorch's compute-only table for ``name`` as CSV cells (idle slots are '')."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(name, num_devices, num_microbatches, stages_per_rank)
    return [["" if a is None else str(a) for a in row] for row in ops]


def torch_schedule(
    name: str, num_devices: int, num_microbatches: int, stages_per_rank: int | None = None
) -> Schedule:
    """Import PyTorch's schedule ``name`` for P devices and M microbatches.

    The microbatch count is passed on, so a listing that names a microbatch
    outside [0, M) is rejected by the validator with the offending cell.
    """
    rows = torch_rows(name, num_devices, num_microbatches, stages_per_rank)
    return torch_csv.from_rows(rows, name=f"torch:{name}", num_microbatches=num_microbatches)
