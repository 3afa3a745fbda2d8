"""Which parallelism features compose: the one table, read by the checks, the docs and the tests.

A pipeline job picks features from :data:`FEATURES` (data parallelism, FSDP, tensor and
sequence parallelism, expert parallelism, sequence segments, recompute, overlapped F&B pairs,
parameters tied across stages, random ops); any schedule kind, V placements included, runs
under each. Every pair of features is a :class:`Cell` of :data:`CELLS`: it either composes
(``tests/test_composition.py`` shows the pipeline bitwise against the composed
reference, ``zerobubble.reference_step``) or is refused for a stated reason, with the fix.
Every pair is listed once (a test checks it).

:func:`check` is the one refusal: the mesh, the executor, the pipeline and the reference
call it with the features a job uses, so the same combination gets the same message
everywhere. ``docs/scale.md``'s composition table is :func:`markdown` (a test compares
them), so the docs cannot drift from what is refused. ``tests/test_composition.py`` runs a
covering design of the whole matrix on gloo ranks.

Pure data and string formatting: torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CELLS", "FEATURES", "TRIPLES", "Cell", "cell", "check", "markdown", "refusal"]

FEATURES: dict[str, str] = {
    "dp": "data-parallel replicas (gradients all-reduced)",
    "fsdp": "FSDP2 (the dp replicas shard their stages)",
    "tp": "tensor parallelism",
    "sp": "sequence parallelism (tp's activations sharded over the sequence)",
    "ep": "expert parallelism",
    "cp": "context parallelism (sequences sharded over cp ranks)",
    "segments": "sequence segments",
    "recompute": "activation recompute",
    "overlap": "overlapped F&B pairs",
    "ties": "parameters tied across stages",
    "random": "random ops (a seed: dropout in training mode)",
}
"""The features, in the table's order, with the words messages use for them."""

IMPLIES: dict[str, str] = {"fsdp": "dp", "sp": "tp", "ep": "dp"}
"""A feature that needs another: FSDP shards over dp, SP over tp, experts over dp ranks."""


@dataclass(frozen=True)
class Cell:
    """A set of features (a pair, or a larger set refused as a whole) and how they compose."""

    pair: tuple[str, ...]
    """Two (or more) keys of :data:`FEATURES`, in its order."""
    composes: bool
    why: str
    """Composes: what the composition rests on. Refused: why it is not honoured."""
    fix: str = ""
    """Refused: what the user does instead."""


def _cell(*args: str) -> Cell:
    """``_cell(feature, feature, ..., why[, fix])``: a fix means refused."""
    names = [a for a in args if a in FEATURES]
    why, fix = [*args[len(names) :], ""][:2]
    order = list(FEATURES)
    return Cell(tuple(sorted(names, key=order.index)), not fix, why, fix)


