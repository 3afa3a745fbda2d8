"""Activation checkpointing that composes with the B/W split.

A checkpointed region (a whole stage, or selected layers of it) runs in F
without a graph and keeps only its inputs. Its B runs the region's forward
again, with the generator and autocast states F had (so dropout draws the same
numbers, bitwise), and asks autograd for the input gradient, the gradients of
the region's unsplit parameters and, inside a B of the store, the output
gradients of the split layers it recorded while recomputing. Those layers'
weight-gradient work (their inputs and output gradients) goes to the store as
deferred work: W is unchanged, and after B the region holds exactly what W
needs. A fused BW on a region recomputes, then runs the plain backward.

The region is one custom autograd node (the reentrant style of checkpointing):
its forward is the no-graph pass, its backward the recomputation. Limits, all
shared with ``torch.utils.checkpoint``: every floating output of a region
carries a gradient (F cannot tell which do without a graph; one that does not
gets a zero gradient); a region may use only its inputs and its own parameters
(a parameter of another module reached from inside a checkpointed layer gets no
gradient: checkpoint the layer that owns it, or the whole stage); a kernel
that picks its algorithm by ``requires_grad`` may round F's and B's forward
differently. A region that modifies one of its inputs in place cannot be
recomputed from them: F refuses it, naming the region (a stage's checkpoint
hands its module copies of the inputs, so there in-place ops work as without
it). Buffers the forward updates (BatchNorm's running statistics) are put back
after the recomputation (:mod:`~zerobubble.runtime.split.buffers`): each
microbatch updates them once, as in plain autograd.

A replay holds the process's default generators under the rank's forward lock
(:attr:`WeightGradStore.rng_lock`) when F drew from them, so it composes with an
overlapped pair's forward running at once on another thread; everything else it touches
is its stage's or thread-local. A collective layer that runs in both directions tells a
replay from a forward by :func:`replaying` (an ep layer's all-to-alls then go on its
backwards' group: the replay runs on the backward's thread, beside a pair's forward on the
forwards' group). Under a segment scope the region takes its part of it
(:class:`~zerobubble.runtime.sequence.kv.RegionSegments`): the past keys and values its
attention reads are extra inputs, its own keys and values extra outputs, and the replay
runs in a scope of F's start over the same past, so it computes what F computed.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.utils import _pytree as pytree

from zerobubble.runtime.sequence.kv import RegionSegments
from zerobubble.runtime.split.buffers import restored
from zerobubble.runtime.split.store import Call, GradList, WeightGradStore, Work

__all__ = [
    "Recompute",
    "RecomputePlan",
    "install_layer_recompute",
    "recompute_plan",
    "replaying",
    "run_checkpointed",
]

Recompute: TypeAlias = Literal["none", "stage", "layers"] | Callable[[str, nn.Module], bool]
"""What a stage checkpoints: nothing, the whole stage (module and, on the last stage,
the loss), every direct child of the stage module, or the outermost submodules a
predicate ``(qualified name, module) -> bool`` selects."""

RECOMPUTE_MODES = ("none", "stage", "layers")


class RecomputePlan:
    """A validated :data:`Recompute` setting (``mode`` is "none", "stage" or "layers")."""

    def __init__(self, mode: str, predicate: Callable[[str, nn.Module], bool] | None) -> None:
        self.mode = mode
        self.predicate = predicate

    def select(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """The submodules of ``module`` that "layers" or a predicate checkpoints, outermost."""
        if self.mode != "layers":
            return []
        if self.predicate is None:
            return list(module.named_children())
        out: list[tuple[str, nn.Module]] = []

        def visit(prefix: str, m: nn.Module) -> None:
            for name, child in m.named_children():
                qual = f"{prefix}{name}"
                if self.predicate is not None and self.predicate(qual, child):
                    out.append((qual, child))
                else:
                    visit(f"{qual}.", child)

        visit("", module)
        return out


def recompute_plan(spec: Recompute) -> RecomputePlan:
    """Check a :data:`Recompute` value; a bad one raises ValueError naming the choices."""
    if callable(spec):
        return RecomputePlan("layers", spec)
    if spec not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute={spec!r} is not one of {', '.join(map(repr, RECOMPUTE_MODES))} "
            "or a predicate (name, module) -> bool selecting the layers to checkpoint"
        )
    return RecomputePlan(spec, None)


# ---- the checkpointed region ------------------------------------------------------------


class _Replaying(threading.local):
    """Whether this thread is replaying a checkpointed region's forward (per thread: a
    pair's forward runs at once on another)."""

    def __init__(self) -> None:
        self.on = False


_REPLAYING = _Replaying()


