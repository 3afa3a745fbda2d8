"""The pipeline layers cut out of a Hugging Face causal LM (imports ``transformers``).

Each layer holds the model's own submodules (no copies, no re-implementation):
the embedding layer, one layer per decoder block, and the final norm with the
head. Between layers travels a dict pytree ``{"hidden", "attention_mask",
"position_ids"}`` (plus ``"router"``, the router-loss statistics of a mixture of
experts: :mod:`~zerobubble.interop.hf_router`): the hidden states, the 2-D
padding mask as bool (or a user's 4-D mask, unchanged) and the user's position
ids, each possibly ``None``. Every block rebuilds what it needs from them the
way the model's forward does (the causal mask with ``transformers``' own mask
utilities, the rotary embedding from the position ids): a few ``B x S`` integers
travel instead of ``S x S`` masks or ``S x head_dim`` tables, and the recomputed
values are bitwise those of the model.

Every layer names its state as the model does (:meth:`HFLayer.source_name`), so
a pipeline's parameters and state dicts carry Hugging Face names.

Under context parallelism (:mod:`zerobubble.runtime.sequence.cp`) a decoder block's
attention runs the cp ring: importing this module registers :func:`_ring_interface` in
transformers' ``AttentionInterface`` as ``"zerobubble_cp_ring"``; a block given its cp slot
points its attention modules at a copy of their config that names it, and passes the slot
through the decoder layer's keyword arguments, which Hugging Face hands to the attention
function (Llama, Qwen3 and Mistral-style attention do). No mask and no other rank's keys
are held. With attention dropout the block gathers the keys and values instead
(:func:`_context_inputs`).
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
)

from zerobubble.interop.hf_experts import shard_layer_experts
from zerobubble.interop.hf_router import (
    BIAS,
    ROUTER_TERM,
    Z_TERM,
    BiasBalance,
    RouterLoss,
    Routers,
    RouterStats,
    add_routing,
    router_term,
    router_z_term,
)
from zerobubble.interop.hf_tp import hf_block_plan
from zerobubble.parallel.ep import ExpertGroup
from zerobubble.parallel.tp import LayerLayout, share_column_inputs
from zerobubble.runtime.loss_terms import add_loss_term, segments_refusal
from zerobubble.runtime.sequence.cp import ContextAware, ContextSlot, ring_attention
from zerobubble.runtime.sequence.kv import SegmentAware, SegmentSlot, saving_joined

Boundary = dict[str, Any]
"""What travels between layers: ``hidden``, ``attention_mask``, ``position_ids``."""

_MASKS: dict[str, Callable[..., Any]] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


class HFLayer(nn.Module):
    """A slice of a Hugging Face model whose state keeps the model's names.

    ``parts`` maps an attribute name to ``(path in the model, submodule)``; the
    submodule is registered under the attribute, so its state is named
    ``"<attribute>.<rest>"`` here and ``"<path>.<rest>"`` in the model.
    Subclasses declare their parts as ``nn.Module`` attributes, which is what they
    are (``nn.Module.__getattr__`` alone would type them as ``Tensor | Module``).
    """

    def __init__(self, parts: Mapping[str, tuple[str, nn.Module]]) -> None:
        super().__init__()
        self._paths: dict[str, str] = {}
        for attr, (path, module) in parts.items():
            self.add_module(attr, module)
            self._paths[attr] = path

    def source_name(self, name: str) -> str:
        """The model's name for this layer's parameter or buffer ``name``."""
        attr, dot, rest = name.partition(".")
        if not dot or attr not in self._paths:
            raise ValueError(
                f"{name!r} is not a parameter or buffer of {type(self).__name__} (its parts are "
                f"{', '.join(sorted(self._paths))})"
            )
        return f"{self._paths[attr]}.{rest}"

    def shard_experts(self, ep: ExpertGroup, first_run: int) -> int:
        """The layer contract's sharding hook
        (:class:`~zerobubble.parallel.experts.ShardsExperts`): every experts module of
        transformers' layout in this layer becomes its
        :class:`~zerobubble.interop.hf_experts.ShardedExperts` over ``ep``
        (:func:`~zerobubble.interop.hf_experts.shard_layer_experts`); a refusal names the
        module as the model does."""
        return shard_layer_experts(self, ep, first_run, self.source_name)


def _batch_inputs(layer: str, inputs: Tensor | Mapping[str, Any], extra: dict[str, Any]) -> dict:
    """The embedding's inputs from a tensor of ids plus keywords, or from one mapping.

    A mapping is what a tokenizer returns (``input_ids``, ``attention_mask``, ...).
    Unknown keys are refused rather than dropped, so nothing is silently ignored.
    """
    if isinstance(inputs, Mapping):
        given = {k: v for k, v in extra.items() if v is not None}
        if given:
            raise ValueError(
                f"{layer}: pass the inputs either as one mapping or as input_ids plus "
                f"keywords, not both (got the mapping and {', '.join(sorted(given))})"
            )
        unknown = sorted(set(inputs) - {"input_ids", *extra})
        if unknown:
            raise ValueError(
                f"{layer}: unknown inputs {', '.join(map(repr, unknown))}; it takes input_ids, "
                f"{', '.join(extra)} (labels go to the loss as the target)"
            )
        if "input_ids" not in inputs:
            raise ValueError(f"{layer}: the input mapping has no 'input_ids'")
        return {"input_ids": inputs["input_ids"], **{k: inputs.get(k) for k in extra}}
    if not isinstance(inputs, Tensor):
        raise ValueError(
            f"{layer}: input_ids must be an integer tensor or a mapping with 'input_ids', got "
            f"{type(inputs).__name__}"
        )
    return {"input_ids": inputs, **extra}


def _padding_mask(layer: str, mask: Tensor | None) -> Tensor | None:
    """The padding mask as it travels: a 2-D mask as bool (the mask utilities use bool)."""
    if mask is None or mask.ndim == 4:
        return mask
    if mask.ndim != 2:
        raise ValueError(
            f"{layer}: attention_mask must be (batch, sequence) with 1 for real tokens and 0 for "
            f"padding, or a prepared 4-D mask; got shape {tuple(mask.shape)}"
        )
    return mask.to(torch.bool)


def _positions(hidden: Tensor, position_ids: Tensor | None) -> Tensor:
    """The user's position ids, or the models' default ``arange(S)[None]``."""
    if position_ids is not None:
        return position_ids
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _query_positions(name: str, hidden: Tensor, position_ids: Tensor | None, start: int) -> Tensor:
    """A segment's positions: columns ``[start, end)`` of the whole sequence's position ids
    (:func:`~zerobubble.runtime.sequence.kv.segment_inputs` keeps them whole), or
    ``arange(start, end)[None]``."""
    end = start + hidden.shape[1]
    if position_ids is None:
        return torch.arange(start, end, device=hidden.device).unsqueeze(0)
    if position_ids.shape[-1] < end:
        raise ValueError(
            f"{name}: a segment of tokens [{start}, {end}) needs the position ids of the whole "
            "sequence (segment_inputs keeps them whole: the earlier tokens' tell the documents "
            f"of a packed batch), got shape {tuple(position_ids.shape)}"
        )
    return position_ids[..., start:end]


def _documents(
    position_ids: Tensor | None, mask: Tensor | None, batch: int, end: int
) -> Tensor | None:
    """The document of each token ``[0, end)`` of a packed batch, or None for one per row.

    Hugging Face's packed-sequence convention: without a padding mask, position ids that do
    not go up by one (restart at 0) start a new document, and no token attends to another
    document's (``transformers.masking_utils.find_packed_sequence_indices``). The model's
    own forward applies it only without a key/value cache, so with its default
    ``use_cache=True`` it attends across documents; the layers apply it always, on the whole
    sequence and on segments alike: a segment's queries see their own document's earlier
    keys, those of earlier segments included.
    """
    if position_ids is None or mask is not None or position_ids.ndim != 2:
        return None
    ids = position_ids[:, :end]
    if ids.shape[0] != batch:  # position ids given for one row, as the models allow
        ids = ids.expand(batch, -1)
    return find_packed_sequence_indices(ids)


def _forward_cache(config: Any) -> DynamicCache | None:
    """The key/value cache the model's own forward would fill, fresh for one block's call.

    Called without ``use_cache``, a causal LM takes it from its config and, when set,
    passes every layer a ``DynamicCache``, also in training. The cache's ``update``
    concatenates each layer's keys and values into new contiguous tensors, so attention
    multiplies other memory layouts than without it, and the layouts choose the kernels:
    a block must get the same (empty) cache to compute the model's very ops. Nothing
    reads the cache afterwards; it lives for one call.
    """
    return DynamicCache(config=config) if getattr(config, "use_cache", False) else None


_DOCUMENT_MASKS = ("sdpa", "eager")
"""Attention implementations whose masks the layers build from a mask function (the
document mask of a packed batch in segments goes into it)."""


def _attention_inputs(
    slot: SegmentSlot | None,
    config: Any,
    index: int,
    make_mask: Callable[..., Any],
    hidden: Tensor,
    mask: Tensor | None,
    position_ids: Tensor | None,
) -> tuple[Any, Tensor | None, Tensor, Any]:
    """The cache, padding mask, positions and causal mask of one block's call.

    Without a segment, what the model's forward gives the block. In a segment of tokens
    ``[start, end)`` (:mod:`zerobubble.runtime.sequence.kv`) the cache (:class:`_SegmentKV`)
    joins to the layer's own keys and values the earlier segments' that it reads: all of
    them under full attention, those of tokens ``[max(0, start - window + 1), start)`` under
    a sliding window (the earliest key its first query sees), so the model's own code
    attends over them; the mask utilities take the query offset and key length from a
    cache of placeholders (:func:`_mask_cache`); the padding mask keeps the
    columns of keys ``[0, end)`` (returned so, as it travels on) and the mask is built over
    the cached keys' columns. A packed batch (:func:`_documents`) adds the document mask.
    """
    extra: dict[str, Any] = {}
    first = 0
    keys_mask = mask
    cache: DynamicCache | _SegmentKV | None
    if slot is None:
        positions = _positions(hidden, position_ids)
        cache = _forward_cache(config)
        docs = _documents(position_ids, mask, hidden.shape[0], hidden.shape[1])
    else:
        start = slot.start
        end = start + hidden.shape[1]
        window = _window(slot.name, config, make_mask)
        first = 0 if window is None else max(0, start - window + 1)
        mask = _segment_mask(slot.name, mask, end)
        keys_mask = None if mask is None else mask[:, first:]
        positions = _query_positions(slot.name, hidden, position_ids, start)
        docs = _documents(position_ids, mask, hidden.shape[0], end)
        if docs is not None and config._attn_implementation not in _DOCUMENT_MASKS:
            raise ValueError(
                f"{slot.name}: a packed batch (position ids that restart) in segments needs "
                f"its document mask, which the layers build for {', '.join(_DOCUMENT_MASKS)} "
                f"attention, not {config._attn_implementation!r}: build the model with "
                "attn_implementation='sdpa', or train the packed batch without segments"
            )
        cache = _SegmentKV(slot, first)
        extra["layer_idx"] = index
    if docs is not None:
        extra["and_mask_function"] = packed_sequence_mask_function(docs[:, first:])
    # In a segment the stage's blocks of one kind build the same mask (the same padding
    # mask, positions and cached length): the first builds it, the others share it, so a
    # kernel that saves its mask (sdpa) keeps one per stage rather than one per layer.
    key = (make_mask, first, tuple(hidden.shape), hidden.dtype)
    causal = None if slot is None else slot.context.shared.get(key)
    if causal is None:
        causal = make_mask(
            config=config,
            inputs_embeds=hidden,
            attention_mask=keys_mask,
            cache=cache if slot is None else _mask_cache(hidden, slot.start - first, index),
            position_ids=None if docs is not None else positions,
            **extra,
        )
        if slot is not None:
            causal = _additive_for_sdpa(config, causal, hidden.dtype)
            slot.context.shared[key] = causal
    return cache, mask, positions, causal


def _additive_for_sdpa(config: Any, causal: Any, dtype: torch.dtype) -> Any:
    """A boolean mask that sdpa gets, as the additive mask sdpa would make of it.

    ``scaled_dot_product_attention`` turns a boolean mask into zeros and ``-inf`` of the
    queries' dtype on every call, and its graph saves that copy: one mask per layer. Made
    here, the stage's layers share one, and the kernel reads the values it would have made
    (so it computes what it did)."""
    if config._attn_implementation != "sdpa" or not isinstance(causal, Tensor):
        return causal
    if causal.dtype != torch.bool:
        return causal
    return torch.zeros(causal.shape, dtype=dtype, device=causal.device).masked_fill_(
        causal.logical_not(), float("-inf")
    )


def _window(name: str, config: Any, make_mask: Callable[..., Any]) -> int | None:
    """The layer's sliding window (None for full attention): a query at ``t`` sees the keys
    ``(t - window, t]``, as ``transformers.masking_utils.sliding_window_overlay``."""
    if make_mask is create_causal_mask:
        return None
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(
            f"{name}: a sliding-window layer needs config.sliding_window, a positive number "
            f"of tokens, got {window!r}"
        )
    return window


def _segment_mask(name: str, mask: Tensor | None, end: int) -> Tensor | None:
    """A segment's padding mask: keys ``[0, end)``."""
    if mask is None:
        return None
    if mask.ndim != 2 or mask.shape[-1] < end:
        raise ValueError(
            f"{name}: a segment ending at token {end} needs the 2-D padding mask "
            f"of keys [0, {end}), got shape {tuple(mask.shape)}"
        )
    return mask[:, :end]


