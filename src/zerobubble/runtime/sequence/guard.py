"""The segment guard: a segment schedule checks each stage on the segments against the
whole sequence before its result can be used.

A layer that reads token positions from its input's length (a position table indexed by
``arange(T)``) or attends over its input without the segment protocol (a causal attention
whose class name does not end in ``Attention``, which
:func:`~zerobubble.runtime.sequence.kv.unaware_attention` cannot see) computes something
else on a segment than on the whole sequence, silently. :func:`check_segments
<zerobubble.runtime.sequence.check.check_segments>` finds them, but only where it is
called; the guard runs in every :class:`~zerobubble.executor.PipelineExecutor` with
segments, as one :class:`~zerobubble.runtime.extension.StageExtension` per stage:

* on the first microbatch of each row count (the cuts fix the length), the extension keeps
  a fresh copy of the stage taken before its first segment ran (parameters shared, buffers
  and attributes copied: a stateful layer, such as a rotary embedding that caches its
  frequencies, starts from the state the segments started from, and the check never
  changes the model) and the segments' inputs;
* after the last segment's F it runs the copy, in eval mode, without gradients and with the
  random state saved and restored, layer by layer on the whole sequence (the segments'
  inputs joined) and on the segments, and compares each layer's output at the library's
  stated bound (docs/long-context.md: segments are not bitwise the whole sequence; they
  agree within float32 rounding, ``rtol=1e-5`` and ``atol=1e-6`` of the largest value);
  a layer that declares itself segment-aware (derives from
  :class:`~zerobubble.runtime.sequence.kv.SegmentAware`) runs whole only;
* the executor agrees on the verdicts over the pipeline group at the end of that step
  (bounded wait) and raises ``ValueError`` on every rank, naming the stage, the layer and
  the fix, before an optimizer could apply the step.
"""

from __future__ import annotations

import copy
import itertools
import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from zerobubble.runtime.extension import Call, StageExtension, Unit
from zerobubble.runtime.p2p.comm import exchange_bytes
from zerobubble.runtime.progress import Progress
from zerobubble.runtime.sequence.batch import cut_value
from zerobubble.runtime.sequence.kv import (
    SegmentAware,
    SegmentContext,
    SegmentOf,
    past_leaves,
    segment_inputs,
    segment_scope,
)
from zerobubble.runtime.shapes import map_tensors, tensor_leaves

__all__ = ["SegmentGuard", "join_segments", "stage_mismatch", "stated_bound"]

_BOUNDS = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-13, 1e-15)}
"""The bounds docs/long-context.md states for segments against the whole sequence:
``(rtol, atol)``, ``atol`` relative to the largest value."""


