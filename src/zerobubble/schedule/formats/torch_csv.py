"""PyTorch pipelining's compute-only CSV schedule format.

One row per rank; each cell is ``{stage}{type}{microbatch}`` with type
``F`` (forward), ``I`` (input-gradient backward: our B), ``W`` (weight
gradient: our W) or ``B`` (full backward: our BW). PyTorch's listings may also
hold empty cells (idle slots), bookkeeping actions (``REDUCE_GRAD``,
``UNSHARD``, ``RESHARD``: no compute, skipped) and ``(a;b)OVERLAP_F_B`` pairs
(their sub-actions in order, an F and a backward kept as an overlapped pair:
``Schedule.overlaps``). Communication cells (``SEND_F``...) mean a compute+comms
listing, which is refused.

Export writes F/I/W/B cells and an overlapped pair as one ``(a;b)OVERLAP_F_B``
cell, so our schedules round-trip exactly (the name is not part of the format).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.textfile import read_text

_TO_OURS = {"F": Op.F, "I": Op.B, "W": Op.W, "B": Op.BW}
_TO_TORCH = {op: t for t, op in _TO_OURS.items()}
_CELL = re.compile(r"^(\d+)(F|I|W|B)(\d+)$")
_BOOKKEEPING = re.compile(r"^\d*(REDUCE_GRAD|UNSHARD|RESHARD)\d*$")
_COMMS = re.compile(r"^\d+(SEND_F|RECV_F|SEND_B|RECV_B)\d*$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")


def dumps(schedule: Schedule) -> str:
    if schedule.segments > 1:
        raise ValueError(
            f"{schedule.name} runs {schedule.segments} sequence segments per microbatch, "
            "which PyTorch's CSV format cannot say; export it as JSON"
        )
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for d in range(schedule.num_devices):
        writer.writerow(
            _cell(a) if b is None else f"({_cell(a)};{_cell(b)})OVERLAP_F_B"
            for a, b in schedule.blocks(d)
        )
    return out.getvalue()


def _cell(a: Action) -> str:
    return f"{a.stage}{_TO_TORCH[a.op]}{a.mb}"


def save(schedule: Schedule, path: str | Path) -> None:
    Path(path).write_text(dumps(schedule))


def parse_cell(cell: str, rank: int, column: int) -> list[Action]:
    """Actions of one cell (zero for idle or bookkeeping cells, two for an overlap pair)."""
    text = cell.strip()
    if text in ("", "None"):
        return []
    if _BOOKKEEPING.match(text):
        return []
    if _COMMS.match(text):
        raise ValueError(
            f"rank {rank} column {column}: {text!r} is a communication action; this reader takes "
            "PyTorch's compute-only CSV (export with format='compute_only')"
        )
    if m := _OVERLAP.match(text):
        return [a for part in m.group(1).split(";") for a in parse_cell(part, rank, column)]
    if m := _CELL.match(text):
        return [Action(_TO_OURS[m.group(2)], int(m.group(1)), int(m.group(3)))]
    raise ValueError(
        f"rank {rank} column {column}: cannot parse {text!r}; "
        "expected cells like 0F0, 2I0, 2W0, 1B3"
    )


def from_rows(
    rows: Sequence[Iterable[str]],
    *,
    name: str = "torch-csv",
    num_stages: int | None = None,
    num_microbatches: int | None = None,
) -> Schedule:
    """Build a schedule from rows of cells, inferring placement from where stages appear.

    ``num_stages`` / ``num_microbatches`` default to the largest index seen plus one;
    pass them to have out-of-range cells rejected precisely by the validator.
    """
    actions: list[list[Action]] = []
    overlaps: list[tuple[Action, Action]] = []
    where: dict[int, tuple[int, int]] = {}
    for rank, row in enumerate(rows):
        acts: list[Action] = []
        for column, cell in enumerate(row):
            parsed = parse_cell(cell, rank, column)
            if (
                _OVERLAP.match(cell.strip())
                and len(parsed) == 2
                and parsed[0].op is Op.F
                and parsed[1].op in (Op.B, Op.BW)
            ):
                overlaps.append((parsed[0], parsed[1]))
            for a in parsed:
                if a.stage in where and where[a.stage][0] != rank:
                    first_rank, first_col = where[a.stage]
                    raise ScheduleError(
                        Reason.WRONG_DEVICE,
                        f"stage {a.stage} also appears on rank {first_rank} (column {first_col}); "
                        "a stage must live on exactly one rank",
                        device=rank,
                        position=len(acts),
                        action=a,
                    )
                where.setdefault(a.stage, (rank, column))
                acts.append(a)
        actions.append(acts)
    if not where:
        raise ValueError("the CSV holds no compute actions")
    seen_stages = max(where) + 1
    S = num_stages if num_stages is not None else seen_stages
    total = sum(len(acts) for acts in actions)
    if total < S:  # a stage needs an action: no range of S is walked before this check
        what = f"num_stages={S}" if num_stages is not None else f"a cell names stage {S - 1}"
        raise ValueError(
            f"{what}, but the CSV holds {total} compute actions and every stage needs at "
            f"least one: a stage (the number before F, I, W or B in a cell) must be < {total}"
        )
    absent = [s for s in range(S) if s not in where]
    if absent:
        raise ScheduleError(
            Reason.MISSING,
            f"stages {absent} never appear, so their rank is unknown; every stage needs "
            "at least one action",
        )
    M = num_microbatches
    if M is None:
        M = max(a.mb for acts in actions for a in acts) + 1
    if total < M:  # and beyond any simulation's reach
        raise ValueError(
            f"{M} microbatches but the CSV holds {total} compute actions, and every "
            "microbatch needs a forward on every stage; pass the schedule's own -m"
        )
    placement = tuple(where[s][0] for s in range(S))
    return Schedule(
        name, len(actions), S, M, placement, tuple(map(tuple, actions)), overlaps=tuple(overlaps)
    )


def loads(
    text: str,
    *,
    name: str = "torch-csv",
    num_stages: int | None = None,
    num_microbatches: int | None = None,
) -> Schedule:
    rows = list(csv.reader(io.StringIO(text)))
    return from_rows(rows, name=name, num_stages=num_stages, num_microbatches=num_microbatches)


def load(
    path: str | Path,
    *,
    name: str | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
) -> Schedule:
    """Read a CSV file; the schedule is named after the file unless ``name`` is given."""
    return loads(
        read_text(path, "schedule file"),
        name=Path(path).stem if name is None else name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
    )
