"""Loss parallel: cross-entropy on logits sharded over the vocabulary, never gathered.

Under tensor parallelism the LM head is column-wise: each tp rank computes ``vocab / tp``
columns of the logits. Gathering them (``colwise_gather_output``) hands every rank the
whole ``(B, T, vocab)`` logits, and the loss's softmax saves them whole for backward: on
the last stage, the largest activation of the model, kept once per microbatch in flight.
With loss parallel the head leaves its output a DTensor ``Shard(-1)`` over the tp mesh,
and :func:`cross_entropy` computes Megatron's vocab-parallel cross-entropy on each rank's
shard: the row max (one all-reduce, MAX), then each row's sum of exponentials and its
target logit (one all-reduce, SUM, of both), the loss ``log(sum) - target logit``. It
saves its ``(rows, vocab / tp)`` softmax for backward, whose gradient
``softmax - onehot`` is local: no collective in B. A vocabulary tp does not divide is
split as DTensor's ``Shard`` splits it (``torch.chunk``: ``ceil(vocab / tp)`` columns a
rank, the last ones fewer), and each rank matches the targets against its real offset.

The arithmetic differs from the gathered ``F.cross_entropy`` only in the order of the
sum of exponentials (each tp rank's partial sum, then their sum) and in where the
softmax rounds, so the two agree within a few ulps per vocabulary entry (docs/scale.md
states the bound; tests/test_loss_parallel.py asserts it). It is bitwise its own
reference: :func:`~zerobubble.reference.tp.tp_reference_step` runs the same function on
the same shards.

Who uses it (:class:`LossParallel`, the rule): a loss that takes vocabulary-sharded
logits says so with the attribute ``loss_parallel = True`` (:func:`takes_sharded_logits`;
our :func:`~zerobubble.models.gpt.gpt_loss` and the Hugging Face adapter's ``CausalLMLoss``
do). With ``tp > 1`` and the option left at None (the default), a loss that says so gets
the sharded logits, and any other loss the gathered ones, as before; ``True`` requires it
(ValueError naming the stage otherwise); ``False`` gathers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "LossParallel",
    "cross_entropy",
    "is_vocab_sharded",
    "takes_sharded_logits",
    "vocab_parallel_cross_entropy",
]

LossT = TypeVar("LossT", bound=Callable[..., Any])


def takes_sharded_logits(loss_fn: LossT) -> LossT:
    """Mark ``loss_fn`` as taking vocabulary-sharded logits (``loss_parallel = True``): it
    computes its cross-entropy with :func:`cross_entropy`, which takes them as they come."""
    loss_fn.loss_parallel = True  # type: ignore[attr-defined]
    return loss_fn


def is_vocab_sharded(logits: Tensor) -> TypeGuard[DTensor]:
    """``logits`` is a DTensor on a 1-D mesh sharded over its last dim (the vocabulary)."""
    if not isinstance(logits, DTensor) or logits.device_mesh.ndim != 1:
        return False
    (placement,) = logits.placements
    return isinstance(placement, Shard) and placement.dim % logits.ndim == logits.ndim - 1


def cross_entropy(
    logits: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """``F.cross_entropy`` of ``(..., vocab)`` logits against ``(...)`` class ids, both
    flattened, however the logits come: a plain tensor as ``F.cross_entropy`` computes it
    (bitwise), vocabulary-sharded by :func:`vocab_parallel_cross_entropy`, another DTensor
    gathered first. ``reduction``: ``"mean"`` (over the targets not ``ignore_index``) or
    ``"sum"``."""
    if is_vocab_sharded(logits):
        return vocab_parallel_cross_entropy(
            logits, target, ignore_index=ignore_index, reduction=reduction
        )
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
    )


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of vocabulary-sharded ``(..., vocab)`` logits (:func:`is_vocab_sharded`)
    against whole ``(...)`` class ids, on the local shards (see the module docstring).
    Collective over the logits' mesh. Returns a plain tensor, the same on every rank:
    ``reduction="mean"`` divides by the number of targets that are not ``ignore_index``
    (NaN when there are none, as ``F.cross_entropy``), ``"sum"`` does not."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not is_vocab_sharded(logits):
        raise ValueError(
            "vocab_parallel_cross_entropy takes a DTensor sharded over its last dim (the "
            "vocabulary) on a 1-D mesh; use cross_entropy for other logits"
        )
    mesh = logits.device_mesh
    vocab, tp, rank = logits.shape[-1], mesh.size(), mesh.get_local_rank()
    chunk = -(-vocab // tp)  # DTensor's Shard splits as torch.chunk does
    start = rank * chunk
    local = logits.to_local()
    assert local.shape[-1] == max(0, min(vocab, start + chunk) - start), (local.shape, start)
    target = target.reshape(-1).to(local.device)
    _check_targets(target, vocab, ignore_index)
    rows = local.reshape(-1, local.shape[-1])
    losses = _VocabParallelCE.apply(rows, target, start, ignore_index, mesh.get_group())
    total = losses.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().to(total.dtype)


def _check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    """A target outside ``[0, vocab)`` (and not ``ignore_index``) would match no rank's
    shard and score 0 silently: refuse it, as ``F.cross_entropy`` does."""
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if target.device.type != "cpu":
        torch._assert_async(~bad.any(), "loss parallel: a target is out of the vocabulary")
    elif bool(bad.any()):
        found = int(target[bad][0])
        raise ValueError(
            f"loss parallel: target {found} is out of the vocabulary [0, {vocab}) (and not "
            f"ignore_index={ignore_index})"
        )


class _VocabParallelCE(torch.autograd.Function):
    """Per-row losses of ``(rows, vocab / tp)`` local logits (this rank's columns from
    ``start``); backward ``softmax - onehot``, local."""

    @staticmethod
    def forward(
        ctx: Any,
        local: Tensor,
        target: Tensor,
        start: int,
        ignore_index: int,
        group: dist.ProcessGroup,
    ) -> Tensor:
        x = local.float()
        row_max = x.amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = x - row_max.unsqueeze(-1)
        exp = shifted.exp()
        ignored = target == ignore_index
        at = target - start
        mine = (at >= 0) & (at < x.shape[-1]) & ~ignored
        at = torch.where(mine, at, 0)
        picked = shifted.gather(-1, at.unsqueeze(-1)).squeeze(-1)
        sums = torch.stack([exp.sum(dim=-1), torch.where(mine, picked, 0.0)])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        total, target_logit = sums[0], sums[1]
        losses = torch.where(ignored, 0.0, total.log() - target_logit)
        softmax = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, at, mine, ignored)
        ctx.dtype = local.dtype
        return losses.to(local.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        softmax, at, mine, ignored = ctx.saved_tensors
        out = softmax.scatter_add(-1, at.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        scale = torch.where(ignored, 0.0, grad.float())
        return out.mul_(scale.unsqueeze(-1)).to(ctx.dtype), None, None, None, None


@dataclass(frozen=True)
class LossParallel:
    """Where the loss meets the logits under tensor parallelism: whether the loss stage's
    LM head leaves them vocabulary-sharded (the rule of the module docstring)."""

    stage: int
    """The loss stage (the last): its last layer's output is the loss's input."""
    loss_fn: object
    """The loss (None on ranks that hold no loss stage)."""
    option: bool | None = None
    """None: sharded where the loss takes it; True: required; False: gathered."""

    def __post_init__(self) -> None:
        """Check the option, and where the loss is known (a Pipeline's every rank) refuse
        ``True`` for a loss that does not take sharded logits: on every rank at once."""
        if self.option is not None and type(self.option) is not bool:
            raise ValueError(
                f"loss_parallel must be None, True or False, got {self.option!r} "
                f"({type(self.option).__name__})"
            )
        if self.loss_fn is not None:
            self.sharded(self.stage)

    def sharded(self, stage: int) -> bool:
        """Whether stage ``stage``'s head leaves the logits sharded; ValueError, naming the
        stage, where ``True`` asks it of a loss that does not take them."""
        if stage != self.stage or self.option is False:
            return False
        takes = getattr(self.loss_fn, "loss_parallel", False) is True
        if self.option and not takes:
            name = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
            raise ValueError(
                f"stage {stage}: loss_parallel=True, but the loss {name} does not say it takes "
                "logits sharded over the vocabulary (an attribute loss_parallel = True, as "
                "gpt_loss and CausalLMLoss have): its cross-entropy would see a DTensor. Fix: "
                "leave loss_parallel at None (the logits are then gathered for this loss), or "
                "compute the loss with zerobubble.parallel.loss.cross_entropy and mark it "
                "with takes_sharded_logits"
            )
        return takes
