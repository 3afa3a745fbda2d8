"""Schedule file formats: our JSON, PyTorch's compute-only CSV, a text timeline."""

from __future__ import annotations

from pathlib import Path

from zerobubble.schedule.formats import json_format, torch_csv
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.textfile import read_text

__all__ = ["json_format", "load_schedule", "save_schedule", "torch_csv"]


def load_schedule(path: str | Path, *, num_microbatches: int | None = None) -> Schedule:
    """Read our JSON or PyTorch's CSV, chosen by content (JSON starts with '{')."""
    text = read_text(path, "schedule file")
    if text.lstrip().startswith("{"):
        return json_format.loads(text, str(path))
    return torch_csv.loads(text, name=Path(path).stem, num_microbatches=num_microbatches)


def save_schedule(schedule: Schedule, path: str | Path) -> None:
    """Write JSON, or CSV when the file name ends in .csv."""
    if str(path).endswith(".csv"):
        torch_csv.save(schedule, path)
    else:
        json_format.save(schedule, path)