def _mask_cache(hidden: Tensor, past: int, index: int) -> DynamicCache:
    """A cache that tells the mask utilities ``past`` cached keys before the queries (their
    length is all they read): placeholders of one element per key, not the keys."""
    cache = DynamicCache()
    if past:
        stub = hidden.new_zeros(hidden.shape[0], 1, past, 1)
        cache.update(stub, stub, index)
    return cache


class _SegmentKV:
    """A segment's stand-in for the attention's key/value cache.

    ``update`` hands the layer's own keys and values to the scope and returns them joined
    after the earlier segments' of tokens ``[first, start)`` (all of them under full
    attention), the joined tensors saved as their pieces while :meth:`saving` lasts
    (:func:`~zerobubble.runtime.sequence.kv.saving_joined`): each segment's graph keeps its
    own keys and values once, not a copy of the past per segment. With grouped-query
    attention the keys and values are repeated to the query heads before they are kept, and
    the attention is told there is one query head per key head for the call, so the repeated
    pieces are saved once too (the model's kernels would repeat the joined tensors, a copy
    of the past per segment).
    """

    def __init__(self, slot: SegmentSlot, first: int) -> None:
        self.slot = slot
        past_k, past_v = slot.past()
        self.past = (_pieces_from(past_k, first), _pieces_from(past_v, first))
        self.groups = 1
        self.recorded = False
        self._join: Callable[[Sequence[Tensor], int], Tensor] | None = None

    @contextmanager
    def saving(self, attention: Sequence[nn.Module]) -> Iterator[None]:
        """Join inside: the layer's call, ``attention`` its attention modules (which must
        agree on their query heads per key head)."""
        grouped = [m for m in attention if getattr(m, "num_key_value_groups", 1) > 1]
        counts: set[int] = {getattr(m, "num_key_value_groups") for m in grouped}  # noqa: B009
        if len(counts) > 1:
            raise ValueError(
                f"{self.slot.name}: its attention modules repeat their key/value heads "
                f"{sorted(counts)} times; segments take one count per layer"
            )
        with saving_joined() as join:
            self._join, self.groups = join, counts.pop() if counts else 1
            for m in grouped:  # a plain attribute, not a submodule
                setattr(m, "num_key_value_groups", 1)  # noqa: B010
            try:
                yield
            finally:
                for m in grouped:
                    setattr(m, "num_key_value_groups", self.groups)  # noqa: B010
                self._join = None
        if not self.recorded:
            raise ValueError(
                f"{self.slot.name}: the layer left no keys and values in its cache; segments "
                "take attention layers that cache them"
            )

    def update(self, keys: Tensor, values: Tensor, *args: Any, **kwargs: Any) -> tuple:
        if self._join is None:
            raise RuntimeError(f"{self.slot.name}: the segment cache is used outside its call")
        keys, values = repeat_kv(keys, self.groups), repeat_kv(values, self.groups)
        self.slot.record(keys, values)
        self.recorded = True
        return self._join([*self.past[0], keys], -2), self._join([*self.past[1], values], -2)


