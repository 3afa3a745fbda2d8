"""The single-process ground truth of pipeline x expert parallelism.

One process plays every dp rank of a ``(pp, dp, ep)`` mesh: each replica has its own
copy of the model, and at an :class:`~zerobubble.parallel.experts.ExpertLayer` the
replicas of one ep group meet as the all-to-all makes them meet. Each replica
dispatches its tokens; the rows bound for expert owner ``o`` are concatenated in
source-rank order (what ``all_to_all_single`` delivers), owner ``o``'s copy of its
experts runs on them with :func:`~zerobubble.parallel.experts.run_experts` (the same ops
on the same rows, in the same order, as the ep rank runs them), and the outputs go
back split by source. Stage cuts do not change what is computed, so the model runs
whole. Bitwise equality with a pipeline run holds by construction, not by a
kernel's luck.

Where the stages matter (random ops seeded per stage, parameters tied across stages,
sequence segments), :func:`ep_replicas_step` makes a single-replica reference the ep one:
each replica runs it in a thread of its own on its sharded copy, the all-to-alls played
between the threads, the threads taking turns so that each draws from its own generator
state.

The model is reached through the layer contract only (docs/layer-contract.md): the expert
layers' phases (:class:`~zerobubble.parallel.experts.ExpertLayer`) and, for the threaded
reference, each module's sharding hook ``shard_experts``; this module imports no model.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from zerobubble.parallel.ep import ExpertGroup, LocalGroup, Turns, is_expert
from zerobubble.parallel.experts import ExpertLayer, expert_shard, run_experts, shard_all_experts
from zerobubble.parallel.partition import model_name
from zerobubble.reference.step import as_sequential, local_sum
from zerobubble.reference.tp import reduced_over_tp
from zerobubble.runtime.loss_terms import TermWeight, collect_loss_terms, weighted_objective
from zerobubble.runtime.loss_terms import term_weight as weight_of
from zerobubble.runtime.microbatch import (
    CountFn,
    batch_count,
    batch_size,
    default_count_fn,
    split_batch,
    split_tree,
)

T = TypeVar("T")

__all__ = [
    "ReplicaStep",
    "TurnTaking",
    "ep_reference_step",
    "ep_replicas_step",
    "threaded_ep_reference_step",
]


def ep_reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    parts: Sequence[tuple[Tensor, Tensor]],
    m: int,
    ep: int,
    *,
    term_weight: TermWeight = "mean",
) -> tuple[list[list[Tensor]], dict[str, Tensor]]:
    """One step of a ``(pp, dp = len(parts), ep)`` mesh, in one process (no random ops).

    ``layers`` is the whole (unsharded) model, whose MoE layers must be top-level
    :class:`~zerobubble.parallel.experts.ExpertLayer` s. ``parts[r]`` is dp replica ``r``'s
    ``(x, target)``. For j = 0..m-1 every replica runs microbatch j (ep groups meeting
    at the expert layers) and ``sum_r loss_rj * n_rj / N`` is back-propagated once
    (``N`` the global batch): each replica's dense copy gets exactly its own
    gradients, accumulated in microbatch order, and expert ``e``'s copy on its owner
    (ep rank ``e // (E / ep)`` of each ep group) the gradient of its one matmul over
    all sources' rows. The replicas' gradients are then summed in rank order,
    ``(g_0 + g_1) + ...``: dense ones over all replicas (the dp all-reduce), expert
    ones over the replicas holding that expert (the edp all-reduce); with two terms
    that is gloo's sum bitwise (see :mod:`~zerobubble.parallel.dp`). The sums are
    left in ``layers``' ``.grad``.

    Loss terms a layer adds (a router's balance loss) are collected per replica in layer
    order; each replica's loss is then its objective, ``loss_fn``'s loss plus every term
    weighted as ``term_weight`` says for ``M = m`` and ``dp = len(parts)``
    (:func:`~zerobubble.runtime.loss_terms.weighted_objective`), as a pipeline's last stage
    roots it.

    Returns:
        Each replica's unscaled per-microbatch losses (objectives), and a copy of every
        summed gradient keyed by ``layers``' parameter names.
    """
    model = as_sequential(layers)
    dp = len(parts)
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide the {dp} replicas (parts); pass one per dp rank")
    _check_top_level(model)
    replicas = [copy.deepcopy(model) for _ in range(dp)]
    for rep in replicas:
        for p in rep.parameters():
            p.grad = None
    total = sum(len(x) for x, _ in parts)
    weight = weight_of(term_weight, m, dp)
    xs = [split_batch(x, m) for x, _ in parts]
    ts = [split_batch(t, m) for _, t in parts]
    losses: list[list[Tensor]] = [[] for _ in range(dp)]
    for j in range(m):
        hs: list[Tensor] = [xs[r][j] for r in range(dp)]
        with ExitStack() as stack:
            found = [stack.enter_context(collect_loss_terms(rep)) for rep in replicas]
            for i, layer in enumerate(model):
                if isinstance(layer, ExpertLayer):
                    hs = _expert_layer([rep[i] for rep in replicas], hs, ep)
                else:
                    hs = [rep[i](h) for rep, h in zip(replicas, hs, strict=True)]
        mine = [
            weighted_objective(loss_fn(h, ts[r][j]), found[r], len(xs[r][j]) / total, weight)
            for r, h in enumerate(hs)
        ]
        root = mine[0][0]
        for r in range(1, dp):
            root = root + mine[r][0]
        root.backward()
        for r in range(dp):
            losses[r].append(mine[r][1])
    summed = _sum_in_rank_order(replicas)
    for n, p in model.named_parameters():
        p.grad = summed.get(n)
    return losses, {n: g.clone() for n, g in summed.items()}


def _check_top_level(model: nn.Sequential) -> None:
    """Refuse a MoE inside a layer: :func:`ep_reference_step` plays the all-to-all between
    whole layers."""
    for i, layer in enumerate(model):
        inside = any(isinstance(x, ExpertLayer) for x in layer.modules())  # a MoE is one too
        if not isinstance(layer, ExpertLayer) and inside:
            raise ValueError(
                f"layer {i} ({type(layer).__name__}) holds a MoE inside: ep_reference_step "
                "needs the MoE layers at the top level (a MoE, a MoEBlock or another "
                "ExpertLayer)"
            )


def _sum_in_rank_order(replicas: Sequence[nn.Module]) -> dict[str, Tensor]:
    """Every parameter's gradient summed over the replicas in rank order, ``(g_0 + g_1) +
    ...`` (a replica's unused expert copies have no gradient and add nothing)."""
    summed: dict[str, Tensor] = {}
    for rep in replicas:
        for n, p in rep.named_parameters():
            if p.grad is not None:
                summed[n] = p.grad.clone() if n not in summed else summed[n] + p.grad
    return summed


def _expert_layer(layers: Sequence[Any], hs: list[Tensor], ep: int) -> list[Tensor]:
    """Every replica's ``layers[r]`` on ``hs[r]``, each ep group's all-to-all played out."""
    out: list[Tensor] = list(hs)
    for first in range(0, len(hs), ep):
        group = range(first, first + ep)
        dispatched = [layers[r].dispatch(hs[r]) for r in group]
        counts = [c.view(ep, -1) for _, _, c in dispatched]
        local = counts[0].shape[1]
        sends = [c.sum(1).tolist() for c in counts]  # sends[src][owner]: rows src sends
        pieces = [rows.split(sends[s]) for s, (_, rows, _) in enumerate(dispatched)]
        back: list[list[Tensor]] = [[] for _ in group]
        for o in range(ep):
            received = torch.cat([pieces[s][o] for s in range(ep)])  # source-rank order
            recv_counts = torch.stack([counts[s][o] for s in range(ep)])
            moe = layers[first + o].moe
            experts = [moe.experts[str(e)] for e in range(o * local, (o + 1) * local)]
            outs = run_experts(experts, received, recv_counts).split(
                [sends[s][o] for s in range(ep)]
            )
            for s in range(ep):
                back[s].append(outs[s])
        for s, r in enumerate(group):
            ctx = dispatched[s][0]
            out[r] = layers[r].combine(ctx, torch.cat(back[s]))
    return out


def threaded_ep_reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[..., Tensor],
    parts: Sequence[tuple[Any, Any]],
    m: int,
    ep: int,
    *,
    count_fn: CountFn | None = None,
    term_weight: TermWeight = "mean",
    spread: bool = False,
    parallelize: Callable[[nn.Sequential], nn.Sequential] | None = None,
) -> tuple[list[list[Tensor]], dict[str, Tensor]]:
    """:func:`ep_reference_step` for expert layers anywhere in the model (a Hugging Face
    decoder layer's experts, :mod:`~zerobubble.interop.hf_experts`): one thread per dp
    replica, each with its own copy of the model sharded as the pipeline shards it (every
    module's sharding hook: :func:`~zerobubble.parallel.experts.shard_all_experts`, e.g. our
    MoE's and the Hugging Face adapter's layers') over an :class:`ExpertGroup`
    of a :class:`~zerobubble.parallel.ep.LocalGroup`: the ep group's all-to-alls (forward
    and backward) hand the same blocks between the threads, in source-rank order, that
    the process group hands between ep ranks, so every op sees the rows it sees there.
    The threads run one at a time, handing the turn on only where a replica waits for its
    ep peers (:class:`~zerobubble.parallel.ep.Turns`), so their ops run in an order fixed by
    the program.

    ``parallelize``: applied to each replica's copy before its experts are sharded (the
    pipeline's order: tp, then ep), returning the layers the replica runs under the same
    keys; :func:`~zerobubble.reference.tp.tp_layers` lays them out over a tp mesh
    (collective over it: every tp rank calls this with the same batch, its replicas then
    issue their tp collectives in the same order on every tp rank). Each tp rank's
    replicas meet only each other, as each tp rank's ep group does.

    Per replica, in microbatch order, the objective is back-propagated: ``loss_fn``'s
    loss scaled by ``n_j / N`` (``N`` the global batch), or with ``count_fn`` (default:
    ``loss_fn.count_fn``, as the pipeline does) computed as ``loss_fn(output, target_j,
    count)`` with ``count`` summed over the replicas and unscaled, plus the replica's loss
    terms weighted as ``term_weight`` says for ``M = m`` and ``dp = len(parts)``
    (:func:`~zerobubble.runtime.loss_terms.weighted_objective`). The replicas' gradients
    are then summed in rank order: dense ones over all replicas, expert ones over the
    replicas with the same ep rank (edp). The threads are :func:`ep_replicas_step`'s.
    ``parts[r]`` is replica ``r``'s ``(x, target)``, ``x`` what the first layer takes
    (split along dim 0), or with ``spread`` its ``(args, kwargs)`` (the first layer called
    as ``layer(*args, **kwargs)``, as a pipeline's first stage calls it).

    Returns:
        Each replica's unscaled per-microbatch objectives, and every summed gradient
        keyed by the user's parameter names; a sharded HF experts tensor whole again
        (its ep ranks' row blocks concatenated in ep-rank order).
    """
    model = as_sequential(layers)
    weight = weight_of(term_weight, m, len(parts))
    total = sum(batch_size(x, "x") for x, _ in parts)
    count = _global_count(default_count_fn(loss_fn, count_fn), parts)

    def run(r: int, rep: nn.Sequential) -> list[Tensor]:
        x, target = parts[r]
        n = batch_size(x, "x")
        losses: list[Tensor] = []
        for xj, tj in zip(split_tree(x, m, n), split_tree(target, m, n), strict=True):
            with collect_loss_terms(rep) as found:
                out = _forward(rep, xj, spread)
                if count is None:
                    scale = batch_size(xj, "x") / total
                    root, loss = weighted_objective(loss_fn(out, tj), found, scale, weight)
                else:
                    main = loss_fn(out, tj, count)
                    root, loss = weighted_objective(main, found, 1.0, weight)
            root.backward()
            losses.append(loss)
        return losses

    return ep_replicas_step(model, run, len(parts), ep, parallelize=parallelize)


ReplicaStep = Callable[[int, nn.Sequential], list[Tensor]]
"""One dp replica's step: ``(replica index, its sharded model) -> its per-microbatch losses``,
its gradients left in the model's ``.grad``."""


def ep_replicas_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    step: ReplicaStep,
    dp: int,
    ep: int,
    *,
    parallelize: Callable[[nn.Sequential], nn.Sequential] | None = None,
    params: dict[str, Tensor] | None = None,
    fsdp: bool = False,
) -> tuple[list[list[Tensor]], dict[str, Tensor]]:
    """``step`` of each of ``dp`` replicas, each in its own thread on its own copy of the
    model sharded as ep rank ``r % ep`` of its ep group shards it, the groups' all-to-alls
    played between the threads (a :class:`~zerobubble.parallel.ep.LocalGroup` each): a
    single-replica reference (:func:`~zerobubble.reference.step.reference_step`,
    :func:`~zerobubble.reference.step.segment_reference_step`) becomes the ep one.

    The replicas take turns (:class:`~zerobubble.parallel.ep.Turns`): one runs at a time,
    from where it took its turn up to its next all-to-all, then the turn goes to the next
    replica that can run, in replica order: an order fixed by the program, so the tp
    collectives of replicas laid out over a tp mesh (``parallelize``, applied to each copy
    before its experts are sharded) meet in one order on every tp rank. Each replica draws
    from its own state of the default generators (:class:`_Generators`), so its random ops
    draw what its pipeline rank draws, whatever the others draw in between (with a seed each
    stage's forward starts from ``(seed, step, stage, microbatch)``'s state, the same on
    every replica, as on every dp rank); the caller's generator state is put back afterwards.

    ``params`` (filled: each user name's parameter of replica 0, the layout a tie's
    gradients are summed in); ``fsdp``: a dense gradient ``Partial`` over tp reduced over tp
    before the replicas' sum, as FSDP2 reduces it.

    Returns:
        Each replica's losses, and the replicas' gradients summed in rank order (dense ones
        over all replicas, expert ones over the replicas of one ep rank), keyed by the
        user's names (:func:`threaded_ep_reference_step`).
    """
    model = as_sequential(layers)
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide the {dp} replicas (parts); pass one per dp rank")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    turned = TurnTaking(dp, device)
    groups = [turned.group(g * ep, ep) for g in range(dp // ep)]
    replicas = [_sharded_replica(model, groups, r, ep, parallelize) for r in range(dp)]
    losses = turned.run(lambda r: step(r, replicas[r]))
    return losses, _user_sums(model, replicas, ep, params, fsdp)


class TurnTaking:
    """``n`` threads of a threaded reference, one per replica (or cp rank), taking turns
    (:class:`~zerobubble.parallel.ep.Turns`: one runs at a time, up to its next exchange, in
    an order fixed by the program), each drawing from its own state of the default
    generators; :meth:`group` makes the in-process groups they exchange over."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.turns, self.gens = Turns(n), _Generators(n, device)

    def group(self, first: int, size: int) -> LocalGroup:
        """The threads ``first, ..., first + size - 1`` as one group."""
        return _TurnGroup(self.turns, first, size, self.gens)

    def run(self, work: Callable[[int], T]) -> list[T]:
        """``work(i)`` on thread ``i`` for every ``i``, in turns; the results in thread order.
        The first failure is raised here (the other threads' waits raise instead of hanging);
        the caller's generator states are put back."""
        n = self.turns.size
        out: list[Any] = [None] * n
        failed: list[BaseException] = []

        def thread(i: int) -> None:
            try:
                self.turns.begin(i)
                self.gens.enter(i)
                out[i] = work(i)
                self.gens.leave(i)
                self.turns.end(i)
            except BaseException as e:
                failed.append(e)
                self.turns.abort()

        threads = [threading.Thread(target=thread, args=(i,)) for i in range(n)]
        with self.gens.kept():
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if failed:
            raise failed[0]
        return out


class _Generators:
    """Each replica's state of the default generators (the CPU's and ``device``'s): they are
    the process's, so replicas taking turns would otherwise draw from one another's streams.
    A replica's state is put in place when it takes the turn (:meth:`enter`) and kept when it
    hands the turn on (:meth:`leave`)."""

    def __init__(self, n: int, device: torch.device) -> None:
        self._device = device
        self._mod = None if device.type == "cpu" else torch.get_device_module(device.type)
        start = self._state()
        self._states = [start] * n

    def _state(self) -> tuple[Tensor, Tensor | None]:
        mod = self._mod
        return torch.get_rng_state(), None if mod is None else mod.get_rng_state(self._device)

    def _set(self, state: tuple[Tensor, Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if self._mod is not None:
            self._mod.set_rng_state(state[1], self._device)

    @contextmanager
    def kept(self) -> Iterator[None]:
        """The caller's generator states, as they were before the block."""
        saved = self._state()
        try:
            yield
        finally:
            self._set(saved)

    def enter(self, r: int) -> None:
        self._set(self._states[r])

    def leave(self, r: int) -> None:
        self._states[r] = self._state()


class _TurnGroup(LocalGroup):
    """A :class:`LocalGroup` whose replicas keep their generator state while another runs."""

    def __init__(self, turns: Turns, first: int, size: int, gens: _Generators) -> None:
        super().__init__(turns, first, size)
        self._gens, self._first = gens, first

    def exchange(self, rank: int, blocks: list[Tensor]) -> list[Tensor]:
        self._gens.leave(self._first + rank)
        try:
            return super().exchange(rank, blocks)
        finally:
            self._gens.enter(self._first + rank)


def _forward(model: nn.Sequential, x: Any, spread: bool) -> Any:
    """``model`` on ``x``, or with ``spread`` on ``*args, **kwargs`` for ``x = (args, kwargs)``."""
    if not spread:
        return model(x)
    args, kwargs = x
    h = model[0](*args, **kwargs)
    for layer in list(model)[1:]:
        h = layer(h)
    return h


def _sharded_replica(
    model: nn.Sequential,
    groups: Sequence[LocalGroup],
    r: int,
    ep: int,
    parallelize: Callable[[nn.Sequential], nn.Sequential] | None = None,
) -> nn.Sequential:
    """Replica ``r``'s copy of ``model`` (``parallelize`` d), its experts sharded as ep rank
    ``r % ep`` of its ep group shards them, its gradients cleared."""
    rep = copy.deepcopy(model)
    if parallelize is not None:
        rep = parallelize(rep)
    group = ExpertGroup(groups[r // ep] if ep > 1 else None, r % ep, ep)
    shard_all_experts(rep, group)
    for p in rep.parameters():
        p.grad = None
    return rep


def _global_count(
    count_fn: CountFn | None, parts: Sequence[tuple[Any, Any]]
) -> Tensor | int | None:
    """The count the loss is normalised by, summed over the replicas (None without one)."""
    if count_fn is None:
        return None
    counts = [batch_count(count_fn, t) for _, t in parts]
    count = counts[0]
    for c in counts[1:]:
        count = count + c
    return count


def _user_sums(
    model: nn.Sequential,
    replicas: Sequence[nn.Module],
    ep: int,
    params: dict[str, Tensor] | None = None,
    fsdp: bool = False,
) -> dict[str, Tensor]:
    """The replicas' gradients summed in rank order and keyed by the user's names: dense
    ones over all replicas, expert ones over the replicas with the same ep rank (edp); a
    sharded HF experts tensor whole again (its ep ranks' blocks in ep-rank order)."""
    keys = tuple(model._modules)
    dense: dict[str, Tensor] = {}
    experts: list[dict[str, Tensor]] = [{} for _ in range(ep)]
    whole: dict[str, bool] = {}
    for r, rep in enumerate(replicas):  # rank order
        for name, p in rep.named_parameters():
            if p.grad is None:
                continue
            key, _, rest = name.partition(".")
            user = model_name(f"{keys.index(key)}.{rest}", keys, list(model))
            if params is not None and r == 0:  # the layout a tie's gradients are summed in
                params[user] = p
            into = experts[r % ep] if is_expert(p) else dense
            g = reduced_over_tp(p.grad) if fsdp else p.grad  # FSDP2: over tp, then over dp
            into[user] = local_sum(into.get(user), g)  # a DTensor's shards as they are
            whole[user] = expert_shard(p) is not None
    out = dict(dense)
    for q in range(ep):
        for user, g in experts[q].items():
            if whole[user]:
                out[user] = torch.cat([experts[k][user] for k in range(ep)])
            else:
                out[user] = g
    return out
