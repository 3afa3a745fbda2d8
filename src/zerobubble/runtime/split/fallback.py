"""Graph-level B/W split for any parameterised module that has no kernel.

The module keeps its own forward. Inside ``store.record`` it runs with leaf
aliases of its parameters swapped in (as a kernel split does), so that B, which
asks autograd for the stage input, the parameters and the recorded outputs,
never runs the module's weight-gradient edges; the module's output is recorded
like a split layer's. W recomputes the module's forward from its kept inputs
(same RNG state, same autocast state) and asks autograd for the parameters'
gradients from the output gradient B delivered. Both halves run autograd's own
nodes on the same values, so B and W are bitwise those of plain autograd. The
price is W's recomputation; in return, after B only the module's inputs and its
output gradient stay alive.

A module called with more than one differentiable output is re-run with its
real parameters instead (its gradients then arrive in B): W has a single output
gradient per recorded call. Inputs modified in place between F and W are
detected (version counters) and refused. Buffers the forward updates (BatchNorm's
running statistics) are put back after every re-run, in F and in W, so each
microbatch updates them once, as in plain autograd (see
:mod:`~zerobubble.runtime.split.buffers`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from zerobubble.runtime.split.buffers import restored
from zerobubble.runtime.split.kernels import _alias, _current
from zerobubble.runtime.split.store import (
    Call,
    GradList,
    WeightGradFn,
    WeightGradStore,
    output_node,
)

__all__ = ["GraphSplit", "install_graph_split"]


class _Replay(NamedTuple):
    """What W needs to recompute one call: its inputs and the state it ran in."""

    args: tuple
    kwargs: dict
    versions: tuple[tuple[Tensor, int], ...]
    rng: tuple[Tensor, Tensor | None]
    autocast: tuple[bool, torch.dtype, bool]
    """Enabled, dtype, cast cache enabled."""
    device: torch.device
    """Whose generator ``rng`` holds besides the CPU's."""
    drew: bool = True
    """Whether the forward drew from the default generators (known after it ran). A
    replay of a forward that drew nothing leaves them alone: it draws nothing either."""


def _rng_states(dev: torch.device) -> tuple[Tensor, Tensor | None]:
    """The CPU's and ``dev``'s default generator states (None: ``dev`` is the CPU)."""
    acc = None if dev.type == "cpu" else torch.get_device_module(dev.type).get_rng_state(dev)
    return torch.get_rng_state(), acc


def _set_rng_states(states: tuple[Tensor, Tensor | None], dev: torch.device) -> None:
    cpu, acc = states
    torch.set_rng_state(cpu)
    if acc is not None:
        torch.get_device_module(dev.type).set_rng_state(acc, dev)


class GraphSplit:
    """Forward hooks giving one module the graph-level split (see the module docstring)."""

    def __init__(self, module: nn.Module, store: WeightGradStore) -> None:
        self.store = store
        self.slots = [
            (owner, name)
            for owner in module.modules()
            for name, p in owner._parameters.items()
            if p is not None
        ]
        """Where each parameter of the module sits: (owning submodule, attribute name)."""
        self._aliases: dict[tuple[int, str], Tensor] = {}
        self._open: list[tuple[list[tuple[nn.Module, str, nn.Parameter]], _Replay] | None] = []
        self._rerun = False
        self.outputs_seen = 0
        """The most differentiable outputs a recorded call of the module returned; above 1
        its gradients were computed in B (see the module docstring), which
        :func:`~zerobubble.runtime.split.swap.unsplit_modules` then reports."""

    def install(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._before, with_kwargs=True)
        module.register_forward_hook(self._after, with_kwargs=True, always_call=True)

    @staticmethod
    def of(module: nn.Module) -> GraphSplit | None:
        """The graph-level split installed on ``module``, or None.

        Found through the module's own forward pre-hooks, the one record that exists
        anyway: nothing is written into the user's module, and no registry outlives it.
        """
        for hook in module._forward_pre_hooks.values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, GraphSplit):
                return owner
        return None

    def params(self) -> list[Tensor]:
        """The module's parameters, in a fixed order."""
        return [owner._parameters[name] for owner, name in self.slots]  # type: ignore[misc]

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        params = self.params()
        if (
            self._rerun
            or self.store.recording is None
            or not torch.is_grad_enabled()
            or not any(p.requires_grad for p in params)
        ):
            self._open.append(None)
            return
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        for (owner, name), p in zip(self.slots, params, strict=True):
            original = owner._parameters[name]  # p itself, typed as the Parameter it is
            if original is not None and p.requires_grad:
                key = (id(owner), name)
                alias = self._aliases.get(key)
                if not _current(alias, p):
                    alias = self._aliases[key] = _alias(p)
                owner._parameters[name] = alias  # type: ignore[assignment]
                swapped.append((owner, name, original))
        flat = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        dev = flat[0].device if flat else params[0].device
        held_args, held_kwargs = _held_inputs(args, kwargs)
        replay = _Replay(
            held_args,
            held_kwargs,
            tuple((t, t._version) for t in flat),
            _rng_states(dev),
            (
                torch.is_autocast_enabled(dev.type),
                torch.get_autocast_dtype(dev.type),
                torch.is_autocast_cache_enabled(),
            ),
            dev,
        )
        self._open.append((swapped, replay))

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        opened = self._open.pop()
        if opened is None:
            return None
        swapped, replay = opened
        for owner, name, p in swapped:
            owner._parameters[name] = p
        if output is None:  # the forward raised (always_call): parameters restored, done
            return None
        outs = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
        calls = self.store.recording
        if calls is not None:
            self.outputs_seen = max(self.outputs_seen, len(outs))
        dev = replay.device
        if len(outs) != 1 or calls is None:
            self._rerun = True  # several outputs: plain autograd for this call
            try:
                _set_rng_states(replay.rng, dev)  # the same draws again, as one call makes
                with restored(module):
                    return module(*args, **kwargs)
            finally:
                self._rerun = False
        after = _rng_states(dev)
        drew = not all(
            a is b or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(replay.rng, after, strict=True)
        )
        replay = replay._replace(drew=drew)
        held = tuple(t for t, _ in replay.versions)
        calls.append(Call(held, output_node(outs[0]), _RECOMPUTE, (self, module, replay)))
        return None