def _pieces_from(pieces: list[Tensor], first: int) -> list[Tensor]:
    """The pieces (consecutive tokens from 0, on dim -2) from token ``first`` on, as views;
    a piece wholly before it is not read (nor sent a gradient)."""
    kept = []
    offset = 0
    for piece in pieces:
        n = piece.shape[-2]
        if offset + n > first:
            kept.append(piece[..., max(0, first - offset) :, :])
        offset += n
    return kept


def _saving(cache: Any, attention: Sequence[nn.Module]) -> AbstractContextManager[None]:
    """The context a block's layer runs in: a segment cache's :meth:`_SegmentKV.saving`."""
    return cache.saving(attention) if isinstance(cache, _SegmentKV) else nullcontext()


class _GatheredCache:
    """A cp rank's stand-in for the attention's key/value cache: ``update`` returns the whole
    sequence's keys and values, gathered from the cp ranks (their gradients sent back)."""

    def __init__(self, slot: ContextSlot) -> None:
        self.slot = slot

    def update(self, keys: Tensor, values: Tensor, *args: Any, **kwargs: Any) -> tuple:
        return self.slot.gather(keys), self.slot.gather(values)


class _RingCall:
    """What one block call hands its attention modules (through the decoder layer's keyword
    arguments, which Hugging Face forwards to the attention interface): the cp slot, and a
    count of the attention calls that ran the ring, which the block checks afterwards (an
    attention module that never reached the interface would have attended to its rank's
    chunks only)."""

    def __init__(self, slot: ContextSlot) -> None:
        self.slot = slot
        self.calls = 0


RING_ATTENTION = "zerobubble_cp_ring"
"""The name under which :func:`_ring_interface` is registered in transformers'
``AttentionInterface`` (a cp rank's blocks point their attention modules' config copy at it)."""

_RING_KWARG = "zerobubble_cp_ring"
"""The keyword argument that carries a block call's :class:`_RingCall` to the interface."""


