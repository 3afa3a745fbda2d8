"""The expert-layer contract: what the runtime knows of a model's experts, so that it
imports no model (docs/layer-contract.md).

* **The phases** of a layer that exchanges tokens with its experts' owners:
  :class:`ExpertLayer` (``dispatch``, ``moe.exchange``, ``combine``), which
  :func:`~zerobubble.reference.ep.ep_reference_step` drives for every ep rank in one
  process; the exchange itself, counts then rows all-to-all to the experts' owners and the
  outputs back (:func:`exchange_rows`, :func:`exchange_grouped`), and the local experts run on
  the received rows (:func:`run_experts`, :func:`run_grouped`).
* **Sharding**: a module that holds experts keeps its rank's share when the pipeline (on a
  mesh with ``ep > 1``) or the threaded reference asks, through its hook
  ``shard_experts(ep, first_run) -> runs`` (:func:`shard_all_experts` walks a module for the
  hooks); our ``MoE`` has one, and so has every layer of the Hugging Face adapter
  (:class:`~zerobubble.interop.hf_layers.HFLayer`, for transformers' experts modules inside
  it). :func:`unsharded_experts` names what looks like experts yet holds no shard.
* **The shard record** on each expert parameter:
  :func:`~zerobubble.parallel.shards.mark_expert` (its MoE layer's run and, for a stacked
  ``(E, ...)`` tensor, its rows ``[start, stop)``; :func:`expert_shard` reads the rows),
  which the reductions, the norm, the pipeline's state dict and the checkpoints read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from zerobubble.parallel.ep import ExpertGroup, all_to_all, exchange_counts
from zerobubble.parallel.shards import expert_shard_of, is_expert

__all__ = [
    "ExpertLayer",
    "ShardsExperts",
    "dispatch_order",
    "exchange_grouped",
    "exchange_rows",
    "expert_shard",
    "run_experts",
    "run_grouped",
    "shard_all_experts",
    "unsharded_experts",
]


class ExpertLayer(nn.Module):
    """A layer whose forward is ``combine(ctx, moe.exchange(rows, counts))`` after
    ``ctx, rows, counts = dispatch(x)``: the phases the single-process reference
    drives for every ep rank at once.

    ``moe`` holds the experts: ``moe.experts[str(e)]`` is global expert ``e`` (once sharded,
    only this rank's), ``moe.exchange(rows, counts)`` their outputs of the dispatched rows
    (communicating over its ep group). Our :class:`~zerobubble.models.moe.MoE` is one, and is
    its own ``moe``.
    """

    moe: Any

    def dispatch(self, x: Tensor) -> tuple[Any, Tensor, Tensor]:
        raise NotImplementedError

    def combine(self, ctx: Any, out: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        ctx, rows, counts = self.dispatch(x)
        return self.combine(ctx, self.moe.exchange(rows, counts))


def dispatch_order(chosen: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """For ``chosen`` ``(N, k)`` expert indices: the (token, k) pairs sorted by expert
    (stable: token order within an expert), the token of each sorted pair, and the
    per-expert counts ``(E,)``."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // chosen.shape[1], counts


def run_experts(experts: Sequence[Any], rows: Tensor, counts: Tensor) -> Tensor:
    """Run local experts on received rows, returning outputs in the received layout.

    ``rows`` holds, for source rank 0, 1, ... in turn, its rows for local expert 0,
    1, ...; ``counts[src, l]`` how many. Expert ``l`` runs once on its rows of all
    sources concatenated in source order.
    """

    def each(grouped: Tensor, per_expert: Tensor) -> Tensor:
        outs = [e(x) for e, x in zip(experts, grouped.split(per_expert.tolist()), strict=True)]
        return torch.cat(outs) if outs else grouped

    return run_grouped(each, rows, counts)


def run_grouped(fn: Callable[[Tensor, Tensor], Tensor], rows: Tensor, counts: Tensor) -> Tensor:
    """:func:`run_experts` with every local expert in one call: ``fn(grouped, per_expert)``
    gets the received rows regrouped expert-major (source order inside an expert) and the
    rows per local expert ``(E / ep,)``, and returns their outputs in that order (one
    grouped matmul per projection, say); the outputs come back in the received layout."""
    sources, local = counts.shape
    if sources == 1:  # already grouped by expert
        return fn(rows, counts[0])
    # perm: the received rows regrouped expert-major (source order inside an expert)
    flat = counts.reshape(-1)
    starts = flat.cumsum(0) - flat  # of each (source, expert) block in the received rows
    lengths = counts.t().reshape(-1)  # the blocks in expert-major order
    moved = starts.view(sources, local).t().reshape(-1) - (lengths.cumsum(0) - lengths)
    perm = torch.arange(len(rows), device=counts.device)
    perm = (perm + moved.repeat_interleave(lengths)).to(rows.device)
    out = fn(rows[perm], counts.sum(0))
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(len(perm), device=perm.device)
    return out[inverse]


def exchange_rows(experts: Sequence[Any], rows: Tensor, counts: Tensor, ep: ExpertGroup) -> Tensor:
    """Outputs of dispatched ``rows`` (sorted by global expert, ``counts`` per expert), in
    the rows' order: counts then rows all-to-all to the experts' owners, :func:`run_experts`
    over this rank's ``experts`` (callables), the reverse all-to-all. No communication at
    ``ep.size == 1``."""
    return exchange_grouped(lambda x, c: run_experts(experts, x, c), rows, counts, ep)


def exchange_grouped(
    run: Callable[[Tensor, Tensor], Tensor], rows: Tensor, counts: Tensor, ep: ExpertGroup
) -> Tensor:
    """:func:`exchange_rows` with ``run(received, received_counts)`` (``(sources, E / ep)``)
    in place of :func:`run_experts`: three all-to-alls in the forward (the counts, the rows,
    the outputs back) and, for the two of rows, their reverse in the backward."""
    if ep.size == 1:
        return run(rows, counts.view(1, -1))
    received = exchange_counts(counts, ep)
    send = counts.view(ep.size, -1).sum(1).tolist()
    recv = received.sum(1).tolist()
    got = all_to_all(rows, recv, send, ep)
    return all_to_all(run(got, received), send, recv, ep)


def expert_shard(param: Tensor) -> tuple[int, int, int] | None:
    """``(start, stop, num_experts)``: the rows of the whole ``(E, ...)`` tensor that
    ``param`` holds (a sharded Hugging Face experts tensor,
    :attr:`~zerobubble.parallel.shards.ExpertShard.rows`); None
    for any other tensor."""
    shard = expert_shard_of(param)
    return None if shard is None else shard.rows


class ShardsExperts(Protocol):
    """The sharding hook of a module that holds experts (see :func:`shard_all_experts`)."""

    def shard_experts(self, ep: ExpertGroup, first_run: int) -> int:
        """Keep this rank's experts ``[r * E / ep, (r + 1) * E / ep)`` of every expert layer
        the module holds, mark their parameters (:func:`~zerobubble.parallel.ep.mark_expert`)
        with runs ``first_run, first_run + 1, ...`` and return how many runs it used (0:
        it holds no experts); ValueError naming what it cannot shard."""
        ...


def shard_all_experts(module: nn.Module, ep: ExpertGroup, first_run: int = 0) -> int:
    """Shard every module in ``module`` that has the hook ``shard_experts(ep, first_run) ->
    runs`` (the outermost one only: what it holds is its own), in module order; each gets the
    next free :func:`~zerobubble.parallel.ep.mark_expert` run and returns how many runs it
    used. Returns the runs used in all (0: nothing holds experts). A hook raises ValueError
    for experts it cannot shard."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if any(outer == "" or name.startswith(f"{outer}.") for outer, _ in found):
            continue  # inside one already found
        if callable(getattr(type(m), "shard_experts", None)):
            found.append((name, m))
    run = first_run  # the hooks run after the walk: they replace submodules
    for _, m in found:
        run += cast(ShardsExperts, m).shard_experts(ep, run)
    return run - first_run


def unsharded_experts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Submodules that look like a MoE layer's experts yet hold no expert shard: named
    ``experts`` (what transformers and our MoE call them) or of a class named ``...Experts``,
    with parameters of which none is marked (:func:`~zerobubble.parallel.ep.is_expert`); the
    outermost such module only. Under ``ep > 1`` such a module would silently run as plain
    data parallelism."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in out):
            continue  # inside one already named
        looks = name.rpartition(".")[2] == "experts" or type(m).__name__.endswith("Experts")
        params = list(m.parameters())
        if looks and params and not any(is_expert(p) for p in params):
            out.append((name, m))
    return out