def replaying() -> bool:
    """Whether this thread runs a checkpointed region's forward again, inside its B.

    Every peer of a collective replays at the same program point of its backward, so a
    layer whose forward communicates may put a replay's collectives on its backwards'
    group (:class:`~zerobubble.runtime.overlap.LaneGroups`): they then run in one order
    with the backward's own, on the backward's thread, never beside a pair's forward's."""
    return _REPLAYING.on


@contextmanager
def _marked() -> Iterator[None]:
    """Inside: :func:`replaying` is true on this thread."""
    was, _REPLAYING.on = _REPLAYING.on, True
    try:
        yield
    finally:
        _REPLAYING.on = was


class _State:
    """The generator and autocast states a region's forward ran under, for its replay."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu_rng, self.acc_rng = _rng_states(device)
        types = ["cpu"] if device.type == "cpu" else ["cpu", device.type]
        self.autocast = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types
        ]
        self.cache = torch.is_autocast_cache_enabled()
        self.drew = True
        """Whether F drew from the default generators (set after it ran, :meth:`ran`)."""

    def ran(self) -> None:
        """F ran: note whether it moved the default generators. A replay of a forward that
        drew nothing leaves them alone (it draws nothing either), and so needs no lock."""
        after = _rng_states(self.device)
        self.drew = not all(
            a is b or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip((self.cpu_rng, self.acc_rng), after, strict=True)
        )

    @contextmanager
    def replay(self, rng_lock: AbstractContextManager[Any]) -> Iterator[None]:
        """Inside: F's generator and autocast states; the caller's generators come back.

        The default generators are the process's: while the replay holds them it holds
        ``rng_lock`` (:attr:`WeightGradStore.rng_lock`, the lock every forward of the rank
        holds), so that the forward of an overlapped pair's other half, running at once on
        another thread, neither moves them under the replay nor sees them moved.
        """
        dev = self.device
        devices = [] if self.acc_rng is None else [dev]
        with ExitStack() as stack:
            if self.drew:
                stack.enter_context(rng_lock)
                stack.enter_context(torch.random.fork_rng(devices=devices, device_type=dev.type))
                torch.set_rng_state(self.cpu_rng)
                if self.acc_rng is not None:
                    torch.get_device_module(dev.type).set_rng_state(self.acc_rng, dev)
            for t, enabled, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(t, dtype=dtype, enabled=enabled, cache_enabled=self.cache)
                )
            yield


def _rng_states(device: torch.device) -> tuple[Tensor, Tensor | None]:
    """The CPU's and ``device``'s default generator states (None: ``device`` is the CPU)."""
    acc = None if device.type == "cpu" else torch.get_device_module(device.type)
    return torch.get_rng_state(), None if acc is None else acc.get_rng_state(device)


class _Region:
    """One checkpointed call: the function, how to rebuild its arguments, where W goes."""

    def __init__(
        self,
        fn: Callable[..., Any],
        spec: pytree.TreeSpec,
        leaves: list[Any],
        slots: list[int],
        params: list[Tensor],
        store: WeightGradStore | None,
        module: nn.Module | None,
        name: str,
        segments: RegionSegments | None,
    ) -> None:
        self.fn = fn
        self.spec = spec
        self.leaves = leaves  # the non-tensor leaves; tensors are filled in at each call
        self.slots = slots  # where the tensor leaves go
        self.params = params
        self.store = store
        self.module = module  # whose buffers the recomputation puts back
        self.name = name  # for messages: "stage 2", "stage 2: layer 'mlp' (MLP)"
        self.segments = segments  # the region's part in a segment scope, or None
        self.state: _State | None = None
        self.out_spec: pytree.TreeSpec | None = None
        self.out_leaves: list[Any] = []
        self.out_slots: list[int] = []

    def call(self, tensors: Sequence[Tensor]) -> Any:
        """The function on ``tensors``: the call's tensors, then the segments' past leaves
        (which the function reads from its scope)."""
        leaves = list(self.leaves)
        for i, t in zip(self.slots, tensors[: len(self.slots)], strict=True):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.fn(*args, **kwargs)

    def outputs(self, out: Any) -> list[Tensor]:
        """``out``'s tensors; the first time, remembers its structure for :meth:`rebuild`."""
        leaves, spec = pytree.tree_flatten(out)
        slots = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        if self.out_spec is None:
            kept = [None if isinstance(x, Tensor) else x for x in leaves]
            self.out_spec, self.out_leaves, self.out_slots = spec, kept, slots
        return [leaves[i] for i in slots]

    def rebuild(self, tensors: Sequence[Tensor]) -> Any:
        assert self.out_spec is not None
        leaves = list(self.out_leaves)
        for i, t in zip(self.out_slots, tensors, strict=True):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.out_spec)


