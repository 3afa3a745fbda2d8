"""Training data for the trainer: local text or JSONL (or a saved ``datasets`` dataset), tokenised
once, served as batches that are a pure function of (seed, step, dp rank, dp size, rows).

Why a pure function and not an iterator: a run resumed at step ``s`` must see the batches an
unbroken run saw, and a resume onto another data-parallel size must see the same *global* batch.
So nothing here has a position to save: :meth:`TokenBatches.batch` computes sample indices from
its arguments.

**Order.** Step ``s`` with ``rows`` rows per rank and ``dp_size`` ranks reads the global sample
positions ``s * G .. s * G + G - 1`` (``G = rows * dp_size``, the global batch); rank ``r`` takes
positions ``s * G + r * rows ..`` (``rows`` of them). Position ``p`` is sample
``perm_e[p % n]`` of epoch ``e = p // n`` (``n`` samples, ``perm_e`` a permutation seeded by
(seed, e)), so the order wraps around epoch after epoch. The ranks of a step hold disjoint
positions of one global batch, and the global batch depends on ``G`` only, never on how it is
split: dp=2 with ``rows`` rows each sees exactly the rows of dp=1 with ``2 * rows``.

**Documents.** A JSONL line (its ``text_key``), a plain text file (the whole file: for one sample
per line, write JSONL), a row of a ``datasets`` dataset, a stdlib source file for the embedded
corpus. Empty documents are skipped.

**Packed** (``packing=True``): every document is tokenised (with the tokenizer's own special
tokens, e.g. a BOS) and followed by EOS when the tokenizer has one; the stream is cut into
``seq_len`` windows, the last partial window dropped; attention spans document boundaries
(``attention_mask`` is None). **Padded**: one document per row, cut to ``seq_len`` and
right-padded with the pad id; labels are -100 and the attention mask 0 at pads. Documents of
fewer than 2 tokens are dropped there (no next-token target).

Labels follow Hugging Face: ``labels`` equals ``input_ids`` (the model's loss shifts), -100 where
a position must not count.

**Byte-level fallback** (no tokenizer in the model directory, or no directory): a token is one
UTF-8 byte, id = byte value 0..255; EOS and pad are id 0, the NUL byte, which text does not hold.
It needs ``vocab_size >= 256``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from zerobubble.models.corpus import stdlib_sources

#: Ids of the byte-level fallback: 256 byte values; NUL doubles as EOS and pad.
BYTE_VOCAB = 256
BYTE_EOS = 0

#: Files a folder contributes: JSONL by its suffix, the others as plain text.
JSONL_SUFFIXES = (".jsonl",)
TEXT_SUFFIXES = (".txt", ".text", ".md")

#: Files that make a directory a tokenizer directory (any one of them).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
#: What ``DatasetDict.save_to_disk`` writes / what ``Dataset.save_to_disk`` writes (both files).
_DATASET_DICT = "dataset_dict.json"
_DATASET_FILES = ("state.json", "dataset_info.json")

_ENCODE_CHUNK = 256  # documents per tokenizer call: bounded memory for the intermediate lists


class Batch(NamedTuple):
    """One rank's rows of a step: ``rows x seq_len`` int64 tensors.

    ``attention_mask`` is None for packed data (every position is a token).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None


@dataclass(frozen=True)
class _Tokenizer:
    """What batching needs of a tokenizer: encode documents, and its EOS and pad ids."""

    name: str
    encode: Callable[[list[str]], list[list[int]]]
    eos_id: int | None
    pad_id: int | None


