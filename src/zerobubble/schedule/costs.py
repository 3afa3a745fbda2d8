"""Cost and memory model consumed by the simulator and the schedule search.

Times and memory are plain Python numbers. Pass ``fractions.Fraction`` values
to get exact arithmetic (the tests do, to assert closed forms); floats are the
fast default.

Memory is counted per virtual stage: an F allocates ``mem_f[s]`` (the state B
needs, M_B); B keeps ``mem_w[s]`` of it (the state W needs, M_W) and frees the
rest; W frees ``mem_w[s]``; BW frees all of ``mem_f[s]``. With the defaults a
device's units are "one microbatch's activations over all of that device's
layers", so a device holding v chunks allocates 1/v per chunk F.

Activation checkpointing (:meth:`CostModel.with_recompute`) changes three terms:
F keeps only the checkpointed inputs (``mem_f`` becomes what they take), B runs
the forward again before the input gradient (``b`` grows by the recomputed part
of ``f``) and rebuilds what W needs (``mem_w`` is unchanged, and may now exceed
``mem_f``: B allocates ``mem_w - mem_f``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import TypeAlias, TypeGuard

from zerobubble.schedule.formats.json_format import read_json
from zerobubble.schedule.ir import Op

#: A time or memory amount: ints and floats, or Fractions for exact arithmetic.
Number: TypeAlias = int | float | Fraction

#: The largest duration or memory amount a cost model takes. Nothing real comes near it
#: in any unit (1e15 ns are 11 days, 1e15 bytes a petabyte), and sums over the largest
#: schedule the command line builds (1e8 actions) stay finite: a value like 1e308 would
#: make a makespan of inf, which no exact (Fraction) arithmetic or drawing survives.
MAX_AMOUNT = 1e15


def _amount_error(x: object) -> str | None:
    """Why ``x`` is no duration or memory amount, or None if it is one."""
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return "must be a number"
    if math.isnan(v):
        return "must be a number, not NaN"
    if v < 0:
        return "must be >= 0"
    if not v <= MAX_AMOUNT:
        return f"must be finite and at most {MAX_AMOUNT:g} (no real stage takes that much)"
    return None


def _div(x: Number, v: int) -> Number:
    """Divide, staying exact for Fractions and for ints that divide evenly.

    Anything else becomes a float: Fraction arithmetic is ~50x slower, so
    exactness is opt-in (pass Fractions).
    """
    if isinstance(x, Fraction):
        q = x / v
        return q.numerator if q.denominator == 1 else q
    if isinstance(x, int) and x % v == 0:
        return x // v
    return x / v


@dataclass(frozen=True)
class CostModel:
    """Per-virtual-stage durations and memory deltas.

    Attributes:
        f, b, w: Duration of F, B and W of each virtual stage. BW costs b + w.
        comm: Latency added to every dependency that crosses devices. It delays
            the consumer but does not occupy either device's compute.
        mem_f: Memory an F allocates (M_B of the stage).
        mem_w: Memory still held after B until W (M_W of the stage, <= mem_f unless
            ``recompute``).
        recompute: B recomputes the forward (see :meth:`with_recompute`), so it may
            allocate: ``mem_w`` may exceed ``mem_f``.
        reduce: Duration of the data-parallel all-reduce of each stage's gradients
            (default 0: no dp). It runs on the device's comm lane, not its compute:
            see :attr:`~zerobubble.schedule.simulate.SimResult.reductions`.
        host_f, host_b, host_w: The part of f, b, w that is host work after the op
            (recording it, sending its output, posting receives, dispatching the
            next; default 0). It occupies the device like compute, so the durations
            include it; it is kept apart only so that a prediction can be read as a
            trace is: a trace counts it as idle ("overhead"), not as compute (see
            :attr:`~zerobubble.schedule.simulate.SimResult.host`).
        segment_time, segment_memory: For a schedule of k sequence segments per
            microbatch, one factor per segment (0 = the sequence's start) that scales
            the compute of that segment's actions (their durations less the host tails)
            and their memory deltas (default: all 1). The per-stage terms are then those
            of a mean segment; unequal cuts make unequal segments
            (:func:`~zerobubble.schedule.segments.segment_model`).
        kv_grad, segment_tokens: For a schedule of k sequence segments, per virtual stage
            the memory of a mean segment's key and value gradients (default 0), and per
            segment its tokens over the mean segment's (default all 1). A segment's later
            segments send gradients into its keys and values, summed on the stage from the
            last segment's backward (which reads every earlier segment) until the segment's
            own: the last segment's backward allocates ``kv_grad[s] * segment_tokens[j]``
            for each earlier segment ``j``, and segment ``j``'s backward frees its part
            (:meth:`unit_memory_delta`).
        stage_segment_memory: Per virtual stage, per segment, the memory factor of that
            segment on that stage, in place of ``segment_memory`` (default: none; a
            stage's layers save per token, per query-key pair and per key in their own
            mix, so each stage splits its memory over the segments its own way).
        a2a: Per virtual stage, the all-to-all time (a mixture of experts' dispatch and
            combine) of each F and each backward (B or BW) of the stage, on the device's
            comm lane; default 0. A lone action waits for it, so it counts in the
            action's :meth:`duration`; an overlapped F&B pair
            (:attr:`~zerobubble.schedule.ir.Schedule.overlaps`) hides each one's behind
            the other's compute, taking ``max(compute, all-to-all)`` of the two together
            (:meth:`overlapped`).
    """

    f: tuple[Number, ...]
    b: tuple[Number, ...]
    w: tuple[Number, ...]
    comm: Number = 0
    mem_f: tuple[Number, ...] = ()
    mem_w: tuple[Number, ...] = ()
    recompute: bool = False
    reduce: tuple[Number, ...] = ()
    host_f: tuple[Number, ...] = ()
    host_b: tuple[Number, ...] = ()
    host_w: tuple[Number, ...] = ()
    segment_time: tuple[Number, ...] = ()
    segment_memory: tuple[Number, ...] = ()
    a2a: tuple[Number, ...] = ()
    kv_grad: tuple[Number, ...] = ()
    segment_tokens: tuple[Number, ...] = ()
    stage_segment_memory: tuple[tuple[Number, ...], ...] = ()

    def __post_init__(self) -> None:
        _settle(self)

    @property
    def num_stages(self) -> int:
        return len(self.f)

    def with_stages_from(self, other: CostModel, stages: Iterable[int]) -> CostModel:
        """A copy whose ``stages`` take ``other``'s durations and memory (``comm`` stays).

        For a schedule whose stages run differently, e.g. some with the backward
        split and some fused: each stage is costed by what it runs.
        """
        if other.num_stages != self.num_stages:
            raise ValueError(
                f"cannot mix cost models of {self.num_stages} and {other.num_stages} stages"
            )
        take = set(stages)

        def pick(name: str) -> tuple[Number, ...]:
            mine, theirs = getattr(self, name), getattr(other, name)
            return tuple(theirs[s] if s in take else x for s, x in enumerate(mine))

        return replace(
            self,
            f=pick("f"),
            b=pick("b"),
            w=pick("w"),
            mem_f=pick("mem_f"),
            mem_w=pick("mem_w"),
            host_f=pick("host_f"),
            host_b=pick("host_b"),
            host_w=pick("host_w"),
            recompute=self.recompute or other.recompute,
        )

    def with_recompute(
        self, kept: Sequence[Number], share: Number | Sequence[Number] = 1
    ) -> CostModel:
        """The costs under activation checkpointing, derived from the plain ones.

        ``kept[s]``: what stage s's F keeps per microbatch (the checkpointed inputs, in
        ``mem_f``'s units); ``share``: the fraction of F's work that B recomputes (1 for
        a whole stage; for checkpointed layers, their part of F), per stage or for all.
        Then ``b' = b + share * f`` (so BW costs ``b + share * f + w``), ``mem_f' = kept``
        and ``mem_w`` stays: B rebuilds exactly the state W needs, so B allocates
        ``mem_w - kept`` where that is positive. F and W are unchanged.
        """
        n = self.num_stages
        shares = [share] * n if not isinstance(share, Sequence) else list(share)
        for name, xs in (("kept", kept), ("share", shares)):
            if len(xs) != n:
                raise ValueError(
                    f"with_recompute: {name!r} has {len(xs)} entries, expected one per "
                    f"virtual stage ({n})"
                )
        for s, x in enumerate(shares):
            if not 0 <= x <= 1:
                raise ValueError(f"with_recompute: share[{s}]={x} must be in [0, 1]")
        return replace(
            self,
            b=tuple(b + x * f for b, x, f in zip(self.b, shares, self.f, strict=True)),
            mem_f=tuple(kept),
            recompute=True,
        )

    def per_segment(self, segments: int) -> CostModel:
        """The model of one of ``segments`` equal segments: every compute and memory term 1/k
        of this (per-microbatch) model's. A host tail is per action (recording, posting,
        dispatching), not per token, so each segment's action keeps it whole; ``comm`` and
        ``reduce`` stay."""

        def part(xs: tuple[Number, ...]) -> tuple[Number, ...]:
            return tuple(_div(x, segments) for x in xs)

        def compute(xs: tuple[Number, ...], host: tuple[Number, ...]) -> tuple[Number, ...]:
            return tuple(_div(x - h, segments) + h for x, h in zip(xs, host, strict=True))

        return replace(
            self,
            f=compute(self.f, self.host_f),
            b=compute(self.b, self.host_b),
            w=compute(self.w, self.host_w),
            mem_f=part(self.mem_f),
            mem_w=part(self.mem_w),
            a2a=part(self.a2a),
            kv_grad=part(self.kv_grad),
        )

    def segment_scales(self, segments: int) -> tuple[tuple[Number, ...], tuple[Number, ...]]:
        """The time and memory factor of each of ``segments`` segments (1 where unset)."""
        return (
            self.segment_factors("segment_time", segments),
            self.segment_factors("segment_memory", segments),
        )

    def segment_factors(self, name: str, segments: int) -> tuple[Number, ...]:
        """The per-segment factors ``name`` of ``segments`` segments (1 where unset)."""
        xs: tuple[Number, ...] = getattr(self, name)
        if xs and len(xs) != segments:
            raise ValueError(
                f"cost model has {len(xs)} {name} factors, the schedule {segments} "
                "segments per microbatch"
            )
        return xs or (1,) * segments

    def segment_memory_factor(self, stage: int, segment: int, segments: int) -> Number:
        """What segment ``segment`` of ``segments`` holds on ``stage`` over a mean
        segment's: :attr:`stage_segment_memory` where given, else ``segment_memory``."""
        if not self.stage_segment_memory:
            return self.segment_factors("segment_memory", segments)[segment]
        row = self.stage_segment_memory[stage]
        if len(row) != segments:
            raise ValueError(
                f"cost model has {len(row)} stage_segment_memory factors per stage, the "
                f"schedule {segments} segments per microbatch"
            )
        return row[segment]

    def unit_memory_delta(self, op: Op, stage: int, segment: int, segments: int) -> Number:
        """Net memory change when ``op`` of ``stage`` completes on segment ``segment`` of
        ``segments``: :meth:`memory_delta` scaled by the segment's :attr:`segment_memory`,
        and a backward's change in the key and value gradient sums (:attr:`kv_grad`)."""
        delta = self.memory_delta(op, stage)
        if segments == 1:
            return delta
        delta = delta * self.segment_memory_factor(stage, segment, segments)
        kv = self.kv_grad[stage]
        if op in (Op.B, Op.BW) and kv:
            tokens = self.segment_factors("segment_tokens", segments)
            if segment == segments - 1:  # the sums of every earlier segment start here
                delta = delta + kv * sum(tokens[:-1])
            else:  # the segment's own sum is consumed
                delta = delta - kv * tokens[segment]
        return delta

    def duration(self, op: Op, stage: int) -> Number:
        """How long ``op`` takes on virtual stage ``stage``."""
        match op:
            case Op.F:
                return self.f[stage] + self.a2a[stage]
            case Op.B:
                return self.b[stage] + self.a2a[stage]
            case Op.W:
                return self.w[stage]
            case Op.BW:
                return self.b[stage] + self.w[stage] + self.a2a[stage]
        raise AssertionError(op)  # pragma: no cover

    def a2a_time(self, op: Op, stage: int) -> Number:
        """Of :meth:`duration`, the all-to-all part (none for W)."""
        return 0 if op is Op.W else self.a2a[stage]

    def overlapped(self, f_stage: int, b_op: Op, b_stage: int) -> tuple[Number, Number]:
        """An overlapped pair's block (F of ``f_stage``, then ``b_op`` of ``b_stage``): its
        duration, ``max(compute, all-to-all)`` of the two together (each one's
        all-to-all runs while the other computes), and the all-to-all left exposed."""
        comm = self.a2a[f_stage] + self.a2a_time(b_op, b_stage)
        compute = self.duration(Op.F, f_stage) + self.duration(b_op, b_stage) - comm
        return max(compute, comm), max(comm - compute, 0)

    def host_time(self, op: Op, stage: int) -> Number:
        """Of :meth:`duration`, the host part (see the class docstring)."""
        match op:
            case Op.F:
                return self.host_f[stage]
            case Op.B:
                return self.host_b[stage]
            case Op.W:
                return self.host_w[stage]
            case Op.BW:
                return self.host_b[stage] + self.host_w[stage]
        raise AssertionError(op)  # pragma: no cover

    def hop(self, op: Op, stage: int) -> Number:
        """From the end of ``op`` of ``stage`` to when a consumer of its output on another
        device may start: ``comm`` from the end of its compute, which is its end minus its
        host tail (the message leaves before the tail's other work is done)."""
        return self.comm - self.host_time(op, stage)

    def memory_delta(self, op: Op, stage: int) -> Number:
        """Net memory change when ``op`` of ``stage`` completes."""
        match op:
            case Op.F:
                return self.mem_f[stage]
            case Op.B:
                return -(self.mem_f[stage] - self.mem_w[stage])
            case Op.W:
                return -self.mem_w[stage]
            case Op.BW:
                return -self.mem_f[stage]
        raise AssertionError(op)  # pragma: no cover

    # ---- constructors ----------------------------------------------------------------------

    @classmethod
    def from_device_totals(
        cls,
        placement: Sequence[int],
        F: Number = 1,
        B: Number = 1,
        W: Number = 1,
        comm: Number = 0,
        mem_w: Number = 0.5,
        segments: int = 1,
        a2a: Number = 0,
    ) -> CostModel:
        """Uniform costs given as per-device totals of one microbatch.

        A device holding v chunks spends F/v, B/v, W/v (and ``a2a``/v of all-to-all in
        each F and each backward) per chunk and allocates
        1/v (of its M_B) per chunk F; ``mem_w`` is r = M_W / M_B. With k
        ``segments`` per microbatch every term is that of one segment, 1/k of it
        (equal segments; :attr:`segment_time` and :attr:`segment_memory` make them
        unequal).
        """
        # Exact in, exact out: one Fraction among the inputs makes memory exact too.
        unit = Fraction(1) if any(isinstance(x, Fraction) for x in (F, B, W, mem_w)) else 1
        counts: dict[int, int] = {}
        for d in placement:
            counts[d] = counts.get(d, 0) + 1
        vs = [counts[d] * segments for d in placement]
        if type(segments) is not int or segments < 1:
            raise ValueError(f"segments must be an integer >= 1, got {segments!r}")
        if not 0 <= mem_w <= 1:
            raise ValueError(f"mem_w ratio r={mem_w} must be in [0, 1]")
        return cls(
            f=tuple(_div(F, v) for v in vs),
            b=tuple(_div(B, v) for v in vs),
            w=tuple(_div(W, v) for v in vs),
            comm=comm,
            mem_f=tuple(_div(unit, v) for v in vs),
            mem_w=tuple(_div(mem_w, v) for v in vs),
            a2a=tuple(_div(a2a, v) for v in vs),
        )

    @classmethod
    def per_stage(
        cls,
        f: Sequence[Number],
        b: Sequence[Number],
        w: Sequence[Number],
        comm: Number = 0,
        mem_f: Sequence[Number] | None = None,
        mem_w: Sequence[Number] | None = None,
        recompute: bool = False,
        host: Mapping[str, Sequence[Number]] | None = None,
        a2a: Sequence[Number] = (),
    ) -> CostModel:
        """Costs given as one value per virtual stage (e.g. from a profile); ``host``:
        the host part of F, B and W (keys ``F``, ``B``, ``W``, any subset); ``a2a``: the
        all-to-all time of each F and backward (see :attr:`a2a`)."""
        host = host or {}
        return cls(
            tuple(f),
            tuple(b),
            tuple(w),
            comm,
            tuple(mem_f or ()),
            tuple(mem_w or ()),
            recompute,
            host_f=tuple(host.get("F", ())),
            host_b=tuple(host.get("B", ())),
            host_w=tuple(host.get("W", ())),
            a2a=tuple(a2a),
        )

    def to_dict(self) -> dict[str, object]:
        return _as_dict(self)