def stated_bound(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` of segments against the whole sequence for ``dtype``: the stated
    float32 and float64 bounds; for other dtypes ``torch.testing``'s defaults."""
    if dtype in _BOUNDS:
        return _BOUNDS[dtype]
    defaults = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}
    return defaults.get(dtype, (1e-5, 1e-6))


Inputs = tuple[tuple, dict]
"""A module call's ``(args, kwargs)``."""


def join_segments(pieces: Sequence[Any], cuts: Sequence[int]) -> Any:
    """The whole sequence's value from its segments' (the inverse of
    :func:`~zerobubble.runtime.sequence.kv.segment_inputs`): a tensor that every segment
    holds its own tokens of is concatenated on dim 1; one that is not cut (whole
    ``position_ids``) or cut to the segment's end (a 2-D ``attention_mask``) is the last
    segment's, which covers the whole sequence."""
    first = pieces[0]
    if isinstance(first, Tensor):
        spans = [e - s for s, e in itertools.pairwise(cuts)]
        if all(p.dim() >= 2 and p.shape[1] == n for p, n in zip(pieces, spans, strict=True)):
            return torch.cat(list(pieces), dim=1)
        return pieces[-1]
    if isinstance(first, Mapping):
        return {key: join_segments([p[key] for p in pieces], cuts) for key in first}
    if isinstance(first, tuple | list):
        joined = [join_segments([p[i] for p in pieces], cuts) for i in range(len(first))]
        return type(first)(joined)
    return pieces[-1]


def stage_mismatch(
    module: nn.Module, pieces: Sequence[Inputs], cuts: Sequence[int], stage: int
) -> str | None:
    """Why ``module`` (a fresh copy of a stage, changed here) is not right on the segments
    cut at ``cuts`` whose inputs are ``pieces``, or None: the first layer whose output on
    the segments differs from that on the whole sequence beyond :func:`stated_bound`."""
    layers = list(module) if isinstance(module, nn.Sequential) else [module]
    args, kwargs = join_segments(list(pieces), cuts)
    pairs = list(itertools.pairwise(cuts))
    module.eval()
    with torch.no_grad():
        for index, layer in enumerate(layers):
            whole = layer(*args, **kwargs)
            if not isinstance(layer, SegmentAware):
                outs: list[Any] = []
                contexts: list[SegmentContext] = []
                for start, end in pairs:
                    context = SegmentContext(start, past_leaves([c.new_kv() for c in contexts]))
                    cut_args = cut_value(args, start, end)
                    cut_kwargs = segment_inputs(kwargs, start, end) if kwargs else kwargs
                    with segment_scope([layer], context):
                        outs.append(layer(*cut_args, **cut_kwargs))
                    contexts.append(context)
                why = _differ(whole, join_segments(outs, cuts), _padding(args, kwargs))
                if why is not None:
                    return _message(stage, index, layer, cuts, why)
            args, kwargs = (whole,), {}
    return None


def _padding(args: tuple, kwargs: dict) -> Tensor | None:
    """The 2-D ``attention_mask`` of a layer's inputs (padded positions are not compared:
    their values are unused), or None."""
    for value in (*args, kwargs):
        mask = value.get("attention_mask") if isinstance(value, Mapping) else None
        if isinstance(mask, Tensor) and mask.dim() == 2:
            return mask.bool()
    return None


def _differ(whole: Any, cut: Any, keep: Tensor | None) -> str | None:
    for a, b in zip(tensor_leaves(whole), tensor_leaves(cut), strict=True):
        if not a.is_floating_point():
            continue
        if a.shape != b.shape:
            return f"an output of shape {tuple(b.shape)} instead of {tuple(a.shape)}"
        if keep is not None and a.dim() >= 2 and a.shape[:2] == keep.shape:
            a, b = a[keep], b[keep]
        if not a.numel():
            continue
        rtol, atol = stated_bound(a.dtype)
        a, b = a.double(), b.double()
        scale = float(a.abs().max())
        excess = (a - b).abs() - (atol * scale + rtol * a.abs())
        if bool((excess > 0).any()) or not bool(torch.isfinite(b).all()):
            worst = float((a - b).abs().max())
            return (
                f"largest difference {worst:.3g} at values up to {scale:.3g}, beyond the "
                f"stated bound of segments (float rounding: rtol={rtol:g}, atol={atol:g} of "
                "the largest value)"
            )
    return None


def _message(stage: int, index: int, layer: nn.Module, cuts: Sequence[int], why: str) -> str:
    return (
        f"stage {stage}, layer {index} of the stage ({type(layer).__name__}) computes other "
        f"values on the sequence segments cut at {list(cuts)} than on the whole sequence "
        f"({why}): a "
        "layer that reads token positions (a position table indexed by arange(T)) or "
        "attends over its input must take the segment's place from the segment protocol; "
        "derive it from zerobubble.runtime.sequence.kv.SegmentAware only if it truly is "
        "right on segments, or use a schedule without segments (e.g. 'zb' for 'seq-zb')"
    )


def _rows(inputs: Inputs) -> int:
    """The microbatch's row count: dim 0 of its first tensor with a sequence dim."""
    for t in tensor_leaves(inputs):
        if t.dim() >= 2:
            return int(t.shape[0])
    return 0


_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)


def fresh_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its own buffers, tensor attributes and plain values (the
    state a layer may change in its forward), sharing its parameters and every other object
    it refers to (hooks, configs, the chunk's store and its locks), outside any segment
    scope."""
    memo: dict[int, Any] = {}
    for m in module.modules():
        memo.update((id(p), p) for p in m._parameters.values() if p is not None)
        for key, value in vars(m).items():
            # An instance forward (activation recompute's) runs its module: the copy's its copy.
            skip = key in ("_parameters", "_buffers", "_modules", "forward")
            if not (skip or isinstance(value, (Tensor, nn.Module, *_PLAIN))):
                memo[id(value)] = value
    out = copy.deepcopy(module, memo)
    for m in out.modules():
        if isinstance(m, SegmentAware):
            m.__dict__.pop("segment_slot", None)
    return out


class UncheckedSegmentsWarning(UserWarning):
    """Segments run where the guard cannot check them (under tp, FSDP or cp)."""


class SegmentGuard:
    """The verdicts of this rank's stages' checks for one executor (see the module).

    Args:
        cuts: The segments' token boundaries.
        device: Where the stages run (whose random state the check saves too).
    """

    def __init__(self, cuts: Sequence[int], device: torch.device) -> None:
        self.cuts = tuple(cuts)
        self.device = device
        self.ran = False
        """Whether a check ran on this rank since the last :meth:`take`."""
        self.failures: list[str] = []
        self.checks = 0
        """How many stage checks ran on this rank."""

    @classmethod
    def install(
        cls, cuts: Sequence[int] | None, chunks: Mapping[int, Any], device: torch.device, mesh: Any
    ) -> SegmentGuard | None:
        """With ``cuts``, the guard of an executor's ``chunks`` (one extension appended to
        each chunk's list); None without segments, and under tp, FSDP or cp, whose stages
        run collectives that a local copy cannot (and under cp a rank's segments joined are
        not the whole sequence's chunks)."""
        if cuts is None:
            return None
        cp = mesh is not None and mesh.cp_size > 1
        if mesh is not None and (mesh.tp_size > 1 or mesh.spec.fsdp or cp):
            what = "tensor parallelism" if mesh.tp_size > 1 else "FSDP"
            what = "context parallelism" if cp else what
            warnings.warn(
                f"sequence segments under {what}: the segment guard does not run (a stage's "
                "collectives cannot run on a local copy), so a layer that is not exact on "
                "segments is not caught; check the model without it first "
                "(zerobubble.runtime.sequence.check.check_segments, or a run of the same cuts "
                "without it)",
                UncheckedSegmentsWarning,
                stacklevel=3,
            )
            return None
        guard = cls(cuts, device)
        for stage, chunk in chunks.items():
            chunk.extensions.append(guard.extension(stage, chunk.module))
        return guard

    def extension(self, stage: int, module: nn.Module) -> StageExtension:
        """The stage extension that checks ``module``, stage ``stage``."""
        return _StageCheck(self, stage, module)

    def check(self, stage: int, fresh: nn.Module, pieces: Sequence[Inputs]) -> None:
        """Check one stage's fresh copy on its segments' inputs; keep the verdict."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            try:
                why = stage_mismatch(fresh, pieces, self.cuts, stage)
            except Exception as e:  # a layer that fails on the whole sequence
                why = f"stage {stage}: the segment check could not run the stage ({e!r})"
        self.checks += 1
        self.ran = True
        if why is not None:
            self.failures.append(why)

    def refuse(self, why: str) -> None:
        """A stage that could not be checked: refused at the step's end."""
        self.ran = True
        self.failures.append(why)

    def agree(self, group: Any, timeout_s: float, progress: Progress | None = None) -> None:
        """After a step in which this rank checked a stage: every rank's verdicts (a
        bounded all-gather over the pipeline ``group``); ``ValueError`` on every rank if any
        stage failed. Every rank checks in the same steps: each stage sees the same rows."""
        if not self.ran:
            return
        mine, self.ran, self.failures = self.failures, False, []
        theirs = exchange_bytes(
            json.dumps(mine).encode(),
            group=group,
            device=self.device,
            timeout_s=timeout_s,
            action="agreement on the segment check's verdicts",
            key="executor/segment-check",
            progress=progress,
        )
        failures = [f for data in theirs for f in json.loads(data)]
        if failures:
            raise ValueError("sequence segments refused: " + "; ".join(failures))


class _StageCheck(StageExtension):
    """One stage's part of the guard: keeps a fresh copy and the segments' inputs of the
    first microbatch of each row count, and checks them after its last segment's F."""

    def __init__(self, guard: SegmentGuard, stage: int, module: nn.Module) -> None:
        self.guard = guard
        self.stage = stage
        self.module = module
        self._seen: set[int] = set()
        self._fresh: nn.Module | None = None
        self._pieces: list[Inputs] = []
        self._rows = 0

    def _ours(self, segment: SegmentOf | None) -> bool:
        """Whether ``segment`` is microbatch 0's under this guard's cuts: executors of other
        cuts may share the chunk (``Pipeline.with_schedule``), each with its own check."""
        cuts = self.guard.cuts
        return (
            segment is not None
            and segment.microbatch == 0
            and segment.count == len(cuts) - 1
            and segment.start == cuts[segment.index]
        )

    def call(self, unit: Unit, fn: Call) -> Call:
        segment = unit.segment
        if segment is None or not self._ours(segment):
            return fn

        def run(args: tuple, kwargs: dict) -> Any:
            inputs = map_tensors((args, kwargs), Tensor.detach)
            if segment.index == 0 and _rows(inputs) not in self._seen:
                self._pieces, self._rows = [], _rows(inputs)
                try:
                    self._fresh = fresh_copy(self.module)  # before the segments change it
                except Exception as e:  # refused at the step's end, on every rank
                    self._seen.add(self._rows)
                    self.guard.refuse(
                        f"stage {self.stage}: the segment check cannot copy it ({e!r})"
                    )
            if self._fresh is not None:
                self._pieces.append(inputs)
            return fn(args, kwargs)

        return run

    def keep(self, unit: Unit, out: Any) -> bool:
        segment = unit.segment
        fresh = self._fresh
        if segment is None or fresh is None or not self._ours(segment):
            return False
        if segment.index + 1 == segment.count:
            pieces, self._fresh, self._pieces = self._pieces, None, []
            self._seen.add(self._rows)
            self.guard.check(self.stage, fresh, pieces)
        return False

    def discard(self) -> None:
        self._fresh, self._pieces = None, []
