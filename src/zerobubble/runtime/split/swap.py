"""Swapping a module's layers for their B/W-split versions, in place, by rules.

A :class:`SplitRules` is an ordered, immutable list of :class:`SplitRule`; the
first rule whose ``matches`` accepts a module decides its split. The default
rules cover ``nn.Linear``, ``nn.Embedding``, ``nn.Conv1d/2d/3d``,
``nn.LayerNorm`` and ``transformers``' ``Conv1D``. A
:class:`~zerobubble.runtime.split.grouped.SplitGrouped` module (grouped experts) splits
itself: it is only bound to the store. A user gives their own
one-op layer a split with :meth:`SplitRules.with_rule` and a
:class:`~zerobubble.runtime.split.kernels.Kernel`, and passes the rules to
:func:`enable_bw_split` (or ``StageChunk(split_rules=...)``); nothing is
registered process-wide.

Any other module that owns parameters, and whose subtree has no rule-split
layer, gets the graph-level split of :mod:`~zerobubble.runtime.split.fallback`
(unless ``fallback=False``). A layer whose forward lets a tensor computed inside one
of its submodules escape that submodule's output (a router's logits that a loss term
reads) names such submodules in an ``unsplit_submodules()`` method: the fallback
leaves them, and every module around them, on plain autograd, since a graph-level
split would differentiate only the module's output and drop the escaped tensor's
gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from zerobubble.runtime.split.fallback import GraphSplit, install_graph_split
from zerobubble.runtime.split.grouped import SplitGrouped
from zerobubble.runtime.split.kernels import (
    CONV,
    HF_CONV1D,
    LAYER_NORM,
    Kernel,
    SplitEmbedding,
    SplitLinear,
    SplitOp,
    conv_splittable,
    is_hf_conv1d,
)
from zerobubble.runtime.split.store import WeightGradStore

__all__ = [
    "SplitRule",
    "SplitRules",
    "SplitShare",
    "SplitShareWarning",
    "enable_bw_split",
    "is_split",
    "split_share",
    "unsplit_modules",
]

Splitter = Callable[[nn.Module, WeightGradStore], nn.Module]


@dataclass(frozen=True)
class SplitRule:
    """``matches(module)`` decides; ``split(module, store)`` builds the replacement.

    ``split=None`` keeps the module on plain autograd on purpose (its gradients
    are produced in B, and the graph-level fallback leaves it alone).
    """

    name: str
    matches: Callable[[nn.Module], bool]
    split: Splitter | None


def _kernel_rule(name: str, matches: Callable[[nn.Module], bool], kernel: Kernel) -> SplitRule:
    return SplitRule(name, matches, lambda m, store: SplitOp(m, kernel, store))


def _split_linear(m: nn.Module, store: WeightGradStore) -> nn.Module:
    assert isinstance(m, nn.Linear)  # the rule matches exact nn.Linear only
    return SplitLinear.from_linear(m, store)


def _split_embedding(m: nn.Module, store: WeightGradStore) -> nn.Module:
    assert isinstance(m, nn.Embedding)  # the rule matches exact nn.Embedding only
    return SplitEmbedding(m, store)


def _exact(cls: type[nn.Module]) -> Callable[[nn.Module], bool]:
    # Exact types only: subclasses may override forward, and modules such as
    # nn.MultiheadAttention read their Linear's weights without calling it.
    return lambda m: type(m) is cls


_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _norm(m: nn.Module) -> bool:
    # Not worth splitting by default: a norm's weight gradient is one pass over
    # the tokens, like its input gradient, while deferring it keeps the norm's
    # input and output gradient alive until W (and the graph-level split would
    # recompute it in W). Opt in with LAYER_NORM. User norms are known by name
    # (LlamaRMSNorm, T5LayerNorm, ...).
    return type(m) in _NORMS or type(m).__name__.endswith("Norm")


def _layer_norm(m: nn.Module) -> bool:
    return type(m) is nn.LayerNorm and m.weight is not None


@dataclass(frozen=True)
class SplitRules:
    """Ordered split rules; the first match wins."""

    rules: tuple[SplitRule, ...]

    @classmethod
    def default(cls) -> SplitRules:
        return cls(
            (
                SplitRule("Linear", _exact(nn.Linear), _split_linear),
                SplitRule("Embedding", _exact(nn.Embedding), _split_embedding),
                _kernel_rule("Conv", conv_splittable, CONV),
                _kernel_rule("transformers Conv1D", is_hf_conv1d, HF_CONV1D),
                SplitRule("norm (kept in B)", _norm, None),
            )
        )

    def with_layer_norm(self) -> SplitRules:
        """These rules with ``nn.LayerNorm``'s weight and bias deferred to W too."""
        return self.with_rule(_layer_norm, LAYER_NORM, "LayerNorm")

    def with_rule(
        self,
        matches: type[nn.Module] | Callable[[nn.Module], bool],
        split: Kernel | Splitter | None,
        name: str | None = None,
    ) -> SplitRules:
        """These rules with one more in front: ``matches`` an exact type or a predicate;
        ``split`` a :class:`Kernel` (the layer becomes a ``SplitOp``), a function
        ``(module, store) -> replacement`` that records its calls in
        ``store.recording``, or None (keep the module on plain autograd)."""
        pred = _exact(matches) if isinstance(matches, type) else matches
        label = name or (matches.__name__ if isinstance(matches, type) else "user rule")
        rule = (
            _kernel_rule(label, pred, split)
            if isinstance(split, Kernel)
            else SplitRule(label, pred, split)
        )
        return SplitRules((rule, *self.rules))

    def rule_for(self, module: nn.Module) -> SplitRule | None:
        """The first rule that matches ``module``, or None."""
        return next((r for r in self.rules if r.matches(module)), None)


