"""Operator-level split of backward into B (input gradient) and W (weight gradient).

A pipeline stage must send the gradient of its input upstream as early as
possible; the gradient of its own weights is only needed before the optimizer
step. For a linear layer ``Y = X Wᵀ + b`` the two are separate matrix products
(``dX = dY W`` and ``dW = dYᵀ X``), so B computes ``dX`` and a
:class:`WeightGradStore` keeps ``X`` and ``dY`` for a later W op that computes
``dW``/``db``. :class:`SplitEmbedding` does the same (its B is empty: token ids
have no gradient).

Two mechanisms, one store:

* Recorded (the fast path, used by :class:`~zerobubble.runtime.chunk.StageChunk`):
  inside :meth:`WeightGradStore.record` a split layer runs the native kernel
  on a leaf alias of its weight (see :func:`_alias`) and notes its input and
  where its output sits in the graph. The graph is the one plain autograd
  builds; :meth:`WeightGradStore.backward` asks autograd for the gradients of
  the recorded outputs along with the stage input and the parameters (not the
  aliases), and W turns them into weight gradients. No custom autograd node,
  no Python per layer during B.
* Captured (the rest: a non-contiguous N-D input to a Linear, layers used
  outside ``record``): a custom autograd Function whose backward, inside
  :meth:`WeightGradStore.capture`, returns only ``dX`` and queues ``dW``.

Exactness: B and W call the very kernels PyTorch's autograd calls for
``F.linear`` / ``F.embedding`` (same folding of N-D inputs, same operand order
and layout-dependent formula, same bias reduction), so the gradients are
bitwise those of plain autograd. Gradients are added to ``.grad`` in
microbatch order, with plain autograd's arithmetic (first microbatch assigned,
later ones added), even when W ops run out of order.

Memory: after B only what W needs stays alive (each split layer's input and
output gradient); the rest of the microbatch's graph is freed by B.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = [
    "GradList",
    "SplitEmbedding",
    "SplitLinear",
    "WeightGradStore",
    "enable_bw_split",
]

_PyNode = torch._C._FunctionBase
"""Type of a custom Function's graph node, which a bare GradientEdge does not keep alive."""

Key = tuple[int, int]
"""(chunk, microbatch)."""

GradList = list[tuple[Tensor, Tensor]]
"""``(parameter, gradient)`` pairs, in the order they were produced."""


_Grad = tuple[Tensor, Tensor, bool]
"""``(parameter, gradient, owned)`` for one microbatch; ``owned`` if no one else holds it."""


class _Deferred(NamedTuple):
    """One split layer's weight-gradient work for one microbatch."""

    compute: Callable[[], GradList]
    held: tuple[Tensor, ...]
    """The tensors ``compute`` keeps alive until it runs (for memory accounting)."""


_Call = tuple[Tensor, "Node | GradientEdge", Callable[..., GradList], tuple]
"""A split layer's call recorded at forward: ``(input kept for W, node of the output,
grads, args)``; W runs ``grads(*args, output gradient)``. A plain tuple: one is built
per layer and microbatch on the critical path."""


class _Work(NamedTuple):
    """A recorded call after B (its place in the graph no longer needed)."""

    held: Tensor
    grads: Callable[..., GradList]
    args: tuple


