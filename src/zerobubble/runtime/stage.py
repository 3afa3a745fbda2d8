"""The compute of one virtual stage: F, B, W and BW on one microbatch at a time.

A :class:`StageChunk` wraps the layers of one virtual stage. It keeps, per
microbatch, exactly what the next op needs: after F the autograd graph (its
saved tensors) and the stage input; after B only the weight-gradient work in
the :class:`~zerobubble.runtime.split.WeightGradStore`; after W nothing.
It knows nothing of devices or communication: the executor moves the tensors
that :meth:`StageChunk.forward` and :meth:`StageChunk.backward_input` return.

All parameter gradients, including those of unsplit modules (LayerNorm...)
that autograd produces during B, reach ``.grad`` in microbatch order (through
the store, or straight from autograd for a BW that is next in line), so a
pipeline run matches :func:`~zerobubble.reference.step.reference_step`
bitwise.

What rides on the ops without changing them (loss terms, sequence segments) is a
:class:`~zerobubble.runtime.extension.StageExtension` the chunk calls in a loop, so
that this module keeps F/B/W/BW, the records and the store.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from zerobubble.runtime.extension import Call, Roots, StageChunkError, StageExtension, Unit
from zerobubble.runtime.recompute import (
    Recompute,
    install_layer_recompute,
    recompute_plan,
    run_checkpointed,
)
from zerobubble.runtime.sequence.extension import SegmentExtension
from zerobubble.runtime.sequence.kv import SegmentOf
from zerobubble.runtime.shapes import map_tensors, tensor_leaves
from zerobubble.runtime.split import (
    SplitRules,
    SplitShare,
    SplitShareWarning,
    WeightGradStore,
    enable_bw_split,
    is_split,
    split_share,
)
from zerobubble.runtime.split.fallback import GraphSplit
from zerobubble.runtime.term_extension import LossTermExtension

__all__ = ["StageChunk", "StageChunkError", "storage_bytes"]

LossFn = Callable[..., Tensor]
"""``loss_fn(output, target)``, or ``loss_fn(output, target, num_items)`` (see
:meth:`StageChunk.forward`); output and target may be pytrees."""


@dataclass
class _Record:
    """What one microbatch holds between F and B (state "F") or B and W (state "B")."""

    state: str
    x: list[Tensor] | None
    """The input's tensors (None after B); those that require grad get a gradient."""
    bare: bool
    """The input was one tensor (B returns one gradient, not a list)."""
    roots: Roots
    """One per output tensor that carries a gradient (the scaled loss on the last stage)."""
    outs: list[tuple[torch.Size, torch.dtype, torch.device]]
    unit: Unit
    saved: list[weakref.ref[Tensor]] = field(default_factory=list)
    extended: list[StageExtension] = field(default_factory=list)
    """The extensions B calls for this unit (those whose ``keep`` said so)."""


def storage_bytes(tensors: Iterable[Tensor], exclude: Iterable[Tensor] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors``, skipping those of ``exclude``.

    Views share their base's storage and count once, at its full size: that is
    what keeping them alive costs. A DTensor counts its local shard (what this rank holds).
    Fake and meta tensors (no memory, as a memory estimate runs a stage) count by their
    storage's identity, having no address.
    """
    skip = {_storage_key(p) for t in exclude for p in _plain(t)}
    seen: dict[int, int] = {}
    for p in (p for t in tensors for p in _plain(t)):
        key = _storage_key(p)
        if key and key not in skip:
            seen[key] = p.untyped_storage().nbytes()
    return sum(seen.values())


def _storage_key(t: Tensor) -> int:
    """The address of ``t``'s storage (0 for none), or for a fake or meta tensor, which has
    none, the storage object's (one per storage, shared by views)."""
    st = t.untyped_storage()
    if t.is_meta or isinstance(t, FakeTensor):
        return int(st._cdata) if st.nbytes() else 0
    return int(st.data_ptr())


def _plain(t: Tensor) -> Iterator[Tensor]:
    """The plain tensors behind ``t``: itself, or a wrapper subclass's inner tensors (a
    DTensor's local shard, a pending collective's result), which hold its memory."""
    if not is_traceable_wrapper_subclass(t):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, Tensor):  # not the metadata some subclasses list (a mesh)
            yield from _plain(inner)


