"""`zerobubble bench` reads torchtitan's table and key names (zerobubble.train.titan)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_docs import fences
from zerobubble.cli import _bench_config, build_parser, main
from zerobubble.train.options import build_config, load_toml

ROOT = Path(__file__).resolve().parents[1]

TITAN = """
[job]
dump_folder = "out/t"
baseline_steps = 2

[model]
name = "gpt"
n_layers = 1

[training]
steps = 3
global_batch_size = 12
seq_len = 16
max_norm = 0.5
seed = 7

[parallelism]
pipeline_parallel_degree = 3
pipeline_parallel_microbatch_size = 3
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
expert_parallel_degree = 1
pipeline_parallel_schedule = "auto"

[checkpoint]
enable = false
folder = "ckpt"
interval = 10
keep_latest_k = 2

[metrics]
log_freq = 1
"""


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def _cfg(argv: list[str]):
    return _bench_config(build_parser().parse_args(["bench", *argv]))


def test_torchtitan_keys_become_the_jobs_options_exactly(tmp_path):
    values = load_toml(_file(tmp_path, TITAN))
    assert values == {
        "job.out": "out/t",
        "job.baseline_steps": 2,
        "model.name": "gpt",
        "model.n_layers": 1,
        "job.steps": 3,
        "training.global_batch_size": 12,  # resolved against the final microbatch size
        "job.seq_len": 16,
        "optimizer.grad_clip": 0.5,
        "job.seed": 7,
        "schedule.devices": 3,
        "job.microbatch_size": 3,
    }
    cfg = build_config(values, devices=2)
    assert cfg.schedule.devices == 3 and cfg.schedule.microbatches == 4  # 12 / 3
    assert (cfg.job.steps, cfg.job.seq_len, cfg.job.seed, cfg.job.out) == (3, 16, 7, "out/t")
    assert cfg.optimizer.grad_clip == 0.5 and cfg.job.microbatch_size == 3
    assert cfg.batch_size == 12


def test_flags_override_the_files_keys(tmp_path):
    path = str(_file(tmp_path, TITAN))
    cfg = _cfg(["--config", path, "--training.steps", "5", "--parallelism.pipeline_parallel_degree",
                "2", "--parallelism.pipeline-parallel-microbatch-size", "2"])  # fmt: skip
    assert (cfg.job.steps, cfg.schedule.devices, cfg.job.microbatch_size) == (5, 2, 2)
    assert cfg.schedule.microbatches == 6  # the file's global batch 12 over the flag's size 2
    # A flag under the job's own name overrides the file's torchtitan key, and -m replaces
    # the file's global batch.
    cfg = _cfg(["--config", path, "--steps", "6", "-m", "5", "--model.n_layers", "2"])
    assert (cfg.job.steps, cfg.schedule.microbatches, cfg.model.n_layers) == (6, 5, 2)
    cfg = _cfg(["--config", path, "--training.global_batch_size", "6"])
    assert cfg.schedule.microbatches == 2


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("[paralellism]\npipeline_parallel_degree = 2\n", "did you mean 'parallelism'?"),
        ("[parallelism]\ntensor_paralel_degree = 2\n", "did you mean 'tensor_parallel_degree'?"),
        ("[training]\ntensor_parallel_degree = 2\n",
         "did you mean 'parallelism.tensor_parallel_degree'?"),
    ],
)  # fmt: skip
def test_an_unknown_table_or_key_exits_2_naming_the_closest(tmp_path, capsys, text, hint):
    assert main(["bench", "--config", str(_file(tmp_path, text))]) == 2
    err = capsys.readouterr().err
    assert "zerobubble bench: error:" in err and hint in err


def test_an_unknown_flag_exits_2_naming_the_closest(capsys):
    assert main(["bench", "--training.stepz", "3"]) == 2
    assert "did you mean '--training.steps'?" in capsys.readouterr().err
    assert main(["bench", "--tensor_parallel_degree=2"]) == 2
    assert "did you mean '--parallelism.tensor_parallel_degree'?" in capsys.readouterr().err
    assert main(["bench", "--training.step", "3"]) == 2  # no abbreviation passes as a flag
    assert "did you mean '--training.steps'?" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("parallelism.tensor_parallel_degree", 2, "tensor parallelism"),
        ("parallelism.data_parallel_replicate_degree", 2, "data parallelism"),
        ("parallelism.data_parallel_shard_degree", 4, "FSDP"),
        ("parallelism.expert_parallel_degree", 2, "expert parallelism"),
        ("parallelism.pipeline_parallel_schedule", "1F1B", "a fixed schedule kind"),
        ("checkpoint.enable", True, "checkpointing"),
        ("metrics.log_freq", 10, "a log_freq other than 1"),
        ("activation_checkpoint.mode", "selective", "selective activation checkpointing"),
    ],
)
def test_a_key_the_job_cannot_honour_exits_2_in_file_and_flag(tmp_path, capsys, key, value, why):
    table, name = key.split(".")
    toml = "true" if value is True else f'"{value}"' if isinstance(value, str) else str(value)
    assert main(["bench", "--config", str(_file(tmp_path, f"[{table}]\n{name} = {toml}\n"))]) == 2
    err = capsys.readouterr().err
    assert f"{key} = {toml.replace(chr(34), chr(39))}: zerobubble bench does not do {why}" in err
    assert main(["bench", f"--{key}", toml.strip('"')]) == 2
    err = capsys.readouterr().err
    assert f"does not do {why};" in err
    assert why.startswith("selective") or "or zerobubble train, the trainer, which does" in err
    with pytest.raises(ValueError, match=why):  # the API refuses it alike
        build_config({key: value}, devices=2)


def test_local_batch_and_full_activation_checkpointing_map_onto_the_job(tmp_path):
    text = "[training]\nlocal_batch_size = 8\n[activation_checkpoint]\nmode = 'full'\n"
    values = load_toml(_file(tmp_path, text))
    assert values == {"training.global_batch_size": 8, "executor.recompute": "layers"}
    cfg = _cfg(["--config", str(tmp_path / "job.toml"), "--activation_checkpoint.mode", "none"])
    assert cfg.executor.recompute == "none" and cfg.schedule.microbatches == 2  # 8 / 4


def test_batch_sizes_that_disagree_are_refused(tmp_path, capsys):
    bad = (
        "[training]\nglobal_batch_size = 7\n[parallelism]\npipeline_parallel_microbatch_size = 2\n"
    )
    assert main(["bench", "--config", str(_file(tmp_path, bad))]) == 2
    assert "not a positive multiple of the microbatch size 2" in capsys.readouterr().err
    both = "[training]\nglobal_batch_size = 8\nbatch_size = 8\n"
    assert main(["bench", "--config", str(_file(tmp_path, both))]) == 2
    assert "are the same batch; give one" in capsys.readouterr().err
    twice = "[training]\nsteps = 8\n[job]\nsteps = 4\n"
    assert main(["bench", "--config", str(_file(tmp_path, twice))]) == 2
    assert "training.steps and job.steps set the same option" in capsys.readouterr().err
    assert main(["bench", "--model", "./my-llama/"]) == 2
    assert "a Hugging Face directory is not a model of zerobubble bench" in (
        capsys.readouterr().err
    )


def test_the_docs_toml_example_is_the_job_it_describes(tmp_path):
    text = (ROOT / "docs" / "e2e.md").read_text()
    (body,) = [b for _, info, b in fences(text) if info == "toml"]
    cfg = build_config(load_toml(_file(tmp_path, body)), devices=4)
    assert (cfg.schedule.devices, cfg.schedule.microbatches, cfg.job.microbatch_size) == (2, 8, 2)
    assert (cfg.job.steps, cfg.job.seq_len, cfg.job.out) == (4, 32, "out/titan")
    assert cfg.model.n_layers == 2 and cfg.optimizer.grad_clip == 1.0
    # The prose's flag example and its refusal are what the command line does.
    assert re.search(r"did you mean '--training\.steps'\?", text)


@pytest.mark.slow
def test_a_tiny_job_runs_from_a_torchtitan_toml(tmp_path, capfd):
    """The one end-to-end run: the file's mesh and batch and the flag's steps are the job's."""
    out = tmp_path / "out"
    path = _file(tmp_path, f"""
[job]
dump_folder = "{out}"
baseline_steps = 2

[model]
n_layers = 1
d_model = 16
n_heads = 2

[training]
steps = 4
global_batch_size = 8
seq_len = 8

[parallelism]
pipeline_parallel_degree = 2
pipeline_parallel_microbatch_size = 2
""")  # fmt: skip
    assert main(["bench", "--config", str(path), "--training.steps", "1"]) == 0
    text = capfd.readouterr().out
    assert "P=2 ranks, M=4 microbatches of 2x8 tokens" in text  # 8 = 4 x 2, seq_len 8
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert sum("(profiling)" in s for s in steps) == 2 * 2  # baseline_steps of 1F1B and ZB-H1
    last = max(i for i, s in enumerate(steps) if "try:" in s or "(profiling)" in s)
    assert len(steps) - 1 - last == 3 * (1 + 1)  # 1F1B, ZB-H1, the plan: warm-up + 1 step
    assert (out / "timeline.png").stat().st_size > 0