def _ring_interface(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """A Hugging Face attention function (``AttentionInterface``) that runs
    :func:`~zerobubble.runtime.sequence.cp.ring_attention` over a cp rank's two chunks.

    Pure: the slot comes with the call (the ``zerobubble_cp_ring`` keyword the block passes
    its decoder layer). Grouped key/value heads are repeated to the query heads first
    (``repeat_kv``: the ring is groups-free; their gradients sum back through the repeat).
    What the ring cannot honour is refused, naming the layer: a mask (the ring is the
    causal mask of the chunks' positions), attention dropout, a logit soft cap, attention
    sinks, a sliding window, a position bias, a non-causal attention, returned attention
    weights (the ring never holds the probabilities).
    """
    ring = kwargs.pop(_RING_KWARG, None)
    if not isinstance(ring, _RingCall):
        raise ValueError(
            f"{type(module).__name__}: attn_implementation={RING_ATTENTION!r} is zerobubble's "
            "context-parallel ring, which runs only inside the Hugging Face adapter's "
            "DecoderBlock on a cp rank (the block passes its slot through the decoder layer's "
            "keyword arguments); this attention was called without it: its decoder layer does "
            "not forward its keyword arguments to the attention. Build the mesh with cp=1 "
            "for this model"
        )
    why = _ring_refusal(module, attention_mask, dropout, kwargs)
    if why is not None:
        raise ValueError(
            f"{ring.slot.name} ({type(module).__name__}): the context-parallel ring does not "
            f"take {why}"
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(
            f"{ring.slot.name} ({type(module).__name__}): {heads} query heads over {kv_heads} "
            "key/value heads, which do not divide them"
        )
    key, value = repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = ring_attention(query, key, value, ring.slot, scale)
    ring.calls += 1
    return out.transpose(1, 2).contiguous(), None


def _ring_refusal(
    module: nn.Module, mask: Tensor | None, dropout: float, kwargs: dict[str, Any]
) -> str | None:
    """Why the ring cannot run this attention call (with the fix), or None."""
    if dropout > 0:
        return (
            f"attention dropout ({dropout}): the block gathers the keys and values instead "
            "when its attention modules have attention_dropout > 0 as it gets its cp slot; "
            "set attention_dropout before building the pipeline, or to 0"
        )
    if kwargs.get("softcap") is not None:
        return "a soft cap of the attention logits (softcap); build the mesh with cp=1"
    if kwargs.get("s_aux") is not None:
        return "attention sinks (s_aux); build the mesh with cp=1"
    if kwargs.get("sliding_window") is not None:
        return (
            f"a sliding window (sliding_window={kwargs['sliding_window']}); set "
            "config.sliding_window=None, or build the mesh with cp=1"
        )
    if kwargs.get("position_bias") is not None:
        return "a position bias; build the mesh with cp=1"
    if mask is not None:
        return "an attention mask (the ring is the causal mask); build the mesh with cp=1"
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        return "a non-causal attention; build the mesh with cp=1"
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        return (
            "output_attentions (the ring never holds the attention probabilities); set "
            "config.output_attentions=False, or build the mesh with cp=1"
        )
    return None


AttentionInterface.register(RING_ATTENTION, _ring_interface)


def _attention_modules(layer: nn.Module) -> list[nn.Module]:
    """The attention modules of a decoder layer: those whose class name ends in
    ``Attention`` (the heuristic :func:`~zerobubble.runtime.sequence.kv.unaware_attention`
    refuses by), outermost only."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in layer.named_modules():
        if type(m).__name__.endswith("Attention") and not any(
            name.startswith(f"{outer}.") for outer, _ in found
        ):
            found.append((name, m))
    return [m for _, m in found]


def _context_inputs(
    slot: ContextSlot,
    block: DecoderBlock,
    layer_type: str | None,
    hidden: Tensor,
    mask: Tensor | None,
    position_ids: Tensor | None,
    ring: bool,
) -> tuple[_GatheredCache | None, Tensor, Tensor | None]:
    """A cp rank's cache, positions and causal mask: its two chunks' global positions, and
    with ``ring`` no cache and no mask (the ring is causal over the chunks' positions),
    else the gathering cache and a 4-D mask of its queries over the whole sequence's keys
    (key ``t`` seen from a query at ``p`` iff ``t <= p``), boolean for sdpa, additive for
    eager. Refused: padding, position ids other than the tokens' own (packed documents),
    sliding windows, sequence segments, rotary embeddings that scale with the length, and
    for the gather other attention implementations than sdpa and eager. ``hidden``: the
    rank's two chunks whole (under sequence parallelism a stand-in of their shape: tp's
    shards cut them)."""
    config = block.config
    why = None
    if block.segment_slot is not None:
        why = "sequence segments"
    elif mask is not None:
        why = "a padding attention_mask"
    elif block.attention_type != "full_attention":
        why = f"{block.attention_type!r} layers (only full attention is sharded)"
    elif not ring and config._attn_implementation not in _DOCUMENT_MASKS:
        why = (
            f"attn_implementation={config._attn_implementation!r} with attention dropout (the "
            "gather path: sdpa or eager take its mask)"
        )
    elif _rope_type(block.rotary_emb, layer_type) in ("dynamic", "longrope"):
        why = "a rotary embedding that scales with the sequence's length"
    own = slot.positions(hidden.shape[1], hidden.device)
    if why is None and position_ids is not None and not _same_positions(position_ids, own):
        why = "position ids other than the tokens' own (packed documents)"
    if why is not None:
        raise ValueError(
            f"{slot.name}: context parallelism does not take {why}; build the mesh with cp=1"
        )
    if ring:
        return None, own.unsqueeze(0), None
    keys = torch.arange(own.shape[0] * slot.shards.size, device=hidden.device)
    seen = (keys[None, :] <= own[:, None])[None, None]
    causal: Tensor = seen
    if config._attn_implementation == "eager":
        causal = torch.zeros(seen.shape, dtype=hidden.dtype, device=hidden.device)
        causal = causal.masked_fill(~seen, torch.finfo(hidden.dtype).min)
    return _GatheredCache(slot), own.unsqueeze(0), causal


def _check_ring(ring: _RingCall, modules: int) -> None:
    """Refuse a block call whose attention modules did not all run the ring: one that does
    not call transformers' attention interface attended to its rank's chunks only."""
    if ring.calls != modules:
        raise ValueError(
            f"{ring.slot.name}: {modules} attention modules point at the context-parallel "
            f"ring, but {ring.calls} attention calls ran it: an attention module that does not "
            "call transformers' attention interface would attend to its rank's chunks only; "
            "build the mesh with cp=1 for this model"
        )


def _same_positions(position_ids: Tensor, own: Tensor) -> bool:
    """Whether the given position ids are every row's tokens' own, ``own``."""
    return position_ids.shape[-1] == own.shape[0] and bool((position_ids == own).all())


def _rope_type(rotary: nn.Module, layer_type: str | None) -> str:
    """The rotary embedding's ``rope_type`` (for ``layer_type`` where it has one per type)."""
    rope_type = getattr(rotary, "rope_type", "default")
    if isinstance(rope_type, Mapping):
        rope_type = rope_type.get(layer_type, "default")
    return rope_type if isinstance(rope_type, str) else "default"


def _check_rope(
    name: str,
    rotary: nn.Module,
    layer_type: str | None,
    positions: Tensor,
    position_ids: Tensor | None,
    start: int,
) -> None:
    """Refuse a segment whose rotary frequencies would not be the whole sequence's.

    Two of transformers' ``rope_type`` values pick their frequencies by the length a call
    sees, ``max(position_ids) + 1`` (``modeling_rope_utils.dynamic_rope_update``), which on
    a segment is not the whole sequence's:

    * ``dynamic`` (dynamic NTK) rescales beyond ``original_max_seq_len`` tokens to the
      length seen (and keeps the scale, a state): exact only while every position is below
      it, where it does not scale;
    * ``longrope`` (Phi-3) takes ``long_factor`` beyond ``original_max_position_embeddings``
      and ``short_factor`` within: exact when every segment is on the whole sequence's side,
      that is the whole sequence within the length or the first cut beyond it.

    The whole sequence's position ids travel with every segment when given
    (:func:`~zerobubble.runtime.sequence.kv.segment_inputs`), so the rule is checked on
    each; with the default positions ``arange(T)`` a segment knows only its own end, and a
    ``longrope`` sequence cut inside the length is refused at the first segment beyond it.
    """
    rope_type = _rope_type(rotary, layer_type)
    if "dynamic" not in rope_type and rope_type != "longrope":
        return
    end = start + positions.shape[-1]
    seen = int(positions.max()) + 1
    whole = None if position_ids is None else int(position_ids.max()) + 1
    span = f"tokens [{start}, {end})"
    if "dynamic" in rope_type:
        limit = int(getattr(rotary, "original_max_seq_len", 0))
        longest = max(seen, whole or 0)
        if longest > limit:
            raise ValueError(
                f"{name}: rope_type {rope_type!r} (dynamic NTK) rescales its rotary "
                f"frequencies to the length a call sees beyond {limit} tokens "
                f"(max_position_embeddings), so a segment would rotate by those of a shorter "
                f"sequence than the whole ({span} reach position {longest - 1}). Segments are "
                f"exact only while every position is below {limit}: train sequences of at "
                f"most {limit} tokens with segments, train this one without segments, or "
                "take a rope_type whose frequencies do not depend on the length (linear, "
                "yarn, llama3)"
            )
        return
    params = getattr(getattr(rotary, "config", None), "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), Mapping):
        params = params[layer_type]
    limit = int(params.get("original_max_position_embeddings", 0) or 0)
    if not limit:
        limit = int(getattr(rotary, "original_max_seq_len", 0))
    long_here = seen > limit
    # Without position ids (arange(T)) the segment before this one ended at `start`.
    wrong = long_here != (whole > limit) if whole is not None else long_here and 0 < start <= limit
    if wrong:
        raise ValueError(
            f"{name}: rope_type 'longrope' rotates by its long_factor frequencies when a "
            f"sequence is longer than original_max_position_embeddings={limit} tokens and by "
            f"its short_factor within, choosing by the length a call sees: {span} and the "
            "whole sequence fall on different sides, so the segments would rotate otherwise "
            f"than the whole. Segments are exact when the whole sequence has at most {limit} "
            f"tokens, or every segment reaches beyond token {limit} (the first cut b1 > "
            f"{limit}): cut so (ExecutorOptions(cuts=...)), or train without segments"
        )


def _boundary(
    hidden: Tensor,
    mask: Tensor | None,
    position_ids: Tensor | None,
    router: RouterStats | None = None,
) -> Boundary:
    out = {"hidden": hidden, "attention_mask": mask, "position_ids": position_ids}
    return out if router is None else {**out, "router": router}


def _unpack(layer: str, x: Any) -> tuple[Tensor, Tensor | None, Tensor | None]:
    if not (isinstance(x, Mapping) and isinstance(x.get("hidden"), Tensor)):
        raise ValueError(
            f"{layer}: expected the previous layer's dict with 'hidden' (a tensor), "
            f"'attention_mask' and 'position_ids'; got {type(x).__name__}"
        )
    return x["hidden"], x.get("attention_mask"), x.get("position_ids")


# ---- GPT-2 family: transformer.{wte, wpe, drop, h, ln_f}, lm_head -------------------------------


class GPT2Embedding(SegmentAware, HFLayer):
    """Token plus position embeddings (and token types), then dropout, as ``GPT2Model``.

    In a segment scope the ids are tokens ``[start, start + S)`` and take those positions.
    """

    wte: nn.Module
    wpe: nn.Module
    drop: nn.Module

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__(
            {
                "wte": ("transformer.wte", transformer.get_submodule("wte")),
                "wpe": ("transformer.wpe", transformer.get_submodule("wpe")),
                "drop": ("transformer.drop", transformer.get_submodule("drop")),
            }
        )

    def forward(
        self,
        input_ids: Tensor | Mapping[str, Any],
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Boundary:
        extra = {
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "token_type_ids": token_type_ids,
        }
        args = _batch_inputs(type(self).__name__, input_ids, extra)
        ids = args["input_ids"]
        ids = ids.view(-1, ids.shape[-1])
        embeds = self.wte(ids)
        slot = self.segment_slot
        if slot is None:
            positions = _positions(embeds, args["position_ids"])
        else:
            positions = _query_positions(slot.name, embeds, args["position_ids"], slot.start)
        hidden = embeds + self.wpe(positions).to(embeds.device)
        if args["token_type_ids"] is not None:
            hidden = hidden + self.wte(args["token_type_ids"].view(-1, ids.shape[-1]))
        hidden = self.drop(hidden)
        mask = args["attention_mask"]
        if mask is not None and mask.ndim < 4:  # as GPT2Model flattens it
            mask = mask.view(ids.shape[0], -1)
        mask = _padding_mask(type(self).__name__, mask)
        return _boundary(hidden, mask, args["position_ids"])


class GPT2Block(SegmentAware, HFLayer):
    """One ``GPT2Block`` with the causal (and padding) mask it is given in ``GPT2Model``.

    In a segment scope it attends over the earlier segments' keys and values too (see
    :func:`_attention_inputs`).
    """

    holds_kv = True
    block: nn.Module

    def __init__(self, config: Any, block: nn.Module, index: int) -> None:
        super().__init__({"block": (f"transformer.h.{index}", block)})
        self.config = config
        self.index = index

    def forward(self, x: Boundary) -> Boundary:
        hidden, mask, position_ids = _unpack(type(self).__name__, x)
        slot = self.segment_slot
        cache, mask, positions, causal = _attention_inputs(
            slot, self.config, self.index, create_causal_mask, hidden, mask, position_ids
        )
        with _saving(cache, ()):
            out = self.block(hidden, cache=cache, attention_mask=causal, position_ids=positions)
        return _boundary(out[0] if isinstance(out, tuple) else out, mask, position_ids)


class GPT2Head(HFLayer):
    """Final LayerNorm and the LM head (tied to ``wte`` if the model ties them)."""

    ln_f: nn.Module
    lm_head: nn.Module

    def __init__(self, transformer: nn.Module, lm_head: nn.Module) -> None:
        super().__init__(
            {
                "ln_f": ("transformer.ln_f", transformer.get_submodule("ln_f")),
                "lm_head": ("lm_head", lm_head),
            }
        )

    def forward(self, x: Boundary) -> Tensor:
        hidden, _, _ = _unpack(type(self).__name__, x)
        return self.lm_head(self.ln_f(hidden))


# ---- Llama family: model.{embed_tokens, layers, norm, rotary_emb}, lm_head ----------------------


TP_TABLE = {
    **dict.fromkeys(
        ("layers.*.self_attn.q_proj", "layers.*.self_attn.k_proj", "layers.*.self_attn.v_proj"),
        "colwise",
    ),
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
"""The tensor-parallel table of a Llama-layout block whose config has no
``base_model_tp_plan`` (the same names and style strings, see
:func:`~zerobubble.interop.hf_tp.hf_block_plan`)."""


def _attention_dropout(m: nn.Module) -> float:
    """A Hugging Face attention module's ``attention_dropout`` (drawn in its forward)."""
    p = getattr(m, "attention_dropout", None)
    return p if isinstance(p, float) else 0.0


class DecoderEmbedding(HFLayer):
    """The token embedding of a Llama-layout model (``model.embed_tokens``)."""

    embed_tokens: nn.Module

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__({"embed_tokens": ("model.embed_tokens", embed_tokens)})

    tp_token_ids = True
    """Takes the token ids, whose length sequence parallelism shards (checked)."""

    def tp_kinds(self, layout: LayerLayout) -> dict[str, str]:
        """Tensor parallelism (:mod:`~zerobubble.parallel.tp`): the table
        vocabulary-sharded, its output ``seq`` (sequence shards with sequence parallelism)."""
        return {"embed_tokens": "embedding"}

    def forward(
        self,
        input_ids: Tensor | Mapping[str, Any],
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Boundary:
        extra = {"attention_mask": attention_mask, "position_ids": position_ids}
        args = _batch_inputs(type(self).__name__, input_ids, extra)
        hidden = self.embed_tokens(args["input_ids"])
        mask = _padding_mask(type(self).__name__, args["attention_mask"])
        return _boundary(hidden, mask, args["position_ids"])


def _own_rotary(rotary_emb: nn.Module) -> nn.Module:
    """A block's own copy of the model's rotary embedding.

    Every block uses the one ``model.rotary_emb``, whose tables (``inv_freq``) are
    buffers; a buffer shared by layers of different stages cannot be honoured (the
    runtime keeps no buffers in sync), so each block gets a copy: the buffers are
    constants of the config (not in the state dict), the values bitwise the same.
    A rotary embedding with parameters stays shared (a tie the runtime keeps).
    """
    if any(True for _ in rotary_emb.parameters()):
        return rotary_emb
    return copy.deepcopy(rotary_emb)


class DecoderBlock(SegmentAware, ContextAware, HFLayer):
    """One decoder layer with its mask (full or sliding window) and rotary embedding.

    ``attention_type`` is the key of the model's mask mapping for this layer
    (``config.layer_types[i]``, else sliding iff ``config.sliding_window`` is set).

    In a segment scope it attends over the earlier segments' keys and values too, its
    rotary positions offset by the segment's start (see :func:`_attention_inputs`); full
    attention only. On a cp rank (:mod:`zerobubble.runtime.sequence.cp`) it takes its two
    chunks' global positions and its attention runs the ring
    (:func:`~zerobubble.runtime.sequence.cp.ring_attention`, through
    :func:`_ring_interface`); with attention dropout it attends the whole sequence's gathered
    keys and values under the causal mask of those positions (:func:`_context_inputs`).

    ``router``: the model's router loss (the block adds its router's statistics);
    ``routers``: where the model's routers are, for ``z_loss``, the coefficient of the
    router z-loss the block adds as the term ``"router_z"``
    (:func:`~zerobubble.interop.hf_router.router_z_term`). Both hook the block's router
    for the duration of its forward only.
    """

    holds_kv = True
    layer: nn.Module
    rotary_emb: nn.Module

    def __init__(
        self,
        config: Any,
        layer: nn.Module,
        rotary_emb: nn.Module,
        index: int,
        attention_type: str,
        router: RouterLoss | None = None,
        *,
        routers: Routers | None = None,
        z_loss: float = 0.0,
    ) -> None:
        super().__init__(
            {
                "layer": (f"model.layers.{index}", layer),
                "rotary_emb": ("model.rotary_emb", _own_rotary(rotary_emb)),
            }
        )
        if attention_type not in _MASKS:
            raise ValueError(
                f"decoder layer {index} uses {attention_type!r} attention; the adapter builds "
                f"masks for {', '.join(_MASKS)} only: cut the model into layers by hand"
            )
        self.config = config
        self.index = index
        self.attention_type = attention_type
        self.sequence_shards = 1
        self._tensor_shards = 1
        """Over how many ranks the hidden states' sequence is sharded (sequence parallelism,
        :mod:`~zerobubble.parallel.tp`): the mask and positions are of the whole sequence."""
        self.router = router
        """The model's router loss (None: none); then the block adds its router's statistics."""
        self.z_loss = float(z_loss)
        """The router z-loss coefficient (0: none); the block adds the term ``"router_z"``."""
        if router is not None:
            routers = Routers(router.router_class, router.index)
        self._routers = routers
        self._router_path = None if routers is None else _router_path(layer, routers, index)
        if z_loss and routers is None:
            raise ValueError(
                f"decoder layer {index}: router_z_loss needs the model's routers, but it "
                "records no router_logits (no mixture of experts the adapter knows)"
            )
        self.balance: BiasBalance | None = None
        """DeepSeek-V3's bias balancing of this block's router (None: off; see
        :class:`BiasBalancedBlock`)."""
        # Models with per-type rotary tables (local/global) take the layer type too.
        self._rotary_by_type = "layer_type" in inspect.signature(rotary_emb.forward).parameters
        self._cp_slot: ContextSlot | None = None
        self._own_configs: list[tuple[nn.Module, Any]] = []
        """The attention modules pointed at the ring's config copy, with their own configs."""

    @property
    def cp_slot(self) -> ContextSlot | None:
        """The cp slot (:mod:`~zerobubble.runtime.sequence.cp`; None: no cp). Setting it
        points the attention modules at the ring (:meth:`_point_attention`)."""
        return self._cp_slot

    @cp_slot.setter
    def cp_slot(self, slot: ContextSlot | None) -> None:
        self._point_attention(slot)
        self._cp_slot = slot

    @property
    def runs_ring(self) -> bool:
        """Whether a cp rank's forward runs the ring (its attention modules point at it);
        False with attention dropout, which needs the probabilities: it gathers."""
        return bool(self._own_configs)

    def _point_attention(self, slot: ContextSlot | None) -> None:
        """On a cp rank, point each attention module at a copy of its config whose
        ``_attn_implementation`` is :data:`RING_ATTENTION` (the model's config and other
        blocks untouched; the reference copies the model per cp rank, so this state is per
        rank); without a slot, or when an attention module has ``attention_dropout > 0``
        (the ring holds no probabilities to drop: the block gathers the keys and values),
        restore their own. A layer without an attention module, or an attention module
        without a config to point, is refused."""
        for module, config in self._own_configs:
            setattr(module, "config", config)  # noqa: B010 (a plain attribute, not a submodule)
        self._own_configs = []
        attention = _attention_modules(self.layer)
        if slot is not None and not attention:
            raise ValueError(
                f"{slot.name}: its decoder layer has no attention module (no submodule whose "
                "class name ends in Attention) to run the context-parallel ring or gather the "
                "sequence: build the mesh with cp=1 for this model"
            )
        if slot is None or any(_attention_dropout(m) > 0 for m in attention):
            return
        for m in attention:
            own: Any = getattr(m, "config", None)
            if not hasattr(own, "_attn_implementation"):
                raise ValueError(
                    f"{slot.name}: its {type(m).__name__} has no Hugging Face config whose "
                    "attn_implementation could select the context-parallel ring: build the "
                    "mesh with cp=1 for this model"
                )
            ring = copy.deepcopy(own)  # a deep copy: the setter recurses into sub-configs
            ring._attn_implementation = RING_ATTENTION
            setattr(m, "config", ring)  # noqa: B010 (a plain attribute, not a submodule)
            self._own_configs.append((m, own))

    def unsplit_submodules(self) -> list[nn.Module]:
        """The router, whose logits the router loss or z-loss reads outside its MoE block:
        the B/W split's graph-level fallback must leave it (and that block) on plain
        autograd (:mod:`~zerobubble.runtime.split.swap`). Under sequence parallelism also
        each MoE block's children other than its experts (its router): the block gathers
        the sequence in hooks (``whole_sequence``) that a graph split of the block would
        re-run in W, so its experts are split on their own instead."""
        kept = []
        if self.sequence_shards > 1:  # whole_sequence blocks: their children split, not they
            for name in _moe_blocks(self):
                moe = self.get_submodule(name)
                kept += [m for n, m in moe.named_children() if "experts" not in n.lower()]
        if self._router_path is None or (self.router is None and not self.z_loss):
            return kept
        return [*kept, self.layer.get_submodule(self._router_path)]

    def tp_kinds(self, layout: LayerLayout) -> dict[str, str]:
        """Tensor parallelism (:mod:`~zerobubble.parallel.tp`): the config's
        ``base_model_tp_plan`` where it has one, else Megatron's Llama layout
        (:data:`TP_TABLE`); column-wise siblings share one prepared input, the norms run on
        sequence shards with sequence parallelism. When only ``attention_dropout`` draws (on
        this rank's heads) the block draws from the rank's own stream; a dropout module is
        left uncovered, so that :func:`~zerobubble.parallel.tp.parallelize_stage` refuses it
        (it may act on replicated activations)."""
        config = self.config
        layout.divisible("layer.self_attn", "num_attention_heads", config.num_attention_heads)
        kv = config.num_key_value_heads
        replicate_kv = kv < layout.tp and layout.tp % kv == 0
        if not replicate_kv:
            _kv_divisible(layout, kv)
        table = getattr(config, "base_model_tp_plan", None) or TP_TABLE
        try:
            kinds = hf_block_plan(table, {"layer": self._paths["layer"]}, self)
        except ValueError as e:
            raise ValueError(f"stage {layout.stage}: layer {layout.name}: {e}") from None
        if replicate_kv:  # Megatron's kv-head replication: each rank the head its queries use
            for sub in ("layer.self_attn.k_proj", "layer.self_attn.v_proj"):
                if kinds.get(sub) == "colwise":
                    kinds[sub] = f"replicated_heads:{kv}"
        modules = list(self.modules())
        if any(_attention_dropout(m) > 0 for m in modules) and not any(
            isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in modules
        ):
            kinds[""] = "random_sharded"
        # The norms the plan leaves unstated run on sequence shards (Qwen3's q_norm and
        # k_norm act on local heads: the plan's heads_norm).
        return layout.norms(self) | _whole_moe_blocks(self, share_column_inputs(kinds), layout)

    @property
    def tensor_shards(self) -> int:
        """Over how many ranks the block is tensor-parallel (set by
        :func:`~zerobubble.parallel.tp.parallelize_stage`). With fewer kv heads than that, each
        rank holds one kv head for its ``heads / tp`` query heads (``replicated_heads``), so
        the attention's ``num_key_value_groups`` becomes ``heads / tp``."""
        return self._tensor_shards

    @tensor_shards.setter
    def tensor_shards(self, tp: int) -> None:
        self._tensor_shards = tp
        heads, kv = self.config.num_attention_heads, self.config.num_key_value_heads
        attention = self.layer.get_submodule("self_attn")
        if kv < tp and hasattr(attention, "num_key_value_groups"):
            attention.num_key_value_groups = heads // tp

    def forward(self, x: Boundary) -> Boundary:
        hidden, mask, position_ids = _unpack(type(self).__name__, x)
        slot = self.segment_slot
        if slot is not None and (self.router is not None or self.z_loss):
            # before the router's statistics meet the segment's mask (of its keys)
            raise segments_refusal(f"layer {slot.name} ({type(self).__name__})")
        whole = hidden
        if self.sequence_shards > 1:  # a stand-in of the whole sequence's shape (no memory)
            b, t, d = hidden.shape
            whole = hidden.new_empty(()).expand(b, t * self.sequence_shards, d)
        cache: Any  # the cache the attention updates (a cp rank's gathers the sequence)
        ring: dict[str, _RingCall] = {}  # a cp rank's ring: the slot for the attention
        cp = self.cp_slot
        if cp is not None:
            layer_type = self.attention_type if self._rotary_by_type else None
            cache, positions, causal = _context_inputs(  # whole: the cp rank's chunks
                cp, self, layer_type, whole, mask, position_ids, self.runs_ring
            )
            if self.runs_ring:
                ring[_RING_KWARG] = _RingCall(cp)
        else:
            cache, mask, positions, causal = _attention_inputs(
                slot, self.config, self.index, _MASKS[self.attention_type], whole, mask,
                position_ids,
            )  # fmt: skip
        if slot is not None:
            layer_type = self.attention_type if self._rotary_by_type else None
            _check_rope(slot.name, self.rotary_emb, layer_type, positions, position_ids, slot.start)
        if self._rotary_by_type:
            rotary = self.rotary_emb(hidden, positions, self.attention_type)
        else:
            rotary = self.rotary_emb(hidden, positions)
        calls: list[Any] = []  # the router's outputs in this call, once each
        handle = None
        if self._routers is not None and self._router_path is not None:
            gate = self.layer.get_submodule(self._router_path)
            keep = partial(_keep_call, calls, self._routers.index, threading.get_ident())
            handle = gate.register_forward_hook(keep)
        try:
            with _saving(cache, _attention_modules(self.layer)):
                out = self.layer(
                    hidden,
                    cache=cache,
                    attention_mask=causal,
                    position_embeddings=rotary,
                    position_ids=positions,
                    **ring,
                )
        finally:
            if handle is not None:
                handle.remove()
        if ring:
            _check_ring(ring[_RING_KWARG], len(self._own_configs))
        stats = x.get("router")
        given = x.get("attention_mask")  # the padding mask as the model's forward was given it
        counting = self.balance is not None and torch.is_grad_enabled()
        for call in calls:
            assert self._routers is not None
            logits = call[self._routers.index]
            if self.router is not None:
                stats = add_routing(stats, logits, given, self.router)
            if self.z_loss:
                add_loss_term(self, Z_TERM, router_z_term(logits, given, self.z_loss))
            if counting:
                assert self.balance is not None
                self.balance.count(call[-1])
        return _boundary(out[0] if isinstance(out, tuple) else out, mask, position_ids, stats)


def _whole_moe_blocks(block: nn.Module, kinds: dict[str, str], layout: LayerLayout) -> dict:
    """``kinds`` with each mixture-of-experts block (the parent of an experts module) run
    whole on the whole sequence under sequence parallelism (``whole_sequence``: its
    experts and router see the same tokens on every tp rank, so their replicated
    parameters get equal gradients); kinds the plan states inside such a block (shared
    experts) are dropped then, as the block takes no sequence shards."""
    if not layout.sequence_parallel:
        return kinds
    blocks = _moe_blocks(block)
    out = {k: v for k, v in kinds.items() if not any(k.startswith(f"{b}.") for b in blocks)}
    return out | dict.fromkeys(blocks, "whole_sequence")


def _moe_blocks(block: nn.Module) -> list[str]:
    """The names of ``block``'s mixture-of-experts blocks: the parents of its experts modules
    (named ``experts`` or of a class named ``...Experts``), outermost only."""
    found = {
        name.rpartition(".")[0]
        for name, m in block.named_modules()
        if "." in name
        and (name.rpartition(".")[2] == "experts" or type(m).__name__.endswith("Experts"))
    }
    return sorted(b for b in found if not any(b.startswith(f"{o}.") for o in found))


def _kv_divisible(layout: LayerLayout, kv: int) -> None:
    """Refuse kv heads that tp neither divides nor is a multiple of: a rank's query heads
    would need parts of several kv heads."""
    if kv % layout.tp:
        raise ValueError(
            f"stage {layout.stage}: {layout.name}.layer.self_attn has num_key_value_heads={kv}, "
            f"which tp={layout.tp} neither divides (each rank its own kv heads) nor is a "
            f"multiple of (each kv head replicated on tp / {kv} ranks, as Megatron does): "
            f"choose a tp that divides {kv} or that {kv} divides, or pass tp_plan="
        )


def _keep_call(
    kept: list[Any], index: int, thread: int, _module: nn.Module, _args: Any, out: Any
) -> None:
    """A router's forward hook: keep its output once per call, of calls on the forward's own
    thread. A module re-run inside its own call (the graph-level B/W split re-runs a router
    with two differentiable outputs) hands the inner call's output to the outer call's hooks
    as well; a W that re-runs the router on another thread meanwhile is not this forward's."""
    if threading.get_ident() == thread and not any(k[index] is out[index] for k in kept):
        kept.append(out)


class BiasBalancedBlock(DecoderBlock):
    """A :class:`DecoderBlock` whose router's ``e_score_correction_bias`` follows
    DeepSeek-V3's auxiliary-loss-free balancing (``causal_lm_layers(..., bias_update=u)``):
    its forwards count the expert loads (:class:`~zerobubble.interop.hf_router.BiasBalance`),
    and after each applied optimizer step the bias moves by ``u * sign(mean load - load)``.
    The trainer drives it as a :class:`~zerobubble.optim.step_state.StepState`.
    """

    def __init__(self, *args: Any, bias_update: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        gate = None if self._router_path is None else self.layer.get_submodule(self._router_path)
        if gate is None or BIAS not in gate._buffers:
            raise ValueError(
                f"decoder layer {self.index}: bias_update={bias_update} moves its router's "
                f"{BIAS} buffer (DeepSeek-V3's balancing), but it has no such router; build "
                "the layers without bias_update"
            )
        where = f"decoder layer {self.index}'s {type(gate).__name__}"
        self.balance = BiasBalance(int(gate.get_buffer(BIAS).numel()), bias_update, where)

    def _bias(self) -> Tensor:
        assert self._router_path is not None  # checked at construction
        return self.layer.get_submodule(self._router_path).get_buffer(BIAS)

    def begin_step(self) -> None:
        """A training step begins: its forwards count the router's expert loads afresh."""
        assert self.balance is not None
        self.balance.begin()

    def end_step(self, reduce: Callable[[Tensor], Tensor]) -> None:
        """The step's loads summed over the dp replicas (``reduce``), kept until committed."""
        assert self.balance is not None
        self.balance.end(reduce)

    def commit_step(self, applied: bool) -> None:
        """The optimizer's step was applied: move the router's bias by DeepSeek-V3's rule;
        skipped: leave it."""
        assert self.balance is not None
        self.balance.commit(self._bias(), applied)


def _router_path(layer: nn.Module, routers: Routers, index: int) -> str | None:
    """Where ``layer``'s router is (None for a dense layer); ValueError for several."""
    found = [n for n, m in layer.named_modules() if isinstance(m, routers.router_class)]
    if len(found) > 1:
        raise ValueError(
            f"decoder layer {index} holds {len(found)} routers ({', '.join(found)}); the "
            "adapter's router loss, z-loss and bias update take one router per layer"
        )
    return found[0] if found else None


class DecoderHead(HFLayer):
    """Final norm and the LM head (tied to ``embed_tokens`` if the model ties them).

    With a router loss (a mixture of experts built with ``output_router_logits=True``) it
    adds ``router_aux_loss_coef`` times the load-balancing loss of the blocks' statistics
    as the loss term ``"router_aux"`` (:mod:`~zerobubble.interop.hf_router`).

    Then what some causal LMs do to the logits in their forward, in the same order:
    multiply by ``logit_scale`` (Cohere), soft-cap to ``(-softcap, softcap)`` with
    ``tanh`` (Gemma-2, ``config.final_logit_softcapping``). The adapter's check
    tells whether a model does what its config says.
    """

    norm: nn.Module
    lm_head: nn.Module

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Module,
        *,
        logit_scale: float | None = None,
        softcap: float | None = None,
        router: RouterLoss | None = None,
    ) -> None:
        super().__init__({"norm": ("model.norm", norm), "lm_head": ("lm_head", lm_head)})
        self.logit_scale = logit_scale
        self.softcap = softcap
        self.router = router
        """The model's router loss: added as the loss term ``"router_aux"`` (None: none)."""

    def tp_kinds(self, layout: LayerLayout) -> dict[str, str]:
        """Tensor parallelism (:mod:`~zerobubble.parallel.tp`): the LM head column-wise, its
        logits left sharded over the vocabulary for a loss-parallel loss
        (``layout.loss_parallel``; ``logit_scale`` and the soft cap are elementwise) and
        gathered otherwise; the norm on sequence shards with sequence parallelism."""
        norm = {"norm": "sequence_parallel"} if layout.sequence_parallel else {}
        return {"lm_head": layout.lm_head()} | norm

    def forward(self, x: Boundary) -> Tensor:
        hidden, _, _ = _unpack(type(self).__name__, x)
        stats = x.get("router")
        if self.router is not None and stats is not None:
            add_loss_term(self, ROUTER_TERM, router_term(stats, self.router))
        logits = self.lm_head(self.norm(hidden))
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
