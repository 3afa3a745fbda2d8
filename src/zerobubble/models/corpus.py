"""A character-level text corpus that ships with every machine: Python's own stdlib sources.

No downloads: the training demo reads ``.py`` files from the running
interpreter's standard library in a fixed order, so every rank (and every
machine with the same Python) sees the same bytes.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

#: Printable ASCII plus newline; anything else maps to '?'.
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))


@dataclass(frozen=True)
class CharCorpus:
    """Encoded text plus its vocabulary.

    Attributes:
        tokens: 1-D int64 tensor of character ids.
        vocab: The characters, id = index.
        sources: How many files were read.
    """

    tokens: torch.Tensor
    vocab: str
    sources: int

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def batch(
        self, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs (B, T) and next-character targets (B, T)."""
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(
                f"corpus has {len(self.tokens)} characters, too few for seq_len={seq_len}"
            )
        starts = torch.randint(
            0, len(self.tokens) - seq_len - 1, (batch_size,), generator=generator
        )
        idx = starts[:, None] + torch.arange(seq_len + 1)
        window = self.tokens[idx]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def stdlib_corpus(max_chars: int = 2_000_000, root: str | Path | None = None) -> CharCorpus:
    """Read up to ``max_chars`` characters of ``.py`` files under the stdlib, sorted by path."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"no standard library sources at {base}; pass root=")
    table = {ch: i for i, ch in enumerate(ALPHABET)}
    unknown = table["?"]
    ids: list[int] = []
    sources = 0
    for path in sorted(base.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        ids.extend(table.get(ch, unknown) for ch in text[: max_chars - len(ids)])
        sources += 1
        if len(ids) >= max_chars:
            break
    if not ids:
        raise FileNotFoundError(f"no .py sources found under {base}")
    return CharCorpus(torch.tensor(ids, dtype=torch.int64), ALPHABET, sources)
