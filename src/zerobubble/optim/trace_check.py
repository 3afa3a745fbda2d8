"""Offline check of a gathered trace against the optimizer protocol's version invariants.

The trainer records its protocol steps as trace events (track ``optim``):

=================  ==================================================================
``opt_reduce``     sync mode: the all-reduce of the gradient-norm vector
``opt_prefix``     post-validation: prefix state received (and, on the last rank, final)
``opt_provisional`` a provisional step (``param_version`` after it)
``opt_defer``      no provisional step: prefix non-finite or above the clip threshold
``opt_validate``   the full state arrived; the rank compares it with what it did
``opt_rollback``   the provisional step was undone
``opt_step``       a final step (sync, last rank, deferred or redone after a rollback)
``opt_skip``       the final action is to skip (non-finite norm)
``opt_commit``     the iteration's version is final on this rank
``replay``         (executor) speculative work of this iteration was discarded
=================  ==================================================================

An optimizer event carries the iteration whose gradients it acts on, even when
it happens during the next iteration's compute.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from zerobubble.runtime.trace import COMPUTE_OPS, TraceEvent

STEP_OPS = ("opt_provisional", "opt_step", "opt_skip", "opt_defer")
"""Events that act on an iteration's gradients (no W of that iteration may follow)."""


def check_versions(events: Iterable[TraceEvent], *, conservative: bool = False) -> list[str]:
    """Problems in a trace of all ranks (empty: the invariants hold).

    Checks, per rank unless stated:

    1. every W/BW of iteration k ends before the first optimizer action on
       iteration k's gradients starts ("no W after its optimizer step");
    2. across ranks, every kept compute event of one (iteration, microbatch)
       carries the same ``param_version`` (events of an iteration that precede
       a ``replay`` of that iteration on their rank are discarded work);
    3. across ranks, every iteration is committed exactly once per rank, all
       at version ``iteration + 1``;
    4. with ``conservative``: no forward of iteration k+1 starts before the
       rank committed iteration k.
    """
    problems: list[str] = []
    by_rank: dict[int, list[TraceEvent]] = defaultdict(list)
    for e in events:
        by_rank[e.rank].append(e)
    versions: dict[tuple[int, int], set[int]] = defaultdict(set)
    commits: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for rank, evs in sorted(by_rank.items()):
        evs.sort(key=lambda e: (e.start_ns, e.end_ns))
        replayed_at = {e.iteration: e.start_ns for e in evs if e.op == "replay"}
        first_step: dict[int, int] = {}
        committed_at: dict[int, int] = {}
        for e in evs:
            if e.op in STEP_OPS:
                first_step.setdefault(e.iteration, e.start_ns)
            if e.op == "opt_commit":
                commits[e.iteration].setdefault(rank, []).append(e.param_version)
                committed_at.setdefault(e.iteration, e.end_ns)
        for e in evs:
            step_at = first_step.get(e.iteration)
            if e.op in ("W", "BW") and step_at is not None and e.end_ns > step_at:
                problems.append(
                    f"rank {rank}: {e.op}(s{e.stage},mb{e.mb}) of iteration {e.iteration} "
                    "ends after the optimizer acted on that iteration's gradients"
                )
            if e.op not in COMPUTE_OPS:
                continue
            prev = committed_at.get(e.iteration - 1)
            if (
                conservative
                and e.op == "F"
                and e.iteration > 0
                and (prev is None or e.start_ns < prev)
            ):
                problems.append(
                    f"rank {rank}: F(s{e.stage},mb{e.mb}) of iteration {e.iteration} starts "
                    f"before iteration {e.iteration - 1} is committed on this rank"
                )
            if e.iteration in replayed_at and e.start_ns < replayed_at[e.iteration]:
                continue  # discarded speculative work
            versions[e.iteration, e.mb].add(e.param_version)
    for (it, mb), vs in sorted(versions.items()):
        if len(vs) > 1:
            problems.append(
                f"microbatch {mb} of iteration {it} ran on parameter versions {sorted(vs)}"
            )
    ranks = sorted(by_rank)
    for it, per_rank in sorted(commits.items()):
        got = {r: per_rank.get(r, []) for r in ranks}
        if any(v != [it + 1] for v in got.values()):
            problems.append(f"iteration {it} committed as {got} (expected [{it + 1}] per rank)")
    return problems
