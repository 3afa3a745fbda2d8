"""Schedule generators: pure functions from (P, M, options) to an immutable Schedule.

``GENERATORS`` maps each kind name (the CLI's ``KIND``) to a :class:`Generator`
that records which options the kind understands, so a caller asking for an
option a kind ignores gets an error instead of a silently different schedule.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import import_module
from types import MappingProxyType

from zerobubble.schedule.costs import CostSpec, Number
from zerobubble.schedule.generators.classic import gpipe, interleaved_1f1b, one_f_one_b
from zerobubble.schedule.generators.dualpipe import dualpipev
from zerobubble.schedule.generators.sequence import seq1f1b, seq_zb, seq_zbv
from zerobubble.schedule.generators.v_family import one_f_one_b_v, v_half, v_min
from zerobubble.schedule.generators.zero_bubble import zb_h1, zb_h2, zbv
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.passes import overlap_where_it_pays

__all__ = [
    "GENERATORS",
    "Generator",
    "NoPairWarning",
    "dualpipev",
    "generate",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "one_f_one_b_v",
    "seq1f1b",
    "seq_zb",
    "seq_zbv",
    "v_half",
    "v_min",
    "zb_h1",
    "zb_h2",
    "zbv",
]


@dataclass(frozen=True)
class Generator:
    """A schedule kind.

    Attributes:
        name: The kind's name on the command line.
        fn: ``fn(P, M, **options) -> Schedule``.
        summary: One line for ``--help`` and the docs.
        options: The keyword options ``fn`` accepts, among ``chunks``,
            ``split_backward``, ``costs`` (a :class:`CostSpec`), ``mem_limit``,
            ``max_stages`` (a layer count the search keeps within), ``time_budget_s``
            (seconds after which the search returns its best so far), ``segments``
            (sequence segments per microbatch) and ``overlap`` (overlapped F&B pairs).
        baseline: True for schedules without a B/W split (kept for comparison).
        segmented: True for the kinds that always cut sequences into segments (``seq*``,
            k = 2 by default), whose schedules need the runtime's ``cuts``; ``auto`` takes
            ``segments`` too, as a bound, and cuts only where that pays.
    """

    name: str
    fn: Callable[..., Schedule]
    summary: str
    options: frozenset[str] = frozenset()
    baseline: bool = False
    segmented: bool = False


@dataclass(frozen=True)
class _Lazy:
    """A search kind's generator, imported on first call: ``schedule.search`` builds on the
    generators above, so importing it here would be circular.

    ``fixed`` are keyword arguments every call passes (``v_shape`` for optimal-v);
    ``renamed`` maps a ``generate`` option to the search function's own name for it
    (auto's ``chunks`` caps its ``max_chunks``).
    """

    module: str
    attr: str
    fixed: tuple[tuple[str, object], ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()

    def __call__(self, num_devices: int, num_microbatches: int, **options: object) -> Schedule:
        fn: Callable[..., Schedule] = getattr(import_module(self.module), self.attr)
        names = dict(self.renamed)
        kwargs = {names.get(k, k): v for k, v in options.items()}
        return fn(num_devices, num_microbatches, **dict(self.fixed), **kwargs)


_SEARCH = "zerobubble.schedule.search."
_auto = _Lazy(_SEARCH + "placement", "auto", renamed=(("chunks", "max_chunks"),))
_zb_auto = _Lazy(_SEARCH + "fixed", "zb_auto")
_zbv_auto = _Lazy(_SEARCH + "fixed", "zbv_auto")
_optimal = _Lazy(_SEARCH + "milp", "optimal")
_optimal_v = _Lazy(_SEARCH + "milp", "optimal", fixed=(("v_shape", True),))

_SEARCH_OPTIONS = frozenset({"costs", "mem_limit"})

_KINDS = (
    Generator(
        "gpipe", gpipe, "all forwards, then all backwards", frozenset({"split_backward"}), True
    ),
    Generator(
        "1f1b",
        one_f_one_b,
        "one forward, one backward (PipeDream-Flush)",
        frozenset({"split_backward"}),
        True,
    ),
    Generator(
        "interleaved-1f1b",
        interleaved_1f1b,
        "Megatron interleaved 1F1B, v chunks per device, looped placement",
        frozenset({"chunks", "split_backward"}),
        True,
    ),
    Generator("zb-h1", zb_h1, "Zero Bubble H1: 1F1B memory, 1/3 of its bubble"),
    Generator("zb-h2", zb_h2, "Zero Bubble H2: zero bubble with 2P-1 microbatches in flight"),
    Generator("zbv", zbv, "Zero Bubble V: V placement, zero bubble at 1F1B memory"),
    # V-shaped building blocks (Qi et al., 2024) and DeepSeek's DualPipeV: any P, M >= 1.
    Generator("v-half", v_half, "V-Half: V placement, about 1/2 of 1F1B's memory"),
    Generator("v-min", v_min, "V-Min: V placement, about 1/3 of 1F1B's memory"),
    Generator(
        "1f1b-v",
        one_f_one_b_v,
        "1F1B-V: V placement without B/W split, about 2/3 of 1F1B's memory",
        frozenset({"split_backward"}),
        True,
    ),
    Generator(
        "seq1f1b",
        seq1f1b,
        "Seq1F1B: 1F1B over k sequence segments per microbatch (default k=2)",
        frozenset({"segments", "split_backward"}),
        True,
        segmented=True,
    ),
    Generator(
        "seq-zb",
        seq_zb,
        "ZB-H1 over k sequence segments per microbatch: Seq1F1B's memory, a third of its bubble",
        frozenset({"segments"}),
        segmented=True,
    ),
    Generator(
        "seq-zbv",
        seq_zbv,
        "ZB-V over k sequence segments per microbatch: seq-zb's peak memory, no bubble",
        frozenset({"segments"}),
        segmented=True,
    ),
    Generator(
        "dualpipev",
        dualpipev,
        "DeepSeek's DualPipeV: DualPipe cut in half onto the V placement",
        frozenset({"overlap"}),
    ),
    Generator(
        "auto",
        _auto,
        "best placement (1..4 chunks per device, looped or V) and schedule for the given "
        "costs and memory limit (default P); chunks caps the chunks per device, segments K "
        "also tries 2..K sequence segments per microbatch",
        _SEARCH_OPTIONS | {"chunks", "max_stages", "time_budget_s", "overlap", "segments"},
    ),
    Generator(
        "zb-auto",
        _zb_auto,
        "automatic zero bubble for the given costs and memory limit (default P: ZB-1p); "
        "chunks > 1 interleaves",
        _SEARCH_OPTIONS | {"chunks", "overlap"},
    ),
    Generator(
        "zbv-auto",
        _zbv_auto,
        "automatic ZB-V for the given costs and memory limit (default P)",
        _SEARCH_OPTIONS | {"overlap"},
    ),
    Generator(
        "optimal",
        _optimal,
        "exact optimum by MILP for small P*M (default memory limit 2P); chunks > 1 interleaves",
        _SEARCH_OPTIONS | {"chunks"},
    ),
    Generator(
        "optimal-v",
        _optimal_v,
        "exact optimum by MILP on the V placement for small P*M (default memory limit 2P)",
        _SEARCH_OPTIONS,
    ),
)

GENERATORS: Mapping[str, Generator] = MappingProxyType({g.name: g for g in _KINDS})
"""Every kind by name. A fixed table, built once at import and read-only (not a registry:
a new kind is one entry in ``_KINDS``)."""


def generate(
    kind: str,
    num_devices: int,
    num_microbatches: int,
    *,
    chunks: int | None = None,
    split_backward: bool = False,
    costs: CostSpec | None = None,
    mem_limit: Number | None = None,
    max_stages: int | None = None,
    time_budget_s: float | None = None,
    segments: int | None = None,
    overlap: bool = False,
) -> Schedule:
    """Build a schedule of ``kind``; options the kind does not use are an error.

    ``max_stages`` (e.g. the model's layer count: a stage holds a layer at least) is
    for every kind: ``auto`` searches only placements within it, any other kind whose
    schedule has more stages is refused, naming both counts. ``overlap`` pairs F&B as
    DualPipe does for ``dualpipev`` (its own pairs), and for any other kind where a pair
    pays under ``costs`` (:func:`~zerobubble.schedule.passes.overlap_where_it_pays`; none
    without an all-to-all cost). ``segments`` is k, the sequence segments per microbatch, for
    the seq kinds, and for ``auto`` the most it tries (the schedule's ``segments`` says which
    k it chose). ``time_budget_s`` (``auto``)
    returns the best schedule found within that many seconds; without it every kind is
    a pure function of its arguments.
    """
    try:
        gen = GENERATORS[kind]
    except KeyError:
        raise ValueError(
            f"unknown schedule kind {kind!r}; choose one of: {', '.join(GENERATORS)}"
        ) from None
    given = {
        "chunks": chunks,
        "split_backward": split_backward or None,
        "costs": costs,
        "mem_limit": mem_limit,
        "max_stages": max_stages,
        "time_budget_s": time_budget_s,
        "segments": segments,
        "overlap": overlap or None,
    }
    kwargs = {}
    for key, value in given.items():
        if value is None:
            continue
        if key not in gen.options:
            if key == "costs":  # costs only matter to cost-aware kinds; timing uses them anyway
                continue
            if key in ("max_stages", "overlap"):  # both applied to the result below
                continue
            if key == "mem_limit" and overlap:  # bounds the pairs the pass forms
                continue
            raise ValueError(
                f"schedule kind {kind!r} does not take option {key!r} "
                f"(it takes: {', '.join(sorted(gen.options)) or 'no options'})"
            )
        kwargs[key] = value
    sched = gen.fn(num_devices, num_microbatches, **kwargs)
    if overlap and "overlap" not in gen.options:  # pairs where they pay under the costs
        model = None if costs is None else costs.resolve(sched.placement, sched.segments)
        sched = overlap_where_it_pays(sched, model, None if mem_limit is None else float(mem_limit))
    if overlap and not sched.overlaps:
        _no_pair(kind, sched, costs, searched=kind == "auto" and (chunks is None or chunks > 1))
    if max_stages is not None and sched.num_stages > max_stages:
        raise ValueError(
            f"schedule kind {kind!r} makes {sched.num_stages} stages, more than "
            f"max_stages={max_stages} (the layers to cut); pick fewer chunks, a kind with "
            "one stage per device, or 'auto' (which keeps within max_stages)"
        )
    return sched


class NoPairWarning(UserWarning):
    """``overlap=True`` formed no overlapped pair: the schedule runs every action alone."""


def _no_pair(kind: str, sched: Schedule, costs: CostSpec | None, *, searched: bool) -> None:
    """Say why ``overlap=True`` gave no pair: a ValueError where none can exist (one stage
    per device: a pair needs two stages on a device), else a :class:`NoPairWarning`.
    ``searched``: the kind chose among placements, some of which can pair (``auto``)."""
    if len(set(sched.placement)) == sched.num_stages and not searched:
        raise ValueError(
            f"schedule kind {kind!r} places one stage per device, and an overlapped pair is "
            "an F and a backward of two different stages on one device; choose a kind with "
            "several stages per device (dualpipev, zbv, seq-zbv, interleaved-1f1b, auto) or "
            "drop overlap"
        )
    if costs is None or not any(costs.resolve(sched.placement, sched.segments).a2a):
        why = "no all-to-all cost was given (costs=..., a2a=X)"
    elif "overlap" in GENERATORS[kind].options and kind != "dualpipev":
        why = "no paired schedule the search found was cheaper than its best unpaired one"
    else:
        why = "no candidate hid all-to-all without lengthening the step"
    warnings.warn(
        f"schedule kind {kind!r} with overlap=True formed no overlapped F&B pair: {why}; "
        "every action runs alone",
        NoPairWarning,
        stacklevel=3,
    )