def _held_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's inputs as W re-runs them: detached, yet the same ops on the same operands.

    A tensor passed several times stays one object (``MultiheadAttention`` projects
    ``q is k is v`` with one packed ``linear``, distinct tensors with three), and each
    keeps its ``requires_grad`` (``matmul`` folds or batches by it). Either difference
    would make W's recomputation issue other kernels than the forward did, whose sums
    may round differently; W asks autograd for the parameters only, so the inputs'
    flag computes nothing more.
    """
    held: dict[int, Tensor] = {}

    def hold(t: Tensor) -> Tensor:
        h = held.get(id(t))
        if h is None:
            h = held[id(t)] = t.detach().requires_grad_(t.requires_grad)
        return h

    return pytree.tree_map_only(Tensor, hold, (args, kwargs))


def _recompute(split: GraphSplit, module: nn.Module, replay: _Replay, gy: Tensor) -> GradList:
    """W of a graph-split call: the forward again, then autograd to the parameters."""
    return _recompute_calls(split, module, [(replay, gy)])


def _recompute_many(calls: Sequence[tuple[tuple, Tensor]]) -> GradList:
    """W of a group of graph-split calls (:func:`_recompute_group`), ``(args, output
    gradient)`` pairs in forward order; the args are the recorded ``(split, module, replay)``."""
    split, module, _ = calls[0][0]
    return _recompute_calls(split, module, [(args[2], gy) for args, gy in calls])


def _recompute_calls(
    split: GraphSplit, module: nn.Module, calls: Sequence[tuple[_Replay, Tensor]]
) -> GradList:
    """W of one or more graph-split calls of ``module`` in one microbatch (``calls`` in
    forward order, all in one autocast state): each forward again from its kept inputs and
    RNG state, all inside one autocast context, then one autograd call to the parameters.
    So, as in the forward, autocast casts each weight once (its cache) and autograd sums
    the calls' gradients at that cast before casting back, as plain autograd does."""
    for replay, _ in calls:
        for t, version in replay.versions:
            if t._version != version:
                raise RuntimeError(
                    f"{type(module).__name__}: an input of this module was modified in place "
                    "between its forward and its W, so W cannot recompute it; avoid in-place "
                    "ops on its inputs or give the module a split rule"
                )
    params = split.params()
    need = [p for p in params if p.requires_grad]
    gys = [gy for _, gy in calls]
    dev = gys[0].device
    enabled, dtype, cache = calls[0][0].autocast
    outs: list[Tensor] = []
    with (
        torch.enable_grad(),
        torch.autocast(dev.type, dtype=dtype, enabled=enabled, cache_enabled=cache),
        restored(module),
    ):
        for replay, _ in calls:
            if replay.drew:  # the generators are the rank's: see WeightGradStore.rng_lock
                devices = [] if replay.rng[1] is None else [dev]
                with (
                    split.store.rng_lock,
                    torch.random.fork_rng(devices=devices, device_type=dev.type),
                ):
                    _set_rng_states(replay.rng, dev)
                    out = module(*replay.args, **replay.kwargs)
            else:
                out = module(*replay.args, **replay.kwargs)
            (y,) = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
            outs.append(y)
    grads = torch.autograd.grad(outs, need, gys, allow_unused=True)
    ptrs = {_data_ptr(gy) for gy in gys}
    return [
        (p, g.clone() if _data_ptr(g) in ptrs else g)  # .grad may adopt it
        for p, g in zip(need, grads, strict=True)
        if g is not None
    ]


def _data_ptr(t: Tensor) -> int:
    """Where ``t``'s storage is; a DTensor's (tensor parallelism) is its local tensor's, which
    may be the wrapper of a collective's result (B's reduce-scatter, done: B's input
    gradient used it), whose own storage is the result's."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if isinstance(local, AsyncCollectiveTensor):
        local = local.trigger_wait()
    return local.untyped_storage().data_ptr()


def _recompute_group(args: tuple) -> Hashable | None:
    """The calls W recomputes together
    (:attr:`~zerobubble.runtime.split.store.WeightGradFn.group`): those of one module under
    autocast with its cast cache, where they share a cast; without, each runs alone (exact,
    and W holds one recomputed graph at a time)."""
    split, _, replay = args
    enabled, dtype, cache = replay.autocast
    return (id(split), dtype) if enabled and cache else None


_RECOMPUTE = WeightGradFn(_recompute, group=_recompute_group, many=_recompute_many)
"""W of graph-split calls: alone, or a group of one module's calls under autocast's cache."""


def install_graph_split(module: nn.Module, store: WeightGradStore) -> None:
    """Give ``module`` the graph-level split bound to ``store`` (rebinding an existing one)."""
    existing = GraphSplit.of(module)
    if existing is not None:
        existing.store = store
        return
    GraphSplit(module, store).install(module)