def _settle(m: CostModel) -> None:
    """Normalise ``m``'s fields to tuples (defaults filled) and check every amount: the
    model's ``__post_init__``."""
    n = len(m.f)
    rows = tuple(tuple(row) for row in m.stage_segment_memory)
    object.__setattr__(m, "stage_segment_memory", rows)
    if rows and (len(rows) != n or len({len(row) for row in rows}) != 1):
        raise ValueError(
            f"stage_segment_memory needs one row per virtual stage ({n}), all of one "
            f"length, got {[len(row) for row in rows]}"
        )
    for s, row in enumerate(rows):
        for i, x in enumerate(row):
            if why := _amount_error(x):
                raise ValueError(f"stage_segment_memory[{s}][{i}]={x} {why}")
    for name in ("segment_time", "segment_memory", "segment_tokens"):
        object.__setattr__(m, name, tuple(getattr(m, name)))
        for i, x in enumerate(getattr(m, name)):
            if why := _amount_error(x):
                raise ValueError(f"{name}[{i}]={x} {why}")
    for name in ("host_f", "host_b", "host_w"):
        object.__setattr__(m, name, tuple(getattr(m, name)) or (0,) * n)
    for name in ("reduce", "a2a", "kv_grad"):  # per stage, 0 by default
        xs = tuple(getattr(m, name)) or (0,) * n
        object.__setattr__(m, name, xs)
        if len(xs) != n or any(_amount_error(x) for x in xs):
            raise ValueError(
                f"{name}={list(xs)} must hold one finite number >= 0 (at most "
                f"{MAX_AMOUNT:g}) per virtual stage ({n})"
            )
    for name in ("f", "b", "w", "mem_f", "mem_w"):
        object.__setattr__(m, name, tuple(getattr(m, name)))
    if not m.mem_f:
        object.__setattr__(m, "mem_f", (1,) * n)
    if not m.mem_w:
        object.__setattr__(m, "mem_w", tuple(_div(m, 2) for m in m.mem_f))
    for name in ("b", "w", "mem_f", "mem_w", "host_f", "host_b", "host_w"):
        if len(getattr(m, name)) != n:
            raise ValueError(
                f"cost array {name!r} has {len(getattr(m, name))} entries, "
                f"expected one per virtual stage ({n})"
            )
    for name in ("f", "b", "w", "mem_f", "mem_w"):
        for s, x in enumerate(getattr(m, name)):
            if why := _amount_error(x):
                raise ValueError(f"{name}[{s}]={x} {why}")
    if why := _amount_error(m.comm):
        raise ValueError(f"comm={m.comm} {why}")
    for s, (mf, mw) in enumerate(zip(m.mem_f, m.mem_w, strict=True)):
        if mw > mf and not m.recompute:
            raise ValueError(
                f"mem_w[{s}]={mw} exceeds mem_f[{s}]={mf}: W cannot hold more than F allocated"
            )
    for name, whole in (("host_f", m.f), ("host_b", m.b), ("host_w", m.w)):
        for s, (x, t) in enumerate(zip(getattr(m, name), whole, strict=True)):
            if (why := _amount_error(x)) or x > t:
                raise ValueError(
                    f"{name}[{s}]={x} {why or f'exceeds {name[-1]}[{s}]={t}'}: the host "
                    "part of an op is part of its duration"
                )