class _Raw(NamedTuple):
    """What B's autograd call returned for parameters and recorded outputs, as it came."""

    params: Sequence[Tensor]
    param_grads: Sequence[Tensor | None]
    calls: list[_Work]
    out_grads: Sequence[Tensor | None]

    def early(self) -> GradList:
        """Parameter gradients produced by B (None: the parameter was not reached)."""
        return [(p, g) for p, g in zip(self.params, self.param_grads, strict=True) if g is not None]

    def grads(self) -> list[_Grad]:
        """W for the recorded calls, in the order autograd's backward met them (reverse
        forward order), so that a layer's uses are summed as autograd sums them."""
        out: list[_Grad] = []
        for c, gy in zip(reversed(self.calls), reversed(self.out_grads), strict=True):
            if gy is not None:
                out.extend([(p, g, True) for p, g in c.grads(*c.args, gy)])
        return out

    def held(self) -> list[Tensor]:
        """The tensors kept for W (for memory accounting)."""
        out = [g for g in self.param_grads if g is not None]
        for c, gy in zip(self.calls, self.out_grads, strict=True):
            if gy is not None:
                out += (c.held, gy)
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
        self._key: Key | None = None
        self._calls: list[_Call] | None = None  # the forward being recorded
        self._state: dict[Key, str] = {}  # "open" -> "backward" -> "ready" -> (removed)
        self._recorded: dict[Key, list[_Call]] = {}
        self._raw: dict[Key, _Raw] = {}  # B's gradients, sorted out by run()
        self._work: dict[Key, list[_Deferred]] = {}
        self._early: dict[Key, GradList] = {}
        self._ready: dict[Key, list[_Grad]] = {}

    # ---- protocol -----------------------------------------------------------------------

    def begin(self, chunk: int, mb: int) -> None:
        """Register microbatch ``mb`` of ``chunk`` as in flight (at its forward)."""
        key = (chunk, mb)
        if key in self._state:
            raise RuntimeError(
                f"chunk {chunk}, microbatch {mb} is already in flight in this store; "
                "run its W before forwarding it again"
            )
        self._state[key] = "open"

    @contextmanager
    def record(self, chunk: int, mb: int) -> Iterator[None]:
        """Forward of (chunk, mb): begins it and lets split layers record their calls.

        Its backward must then go through :meth:`backward`, which asks autograd
        for the gradients of the recorded outputs (a plain ``.backward()`` would
        skip the recorded layers' weights).
        """
        if self._calls is not None:
            raise RuntimeError(
                f"record({chunk}, {mb}) entered while another forward is being recorded; "
                "run one microbatch's forward at a time"
            )
        self.begin(chunk, mb)
        calls: list[_Call] = []
        self._calls = calls
        try:
            yield
        except BaseException:
            del self._state[chunk, mb]  # a failed forward leaves nothing in flight
            raise
        else:
            if calls:
                self._recorded[chunk, mb] = calls
        finally:
            self._calls = None

    @property
    def recording(self) -> list[_Call] | None:
        """The call list of the forward being recorded, or None (split layers only)."""
        return self._calls

    @contextmanager
    def capture(self, chunk: int, mb: int) -> Iterator[None]:
        """Attribute the weight-gradient work of backward calls inside to (chunk, mb)."""
        key = (chunk, mb)
        if self._key is not None:
            raise RuntimeError(
                f"capture({chunk}, {mb}) entered inside capture{self._key}; "
                "run one microbatch's backward at a time"
            )
        state = self._state.get(key)
        if state is None:
            self.begin(chunk, mb)
        elif state == "ready":
            raise RuntimeError(
                f"chunk {chunk}, microbatch {mb}: W already ran; its backward cannot run again"
            )
        self._key = key
        try:
            yield
        finally:
            self._key = None
            self._state[key] = "backward"

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
        calls = self._recorded.pop((chunk, mb), [])
        targets = [*inputs, *params, *(_edge(out) for _, out, _, _ in calls)]
        # Several roots (a stage output with several tensors) come as lists.
        roots = root if isinstance(root, list) else [] if root is None else [root]
        if grad_output is not None and not isinstance(grad_output, list):
            grad_output = [grad_output]
        with self.capture(chunk, mb):
            if not roots or not targets:
                return (None,) * len(inputs)
            grads = torch.autograd.grad(roots, targets, grad_outputs=grad_output, allow_unused=True)
        n = len(inputs)
        if params or calls:
            # Drop the graph edges: a node that B did not run keeps its saved tensors.
            work = [_Work(held, grads, args) for held, _, grads, args in calls]
            self._raw[chunk, mb] = _Raw(
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
        if self._state.get(key) != "open" or key in self._recorded:
            return False
        return min(k for k in self._state if k[0] == chunk) == key

    def finish(self, chunk: int, mb: int) -> None:
        """Close (chunk, mb) after its gradients went to ``.grad`` directly (see :meth:`direct`)."""
        key = (chunk, mb)
        if not self.direct(chunk, mb):
            raise RuntimeError(
                f"finish({chunk}, {mb}): not the oldest microbatch of its chunk in flight, or "
                "its forward was recorded; run its backward through backward() and run()"
            )
        del self._state[key]
        self._flush(chunk)

    def defer(self, compute: Callable[[], GradList], held: Sequence[Tensor]) -> None:
        """Queue weight-gradient work for the microbatch being captured (split layers only)."""
        if self._key is None:
            raise RuntimeError("defer() called outside a capture context")
        self._work.setdefault(self._key, []).append(_Deferred(compute, tuple(held)))

    def add_grads(self, chunk: int, mb: int, grads: GradList) -> None:
        """Hand over gradients computed during B (parameters of unsplit modules)."""
        key = (chunk, mb)
        if self._state.get(key) not in ("open", "backward"):
            raise RuntimeError(
                f"add_grads for chunk {chunk}, microbatch {mb}, which is not in flight"
            )
        if grads:
            self._early.setdefault(key, []).extend(grads)

    def run(self, chunk: int, mb: int) -> None:
        """W: compute the deferred work of (chunk, mb) and accumulate in microbatch order."""
        key = (chunk, mb)
        state = self._state.get(key)
        if state != "backward":
            why = {
                None: "was never forwarded or its W already ran",
                "open": "has not run its backward (B) yet",
                "ready": "already ran W",
            }[state]
            raise RuntimeError(f"W of chunk {chunk}, microbatch {mb}: it {why}")
        # Gradients from B may alias tensors autograd handed elsewhere; the
        # split layers' own results are fresh tensors that .grad may adopt.
        raw = self._raw.pop(key, None)
        early = self._early.pop(key, [])
        if raw is not None:
            early = raw.early() + early
        grads: list[_Grad] = [(p, g, False) for p, g in early]
        if raw is not None:
            grads += raw.grads()
        for item in self._work.pop(key, ()):  # captured work arrives after the recorded calls
            grads.extend([(p, g, True) for p, g in item.compute()])
        self._ready[key] = _sum_per_param(grads)
        self._state[key] = "ready"
        self._flush(chunk)

    def discard(self, chunk: int, mb: int) -> None:
        """Forget (chunk, mb) without touching ``.grad``: its work is being replayed."""
        key = (chunk, mb)
        tables = (self._state, self._recorded, self._raw, self._work, self._early, self._ready)
        for table in tables:
            table.pop(key, None)

    # ---- inspection ---------------------------------------------------------------------

    def in_flight(self, chunk: int | None = None) -> dict[Key, str]:
        """Keys not yet accumulated and their state: open, backward (W pending) or ready."""
        return {k: s for k, s in self._state.items() if chunk is None or k[0] == chunk}

    def held_tensors(self, chunk: int | None = None) -> list[Tensor]:
        """Every tensor the store keeps alive for ``chunk`` (all chunks if None)."""
        out: list[Tensor] = []
        for key, calls in self._recorded.items():
            if chunk is None or key[0] == chunk:
                out.extend(call[0] for call in calls)
        for key, raw in self._raw.items():
            if chunk is None or key[0] == chunk:
                out.extend(raw.held())
        for key, items in self._work.items():
            if chunk is None or key[0] == chunk:
                out.extend(t for item in items for t in item.held)
        for key, grads in self._early.items():
            if chunk is None or key[0] == chunk:
                out.extend(g for _, g in grads)
        for key, ready in self._ready.items():
            if chunk is None or key[0] == chunk:
                out.extend(g for _, g, _ in ready)
        return out

    # ---- internals ----------------------------------------------------------------------

    def _flush(self, chunk: int) -> None:
        """Add every ready microbatch of ``chunk`` that no earlier one is waiting for."""
        while True:
            first = min((k for k in self._state if k[0] == chunk), default=None)
            if first is None or self._state[first] != "ready":
                return
            del self._state[first]
            _accumulate(self._ready.pop(first))


def _sum_per_param(grads: list[_Grad]) -> list[_Grad]:
    """Sum contributions to the same parameter in arrival order, as autograd's input buffer does."""
    if len({id(p) for p, _, _ in grads}) == len(grads):
        return grads  # one contribution each: the common case
    total: dict[int, _Grad] = {}
    for p, g, owned in grads:
        prev = total.get(id(p))
        total[id(p)] = (p, g, owned) if prev is None else (p, prev[1] + g, True)
    return list(total.values())


def _accumulate(grads: list[_Grad]) -> None:
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
                if not owned or grad.stride() != param.stride():
                    grad = torch.empty_like(param).copy_(grad)
                param.grad = grad
            else:
                dst.append(param.grad)
                src.append(grad)
        if dst:
            torch._foreach_add_(dst, src)


# ---- Linear -------------------------------------------------------------------------------


def _linear_operand(x: Tensor, in_features: int, has_bias: bool) -> Tensor:
    """The 2-D matrix ``F.linear`` actually multiplies, with autograd's layout.

    2-D inputs are used as they are (addmm/mm). A contiguous input with a bias
    is viewed as (N, in) and goes through addmm. Otherwise F.linear calls
    matmul, which unsqueezes 1-D inputs and reshapes (copying if needed) N-D ones.
    """
    if x.dim() == 2:
        return x
    if x.dim() == 1 and not (has_bias and x.is_contiguous()):
        return x.unsqueeze(0)
    return x.reshape(math.prod(x.shape[:-1]), in_features)


def _bias_via_addmm(x: Tensor) -> bool:
    """True where F.linear adds the bias inside addmm (else matmul, then an add)."""
    return x.dim() == 2 or x.is_contiguous()


def _grad_2d(gy: Tensor) -> Tensor:
    """The output gradient as the 2-D matrix the mm/addmm backward receives."""
    if gy.dim() == 2:
        return gy
    return gy.reshape(math.prod(gy.shape[:-1]), gy.shape[-1])


def _linear_input_grad(g2d: Tensor, weight: Tensor, x2d: Tensor, x: Tensor) -> Tensor:
    """dX, as autograd's mm_mat1_backward computes it (mat2 = weight.t())."""
    if x2d.stride(0) == 1 and x2d.stride(1) == x2d.size(0):
        gx2d = weight.t().mm(g2d.t()).t()  # column-major input: column-major gradient
    else:
        gx2d = g2d.mm(weight)
    return gx2d if x.dim() == 2 else gx2d.reshape(x.shape)


def _linear_weight_grad(g2d: Tensor, x2d: Tensor, weight: Tensor) -> Tensor:
    """dW, as mm_mat2_backward on mat2 = weight.t() followed by the transpose's backward."""
    if weight.stride(1) == 1 and weight.stride(0) == weight.size(1):
        return g2d.t().mm(x2d)  # weight.t() is column-major: (dYᵀX)ᵀᵀ
    return x2d.t().mm(g2d).t()


def _bias_grad(gsum: Tensor) -> Tensor:
    """db: the engine reduces the bias's incoming gradient with sum_to."""
    gb = gsum.sum_to_size((gsum.shape[-1],))
    return gb.clone() if gb.data_ptr() == gsum.data_ptr() else gb  # nothing reduced: a copy


def _alias(p: Tensor) -> Tensor:
    """A leaf sharing ``p``'s data and version counter, with ``p.requires_grad``.

    A recorded layer computes with such aliases of its parameters: the graph is
    exactly the one the parameters would build (PyTorch picks kernels and saved
    tensors by ``requires_grad``), but B, which asks only for the stage input,
    the parameters and the recorded outputs, never reaches the aliases. A layer
    keeps its aliases across microbatches (as autograd reuses a parameter's
    gradient accumulator) while :func:`_current` holds.
    """
    return p.detach().requires_grad_(p.requires_grad)


def _current(alias: Tensor | None, p: Tensor) -> bool:
    """``alias`` still is :func:`_alias` of ``p`` (same memory, size, strides, requires_grad)."""
    return alias is not None and alias.is_set_to(p) and alias.requires_grad == p.requires_grad


def _output(y: Tensor) -> Node | GradientEdge:
    """Where autograd delivers ``y``'s gradient (see :func:`_edge`), cheaply, at forward."""
    fn = y.grad_fn
    if isinstance(fn, _PyNode) or y.output_nr:  # rare: keep the graph-owning edge
        return get_gradient_edge(y)
    return fn


def _edge(out: Node | GradientEdge) -> GradientEdge:
    """The gradient edge of a recorded output, for ``torch.autograd.grad``'s inputs."""
    return out if isinstance(out, GradientEdge) else GradientEdge(out, 0)


def _linear_grads(
    weight: Tensor, bias: Tensor | None, need_w: bool, need_b: bool, x: Tensor, gy: Tensor
) -> GradList:
    """W of a recorded linear call: dW and db from its input and output gradient."""
    x2d = _linear_operand(x, weight.size(1), bias is not None)
    g2d = _grad_2d(gy)
    grads: GradList = []
    if need_w:
        grads.append((weight, _linear_weight_grad(g2d, x2d, weight)))
    if need_b:
        grads.append((bias, _bias_grad(g2d if _bias_via_addmm(x) else gy)))
    return grads


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        store: WeightGradStore,
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)  # the Parameter objects, to attribute gradients
        ctx.store = store
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, gy: Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # The operands of the 2-D product, built once for B and W. The bias gets
        # addmm's 2-D gradient, or on the matmul-then-add path the N-D one.
        x2d = _linear_operand(x, w.size(1), bias is not None)
        g2d = _grad_2d(gy)
        gsum = g2d if _bias_via_addmm(x) else gy
        gx = _linear_input_grad(g2d, w, x2d, x) if need_x else None
        store: WeightGradStore = ctx.store
        if store.capturing is None:
            gw = _linear_weight_grad(g2d, x2d, w) if need_w else None
            return gx, gw, _bias_grad(gsum) if need_b else None, None

        # Keep only what W needs alive (a closure holds every name it mentions).
        w_operands = (x2d, g2d) if need_w else None
        b_operand = gsum if need_b else None

        def compute() -> GradList:
            grads: GradList = []
            if w_operands is not None:
                grads.append((weight, _linear_weight_grad(w_operands[1], w_operands[0], w)))
            if b_operand is not None:
                grads.append((bias, _bias_grad(b_operand)))
            return grads

        store.defer(compute, (*(w_operands or ()), *(() if b_operand is None else (b_operand,))))
        return gx, None, None, None


