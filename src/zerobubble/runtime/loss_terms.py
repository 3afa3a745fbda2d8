"""Loss terms that layers add during their forward (a mixture of experts' router loss).

A layer calls :func:`add_loss_term` inside its forward; the per-microbatch objective is
the main loss plus every term. The running stage installs a :class:`TermSink` on its
modules for the duration of one forward (:func:`term_scope`, the pattern of
:func:`~zerobubble.runtime.sequence.kv.segment_scope`: nothing lives on the modules
between calls). A stage that received or produced terms sends, with its output, the
running per-name sums of the terms so far (:func:`with_terms`): differentiable scalars,
so the last stage roots the weighted objective (:func:`weighted_objective`) and each
term's gradient reaches the stage that produced it through the ordinary boundary
gradient. The sums are
built as one process summing the terms in layer order builds them (the first term
itself, then ``acc + t``), so :func:`collect_loss_terms` around the whole model gives the
same bits.

How a microbatch's terms weigh in the step's objective is :data:`TermWeight`:
``"mean"`` (default, Megatron's convention) weighs each microbatch's term by
``1 / (M * dp)``, so that the step's term is the mean over the global batch's
microbatches and does not change with M or dp; ``"per_call"`` keeps Hugging Face's
convention, the term being part of each call's loss and weighted as that loss is.
:func:`term_weight` gives the weight and :func:`weighted_objective` forms the root of
one microbatch's backward; the pipeline's last stage and every reference use both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn

__all__ = [
    "TERM_WEIGHTS",
    "TermSink",
    "TermWeight",
    "add_loss_term",
    "collect_loss_terms",
    "gather_terms",
    "objective",
    "segments_refusal",
    "split_terms",
    "term_scope",
    "term_weight",
    "weighted_objective",
    "with_terms",
]

TermWeight: TypeAlias = Literal["mean", "per_call"]
"""How each microbatch's loss terms weigh in a step's objective (see :func:`term_weight`)."""

TERM_WEIGHTS: tuple[TermWeight, ...] = ("mean", "per_call")

_SINK = "_zerobubble_loss_sink"
_VALUE, _TERMS = "zerobubble.value", "zerobubble.loss_terms"
"""The reserved keys of a boundary value that carries term sums: the wire carries plain
dicts only, so the marker is the dict's exact key set."""


class TermSink:
    """The running per-name sums of the terms one forward's layers add, in their order.

    ``start``: the sums received from the earlier stages (continued, not restarted).
    ``grad``: whether the forward records a graph; a term added while gradients are
    disabled inside such a forward (a checkpointed layer) would not be trained.
    """

    def __init__(self, start: Mapping[str, Tensor] | None = None, *, grad: bool = True) -> None:
        self.sums: dict[str, Tensor] = dict(start or {})
        self.grad = grad
        self.added = 0
        """How many terms the layers added in this forward."""

    def add(self, module: nn.Module, name: str, value: Tensor) -> None:
        if self.grad and not torch.is_grad_enabled():
            raise ValueError(
                f"{type(module).__name__} added loss term {name!r} with gradients disabled "
                "inside a forward that records them: a checkpointed layer (recompute='layers' "
                "or a predicate) runs its forward without a graph, so the term would not be "
                "trained; leave this layer out of recompute, or checkpoint the whole stage "
                "(recompute='stage')"
            )
        acc = self.sums.get(name)
        self.sums[name] = value if acc is None else acc + value
        self.added += 1


def add_loss_term(module: nn.Module, name: str, value: Tensor) -> None:
    """Add ``value`` (a float scalar tensor) to this microbatch's objective as term ``name``.

    Call it from ``module``'s forward. Terms of one name add up (in the order the layers
    add them); the objective is the main loss plus every term's sum, in name order. In a
    pipeline the stage running ``module`` receives it; elsewhere wrap the forward in
    :func:`collect_loss_terms`.
    """
    sink = module.__dict__.get(_SINK)
    if sink is None:
        raise ValueError(
            f"{type(module).__name__} added loss term {name!r} outside a forward that collects "
            "terms: run it inside a Pipeline (or a StageChunk), or wrap the call in "
            "zerobubble.runtime.loss_terms.collect_loss_terms(model)"
        )
    if not isinstance(name, str) or not name:
        raise ValueError(f"{type(module).__name__}: a loss term's name must be a non-empty str")
    if not isinstance(value, Tensor) or value.dim() != 0 or not value.is_floating_point():
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"{type(module).__name__} added loss term {name!r} as {got}: a term is a float "
            "scalar tensor (reduce it to one value per microbatch)"
        )
    sink.add(module, name, value)


def segments_refusal(where: str) -> ValueError:
    """The one refusal of loss terms with sequence segments, raised by every path (the
    stage, the references, the Hugging Face adapter's router blocks, the job) where
    ``where`` names the stage, layer or model.

    A term over one segment's tokens is not that segment's share of the sequence's term:
    a router's balance loss multiplies the fraction of tokens sent to each expert by the
    mean router probability, both over every token of the batch, so segments adding their
    own terms would train another objective."""
    return ValueError(
        f"{where}: loss terms (add_loss_term: a router's balance or z-loss) are not "
        "supported with sequence segments: a term over one segment's tokens is not its "
        "share of the whole sequence's term (a balance loss multiplies token fractions and "
        "mean probabilities over every token); run without segments, or without the terms"
    )