def _as_dict(m: CostModel) -> dict[str, object]:
    """``m`` as the costs file writes it (only what differs from the defaults)."""
    out: dict[str, object] = {
        "F": [float(x) for x in m.f],
        "B": [float(x) for x in m.b],
        "W": [float(x) for x in m.w],
        "comm": float(m.comm),
        "mem_B": [float(x) for x in m.mem_f],
        "mem_W": [float(x) for x in m.mem_w],
    }
    if m.recompute:
        out["recompute"] = True
    for name in ("segment_time", "segment_memory", "segment_tokens"):
        if getattr(m, name):
            out[name] = [float(x) for x in getattr(m, name)]
    if any(m.kv_grad):
        out["kv_grad"] = [float(x) for x in m.kv_grad]
    if m.stage_segment_memory:
        out["stage_segment_memory"] = [[float(x) for x in r] for r in m.stage_segment_memory]
    if any(m.a2a):
        out["a2a"] = [float(x) for x in m.a2a]
    if any(m.host_f) or any(m.host_b) or any(m.host_w):
        out["host"] = {
            op: [float(x) for x in xs]
            for op, xs in (("F", m.host_f), ("B", m.host_b), ("W", m.host_w))
        }
    return out


@dataclass(frozen=True)
class CostSpec:
    """What a user typed: per-device totals (``--costs``) or a per-stage file.

    ``resolve`` turns it into a :class:`CostModel` for a concrete placement, so
    the same spec serves schedules with different chunk counts.
    """

    F: Number = 1
    B: Number = 1
    W: Number = 1
    comm: Number = 0
    mem_w: Number = 0.5
    stage_costs: CostModel | None = None
    mem_limit: Number | None = None
    recompute: Number | None = None
    """Whole-stage activation checkpointing: F keeps this fraction of its M_B and B
    recomputes F (:meth:`CostModel.with_recompute`); None: no checkpointing."""
    a2a: Number = 0
    """All-to-all time of each F and each backward, per device (:attr:`CostModel.a2a`)."""

    def resolve(self, placement: Sequence[int], segments: int = 1) -> CostModel:
        """The model of ``placement``, per sequence segment when ``segments`` > 1 (each term
        1/k of the microbatch's)."""
        if self.stage_costs is not None and segments > 1:
            return replace(self, stage_costs=self.stage_costs.per_segment(segments)).resolve(
                placement
            )
        if self.stage_costs is not None:
            if self.stage_costs.num_stages != len(placement):
                raise ValueError(
                    f"the costs file describes {self.stage_costs.num_stages} virtual stages "
                    f"but the schedule has {len(placement)}; regenerate the profile for this "
                    "partition or pick a schedule with that many stages"
                )
            model = self.stage_costs
        else:
            model = CostModel.from_device_totals(
                placement, self.F, self.B, self.W, self.comm, self.mem_w, segments, self.a2a
            )
        if self.recompute is None:
            return model
        return model.with_recompute([self.recompute * m for m in model.mem_f])


