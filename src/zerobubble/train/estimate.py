"""Memory per pipeline rank before launch: parameters, gradients, optimizer state and the
schedule's activation peak, without allocating any of it (what ``zerobubble train
--dry-run`` is to print).

Activations are measured, not guessed: every stage runs one microbatch's F and then B as
the runtime runs them (:class:`~zerobubble.runtime.stage.StageChunk`, B/W split and all),
on fake tensors (``FakeTensorMode``: shapes and dtypes, no memory), and the chunk's own
count of what it holds (:meth:`~zerobubble.runtime.stage.StageChunk.held_bytes`) after F
is the stage's M_B and after B its M_W. The schedule's peak is then the library's memory
model, the simulator's (:mod:`zerobubble.schedule.simulate`: F allocates M_B, B frees all
but M_W, W frees the rest), in bytes. A real run's trace counts the same held bytes, so the
two compare directly; what neither counts is the transient inside one op (the autograd
buffers of a running backward) and the allocator's slack.

Parameters are the layers' own (dtype as built), each tied Parameter once per rank;
gradients take as much again; the optimizer keeps ``optimizer_states`` fp32 tensors per
parameter (AdamW: 2). Tensor parallelism divides what the default tp plan shards (column-
and row-wise weights, the vocabulary-sharded embedding), expert parallelism the experts'
tensors, FSDP (``dp_shard``) the stored shards: during a step FSDP keeps each stage's
gathered parameters and gradients as well (from the first F to the last W,
:mod:`zerobubble.parallel.fsdp`), which the estimate adds.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from zerobubble.parallel.partition import stage_bounds
from zerobubble.parallel.tp import default_plan
from zerobubble.runtime.recompute import Recompute
from zerobubble.runtime.shapes import map_tensors
from zerobubble.runtime.split import SplitShareWarning
from zerobubble.runtime.stage import LossFn, StageChunk, storage_bytes
from zerobubble.schedule.costs import CostModel, Number
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Op, Schedule
from zerobubble.schedule.simulate import simulate

__all__ = [
    "MemoryEstimate",
    "RankMemory",
    "StageMemory",
    "estimate_memory",
    "saved_bytes",
    "stage_memory",
]

GiB = 1 << 30


@dataclass(frozen=True)
class StageMemory:
    """One microbatch's activations on one stage, in bytes.

    Attributes:
        mem_f: Held from its F until its B (M_B): the stage's input and every tensor
            its graph saved.
        mem_w: Held from its B until its W (M_W): what the weight gradients need.
    """

    mem_f: int
    mem_w: int


@dataclass(frozen=True)
class RankMemory:
    """The predicted memory of one pipeline rank, in bytes."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    """The schedule's activation peak on this rank."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class MemoryEstimate:
    """Per pipeline rank, what a step of ``schedule`` holds (:func:`estimate_memory`)."""

    schedule: str
    ranks: tuple[RankMemory, ...]
    stages: tuple[StageMemory, ...]
    device_bytes: int | None = None

    def fits(self, device_bytes: int | None = None) -> bool:
        """Whether every rank's total fits ``device_bytes`` (default: the estimate's)."""
        return all(self.fits_rank(r.rank, device_bytes) for r in self.ranks)

    def fits_rank(self, rank: int, device_bytes: int | None = None) -> bool:
        limit = self._limit(device_bytes)
        return self.ranks[rank].total <= limit

    def _limit(self, device_bytes: int | None) -> int:
        limit = device_bytes if device_bytes is not None else self.device_bytes
        if limit is None:
            raise ValueError("no device memory to compare with: pass device_bytes")
        return limit

    def lines(self, device_bytes: int | None = None) -> list[str]:
        """One header and one row per rank; the fit columns where a device size is known."""
        limit = device_bytes if device_bytes is not None else self.device_bytes
        cols = ["rank", "params", "grads", "optimizer", "activations", "total"]
        if limit is not None:
            cols += ["device", "fits"]
        rows = [cols]
        for r in self.ranks:
            row = [str(r.rank), *map(_size, (r.params, r.grads, r.optimizer, r.activations))]
            row.append(_size(r.total))
            if limit is not None:
                row += [_size(limit), "yes" if r.total <= limit else "no"]
            rows.append(row)
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        return ["  ".join(_cells(row, widths)) for row in rows]

    def table(self, device_bytes: int | None = None) -> str:
        """:meth:`lines` as one string, under a caption naming the schedule."""
        return "\n".join([f"memory estimate, {self.schedule}:", *self.lines(device_bytes)])


