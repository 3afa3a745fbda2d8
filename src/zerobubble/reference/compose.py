"""The one reference: a pipelined step's ground truth for every combination, in one call.

:func:`reference_step` takes the batch as :meth:`~zerobubble.pipeline.Pipeline.step` does
and the job's dimensions as options; it composes the single-replica references of this
package rather than restating their arithmetic:

- **dp** (``dp=R``): the global batch's rows are cut into ``R`` parts as
  ``torch.tensor_split`` cuts them (replica ``r`` takes part ``r``, as a job feeds its dp
  ranks); each replica's step is normalised by the global batch (its
  :class:`~zerobubble.reference.step.Share`: the rows or ``count_fn``'s count summed over the
  replicas, the loss terms weighted over ``M * R``), and the replicas' gradients are summed
  in rank order ``((g_0 + g_1) + g_2) + ...``, the order of the dp reduction. FSDP shards
  that reduction's result, so its ground truth is the same (with ep too: the experts'
  sums over their edp replicas, the rest over dp), but for one order: FSDP2 reduces a
  gradient that is ``Partial`` over tp (a sequence-parallel norm's) over tp before its
  dp reduction, where the plain dp path sums over dp first (``fsdp=True``);
- **cp** (``cp=C``): each dp replica's sequences are played by ``C`` cp ranks
  (:func:`~zerobubble.reference.cp.context_reference_step`: the single-replica reference on
  each rank's two chunks in a thread of its own, the attention layers' gathers played
  between the threads), normalised by ``count_fn``'s count of the global batch; their
  gradients summed in cp-rank order, then over dp. Losses are ``(dp, cp)``-rank-major;
  with segments (``cuts=``) each rank runs the segment reference on its chunks of every
  segment. With ``tp_mesh`` too (``cp_group=``, the mesh's cp group: collective over it and
  the tp mesh), each process plays its own cp rank over the real group instead: the tp
  reference on the rank's chunks, every gradient (a DTensor's local shard) summed over the
  group in cp-rank order, then over dp, and every cp rank's losses gathered (threads could
  not play the cp ranks: each would run tp's collectives, which the other processes'
  threads would have to meet in the same order); tp with segments under cp is refused;
- **segments** (``cuts=``): :func:`~zerobubble.reference.step.segment_reference_step` per
  replica;
- **tp** (``tp_mesh=``, ``tp_plan=``, ``sequence_parallel=``, ``loss_parallel=``):
  :func:`~zerobubble.reference.tp.tp_reference_step` per replica (collective over the tp mesh:
  every tp rank calls it with the same batch), with segments too (``cuts=``);
- **ep** (``ep=E``): the replicas run together, the all-to-alls played between them
  (:func:`~zerobubble.reference.ep.ep_reference_step` for top-level expert layers); with
  random ops, ties or segments (or experts inside a layer, several inputs, a ``count_fn``)
  each replica runs its single-replica reference of this list in a thread of its own
  (:func:`~zerobubble.reference.ep.ep_replicas_step`), the threads taking turns with their
  own generator state, so each replica draws what its dp rank draws;
  with ``tp_mesh`` too, each replica's layers laid out first by the tp reference
  (:func:`~zerobubble.reference.tp.tp_layers`, collective over the tp mesh): the experts
  replicated over tp, each tp rank's replicas exchanging tokens among themselves;
- **random ops** (``seed``, ``step``, ``num_stages``, ``boundaries``) and **loss terms**
  (``terms``, ``term_weight``) as each of those does; **ties**: a parameter layers of
  different stages share (the stages cut by ``num_stages`` and ``boundaries``, as the
  pipeline cuts them) gets a replica per holder stage, and its gradient is the stages'
  summed in stage order (after the dp and edp sums), as the pipeline's tie reduction adds
  them; **recompute** and **overlapped pairs** change no arithmetic, alone, together or
  (recompute) with segments (tests/test_recompute.py, tests/test_overlap_runtime.py,
  tests/test_overlap_moe.py, tests/test_seq_runtime.py), so they have no option.

A combination without a composed ground truth is refused with a ValueError naming it;
docs/scale.md keeps the table.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from zerobubble.parallel.experts import ExpertLayer
from zerobubble.parallel.parallelize import StagePlan
from zerobubble.parallel.partition import model_name, stage_bounds
from zerobubble.parallel.tied import TiedParam, find_shared, laid_out_as
from zerobubble.reference.cp import (
    context_reference_step,
    cp_rank_shards,
    gathered_over_cp,
    sum_over_cp,
)
from zerobubble.reference.ep import ep_reference_step, ep_replicas_step
from zerobubble.reference.step import (
    Share,
    as_sequential,
    local_sum,
    segment_reference_step,
)
from zerobubble.reference.step import _batch as read_batch
from zerobubble.reference.step import _user_grads as user_grads
from zerobubble.reference.step import (
    reference_step as replica_step,
)
from zerobubble.reference.tp import reduced_over_tp, sum_parts, tp_layers, tp_reference_step
from zerobubble.runtime.loss_terms import TermWeight
from zerobubble.runtime.microbatch import CountFn, batch_count, default_count_fn, split_tree
from zerobubble.runtime.sequence.cp import shard_step

__all__ = ["reference_step"]

Part = tuple[tuple[Any, ...], dict[str, Any], Any]
"""One replica's ``(args, kwargs, target)``."""


def reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[..., Tensor],
    *args: Any,
    target: Any = None,
    microbatches: int | None = None,
    dp: int = 1,
    ep: int = 1,
    cp: int = 1,
    cp_group: dist.ProcessGroup | None = None,
    cuts: Sequence[int] | None = None,
    tp_mesh: DeviceMesh | None = None,
    tp_plan: StagePlan = None,
    sequence_parallel: bool = False,
    loss_parallel: bool | None = None,
    fsdp: bool = False,
    seed: int | None = None,
    step: int = 0,
    num_stages: int = 1,
    boundaries: Sequence[int] | None = None,
    count_fn: CountFn | None = None,
    terms: dict[str, list[Tensor]] | None = None,
    term_weight: TermWeight = "mean",
    **kwargs: Any,
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One step of the whole job's arithmetic in one process (the module docstring); with no
    option :func:`zerobubble.reference.step.reference_step`. ``args``, ``kwargs`` and
    ``target`` are the global batch (all replicas' rows); ``microbatches`` is per replica.
    ``cp_group`` (with ``cp > 1`` and ``tp_mesh``): the mesh's ``cp_group``, over which this
    process plays its own cp rank (unused without tp: one process plays every cp rank).

    Returns:
        The unscaled per-microbatch losses, replica-major (replica ``r``'s microbatch
        ``j`` at ``r * M + j``), and every gradient keyed by the user's parameter names:
        the replicas' sums (under tp, each rank's local shards; under ep, a sharded
        experts tensor whole again). Without tp the sums are left in ``layers``' ``.grad``
        (under ep only by :func:`~zerobubble.reference.ep.ep_reference_step`'s case: top-level
        expert layers without random ops, ties, segments or several inputs).
    """
    args, target, m, n = read_batch(args, target, microbatches, kwargs)
    _refuse(dp, ep, tp_mesh, loss_parallel, cp)
    parts, model = _parts(args, kwargs, target, dp, n), as_sequential(layers)
    staged = _staged(seed, step, num_stages, boundaries)  # how the stages are cut and seeded
    tp: dict[str, Any] = dict(tp_mesh=tp_mesh, tp_plan=tp_plan, loss_parallel=loss_parallel)
    tp["sequence_parallel"] = sequence_parallel
    if ep > 1:
        return _experts(model, loss_fn, parts, m, n, ep, count_fn, term_weight, terms, cuts,
                        staged, {**tp, "fsdp": fsdp})  # fmt: skip
    count_fn = default_count_fn(loss_fn, count_fn)
    if cp != 1 or cp_group is not None:
        return _any_context(model, loss_fn, parts, m, (cp, cp_group), count_fn, tp, cuts, staged)
    share = None if dp == 1 else Share(n if count_fn is None else _count(parts, count_fn), dp)
    if tp_mesh is not None:  # parallelized once, in place of the caller's layers' copy
        model = as_sequential(copy.deepcopy(list(model)))
    run, ties = Ties.of(model, num_stages, boundaries, tp_mesh is None)
    common: dict[str, Any] = {**staged, "count_fn": count_fn, "share": share}
    losses, sums = list[Tensor](), dict[str, Tensor]()
    held: dict[int, Tensor] = {}  # id(parameter) -> its summed .grad
    tie_parts: dict[str, list[Tensor | None]] = {}  # tp: a tie's stage gradients, dp-summed
    for a, k, t in parts:
        if tp_mesh is not None:
            tp.update(terms=terms, term_weight=term_weight, cuts=cuts)
            mine, grads = _tp_replica(model, loss_fn, (a, k, t), m, tie_parts, fsdp, tp, common)
        elif cuts is not None:
            mine, grads = segment_reference_step(
                run, loss_fn, *a, target=t, microbatches=m, cuts=cuts, **common, **k
            )
        else:
            mine, grads = replica_step(
                run, loss_fn, *a, target=t, microbatches=m, terms=terms,
                term_weight=term_weight, **common, **k,
            )  # fmt: skip
        losses.extend(mine)
        sums = grads if not sums else _add(sums, grads)
        if tp_mesh is None:
            _hold(run, held)
    if tp_mesh is None:
        ties.give_back(model, run, held, sums)
    sums.update(_summed_parts(tie_parts))
    return losses, sums


def _summed_parts(tie_parts: dict[str, list[Tensor | None]]) -> dict[str, Tensor]:
    """Under tp, each tie's gradient: its dp-summed stage gradients summed in stage order."""
    return {n: total for n, p in tie_parts.items() if (total := sum_parts(p)) is not None}