def parse_costs(text: str, mem_w: Number | None = None) -> CostSpec:
    """Parse ``F=1,B=1,W=1,comm=0`` (any subset, any order)."""
    values: dict[str, Number] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in {"F", "B", "W", "comm", "recompute", "a2a"}:
            raise ValueError(
                f"cannot parse cost {part!r}: expected KEY=NUMBER with KEY one of F, B, W, comm, "
                "recompute, a2a (e.g. --costs F=1,B=1,W=0.5,comm=0.1; recompute=0.05: F keeps "
                "5% of its activations and B recomputes it; a2a=0.5: each F and backward also "
                "waits 0.5 for its all-to-all, unless overlapped)"
            )
        values[key] = x = _parse_number(raw.strip(), part)
        if _amount_error(x):
            raise ValueError(
                f"cost {part!r}: must be a finite number >= 0 and at most {MAX_AMOUNT:g}"
            )
    default = CostSpec()
    spec = CostSpec(
        F=values.get("F", default.F),
        B=values.get("B", default.B),
        W=values.get("W", default.W),
        comm=values.get("comm", default.comm),
        recompute=values.get("recompute"),
        a2a=values.get("a2a", default.a2a),
    )
    if spec.F + spec.B + spec.W == 0:
        raise ValueError(
            f"costs {text!r}: F + B + W is 0, so every schedule takes no time and its bubble "
            "rate means nothing; give F, B or W a positive duration (e.g. F=1,B=1,W=1)"
        )
    return spec if mem_w is None else replace(spec, mem_w=mem_w)