def _autocast_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} does not support autocast: its deferred weight gradient would use the "
        "uncast operands. Cast the model (e.g. model.to(torch.bfloat16)) instead of "
        "running it under torch.autocast, or leave this module unsplit."
    )


def _check_autocast(x: Tensor, what: str) -> None:
    if torch.is_autocast_enabled(x.device.type):
        raise _autocast_error(what)


class SplitLinear(nn.Module):
    """``nn.Linear`` whose backward defers the weight gradient to a store (B/W split).

    Reuses the original Parameter objects (optimizers and state_dict keys are
    unaffected). Called inside ``store.record(chunk, mb)`` it records itself for
    ``store.backward(chunk, mb, ...)``; otherwise, inside ``store.capture(chunk,
    mb)`` its backward returns only the input gradient and queues ``dW``/``db``.
    Either way ``store.run(chunk, mb)`` adds them. Outside both it behaves
    exactly like ``nn.Linear``.
    """

    def __init__(
        self, weight: nn.Parameter, bias: nn.Parameter | None, store: WeightGradStore
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", bias)
        self.store = store
        self._aliases: list[Tensor | None] = [None, None]  # of weight and bias (_alias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, store: WeightGradStore) -> SplitLinear:
        return cls(linear.weight, linear.bias, store)

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        need_w = w.requires_grad
        need_b = b is not None and b.requires_grad
        if not ((need_w or need_b) and torch.is_grad_enabled()):
            return F.linear(x, w, b)  # no weight gradient to defer
        calls = self.store._calls  # self.store.recording, minus a call: this runs per layer
        # Recorded unless matmul would fold a non-contiguous N-D input into a copy:
        # W would then need that copy, which only the captured path keeps.
        if calls is None or not (x.dim() <= 2 or x.is_contiguous()):
            _check_autocast(x, "SplitLinear")
            return _SplitLinearFn.apply(x, w, b, self.store)
        lw, lb = aliases = self._aliases
        if not _current(lw, w):
            lw = aliases[0] = _alias(w)
        if b is not None and not _current(lb, b):
            lb = aliases[1] = _alias(b)
        y = F.linear(x, lw, lb)
        if not (x.dtype == y.dtype == w.dtype):  # only autocast gets F.linear there
            raise _autocast_error("SplitLinear")
        calls.append((x, _output(y), _linear_grads, (w, b, need_w, need_b, x)))
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


# ---- Embedding ----------------------------------------------------------------------------


class _SplitEmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        idx: Tensor,
        weight: Tensor,
        module: SplitEmbedding,
    ) -> Tensor:
        m = module
        out = F.embedding(idx, weight, m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq)
        ctx.save_for_backward(idx)
        ctx.weight = weight
        ctx.args = m.backward_args()
        ctx.store = m.store
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, gy: Tensor):  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        weight, args = ctx.weight, ctx.args
        store: WeightGradStore = ctx.store
        if store.capturing is None:
            return None, _embedding_grads(weight, idx, args, gy)[0][1], None
        store.defer(lambda: _embedding_grads(weight, idx, args, gy), (idx, gy))
        return None, None, None


