"""The weight-gradient store: one record per (chunk, microbatch), from F to the gradient sum.

Two ways in, one store:

* Recorded (the fast path, used by :class:`~zerobubble.runtime.stage.StageChunk`):
  inside :meth:`WeightGradStore.record` a split layer runs the native kernel on
  a leaf alias of its weight and appends a :class:`Call` (its input, where its
  output sits in the graph, and W's function) to :attr:`WeightGradStore.recording`.
  :meth:`WeightGradStore.backward` asks autograd for the gradients of the
  recorded outputs along with the stage input and the parameters, and W turns
  them into weight gradients. No custom autograd node, no Python per layer in B.
* Captured (the rest): a custom autograd Function whose backward, inside
  :meth:`WeightGradStore.capture`, returns only the input gradient and queues its
  weight-gradient work with :meth:`WeightGradStore.defer`.

Gradients are added to ``.grad`` in microbatch order, with plain autograd's
arithmetic (first microbatch assigned, later ones added), even when W ops run
out of order. The segments of a microbatch's sequence (units of a segment schedule)
are added in the order their backwards run, last segment first: a segment's gradients
then never wait for its earlier segments' (k - 1 copies of the stage's gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.distributed.tensor import DTensor

__all__ = [
    "Call",
    "CastGrad",
    "GradList",
    "State",
    "WeightGradFn",
    "WeightGradStore",
    "Work",
    "cast_back",
    "output_node",
]

_PyNode = torch._C._FunctionBase
"""Type of a custom Function's graph node, which a bare GradientEdge does not keep alive."""

Key = tuple[int, int]
"""(chunk, microbatch)."""


class CastGrad(NamedTuple):
    """A weight gradient with respect to an autocast cast of its parameter, still in the
    cast's dtype.

    Autocast casts a parameter once per forward (its cast cache) and every use of that cast
    sends its gradient to the cast's one backward node, which sums them in the low precision
    and casts the sum back. :meth:`WeightGradStore.run` does the same with every CastGrad
    through the same ``cast``: sum in arrival order, then one cast to the parameter's dtype.
    """

    grad: Tensor
    cast: Tensor
    """The cast operand the gradient is with respect to (it identifies the cast)."""


GradList = list[tuple[Tensor, "Tensor | CastGrad"]]
"""``(parameter, gradient)`` pairs, in the order they were produced; a gradient with
respect to an autocast cast of the parameter comes as a :class:`CastGrad` (see
:func:`cast_back`)."""

_Grad = tuple[Tensor, "Tensor | CastGrad", bool]
"""``(parameter, gradient, owned)`` for one microbatch; ``owned`` if no one else holds it."""


_Ready = tuple[Tensor, Tensor, bool]
"""A :data:`_Grad` whose casts are summed and cast back (:func:`_combine`)."""


def cast_back(grad: Tensor, used: Tensor, param: Tensor) -> Tensor | CastGrad:
    """``param``'s share of ``grad``, the gradient with respect to ``used``, the operand that
    stood for ``param`` in the op: ``grad`` itself when ``used`` has the parameter's dtype,
    else a :class:`CastGrad` for the store to sum and cast back."""
    return grad if used.dtype == param.dtype else CastGrad(grad, used)


@dataclass(frozen=True, slots=True)
class WeightGradFn:
    """How W turns a kind of recorded call into weight gradients.

    A typed object rather than attributes on a function, so that the store calls each
    part by name: ``one`` for a call on its own, and for calls that must run together
    (the graph-level split's, which share autocast's casts) ``group`` and ``many``.
    """

    one: Callable[..., GradList]
    """``one(*args, output gradient)``: W of one recorded call."""
    group: Callable[[tuple], Hashable | None] | None = None
    """``group(args)``: a microbatch's calls with the same key (not None) run together
    through ``many``; None for a kind whose calls always run alone."""
    many: Callable[[Sequence[tuple[tuple, Tensor]]], GradList] | None = None
    """``many([(args, output gradient), ...])``, the calls of one group in forward order:
    their W in one go."""

    def __post_init__(self) -> None:
        if (self.group is None) != (self.many is None):
            raise ValueError("WeightGradFn: give group and many together, or neither")


