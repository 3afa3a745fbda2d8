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
pipeline run matches :func:`~zerobubble.runtime.reference.reference_step`
bitwise.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge, saved_tensors_hooks

from zerobubble.runtime.split import (
    SplitRules,
    SplitShare,
    WeightGradStore,
    enable_bw_split,
    is_split,
    split_share,
)

__all__ = ["StageChunk", "StageChunkError", "storage_bytes"]

LossFn = Callable[..., Tensor]
"""``loss_fn(output, target)``, or ``loss_fn(output, target, num_items)`` (see
:meth:`StageChunk.forward`)."""


class StageChunkError(RuntimeError):
    """An op called out of protocol or with mismatched data; names the stage and microbatch."""

    def __init__(self, stage: int, mb: int, message: str) -> None:
        super().__init__(f"stage {stage}, microbatch {mb}: {message}")
        self.stage = stage
        self.mb = mb


@dataclass
class _Record:
    """What one microbatch holds between F and B (state "F") or B and W (state "B")."""

    state: str
    x: Tensor | None
    root: Tensor | GradientEdge | None
    out_shape: torch.Size
    out_dtype: torch.dtype
    out_device: torch.device
    saved: list[weakref.ref[Tensor]] = field(default_factory=list)


def storage_bytes(tensors: Iterable[Tensor], exclude: Iterable[Tensor] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors``, skipping those of ``exclude``.

    Views share their base's storage and count once, at its full size: that is
    what keeping them alive costs.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr and ptr not in skip:
            seen[ptr] = st.nbytes()
    return sum(seen.values())


class StageChunk:
    """F / B / W / BW of one virtual stage.

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
    ) -> None:
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is not in [0, num_stages={num_stages})")
        self.stage = stage
        self.num_stages = num_stages
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError(f"stage {stage} is the last stage: pass loss_fn")
        if not self.is_last and loss_fn is not None:
            raise ValueError(
                f"stage {stage} is not the last of {num_stages} stages: only the last "
                "stage computes the loss, drop loss_fn"
            )
        self.loss_fn = loss_fn
        self.store = WeightGradStore() if store is None else store
        self.split = split
        self.module = enable_bw_split(module, self.store, split_rules) if split else module
        self.split_share: SplitShare | None = split_share(self.module) if split else None
        """How much weight-gradient work W holds (None without split)."""
        message = None if self.split_share is None else self.split_share.warning(stage)
        if message is not None:
            warnings.warn(message, stacklevel=2)
        self.track_memory = track_memory
        self._params = list(self.module.parameters())
        # Without split layers a BW in microbatch order can let autograd add the
        # gradients itself (AccumulateGrad, as the reference does).
        self._plain = not is_split(self.module)
        self._submodules = list(self.module.modules())
        self._records: dict[int, _Record] = {}
        self._held: int | None = 0  # held_bytes() until the next op; None: recount

    # ---- ops ----------------------------------------------------------------------------

    def forward(
        self,
        mb: int,
        x: Tensor,
        *,
        target: Tensor | None = None,
        loss_scale: float = 1.0,
        num_items: Tensor | int | None = None,
    ) -> Tensor:
        """F. Returns the (detached) stage output, or on the last stage the unscaled loss.

        ``x`` is the raw microbatch on stage 0, else the received activation
        (a float one becomes a leaf that requires grad). The last stage keeps
        ``loss * loss_scale`` as the root of its backward; its loss is
        ``loss_fn(output, target)``, or ``loss_fn(output, target, num_items)`` when
        ``num_items`` (a count over the whole batch) is given.
        """
        if mb in self._records:
            raise StageChunkError(
                self.stage,
                mb,
                f"forwarded twice; its {'B' if self._records[mb].state == 'F' else 'W'} "
                "has not run yet",
            )
        if self.is_last and target is None:
            raise StageChunkError(self.stage, mb, "the last stage needs target= for the loss")
        if not self.is_last and target is not None:
            raise StageChunkError(
                self.stage, mb, "target= is only used on the last stage; do not pass it here"
            )
        inp = x.detach()
        if not self.is_first and (inp.is_floating_point() or inp.is_complex()):
            inp.requires_grad_(True)
        saved: list[Tensor] = []  # held by the graph anyway until F returns

        def pack(t: Tensor) -> Tensor:
            alias = t.detach()  # an alias, not t itself: t may own this very graph
            saved.append(alias)
            return alias

        self._held = None
        hooks = saved_tensors_hooks(pack, _identity) if self.track_memory else nullcontext()
        with torch.enable_grad(), hooks, self.store.record(self.stage, mb):
            out = self.module(inp)
            if not isinstance(out, Tensor):
                raise StageChunkError(
                    self.stage, mb, f"the stage returned {type(out).__name__}, expected a Tensor"
                )
            result = out
            if self.is_last:
                assert self.loss_fn is not None and target is not None
                if num_items is None:
                    loss = self.loss_fn(out, target)
                else:
                    loss = self.loss_fn(out, target, num_items)
                if not isinstance(loss, Tensor) or loss.dim() != 0:
                    shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss)
                    raise StageChunkError(
                        self.stage, mb, f"loss_fn must return a scalar tensor, got {shape}"
                    )
                out = loss * loss_scale
                result = loss
        root: Tensor | GradientEdge | None = None
        if out.requires_grad:
            # Keep the output's node, not its data, unless the loss (a scalar) or a
            # leaf that the stage passed through.
            root = out if self.is_last or out.grad_fn is None else get_gradient_edge(out)
        refs = [weakref.ref(t) for t in saved]
        saved.clear()  # every saved tensor's hooks keep `pack`, and with it this list, alive
        self._records[mb] = _Record("F", inp, root, out.shape, out.dtype, out.device, refs)
        return result.detach()

    def backward_input(self, mb: int, grad_output: Tensor | None) -> Tensor | None:
        """B. Returns the gradient of the stage input (None on stage 0 or for integer inputs).

        ``grad_output`` is None on the last stage (backward starts from the
        scaled loss). The tensors W needs stay in the store; the rest of the
        microbatch's graph is freed. ``grad_output`` may be kept until W: do not
        overwrite it in place.
        """
        rec = self._require(mb, "F", "backward_input (B)")
        self._check_grad_output(mb, rec, grad_output)
        self._held = None
        x = rec.x
        assert x is not None
        params = [p for p in self._params if p.requires_grad]
        if x.requires_grad:
            (gx,) = self.store.backward(self.stage, mb, rec.root, grad_output, [x], params)
            if gx is None:  # the output does not depend on the input
                gx = torch.zeros_like(x)
        else:
            gx = None
            self.store.backward(self.stage, mb, rec.root, grad_output, [], params)
        # The weak references to saved tensors stay: held_bytes would expose a
        # graph that B failed to free.
        rec.state, rec.x, rec.root = "B", None, None
        return gx

    def backward_weight(self, mb: int) -> None:
        """W. Runs the deferred weight-gradient work and adds gradients in microbatch order."""
        self._require(mb, "B", "backward_weight (W)")
        self._held = None
        self.store.run(self.stage, mb)
        del self._records[mb]

    def backward_full(self, mb: int, grad_output: Tensor | None) -> Tensor | None:
        """BW: B then W, for schedules that do not split the backward.

        Without split layers and in microbatch order, one ``torch.autograd.backward``
        adds the parameter gradients as it goes, like plain autograd.
        """
        if not (self._plain and self.store.direct(self.stage, mb)):
            gx = self.backward_input(mb, grad_output)
            self.backward_weight(mb)
            return gx
        rec = self._require(mb, "F", "backward_full (BW)")
        self._check_grad_output(mb, rec, grad_output)
        self._held = None
        x = rec.x
        assert x is not None
        inputs = ([x] if x.requires_grad else []) + [p for p in self._params if p.requires_grad]
        if rec.root is not None and inputs:
            grads = None if grad_output is None else [grad_output]
            torch.autograd.backward([rec.root], grads, inputs=inputs)
        self.store.finish(self.stage, mb)
        del self._records[mb]
        if not x.requires_grad:
            return None
        return torch.zeros_like(x) if x.grad is None else x.grad

    def discard(self) -> None:
        """Drop every microbatch in flight, leaving ``.grad`` untouched.

        For speculative work that is replayed after a parameter rollback (see
        :mod:`zerobubble.schedule.replay`); the graphs and stored inputs are freed.
        """
        self._held = None
        for mb in self._records:
            self.store.discard(self.stage, mb)
        self._records.clear()

    # ---- inspection ---------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Bytes of activations, saved tensors and pending gradients this chunk holds.

        Counts distinct storages (parameters and buffers excluded) among: each
        in-flight microbatch's input and the saved tensors of its graph that are
        still alive, and everything the store keeps for this chunk (W's inputs
        and output gradients, gradients waiting for an earlier microbatch).
        Counted at the first call after each op of this chunk (only ops change
        it), so callers may ask around every instruction.
        """
        if not self.track_memory:
            raise RuntimeError(
                f"stage {self.stage}: held_bytes() needs StageChunk(track_memory=True)"
            )
        if self._held is None:
            tensors: list[Tensor] = []
            for rec in self._records.values():
                if rec.x is not None:
                    tensors.append(rec.x)
                if isinstance(rec.root, Tensor):
                    tensors.append(rec.root)
                tensors.extend(t for ref in rec.saved if (t := ref()) is not None)
            tensors.extend(self.store.held_tensors(self.stage))
            weights = [
                t
                for m in self._submodules
                for t in (*m._parameters.values(), *m._buffers.values())
                if t is not None
            ]
            self._held = storage_bytes(tensors, exclude=weights)
        return self._held

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

    def _check_grad_output(self, mb: int, rec: _Record, grad: Tensor | None) -> None:
        if self.is_last:
            if grad is not None:
                raise StageChunkError(
                    self.stage,
                    mb,
                    "the last stage's backward starts from its loss: pass grad_output=None",
                )
            return
        if grad is None and rec.root is None:
            return  # the output carries no gradient (e.g. integer ids passed along)
        if grad is None:
            raise StageChunkError(
                self.stage, mb, "grad_output is None; pass the gradient of this stage's output"
            )
        got = (grad.shape, grad.dtype, grad.device)
        want = (rec.out_shape, rec.out_dtype, rec.out_device)
        if got != want:
            raise StageChunkError(
                self.stage,
                mb,
                f"grad_output has shape {tuple(grad.shape)}, dtype {grad.dtype}, device "
                f"{grad.device} but the forward output had shape {tuple(rec.out_shape)}, "
                f"dtype {rec.out_dtype}, device {rec.out_device}; send the gradient of this "
                "stage's output for this microbatch",
            )


def _identity(t: Tensor) -> Tensor:
    return t
