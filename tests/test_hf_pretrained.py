"""Hugging Face directories into a pipeline, one rank's stages each, and back.

A tiny Llama with a tied head (vocabulary 512, so that its embedding weighs about one
block: the four stages of P = 4 hold near-equal shares) is saved with ``save_pretrained``
in shards of 100 KB (an index, the tie saved once). :func:`load_pipeline` at P = 4 (gloo,
ZB-H1): each rank's stage modules hold at most 0.3 of the model's parameter bytes, every
tensor equals the saved model's (the rotary tables, recomputed, too), and two AdamW steps
are bitwise those of the same Pipeline built the usual way from the whole model in memory.
At P = 2 under ZB-V (rank 0 holds the embedding's and the head's stages, both replicas of
the tie) two steps, then :func:`save_pipeline`: ``from_pretrained`` loads every trained
tensor exactly. A Mixtral at pp 2 x dp 2 with its experts sharded over ep 2 exports them
whole, and :func:`load_pipeline` reads that directory back per rank (its names are the
modules'), and the directory transformers saved itself (per-expert names, converted as
``from_pretrained`` converts them) per rank too, equal to the whole model's tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import zerobubble  # noqa: E402
from ranks import launch  # noqa: E402
from zerobubble.interop import hf  # noqa: E402
from zerobubble.interop.hf_experts import gather_hf_experts  # noqa: E402
from zerobubble.interop.hf_pretrained import load_config, load_pipeline, save_pipeline  # noqa: E402
from zerobubble.parallel.mesh import build_mesh  # noqa: E402
from zerobubble.parallel.partition import layer_keys  # noqa: E402
from zerobubble.parallel.tied import find_shared  # noqa: E402

SEED, M = 3, 4
CONFIG = {"tie_word_embeddings": True, "vocab_size": 512}


def tiny() -> torch.nn.Module:
    return hf.tiny_model("hf-llama", seed=SEED, **CONFIG)


def saved(folder: Path) -> Path:
    tiny().save_pretrained(folder, max_shard_size="100KB")
    return folder


def batch(k: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + k)
    ids = torch.randint(3, 256, (8, 7), generator=gen)  # both vocabularies
    mask = (torch.arange(7) < torch.randint(3, 8, (8,), generator=gen)[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)


def held_bytes(pipe: zerobubble.Pipeline) -> int:
    """The bytes of every parameter of this rank's stage modules, each memory once."""
    seen: dict[int, int] = {}
    for chunk in pipe.executor.chunks.values():
        for p in chunk.module.parameters():
            seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def train(pipe: zerobubble.Pipeline, steps: int = 2) -> list[list[float] | None]:
    pipe.set_optimizer(torch.optim.AdamW(pipe.parameters(), lr=0.01))
    out = []
    for k in range(steps):
        x, y = batch(k)
        losses = pipe.step(x, target=y)
        out.append(None if losses is None else [float(v) for v in losses])
    pipe.drain()
    return out


