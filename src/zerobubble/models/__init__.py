"""Small models built as ordered lists of layers (nn.Sequential), ready to be cut into stages."""

from zerobubble.models.corpus import stdlib_corpus
from zerobubble.models.gpt import GPTConfig, build_gpt, gpt_loss
from zerobubble.models.mlp import build_mlp, mlp_loss

__all__ = ["GPTConfig", "build_gpt", "build_mlp", "gpt_loss", "mlp_loss", "stdlib_corpus"]