class StageChunk:
    """F / B / W / BW of one virtual stage.

    What rides on the ops without changing them is in :attr:`extensions`
    (:mod:`~zerobubble.runtime.extension`): the loss terms that layers add, and, under a
    segment schedule (``forward(..., segment=...)``, the ops then run on units, one
    segment of a microbatch's sequence each), the keys and values the microbatch's
    segments share on this stage.

    Args:
        module: The stage's layers (split in place when ``split``).
        stage: Index of this virtual stage in model order.
        num_stages: Number of virtual stages; stage 0 takes raw inputs and
            stage ``num_stages - 1`` computes the loss.
        loss_fn: ``loss_fn(output, target) -> scalar`` (or with ``num_items``, see
            :meth:`forward`); required on the last stage only.
        store: Weight-gradient store; chunks on one device may share one. A new
            store is made if None.
        split: Split the weight gradients out of B (see
            :func:`~zerobubble.runtime.split.enable_bw_split`). With False, B
            computes every gradient and W only adds them to ``.grad``.
        split_rules: The rules deciding each layer's split; the defaults if None.
        track_memory: Keep track of the tensors each microbatch's graph saves, so
            that :meth:`held_bytes` can count them. Costs a Python call per saved
            tensor in F and in B; without it :meth:`held_bytes` is unavailable.
        recompute: Activation checkpointing (:mod:`~zerobubble.runtime.recompute`):
            "none"; "stage" (F keeps only the stage's input, and on the last stage the
            target; B recomputes the stage and its loss); "layers" (every direct child
            of ``module`` keeps only its inputs); or a predicate ``(name, module) ->
            bool`` choosing the layers. W is unchanged.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        num_stages: int,
        *,
        loss_fn: LossFn | None = None,
        store: WeightGradStore | None = None,
        split: bool = True,
        split_rules: SplitRules | None = None,
        track_memory: bool = True,
        recompute: Recompute = "none",
    ) -> None:
        _check_stage(stage, num_stages, loss_fn)
        self.stage = stage
        self.num_stages = num_stages
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.loss_fn = loss_fn
        self.store = WeightGradStore() if store is None else store
        self.split = split
        self.module = enable_bw_split(module, self.store, split_rules) if split else module
        self._share = _ShareWatch(self.module, stage, split)
        self.split_share: SplitShare | None = self._share.share
        """How much weight-gradient work W holds (None without split); updated after a
        forward in which a graph-level split fell back to B (several outputs)."""
        self.track_memory = track_memory
        plan = recompute_plan(recompute)
        self.recompute = plan.mode
        """"none", "stage" or "layers" (a predicate counts as "layers")."""
        self.recomputed_layers = install_layer_recompute(self.module, plan, self.store, stage)
        """Names of the checkpointed layers (empty unless "layers")."""
        self._params = list(self.module.parameters())
        # Without split layers a BW in microbatch order can let autograd add the
        # gradients itself (AccumulateGrad, as the reference does).
        self._plain = not is_split(self.module)
        self._submodules = list(self.module.modules())
        self._records: dict[int, _Record] = {}
        self._held: int | None = 0  # held_bytes() until the next op; None: recount
        self._objective: Tensor | None = None
        """The last stage's unscaled objective of the run that just ran (set by
        :meth:`_value`, taken by :meth:`forward`; a replay's is ignored)."""
        self._loss_terms = LossTermExtension(self._submodules)
        self.extensions: list[StageExtension] = [
            self._loss_terms,
            SegmentExtension(self.module),
        ]
        """Called in this order at each point of F and B; a new one is one more entry."""

    # ---- ops ----------------------------------------------------------------------------

    def forward(
        self,
        mb: int,
        *inputs: Any,
        target: Any = None,
        loss_scale: float = 1.0,
        num_items: Tensor | int | None = None,
        segment: SegmentOf | None = None,
        term_weight: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """F. Returns the stage output, detached, or on the last stage the unscaled loss.

        Stage 0 is called as ``module(*inputs, **kwargs)`` on the raw microbatch;
        a later stage takes exactly one input, the received boundary value (a
        tensor or a pytree, see :mod:`~zerobubble.runtime.shapes`): a bare float
        tensor, and every float leaf of a pytree that requires grad, becomes a
        leaf that requires grad. In the returned output the float tensors that
        carry a gradient are fresh leaves flagged ``requires_grad`` (no graph),
        so a receiver knows which gradients to send back. The last stage keeps
        ``loss * loss_scale`` as the root of its backward; its loss is
        ``loss_fn(output, target)``, or ``loss_fn(output, target, num_items)`` when
        ``num_items`` (a count over the whole batch) is given.

        Loss terms the layers add (:mod:`~zerobubble.runtime.term_extension`) travel
        with the output as their running sums; on the last stage the loss becomes the
        objective, the loss plus every term, and :meth:`take_terms` gives the terms.
        ``term_weight``: each term's weight in the root (None: as the loss,
        ``loss_scale``). Not with ``segment``.

        With ``segment``, ``mb`` is a unit of a segment schedule and the input is that
        segment of the microbatch's sequence: the stage's attention reads the keys and
        values kept from the microbatch's earlier segments (which must have run here, in
        order) and keeps its own for the later ones
        (:mod:`~zerobubble.runtime.sequence.extension`).
        """
        rec = self._records.get(mb)
        _check_forward(self.stage, mb, self.is_first, self.is_last, rec, inputs, kwargs, target)
        unit = Unit(self.stage, mb, self.is_first, self.is_last, segment, loss_scale, term_weight)
        scopes = [ext.enter(unit) for ext in self.extensions]
        bare = len(inputs) == 1 and not kwargs and isinstance(inputs[0], Tensor)
        if self.is_first:
            args, kw = map_tensors((inputs, kwargs), Tensor.detach)
        else:
            args, kw = (map_tensors(inputs[0], _receive_leaf(bare)),), {}
        saved: list[Tensor] = []  # held by the graph anyway until F returns
        self._held, self._objective = None, None
        with torch.enable_grad(), _saving(self.track_memory, saved), ExitStack() as stack:
            for scope in scopes:
                stack.enter_context(scope)
            order = None if segment is None else (segment.microbatch, -segment.index)
            stack.enter_context(self.store.record(self.stage, mb, order))
            out = self._run(unit, args, kw, target, num_items)
            result = _objective(self.stage, mb, self._objective, out) if self.is_last else out
        self._objective = None
        extended = [ext for ext in self.extensions if ext.keep(unit, out)]
        grad_outs = [t for t in tensor_leaves(out) if t.requires_grad]
        # Keep each output's node, not its data, unless the loss (a scalar) or a
        # leaf that the stage passed through.
        roots: Roots = [
            t if self.is_last or t.grad_fn is None else get_gradient_edge(t) for t in grad_outs
        ]
        outs = [(t.shape, t.dtype, t.device) for t in grad_outs]
        refs = [weakref.ref(t) for t in saved]
        saved.clear()  # every saved tensor's hooks keep `pack`, and with it this list, alive
        x = tensor_leaves(args if self.is_first else args[0])
        self._records[mb] = _Record("F", x, bare, roots, outs, unit, refs, extended)
        if self._share.graph_splits:
            self.split_share = self._share.recount()
        if self.is_last:
            return result.detach()
        return map_tensors(result, _send_leaf)

    def _run(self, unit: Unit, args: tuple, kw: dict, target: Any, num_items: Any) -> Any:
        """The value of F's run: :meth:`_value`, as a checkpointed region under "stage"."""
        if self.recompute == "stage":
            # The region keeps its inputs for B: the module gets copies, which it
            # may modify in place (F and B each copy; F's copy dies with F).
            call = (args, kw, target, num_items, unit)
            name = f"stage {self.stage}"
            return run_checkpointed(
                self._copied_value, call, {}, self._params, self.store, self.module, name
            )
        # A received leaf would refuse in-place ops, which plain autograd allows
        # on the activation it stands for: the module gets a non-leaf alias.
        inner = args if self.is_first else map_tensors(args, _entry)
        return self._value(inner, kw, target, num_items, unit)

    def _copied_value(self, args: tuple, kw: dict, target: Any, num_items: Any, unit: Unit) -> Any:
        """:meth:`_value` on copies of the module's input tensors (what "stage" replays)."""
        args, kw = map_tensors((args, kw), Tensor.clone)
        return self._value(args, kw, target, num_items, unit)

    def _value(self, args: tuple, kw: dict, target: Any, num_items: Any, unit: Unit) -> Any:
        """The stage's output, or on the last stage the root of its backward (what "stage"
        recompute replays): the module's run as the extensions wrap it, then the loss, and
        the root the first extension that forms one gives (else ``loss * loss_scale``);
        the unscaled objective goes to ``_objective`` for :meth:`forward`.
        """
        fn: Call = functools.partial(_call, self.module)
        for ext in reversed(self.extensions):
            fn = ext.call(unit, fn)
        out = fn(args, kw)
        if not self.is_last:
            return out
        assert self.loss_fn is not None and target is not None
        if num_items is None:
            loss = self.loss_fn(out, target)
        else:
            loss = self.loss_fn(out, target, num_items)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            return loss  # forward refuses a loss that is no scalar, naming the stage
        formed = (ext.root(unit, loss) for ext in self.extensions)
        root, self._objective = next(
            (r for r in formed if r is not None), (loss * unit.loss_scale, loss.detach())
        )
        return root

    def take_terms(self, mb: int) -> dict[str, Tensor]:
        """The loss terms of microbatch ``mb``'s forward on the last stage, by name (their
        per-microbatch sums, detached and unscaled; empty if its layers added none)."""
        return self._loss_terms.take(mb)

    def backward_input(self, mb: int, grad_output: Any) -> Any:
        """B. Returns the gradient of the stage input: for a bare tensor input that
        gradient (None on stage 0 or for an integer input), for a pytree input the
        list of gradients of its tensors that require grad, in depth-first order.

        ``grad_output`` is what the next stage's B returned (None on the last
        stage: backward starts from the scaled loss). The tensors W needs stay
        in the store; the rest of the microbatch's graph is freed. ``grad_output``
        may be kept until W: do not overwrite it in place.
        """
        rec = self._require(mb, "F", "backward_input (B)")
        grads = _grad_output(self.stage, mb, self.is_last, rec, grad_output)
        self._held = None
        assert rec.x is not None
        xs = [t for t in rec.x if t.requires_grad]
        params = [p for p in self._params if p.requires_grad]
        roots, extra = rec.roots, []
        for ext in rec.extended:  # extra roots, their gradients and inputs
            roots, grads, inputs = ext.backward(rec.unit, roots, grads)
            extra.append(inputs)
        inputs = xs + [t for more in extra for t in more]
        got = self.store.backward(self.stage, mb, roots, grads, inputs, params)
        at = len(xs)
        for ext, more in zip(rec.extended, extra, strict=True):
            ext.hand_back(rec.unit, got[at : at + len(more)])
            at += len(more)
        # The weak references to saved tensors stay: held_bytes would expose a
        # graph that B failed to free.
        rec.state, rec.x, rec.roots = "B", None, []
        return _input_grads(rec, xs, got[: len(xs)])

    def backward_weight(self, mb: int) -> None:
        """W. Runs the deferred weight-gradient work and adds gradients in microbatch order."""
        self._require(mb, "B", "backward_weight (W)")
        self._held = None
        self.store.run(self.stage, mb)
        del self._records[mb]

    def backward_full(self, mb: int, grad_output: Tensor | None) -> Tensor | None:
        """BW: B then W, for schedules that do not split the backward.

        Without split layers and in microbatch order, one ``torch.autograd.backward``
        adds the parameter gradients as it goes, like plain autograd (not for a unit
        an extension takes part in: B calls it).
        """
        rec0 = self._records.get(mb)
        extended = rec0 is not None and bool(rec0.extended)
        if extended or not (self._plain and self.store.direct(self.stage, mb)):
            gx = self.backward_input(mb, grad_output)
            self.backward_weight(mb)
            return gx
        rec = self._require(mb, "F", "backward_full (BW)")
        grads = _grad_output(self.stage, mb, self.is_last, rec, grad_output)
        self._held = None
        assert rec.x is not None
        xs = [t for t in rec.x if t.requires_grad]
        inputs = xs + [p for p in self._params if p.requires_grad]
        if rec.roots and inputs:
            # The stub takes all-Tensor or all-GradientEdge roots; autograd accepts a mix.
            torch.autograd.backward(rec.roots, grads, inputs=inputs)  # type: ignore[arg-type]
        self.store.finish(self.stage, mb)
        del self._records[mb]
        return _input_grads(rec, xs, [x.grad for x in xs])

    def refresh_parameters(self) -> None:
        """Take the module's current parameter objects (FSDP swaps gathered parameters in
        and out of the module: B must differentiate the ones the forward used)."""
        self._params = list(self.module.parameters())

    def discard(self) -> None:
        """Drop every microbatch in flight, leaving ``.grad`` untouched.

        For speculative work that is replayed after a parameter rollback (see
        :mod:`zerobubble.program.passes.protocol`); the graphs and stored inputs are freed.
        """
        self._held = None
        for mb in self._records:
            self.store.discard(self.stage, mb)
        self._records.clear()
        for ext in self.extensions:
            ext.discard()

    # ---- inspection ---------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Bytes of activations, saved tensors and pending gradients this chunk holds.

        Counts distinct storages (parameters and buffers excluded) among: each
        in-flight microbatch's input and the saved tensors of its graph that are
        still alive, everything the store keeps for this chunk (W's inputs
        and output gradients, gradients waiting for an earlier microbatch), and what
        the extensions keep between ops.
        Counted at the first call after each op of this chunk (only ops change
        it), so callers may ask around every instruction.
        """
        if not self.track_memory:
            raise RuntimeError(
                f"stage {self.stage}: held_bytes() needs StageChunk(track_memory=True)"
            )
        if self._held is None:
            held = [*self.store.held_tensors(self.stage)]
            held.extend(t for ext in self.extensions for t in ext.held_tensors())
            self._held = _held_bytes(self._records.values(), held, self._submodules)
        return self._held

    def layer_of(self, error: BaseException) -> str | None:
        """The innermost layer of this stage whose forward is on ``error``'s traceback,
        as ``"layer 'blocks.0.attn' (Attention)"``; None if none is (for messages)."""
        found = self.layer_path(error)
        return None if found is None else f"layer {found[0]!r} ({found[1]})"

    def layer_path(self, error: BaseException) -> tuple[str, str] | None:
        """:meth:`layer_of` as ``(module path in the stage, class name)``; the path's
        first part is the layer's index in the stage."""
        return _layer_of(self.module, error)

    def pending(self) -> dict[int, str]:
        """Microbatches in flight: "F" (awaiting B) or "B" (awaiting W)."""
        return {mb: rec.state for mb, rec in sorted(self._records.items())}

    # ---- checks -------------------------------------------------------------------------

    def _require(self, mb: int, state: str, op: str) -> _Record:
        rec = self._records.get(mb)
        if rec is None:
            raise StageChunkError(
                self.stage, mb, f"{op} of a microbatch that was never forwarded (or already ran W)"
            )
        if rec.state != state:
            why = "B already ran" if rec.state == "B" else "W before B: run backward_input first"
            raise StageChunkError(self.stage, mb, f"{op}: {why}")
        return rec


class _ShareWatch:
    """The chunk's :class:`SplitShare` and its warning: counted at construction, and
    recounted once a graph-level split has fallen back to B (a call with several
    differentiable outputs), warning if W now defers less than half (once per chunk)."""

    def __init__(self, module: nn.Module, stage: int, split: bool) -> None:
        self.module, self.stage = module, stage
        self.share = split_share(module) if split else None
        message = None if self.share is None else self.share.warning(stage)
        self.warned = message is not None
        if message is not None:
            warnings.warn(message, SplitShareWarning, stacklevel=3)  # StageChunk's caller
        self.graph_splits = [g for m in module.modules() if (g := GraphSplit.of(m)) is not None]
        self.fallen_back = 0  # how many of them fell back to B so far

    def recount(self) -> SplitShare | None:
        fallen = sum(g.outputs_seen > 1 for g in self.graph_splits)
        if fallen == self.fallen_back:
            return self.share
        self.fallen_back = fallen
        self.share = split_share(self.module)
        message = self.share.warning(self.stage)
        if message is not None and not self.warned:
            self.warned = True
            warnings.warn(message, SplitShareWarning, stacklevel=3)  # forward's caller
        return self.share


def _saving(track_memory: bool, saved: list[Tensor]) -> AbstractContextManager[object]:
    """With ``track_memory``, F's graph hands each tensor it saves to ``saved`` (as an
    alias), so that :meth:`held_bytes` can watch it for as long as it lives."""
    if not track_memory:
        return nullcontext()

    def pack(t: Tensor) -> Tensor:
        alias = t.detach()  # an alias, not t itself: t may own this very graph
        saved.append(alias)
        return alias

    return saved_tensors_hooks(pack, _identity)


def _check_forward(
    stage: int,
    mb: int,
    is_first: bool,
    is_last: bool,
    rec: _Record | None,
    inputs: tuple,
    kwargs: dict,
    target: Any,
) -> None:
    """Refuse a forward out of protocol: of a unit still in flight (``rec``, its record),
    with a target off the last stage (or none on it), with several inputs after the first."""
    if rec is not None:
        raise StageChunkError(
            stage, mb, f"forwarded twice; its {'B' if rec.state == 'F' else 'W'} has not run yet"
        )
    if is_last and target is None:
        raise StageChunkError(stage, mb, "the last stage needs target= for the loss")
    if not is_last and target is not None:
        raise StageChunkError(
            stage, mb, "target= is only used on the last stage; do not pass it here"
        )
    if not is_first and (len(inputs) != 1 or kwargs):
        raise StageChunkError(
            stage, mb, "a stage after the first takes one input, the received value"
        )


def _objective(stage: int, mb: int, objective: Tensor | None, out: Any) -> Tensor:
    """What the last stage's F returns: the objective (``out`` is the root, loss_scale and
    weights applied), or a refusal if the loss was no scalar (then ``objective`` is None)."""
    if objective is None:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out)
        raise StageChunkError(stage, mb, f"loss_fn must return a scalar tensor, got {shape}")
    return objective