def _embedding_grads(
    weight: Tensor, idx: Tensor, args: tuple[int, int, bool], gy: Tensor
) -> GradList:
    """W of an embedding call: the dense weight gradient, as ``F.embedding``'s backward."""
    return [(weight, torch.ops.aten.embedding_dense_backward(gy, idx, *args))]


class SplitEmbedding(nn.Module):
    """``nn.Embedding`` whose weight gradient is deferred to a store (B/W split).

    B has nothing to compute (indices have no gradient); W runs the dense
    embedding backward (padding_idx, scale_grad_by_freq and max_norm as in
    ``nn.Embedding``). ``sparse=True`` is rejected: a sparse gradient cannot be
    accumulated with dense autograd's arithmetic.
    """

    def __init__(self, embedding: nn.Embedding, store: WeightGradStore) -> None:
        super().__init__()
        if embedding.sparse:
            raise ValueError(
                "SplitEmbedding does not support nn.Embedding(sparse=True): the B/W split "
                "accumulates dense gradients. Use sparse=False, or keep this embedding "
                "out of enable_bw_split (e.g. wrap it in a subclass of nn.Embedding)."
            )
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.max_norm = embedding.max_norm
        self.norm_type = embedding.norm_type
        self.scale_grad_by_freq = embedding.scale_grad_by_freq
        self.weight = embedding.weight
        self.store = store
        self._aliases: list[Tensor | None] = [None]  # of the weight, see _alias

    def forward(self, idx: Tensor) -> Tensor:
        w = self.weight
        if not (torch.is_grad_enabled() and w.requires_grad):
            return F.embedding(
                idx, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq
            )
        _check_autocast(w, "SplitEmbedding")
        calls = self.store.recording
        if calls is not None:
            aliases = self._aliases
            if not _current(aliases[0], w):
                aliases[0] = _alias(w)
            y = F.embedding(
                idx,
                aliases[0],
                self.padding_idx,
                self.max_norm,
                self.norm_type,
                self.scale_grad_by_freq,
            )
            calls.append((idx, _output(y), _embedding_grads, (w, idx, self.backward_args())))
            return y
        return _SplitEmbeddingFn.apply(idx, w, self)

    def backward_args(self) -> tuple[int, int, bool]:
        """``embedding_dense_backward``'s trailing arguments (-1: no padding index)."""
        pad = -1 if self.padding_idx is None else self.padding_idx
        return self.num_embeddings, pad, self.scale_grad_by_freq

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}"