def _cells(row: Sequence[str], widths: Sequence[int]) -> list[str]:
    """The first cell left-aligned, the figures right-aligned."""
    return [
        c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
    ]


def _size(n: int) -> str:
    """Bytes for people: MiB below a GiB, GiB above."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.2f} MiB"


def saved_bytes(module: nn.Module, *args: Any, **kwargs: Any) -> int:
    """Bytes of the distinct storages that ``module``'s forward saves for its backward,
    its own parameters and buffers left out (they are counted as parameters).

    Run it on a module and inputs on the meta device (or fake tensors): nothing is
    allocated. Views of one storage count once, at its full size, as keeping them costs.
    """
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.enable_grad(), saved_tensors_hooks(pack, lambda t: t):
        module(*args, **kwargs)
    weights = [*module.parameters(), *module.buffers()]
    return storage_bytes(saved, exclude=weights)


def stage_memory(
    layers: Sequence[nn.Module],
    loss_fn: LossFn,
    num_stages: int,
    example: Any,
    target: Any,
    *,
    boundaries: Sequence[int] | None = None,
    recompute: Recompute = "none",
) -> tuple[StageMemory, ...]:
    """M_B and M_W of every stage for one microbatch (``example``: the first layer's input,
    ``target``: the loss's), measured by running the stages' F then B on fake tensors.

    ``layers`` may be on any device, the meta device included: they are copied with fake
    parameters (the caller's are untouched, nothing is allocated). Raises ValueError when a
    layer's forward reads values (a fake tensor has none).
    """
    bounds = stage_bounds(len(layers), num_stages, boundaries)
    with FakeTensorMode(allow_non_fake_inputs=False), warnings.catch_warnings():
        warnings.simplefilter("ignore", SplitShareWarning)  # split shares are not the point
        fake = _fake_copy(layers)
        chunks = [
            StageChunk(
                nn.Sequential(*(fake[i] for i in bounds[s])),
                s,
                num_stages,
                loss_fn=loss_fn if s == num_stages - 1 else None,
                recompute=recompute,
            )
            for s in range(num_stages)
        ]
        try:
            return _run(chunks, _fake_tree(example), _fake_tree(target))
        except (RuntimeError, NotImplementedError) as exc:
            raise ValueError(
                f"cannot run the stages on fake tensors to measure their activations ({exc}); "
                "a layer whose forward reads tensor values (a data-dependent branch, .item()) "
                "cannot be estimated this way"
            ) from None


def _run(chunks: Sequence[StageChunk], example: Any, target: Any) -> tuple[StageMemory, ...]:
    """F of every stage in order, then B in reverse: each chunk's held bytes after each."""
    mem_f, mem_w = [], []
    x = example
    for c in chunks:
        x = c.forward(0, x, target=target) if c.is_last else c.forward(0, x)
        mem_f.append(c.held_bytes())
    grad: Any = None
    for c in reversed(chunks):
        grad = c.backward_input(0, grad)
        mem_w.append(c.held_bytes())
    return tuple(StageMemory(f, w) for f, w in zip(mem_f, reversed(mem_w), strict=True))


def _fake_tree(tree: Any) -> Any:
    """``tree`` with every tensor a fake one of its shape and dtype (call inside the mode)."""
    return map_tensors(tree, lambda t: torch.empty(t.shape, dtype=t.dtype))


def _fake_copy(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """A deep copy of ``layers`` whose parameters and buffers are fake tensors (call inside
    the mode): each tensor is replaced through the copy's memo, so a tie stays one object
    and no real tensor is copied."""
    memo: dict[int, Any] = {}
    for layer in layers:
        for t in (*layer.parameters(), *layer.buffers()):
            if id(t) not in memo:
                empty = torch.empty(t.shape, dtype=t.dtype)
                memo[id(t)] = (
                    nn.Parameter(empty, requires_grad=t.requires_grad)
                    if isinstance(t, nn.Parameter)
                    else empty
                )
    return copy.deepcopy(list(layers), memo)


def estimate_memory(
    layers: Sequence[nn.Module],
    loss_fn: LossFn,
    schedule: Schedule | str,
    example: Any,
    target: Any,
    *,
    pp: int | None = None,
    microbatches: int | None = None,
    boundaries: Sequence[int] | None = None,
    dp_shard: int = 1,
    tp: int = 1,
    ep: int = 1,
    optimizer_states: int = 2,
    recompute: Recompute = "none",
    device_bytes: int | None = None,
) -> MemoryEstimate:
    """What each pipeline rank of ``schedule`` will hold, before anything is allocated.

    ``layers`` and ``loss_fn`` are what :class:`~zerobubble.pipeline.Pipeline` takes (the
    layers may be on the meta device); ``schedule`` a Schedule, or a kind generated for
    ``pp`` ranks and ``microbatches``. ``example`` and ``target`` are one microbatch (per
    data-parallel replica): the first layer's input and the loss's target; only their
    shapes and dtypes matter. ``dp_shard``: FSDP's shard degree; ``tp``, ``ep``: tensor
    and expert parallel degrees (activations are those of the unsharded stage, so under
    tp an upper bound); ``optimizer_states``: fp32 tensors the optimizer keeps per
    parameter (AdamW 2, SGD with momentum 1). Raises ValueError for what it cannot
    estimate (a segment schedule, a layer that reads values, a tp plan that does not
    divide).
    """
    for name, n in (("dp_shard", dp_shard), ("tp", tp), ("ep", ep)):
        if n < 1:
            raise ValueError(f"{name}={n}: a parallel degree is at least 1")
    if optimizer_states < 0:
        raise ValueError(f"optimizer_states={optimizer_states} must be >= 0")
    sched = _schedule(schedule, pp, microbatches, len(layers))
    if sched.segments > 1:
        raise ValueError(
            f"{sched.name} runs {sched.segments} sequence segments per microbatch, whose "
            "activations this estimate does not measure; estimate the schedule without segments"
        )
    stages = stage_memory(
        layers,
        loss_fn,
        sched.num_stages,
        example,
        target,
        boundaries=boundaries,
        recompute=recompute,
    )
    peaks = activation_peaks(sched, stages, recompute=recompute != "none")
    bounds = stage_bounds(len(layers), sched.num_stages, boundaries)
    ranks = []
    for d in range(sched.num_devices):
        held = [i for s in sched.stages_of_device[d] for i in bounds[s]]
        whole, shard, states = _param_bytes(layers, held, bounds, sched, d, tp, ep, dp_shard)
        gathered = whole if dp_shard > 1 else 0  # FSDP's working copy during a step
        ranks.append(
            RankMemory(
                rank=d,
                params=shard + gathered,
                grads=whole,
                optimizer=states * 4 * optimizer_states,
                activations=int(peaks[d]),
            )
        )
    return MemoryEstimate(sched.name, tuple(ranks), stages, device_bytes)


def activation_peaks(
    schedule: Schedule, stages: Sequence[StageMemory], *, recompute: bool = False
) -> tuple[Number, ...]:
    """Each device's activation peak in bytes under ``schedule``: the simulator's memory
    model with every stage's measured M_B and M_W (times play no part in it)."""
    n = schedule.num_stages
    mem_f = tuple(s.mem_f for s in stages)
    # A stage whose W needs more than F kept (an embedding: W keeps the output's gradient)
    # has B allocate the difference, as under recompute.
    grows = recompute or any(s.mem_w > s.mem_f for s in stages)
    mem_w = tuple(s.mem_w for s in stages)
    if not any(a.op is Op.B for acts in schedule.actions for a in acts):
        mem_w = tuple(0 for _ in stages)  # BW frees all of M_B: M_W plays no part
    costs = CostModel((1,) * n, (1,) * n, (1,) * n, mem_f=mem_f, mem_w=mem_w, recompute=grows)
    return tuple(simulate(schedule, costs).peak_memory)


def _schedule(schedule: Schedule | str, pp: int | None, mb: int | None, layers: int) -> Schedule:
    if isinstance(schedule, Schedule):
        return schedule
    if pp is None or mb is None:
        raise ValueError(f"schedule kind {schedule!r} needs pp= and microbatches= to generate it")
    return generate(schedule, pp, mb, max_stages=layers)


def _param_bytes(
    layers: Sequence[nn.Module],
    held: Sequence[int],
    bounds: Sequence[range],
    schedule: Schedule,
    device: int,
    tp: int,
    ep: int,
    dp_shard: int,
) -> tuple[int, int, int]:
    """(bytes before FSDP, bytes of the FSDP shard, parameter elements of the shard) of the
    parameters of ``held`` layers on ``device`` after tp and ep; each Parameter once. FSDP
    shards an expert over the ``dp_shard / ep`` replicas holding it, the rest over
    ``dp_shard``."""
    divisor, rows, experts = _divisors(layers, bounds, schedule, device, tp, ep)
    seen: set[int] = set()
    dense, experts_whole, experts_shard, elements = 0, 0, 0, 0
    for i in held:
        for p in layers[i].parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            d = divisor.get(id(p), 1)
            if id(p) in rows:  # torch.chunk's rows: the first tp rank's the most
                n = math.ceil(p.shape[0] / d) * (p.numel() // max(1, p.shape[0]))
            else:
                n = math.ceil(p.numel() / d)
            if id(p) in experts:
                part = math.ceil(n / max(1, dp_shard // ep))
                experts_whole += n * p.element_size()
                experts_shard += part * p.element_size()
            else:
                part = math.ceil(n / dp_shard)
                dense += n * p.element_size()
            elements += part
    return dense + experts_whole, math.ceil(dense / dp_shard) + experts_shard, elements


def _divisors(
    layers: Sequence[nn.Module],
    bounds: Sequence[range],
    schedule: Schedule,
    device: int,
    tp: int,
    ep: int,
) -> tuple[dict[int, int], set[int], set[int]]:
    """Parameter id -> how many ways tp and ep split it on this device's stages; the ids of
    those tp splits by rows (dim 0: column-wise weights, embedding tables, whose vocabulary
    tp may not divide); and the ids of the experts' parameters."""
    out: dict[int, int] = {}
    rows: set[int] = set()
    experts: set[int] = set()
    for s in schedule.stages_of_device[device]:
        module = nn.Sequential(*(layers[i] for i in bounds[s]))
        if tp > 1:
            for name, style in default_plan(module, tp, stage=s, sequence_parallel=False).items():
                target = module.get_submodule(name)
                table = isinstance(style, RowwiseParallel) and isinstance(target, nn.Embedding)
                if isinstance(style, ColwiseParallel) or table:
                    sharded = list(target.parameters(recurse=False))
                    rows.update(id(p) for p in sharded)
                elif isinstance(style, RowwiseParallel):  # the bias stays whole
                    sharded = [p for n, p in target.named_parameters(recurse=False) if n != "bias"]
                else:
                    sharded = []
                for p in sharded:  # split tp ways once, however many stages here use it
                    out[id(p)] = tp
        if ep > 1:
            for _, m in _expert_modules(module):
                for p in m.parameters():
                    out[id(p)] = out.get(id(p), 1) * ep
                    experts.add(id(p))
    return out, rows, experts


def _expert_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules holding a MoE layer's experts (named ``experts`` or of a
    class named ``...Experts``, as transformers and our MoE call them)."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in out):
            continue
        if name.rpartition(".")[2] == "experts" or type(m).__name__.endswith("Experts"):
            out.append((name, m))
    return out