class Work(NamedTuple):
    """A recorded call whose place in the graph is no longer needed (after B)."""

    held: Tensor | tuple[Tensor, ...]
    """The tensors W needs (kept alive until it runs)."""
    w: WeightGradFn
    args: tuple

    def run(self, gy: Tensor) -> GradList:
        """W of this call alone, from its output gradient ``gy``."""
        return self.w.one(*self.args, gy)


class Call(NamedTuple):
    """A split layer's call recorded at forward. A NamedTuple (built per layer and
    microbatch on the critical path): as cheap to read as a tuple, fields by name."""

    held: Tensor | tuple[Tensor, ...]
    """The tensors kept for W."""
    node: Node | GradientEdge
    """Where autograd delivers the output's gradient (:func:`output_node`)."""
    w: WeightGradFn
    args: tuple
    """W runs ``w.one(*args, output gradient)``."""

    def work(self) -> Work:
        """This call without its graph node (which would keep B's saved tensors alive)."""
        return Work(self.held, self.w, self.args)


class State(StrEnum):
    """Where a microbatch is between its forward and the addition of its gradients."""

    OPEN = "open"
    """Forwarded (or first captured); its B has not finished."""
    BACKWARD = "backward"
    """B done; W pending."""
    READY = "ready"
    """W done; waiting for an earlier microbatch of its chunk before adding to ``.grad``."""


class _Deferred(NamedTuple):
    """One captured layer's weight-gradient work for one microbatch."""

    compute: Callable[[], GradList]
    held: tuple[Tensor, ...]
    """The tensors ``compute`` keeps alive until it runs (for memory accounting)."""
    owned: bool
    """``compute`` returns fresh tensors that ``.grad`` may adopt."""


class _Raw(NamedTuple):
    """What B's autograd call returned for parameters and recorded outputs, as it came."""

    params: Sequence[Tensor]
    param_grads: Sequence[Tensor | None]
    calls: list[Work]
    out_grads: Sequence[Tensor | None]

    def early(self) -> list[tuple[Tensor, Tensor]]:
        """Parameter gradients produced by B (None: the parameter was not reached)."""
        return [(p, g) for p, g in zip(self.params, self.param_grads, strict=True) if g is not None]

    def grads(self) -> list[_Grad]:
        """W for the recorded calls, in the order autograd's backward met them (reverse
        forward order), so that a layer's uses are summed as autograd sums them.

        Calls with one :func:`_group_key` (the graph-level split's calls of one module under
        autocast) run together through their :attr:`WeightGradFn.many`, with the
        ``(args, output gradient)`` pairs in forward order, placed where the last of them
        comes in backward order: one recomputation then shares autocast's cast per weight
        among them, as their forward did."""
        pending = [
            (c, gy)
            for c, gy in zip(reversed(self.calls), reversed(self.out_grads), strict=True)
            if gy is not None
        ]
        keys = [_group_key(c) for c, _ in pending]
        groups: dict[Hashable, list[int]] = {}
        for i, key in enumerate(keys):
            if key is not None:
                groups.setdefault(key, []).append(i)
        out: list[_Grad] = []
        for i, ((c, gy), key) in enumerate(zip(pending, keys, strict=True)):
            group = groups[key] if key is not None else [i]
            if len(group) == 1:
                out.extend([(p, g, True) for p, g in c.run(gy)])
            elif i == group[-1]:  # where the cast's backward runs: after its last use
                many = c.w.many
                assert many is not None  # a group key comes with many (WeightGradFn)
                grads = many([(pending[j][0].args, pending[j][1]) for j in reversed(group)])
                out.extend([(p, g, True) for p, g in grads])
        return out

    def held(self) -> list[Tensor]:
        """The tensors kept for W (for memory accounting)."""
        out = [g for g in self.param_grads if g is not None]
        for c, gy in zip(self.calls, self.out_grads, strict=True):
            if gy is not None:
                out += (*_tensors(c.held), gy)
        return out


