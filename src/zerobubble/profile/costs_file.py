"""A measured profile, saved as the costs file the planners read.

The JSON holds the keys of :func:`zerobubble.schedule.costs.load_costs_file`
(``F``, ``B``, ``W`` per virtual stage in milliseconds: compute plus host
tail; ``comm`` in milliseconds; ``mem_B``, ``mem_W`` and ``mem_limit`` in
bytes), so
``zerobubble schedule zb-auto --costs-file profile.json`` plans from it
directly, plus what a user wants to see: p95s, BW, latency per stage
boundary, per-layer costs and the layer cut that was profiled.

Splitting the backward is not free on every machine (two passes, more
bookkeeping), so a schedule without B/W split is predicted from a run without
it: :meth:`Profile.cost_model` with ``fused=True`` takes F and BW from that run.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from zerobubble.profile.layers import LayerProfile
from zerobubble.profile.stages import StageProfile
from zerobubble.profile.stats import OpStats
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.segments import (
    SegmentCost,
    SegmentMemory,
    balanced_cuts,
    segment_model,
)


def _costs(st: StageProfile, op: str, stats: tuple[OpStats, ...]) -> list[float]:
    """Median compute plus median host tail of ``op`` on every stage."""
    return [s.median + (h or 0.0) for s, h in zip(stats, st.host[op], strict=True)]


def _host(st: StageProfile, op: str) -> list[float]:
    """Median host tail of ``op`` on every stage (0 where it never ran)."""
    return [h or 0.0 for h in st.host[op]]


def _every_stage(stats: tuple[OpStats | None, ...]) -> tuple[OpStats, ...] | None:
    """``stats`` if every stage ran the op, else None."""
    ran = tuple(s for s in stats if s is not None)
    return ran if len(ran) == len(stats) else None


@dataclass(frozen=True)
class Profile:
    """Everything measured about one model cut on one placement.

    Attributes:
        stages: Per-virtual-stage costs, from a run with B/W split (and BW from
            a run without, if one was traced).
        placement: ``placement[s]`` is the device of virtual stage ``s``.
        latency: ``(s, stats)`` for every boundary ``s -> s+1`` that crosses devices.
        layers: Per-layer costs, if measured (for balancing).
        boundaries: The layer cut ``[0, b_1, ..., L]`` the stages were built with.
        mem_limit: Activation-memory limit per device for the planner (bytes), if any.
        warmup: Iterations dropped before measuring.
        fused: Per-stage costs of a run without B/W split (F and BW), if one was traced.
        step_fixed_ms: A pipeline step's median time outside its compute window (from
            the step's start to the first compute, and from the last compute to the end
            of the last wait for sends): splitting the batch, the first posts, the last
            waits. The same for every schedule of the placement, so a prediction of the
            step adds it to the simulated makespan.
        segment_cost: The layers' cost of a segment of a sequence (fitted to timed spans,
            :func:`~zerobubble.profile.segments.profile_segment_cost`), if measured: what
            a segment schedule's cuts balance and its prediction scales by.
        seq_len: The length of the profiled sequences (the cuts' last position).
        segment_memory: Per layer, what a segment holds (fitted to the saved bytes of
            spans, :func:`~zerobubble.profile.segments.profile_segment_memory`), if
            measured: with :attr:`boundaries`, how a segment schedule's prediction splits
            each stage's memory over its segments and prices the key and value gradient
            sums.
        comm_fit: The latency (ms) per cross-device dependency under which the profiled
            schedules' simulated steps best match their measured ones
            (:func:`~zerobubble.profile.calibrate.fit_latency`), if fitted: the cost
            model charges it instead of the measured median.
    """

    stages: StageProfile
    placement: tuple[int, ...]
    latency: tuple[tuple[int, OpStats], ...] = ()
    layers: LayerProfile | None = None
    boundaries: tuple[int, ...] | None = None
    mem_limit: int | None = None
    warmup: int = 1
    fused: StageProfile | None = None
    step_fixed_ms: float = 0.0
    segment_cost: SegmentCost | None = None
    seq_len: int | None = None
    comm_fit: float | None = None
    segment_memory: tuple[SegmentMemory, ...] | None = None

    def cuts(self, segments: int) -> tuple[int, ...]:
        """Where to cut the profiled sequences into ``segments`` segments of equal work."""
        if self.segment_cost is None or self.seq_len is None:
            raise ValueError(
                "the profile has no segment cost: profile with segments (zerobubble profile "
                "--segments K) to plan a segment schedule"
            )
        return balanced_cuts(self.seq_len, segments, self.segment_cost)

    def segment_model(self, costs: CostModel, segments: int) -> CostModel:
        """``costs`` (per microbatch) as the model of a schedule of ``segments`` segments cut
        at :meth:`cuts`; ``costs`` itself for one segment."""
        if segments == 1:
            return costs
        cuts = self.cuts(segments)
        assert self.segment_cost is not None  # cuts() checked it
        memory = self.stage_segment_memory()  # bytes, as the profile's cost model counts
        return segment_model(costs, cuts, self.segment_cost, memory, 1.0 if memory else None)

    def stage_segment_memory(self) -> list[SegmentMemory] | None:
        """Per virtual stage, the :attr:`segment_memory` of its layers (None without it or
        without the layer cut)."""
        bounds, memory = self.boundaries, self.segment_memory
        if memory is None or bounds is None:
            return None
        if bounds[-1] != len(memory):
            raise ValueError(
                f"the profile's segment memory has {len(memory)} layers, its cut {list(bounds)}"
            )
        return [SegmentMemory.total(memory[a:b]) for a, b in itertools.pairwise(bounds)]

    @property
    def comm(self) -> float:
        """One latency for the cost model: :attr:`comm_fit` if fitted, else the mean of the
        boundaries' median latencies (:attr:`comm_measured`)."""
        return self.comm_fit if self.comm_fit is not None else self.comm_measured

    @property
    def comm_measured(self) -> float:
        """The mean of the boundaries' median latencies (0 without a boundary)."""
        if not self.latency:
            return 0.0
        return sum(s.median for _, s in self.latency) / len(self.latency)

    def cost_model(self, *, fused: bool = False) -> CostModel:
        """The per-stage :class:`CostModel` (ms, bytes) the simulator and planners use.

        Each op costs its median compute time plus its median host tail (the
        host work after it, see :mod:`zerobubble.profile.stages`). ``fused=True``
        predicts schedules without B/W split: F and M_B come from the unsplit
        run and B is set to BW - W, so that a BW costs the measured BW.

        A stage's measured all-to-all (:attr:`~zerobubble.profile.stages.StageProfile.a2a`,
        0 without one) becomes its ``a2a`` and is taken out of F's and B's compute, so that
        each still costs what was measured alone and an overlapped pair hides it.
        """
        st = self.stages
        split_b, split_w = self._split()
        w = _costs(st, "W", split_w)
        host_w = _host(st, "W")
        a2a = list(st.a2a)  # measured inside F and B: taken out of their compute

        def less(xs: list[float]) -> list[float]:
            return [x - y for x, y in zip(xs, a2a, strict=True)]

        if not fused:
            return CostModel.per_stage(
                f=less(_costs(st, "F", st.f)),
                b=less(_costs(st, "B", split_b)),
                w=w,
                comm=self.comm,
                mem_f=list(st.mem_b),
                mem_w=[m if m is not None else 0 for m in st.mem_w],
                recompute=st.recompute,
                host={"F": _host(st, "F"), "B": _host(st, "B"), "W": host_w},
                a2a=a2a,
            )
        fu = self.fused
        fused_bw = None if fu is None else _every_stage(fu.bw)
        if fu is None or fused_bw is None:
            raise ValueError("no run without B/W split was profiled: there is no measured BW")
        b = [max(bw - ws, 0.0) for bw, ws in zip(_costs(fu, "BW", fused_bw), w, strict=True)]
        # BW's host tail is B's part plus W's, as its duration is b + w.
        host_b = [
            min(max(h - hw, 0.0), x) for h, hw, x in zip(_host(fu, "BW"), host_w, b, strict=True)
        ]
        return CostModel.per_stage(
            f=[
                max(x - y, h)
                for x, y, h in zip(_costs(fu, "F", fu.f), a2a, _host(fu, "F"), strict=True)
            ],
            b=[max(x - y, h) for x, y, h in zip(b, a2a, host_b, strict=True)],
            w=w,
            comm=self.comm,
            host={"F": _host(fu, "F"), "B": host_b, "W": host_w},
            a2a=a2a,
            mem_f=list(fu.mem_b),
            mem_w=[
                (m or 0) if st.recompute else min(m or 0, mb)
                for m, mb in zip(st.mem_w, fu.mem_b, strict=True)
            ],
            recompute=st.recompute,
        )

    def replay_model(self, run: StageProfile) -> CostModel:
        """The cost model with every op's time taken from ``run`` (the stage profile of one
        measured run, e.g. one schedule's training steps) and the rest from this profile
        (the latency :attr:`comm`; memory, which a makespan does not depend on).

        A stage that ran split B and W takes them (a BW of that stage then costs their
        sum); one that ran BW only takes ``b = BW``, ``w = 0``. Simulating the run's own
        schedule with it *replays* the run: the prediction the profile would have made had
        it been measured at the run's pace. A gap between prediction and measurement then
        splits in two: prediction against replay is the machine's drift between the
        phases (the same ops took longer or shorter), replay against measurement is what
        the model does not charge (see docs/e2e.md, "Reading a prediction").
        """
        if run.num_stages != self.stages.num_stages:
            raise ValueError(
                f"the run has {run.num_stages} stages, the profile {self.stages.num_stages}"
            )
        f, b, w = [], [], []
        host: dict[str, list[float]] = {"F": [], "B": [], "W": []}
        for s in range(run.num_stages):
            f.append(run.f[s].median + (run.host["F"][s] or 0.0))
            host["F"].append(run.host["F"][s] or 0.0)
            rb, rw, rbw = run.b[s], run.w[s], run.bw[s]
            parts: tuple[tuple[str, OpStats], ...]
            if rb is not None and rw is not None:
                parts = (("B", rb), ("W", rw))
            elif rbw is not None:
                parts = (("BW", rbw),)
            else:
                raise ValueError(f"the run has no backward of stage {s} (neither B and W nor BW)")
            times = {op: st.median + (run.host[op][s] or 0.0) for op, st in parts}
            tails = {op: run.host[op][s] or 0.0 for op, _ in parts}
            b.append(times.get("B", times.get("BW", 0.0)))
            w.append(times.get("W", 0.0))
            host["B"].append(tails.get("B", tails.get("BW", 0.0)))
            host["W"].append(tails.get("W", 0.0))
        st = self.stages
        return CostModel.per_stage(
            f=f,
            b=b,
            w=w,
            comm=self.comm,
            mem_f=list(st.mem_b),
            mem_w=[m if m is not None else 0 for m in st.mem_w],
            recompute=st.recompute,
            host=host,
        )

    def _split(self) -> tuple[tuple[OpStats, ...], tuple[OpStats, ...]]:
        """B and W of every stage; the planners need both passes measured."""
        st = self.stages
        b, w = _every_stage(st.b), _every_stage(st.w)
        if b is None or w is None:
            gaps = [s for s in range(st.num_stages) if st.b[s] is None or st.w[s] is None]
            raise ValueError(
                f"stages {gaps} have no measured B and W: profile a schedule that splits the "
                "backward (e.g. zb-h1) with ExecutorOptions(fuse_local_backward=False), so "
                "both passes of every stage are timed"
            )
        return b, w

    def to_dict(self) -> dict[str, object]:
        st = self.stages
        b, w = self._split()
        out: dict[str, object] = {**self.cost_model().to_dict(), "mem_limit": self.mem_limit}
        cols = (("F", st.f), ("B", b), ("W", w))
        out["compute"] = {op: [s.median for s in col] for op, col in cols}
        out["host"] = {op: list(st.host[op]) for op, _ in cols}
        out["p95"] = {op: [s.p95 for s in col] for op, col in cols}
        if self.fused is not None:
            fu = self.fused
            out["fused"] = {
                "F": [s.median for s in fu.f],
                "BW": [s.median if s is not None else None for s in fu.bw],
                "host": {"F": list(fu.host["F"]), "BW": list(fu.host["BW"])},
                "F_p95": [s.p95 for s in fu.f],
                "BW_p95": [s.p95 if s is not None else None for s in fu.bw],
                "mem_B": list(fu.mem_b),
            }
        out["comm_per_boundary"] = [
            {
                "stage": s,
                "src_device": self.placement[s],
                "dst_device": self.placement[s + 1],
                **stats.to_dict(),
            }
            for s, stats in self.latency
        ]
        out["placement"] = list(self.placement)
        out["boundaries"] = list(self.boundaries) if self.boundaries is not None else None
        out["layers"] = self.layers.to_dict() if self.layers is not None else None
        out["units"] = {"time": "ms", "memory": "bytes"}
        out["warmup_iterations"] = self.warmup
        out["step_fixed_ms"] = self.step_fixed_ms
        out["measured_samples"] = {"F": [s.n for s in st.f]}
        out["comm_measured"] = self.comm_measured
        out["comm_fit"] = self.comm_fit
        if self.segment_cost is not None:
            c = self.segment_cost
            out["segment_cost"] = {
                "linear": c.linear,
                "attention": c.attention,
                "kernel": c.kernel,
                "seq_len": self.seq_len,
                "unit": "ms of the whole model's forward",
            }
        if self.segment_memory is not None:
            out["segment_memory"] = {
                "layers": [dataclasses.asdict(m) for m in self.segment_memory],
                "unit": "bytes each layer's forward saves a token (linear) and a query-key "
                "pair (attention); kv: one token's keys and values",
            }
        return out

    def save(self, path: str | Path) -> Path:
        """Write the JSON costs file; returns its path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return out
