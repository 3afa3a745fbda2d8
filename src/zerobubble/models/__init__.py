"""Small models built as ordered lists of layers (nn.Sequential), ready to be cut into stages."""

from zerobubble.models.corpus import stdlib_corpus
from zerobubble.models.gpt import GPTConfig, build_gpt, gpt_loss
from zerobubble.models.mlp import build_mlp, mlp_loss
from zerobubble.models.moe import MoE, MoEBlock, build_moe_gpt, build_moe_mlp

__all__ = [
    "GPTConfig",
    "MoE",
    "MoEBlock",
    "build_gpt",
    "build_mlp",
    "build_moe_gpt",
    "build_moe_mlp",
    "gpt_loss",
    "mlp_loss",
    "stdlib_corpus",
]