def _staged(
    seed: int | None, step: int, num_stages: int, boundaries: Sequence[int] | None
) -> dict[str, Any]:
    """The options that cut and seed the stages, as the single-replica references take them."""
    return {"seed": seed, "step": step, "num_stages": num_stages, "boundaries": boundaries}


def _tp_replica(
    model: nn.Sequential, loss_fn: Callable[..., Tensor], part: Part, m: int,
    tie_parts: dict[str, list[Tensor | None]], fsdp: bool, tp: dict[str, Any],
    common: dict[str, Any], over_cp: Callable[[Tensor], Tensor] | None = None,
) -> tuple[list[Tensor], dict[str, Tensor]]:  # fmt: skip
    """One replica's :func:`tp_reference_step`; its ties' stage gradients added into
    ``tie_parts`` (summed over the stages after every replica, as the pipeline sums them).
    ``over_cp``: each gradient and stage gradient summed over the cp ranks first."""
    a, k, t = part
    mine_parts: dict[str, list[Tensor | None]] = {}
    mine, grads = tp_reference_step(
        model, loss_fn, *a, target=t, microbatches=m, copy_layers=False, tie_parts=mine_parts,
        **tp, **common, **k,
    )  # fmt: skip
    if over_cp is not None:  # the pipeline sums each stage's gradients over cp first
        grads = {n: over_cp(g) for n, g in grads.items()}
        mine_parts = {
            n: [None if g is None else over_cp(g) for g in gs] for n, gs in mine_parts.items()
        }
    if fsdp:  # FSDP2 reduces a Partial tp gradient over tp before its dp reduction
        grads = {n: reduced_over_tp(g) for n, g in grads.items()}
    for name, stage_grads in mine_parts.items():
        held = tie_parts.setdefault(name, [None] * len(stage_grads))
        for i, g in enumerate(stage_grads):
            if g is not None:
                held[i] = local_sum(held[i], reduced_over_tp(g) if fsdp else g)
    return mine, grads