@contextmanager
def term_scope(
    modules: Iterable[nn.Module], start: Mapping[str, Tensor] | None = None
) -> Iterator[TermSink]:
    """Install one :class:`TermSink` on exactly ``modules`` for the block (an enclosing
    scope's sink comes back afterwards, even on an exception)."""
    sink = TermSink(start, grad=torch.is_grad_enabled())
    previous: list[tuple[nn.Module, Any]] = []
    try:
        for m in modules:
            previous.append((m, m.__dict__.get(_SINK)))
            m.__dict__[_SINK] = sink
        yield sink
    finally:
        for m, before in reversed(previous):
            if before is None:
                m.__dict__.pop(_SINK, None)
            else:
                m.__dict__[_SINK] = before


@contextmanager
def collect_loss_terms(*roots: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Collect the terms the layers of ``roots`` (and their submodules) add in the block.

    Yields a dict ``name -> summed value`` that fills as the layers add terms: for
    single-process runs (references, evaluation loops). ``objective(loss, terms)`` is
    then what a pipeline trains.
    """
    modules = list(dict.fromkeys(m for root in roots for m in root.modules()))
    with term_scope(modules) as sink:
        yield sink.sums


def objective(loss: Tensor, sums: Mapping[str, Tensor]) -> Tensor:
    """``loss`` plus every term's sum, added in name order (one order everywhere, so the
    pipeline's last stage and a reference give the same bits)."""
    for name in sorted(sums):
        loss = loss + sums[name]
    return loss


def term_weight(mode: str, microbatches: int, replicas: int = 1) -> float | None:
    """The weight ``w`` of every microbatch's terms in the step's objective under ``mode``.

    ``"mean"``: ``1 / (microbatches * replicas)``, the step's term being the mean of the
    per-microbatch terms over all M microbatches of all dp replicas (the dp reduction
    sums gradients of objectives normalised over the global batch, so each replica's
    share enters once). ``"per_call"``: None, the terms are part of each microbatch's loss
    and weighted as it is (``n_j / N``, or 1 with a count-normalised loss: then each
    microbatch adds its whole term, as Hugging Face's model does per call).
    """
    if mode not in TERM_WEIGHTS:
        raise ValueError(
            f"term_weight={mode!r} is not one of {', '.join(map(repr, TERM_WEIGHTS))}: 'mean' "
            "weighs each microbatch's loss terms 1 / (M * dp), 'per_call' as its loss"
        )
    if microbatches < 1 or replicas < 1:
        raise ValueError(
            f"term_weight needs microbatches >= 1 and replicas >= 1, got {microbatches} "
            f"and {replicas}"
        )
    return None if mode == "per_call" else 1.0 / (microbatches * replicas)


def weighted_objective(
    loss: Tensor, sums: Mapping[str, Tensor], loss_scale: float, weight: float | None
) -> tuple[Tensor, Tensor]:
    """One microbatch's backward root and its objective as reported (detached, unscaled).

    ``weight`` None (``"per_call"``): the root is ``objective(loss, sums) * loss_scale``,
    reported ``objective(loss, sums)``. A weight ``w`` (``"mean"``): the root is
    ``loss * loss_scale`` plus each term times ``w`` (so every term's gradient is exactly
    ``w``), reported ``loss`` plus each term times ``w / loss_scale``: the objective whose
    ``loss_scale``-weighted sum over the step is the step's (with equal microbatches and a
    per-sample mean loss ``w / loss_scale`` is 1, with a count-normalised loss ``w``).
    """
    if weight is None:
        value = objective(loss, sums)
        return value * loss_scale, value.detach()
    root = objective(loss * loss_scale, {n: t * weight for n, t in sums.items()})
    with torch.no_grad():
        share = weight / loss_scale
        value = objective(loss, {n: t * share for n, t in sums.items()})
    return root, value.detach()


def with_terms(value: Any, sums: Mapping[str, Tensor]) -> Any:
    """A stage's output with the term sums it carries on (``value`` itself without any)."""
    return {_VALUE: value, _TERMS: dict(sums)} if sums else value


def split_terms(value: Any) -> tuple[Any, dict[str, Tensor]]:
    """The inverse of :func:`with_terms`: the value a module takes, and the sums."""
    if type(value) is dict and value.keys() == {_VALUE, _TERMS}:
        return value[_VALUE], dict(value[_TERMS])
    return value, {}


def gather_terms(per_mb: Sequence[Mapping[str, Tensor]], out: dict[str, list[Tensor]]) -> None:
    """Append each term's per-microbatch values to ``out[name]`` (names in order; a
    microbatch whose layers did not add the term counts it as zero)."""
    names = sorted({n for found in per_mb for n in found})
    for name in names:
        like = next(found[name] for found in per_mb if name in found)
        zero = torch.zeros_like(like)
        out.setdefault(name, []).extend(found.get(name, zero) for found in per_mb)
