"""Tensor parallelism inside a pipeline stage, on PyTorch's DTensor (``parallelize_module``).

A stage module is parallelized over the mesh's ``tp`` dim before the B/W split swaps its
layers (the split layers keep the parallel styles' input and output hooks), so the split
layers compute on DTensors: B's all-reduce or reduce-scatter of the input gradient runs
inside the parallel style's redistribution, on the critical path, and W multiplies the
local shards only.

The default plan (``plan=None``) is assembled from the stage's layers: a layer states
its own in a method ``tp_kinds(layout: LayerLayout) -> {submodule name: kind}`` (``""``
names the layer itself; the kinds are :data:`KINDS`), so this module knows no model. A
layer on its own that is a norm or an ``nn.Linear`` (a final norm, an LM head) needs no
method; any other layer with parameters and no method is refused. Our GPT
(:mod:`~zerobubble.models.gpt`) and the Hugging Face adapter's Llama-layout layers
(:mod:`~zerobubble.interop.hf_layers`: Llama, Qwen2, Mistral, ...) state Megatron's layout:

* attention's q/k/v and the MLP's up projections column-wise (each rank holds
  ``heads / tp`` heads and ``d_ff / tp`` hidden units), the output and down projections
  row-wise (one all-reduce, or reduce-scatter, per block half). A Hugging Face block takes
  its config's ``base_model_tp_plan`` where it has one, its strings mapped onto
  :data:`KINDS` by the adapter (:mod:`~zerobubble.interop.hf_tp`): this module reads kinds,
  plain data, and no other library's plan format;
* the token embedding row-wise (vocabulary-sharded: each rank holds ``vocab / tp`` rows,
  the lookup's partial sums are reduced), not replicated, so that no rank keeps the
  largest matrix whole; our GPT's position embedding is replicated (a DTensor, so its
  gradient stays exact under sequence parallelism);
* a vocabulary that tp does not divide (the token table's rows, the LM head's outputs,
  :data:`VOCABULARY_KINDS`) is sharded unevenly by DTensor's own ``Shard(0)``
  (``torch.chunk``'s split: ``ceil(vocab / tp)`` rows a rank, the last ones fewer), not
  padded as Megatron does: the parameters keep the user's global shapes, so state dicts,
  checkpoints and exports are unchanged, and no padded row needs keeping out of the
  optimizer. DTensor's lookup mask and :mod:`~zerobubble.parallel.loss` use each rank's
  real offset and width. Every other dim is sharded evenly or refused;
* the LM head column-wise; on the loss stage with loss parallel
  (:mod:`~zerobubble.parallel.loss`, the default where the loss takes it) its logits stay
  sharded over the vocabulary (a ``Shard(-1)`` DTensor, the kind ``colwise_shard_output``)
  and the loss never gathers them; otherwise they are gathered (``Replicate``): every tp
  rank holds the whole logits and the loss runs unchanged;
* the module that feeds several column-wise layers one input (attention's q/k/v, a gated
  MLP's gate/up) takes it as one ``Replicate`` DTensor (``PrepareModuleInput``, as
  torchtitan's Llama plan): with sequence parallelism one all-gather of the sequence
  per block half instead of one per layer, and in backward the layers' ``Partial`` input
  gradients add up locally before one reduce-scatter (or all-reduce without sequence
  parallelism) instead of one each.

With ``sequence_parallel`` the norms run on sequence shards (``SequenceParallel``), the
column-wise layers gather the sequence, the row-wise ones reduce-scatter it, and the
embedding hands out shards: the tensors between the layers, and so a stage's input and
output, are each tp rank's local shard ``(B, T / tp, d)``. Masks and positions are those
of the whole sequence (a Hugging Face block rebuilds them from the whole length; the
boundary's ``position_ids`` and ``attention_mask`` travel whole, they are a few integers).

Random ops draw by the rule of :mod:`~zerobubble.runtime.rng`: on activations sharded over
the tp ranks (sequence shards, local attention heads) each tp rank from its own stream, on
replicated activations every tp rank the same numbers from the shared one. The plan says
which is which: :class:`TPRandom` on each module with dropout (or on a module around it);
the default plan marks our GPT's dropouts (attention probabilities: local heads, sharded;
the embedding's and the residual branches': sharded with sequence parallelism, replicated
without) and a Llama-layout block's ``attention_dropout`` (local heads). A module with
dropout > 0 that no :class:`TPRandom` covers is refused.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import partial
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from zerobubble.runtime.rng import rank_stream

__all__ = [
    "KINDS",
    "VOCABULARY_KINDS",
    "LayerLayout",
    "ReplicatedExpertsWarning",
    "ShardedLogits",
    "TPPlan",
    "TPRandom",
    "default_plan",
    "dropout_kinds",
    "is_norm",
    "norm_names",
    "parallelize_stage",
    "share_column_inputs",
]

TPPlan = Mapping[str, ParallelStyle]
"""``parallelize_module``'s plan: submodule name (relative to the stage module, ``*``
wildcards allowed) -> parallel style."""

KINDS = (
    "colwise",
    "colwise_prepared",
    "colwise_partial_grad",
    "colwise_gather_output",
    "colwise_shard_output",
    "rowwise",
    "embedding",
    "embedding_dtensor",
    "replicated",
    "prepare_input",
    "shard_output",
    "sequence_parallel",
    "sequence_parallel_layer",
    "heads_norm",
    "replicated_heads",
    "whole_sequence",
    "random_sharded",
    "random_replicated",
)
"""What a layer's ``tp_kinds`` may say of a submodule (the sequence layout ``seq`` is
``Shard(1)`` with sequence parallelism, ``Replicate()`` without): ``colwise`` (input
``seq``), ``colwise_prepared`` (input already a ``Replicate`` DTensor, see
``prepare_input``), ``colwise_partial_grad`` (input a local tensor every rank holds whole
whose gradient is ``Partial``, the output of a ``replicated_heads:1`` projection or of a
``heads_norm`` after one: the input's gradient is left a partial sum, reduced with theirs,
not all-reduced here; multi-head latent attention's up projections),
``colwise_gather_output`` (output gathered), ``colwise_shard_output`` (output left a
DTensor sharded over its last dim: the loss-parallel LM head, where
:attr:`LayerLayout.loss_parallel` says so), ``rowwise`` (output ``seq``), ``embedding``
(vocabulary-sharded, output ``seq``), ``embedding_dtensor`` (the same, output left a
DTensor), ``replicated`` (whole parameters as DTensors),
``prepare_input`` (the module's first input made one ``Replicate`` DTensor for its
column-wise layers), ``shard_output`` (the module's output handed on as local ``seq``
tensors), ``sequence_parallel`` (a norm on sequence shards), ``sequence_parallel_layer``
(the same, its output local: a layer whose output may be the stage's), ``heads_norm`` (a
norm over the head dim of a column-wise projection's local heads, Qwen3's ``q_norm`` and
``k_norm``: its input ``(..., heads / tp, head_dim)`` taken as sharded on the heads, its
weight replicated, its gradient ``Partial``, each rank's covering its own heads, summed over
tp where it is reduced; also a norm of a replicated latent whose gradient is partial,
multi-head latent attention's ``kv_a_layernorm``), ``replicated_heads:N`` (a key or value
projection of ``N`` heads, fewer than tp and dividing it, as Megatron replicates kv heads:
the weight whole on every rank, each rank keeping head ``rank * N // tp`` of the output, the
one its query heads use; ``N = 1`` a latent every head shares; the weight's and the input's
gradients ``Partial``, each rank's covering its own query heads), ``whole_sequence`` (a
module left whole on every rank, a mixture of experts' block: with sequence parallelism its
input's sequence gathered and its output handed on as this rank's shard, so that every rank
routes and computes the same tokens and its plain parameters get the same gradient
everywhere; nothing without), ``random_sharded`` and ``random_replicated``
(:class:`TPRandom`)."""


@dataclass(frozen=True)
class LayerLayout:
    """What a layer's ``tp_kinds`` is told: the tp size, sequence parallelism, and where
    the layer is (for the messages of what it cannot shard)."""

    tp: int
    sequence_parallel: bool
    stage: int
    name: str
    """The layer's name in its stage module."""
    loss_parallel: bool = False
    """The layer's output is the logits the loss takes sharded over the vocabulary: its LM
    head is ``colwise_shard_output`` (:mod:`~zerobubble.parallel.loss`), not gathered."""

    def lm_head(self) -> str:
        """The kind of an LM head here: its logits sharded or gathered."""
        return "colwise_shard_output" if self.loss_parallel else "colwise_gather_output"

    def divisible(self, sub: str, what: str, n: int) -> None:
        """Raise ValueError naming the stage and ``sub`` unless ``tp`` divides ``n``."""
        _divisible(self.stage, f"{self.name}.{sub}" if sub else self.name, what, n, self.tp)

    def norms(self, layer: nn.Module) -> dict[str, str]:
        """``layer``'s norms on sequence shards with sequence parallelism (else none)."""
        if not self.sequence_parallel:
            return {}
        return dict.fromkeys(norm_names(layer), "sequence_parallel")


class _Replicated(ParallelStyle):
    """Parameters as ``Replicate`` DTensors, inputs made ``Replicate`` DTensors, the output
    left a DTensor: a small table (a position embedding) that every rank holds whole but
    whose output meets sharded DTensors, so its gradient is reduced exactly by DTensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(_m: nn.Module, args: Any, mesh: DeviceMesh) -> Any:
            return tuple(
                DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                if isinstance(a, Tensor) and not isinstance(a, DTensor)
                else a
                for a in args
            )

        return distribute_module(module, device_mesh, input_fn=inputs)


class _PrepareInput(PrepareModuleInput):
    """``PrepareModuleInput`` of a module's first input, passed positionally or by name
    (``transformers``' decoder layers call attention with ``hidden_states=``)."""

    def __init__(self, name: str, layout: Placement) -> None:
        super().__init__(input_layouts=(layout,), desired_input_layouts=(Replicate(),))
        self.name = name
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def prepare(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            def arg(x: Any) -> Any:
                return self._prepare_input_arg(x, device_mesh, self.layout, Replicate())

            if args:
                return (arg(args[0]), *args[1:]), kwargs
            if self.name not in kwargs:
                raise ValueError(
                    f"{type(m).__name__} was called without its input {self.name!r}, which "
                    "the tensor-parallel plan gathers once for its column-wise layers; pass "
                    "tp_plan= with ColwiseParallel on each of them instead"
                )
            return args, {**kwargs, self.name: arg(kwargs[self.name])}

        module.register_forward_pre_hook(prepare, with_kwargs=True)
        return module


class _ReplicatedHeads(ParallelStyle):
    """A projection whose output is ``heads`` heads, fewer than tp (tp a multiple): each rank
    computes them all from the whole weight (a ``Replicate`` DTensor, on the input made one
    ``Replicate`` DTensor) and keeps head ``rank * heads // tp``. The output's gradient
    covers this rank's query heads only, so it is marked ``Partial``: the weight's and the
    input's gradients are partial sums over tp, reduced with the other layers'."""

    def __init__(self, heads: int, seq: Placement) -> None:
        super().__init__()
        self.heads = heads
        self.seq = seq

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        head = device_mesh.get_local_rank() * self.heads // device_mesh.size()

        def inputs(_m: nn.Module, args: tuple, mesh: DeviceMesh) -> Any:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [self.seq], run_check=False)
            return (x.redistribute(placements=[Replicate()]), *args[1:])

        def outputs(_m: nn.Module, out: Any, _mesh: DeviceMesh) -> Any:
            local = out.to_local(grad_placements=[Partial()])
            width = local.shape[-1] // self.heads
            return local[..., head * width : (head + 1) * width]

        return distribute_module(module, device_mesh, input_fn=inputs, output_fn=outputs)


class _ColwisePartialGrad(ColwiseParallel):
    """Column-wise on a local input that every rank holds whole but whose gradient is a
    partial sum over tp (each rank's covering its own heads): a latent computed by
    replicated layers that mark their outputs' gradients ``Partial`` (``replicated_heads``,
    ``heads_norm``). ``ColwiseParallel`` would all-reduce the input's gradient, which the
    replicated layers before it then take as partial and sum again; here it stays
    ``Partial`` and is reduced once, with theirs, where they meet the layer input."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate())

    @staticmethod
    def _prepare_input_fn(
        input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: Any, mesh: Any
    ) -> DTensor:
        x = inputs[0]
        if isinstance(x, DTensor):
            raise ValueError(
                f"{type(mod).__name__} is planned 'colwise_partial_grad', which takes a local "
                f"tensor whose gradient is partial, but was given a DTensor "
                f"({x.placements}); plan it 'colwise_prepared' instead"
            )
        return DTensor.from_local(
            x, mesh, [Replicate()], run_check=False, grad_placements=[Partial()]
        )


class _WholeSequence(ParallelStyle):
    """A module run whole on every rank on the whole sequence (sequence parallelism): its
    first input (a sequence shard, local or a DTensor) is gathered, its output (or the first
    of a tuple) cut back to this rank's shard. Backward: the output's gradient is gathered,
    so that every rank's module gets the whole, equal gradient, and the input's is cut.
    The B/W split must not graph-split the module itself (W would re-run these hooks): its
    layer keeps a submodule of it unsplit (``unsplit_submodules``), so its children are
    split instead."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard: list[Placement] = [Shard(1)]

        def gather(x: Any) -> Any:
            if not isinstance(x, Tensor):
                return x
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, shard, run_check=False)
            whole = x.redistribute(placements=[Replicate()])
            return whole.to_local(grad_placements=[Replicate()])

        def before(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            return args, {**kwargs, self.name: gather(kwargs.get(self.name))}

        def cut(y: Tensor) -> Tensor:
            whole = DTensor.from_local(y, device_mesh, [Replicate()], run_check=False)
            return whole.redistribute(placements=shard).to_local()

        def after(_m: nn.Module, _args: tuple, out: Any) -> Any:
            if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
                return (cut(out[0]), *out[1:])
            return cut(out) if isinstance(out, Tensor) else out

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after)
        return module


class ReplicatedExpertsWarning(UserWarning):
    """A stage's experts stay whole on every tp rank (no expert-tensor parallelism): the
    memory of every expert on every rank, and their compute repeated over tp."""


def _warn_replicated_experts(module: nn.Module, stage: int, tp: int) -> None:
    """Warn once for stage ``stage`` if it holds experts the plan left whole (plain tensors):
    replicated over tp is a choice the user should see, not a silent default."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        looks = name.rpartition(".")[2] == "experts" or type(m).__name__.endswith("Experts")
        params = list(m.parameters(recurse=True))
        whole = looks and params and not any(isinstance(p, DTensor) for p in params)
        if whole and not any(name.startswith(f"{f}.") for f, _ in found):
            found.append((name, m))
    if not found:
        return
    names = ", ".join(f"{_source(module, n)} ({type(m).__name__})" for n, m in found)
    warnings.warn(
        f"stage {stage}: the experts {names} are replicated over tp={tp}: every tp rank holds "
        "each expert whole and computes it on the same tokens (with sequence parallelism the "
        "block gathers the sequence), so their gradients are equal on every tp rank; "
        "expert-tensor parallelism is not built. To shard experts over the dp ranks use ep "
        "(each tp rank then holds its ep rank's experts)",
        ReplicatedExpertsWarning,
        stacklevel=3,
    )


def _source(module: nn.Module, name: str) -> str:
    """``name`` (in the stage) as the layer's model names it, where the layer says."""
    layer, _, rest = name.partition(".")
    source = getattr(module.get_submodule(layer), "source_name", None)
    if rest and callable(source):
        try:
            return str(source(rest))
        except ValueError:
            pass
    return name


def _first_input(module: nn.Module) -> str:
    """The name of the first parameter of ``module.forward``."""
    return next(iter(inspect.signature(module.forward).parameters))


class TPRandom(ParallelStyle):
    """Where the random ops of a module (and of its submodules) draw under tensor parallelism.

    ``sharded=True``: the module's activations are sharded over the tp ranks (sequence
    shards, local heads), each rank draws from its own stream
    (:func:`~zerobubble.runtime.rng.rank_stream`, entered before the forward and left after
    it); ``sharded=False``: they are replicated, every rank draws the same numbers from the
    shared stream. A dropout module's DTensor input is handed to it as its local tensor and
    its output made a DTensor of the same layout again, so that it draws from our streams on
    every device (DTensor's own random ops keep a tracker of their own on CUDA).
    """

    def __init__(self, *, sharded: bool) -> None:
        super().__init__()
        self.sharded = sharded

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rank = device_mesh.get_local_rank()
        open_: list[tuple[ExitStack, DTensor | None]] = []  # one per forward running
        elementwise = isinstance(module, nn.modules.dropout._DropoutNd)

        def enter(_m: nn.Module, args: tuple) -> tuple:
            first = args[0] if args else None
            stack = ExitStack()
            if self.sharded:
                device = first.device if isinstance(first, Tensor) else device_mesh.device_type
                stack.enter_context(rank_stream(rank, device))
            layout = first if elementwise and isinstance(first, DTensor) else None
            open_.append((stack, layout))
            return args if layout is None else (layout.to_local(), *args[1:])

        def leave(_m: nn.Module, _args: tuple, out: Any) -> Any:
            stack, layout = open_.pop()
            stack.close()
            if layout is None or not isinstance(out, Tensor):
                return out
            return DTensor.from_local(
                out,
                layout.device_mesh,
                layout.placements,
                shape=layout.shape,
                stride=layout.stride(),
                run_check=False,
            )

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return module


class ShardedLogits(ColwiseParallel):
    """The loss-parallel LM head: column-wise, its output left a DTensor ``Shard(-1)`` (each
    rank's ``vocab / tp`` columns of the logits) for :mod:`~zerobubble.parallel.loss`."""

    def __init__(self, seq: Placement) -> None:
        super().__init__(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)


def _style(kind: str, sp: bool) -> ParallelStyle:
    """The parallel style of ``kind`` with or without sequence parallelism."""
    seq: Placement = Shard(1) if sp else Replicate()
    if kind.startswith("replicated_heads:"):
        return _ReplicatedHeads(int(kind.partition(":")[2]), seq)
    if kind == "colwise":
        return ColwiseParallel(input_layouts=seq)
    if kind == "colwise_prepared":  # the input is a Replicate DTensor already
        return ColwiseParallel(input_layouts=Replicate())
    if kind == "colwise_partial_grad":
        return _ColwisePartialGrad()
    if kind == "rowwise":
        return RowwiseParallel(output_layouts=seq)
    if kind == "colwise_gather_output":
        return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if kind == "colwise_shard_output":
        return ShardedLogits(seq)
    if kind == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if kind == "embedding_dtensor":
        return RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=False
        )
    if kind == "sequence_parallel":
        return SequenceParallel()
    if kind == "sequence_parallel_layer":  # a stage's layer: its output may be the boundary
        return SequenceParallel(use_local_output=True)
    if kind == "heads_norm":  # heads (dim -2) sharded: the weight's gradient is Partial
        return SequenceParallel(sequence_dim=-2, use_local_output=True)
    if kind in ("random_sharded", "random_replicated"):
        return TPRandom(sharded=kind == "random_sharded")
    raise AssertionError(kind)