_SPLIT_TYPES = (SplitLinear, SplitEmbedding, SplitOp, SplitGrouped)
"""Modules that defer their weight gradients themselves; a :class:`SplitGrouped` (grouped
experts) is one by construction, and :func:`enable_bw_split` only binds it to the store."""


def is_split(module: nn.Module) -> bool:
    """True if ``module`` or a submodule defers weight gradients to a store."""
    return any(
        isinstance(m, _SPLIT_TYPES) or GraphSplit.of(m) is not None for m in module.modules()
    )


def _deferring(m: nn.Module) -> bool:
    """``m`` defers its weight gradients: a split layer, or a graph-level split whose
    recorded calls so far returned at most one differentiable output."""
    if isinstance(m, _SPLIT_TYPES):
        return True
    graph = GraphSplit.of(m)
    return graph is not None and graph.outputs_seen <= 1


def unsplit_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules whose own parameters get their gradients in B (named as in ``module``);
    a graph-level split counts here once a call of it returned several differentiable
    outputs."""
    covered: set[int] = set()
    for m in module.modules():
        if _deferring(m):
            covered.update(id(mm) for mm in m.modules())
    return [
        (name or type(module).__name__, m)
        for name, m in module.named_modules()
        if id(m) not in covered and any(p.requires_grad for p in m.parameters(recurse=False))
    ]


def enable_bw_split(
    module: nn.Module,
    store: WeightGradStore,
    rules: SplitRules | None = None,
    *,
    fallback: bool = True,
) -> nn.Module:
    """Swap the layers of ``module`` that a rule matches for their split versions, in place.

    The swapped layers keep the original Parameter objects and state_dict keys;
    a module shared at several places is replaced by one shared split module;
    the forward (pre-)hooks of a swapped module move to its replacement (tensor
    parallelism's input and output redistribution lives there). With ``fallback``,
    each remaining module that owns parameters and has no rule-split layer
    below it gets the graph-level split (its hooks are added, nothing is
    swapped); a module with both (e.g. a model holding a positional-embedding
    Parameter next to Linear layers) keeps plain autograd for its own
    parameters: their gradients are produced during B, and
    :class:`~zerobubble.runtime.stage.StageChunk` still adds them to ``.grad``
    in microbatch order.

    Returns ``module``, or its split replacement if a rule matches ``module`` itself.
    """
    rules = SplitRules.default() if rules is None else rules
    replaced: dict[int, nn.Module] = {}

    def swap(m: nn.Module) -> nn.Module | None:
        if id(m) not in replaced:
            if isinstance(m, _SPLIT_TYPES):
                m.store = store  # re-split: bind to the new store
                new = None
            else:
                rule = rules.rule_for(m)
                new = None if rule is None or rule.split is None else rule.split(m, store)
                if new is not None:
                    _move_hooks(m, new)
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
    if fallback:
        _install_fallbacks(module, store, rules)
    return module


def _move_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the forward hooks and pre-hooks of ``old`` (which it replaces), in order,
    with their keyword-argument flags: DTensor's parallel styles redistribute a layer's
    input and output in such hooks."""
    new._forward_pre_hooks.update(old._forward_pre_hooks)
    new._forward_pre_hooks_with_kwargs.update(old._forward_pre_hooks_with_kwargs)
    new._forward_hooks.update(old._forward_hooks)
    new._forward_hooks_with_kwargs.update(old._forward_hooks_with_kwargs)
    new._forward_hooks_always_called.update(old._forward_hooks_always_called)


def _install_fallbacks(module: nn.Module, store: WeightGradStore, rules: SplitRules) -> None:
    """Graph-split the outermost modules that own parameters and contain no split layer
    and no submodule a layer keeps unsplit (``unsplit_submodules()``)."""
    has_split: dict[int, bool] = {}
    kept = {
        id(k)
        for m in module.modules()
        if callable(unsplit := getattr(type(m), "unsplit_submodules", None))
        for k in unsplit(m)
    }

    def contains_split(m: nn.Module) -> bool:
        if id(m) not in has_split:
            has_split[id(m)] = isinstance(m, _SPLIT_TYPES) or any(
                contains_split(c) for c in m.children()
            )
        return has_split[id(m)]

    def visit(m: nn.Module) -> None:
        rule = rules.rule_for(m)
        if isinstance(m, _SPLIT_TYPES) or (rule is not None and rule.split is None):
            return
        if id(m) in kept:
            return
        holds_kept = any(id(k) in kept for k in m.modules())
        if not (contains_split(m) or holds_kept) and any(p.requires_grad for p in m.parameters()):
            install_graph_split(m, store)
            return
        for c in m.children():
            visit(c)

    visit(module)


@dataclass(frozen=True)
class SplitShare:
    """How much of a module's weight-gradient work its split defers to W.

    Work is counted by parameter size: a weight element costs one multiply-add
    per token in its gradient for every matmul-like layer, so the share of
    deferred parameters is the share of deferred weight-gradient work.
    """

    deferred: int
    """Elements of the parameters whose gradients W computes."""
    total: int
    """Elements of all parameters that need a gradient."""
    unsplit: tuple[tuple[str, str, int], ...]
    """``(name, type, elements)`` of each module whose own parameters get gradients in B."""
    several_outputs: tuple[str, ...] = ()
    """Names among ``unsplit`` of graph-level splits that fell back to B because a call
    returned several differentiable outputs."""

    @property
    def fraction(self) -> float:
        return self.deferred / self.total if self.total else 1.0

    def warning(self, stage: int) -> str | None:
        """The message to warn with if less than half the work is deferred, else None."""
        if self.fraction >= 0.5:
            return None
        names = ", ".join(f"{n} ({t})" for n, t, _ in self.unsplit[:8])
        more = f" and {len(self.unsplit) - 8} more" if len(self.unsplit) > 8 else ""
        several = (
            f" (the graph-level split of {', '.join(self.several_outputs)} fell back to B: a "
            "call returned several differentiable outputs, and it defers single outputs only)"
            if self.several_outputs
            else ""
        )
        return (
            f"stage {stage}: only {100 * self.fraction:.0f}% of the weight-gradient work "
            f"(by parameter size) is deferred to W, so a zero-bubble schedule has little to "
            f"fill its bubbles with. Not split: {names}{more}{several}. Fix: give these layers "
            "a split rule (SplitRules.default().with_rule(...), passed as "
            "StageChunk(split_rules=...)), keep enable_bw_split's graph-level fallback on, or "
            "use a schedule without B/W split (1f1b)"
        )


class SplitShareWarning(UserWarning):
    """A split stage defers less than half of its weight-gradient work to W
    (:meth:`SplitShare.warning`): a category of its own, so that code splitting single
    layers on purpose (the layer profiler) can silence it alone."""


def split_share(module: nn.Module) -> SplitShare:
    """Deferred and total parameter elements of a split ``module`` (see :class:`SplitShare`)."""
    unsplit = tuple(
        (name, type(m).__name__, sum(p.numel() for p in m.parameters(recurse=False)))
        for name, m in unsplit_modules(module)
    )
    total = sum(p.numel() for p in module.parameters() if p.requires_grad)
    kept = sum(n for _, _, n in unsplit)
    several = tuple(
        name or type(module).__name__
        for name, m in module.named_modules()
        if (graph := GraphSplit.of(m)) is not None and graph.outputs_seen > 1
    )
    return SplitShare(total - kept, total, unsplit, several)