class TokenBatches:
    """Tokenised documents, served by :meth:`batch` (the order is in the module docstring).

    Built by :func:`build_batches`. Tokens are held once, as int32, in one flat tensor.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        *,
        seq_len: int,
        seed: int,
        packing: bool,
        pad_id: int,
        eos_id: int | None,
        tokenizer: str,
        sources: tuple[str, ...],
    ) -> None:
        self._tokens = tokens
        self._starts = starts  # document d is tokens[starts[d]:starts[d + 1]]
        self.seq_len = seq_len
        self.seed = seed
        self.packing = packing
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.tokenizer = tokenizer
        self.sources = sources
        # The permutations of recent epochs: a cache only, the results never depend on it.
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def num_tokens(self) -> int:
        """Tokens held, EOS included."""
        return len(self._tokens)

    @property
    def num_documents(self) -> int:
        return len(self._starts) - 1

    @property
    def num_samples(self) -> int:
        """Samples per epoch: ``seq_len`` windows when packed, documents when padded."""
        if self.packing:
            return self.num_tokens // self.seq_len
        return self.num_documents

    @property
    def summary(self) -> str:
        """One line for a job's opening: sources, tokenizer, tokens and samples."""
        kind = f"{self.seq_len}-token windows" if self.packing else "padded documents"
        return (
            f"{len(self.sources)} source(s), {self.num_documents:,} documents, "
            f"{self.num_tokens:,} tokens ({self.tokenizer}); {self.num_samples:,} {kind} "
            f"per epoch"
        )

    def batch(self, step: int, dp_rank: int, dp_size: int, rows: int) -> Batch:
        """Rank ``dp_rank``'s ``rows`` rows of step ``step`` (of a global batch of
        ``rows * dp_size``)."""
        for name, value, low in (("step", step, 0), ("dp_size", dp_size, 1), ("rows", rows, 1)):
            if value < low:
                raise ValueError(f"{name}={value}: must be >= {low}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank}: must be in [0, dp_size={dp_size})")
        first = (step * dp_size + dp_rank) * rows
        samples = self._samples(first, rows)
        if self.packing:
            index = samples[:, None] * self.seq_len + torch.arange(self.seq_len)
            ids = self._tokens[index].to(torch.int64)
            return Batch(ids, ids.clone(), None)
        ids = torch.full((rows, self.seq_len), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((rows, self.seq_len), dtype=torch.int64)
        for row, doc in enumerate(samples.tolist()):
            start = int(self._starts[doc])
            length = min(int(self._starts[doc + 1]) - start, self.seq_len)
            ids[row, :length] = self._tokens[start : start + length]
            mask[row, :length] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return Batch(ids, labels, mask)

    def _samples(self, first: int, count: int) -> torch.Tensor:
        """Sample indices of global positions ``first .. first + count - 1``."""
        n = self.num_samples
        positions = torch.arange(first, first + count, dtype=torch.int64)
        epochs = positions // n
        out = torch.empty(count, dtype=torch.int64)
        for epoch in torch.unique(epochs).tolist():
            where = epochs == epoch
            out[where] = self._perm(epoch)[positions[where] % n]
        return out

    def _perm(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.default_rng([self.seed, epoch])
            perm = torch.from_numpy(rng.permutation(self.num_samples).astype(np.int64))
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm


def build_batches(
    path: str | Path | None,
    *,
    tokenizer_dir: str | Path | None,
    vocab_size: int,
    seq_len: int,
    seed: int,
    text_key: str = "text",
    packing: bool = True,
    corpus_chars: int = 2_000_000,
) -> TokenBatches:
    """Read and tokenise ``path`` once; the returned object serves every step's batches.

    Args:
        path: A text file, a JSONL file (one object per line, the text under ``text_key``), a
            folder of such files (``*.jsonl``, ``*.txt``, ``*.text``, ``*.md``, recursively,
            sorted by path; other files are not read), a ``datasets`` dataset saved with
            ``save_to_disk`` (needs the ``datasets`` package), or None: the embedded corpus,
            the interpreter's stdlib sources (up to ``corpus_chars`` characters).
        tokenizer_dir: The model directory; its tokenizer (``tokenizer.json`` through
            ``tokenizers``, else ``transformers.AutoTokenizer``), or the byte-level fallback
            when it holds none (or is None).
        vocab_size: The model's vocabulary: a token id at or above it is refused, naming the
            file.
        seq_len: Tokens per row.
        seed: Seeds the per-epoch permutations (>= 0).
        text_key: The JSONL / dataset field holding the text.
        packing: Pack documents into windows (True) or pad one document per row (False).
        corpus_chars: How much of the embedded corpus to read (``path=None`` only).
    """
    for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    if seed < 0:
        raise ValueError(f"seed={seed}: must be >= 0")
    tokenizer = _load_tokenizer(tokenizer_dir, vocab_size)
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    sources: list[str] = []
    for source, docs in _documents(path, text_key, corpus_chars):
        sources.append(source)
        for ids in _encode(tokenizer, docs):
            if not ids:
                continue
            if tokenizer.eos_id is not None and ids[-1] != tokenizer.eos_id:
                ids.append(tokenizer.eos_id)
            if not packing and len(ids) < 2:
                continue
            top = max(ids)
            if top >= vocab_size:
                raise ValueError(
                    f"{source}: token id {top} >= vocab_size={vocab_size} "
                    f"({tokenizer.name}); use the model's own tokenizer or a model with "
                    f"vocab_size >= {top + 1}"
                )
            pieces.append(np.asarray(ids, dtype=np.int32))
            lengths.append(len(ids))
    where = "the embedded stdlib corpus" if path is None else str(path)
    if not lengths:
        raise ValueError(f"{where}: no documents with text (under key {text_key!r} for JSONL)")
    tokens = torch.from_numpy(np.concatenate(pieces))
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    if packing and len(tokens) < seq_len:
        raise ValueError(
            f"{where}: {len(tokens)} tokens, fewer than seq_len={seq_len}; give more text or "
            f"a shorter seq_len"
        )
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    return TokenBatches(
        tokens,
        starts,
        seq_len=seq_len,
        seed=seed,
        packing=packing,
        pad_id=pad_id if pad_id is not None else 0,
        eos_id=tokenizer.eos_id,
        tokenizer=tokenizer.name,
        sources=tuple(sources),
    )


def _load_tokenizer(directory: str | Path | None, vocab_size: int) -> _Tokenizer:
    """The directory's tokenizer, or the byte-level fallback when it holds none."""
    folder = Path(directory) if directory is not None else None
    if folder is not None and not folder.is_dir():
        raise ValueError(f"tokenizer directory {folder} does not exist or is not a folder")
    if folder is None or not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        if vocab_size < BYTE_VOCAB:
            raise ValueError(
                f"vocab_size={vocab_size} is too small for the byte-level fallback (one id per "
                f"byte: needs {BYTE_VOCAB}); give the model vocab_size >= {BYTE_VOCAB} or put "
                f"its tokenizer (tokenizer.json) in the model directory"
            )
        return _Tokenizer("byte-level fallback", _encode_bytes, BYTE_EOS, BYTE_EOS)
    if (folder / "tokenizer.json").is_file():
        return _from_tokenizers(folder)
    return _from_transformers(folder)


def _encode_bytes(docs: list[str]) -> list[list[int]]:
    return [list(doc.encode("utf-8")) for doc in docs]


def _from_tokenizers(folder: Path) -> _Tokenizer:
    """``tokenizer.json`` through ``tokenizers``; EOS and pad named by tokenizer_config.json."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ValueError(
            f"{folder} holds tokenizer.json, which needs the `tokenizers` package: "
            f"pip install 'zerobubble[hf]'"
        ) from e
    try:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # tokenizers raises its own Exception types
        raise ValueError(f"{folder / 'tokenizer.json'} does not load: {e}") from e
    tok.no_truncation()  # a saved truncation would cut documents silently
    tok.no_padding()
    special: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if file.is_file():
            try:
                special.update(json.loads(file.read_text(encoding="utf-8")))
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}: not JSON ({e})") from e

    def token_id(key: str) -> int | None:
        token = special.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token is None:
            return None
        found = tok.token_to_id(str(token))
        if found is None:
            raise ValueError(f"{folder}: {key} {token!r} is not in tokenizer.json's vocabulary")
        return int(found)

    def encode(docs: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in tok.encode_batch(docs, add_special_tokens=True)]

    eos, pad = token_id("eos_token"), token_id("pad_token")
    return _Tokenizer(str(folder / "tokenizer.json"), encode, eos, pad)


def _from_transformers(folder: Path) -> _Tokenizer:
    """Any other tokenizer files (sentencepiece, vocab + merges) through ``AutoTokenizer``."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError(
            f"{folder}'s tokenizer needs `transformers`: pip install 'zerobubble[hf]'"
        ) from e
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad directory
        raise ValueError(f"the tokenizer in {folder} does not load: {e}") from e

    def encode(docs: list[str]) -> list[list[int]]:
        out = tok(docs, add_special_tokens=True, truncation=False, verbose=False)
        return [list(ids) for ids in out["input_ids"]]

    return _Tokenizer(f"{folder} (transformers)", encode, tok.eos_token_id, tok.pad_token_id)


def _encode(tokenizer: _Tokenizer, docs: Sequence[str]) -> Iterator[list[int]]:
    texts = [doc for doc in docs if doc]
    for i in range(0, len(texts), _ENCODE_CHUNK):
        yield from tokenizer.encode(texts[i : i + _ENCODE_CHUNK])


def _documents(
    path: str | Path | None, text_key: str, corpus_chars: int
) -> Iterator[tuple[str, list[str]]]:
    """(source name, its documents) for every source, in a fixed order."""
    if path is None:
        for file, text in stdlib_sources(max_chars=corpus_chars):
            yield str(file), [text]
        return
    root = Path(path)
    if root.is_file():
        yield str(root), _read_file(root, text_key)
        return
    if not root.is_dir():
        raise ValueError(f"data path {root} does not exist: give a text or JSONL file or a folder")
    if (root / _DATASET_DICT).is_file() or all((root / f).is_file() for f in _DATASET_FILES):
        yield str(root), _read_dataset(root, text_key)
        return
    files = sorted(
        f
        for f in root.rglob("*")
        if f.is_file()
        and f.suffix in JSONL_SUFFIXES + TEXT_SUFFIXES
        and not any(part.startswith(".") for part in f.relative_to(root).parts)
    )
    if not files:
        raise ValueError(
            f"{root} holds no data files (*{', *'.join(JSONL_SUFFIXES + TEXT_SUFFIXES)})"
        )
    for file in files:
        yield str(file), _read_file(file, text_key)


def _read_file(file: Path, text_key: str) -> list[str]:
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text ({e}); give text or JSONL files") from e
    if file.suffix not in JSONL_SUFFIXES:
        return [text]
    docs: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}:{number}: not a JSON line ({e.msg})") from e
        if not isinstance(row, dict) or text_key not in row:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"{file}:{number}: no {text_key!r} field (found {keys}); set the data text key"
            )
        value = row[text_key]
        if not isinstance(value, str):
            raise ValueError(
                f"{file}:{number}: {text_key!r} is {type(value).__name__}, not a string"
            )
        docs.append(value)
    return docs


def _read_dataset(folder: Path, text_key: str) -> list[str]:
    """A dataset saved with ``save_to_disk``: its ``train`` split if it has several."""
    try:
        datasets = importlib.import_module("datasets")
    except ImportError as e:
        raise ValueError(
            f"{folder} is a Hugging Face `datasets` dataset (save_to_disk); reading it needs "
            f"the package: pip install datasets"
        ) from e
    data = datasets.load_from_disk(str(folder))
    if hasattr(data, "keys"):  # a DatasetDict
        splits = sorted(data.keys())
        if "train" in splits:
            data = data["train"]
        elif len(splits) == 1:
            data = data[splits[0]]
        else:
            raise ValueError(
                f"{folder} holds splits {splits} and none is 'train'; save the split to train on"
            )
    if text_key not in data.column_names:
        raise ValueError(
            f"{folder}: no {text_key!r} column (found {list(data.column_names)}); set the data "
            f"text key"
        )
    docs = list(data[text_key])
    for i, doc in enumerate(docs):
        if not isinstance(doc, str):
            raise ValueError(f"{folder}: row {i}'s {text_key!r} is {type(doc).__name__}")
    return docs
