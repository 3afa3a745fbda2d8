"""The trainer's metrics: exact JSON rows, flushed per step, progress lines, TensorBoard, FLOPs."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from zerobubble.train.metrics import (
    GIB,
    MetricsLog,
    StepStats,
    flops_per_token,
    peak_flops,
    peak_flops_for_name,
    peak_memory_bytes,
)

STATS = StepStats(
    step=3, loss=2.5, lr=3e-4, grad_norm=0.75, tokens=8192, step_s=0.25, memory_bytes=GIB // 2
)


def _log(folder: Path | None, lines: list[str], **kw: object) -> MetricsLog:
    args: dict[str, object] = {"flops_per_token": None, "peak_flops": None}
    args.update(kw)
    return MetricsLog(folder, write_line=lines.append, clock=lambda: 1700000000.5, **args)  # type: ignore[arg-type]


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_rows_are_exact_and_flushed_before_close(tmp_path: Path) -> None:
    lines: list[str] = []
    with _log(tmp_path / "m", lines, flops_per_token=1e6, peak_flops=1e12) as log:
        row = log.record(STATS)
        expected = {
            "step": 3,
            "loss": 2.5,
            "lr": 3e-4,
            "grad_norm": 0.75,
            "tokens": 8192,
            "tokens_per_s": 32768.0,
            "step_ms": 250.0,
            "mfu": 0.032768,  # 1e6 FLOPs/token * 32768 tokens/s / 1e12
            "memory_gib": 0.5,
            "time": 1700000000.5,
        }
        assert row == expected
        assert log.path == tmp_path / "m" / "metrics.jsonl"
        assert _rows(log.path) == [expected]  # readable while the log is open
        log.record(StepStats(4, float("nan"), 3e-4, None, 100, 0.003, 123456789))
        second = _rows(log.path)[1]
        assert second == {
            "step": 4,
            "loss": None,  # not finite: JSON has no NaN
            "lr": 3e-4,
            "grad_norm": None,
            "tokens": 100,
            "tokens_per_s": 33333.3,
            "step_ms": 3.0,
            "mfu": 0.033333,
            "memory_gib": 0.115,
            "time": 1700000000.5,
        }
    assert lines == [
        "step 3  loss 2.5000  lr 3.0e-04  grad 0.750  tok/s 32,768  mfu 3.3%  mem 0.50 GiB  250 ms",
        "step 4  loss nan  lr 3.0e-04  tok/s 33,333  mfu 3.3%  mem 0.11 GiB  3 ms",
    ]
    # A resumed run appends to the same stream.
    with _log(tmp_path / "m", []) as log:
        log.record(STATS)
    assert [r["step"] for r in _rows(tmp_path / "m" / "metrics.jsonl")] == [3, 4, 3]


def test_mfu_is_null_without_peak_or_model_flops(tmp_path: Path) -> None:
    lines: list[str] = []
    for kw in ({"flops_per_token": 1e6}, {"peak_flops": 1e12}, {}):
        with _log(None, lines, **kw) as log:
            assert log.path is None and log.record(STATS)["mfu"] is None
    assert all("mfu" not in line for line in lines) and len(lines) == 3


def test_progress_line_every_log_freq_steps_and_on_the_first(tmp_path: Path) -> None:
    lines: list[str] = []
    with _log(tmp_path, lines, log_freq=5) as log:
        for step in range(3, 13):
            log.record(StepStats(step, 1.0, 1e-3, None, 10, 0.1, 0))
    assert [line.split("  ")[0] for line in lines] == ["step 3", "step 5", "step 10"]
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == list(range(3, 13))


def test_tensorboard_refused_when_the_package_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    with pytest.raises(ValueError, match="pip install tensorboard"):
        _log(tmp_path, [], tensorboard=True)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before writing anything
    with pytest.raises(ValueError, match="give a folder"):
        _log(None, [], tensorboard=True)


def test_tensorboard_scalars_through_summary_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in SummaryWriter (the package is optional): the calls the log makes."""
    calls: list[tuple[object, ...]] = []

    class Writer:
        def __init__(self, log_dir: str) -> None:
            calls.append(("init", log_dir))

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            calls.append((tag, value, step))

        def flush(self) -> None:
            pass

        def close(self) -> None:
            calls.append(("close",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    with _log(tmp_path, [], tensorboard=True) as log:
        log.record(STATS)
    assert calls == [
        ("init", str(tmp_path / "tensorboard")),
        ("loss", 2.5, 3),
        ("lr", 3e-4, 3),
        ("grad_norm", 0.75, 3),
        ("tokens_per_s", 32768.0, 3),
        ("step_ms", 250.0, 3),
        ("memory_gib", 0.5, 3),
        ("close",),
    ]


def test_bad_arguments_and_record_after_close(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="log_freq=0"):
        _log(tmp_path, [], log_freq=0)
    with pytest.raises(ValueError, match="peak_flops=0"):
        _log(tmp_path, [], peak_flops=0)
    log = _log(tmp_path, [])
    with pytest.raises(ValueError, match="step_s=0"):
        log.record(StepStats(1, 1.0, 1.0, None, 1, 0.0, 0))
    log.close()
    log.close()
    with pytest.raises(ValueError, match="after close"):
        log.record(STATS)


def test_flops_per_token_closed_form() -> None:
    # 6 * (N - E) + 12 * L * H * T
    assert flops_per_token(1000, 2, 8, 16) == 6 * 1000 + 12 * 2 * 8 * 16 == 9072.0
    assert flops_per_token(1000, 2, 8, 16, embedding_params=200) == 6 * 800 + 3072
    # A GPT-2 small sized model: 124M parameters, 38.6M of them the tied token embedding.
    assert flops_per_token(124_439_808, 12, 768, 1024, embedding_params=38_597_376) == (
        6 * 85_842_432 + 12 * 12 * 768 * 1024
    )
    with pytest.raises(ValueError, match="embedding_params=9 > num_params=8"):
        flops_per_token(8, 1, 1, 1, embedding_params=9)
    with pytest.raises(ValueError, match="seq_len=-1"):
        flops_per_token(8, 1, 1, -1)


def test_peak_flops_and_memory() -> None:
    assert peak_flops("cpu") is None
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for_name("NVIDIA H200") == 989e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("NVIDIA L40S") == 362e12
    assert peak_flops_for_name("NVIDIA L4") == 121e12
    assert peak_flops_for_name("Tesla T4") is None
    # The process's peak RSS: at least what it holds now.
    held = torch.ones(2**22, dtype=torch.float64)  # 32 MiB
    assert peak_memory_bytes(torch.device("cpu")) >= held.numel() * 8