@dataclass
class Ties:
    """Parameters tied across stages, run as the pipeline runs them: a replica per holder
    stage (:func:`_stage_replicas`), the stages' gradients summed in stage order after the
    replicas' (dp) sums, under the tie's first name (:mod:`~zerobubble.parallel.tied`)."""

    tied: Sequence[TiedParam] = ()
    names: dict[tuple[str, int], str] = field(default_factory=dict)
    """(tie's first name, stage) -> its replica's name in the run's model."""

    def give_back(
        self, model: nn.Sequential, run: nn.Sequential, held: dict[int, Tensor],
        sums: dict[str, Tensor],
    ) -> None:  # fmt: skip
        """The run's summed gradients into ``model``'s ``.grad`` and ``sums``, each tie's
        stage gradients summed in stage order under its first name."""
        replicas = dict(run.named_parameters())
        for name, p in model.named_parameters():
            p.grad = held.get(id(replicas[name]))
        for tie in self.tied:
            total: Tensor | None = None
            for s in tie.stages:
                g = held.get(id(run.get_parameter(self.names[tie.name, s])))
                total = total if g is None else local_sum(total, g)
            for name in tie.source_names:  # the gradients' keys: the user's names
                sums.pop(name, None)
            if total is not None:
                sums[tie.source_names[0]] = total
            model.get_parameter(tie.name).grad = total

    def fold(self, run: nn.Sequential, sums: dict[str, Tensor], params: dict[str, Tensor]) -> None:
        """Each tie's stage gradients in ``sums`` (under their replicas' user names in
        ``run``, as the ep references key them) summed in stage order under its first name,
        each first laid out as its replica in ``params`` is (under tp a replicated table
        gradient cut to the rank's rows), as the pipeline's tie reduction adds them."""
        keys, layers = tuple(run._modules), list(run)
        for tie in self.tied:
            total: Tensor | None = None
            for s in tie.stages:
                key, _, rest = self.names[tie.name, s].partition(".")
                user = model_name(f"{keys.index(key)}.{rest}", keys, layers)
                g = sums.pop(user, None)
                if g is not None:
                    total = local_sum(total, laid_out_as(g, params[user], tie.name))
            if total is not None:
                sums[tie.source_names[0]] = total

    @staticmethod
    def of(
        model: nn.Sequential, num_stages: int, boundaries: Sequence[int] | None, staged: bool
    ) -> tuple[nn.Sequential, Ties]:
        """:func:`_stage_replicas` where ``staged`` (else ``model`` as it is: tensor
        parallelism gives its stages their replicas itself)."""
        return _stage_replicas(model, num_stages, boundaries) if staged else (model, Ties())


def _stage_replicas(
    model: nn.Sequential, num_stages: int, boundaries: Sequence[int] | None
) -> tuple[nn.Sequential, Ties]:
    """``model`` itself, or where layers of different stages share a parameter, a copy
    whose stages hold their own replica of it (keys, names and values unchanged)."""
    keys = tuple(model._modules)
    bounds = stage_bounds(len(model), num_stages, boundaries)
    tied = [t for t in find_shared(model, keys, bounds) if len(t.local) > 1]
    if not tied:
        return model, Ties()
    stages = [copy.deepcopy(nn.Sequential(*(model[i] for i in r))) for r in bounds]
    run = nn.Sequential(
        OrderedDict((keys[r.start + i], layer) for r, st in zip(bounds, stages, strict=True)
                    for i, layer in enumerate(st))
    )  # fmt: skip
    names = {
        (t.name, s): f"{keys[bounds[s].start + int(i)]}.{rest}"
        for t in tied
        for s in t.stages
        for i, _, rest in [t.local[s][0].partition(".")]
    }
    return run, Ties(tied, names)


def _refuse(
    dp: int, ep: int, tp: DeviceMesh | None, loss_parallel: bool | None, cp: int = 1
) -> None:
    """The combinations without a composed ground truth, named, and loss parallel without
    tp."""
    if loss_parallel and tp is None:
        raise ValueError(
            "loss_parallel=True without tensor parallelism (tp_mesh): the logits are whole; "
            "pass tp_mesh=, or leave loss_parallel at None"
        )
    if dp < 1 or ep < 1 or dp % ep:
        raise ValueError(f"dp={dp} and ep={ep}: both >= 1, and ep must divide dp")
    if cp < 1 or (cp > 1 and ep > 1):
        raise ValueError(
            f"cp={cp}: must be >= 1, and reference_step has no ground truth of context "
            f"parallelism with ep={ep} (the mesh refuses it too)"
        )