CELLS: tuple[Cell, ...] = (
    _cell("dp", "fsdp", "FSDP is the dp replicas' sharded form"),
    _cell("dp", "tp", "the dp all-reduce of each tp rank's shards"),
    _cell("dp", "sp", "sequence shards are per replica"),
    _cell("dp", "ep", "experts are sharded over ep consecutive dp ranks"),
    _cell("dp", "segments", "segments cut each replica's sequences"),
    _cell("dp", "recompute", "recompute changes no arithmetic"),
    _cell("dp", "overlap", "the dp reduction runs outside the pairs"),
    _cell("dp", "ties", "the tie is reduced after the dp sums"),
    _cell("dp", "random", "every replica seeds by (step, stage, microbatch)"),
    _cell("fsdp", "tp", "FSDP shards the tp DTensors over dp"),
    _cell("fsdp", "sp", "FSDP shards the tp DTensors over dp"),
    _cell("fsdp", "ep", "experts shard over their edp group, the rest over dp"),
    _cell("fsdp", "segments", "FSDP's hooks run per unit"),
    _cell("fsdp", "recompute", "the recomputed forward all-gathers again"),
    _cell(
        "fsdp", "overlap", "FSDP's collectives run outside the pairs; each stage is its own root"
    ),
    _cell("fsdp", "ties", "the holder stages' shards are laid out alike; the tie adds them"),
    _cell("fsdp", "random", "sharding changes no draw"),
    _cell("tp", "sp", "sequence parallelism is a tp layout"),
    _cell("tp", "ep", "experts replicated over tp; each tp rank's ep group exchanges"),
    _cell("tp", "segments", "each segment is parallelized as a whole sequence"),
    _cell("tp", "recompute", "the recomputed forward runs the same collectives"),
    _cell(
        "tp",
        "overlap",
        "each stage of a rank on its own tp lane (group); with recompute a pair's halves run "
        "one after the other",
    ),
    _cell("tp", "ties", "the tie is reduced over the shards"),
    _cell("tp", "random", "shared and per-rank streams (TPRandom)"),
    _cell("sp", "ep", "the MoE block gathers the sequence; experts replicated over tp"),
    _cell("sp", "segments", "each segment sharded evenly over tp"),
    _cell("sp", "recompute", "the recomputed forward runs the same collectives"),
    _cell("sp", "overlap", "each stage of a rank on its own tp lane (group)"),
    _cell("sp", "ties", "the tie is reduced over the shards"),
    _cell("sp", "random", "sequence shards draw from per-rank streams"),
    _cell("ep", "segments", "each segment's tokens go through the experts' all-to-all"),
    _cell("ep", "recompute", "the recomputed forward exchanges again"),
    _cell("ep", "overlap", "each half's all-to-all on its own lane"),
    _cell("ep", "ties", "the tie is reduced after the dp and edp sums"),
    _cell("ep", "random", "replicas draw by (step, stage, microbatch), with no dp rank"),
    _cell("dp", "cp", "gradients summed over cp (in cp-rank order), then over dp"),
    _cell(
        "fsdp",
        "cp",
        "FSDP shards over the dp dim only, and the cp ranks' gradients would have to be summed "
        "before its reduce-scatter",
        "use fsdp=False with cp, or cp=1",
    ),
    _cell(
        "tp",
        "cp",
        "each tp rank attends its own heads over its cp group (the cp ranks of its tp rank); "
        "the ground truth plays this process's cp rank over that group",
    ),
    _cell(
        "sp",
        "cp",
        "tp's sequence shards cut each cp rank's two chunks; attention gathers them first",
    ),
    _cell(
        "ep",
        "cp",
        "the experts' all-to-alls and the cp gathers would both be played between the threads "
        "of one reference, which plays one group at a time",
        "use ep=1 with cp, or cp=1",
    ),
    _cell(
        "cp",
        "segments",
        "each segment sharded over cp alike; its ring carries the earlier segments' keys",
    ),
    _cell("cp", "recompute", "the replay gathers the keys and values again"),
    _cell(
        "cp",
        "overlap",
        "both halves would run the cp group's gathers at once, in an order the cp ranks could "
        "differ on",
        "use a schedule without overlap, or cp=1",
    ),
    _cell("cp", "ties", "the tie is reduced after the cp and dp sums"),
    _cell("cp", "random", "each cp rank draws by (step, stage, microbatch), as a dp rank does"),
    _cell("segments", "recompute", "a checkpointed region takes the past K/V as inputs"),
    _cell("segments", "overlap", "a pair is two units of different stages"),
    _cell("segments", "ties", "the tie is reduced once per step"),
    _cell("segments", "random", "each unit seeds by its segment"),
    _cell("recompute", "overlap", "the replay holds the stage's generator lock"),
    _cell("recompute", "ties", "recompute changes no arithmetic"),
    _cell("recompute", "random", "the replay draws from F's generator state"),
    _cell("overlap", "ties", "the tie is reduced after the step"),
    _cell("overlap", "random", "the forward holds the stage's generator lock"),
    _cell("ties", "random", "the replicas draw by their stage"),
)
"""Every pair of :data:`FEATURES`, once."""

TRIPLES: tuple[Cell, ...] = (
    _cell(
        "cp",
        "tp",
        "segments",
        "the cp x tp ground truth plays this process's cp rank with tp's reference, which "
        "does not cut the cp chunks into segments",
        "use a schedule without segments, or tp=1, with cp",
    ),
)
"""Sets of three features refused although each of their pairs composes."""


def cell(a: str, b: str) -> Cell:
    """The cell of features ``a`` and ``b`` (either order)."""
    for c in CELLS:
        if set(c.pair) == {a, b}:
            return c
    raise ValueError(f"no composition cell for {a!r} and {b!r}; features: {', '.join(FEATURES)}")


def closure(features: Iterable[str]) -> set[str]:
    """``features`` with what they imply (:data:`IMPLIES`)."""
    out = set(features)
    for f in list(out):
        if f not in FEATURES:
            raise ValueError(f"unknown feature {f!r}; features: {', '.join(FEATURES)}")
        if f in IMPLIES:
            out.add(IMPLIES[f])
    return out


def refusal(features: Iterable[str]) -> Cell | None:
    """The first refused cell (table order, pairs before triples) inside ``features``, or
    None."""
    on = closure(features)
    for c in (*CELLS, *TRIPLES):
        if not c.composes and set(c.pair) <= on:
            return c
    return None


def check(features: Iterable[str], where: str) -> None:
    """Raise ValueError if ``features`` include a refused cell: ``where`` (the job's words
    for what was asked, e.g. ``"build_mesh(tp=2, ep=2)"``), the features, the reason and
    the fix."""
    c = refusal(features)
    if c is not None:
        names = " with ".join(FEATURES[f] for f in c.pair)
        raise ValueError(f"{where}: {names} is not supported ({c.why}); {c.fix}")


def markdown() -> str:
    """The composition table of ``docs/scale.md``: a grid of the pairs, then each refused
    pair's reason and fix."""
    keys = list(FEATURES)
    refused = [c for c in (*CELLS, *TRIPLES) if not c.composes]
    mark = {c.pair: f"no ({refused.index(c) + 1})" for c in refused}
    rows = ["| | " + " | ".join(keys[1:]) + " |", "|---" * len(keys) + "|"]
    for i, a in enumerate(keys[:-1]):
        row = [("" if j <= i else mark.get((a, b), "yes")) for j, b in enumerate(keys) if j]
        rows.append(f"| **{a}** | " + " | ".join(row) + " |")
    notes = [f"{n}. {' with '.join(c.pair)}: {c.why}; {c.fix}" for n, c in enumerate(refused, 1)]
    legend = [f"- `{k}`: {v}" for k, v in FEATURES.items()]
    return "\n".join([*legend, "", *rows, "", *notes]) + "\n"