def _divisible(stage: int, name: str, what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(
            f"stage {stage}: {name} has {what}={n}, not divisible by tp={tp}; the default "
            f"tensor-parallel plan shards it evenly: choose a tp that divides {n}, or pass "
            "tp_plan= leaving this layer replicated"
        )


VOCABULARY_KINDS = (
    "embedding",
    "embedding_dtensor",
    "colwise_gather_output",
    "colwise_shard_output",
)
"""The kinds whose sharded dim is the vocabulary (a token table's rows, an LM head's
outputs): sharded unevenly where tp does not divide it, every other dim evenly."""


def _check(stage: int, name: str, module: nn.Module, kind: str, tp: int) -> None:
    """What the default plan cannot shard evenly raises; the vocabulary dims are left to
    DTensor's uneven ``Shard(0)`` (``torch.chunk``'s split, see the module docstring)."""
    if kind in VOCABULARY_KINDS:
        return
    if isinstance(module, nn.Linear) and kind.startswith("colwise"):
        _divisible(stage, name, "out_features", module.out_features, tp)
    elif isinstance(module, nn.Linear) and kind == "rowwise":
        _divisible(stage, name, "in_features", module.in_features, tp)
    elif kind.startswith("replicated_heads:"):
        heads = int(kind.partition(":")[2])
        if tp % heads or not isinstance(module, nn.Linear) or module.out_features % heads:
            raise ValueError(
                f"stage {stage}: {name} is planned {kind!r}: its output's {heads} heads "
                f"are replicated over tp={tp}, which needs an nn.Linear whose out_features "
                f"{heads} divides and a tp that {heads} divides; pass tp_plan= instead"
            )


def norm_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s norms (by type, as the B/W split knows them)."""
    return [n for n, m in module.named_modules() if n and is_norm(m)]


def is_norm(m: nn.Module) -> bool:
    """Whether ``m`` is a norm (by type, as the B/W split knows them)."""
    return isinstance(m, nn.LayerNorm | nn.RMSNorm) or type(m).__name__.endswith("Norm")


def dropout_kinds(layer: nn.Module, sharded: Mapping[str, bool]) -> dict[str, str]:
    """The random kinds of ``layer``'s dropouts ``{name: sharded}`` that draw (p > 0)."""
    return {
        name: "random_sharded" if is_sharded else "random_replicated"
        for name, is_sharded in sharded.items()
        if _dropout_p(layer.get_submodule(name)) > 0
    }


def _dropout_p(m: nn.Module) -> float:
    """A module's dropout probability: a dropout module's, or an attention's
    ``attention_dropout`` (Hugging Face attention modules draw it in their forward)."""
    p = m.p if isinstance(m, nn.modules.dropout._DropoutNd) else None
    p = getattr(m, "attention_dropout", p)
    return p if isinstance(p, float) else 0.0


def share_column_inputs(kinds: dict[str, str]) -> dict[str, str]:
    """``kinds`` with each module that holds two or more column-wise layers (attention's
    q/k/v, replicated k/v heads among them; a gated MLP's gate/up) preparing their shared
    input once."""
    parents: dict[str, list[str]] = {}
    for sub, kind in kinds.items():
        column = kind == "colwise" or kind.startswith("replicated_heads:")
        if column and "." in sub:
            parents.setdefault(sub.rpartition(".")[0], []).append(sub)
    out = dict(kinds)
    for parent, subs in parents.items():
        if len(subs) > 1:
            out[parent] = "prepare_input"
            # replicated_heads takes the prepared Replicate DTensor as it is
            out |= {s: "colwise_prepared" for s in subs if kinds[s] == "colwise"}
    return out


def _layer_kinds(layer: nn.Module, layout: LayerLayout) -> dict[str, str] | None:
    """The kinds ``layer`` states (``tp_kinds``), or those of a norm or a linear layer on
    its own; None for a layer that says nothing."""
    kinds = getattr(layer, "tp_kinds", None)
    if callable(kinds):
        return dict(kinds(layout))
    if is_norm(layer):  # a layer of its own, its output may be the stage's: a local shard
        return {"": "sequence_parallel_layer"} if layout.sequence_parallel else {}
    if type(layer) is nn.Linear:  # an LM head
        return {"": layout.lm_head()}
    return None


def default_plan(
    module: nn.Module,
    tp: int,
    *,
    stage: int,
    sequence_parallel: bool,
    loss_parallel: bool = False,
) -> TPPlan:
    """The default plan of stage ``stage``'s ``module`` (an ``nn.Sequential`` of layers that
    state their kinds, see the module docstring) over ``tp`` ranks; ValueError for a layer
    that cannot be sharded exactly or states nothing. ``loss_parallel``: the stage's last
    layer is told its output is the loss's vocabulary-sharded logits
    (:attr:`LayerLayout.loss_parallel`)."""
    sp = sequence_parallel
    plan: dict[str, ParallelStyle] = {}
    children = list(module.named_children())
    for i, (name, layer) in enumerate(children):
        last = loss_parallel and i == len(children) - 1
        kinds = _layer_kinds(layer, LayerLayout(tp, sp, stage, name, last))
        if kinds is None and any(True for _ in layer.parameters()):
            # Left replicated, its weight gradients would be per-rank partial sums under
            # sequence parallelism, and it would hold whole matrices: refuse, not guess.
            raise ValueError(
                f"stage {stage}: layer {name} ({type(layer).__name__}) holds parameters but "
                "no tensor-parallel plan of its own (a tp_kinds method; our GPT's and the "
                "Hugging Face adapter's Llama-layout layers have one); pass tp_plan= (a "
                "plan, or a function (stage, module) -> plan)"
            )
        for sub, kind in (kinds or {}).items():
            full = f"{name}.{sub}" if sub else name
            target = module.get_submodule(full)
            if kind == "replicated":
                plan[full] = _Replicated()
            elif kind == "whole_sequence":
                if sp:
                    plan[full] = _WholeSequence(_first_input(target))
            elif kind == "prepare_input":
                plan[full] = _PrepareInput(_first_input(target), Shard(1) if sp else Replicate())
            elif kind == "shard_output":
                seq: Placement = Shard(1) if sp else Replicate()
                plan[full] = PrepareModuleOutput(
                    output_layouts=seq, desired_output_layouts=seq, use_local_output=True
                )
            else:
                _check(stage, full, target, kind, tp)
                plan[full] = _style(kind, sp)
    return plan


def _refuse_uncovered_dropout(module: nn.Module, plan: TPPlan, stage: int) -> None:
    """Every module that draws (dropout > 0) must be, or be inside, a :class:`TPRandom` of the
    plan: whether its activations are sharded or replicated is the plan's to say."""
    marked = [key.split(".") for key, style in plan.items() if isinstance(style, TPRandom)]

    def covered(name: str) -> bool:  # parallelize_module's matching: fnmatch per component
        parts = name.split(".")
        return any(len(key) <= len(parts) and all(map(fnmatch, parts, key)) for key in marked)

    for name, m in module.named_modules():
        p = _dropout_p(m)
        if p > 0 and not covered(name):
            raise ValueError(
                f"stage {stage}: {name or type(module).__name__} has dropout {p}, and the "
                "tensor-parallel plan does not say where it draws: give it (or a module "
                "around it) TPRandom(sharded=True) in tp_plan= if its activations are "
                "sharded over the tp ranks (sequence shards, local heads), "
                "TPRandom(sharded=False) if they are replicated; or set dropout to 0"
            )


def _check_length(stage: int, tp: int, _m: nn.Module, args: tuple, kwargs: dict) -> None:
    """Sequence parallelism shards the sequence evenly: the first stage checks its ids."""
    ids = args[0] if args else kwargs.get("input_ids")
    if isinstance(ids, Mapping):
        ids = ids.get("input_ids")
    if isinstance(ids, Tensor) and ids.shape[-1] % tp:
        raise ValueError(
            f"stage {stage}: sequence length {ids.shape[-1]} is not divisible by tp={tp}; "
            f"sequence parallelism shards it evenly over the tp ranks: pad the batch to a "
            f"multiple of {tp} tokens, or turn sequence_parallel off"
        )


def _shared_names(module: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter of ``module`` (a tied one has several)."""
    names: dict[int, list[str]] = {}
    for name, p in _named_all(module):
        names.setdefault(id(p), []).append(name)
    return names


def parallelize_stage(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TPPlan | None = None,
    *,
    stage: int,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> nn.Module:
    """Apply ``plan`` (None: :func:`default_plan`, its last layer's LM head leaving the logits
    sharded over the vocabulary with ``loss_parallel``: the loss stage's, for a loss that
    takes them) to stage ``stage``'s ``module`` over ``tp_mesh``, in place; returns the
    module.

    Refuses dropout > 0 that no :class:`TPRandom` of the plan covers. A parameter two layers
    of the stage share (tied embeddings on one stage) stays one parameter where the plan
    lays it out alike for both (the default plan's embedding and LM head), and is refused
    otherwise.
    """
    tp = tp_mesh.size()
    if plan is None:
        sp = sequence_parallel
        plan = default_plan(
            module, tp, stage=stage, sequence_parallel=sp, loss_parallel=loss_parallel
        )
    _refuse_uncovered_dropout(module, plan, stage)
    tied = [n for n in _shared_names(module).values() if len(n) > 1]
    parallelize_module(module, tp_mesh, dict(plan))
    for names in tied:
        _retie(module, names, stage)
    _warn_replicated_experts(module, stage, tp)
    for m in module.children():  # a layer that adapts its local shapes to tp (kv heads)
        if hasattr(m, "tensor_shards"):
            setattr(m, "tensor_shards", tp)  # noqa: B010 (nn.Module types it as a Module)
    if sequence_parallel:
        _shard_sequence(module, stage, tp)
    return module


def _retie(module: nn.Module, names: list[str], stage: int) -> None:
    """Make ``names``, one parameter before the plan, one again: each layer's style made its
    own DTensor of it. Where they agree on the layout (a vocabulary-sharded embedding and
    LM head both shard the ``(vocab, d)`` matrix's rows) every name takes the first's
    Parameter, so autograd sums the uses into one gradient, as without tp; otherwise the
    plan cannot hold one tensor and is refused."""
    params = [module.get_parameter(n) for n in names]
    first = params[0]
    layout = [(type(p), getattr(p, "placements", None), p.shape) for p in params]
    if any(x != layout[0] for x in layout[1:]):
        raise ValueError(
            f"stage {stage}: {' and '.join(names)} are one parameter that the tensor-"
            f"parallel plan lays out two ways ({', '.join(str(x[1]) for x in layout)}); "
            "untie them (e.g. tie_embeddings=False) or give both layers one layout"
        )
    for name, p in zip(names[1:], params[1:], strict=True):
        if p is not first:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, first)


def _named_all(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` under every name, duplicates included."""
    return [
        (f"{mn}.{pn}" if mn else pn, p)
        for mn, m in module.named_modules(remove_duplicate=False)
        for pn, p in m.named_parameters(recurse=False)
    ]


def _shard_sequence(module: nn.Module, stage: int, tp: int) -> None:
    """Tell the layers that rebuild masks and positions from the hidden states' length the
    number of shards, and check the first stage's sequence length."""
    check: Callable[..., None] = partial(_check_length, stage, tp)
    for m in module.children():
        if hasattr(m, "sequence_shards"):
            setattr(m, "sequence_shards", tp)  # noqa: B010 (nn.Module types it as a Module)
        if getattr(m, "tp_token_ids", False):  # takes the ids whose length is sharded
            m.register_forward_pre_hook(check, with_kwargs=True)