def _any_context(
    model: nn.Sequential,
    loss_fn: Callable[..., Tensor],
    parts: Sequence[Part],
    m: int,
    cp: tuple[int, dist.ProcessGroup | None],
    count_fn: CountFn | None,
    tp: dict[str, Any],
    cuts: Sequence[int] | None,
    staged: dict[str, Any],
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """The cp paths: :func:`_context_tp` with a tp mesh (over ``cp``'s group), else
    :func:`_context` (threads), after :func:`_refuse_cp`."""
    size, group = cp
    if size == 1:
        raise ValueError("reference_step: cp_group is given but cp=1; pass cp= its size")
    tp_mesh = tp["tp_mesh"]
    _refuse_cp(size, (tp_mesh, cuts), count_fn, group)
    assert count_fn is not None  # _refuse_cp
    if tp_mesh is not None:
        assert group is not None  # _refuse_cp
        return _context_tp(model, loss_fn, parts, m, (size, group), count_fn, tp, staged)
    return _context(model, loss_fn, parts, m, size, count_fn, cuts, staged)


def _context(
    model: nn.Sequential,
    loss_fn: Callable[..., Tensor],
    parts: Sequence[Part],
    m: int,
    cp: int,
    count_fn: CountFn,
    cuts: Sequence[int] | None,
    staged: dict[str, Any],
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """The dp replicas over ``cp`` ranks each (:func:`context_reference_step`), their cp
    sums added over dp in rank order, the ties' stage gradients summed after; losses
    ``(dp, cp)``-rank-major."""
    share = Share(_count(parts, count_fn), len(parts) * cp)
    run, ties = Ties.of(model, staged["num_stages"], staged["boundaries"], True)
    losses: list[Tensor] = []
    held: dict[int, Tensor] = {}  # id(parameter) -> its summed .grad
    for part in parts:  # each leaves its cp sums in run's .grad
        losses += context_reference_step(
            run, loss_fn, part, m, cp, share, count_fn, cuts=cuts, **staged
        )
        _hold(run, held)
    for p in run.parameters():
        p.grad = held.get(id(p))
    sums = user_grads(run)
    ties.give_back(model, run, held, sums)
    return losses, sums


def _context_tp(
    model: nn.Sequential,
    loss_fn: Callable[..., Tensor],
    parts: Sequence[Part],
    m: int,
    cp: tuple[int, dist.ProcessGroup],
    count_fn: CountFn,
    tp: dict[str, Any],
    staged: dict[str, Any],
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Context with tensor parallelism: this process plays its own cp rank over the real cp
    group (``cp``: its size and the group; :mod:`~zerobubble.reference.cp`), the tp
    reference on the rank's chunks of each dp replica's sequences; each gradient (a tie's
    stage gradients too) summed over cp in cp-rank order, then over dp in rank order, the
    ties' stage sums after, as the pipeline's reductions run. Collective over the tp mesh
    and the cp group. Losses ``(dp, cp)``-rank-major, every cp rank's gathered."""
    size, group = cp
    model = as_sequential(copy.deepcopy(list(model)))
    shards = cp_rank_shards(model, size, group)
    share = Share(_count(parts, count_fn), len(parts) * size)
    common: dict[str, Any] = {**staged, "count_fn": count_fn, "share": share}
    losses: list[Tensor] = []
    sums: dict[str, Tensor] = {}
    tie_parts: dict[str, list[Tensor | None]] = {}  # a tie's stage gradients, cp and dp summed
    tp.update(terms=None, term_weight="mean", cuts=None)
    over_cp = partial(sum_over_cp, group=group)
    for a, k, t in parts:
        part = shard_step(shards, a, k, t)
        mine, grads = _tp_replica(model, loss_fn, part, m, tie_parts, False, tp, common, over_cp)
        losses += gathered_over_cp(mine, group)
        sums = grads if not sums else _add(sums, grads)
    sums.update(_summed_parts(tie_parts))
    return losses, sums


def _refuse_cp(
    cp: int,
    others: tuple[DeviceMesh | None, Sequence[int] | None],
    count_fn: Any,
    cp_group: dist.ProcessGroup | None,
) -> None:
    """Context parallelism's combinations without a composed ground truth, named (ep is
    refused before: its reference runs first)."""
    tp, cuts = others
    if tp is not None and cuts is not None:
        raise ValueError(
            f"reference_step has no ground truth of context parallelism (cp={cp}) with both "
            "tp and cuts: the mesh and the executor refuse it too"
        )
    if count_fn is None:
        raise ValueError(
            f"reference_step with cp={cp} needs count_fn (each cp rank's loss is its chunks' "
            "share of the batch's token count), as the executor does"
        )
    if tp is not None and cp_group is None:
        raise ValueError(
            f"reference_step with cp={cp} and tp_mesh needs cp_group (the mesh's cp_group): "
            "under tensor parallelism each process plays its own cp rank over the real group"
        )


def _parts(args: tuple, kwargs: dict, target: Any, dp: int, n: int) -> list[Part]:
    """The global batch cut into the replicas' parts, as ``torch.tensor_split`` cuts rows."""
    if n < dp:
        raise ValueError(f"a batch of {n} rows cannot feed dp={dp} replicas")
    inputs = split_tree((args, kwargs), dp, n)
    targets = split_tree(target, dp, n)
    return [(a, k, t) for (a, k), t in zip(inputs, targets, strict=True)]


def _count(parts: Sequence[Part], count_fn: CountFn) -> Any:
    """The replicas' counts summed in rank order (the dp all-reduce of the executors'
    ``over_dp``)."""
    counts = [batch_count(count_fn, t) for _, _, t in parts]
    total = counts[0]
    for c in counts[1:]:
        total = total + c
    return total


def _add(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, Tensor]:
    """``a + b`` per name (a name one of them lacks keeps the other's)."""
    out = dict(a)
    for name, g in b.items():
        out[name] = out[name] + g if name in out else g
    return out


def _hold(model: nn.Module, held: dict[int, Tensor]) -> None:
    """Add this replica's ``.grad`` into ``held``, by parameter, in rank order."""
    for p in model.parameters():
        if p.grad is not None:
            held[id(p)] = p.grad.clone() if id(p) not in held else held[id(p)] + p.grad


def _experts(
    model: nn.Sequential,
    loss_fn: Callable[..., Tensor],
    parts: Sequence[Part],
    m: int,
    n: int,
    ep: int,
    count_fn: CountFn | None,
    term_weight: TermWeight,
    terms: dict[str, list[Tensor]] | None,
    cuts: Sequence[int] | None,
    common: dict[str, Any],
    tp: dict[str, Any],
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """The ep replicas together; losses replica-major. Top-level expert layers without
    random ops, ties, segments or tp: :func:`ep_reference_step`; otherwise each replica's
    single-replica reference (:func:`replica_step`, :func:`segment_reference_step`, on
    the stages' replicas of tied parameters, laid out over the tp mesh by ``tp``:
    :func:`~zerobubble.reference.tp.tp_layers` where ``tp["tp_mesh"]`` is one) in its own
    thread, the all-to-alls played between them (:func:`ep_replicas_step`), and the ties'
    stage gradients summed after."""
    fsdp = tp.pop("fsdp", False)
    lay_out = None
    if tp["tp_mesh"] is not None:  # each replica's layers laid out as the tp reference's
        lay_out = partial(
            tp_layers, loss_fn=loss_fn, num_stages=common["num_stages"],
            boundaries=common["boundaries"], **tp,
        )  # fmt: skip
    if terms is not None:
        raise ValueError(
            "reference_step with ep > 1 does not report terms= per name yet: its losses are the "
            "objectives (loss plus weighted terms)"
        )
    spread = any(len(a) != 1 or k for a, k, _ in parts)  # several inputs: as a stage takes them
    run, ties = _stage_replicas(model, common["num_stages"], common["boundaries"])
    plain = common["seed"] is None and cuts is None and not ties.tied and not spread
    top = all(isinstance(x, ExpertLayer) or not _holds_expert(x) for x in model)
    count_fn = default_count_fn(loss_fn, count_fn)
    if plain and top and count_fn is None and lay_out is None:
        tensors = [(a[0], t) for a, _, t in parts]  # one input each
        per, grads = ep_reference_step(model, loss_fn, tensors, m, ep, term_weight=term_weight)
        return [loss for mine in per for loss in mine], grads
    share = Share(n if count_fn is None else _count(parts, count_fn), len(parts))

    def replica(r: int, rep: nn.Sequential) -> list[Tensor]:
        a, k, t = parts[r]
        if cuts is not None:
            return segment_reference_step(
                rep, loss_fn, *a, target=t, microbatches=m, cuts=cuts, count_fn=count_fn,
                share=share, **common, **k,
            )[0]  # fmt: skip
        return replica_step(
            rep, loss_fn, *a, target=t, microbatches=m, count_fn=count_fn,
            term_weight=term_weight, share=share, **common, **k,
        )[0]  # fmt: skip

    params: dict[str, Tensor] = {}
    per, grads = ep_replicas_step(
        run, replica, len(parts), ep, parallelize=lay_out, params=params, fsdp=fsdp
    )
    ties.fold(run, grads, params)
    return [loss for mine in per for loss in mine], grads


def _holds_expert(layer: nn.Module) -> bool:
    return any(isinstance(x, ExpertLayer) for x in layer.modules())