def _parse_number(raw: str, context: str) -> Number:
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return Fraction(raw) if "/" in raw else float(raw)
    except (ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"cannot parse number in {context!r}") from exc


def load_costs_file(path: str | Path) -> CostSpec:
    """Read a per-stage costs JSON (the profiler writes this format).

    Keys: ``F``, ``B``, ``W`` (arrays, one per virtual stage), optional
    ``comm`` (number), ``mem_B`` / ``mem_W`` / ``a2a`` (arrays), ``mem_limit`` and
    ``recompute`` (true: the stages checkpoint activations, so ``mem_W`` may exceed
    ``mem_B``).
    """
    return costs_from_mapping(read_json(path, "costs file"), source=str(path))


def costs_from_mapping(data: object, source: str = "costs") -> CostSpec:
    """The :class:`CostSpec` of a costs JSON object; errors name ``source`` and the key."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a JSON object with keys F, B, W")
    missing = [k for k in ("F", "B", "W") if k not in data]
    if missing:
        raise ValueError(f"{source}: missing per-stage arrays {missing}; expected keys F, B, W")

    def array(key: str) -> list[Number]:
        x = data.get(key)
        if not isinstance(x, list) or not x or not all(_is_number(v) for v in x):
            raise ValueError(
                f"{source}: {key!r} must be a non-empty array of numbers, one per virtual "
                f'stage (e.g. "{key}": [1.0, 1.0]), got {x!r:.60}'
            )
        for s, v in enumerate(x):
            if why := _amount_error(v):
                raise ValueError(f"{source}: {key}[{s}]={v!r} {why}")
        return x

    def optional_array(key: str) -> list[Number] | None:
        return None if data.get(key) is None else array(key)

    def number(key: str) -> Number | None:
        x = data.get(key)
        if x is None:
            return x
        if not _is_number(x):
            raise ValueError(f"{source}: {key!r} must be a number, got {x!r:.60}")
        if why := _amount_error(x):
            raise ValueError(f"{source}: {key}={x!r} {why}")
        return x

    f, b, w, comm = array("F"), array("B"), array("W"), number("comm")
    mem_f, mem_w = optional_array("mem_B"), optional_array("mem_W")
    a2a = optional_array("a2a") or ()
    host = _host_parts(data.get("host"), source)
    recompute = data.get("recompute", False)
    if not isinstance(recompute, bool):
        raise ValueError(f"{source}: 'recompute' must be true or false, got {recompute!r:.60}")
    try:
        model = CostModel.per_stage(
            f,
            b,
            w,
            0 if comm is None else comm,
            mem_f,
            mem_w,
            recompute=recompute,
            host=host,
            a2a=a2a,
        )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if not any(model.f) and not any(model.b) and not any(model.w):
        raise ValueError(f"{source}: every F, B and W is 0; give the stages positive durations")
    return CostSpec(stage_costs=model, mem_limit=number("mem_limit"))


def _host_parts(data: object, source: str) -> dict[str, list[Number]]:
    """The optional ``host`` object (the host part of F, B, W per stage; a stage the
    profile never ran an op on, null, counts 0)."""
    if data is None:
        return {}
    if not isinstance(data, Mapping) or not set(data) <= {"F", "B", "W"}:
        raise ValueError(
            f"{source}: 'host' must be an object with arrays F, B, W, got {data!r:.60}"
        )
    out: dict[str, list[Number]] = {}
    for op, xs in data.items():
        if not isinstance(xs, list) or not all(x is None or _is_number(x) for x in xs):
            raise ValueError(f"{source}: host[{op!r}] must be an array of numbers, got {xs!r:.60}")
        out[op] = [0 if x is None else x for x in xs]
    return out


def _is_number(x: object) -> TypeGuard[int | float]:
    """A JSON number (``bool`` is an ``int`` subclass but not a number here)."""
    return isinstance(x, int | float) and not isinstance(x, bool)
