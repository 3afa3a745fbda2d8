"""The trainer's data: sources, tokenizers, the (seed, step, dp rank, dp size, rows) order, padding,
and the refusals. Single process, tiny texts."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from zerobubble.models.corpus import stdlib_sources
from zerobubble.train.data import Batch, TokenBatches, build_batches


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _windows(data: TokenBatches) -> list[tuple[int, ...]]:
    """Every sample of one epoch, in epoch 0's order."""
    batch = data.batch(0, 0, 1, data.num_samples)
    return [tuple(row) for row in batch.input_ids.tolist()]


def _build(path: Path | None, **kw: object) -> TokenBatches:
    args: dict[str, object] = {"tokenizer_dir": None, "vocab_size": 256, "seq_len": 4, "seed": 0}
    args.update(kw)
    return build_batches(path, **args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WordLevel tokenizer trained here, saved as a model directory's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"])
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran"], trainer)
    folder = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]"
    ).save_pretrained(folder)
    assert (folder / "tokenizer.json").is_file()
    return folder


def test_text_file_packed_with_the_byte_fallback(tmp_path: Path) -> None:
    file = tmp_path / "a.txt"
    file.write_text("hello world", encoding="utf-8")
    data = _build(file)
    assert (data.num_tokens, data.num_samples, data.eos_id, data.pad_id) == (12, 3, 0, 0)
    assert data.sources == (str(file),) and data.tokenizer == "byte-level fallback"
    stream = [*_bytes("hello world"), 0]
    windows = [tuple(stream[i : i + 4]) for i in range(0, 12, 4)]
    batch = data.batch(0, 0, 1, 3)
    assert isinstance(batch, Batch) and batch.attention_mask is None
    assert batch.input_ids.dtype == torch.int64 and batch.input_ids.shape == (3, 4)
    assert torch.equal(batch.labels, batch.input_ids)
    assert batch.labels.data_ptr() != batch.input_ids.data_ptr()
    assert sorted(map(tuple, batch.input_ids.tolist())) == sorted(windows)
    # Wrap-around: every epoch is a permutation of the windows; epochs differ in order here.
    epochs = [[tuple(r) for r in data.batch(s, 0, 1, 3).input_ids.tolist()] for s in range(6)]
    assert all(sorted(e) == sorted(windows) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1


def test_jsonl_documents_are_joined_with_eos(tmp_path: Path) -> None:
    file = tmp_path / "d.jsonl"
    _jsonl(file, [{"body": "ab", "id": 1}, {"body": ""}, {"body": "cdé"}])
    with file.open("a", encoding="utf-8") as f:
        f.write("\n   \n")  # blank lines are skipped
    data = _build(file, text_key="body", seq_len=8)
    expected = [*_bytes("ab"), 0, *_bytes("cdé"), 0]
    assert (data.num_documents, data.num_tokens) == (2, 8)  # é is 2 bytes
    assert data.batch(0, 0, 1, 1).input_ids.tolist() == [expected]


def test_folder_reads_data_files_sorted_and_skips_the_rest(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("A", encoding="utf-8")
    _jsonl(tmp_path / "b" / "c.jsonl", [{"text": "C"}, {"text": "D"}])
    (tmp_path / "e.md").write_text("E", encoding="utf-8")
    (tmp_path / "z.bin").write_bytes(b"\xff\xfe")
    (tmp_path / ".hidden.txt").write_text("H", encoding="utf-8")
    (tmp_path / "state.json").write_text("{}", encoding="utf-8")  # not a saved dataset alone
    data = _build(tmp_path, seq_len=8)
    names = [str(tmp_path / p) for p in ("a.txt", "b/c.jsonl", "e.md")]
    assert data.sources == tuple(names)
    assert data.batch(0, 0, 1, 1).input_ids.tolist() == [[65, 0, 67, 0, 68, 0, 69, 0]]


def test_stdlib_corpus_is_the_default(tmp_path: Path) -> None:
    data = _build(None, seq_len=16, corpus_chars=3000)
    texts = [text for _, text in stdlib_sources(max_chars=3000)]
    stream = [t for text in texts for t in (*_bytes(text), 0)]
    assert data.num_tokens == len(stream) and data.sources[0].endswith(".py")
    got = {tuple(r) for r in data.batch(0, 0, 1, data.num_samples).input_ids.tolist()}
    assert got == {tuple(stream[i : i + 16]) for i in range(0, len(stream) - 15, 16)}


def test_tokenizer_from_a_model_directory(tmp_path: Path, word_tokenizer: Path) -> None:
    # [PAD]=0 [UNK]=1 [EOS]=2 then the words by frequency: the=3, ...
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(word_tokenizer / "tokenizer.json")).get_vocab()
    file = _jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat"}, {"text": "a zebra"}])
    data = _build(file, tokenizer_dir=word_tokenizer, vocab_size=len(vocab), seq_len=7)
    assert (data.eos_id, data.pad_id) == (vocab["[EOS]"], vocab["[PAD]"])
    expected = [vocab[w] for w in ("the", "cat", "sat", "[EOS]", "a", "[UNK]", "[EOS]")]
    assert data.batch(0, 0, 1, 1).input_ids.tolist() == [expected]


def test_tokenizer_through_transformers_without_tokenizer_json(tmp_path: Path) -> None:
    """A vocab.json + merges.txt directory (no tokenizer.json): AutoTokenizer loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the cat sat on the mat"] * 4, trainer)
    folder = tmp_path / "model"
    folder.mkdir()
    tok.model.save(str(folder))
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    file = tmp_path / "t.txt"
    file.write_text("the cat", encoding="utf-8")
    reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ids = [*reference("the cat")["input_ids"], reference.eos_token_id]
    data = _build(file, tokenizer_dir=folder, vocab_size=len(reference), seq_len=len(ids))
    assert data.tokenizer.endswith("(transformers)") and data.eos_id == reference.eos_token_id
    assert data.batch(0, 0, 1, 1).input_ids.tolist() == [ids]


def test_same_arguments_same_batches_and_resume_needs_no_history(tmp_path: Path) -> None:
    file = tmp_path / "a.txt"
    file.write_text("".join(chr(97 + i % 26) for i in range(400)), encoding="utf-8")
    a, b = _build(file, seed=5), _build(file, seed=5)
    walked = [a.batch(s, 0, 1, 8) for s in range(30)]  # several epochs of 25 windows
    for s in (29, 3, 17):  # a fresh object, out of order
        assert torch.equal(b.batch(s, 0, 1, 8).input_ids, walked[s].input_ids)
    other = _build(file, seed=6)
    assert not torch.equal(other.batch(0, 0, 1, 8).input_ids, walked[0].input_ids)


def test_dp_ranks_split_one_global_batch_whatever_the_dp_size(tmp_path: Path) -> None:
    """Global batch G = rows * dp_size: rank r holds rows r*rows.. of it, and the global batch
    depends on G only (dp=2 x 3 rows == dp=3 x 2 rows == dp=1 x 6 rows)."""
    file = tmp_path / "a.txt"
    file.write_text("".join(chr(33 + i) for i in range(90)) + "0123456789", encoding="utf-8")
    data = _build(file, seed=1)  # 25 windows: step 4 of G=6 wraps into the next epoch
    for step in range(6):
        whole = data.batch(step, 0, 1, 6)
        for dp in (2, 3, 6):
            ranks = [data.batch(step, r, dp, 6 // dp) for r in range(dp)]
            assert torch.equal(torch.cat([b.input_ids for b in ranks]), whole.input_ids)
            assert torch.equal(torch.cat([b.labels for b in ranks]), whole.labels)
    # Within an epoch the ranks' rows are distinct windows (disjoint).
    rows = [tuple(r) for rank in range(2) for r in data.batch(1, rank, 2, 3).input_ids.tolist()]
    assert len(set(rows)) == 6


def test_padded_rows_mask_and_labels(tmp_path: Path) -> None:
    file = _jsonl(tmp_path / "d.jsonl", [{"text": "ab"}, {"text": "abcdefg"}])
    data = _build(file, seq_len=5, packing=False)
    assert data.num_samples == 2
    batch = data.batch(0, 0, 1, 2)
    assert batch.attention_mask is not None
    rows = sorted(
        zip(
            batch.input_ids.tolist(),
            batch.labels.tolist(),
            batch.attention_mask.tolist(),
            strict=True,
        )
    )
    assert rows == [
        ([97, 98, 0, 0, 0], [97, 98, 0, -100, -100], [1, 1, 1, 0, 0]),
        ([97, 98, 99, 100, 101], [97, 98, 99, 100, 101], [1, 1, 1, 1, 1]),
    ]


def test_padded_rows_use_the_tokenizers_pad_id(tmp_path: Path, word_tokenizer: Path) -> None:
    file = _jsonl(tmp_path / "d.jsonl", [{"text": "cat"}])
    data = _build(file, tokenizer_dir=word_tokenizer, vocab_size=11, seq_len=4, packing=False)
    batch = data.batch(0, 0, 1, 1)
    cat, eos, pad = batch.input_ids[0, 0].item(), data.eos_id, data.pad_id
    assert (eos, pad) == (2, 0) and cat not in (eos, pad)
    assert batch.input_ids.tolist() == [[cat, eos, pad, pad]]
    assert batch.labels.tolist() == [[cat, eos, -100, -100]]


def test_vocab_refusals(tmp_path: Path, word_tokenizer: Path) -> None:
    file = tmp_path / "a.txt"
    file.write_text("the cat sat", encoding="utf-8")
    with pytest.raises(ValueError, match=r"too small for the byte-level.*256.*tokenizer\.json"):
        _build(file, vocab_size=128)
    with pytest.raises(ValueError, match=rf"{file}: token id \d+ >= vocab_size=5"):
        _build(file, tokenizer_dir=word_tokenizer, vocab_size=5)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "a"}\n{oops\n', r"d\.jsonl:2: not a JSON line"),
        ('{"body": "a"}\n', r"d\.jsonl:1: no 'text' field \(found \['body'\]\)"),
        ('["a"]\n', r"d\.jsonl:1: no 'text' field \(found list\)"),
        ('{"text": 3}\n', r"d\.jsonl:1: 'text' is int, not a string"),
    ],
)
def test_bad_jsonl_is_refused_naming_the_line(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "d.jsonl").write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        _build(tmp_path / "d.jsonl")


def test_bad_sources_and_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        _build(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="holds no data files"):
        _build(tmp_path)
    (tmp_path / "x.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"x\.txt is not UTF-8"):
        _build(tmp_path / "x.txt")
    (tmp_path / "x.txt").write_text("abc", encoding="utf-8")
    with pytest.raises(ValueError, match=r"4 tokens, fewer than seq_len=8"):
        _build(tmp_path / "x.txt", seq_len=8)
    (tmp_path / "e.txt").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="no documents with text"):
        _build(tmp_path / "e.txt")
    with pytest.raises(ValueError, match="seed=-1"):
        _build(tmp_path / "x.txt", seed=-1)
    with pytest.raises(ValueError, match=r"tokenizer directory .* does not exist"):
        _build(tmp_path / "x.txt", tokenizer_dir=tmp_path / "nope")
    data = _build(tmp_path / "x.txt", seq_len=2)
    for args, message in [
        ((0, 2, 2, 1), r"dp_rank=2: must be in \[0, dp_size=2\)"),
        ((0, 0, 1, 0), "rows=0"),
        ((-1, 0, 1, 1), "step=-1"),
        ((0, 0, 0, 1), "dp_size=0"),
    ]:
        with pytest.raises(ValueError, match=message):
            data.batch(*args)


def _saved_dataset(tmp_path: Path, files: tuple[str, ...] = ("dataset_dict.json",)) -> Path:
    folder = tmp_path / "ds"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}", encoding="utf-8")
    return folder


@pytest.mark.parametrize("files", [("dataset_dict.json",), ("state.json", "dataset_info.json")])
def test_saved_dataset_needs_the_datasets_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: tuple[str, ...]
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ValueError, match="pip install datasets"):
        _build(_saved_dataset(tmp_path, files))


def test_saved_dataset_reads_the_train_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``datasets.load_from_disk`` (a stand-in here: the package is optional)."""

    class Split:
        def __init__(self, rows: list[str]) -> None:
            self.column_names = ["text"]
            self.rows = rows

        def __getitem__(self, key: str) -> list[str]:
            assert key == "text"
            return self.rows

    folder = _saved_dataset(tmp_path)
    loaded = {"train": Split(["ab", "c"]), "test": Split(["zz"])}
    fake = types.ModuleType("datasets")
    fake.load_from_disk = lambda p: loaded if p == str(folder) else None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    data = _build(folder, seq_len=5)
    assert data.batch(0, 0, 1, 1).input_ids.tolist() == [[97, 98, 0, 99, 0]]
    with pytest.raises(ValueError, match=r"no 'body' column \(found \['text'\]\)"):
        _build(folder, text_key="body")
    del loaded["train"]
    assert _build(folder, seq_len=3).batch(0, 0, 1, 1).input_ids.tolist() == [[122, 122, 0]]
    loaded["dev"] = Split(["x"])
    with pytest.raises(ValueError, match=r"splits \['dev', 'test'\] and none is 'train'"):
        _build(folder)
