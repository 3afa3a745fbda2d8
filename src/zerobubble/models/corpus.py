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


def stdlib_sources(
    max_chars: int = 2_000_000, root: str | Path | None = None
) -> list[tuple[Path, str]]:
    """The stdlib's ``.py`` files, sorted by path, as (path, text): at most ``max_chars`` in all.

    The last file is cut to fit. The same files and bytes :func:`stdlib_corpus` encodes, one
    text per file, so a tokenizer can see file (document) boundaries.
    """
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"no standard library sources at {base}; pass root=")
    sources: list[tuple[Path, str]] = []
    total = 0
    for path in sorted(base.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        text = text[: max_chars - total]
        sources.append((path, text))
        total += len(text)
        if total >= max_chars:
            break
    return sources


def stdlib_corpus(max_chars: int = 2_000_000, root: str | Path | None = None) -> CharCorpus:
    """Read up to ``max_chars`` characters of ``.py`` files under the stdlib, sorted by path."""
    sources = stdlib_sources(max_chars, root)
    table = {ch: i for i, ch in enumerate(ALPHABET)}
    unknown = table["?"]
    ids = [table.get(ch, unknown) for _, text in sources for ch in text]
    if not ids:
        base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
        raise FileNotFoundError(f"no .py sources found under {base}")
    return CharCorpus(torch.tensor(ids, dtype=torch.int64), ALPHABET, len(sources))
