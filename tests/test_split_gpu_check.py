"""bench/gpu_check.py, which no GPU has run yet, runs its every part on the CPU (--dry-run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run_on_cpu(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    gpu_check = _load()
    assert gpu_check.main(["--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["dry_run"] and out["all_bitwise"]
    assert out["collectives"] == {"backend": "gloo", "cpu_tensor_all_reduce": True}
    checks = {(c["block"], c["autocast"]) for c in out["exactness"]}
    assert checks == {(b, a) for b in ("hf_gpt2", "llama") for a in ("off", "bfloat16")} | {
        ("mixed_first_stage", "off")
    }
    assert [c["model"] for c in out["hf_adapter"]] == ["hf-gpt2", "hf-llama"]
    assert all(c["logits_equal"] and c["param_grads_equal"] for c in out["hf_adapter"])
    (c,) = out["cost"]
    assert c["d_model"] == 128 and 0 < c["held_after_B_bytes"] < c["held_after_F_bytes"]
    work = 8 * (c["t_F_ms"] + c["t_B_ms"] + c["t_W_ms"])  # 2 * 4 microbatches per device
    sims = out["schedules"]["128"]
    assert {"1f1b", "zb-h1", "zb-h2", "zbv"} <= set(sims) and "auto" not in sims
    for kind, sim in sims.items():
        # each device runs every microbatch's F, B and W of one block or more: a floor
        assert sim["makespan_ms"] >= work * (1 - 1e-9), kind
        assert 0 <= sim["bubble_rate"] < 1, kind

    # A split that is not bitwise plain autograd fails the check's exit status.
    real = gpu_check.exactness
    monkeypatch.setattr(gpu_check, "exactness", lambda *a: {**real(*a), "param_grads_equal": False})
    assert gpu_check.main(["--dry-run"]) == 1
    assert not json.loads(capsys.readouterr().out)["all_bitwise"]


def test_checked_blocks_make_no_tensor_off_their_inputs_device() -> None:
    """The blocks gpu_check runs on the GPU, run on the meta device: a tensor one of them made
    on the CPU (such as a causal mask; this test found one) meets a meta tensor and raises."""
    import torch

    sys.path.insert(0, str(BENCH))
    from bench_bw_split import GPT2Block, LlamaBlock

    from zerobubble.models import GPTConfig, build_gpt

    cfg = GPTConfig(vocab_size=64, max_seq_len=16, d_model=64, n_heads=2, n_layers=1)
    for block in (GPT2Block(64, 2), LlamaBlock(64, 2, 96, n_kv_heads=1), build_gpt(cfg)[1]):
        block = block.to("meta")
        x = torch.randn(2, 16, 64, device="meta", requires_grad=True)
        block(x).sum().backward()
        assert x.grad is not None and x.grad.device.type == "meta"
        assert all(p.grad is not None and p.grad.device.type == "meta" for p in block.parameters())
