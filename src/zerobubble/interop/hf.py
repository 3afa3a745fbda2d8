"""Hugging Face causal LMs as pipeline layers (``transformers`` is optional, imported lazily).

:func:`causal_lm_layers` turns a ``transformers`` causal LM of the GPT-2 layout
(``transformer.{wte, wpe, h, ln_f}``, ``lm_head``) or of the Llama layout
(``model.{embed_tokens, layers, norm, rotary_emb}``, ``lm_head``: Llama,
Mistral, Qwen2, ...) into the ordered layers a
:class:`~zerobubble.pipeline.Pipeline` takes: the embedding, one layer per
decoder block, the final norm with the head. The layout is recognised by
structure, not by class name, and every result is checked once against the
model's own forward, so a model whose forward does something the layout does
not (scaled embeddings, soft-capped logits, ...) is refused instead of being
trained wrongly. :class:`CausalLMLoss` is the model's own shifted cross-entropy,
normalised by the token count of the whole batch when given it. See docs/hf.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any

import torch
from torch import Tensor, nn

from zerobubble.interop.hf_router import (
    BIAS,
    ROUTER_TERM,
    Z_TERM,
    family,
    router_loss_of,
    router_z_term,
    routers_of,
)
from zerobubble.parallel.loss import cross_entropy, is_vocab_sharded
from zerobubble.runtime.loss_terms import collect_loss_terms

__all__ = [
    "TINY_BIAS_MOE_CONFIGS",
    "TINY_CE_MOE_CONFIGS",
    "TINY_CONFIGS",
    "TINY_MOE_CONFIGS",
    "CausalLMLoss",
    "causal_lm_layers",
    "check_layers",
    "count_tokens",
    "tiny_config",
    "tiny_model",
]

#: The tiny configs shipped in ``zerobubble/models/configs`` (``<name>-tiny.json``).
TINY_CONFIGS = ("hf-gpt2", "hf-llama", "hf-mistral", "hf-qwen2")

#: The tiny mixtures of experts shipped there too, built with ``output_router_logits``: their
#: loss adds the router loss (a loss term of the layers, not :class:`CausalLMLoss`'s).
TINY_MOE_CONFIGS = ("hf-mixtral", "hf-qwen3-moe")

#: A tiny DeepSeek-V3 (shared and routed experts, sigmoid routing balanced by a bias, not a
#: loss): its loss is cross-entropy alone.
TINY_BIAS_MOE_CONFIGS = ("hf-deepseek-v3",)

#: Tiny mixtures of experts built with ``output_router_logits=False`` (their loss is
#: cross-entropy alone), for expert parallelism across families: OLMoE, Qwen2-MoE (a gated
#: shared expert) and GPT-OSS (transposed expert weights with biases, an interleaved clamped
#: gate, sliding-window layers, attention sinks).
TINY_CE_MOE_CONFIGS = ("hf-olmoe", "hf-qwen2-moe", "hf-gpt-oss")

_PROBE_BATCH, _PROBE_LENGTH, _PROBE_PADS, _PROBE_WINDOW = 2, 7, 2, 3


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "zerobubble.interop.hf needs Hugging Face transformers: pip install transformers"
        ) from e
    return transformers


# ---- layers -----------------------------------------------------------------------------------


def _part(model: nn.Module, name: str, names: tuple[str, ...]) -> nn.Module | None:
    """``model.<name>`` if it is a submodule with all of ``names``, else None."""
    part = getattr(model, name, None)
    if isinstance(part, nn.Module) and all(hasattr(part, n) for n in names):
        return part
    return None


def _hf_attr(model: nn.Module, name: str) -> Any:
    """An attribute of a transformers model that is no submodule (its config, its loss).

    ``nn.Module.__getattr__`` types every attribute as ``Tensor | Module``; these are
    neither, and their classes depend on the model.
    """
    return getattr(model, name)


def _blocks(owner: nn.Module, name: str) -> list[nn.Module]:
    """The decoder blocks ``owner.<name>``, which the layouts hold in a ModuleList."""
    blocks = owner.get_submodule(name)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(
            f"{type(owner).__name__}.{name} is a {type(blocks).__name__}, not the ModuleList of "
            "decoder blocks the layout has; cut the model into layers by hand"
        )
    return list(blocks)


def _attention_type(config: Any, index: int) -> str:
    """Which of the model's masks layer ``index`` gets, as the model's forward chooses it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return layer_types[index]
    if getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _number(value: Any) -> float | None:
    """A plain number the model's forward applies to its logits, else None (a tensor or
    module would be a parameter: then the check refuses the model)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _build(model: nn.Module, z_loss: float = 0.0, bias_update: float = 0.0) -> list[nn.Module]:
    from zerobubble.interop import hf_layers

    name = type(model).__name__
    head = getattr(model, "lm_head", None)
    transformer = _part(model, "transformer", ("wte", "wpe", "drop", "h", "ln_f"))
    decoder = _part(model, "model", ("embed_tokens", "layers", "norm", "rotary_emb"))
    config = _hf_attr(model, "config")
    if isinstance(head, nn.Module) and transformer is not None:
        if router_loss_of(model) is not None:
            raise ValueError(f"{name}: a router loss in the GPT-2 layout is not supported")
        if getattr(config, "add_cross_attention", False):
            raise ValueError(
                f"{name} has cross-attention (config.add_cross_attention): the adapter takes "
                "decoder-only causal LMs; build the model without it"
            )
        if z_loss or bias_update:
            raise ValueError(f"{name}: router_z_loss / bias_update need a mixture of experts")
        return [
            hf_layers.GPT2Embedding(transformer),
            *(hf_layers.GPT2Block(config, b, i) for i, b in enumerate(_blocks(transformer, "h"))),
            hf_layers.GPT2Head(transformer, head),
        ]
    if isinstance(head, nn.Module) and decoder is not None:
        rotary_emb = getattr(decoder, "rotary_emb", None)
        if not isinstance(rotary_emb, nn.Module):
            raise ValueError(
                f"{family(model)} has no rotary embedding (model.rotary_emb is "
                f"{rotary_emb!r}, config.position_embedding_type="
                f"{getattr(config, 'position_embedding_type', None)!r}): the adapter's Llama "
                "layout gives every block its rotary positions; build the model with rotary "
                "positions (e.g. position_embedding_type='rope'), or cut it into layers by hand"
            )
        blocks = _blocks(decoder, "layers")[: config.num_hidden_layers]
        router = router_loss_of(model)
        routers = routers_of(model)
        if bias_update and not any(_has_bias(b) for b in blocks):
            raise ValueError(
                f"{family(model)}: bias_update={bias_update} moves the routers' "
                f"{BIAS} (DeepSeek-V3's balancing), but no block has a router with one; build "
                "the layers without bias_update"
            )
        layers: list[nn.Module] = []
        try:
            for i, b in enumerate(blocks):
                args = (config, b, rotary_emb, i, _attention_type(config, i))
                kw: dict[str, Any] = {"router": router, "z_loss": z_loss}
                block: hf_layers.DecoderBlock
                if bias_update and _has_bias(b):
                    block = hf_layers.BiasBalancedBlock(
                        *args, bias_update=bias_update, routers=routers, **kw
                    )
                else:  # the routers only where a z-loss needs their logits
                    block = hf_layers.DecoderBlock(*args, routers=routers if z_loss else None, **kw)
                layers.append(block)
        except ValueError as e:
            raise ValueError(f"{family(model)}: {e}") from None
        return [
            hf_layers.DecoderEmbedding(decoder.get_submodule("embed_tokens")),
            *layers,
            hf_layers.DecoderHead(
                decoder.get_submodule("norm"),
                head,
                logit_scale=_number(getattr(model, "logit_scale", None)),
                softcap=_number(getattr(config, "final_logit_softcapping", None)),
                router=router,
            ),
        ]
    raise ValueError(
        f"{name} has neither the GPT-2 layout (transformer.wte/wpe/drop/h/ln_f and lm_head) nor "
        "the Llama layout (model.embed_tokens/layers/norm/rotary_emb and lm_head); pass a causal "
        "LM of one of them (e.g. AutoModelForCausalLM.from_config), or cut the model into layers "
        "by hand"
    )


def _has_bias(block: nn.Module) -> bool:
    """Whether a decoder block holds a bias-balanced router (DeepSeek-V3's)."""
    return any(BIAS in m._buffers for m in block.modules())


@contextmanager
def _kept_modes(model: nn.Module) -> Iterator[None]:
    """Every submodule's train/eval mode restored afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _forked_rng(device: torch.device) -> Any:
    """The generators of ``device`` (and the CPU's) saved and restored around a block."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


@contextmanager
def _short_window(config: Any) -> Iterator[None]:
    """A sliding window shorter than the probe, so the check sees which layers slide.

    Model and layers read ``config.sliding_window`` when they build masks; it is
    restored afterwards.
    """
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= _PROBE_WINDOW:
        yield
        return
    config.sliding_window = _PROBE_WINDOW
    try:
        yield
    finally:
        config.sliding_window = window


def _probe(model: nn.Module) -> dict[str, Tensor]:
    """A small right-padded batch (every query sees a real token, so no row is all masked)."""
    config = _hf_attr(model, "config")
    vocab = config.vocab_size
    length = min(_PROBE_LENGTH, getattr(config, "max_position_embeddings", _PROBE_LENGTH))
    n = _PROBE_BATCH * length
    ids = (torch.arange(n).view(_PROBE_BATCH, length) * 7919 + 11) % vocab
    mask = torch.ones(_PROBE_BATCH, length, dtype=torch.long)
    mask[-1, length - min(_PROBE_PADS, length - 1) :] = 0
    device = next(model.parameters()).device
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def check_layers(model: nn.Module, layers: list[nn.Module]) -> None:
    """Raise ValueError unless chaining ``layers`` gives ``model``'s own logits, bitwise.

    Runs both on a small padded batch without gradients, in eval mode and in train
    mode from the same seed (so a dropout the layers miss or add shows), drawing
    nothing from the caller's RNG and restoring every submodule's mode; a sliding
    window is shortened below the batch's length meanwhile, so the check also sees
    which layers slide. Also for layers cut by hand (the first takes the tokenizer-style
    mapping ``{"input_ids", "attention_mask"}``, the last returns the logits). The loss
    terms the layers add (:mod:`~zerobubble.runtime.loss_terms`) must be the model's own:
    ``"router_aux"``, bitwise ``router_aux_loss_coef * aux_loss``, where its loss adds a
    router loss, else none.
    """
    batch = _probe(model)
    name = type(model).__name__
    rng = _forked_rng(batch["input_ids"].device)
    coefs = [getattr(b, "z_loss", 0.0) for b in layers]  # the blocks' router z-loss
    z_loss = next((c for c in coefs if isinstance(c, float) and c), 0.0)
    with _kept_modes(model), _short_window(_hf_attr(model, "config")), torch.no_grad(), rng:
        for training in (False, True):
            model.train(training)
            torch.manual_seed(0)
            with _router_logits(model, z_loss) as logits:
                own = model(**batch)  # as training calls it: the config's use_cache
            expected = own.logits
            torch.manual_seed(0)
            try:
                x: Any = batch
                with collect_loss_terms(*layers) as terms:
                    for layer in layers:
                        x = layer(x)
            except Exception as e:
                raise ValueError(
                    f"{name}: its modules have the expected layout but are not called the way "
                    f"the adapter calls them ({type(e).__name__}: {e}); cut this model into "
                    "layers by hand"
                ) from e
            if not (isinstance(x, Tensor) and x.shape == expected.shape):
                raise ValueError(
                    f"{name}: the last layer returns {type(x).__name__} "
                    f"{tuple(getattr(x, 'shape', ()))}, not the model's logits "
                    f"{tuple(expected.shape)}"
                )
            if not torch.equal(x, expected):
                mode = "train mode (dropout on)" if training else "eval mode"
                raise ValueError(
                    f"{name}: the layers cut from it do not reproduce its own logits in {mode} "
                    f"(max |difference| {(x - expected).abs().max().item():.3g}): its forward "
                    f"does something the {type(layers[1]).__name__} layout does not (e.g. "
                    "scaled embeddings or logits, another dropout, extra inputs); cut this model "
                    "into layers by hand"
                )
            _check_terms(name, _own_terms(model, own, logits, batch, z_loss), terms)


@contextmanager
def _router_logits(model: nn.Module, z_loss: float) -> Iterator[list[Tensor]]:
    """The logits of every router call of ``model``'s forward in the block, in call order
    (nothing without a z-loss)."""
    kept: list[Tensor] = []
    routers = routers_of(model) if z_loss else None
    handles = []
    if routers is not None:
        index = routers.index
        for m in model.modules():
            if isinstance(m, routers.router_class):
                handles.append(m.register_forward_hook(lambda _m, _a, out: kept.append(out[index])))
    try:
        yield kept
    finally:
        for h in handles:
            h.remove()


def _own_terms(
    model: nn.Module, own: Any, logits: list[Tensor], batch: dict[str, Tensor], z_loss: float
) -> dict[str, Tensor]:
    """The terms the layers must add: the router loss the model's forward added (its
    coefficient times ``aux_loss``), and the z-loss of its routers' ``logits`` (summed in
    layer order, as the layers' terms are)."""
    router = router_loss_of(model)
    out = {} if router is None else {ROUTER_TERM: router.coef * own.aux_loss}
    if z_loss and logits:
        mask = batch["attention_mask"].to(torch.bool)
        parts = [router_z_term(t, mask, z_loss) for t in logits]
        out[Z_TERM] = sum(parts[1:], parts[0])
    return out


def _check_terms(name: str, expected: dict[str, Tensor], terms: dict[str, Tensor]) -> None:
    """The layers' loss terms are the model's own (its router loss, bitwise, or none) and the
    adapter's z-loss of the model's router logits."""
    if terms.keys() != expected.keys():
        raise ValueError(
            f"{name}: the layers add the loss terms {sorted(terms)} but the model's loss adds "
            f"{sorted(expected)}; cut this model into layers by hand"
        )
    for term, value in expected.items():
        if not torch.equal(terms[term], value):
            raise ValueError(
                f"{name}: the layers' loss term {term!r} ({terms[term].item():.6g}) is not the "
                f"model's own ({value.item():.6g}); cut this model into layers by hand"
            )


def causal_lm_layers(
    model: nn.Module,
    *,
    check: bool = True,
    router_z_loss: float = 0.0,
    bias_update: float = 0.0,
) -> list[nn.Module]:
    """The ordered pipeline layers of a Hugging Face causal LM.

    ``[embedding, block_0, ..., block_{L-1}, head]``. The layers hold the model's own
    submodules (a tied head shares the embedding's Parameter object), so pass them to
    :class:`~zerobubble.pipeline.Pipeline`, which copies them. The first layer takes
    ``input_ids`` with optional ``attention_mask`` and ``position_ids`` keywords (and
    ``token_type_ids`` for GPT-2), or one mapping of them as a tokenizer returns it; the
    head returns the logits, for :class:`CausalLMLoss`. Parameters and buffers are
    named as in the model (``layer.source_name``).

    ``check``: :func:`check_layers` (one forward of the model and of the layers on a
    small batch). Dropout stays as the model configures it. A mixture of experts built
    with ``config.output_router_logits=True`` (Mixtral, Qwen3-MoE) adds its router loss:
    the blocks carry the routers' statistics and the head adds ``router_aux_loss_coef``
    times the load-balancing loss as the loss term ``"router_aux"``
    (:mod:`~zerobubble.interop.hf_router`), so a pipeline trains the model's own loss; a
    router loss of another form is refused, with or without the check, and so is
    ``output_router_logits=True`` on a family whose loss adds none (DeepSeek-V3, Llama4).

    Two options of the adapter's own for mixtures of experts (the routers the model records
    ``router_logits`` of): ``router_z_loss`` adds, per MoE block, ST-MoE's router z-loss
    ``router_z_loss * mean over tokens of logsumexp(logits) ** 2`` as the term
    ``"router_z"``; ``bias_update`` (a rate ``u > 0``) updates every router's
    ``e_score_correction_bias`` after each applied optimizer step by DeepSeek-V3's rule,
    ``+= u * sign(mean load - load_e)`` over the step's expert loads (all microbatches, all
    dp replicas), through :class:`~zerobubble.optim.step_state.StepState` (docs/moe.md).
    """
    _transformers()
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise ValueError(
            f"expected a transformers PreTrainedModel (a causal LM), got {type(model).__name__}"
        )
    for what, value in (("router_z_loss", router_z_loss), ("bias_update", bias_update)):
        if not value >= 0:
            raise ValueError(f"{what}={value} must be >= 0 (0: off)")
    router_loss_of(model)  # refuses a router loss the layers cannot carry
    layers = _build(model, router_z_loss, bias_update)
    if check:
        check_layers(model, layers)
    return layers


# ---- loss -------------------------------------------------------------------------------------


def count_tokens(labels: Tensor, ignore_index: int = -100) -> int:
    """The tokens a causal-LM loss averages over: shifted labels that are not ignored.

    Position ``t`` predicts label ``t + 1``, so the first label of every row is never a
    target. Pass the count of the whole batch as ``num_items_in_batch``.
    """
    return int((labels[..., 1:] != ignore_index).sum())


class CausalLMLoss:
    """The model's own causal-LM loss, ``loss_fn(logits, labels, num_items_in_batch=None)``.

    Labels are shifted inside (as in ``model(..., labels=labels)``); ``ignore_index``
    positions (padding: label -100) are left out. Without ``num_items_in_batch`` the
    loss is the mean over this call's tokens, as the model computes it. With it (the
    :func:`count_tokens` of the whole batch) the loss is the sum over this call's
    tokens divided by that count, so the microbatches' losses add up to the batch
    mean and their gradients to the batch's, as with Hugging Face's
    ``num_items_in_batch``.

    A :class:`~zerobubble.pipeline.Pipeline` (or :func:`~zerobubble.reference_step`)
    given this loss and no ``count_fn`` uses :meth:`count_fn`, so it trains Hugging
    Face's normalisation (the mean over the batch's tokens), not a mean of per-row
    means weighted by rows.

    Under tensor parallelism it takes the logits sharded over the vocabulary (loss
    parallel: :attr:`loss_parallel`) where the model's loss is ``transformers``'
    ``ForCausalLMLoss``: the same labels (padded with ``ignore_index``, shifted), the same
    reduction and division, on :func:`~zerobubble.parallel.loss.cross_entropy`. A model
    with another loss gets the gathered logits and its own loss.
    """

    shifts_labels = True
    """Position ``t`` is scored against label ``t + 1`` of the same call: a sequence cut into
    segments would lose each segment's last target (a segment schedule refuses it)."""

    def __init__(self, model: nn.Module, ignore_index: int = -100) -> None:
        router_loss_of(model)  # refuses a router loss the layers cannot carry
        self._loss: Callable[..., Tensor] = _hf_attr(model, "loss_function")
        self.vocab_size: int = _hf_attr(model, "config").vocab_size
        self.ignore_index = ignore_index
        self.loss_parallel = self._loss is _causal_lm_loss()
        """Takes vocabulary-sharded logits (:mod:`~zerobubble.parallel.loss`): the model's
        loss is ``ForCausalLMLoss``, whose arithmetic :meth:`__call__` restates on them."""

    def count_fn(self, labels: Tensor) -> int:
        """The whole batch's count that Hugging Face normalises by: :func:`count_tokens`."""
        return count_tokens(labels, self.ignore_index)

    def __call__(
        self, logits: Tensor, labels: Tensor, num_items_in_batch: int | Tensor | None = None
    ) -> Tensor:
        if not isinstance(labels, Tensor) or labels.shape != logits.shape[:-1]:
            raise ValueError(
                f"labels must be a tensor of shape {tuple(logits.shape[:-1])} (the logits' batch "
                f"and sequence), got {getattr(labels, 'shape', type(labels).__name__)}"
            )
        if num_items_in_batch is not None and int(num_items_in_batch) <= 0:
            raise ValueError(
                f"num_items_in_batch must be positive (count_tokens of the whole batch), got "
                f"{int(num_items_in_batch)}"
            )
        if is_vocab_sharded(logits) and self.loss_parallel:
            return self._sharded(logits, labels, num_items_in_batch)
        return self._loss(
            logits,
            labels,
            vocab_size=self.vocab_size,
            num_items_in_batch=num_items_in_batch,
            ignore_index=self.ignore_index,
        )

    def _sharded(self, logits: Tensor, labels: Tensor, num_items: int | Tensor | None) -> Tensor:
        """``ForCausalLMLoss`` on vocabulary-sharded logits: float32, the labels padded with
        ``ignore_index`` and shifted by one, the sum over ``num_items`` or the mean."""
        labels = nn.functional.pad(labels, (0, 1), value=self.ignore_index)[..., 1:]
        reduction = "mean" if num_items is None else "sum"
        loss = cross_entropy(
            logits.float(), labels, ignore_index=self.ignore_index, reduction=reduction
        )
        if num_items is None:
            return loss
        if isinstance(num_items, Tensor):
            num_items = num_items.to(loss.device)
        return loss / num_items


def _causal_lm_loss() -> Callable[..., Tensor]:
    """``transformers``' ``ForCausalLMLoss``, the loss :class:`CausalLMLoss` restates under
    loss parallel."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


# ---- tiny configs -----------------------------------------------------------------------------


def tiny_config(name: str, **overrides: Any) -> Any:
    """The ``transformers`` config of a shipped tiny model (one of :data:`TINY_CONFIGS`,
    :data:`TINY_MOE_CONFIGS`, :data:`TINY_BIAS_MOE_CONFIGS` or :data:`TINY_CE_MOE_CONFIGS`).

    ``overrides`` replace config fields (e.g. ``attn_implementation="eager"``,
    ``num_hidden_layers=6``).
    """
    names = TINY_CONFIGS + TINY_MOE_CONFIGS + TINY_BIAS_MOE_CONFIGS + TINY_CE_MOE_CONFIGS
    if name not in names:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(names)}")
    # The package data of zerobubble/models, read as files (importing that package, a room of
    # its own, is no business of the adapter's).
    shipped = resources.files("zerobubble").joinpath(f"models/configs/{name}-tiny.json")
    text = shipped.read_text()
    fields: dict[str, Any] = {**json.loads(text), **overrides}
    model_type = fields.pop("model_type")
    return _transformers().AutoConfig.for_model(model_type, **fields)


def tiny_model(name: str, *, seed: int = 0, **overrides: Any) -> nn.Module:
    """A freshly initialised tiny causal LM from a shipped config (never downloads).

    The initialisation depends only on ``seed`` (the global RNG is left as it was).
    """
    config = tiny_config(name, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _transformers().AutoModelForCausalLM.from_config(config)