def _held_bytes(
    records: Iterable[_Record], held: list[Tensor], submodules: Sequence[nn.Module]
) -> int:
    """:meth:`StageChunk.held_bytes` counted: the records' inputs, roots and live saved
    tensors, and ``held`` (the store's and the extensions'), without parameters and buffers."""
    tensors: list[Tensor] = []
    for rec in records:
        if rec.x is not None:
            tensors.extend(rec.x)
        tensors.extend(r for r in rec.roots if isinstance(r, Tensor))
        tensors.extend(t for ref in rec.saved if (t := ref()) is not None)
    tensors.extend(held)
    weights = [
        t
        for m in submodules
        for t in (*m._parameters.values(), *m._buffers.values())
        if t is not None
    ]
    return storage_bytes(tensors, exclude=weights)


def _layer_of(module: nn.Module, error: BaseException) -> tuple[str, str] | None:
    """:meth:`StageChunk.layer_path`: the innermost named layer on ``error``'s traceback
    (whose code raised it: a module's ``__getattr__`` failing to find an attribute is not
    that module's failure but its reader's)."""
    names = {id(m): n for n, m in module.named_modules() if n}
    found = None
    tb = error.__traceback__
    while tb is not None:
        m = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_code.co_name != "__getattr__" and id(m) in names:
            found = (names[id(m)], type(m).__name__)
        tb = tb.tb_next
    return found