@dataclass(slots=True)
class _Micro:
    """Everything the store holds for one (chunk, microbatch), from its forward to its sum."""

    order: tuple[int, int] = (0, 0)
    """Where its gradients go among its chunk's: ``(microbatch, -segment)``."""
    state: State = State.OPEN
    recorded: list[Call] = field(default_factory=list)
    """Calls recorded at forward, until B turns them into ``raw``."""
    raw: _Raw | None = None
    """B's gradients, sorted out by W."""
    work: list[_Deferred] = field(default_factory=list)
    """Captured weight-gradient work."""
    early: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    """Gradients produced during B and handed over with :meth:`WeightGradStore.add_grads`."""
    ready: list[_Ready] = field(default_factory=list)
    """W's result, waiting for earlier microbatches."""

    def held(self) -> list[Tensor]:
        out = [t for call in self.recorded for t in _tensors(call.held)]
        if self.raw is not None:
            out += self.raw.held()
        out += [t for item in self.work for t in item.held]
        out += [g for _, g in self.early]
        out += [g for _, g, _ in self.ready]
        return out


class WeightGradStore:
    """Deferred weight-gradient work of one pipeline stage, keyed by (chunk, microbatch).

    Owned by one stage object and handed to its split layers at swap time; it
    holds no global state. The split layers learn which (chunk, microbatch) a
    pass belongs to only inside :meth:`record` (forward) and :meth:`capture`
    (backward); outside both they compute full gradients immediately, like the
    layers they replace.

    Gradient order: every gradient a microbatch contributes (deferred weight
    gradients, and gradients produced during B that :meth:`add_grads` hands
    over) is added to ``.grad`` only once all earlier microbatches of the same
    chunk are added. A microbatch counts from :meth:`begin` (called at forward
    time by :meth:`record`, or implicitly by the first :meth:`capture`) until
    its gradients are added; "earlier" means a smaller microbatch index among
    those in flight. This gives microbatch order as long as a chunk forwards its
    microbatches in increasing order, which every schedule in this library does.
    """

    def __init__(self) -> None:
        self.recording: list[Call] | None = None
        """The call list of the forward being recorded, or None. Split layers append a
        :class:`Call` to it; a plain attribute because it is read once per layer call."""
        self.casts: dict[int, tuple[Tensor, Tensor]] | None = None
        """Autocast's casts of grad-requiring leaves, shared by the split layers of the
        forward being recorded as autocast's cast cache shares them: ``id(source) ->
        (source, cast)`` (an entry keeps its source alive); None outside :meth:`record`."""
        self.rng_lock: AbstractContextManager[Any] = nullcontext()
        """Held while W replays a forward that drew from the default generators (the
        graph-level split), or B a checkpointed region's (activation recompute), which are
        the process's: the executor gives every store of a rank the lock its forwards hold
        (:class:`~zerobubble.runtime.rng.StageRng`), so a replay never moves a generator
        under a forward running at once (an overlapped pair's other half). A reusable no-op
        outside an executor."""
        self._key: Key | None = None
        self._micro: dict[Key, _Micro] = {}

    # ---- protocol -----------------------------------------------------------------------

    def begin(self, chunk: int, mb: int, order: tuple[int, int] | None = None) -> None:
        """Register microbatch ``mb`` of ``chunk`` as in flight (at its forward); ``order``:
        where its gradients go among the chunk's, ``(microbatch, -segment)`` for a unit of
        a segment schedule (default ``(mb, 0)``)."""
        key = (chunk, mb)
        if key in self._micro:
            raise RuntimeError(
                f"chunk {chunk}, microbatch {mb} is already in flight in this store; "
                "run its W before forwarding it again"
            )
        self._micro[key] = _Micro(order=(mb, 0) if order is None else order)

    @contextmanager
    def record(self, chunk: int, mb: int, order: tuple[int, int] | None = None) -> Iterator[None]:
        """Forward of (chunk, mb): begins it (``order`` as :meth:`begin`'s) and lets split
        layers record their calls.

        Its backward must then go through :meth:`backward`, which asks autograd
        for the gradients of the recorded outputs (a plain ``.backward()`` would
        skip the recorded layers' weights).
        """
        if self.recording is not None:
            raise RuntimeError(
                f"record({chunk}, {mb}) entered while another forward is being recorded; "
                "run one microbatch's forward at a time"
            )
        self.begin(chunk, mb, order)
        calls: list[Call] = []
        self.recording = calls
        self.casts = {}
        try:
            yield
        except BaseException:
            del self._micro[chunk, mb]  # a failed forward leaves nothing in flight
            raise
        else:
            self._micro[chunk, mb].recorded = calls
        finally:
            self.recording = None
            self.casts = None

    @contextmanager
    def capture(self, chunk: int, mb: int) -> Iterator[None]:
        """Attribute the weight-gradient work of backward calls inside to (chunk, mb)."""
        key = (chunk, mb)
        if self._key is not None:
            raise RuntimeError(
                f"capture({chunk}, {mb}) entered inside capture{self._key}; "
                "run one microbatch's backward at a time"
            )
        micro = self._micro.get(key)
        if micro is None:
            self.begin(chunk, mb)
            micro = self._micro[key]
        elif micro.state is State.READY:
            raise RuntimeError(
                f"chunk {chunk}, microbatch {mb}: W already ran; its backward cannot run again"
            )
        self._key = key
        try:
            yield
        finally:
            self._key = None
            micro.state = State.BACKWARD

    @property
    def capturing(self) -> Key | None:
        """The (chunk, microbatch) of the current capture context, or None."""
        return self._key

    def backward(
        self,
        chunk: int,
        mb: int,
        root: Tensor | GradientEdge | list[Tensor | GradientEdge] | None,
        grad_output: Tensor | list[Tensor] | None,
        inputs: Sequence[Tensor],
        params: Sequence[Tensor] = (),
    ) -> tuple[Tensor | None, ...]:
        """B of (chunk, mb): the gradients of ``inputs``; weight gradients wait for :meth:`run`.

        One ``torch.autograd.grad`` call from ``root`` for ``inputs``, ``params``
        and the outputs recorded at forward time. The gradients of ``params``
        (parameters of unsplit modules, and split ones used outside their layer)
        are kept as if handed to :meth:`add_grads`; those of the recorded
        outputs, with the recorded inputs, are W's work. Like
        ``torch.autograd.grad`` with ``allow_unused``: None for an input the root
        does not depend on (all None if ``root`` is None: an output that needs
        no gradient). Everything but the autograd call waits for :meth:`run`:
        B is on the pipeline's critical path, W is not.
        """
        micro = self._micro.get((chunk, mb))
        calls: list[Call] = []
        if micro is not None:
            calls, micro.recorded = micro.recorded, []
        targets = [*inputs, *params, *(_edge(c.node) for c in calls)]
        # Several roots (a stage output with several tensors) come as lists.
        roots = root if isinstance(root, list) else [] if root is None else [root]
        if grad_output is not None and not isinstance(grad_output, list):
            grad_output = [grad_output]
        with self.capture(chunk, mb):
            if not roots or not targets:
                return (None,) * len(inputs)
            # The stub wants all-Tensor or all-GradientEdge lists; autograd takes a mix.
            grads = torch.autograd.grad(roots, targets, grad_outputs=grad_output, allow_unused=True)  # type: ignore[arg-type]
        n = len(inputs)
        if params or calls:
            # Drop the graph edges: a node that B did not run keeps its saved tensors.
            work = [c.work() for c in calls]
            self._micro[chunk, mb].raw = _Raw(
                params, grads[n : n + len(params)], work, grads[n + len(params) :]
            )
        return grads[:n]

    def direct(self, chunk: int, mb: int) -> bool:
        """True if B of (chunk, mb) may add its gradients to ``.grad`` itself, right away.

        That is the case when it is the oldest microbatch of its chunk in flight
        and its forward recorded nothing: adding now is what :meth:`run` would
        do. The caller then closes it with :meth:`finish`.
        """
        key = (chunk, mb)
        micro = self._micro.get(key)
        if micro is None or micro.state is not State.OPEN or micro.recorded:
            return False
        return self._first(chunk) == key

    def finish(self, chunk: int, mb: int) -> None:
        """Close (chunk, mb) after its gradients went to ``.grad`` directly (see :meth:`direct`)."""
        if not self.direct(chunk, mb):
            raise RuntimeError(
                f"finish({chunk}, {mb}): not the oldest microbatch of its chunk in flight, or "
                "its forward was recorded; run its backward through backward() and run()"
            )
        del self._micro[chunk, mb]
        self._flush(chunk)

    def defer(
        self, compute: Callable[[], GradList], held: Sequence[Tensor], owned: bool = True
    ) -> None:
        """Queue weight-gradient work for the microbatch being captured (split layers only).

        ``owned``: the gradients ``compute`` returns are fresh (not aliases of
        tensors held elsewhere), so ``.grad`` may adopt them without a copy.
        """
        if self._key is None:
            raise RuntimeError("defer() called outside a capture context")
        self._micro[self._key].work.append(_Deferred(compute, tuple(held), owned))

    def add_grads(self, chunk: int, mb: int, grads: list[tuple[Tensor, Tensor]]) -> None:
        """Hand over gradients computed during B (parameters of unsplit modules)."""
        micro = self._micro.get((chunk, mb))
        if micro is None or micro.state is State.READY:
            raise RuntimeError(
                f"add_grads for chunk {chunk}, microbatch {mb}, which is not in flight"
            )
        micro.early.extend(grads)

    def run(self, chunk: int, mb: int) -> None:
        """W: compute the deferred work of (chunk, mb) and accumulate in microbatch order."""
        micro = self._micro.get((chunk, mb))
        if micro is None or micro.state is not State.BACKWARD:
            why = {
                None: "was never forwarded or its W already ran",
                State.OPEN: "has not run its backward (B) yet",
                State.READY: "already ran W",
            }[None if micro is None else micro.state]
            raise RuntimeError(f"W of chunk {chunk}, microbatch {mb}: it {why}")
        # Gradients from B may alias tensors autograd handed elsewhere; the
        # split layers' own results are fresh tensors that .grad may adopt.
        raw, early, work = micro.raw, micro.early, micro.work
        micro.raw, micro.early, micro.work = None, [], []
        if raw is not None:
            early = raw.early() + early
        grads: list[_Grad] = [(p, g, False) for p, g in early]
        # W's products build no graph (their operands may be aliases) and are not
        # recast: the operands already are what the forward's autocast made them.
        with torch.no_grad(), _autocast_off():
            if raw is not None:
                grads += raw.grads()
            for item in work:  # captured work arrives after the recorded calls
                grads.extend([(p, g, item.owned) for p, g in item.compute()])
        micro.ready = _combine(grads)
        micro.state = State.READY
        self._flush(chunk)

    def discard(self, chunk: int, mb: int) -> None:
        """Forget (chunk, mb) without touching ``.grad``: its work is being replayed."""
        self._micro.pop((chunk, mb), None)

    # ---- inspection ---------------------------------------------------------------------

    def in_flight(self, chunk: int | None = None) -> dict[Key, State]:
        """Keys not yet accumulated and their state: open, backward (W pending) or ready."""
        return {k: m.state for k, m in self._micro.items() if chunk is None or k[0] == chunk}

    def held_tensors(self, chunk: int | None = None) -> list[Tensor]:
        """Every tensor the store keeps alive for ``chunk`` (all chunks if None)."""
        out: list[Tensor] = []
        for key, micro in self._micro.items():
            if chunk is None or key[0] == chunk:
                out += micro.held()
        return out

    # ---- internals ----------------------------------------------------------------------

    def _flush(self, chunk: int) -> None:
        """Add every ready microbatch of ``chunk`` that no earlier one is waiting for."""
        while True:
            first = self._first(chunk)
            if first is None or self._micro[first].state is not State.READY:
                return
            _accumulate(self._micro.pop(first).ready)

    def _first(self, chunk: int) -> Key | None:
        """The in-flight key of ``chunk`` whose gradients go first, if any."""
        keys = [k for k in tuple(self._micro) if k[0] == chunk]
        return min(keys, key=lambda k: self._micro[k].order, default=None)