def test_a_meta_model_is_cut_with_its_tie_and_no_memory_error():
    """Meta tensors hold no memory: the memory-tie check no longer takes any two of one size
    for a tie by ``.data`` (it raised "share memory ... tie them"); the real tie is found."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf.tiny_config("hf-llama", **CONFIG))
    layers = hf.causal_lm_layers(model, check=False)
    bounds = [range(0, 4), range(4, 8)]
    ties = find_shared(layers, layer_keys(layers), bounds)
    assert [t.source_names for t in ties] == [("model.embed_tokens.weight", "lm_head.weight")]


def load_job(folder: str) -> dict:
    zerobubble.init_distributed()
    model = tiny()
    pipe = load_pipeline(folder, "zb-h1", microbatches=M)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    own = model.state_dict()
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, own[name]), name
    rotary = dict(model.model.rotary_emb.named_buffers())
    tables = 0
    for chunk in pipe.executor.chunks.values():
        for name, b in chunk.module.named_buffers():
            if ".rotary_emb." in name:
                assert torch.equal(b, rotary[name.rsplit(".", 1)[1]]), name
                tables += 1
    ratio = held_bytes(pipe) / whole
    ref = zerobubble.Pipeline(
        hf.causal_lm_layers(model), hf.CausalLMLoss(model), "zb-h1", microbatches=M
    )
    losses, expected = train(pipe), train(ref)
    assert losses == expected
    theirs = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert torch.equal(p, theirs[name]), name
    return {"ratio": ratio, "tables": tables, "losses": losses}


@pytest.mark.slow
@pytest.mark.bitwise
def test_each_rank_loads_only_its_stages_and_trains_as_the_whole_model(tmp_path):
    out = launch(load_job, 4, str(saved(tmp_path / "llama")), timeout=240)
    ratios = [r["ratio"] for r in out]
    assert all(r <= 0.3 for r in ratios), ratios
    assert [r["tables"] for r in out] == [2, 4, 4, 2]  # inv_freq and original_inv_freq per block
    assert out[-1]["losses"][0] is not None


def export_job(folder: str, out: str) -> dict:
    zerobubble.init_distributed()
    pipe = load_pipeline(folder, "zbv", microbatches=M)
    train(pipe)
    save_pipeline(pipe, out, load_config(folder))
    return {n: t.detach().clone() for n, t in pipe.state_dict().items()}


@pytest.mark.slow
def test_a_trained_pipeline_exports_a_directory_from_pretrained_loads_exactly(tmp_path):
    out = tmp_path / "trained"
    parts = launch(export_job, 2, str(saved(tmp_path / "llama")), str(out), timeout=240)
    files = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(files.values()) == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    assert "lm_head.weight" not in files  # tied: saved once, as save_pretrained does
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    loaded, before = model.state_dict(), tiny().state_dict()
    trained = {n: t for part in parts for n, t in part.items()}
    assert set(trained) == set(loaded)
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
    assert not torch.equal(
        loaded["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"]
    )


def ep_job(out: str, native: str) -> dict:
    zerobubble.init_distributed()
    mesh = build_mesh(2, 2, ep=2)
    model = hf.tiny_model("hf-mixtral", seed=SEED)
    layers, loss = hf.causal_lm_layers(model), hf.CausalLMLoss(model)
    pipe = zerobubble.Pipeline(layers, loss, "1f1b", microbatches=2, mesh=mesh)
    # transformers' own directory (per-expert w1/w2/w3 under block_sparse_moe), read per rank
    # by its conversion mapping: the same tensors as the Pipeline of the whole model
    direct = load_pipeline(native, "1f1b", microbatches=2, mesh=mesh)
    mine, whole = direct.state_dict(), pipe.state_dict()
    assert set(mine) == set(whole)
    for name, value in whole.items():
        assert torch.equal(mine[name], value), name
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    held = (held_bytes(direct), held_bytes(pipe), model_bytes)
    del direct
    train(pipe, steps=1)
    save_pipeline(pipe, out, model.config)
    back = load_pipeline(out, "1f1b", microbatches=2, mesh=mesh)  # the native names, per rank
    mine = back.state_dict()
    for name, value in pipe.state_dict().items():
        assert torch.equal(mine[name], value), name
    return {"held": held, "state": {n: t.clone() for n, t in gather_hf_experts(pipe, mesh).items()}}


@pytest.mark.slow
def test_experts_sharded_over_ep_are_exported_whole_and_read_back_per_rank(tmp_path):
    """pp 2 x dp 2 (ep 2) Mixtral: the stacked experts gathered whole into the files; the
    directory ``save_pretrained`` wrote (per-expert names) read per rank, each rank's modules
    holding half the model or less (its stages, its experts), equal to the whole model's."""
    out = tmp_path / "mixtral"
    hf.tiny_model("hf-mixtral", seed=SEED).save_pretrained(tmp_path / "native")
    parts = launch(ep_job, 4, str(out), str(tmp_path / "native"), timeout=240)
    for part in parts:
        direct, whole_path, model = part["held"]
        assert direct == whole_path and direct < 0.5 * model
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert set(loaded) == {n for part in parts for n in part["state"]}
    for part in parts:
        for name, value in part["state"].items():
            assert torch.equal(loaded[name], value), name


def test_bad_directories_are_refused_naming_the_file_and_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"has no config\.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(tiny().config.to_json_string())
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"has no \*\.safetensors"):
            load_pipeline(tmp_path, "1f1b", microbatches=2)
        from safetensors.torch import load_file, save_file

        folder = saved(tmp_path / "llama")
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        file = folder / index["weight_map"]["model.norm.weight"]
        kept = {k: v for k, v in load_file(file).items() if k != "model.norm.weight"}
        save_file(kept, file, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=rf"'model\.norm\.weight' is not in .*{file.name}"):
            load_pipeline(folder, "1f1b", microbatches=2)
        (folder / "model.safetensors.index.json").unlink()
        with pytest.raises(ValueError, match=r"'model\.norm\.weight' .* none of the safetensors"):
            load_pipeline(folder, "1f1b", microbatches=2)
    finally:
        dist.destroy_process_group()


def test_conversions_other_than_stacking_experts_are_named_as_not_read_per_rank(monkeypatch):
    from transformers.core_model_loading import Chunk, WeightConverter

    from zerobubble.interop import hf_pretrained as hp

    for name in ("hf-llama", "hf-mixtral", "hf-qwen3-moe"):
        assert hp.per_rank_refusal(hf.tiny_model(name).config) == "", name
    split = WeightConverter("mlp.fused.weight", ["mlp.a.weight", "mlp.b.weight"],
                            operations=[Chunk(dim=0)])  # fmt: skip
    monkeypatch.setattr(hp, "_conversions", lambda model: [split])
    why = hp.per_rank_refusal(tiny().config)
    assert why.startswith("llama checkpoints are converted on loading by") and "Chunk" in why