def _check_stage(stage: int, num_stages: int, loss_fn: LossFn | None) -> None:
    """Refuse a stage out of range, and a loss_fn missing on the last stage or given on
    another."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not in [0, num_stages={num_stages})")
    is_last = stage == num_stages - 1
    if is_last and loss_fn is None:
        raise ValueError(f"stage {stage} is the last stage: pass loss_fn")
    if not is_last and loss_fn is not None:
        raise ValueError(
            f"stage {stage} is not the last of {num_stages} stages: only the last "
            "stage computes the loss, drop loss_fn"
        )


def _grad_output(
    stage: int, mb: int, is_last: bool, rec: _Record, grad: Any
) -> list[Tensor] | None:
    """``grad`` as one gradient per root (None on the last stage), checked against the
    output tensors of ``rec`` that carry a gradient."""
    if is_last:
        if grad is not None:
            raise StageChunkError(
                stage, mb, "the last stage's backward starts from its loss: pass grad_output=None"
            )
        return None
    if grad is None and not rec.roots:
        return []  # the output carries no gradient (e.g. integer ids passed along)
    if grad is None:
        raise StageChunkError(
            stage, mb, "grad_output is None; pass the gradient of this stage's output"
        )
    grads = [grad] if isinstance(grad, Tensor) else list(grad)
    if len(grads) != len(rec.outs) or not all(isinstance(g, Tensor) for g in grads):
        raise StageChunkError(
            stage,
            mb,
            f"grad_output holds {len(grads)} values but the forward output has "
            f"{len(rec.outs)} tensors that carry a gradient; pass one gradient per such "
            "tensor, in depth-first order",
        )
    for i, (g, (shape, dtype, device)) in enumerate(zip(grads, rec.outs, strict=True)):
        if (g.shape, g.dtype, g.device) != (shape, dtype, device):
            which = "" if len(grads) == 1 else f" {i}"
            raise StageChunkError(
                stage,
                mb,
                f"grad_output{which} has shape {tuple(g.shape)}, dtype {g.dtype}, device "
                f"{g.device} but the forward output had shape {tuple(shape)}, "
                f"dtype {dtype}, device {device}; send the gradient of this "
                "stage's output for this microbatch",
            )
    return grads


def _identity(t: Tensor) -> Tensor:
    return t


def _call(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``module(*args, **kwargs)``; an ``nn.Sequential`` (which takes one input) hands
    several arguments to its first layer and chains the rest."""
    if type(module) is not nn.Sequential or (len(args) == 1 and not kwargs):
        return module(*args, **kwargs)
    layers = list(module)
    out = layers[0](*args, **kwargs)
    for layer in layers[1:]:
        out = layer(out)
    return out


def _receive_leaf(bare: bool) -> Callable[[Tensor], Tensor]:
    """A received tensor as a stage input: a fresh leaf; with a gradient if it is a bare
    float tensor or flagged ``requires_grad`` by its sender."""

    def leaf(t: Tensor) -> Tensor:
        grad = t.is_floating_point() and (bare or t.requires_grad)
        return t.detach().requires_grad_(grad)

    return leaf


class _Entry(torch.autograd.Function):
    """The stage input as its module sees it: the leaf's storage (no copy) and version
    counter, but a node of its own, so that in-place ops on it work as on the activation
    it stands for; its gradient reaches the leaf unchanged."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def _entry(t: Tensor) -> Tensor:
    return _Entry.apply(t) if t.requires_grad else t


def _send_leaf(t: Tensor) -> Tensor:
    """A stage output as sent on: no graph, but still flagged if it carries a gradient."""
    return t.detach().requires_grad_(t.requires_grad and t.is_floating_point())


def _input_grads(rec: _Record, xs: list[Tensor], grads: Sequence[Tensor | None]) -> Any:
    """Zeros for an input the output does not depend on; one tensor for a bare input."""
    out = [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads, strict=True)]
    if rec.bare:
        return out[0] if out else None
    return out