@contextmanager
def _autocast_off() -> Iterator[None]:
    """Autocast disabled on the CPU and on the current accelerator, if any (entering an
    autocast context costs tens of µs: skipped where autocast is already off)."""
    acc = torch.accelerator.current_accelerator()
    types = ["cpu"] if acc is None else ["cpu", acc.type]
    on = [t for t in types if torch.is_autocast_enabled(t)]
    if not on:
        yield
        return
    with torch.autocast(on[0], enabled=False):
        if len(on) == 1:
            yield
            return
        with torch.autocast(on[1], enabled=False):
            yield


def _group_key(c: Work) -> Hashable | None:
    """Which recorded calls W runs together (see :attr:`WeightGradFn.group`); None for a
    call that runs alone."""
    group = c.w.group
    return None if group is None else group(c.args)


def _tensors(held: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return held if isinstance(held, tuple) else (held,)


def output_node(y: Tensor) -> Node | GradientEdge:
    """Where autograd delivers ``y``'s gradient, cheaply, at forward (for a :class:`Call`)."""
    fn = y.grad_fn
    if fn is None or isinstance(fn, _PyNode) or y.output_nr:  # rare: the graph-owning edge
        return get_gradient_edge(y)
    return fn


def _edge(out: Node | GradientEdge) -> GradientEdge:
    """The gradient edge of a recorded output, for ``torch.autograd.grad``'s inputs."""
    return out if isinstance(out, GradientEdge) else GradientEdge(out, 0)


def _combine(grads: list[_Grad]) -> list[_Ready]:
    """One gradient per parameter, summed as plain autograd sums: first every
    :class:`CastGrad` per (parameter, cast) in arrival order, cast back to the parameter's
    dtype where the last of them arrived (when the cast's backward node runs); then the
    contributions to each parameter in arrival order, as its input buffer does."""
    if len({id(p) for p, _, _ in grads}) == len(grads):  # one contribution each: common
        return [
            (p, g.grad.to(p.dtype), True) if isinstance(g, CastGrad) else (p, g, owned)
            for p, g, owned in grads
        ]
    last = {
        (id(p), g.cast.data_ptr()): i
        for i, (p, g, _) in enumerate(grads)
        if isinstance(g, CastGrad)
    }
    cast: list[_Ready] = []
    pending: dict[tuple[int, int], Tensor] = {}
    for i, (p, g, owned) in enumerate(grads):
        if not isinstance(g, CastGrad):
            cast.append((p, g, owned))
            continue
        key = id(p), g.cast.data_ptr()
        part = pending.pop(key, None)
        part = g.grad if part is None else part + g.grad
        if last[key] == i:
            cast.append((p, part.to(p.dtype), True))
        else:
            pending[key] = part
    total: dict[int, _Ready] = {}
    for p, g, owned in cast:
        prev = total.get(id(p))
        total[id(p)] = (p, g, owned) if prev is None else (p, prev[1] + g, True)
    return list(total.values())


def _accumulate(grads: list[_Ready]) -> None:
    """``.grad = g`` for the first microbatch, ``.grad += g`` after: AccumulateGrad's arithmetic.

    Like AccumulateGrad, the first gradient is adopted only if nobody else holds
    it and it has the parameter's strides; otherwise ``.grad`` gets a copy. The
    additions run as one ``_foreach_add_`` (elementwise, so the same bits as
    one ``add_`` per parameter).
    """
    dst: list[Tensor] = []
    src: list[Tensor] = []
    with torch.no_grad():
        for param, grad, owned in grads:
            if param.grad is None:
                if isinstance(grad, DTensor) and grad.placements != getattr(
                    param, "placements", None
                ):
                    # As AccumulateGrad: a DTensor gradient keeps its placements (a
                    # Partial one stays unreduced: copying it into the parameter's
                    # layout, or DTensor's clone, would all-reduce it here, in W).
                    grad = grad if owned else _local_copy(grad)
                elif not owned or grad.stride() != param.stride():
                    grad = torch.empty_like(param).copy_(grad)
                param.grad = grad
            else:
                dst.append(param.grad)
                src.append(grad)
        if dst:
            _add_(dst, src)


def _add_(dst: list[Tensor], src: list[Tensor]) -> None:
    """``dst[i] += src[i]`` as one ``_foreach_add_`` over plain tensors: DTensors (tensor
    parallelism) add their local tensors where the placements agree (no collective), and
    through DTensor's ``add_`` otherwise."""
    plain: tuple[list[Tensor], list[Tensor]] = ([], [])
    for d, g in zip(dst, src, strict=True):
        if not isinstance(d, DTensor):
            plain[0].append(d)
            plain[1].append(g)
        elif isinstance(g, DTensor) and g.placements == d.placements:
            plain[0].append(d.to_local())
            plain[1].append(g.to_local())
        else:
            d.add_(g)
    if plain[0]:
        torch._foreach_add_(*plain)


def _local_copy(grad: DTensor) -> DTensor:
    """A copy of ``grad`` made of a copy of its local tensor, in its placements."""
    local = grad.to_local().clone()
    return DTensor.from_local(
        local,
        grad.device_mesh,
        grad.placements,
        run_check=False,
        shape=grad.shape,
        stride=grad.stride(),
    )