# ---- swapping -----------------------------------------------------------------------------


def _split_of(module: nn.Module, store: WeightGradStore) -> nn.Module | None:
    # Exact types only: subclasses may override forward, and modules such as
    # nn.MultiheadAttention read their Linear's weights without calling it.
    if type(module) is nn.Linear:
        return SplitLinear.from_linear(module, store)
    if type(module) is nn.Embedding:
        return SplitEmbedding(module, store)
    if isinstance(module, SplitLinear | SplitEmbedding):
        module.store = store  # re-split: bind to the new store
    return None


def enable_bw_split(module: nn.Module, store: WeightGradStore) -> nn.Module:
    """Swap every ``nn.Linear`` / ``nn.Embedding`` in ``module`` for its split version, in place.

    The swapped layers keep the original Parameter objects and state_dict keys;
    a module shared at several places is replaced by one shared split module.
    Only modules of exactly these types are swapped (subclasses, and layers used
    through their weights rather than their forward, e.g. inside
    ``nn.MultiheadAttention``, are left alone); forward hooks registered on a
    swapped module are dropped.

    Parameters of all other modules (LayerNorm, attention internals, custom
    ops) keep plain autograd: their gradients are produced during B, not W.
    :class:`~zerobubble.runtime.chunk.StageChunk` still adds them to ``.grad``
    in microbatch order.

    Returns ``module``, or its split replacement if ``module`` itself is a
    Linear or Embedding.
    """
    replaced: dict[int, nn.Module] = {}

    def swap(m: nn.Module) -> nn.Module | None:
        if id(m) not in replaced:
            new = _split_of(m, store)
            replaced[id(m)] = new if new is not None else m
        new = replaced[id(m)]
        return None if new is m else new

    root = swap(module)
    if root is not None:
        return root
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            new = swap(child)
            if new is not None:
                parent._modules[name] = new
    return module