class _Checkpoint(torch.autograd.Function):
    """F without a graph, keeping the inputs; backward recomputes (see the module docstring).

    Called as ``apply(region, *inputs, *region.params)``: the parameters are inputs of
    the node so that autograd routes their gradients through it (and a region on
    integer inputs, such as token ids, still gets a backward), but are not saved.
    """

    @staticmethod
    def forward(ctx: Any, region: _Region, *tensors: Tensor) -> tuple[Tensor, ...]:
        inputs = tensors[: len(tensors) - len(region.params)]
        ctx.region = region
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs)
        device = next((t.device for t in tensors), torch.device("cpu"))
        region.state = _State(device)
        versions = [t._version for t in inputs]
        outs = region.outputs(region.call(inputs))
        region.state.ran()
        if region.segments is not None:  # its own keys and values: extra outputs
            outs += region.segments.outputs()
        modified = [
            i for i, (t, v) in enumerate(zip(inputs, versions, strict=True)) if t._version != v
        ]
        if modified:
            raise RuntimeError(
                f"{region.name}: the checkpointed forward modified its input(s) {modified} in "
                "place, so B could not recompute it from them; make that operation out of place "
                "(e.g. inplace=False), or leave this layer out of recompute (a predicate), or "
                "checkpoint the whole stage (recompute='stage')"
            )
        # An input handed through unchanged becomes a view, so that this node owns it.
        outs = [o.view_as(o) if any(o is t for t in inputs) else o for o in outs]
        fixed = [
            o
            for o in outs
            if not o.is_floating_point()
            or any(o._base is t and not t.requires_grad for t in inputs)
        ]
        ctx.mark_non_differentiable(*fixed)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        region: _Region = ctx.region
        params = region.params
        xs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        store = region.store
        calls: list[Call] = []
        assert region.state is not None
        record = store is not None and store.capturing is not None
        kept = nullcontext() if region.module is None else restored(region.module)
        rng_lock = nullcontext() if store is None else store.rng_lock
        segments = _replay_segments(region, xs)
        try:
            with (
                kept,
                region.state.replay(rng_lock),
                _marked(),
                torch.enable_grad(),
                _recording(store, calls, record),
                segments as own_kv,
            ):
                outs = region.outputs(region.call(xs))
                outs += own_kv()
        except torch.OutOfMemoryError:
            raise  # keeps its type: callers catch it to retry smaller
        except Exception as e:
            raise RuntimeError(
                f"{region.name}: recomputing the checkpointed forward in B failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        live = [
            (o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad
        ]
        wanted = [x for x in xs if x.requires_grad] + [p for p in params if p.requires_grad]
        edges = [_edge(c.node) for c in calls]
        work = [c.work() for c in calls]
        del calls, outs  # the recorded nodes would keep the recomputed graph alive
        got: Sequence[Tensor | None] = [None] * (len(wanted) + len(edges))
        if live and (wanted or edges):
            targets: list[Tensor | GradientEdge] = [*wanted, *edges]
            roots, gys = [o for o, _ in live], [g for _, g in live]
            # The stub wants all-Tensor or all-GradientEdge inputs; autograd takes a mix.
            got = torch.autograd.grad(roots, targets, gys, allow_unused=True)  # type: ignore[arg-type]
        del live
        if work:
            assert store is not None
            _defer(store, work, got[len(wanted) :])
        it = iter(got[: len(wanted)])
        out: list[Tensor | None] = [None]  # the region
        out += [next(it) if x.requires_grad else None for x in xs]
        out += [next(it) if p.requires_grad else None for p in params]
        return tuple(out)


def _replay_segments(
    region: _Region, xs: Sequence[Tensor]
) -> AbstractContextManager[Callable[[], list[Tensor]]]:
    """The segment scope of ``region``'s replay over the recomputation's past leaves (the
    inputs after the call's), yielding what gives its own keys and values; for a region
    outside segments, no scope and none."""
    if region.segments is None:
        return nullcontext(list)
    return region.segments.replay(xs[len(region.slots) :])


def _edge(node: Any) -> GradientEdge:
    return node if isinstance(node, GradientEdge) else GradientEdge(node, 0)


@contextmanager
def _recording(store: WeightGradStore | None, calls: list[Call], on: bool) -> Iterator[None]:
    """Let the split layers of the recomputation record into ``calls`` (inside a B)."""
    if not on:
        yield
        return
    assert store is not None
    if store.recording is not None:
        raise RuntimeError(
            "a checkpointed region was recomputed while a forward is being recorded; "
            "run its backward outside the stage's forward"
        )
    store.recording = calls
    store.casts = {}  # autocast's one cast per weight, shared by its uses, as in the forward
    try:
        yield
    finally:
        store.recording = None
        store.casts = None


def _defer(store: WeightGradStore, work: list[Work], out_grads: Sequence[Tensor | None]) -> None:
    """Hand the recorded calls' weight gradients to the store as this microbatch's W work,
    in the order autograd's backward met the calls (reverse forward order), as B does."""
    pending = [(w, g) for w, g in zip(work, out_grads, strict=True) if g is not None]
    held: list[Tensor] = []
    for w, gy in pending:
        held += [*(w.held if isinstance(w.held, tuple) else (w.held,)), gy]

    def compute() -> GradList:
        grads: GradList = []
        for w, gy in reversed(pending):
            grads += w.run(gy)
        return grads

    store.defer(compute, held, owned=True)


def run_checkpointed(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    params: Sequence[Tensor],
    store: WeightGradStore | None,
    module: nn.Module | None = None,
    name: str = "checkpointed region",
) -> Any:
    """``fn(*args, **kwargs)`` as a checkpointed region over ``params``.

    ``module``: the module ``fn`` runs, whose buffers the recomputation must leave as it
    finds them; ``name`` names the region in errors. Without grad mode, or when neither
    an input nor a parameter requires grad, it is a plain call (there is nothing to
    recompute for).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
    # Under a segment scope the past keys and values are inputs too, the own ones outputs.
    segments = None if module is None else RegionSegments.of(module)
    tensors = [leaves[i] for i in slots] + ([] if segments is None else segments.inputs())
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in [*tensors, *params]):
        return fn(*args, **kwargs)
    for i in slots:
        leaves[i] = None
    region = _Region(fn, spec, leaves, slots, list(params), store, module, name, segments)
    got = _Checkpoint.apply(region, *tensors, *params)
    n = len(region.out_slots)
    if segments is not None:
        segments.adopt(got[n:])
    return region.rebuild(got[:n])


# ---- per-layer regions ------------------------------------------------------------------


class _LayerForward:
    """A checkpointed module's forward: its own forward, as a region over its parameters.

    Several chunks may run one module (a split and an unsplit chunk over the same
    layers): each call's weight-gradient work goes to the store recording the forward.
    """

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name  # "stage 1: layer 'act' (Hardswish)", from the first install
        self.stores: list[WeightGradStore] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> _LayerForward:
        """The forward of a copy of the module: bound to the copy, recording into the same
        stores (a copy of a checkpointed layer is checkpointed, and runs itself)."""
        out = _LayerForward(copy.deepcopy(self.module, memo), self.name)
        out.stores = list(self.stores)
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m = self.module
        inner = type(m).forward
        store = next((s for s in self.stores if s.recording is not None), None)
        # The parameters as they are now: inside an ancestor with the graph-level split
        # they are its aliases, so that B leaves them to that split's W (as without
        # checkpointing), which then recomputes this layer again.
        params = list(m.parameters())
        fn = lambda *a, **k: inner(m, *a, **k)  # noqa: E731
        return run_checkpointed(fn, args, kwargs, params, store, m, self.name)


def install_layer_recompute(
    module: nn.Module, plan: RecomputePlan, store: WeightGradStore, stage: int
) -> list[str]:
    """Checkpoint the layers ``plan`` selects in ``module``; returns their names.

    A layer's ``forward`` is overridden on the instance (parameters and state_dict
    keys stay); a layer already checkpointed (by another chunk over the same module)
    is bound to ``store`` too. Refused with ValueError: a layer with an instance
    forward of its own, or one that carries the graph-level split itself (its hooks
    run around the checkpointed call; checkpoint its parent instead).
    """
    from zerobubble.runtime.split.fallback import GraphSplit

    names = []
    for name, m in plan.select(module):
        forward = m.__dict__.get("forward")
        if forward is not None and not isinstance(forward, _LayerForward):
            raise ValueError(
                f"stage {stage}: layer {name!r} ({type(m).__name__}) has an instance forward "
                "of its own, which checkpointing would replace; wrap the layer in a module "
                "instead"
            )
        if GraphSplit.of(m) is not None:
            raise ValueError(
                f"stage {stage}: layer {name!r} ({type(m).__name__}) has the graph-level B/W "
                "split, which cannot be checkpointed itself; checkpoint the layer around it "
                "or give it a split rule"
            )
        if forward is None:
            label = f"stage {stage}: layer {name!r} ({type(m).__name__})"
            forward = m.forward = _LayerForward(m, label)
        if store not in forward.stores:
            forward.stores.append(store)
        names.append(name)
    return names
