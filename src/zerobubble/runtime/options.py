"""How a :class:`~zerobubble.executor.PipelineExecutor` runs: its options, documented.

Each field is checked when the options are made, so a bad value is refused before
any process group or stage exists.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from zerobubble.runtime.loss_terms import TermWeight, term_weight
from zerobubble.runtime.overlap import OverlapFn
from zerobubble.runtime.recompute import Recompute, recompute_plan
from zerobubble.runtime.rng import StageRng
from zerobubble.runtime.sequence.kv import token_cuts

__all__ = ["ExecutorOptions"]


@dataclass(frozen=True)
class ExecutorOptions:
    """How a :class:`PipelineExecutor` runs."""

    comm_timeout_s: float = 60.0
    """Longest a single wait on a peer (a receive, the final send flush, a layout
    message) may block; past it the step raises :class:`~zerobubble.runtime.p2p.comm.PeerError`
    naming the peer and the instruction. A dead peer is usually reported sooner."""

    recv_lookahead: int = 2
    """How many compute actions before its consumer a receive is posted (more overlap,
    more receive buffers held); see :func:`~zerobubble.program.lowering.lower`."""

    directed_groups: bool | None = None
    """Give each direction of each communicating rank pair its own subgroup. None picks
    it for every backend but gloo (NCCL would otherwise serialise both directions and
    can deadlock, see :mod:`~zerobubble.runtime.p2p.comm`). With a mesh, every pipeline of
    the job runs the same schedule and every rank creates every pipeline's subgroups
    (``new_group`` is collective over the default group); without one the pipeline's
    group must be the whole default group."""

    trace: bool = True
    """Record a :class:`~zerobubble.runtime.recorder.TraceEvent` per executed instruction
    in :attr:`PipelineExecutor.trace` (one ``held_bytes`` query per compute: only
    computes change what the stages hold). The stages then track their saved tensors
    (``StageChunk(track_memory=True)``), a Python call per saved tensor in F and in B;
    turn it off for the fastest steps."""

    fuse_local_backward: bool = True
    """Run a B immediately followed by its own W as one BW where no other device waits
    for that B (stage 0, or a stage whose upstream neighbour shares the device; see
    :func:`~zerobubble.schedule.passes.fuse_local_backward`). Every order and
    cross-device dependency stays the same; one ordinary backward is cheaper than B
    plus W. :attr:`PipelineExecutor.schedule` and the trace then show BW: turn it off
    to measure B and W of every stage (profiling)."""

    retain_host_memory: bool | None = None
    """Keep freed host memory in the process for reuse instead of returning it to the
    OS (glibc ``mallopt``, see :mod:`~zerobubble.runtime.host_memory`): a step then
    does not page-fault its activations back in. Process-wide and permanent; resident
    memory stays near its peak. None turns it on when the stages run on the CPU."""

    seed: int = 0
    """Seed of the stages' randomness: every forward of stage ``s`` on microbatch ``j`` in
    step ``k`` (:attr:`PipelineExecutor.iteration`) runs with the CPU's and the device's
    default generators set to a state derived from ``(seed, k, s, j)``
    (:class:`~zerobubble.runtime.rng.StageRng`), and the caller's states are restored after
    it. Dropout then draws the same under every schedule and on a replay, bitwise as
    :func:`~zerobubble.reference.step.reference_step` given the same seed. Every rank
    must use the same seed. Any integer (numpy's too); there is no unseeded mode
    (``seed=None`` is refused with a ValueError: an unseeded stage would draw differently
    under each schedule, on a replay and in a recomputation)."""

    recompute: Recompute = "none"
    """Activation checkpointing of the stages the executor wraps (``StageChunk(recompute=)``,
    see :mod:`~zerobubble.runtime.recompute`): "none", "stage", "layers" or a predicate
    ``(layer name, module) -> bool``. F keeps only the checkpointed inputs; B recomputes
    (with F's generator state: dropout draws the same) and keeps what W needs."""

    compile: str | None = None
    """A ``torch.compile`` backend ("inductor", "aot_eager", ...) for the regions between
    the split layers of the stages the executor wraps, applied in the chunks' one
    transform step after split and recompute (:mod:`~zerobubble.parallel.transforms`);
    None: eager. Not with "layers" recompute (refused)."""

    cuts: tuple[int, ...] | None = None
    """For a schedule of k sequence segments per microbatch
    (:attr:`~zerobubble.schedule.ir.Schedule.segments`): the token boundaries
    ``0 = b0 < ... < bk = T`` of every microbatch's sequence (dim 1 of stage 0's inputs and
    of the target), the same on every rank (a middle stage needs each segment's first
    token too). :func:`~zerobubble.schedule.segments.balanced_cuts` gives segments of equal
    work. Required with segments, refused without (a schedule of whole sequences would
    ignore them). Any integers (numpy's too)."""

    overlap_fn: OverlapFn | None = None
    """How an overlapped F&B pair of the schedule runs
    (:attr:`~zerobubble.schedule.ir.Schedule.overlaps`): a hook given an
    :class:`~zerobubble.runtime.overlap.OverlapPair` that runs each half once. None:
    :func:`~zerobubble.runtime.overlap.run_together` (the F on a helper thread while the
    backward runs, so one's all-to-all is in flight while the other computes)."""

    term_weight: TermWeight = "mean"
    """How each microbatch's loss terms (:func:`~zerobubble.runtime.loss_terms.add_loss_term`:
    a router's balancing or z-loss) weigh in the step's objective. ``"mean"`` (Megatron's
    convention): ``1 / (M * dp)`` each, so the step's term is the mean of the per-microbatch
    terms over the global batch's M * dp microbatches and the balance coefficient means
    the same at any M and dp. ``"per_call"`` (Hugging Face's): each microbatch's term is
    part of its loss and weighted as it is (``n_j / N``; 1 with a count-normalised loss,
    so each microbatch adds its whole term). See docs/moe.md."""

    def __post_init__(self) -> None:
        term_weight(self.term_weight, 1)  # a mode that is not one is refused here
        if self.cuts is not None:  # numpy's integers taken, a float or bool refused by index
            object.__setattr__(self, "cuts", token_cuts(self.cuts))
        if not self.comm_timeout_s > 0:
            raise ValueError(f"comm_timeout_s must be > 0 seconds, got {self.comm_timeout_s}")
        if self.recv_lookahead < 0:
            raise ValueError(f"recv_lookahead must be >= 0, got {self.recv_lookahead}")
        object.__setattr__(self, "seed", _seed(self.seed))
        StageRng(self.seed, "cpu")  # a seed out of range is refused here
        recompute_plan(self.recompute)  # and a recompute setting that is not one
        if self.compile is not None and recompute_plan(self.recompute).mode == "layers":
            raise ValueError(
                f"compile={self.compile!r} with recompute={self.recompute!r} is not supported: "
                "B recomputes a checkpointed layer eagerly, outside its compiled code; use "
                "recompute='stage' or 'none' with compile"
            )


def _seed(seed: object) -> int:
    """``seed`` as an int; None or a non-integer refused naming the option and the fix."""
    try:
        return operator.index(seed)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"ExecutorOptions(seed={seed!r}): seed must be an int; the stages' random ops are "
            "always seeded from (seed, step, stage, microbatch), so that every schedule, a "
            "replay and a recomputation draw alike. Pass an int (the default is 0) and give "
            "reference_step the same seed="
        ) from None
