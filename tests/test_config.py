"""The job's typed config: sections, flags derived from the fields, TOML with overrides."""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

import pytest

from zerobubble.cli import _bench_config, build_parser
from zerobubble.models import GPTConfig
from zerobubble.train import titan
from zerobubble.train.config import (
    GPT_FIELDS,
    ExecutorSection,
    JobSection,
    ModelSection,
    OptimizerSection,
    ScheduleSection,
    TrainConfig,
)
from zerobubble.train.options import build_config, field_docs, load_toml, options

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "job.toml"


def config_of(argv: list[str], monkeypatch, world: int | None = None) -> TrainConfig:
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    return _bench_config(build_parser().parse_args(["bench", *argv]))


def test_example_toml_loads_and_flags_override_it(monkeypatch):
    cfg = config_of(["--config", str(EXAMPLE)], monkeypatch)
    assert cfg == TrainConfig(
        model=ModelSection(d_model=64, n_heads=4, n_layers=4),
        schedule=ScheduleSection(devices=4, microbatches=8, mem_ratio=1.5),
        executor=ExecutorSection(comm_timeout_s=60.0),
        optimizer=OptimizerSection(lr=3e-3, grad_clip=1.0),
        job=JobSection(microbatch_size=2, seq_len=32, steps=4, baseline_steps=2, out="out/job"),
    )
    over = config_of(
        ["--config", str(EXAMPLE), "--steps", "7", "--job.seed", "3", "--grad-clip", "none"],
        monkeypatch,
    )
    assert (over.job.steps, over.job.seed, over.optimizer.grad_clip) == (7, 3, None)
    assert over.model == cfg.model and over.schedule == cfg.schedule


def test_every_field_is_one_documented_flag(capsys):
    """Each option's help is its field's docstring: written once, in the config."""
    sections = {
        "model": ModelSection,
        "schedule": ScheduleSection,
        "executor": ExecutorSection,
        "optimizer": OptimizerSection,
        "job": JobSection,
    }
    assert [f.name for f in fields(TrainConfig)] == list(sections)
    tables = [*sections.items(), *titan.TABLES.items()]  # torchtitan's read onto the job's
    opts = {o.key: o for o in options()}
    docs = {
        f"{name}.{f}": doc for name, cls in reversed(tables) for f, doc in field_docs(cls).items()
    }
    expected = {f"{name}.{f.name}" for name, cls in tables for f in fields(cls)} - {
        "job.profile_only"
    }  # set by the subcommand
    assert set(opts) == expected
    for key, opt in opts.items():
        assert opt.doc and opt.doc == docs[key], key
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--model.mlp_ratio INT Hidden width of each block's MLP, in multiples of d_model." in (
        help_text
    )
    assert field_docs(ModelSection)["n_heads"] == "Attention heads per block; must divide d_model."


def test_model_section_passes_to_gpt_config_by_name():
    model = ModelSection(d_model=32, n_heads=8, n_layers=3, mlp_ratio=2)
    shape = {k: v for k, v in asdict(model).items() if k in GPT_FIELDS}  # hf-* fields aside
    gpt = GPTConfig(vocab_size=10, max_seq_len=16, **shape)
    assert (gpt.d_model, gpt.n_heads, gpt.n_layers, gpt.mlp_ratio) == (32, 8, 3, 2)


# old flag -> (key, text, value): every flag that predates the sections still works
OLD_FLAGS = {
    "-p": ("schedule", "devices", "3", 3),
    "-m": ("schedule", "microbatches", "5", 5),
    "--microbatch-size": ("job", "microbatch_size", "3", 3),
    "--seq-len": ("job", "seq_len", "16", 16),
    "--d-model": ("model", "d_model", "32", 32),
    "--heads": ("model", "n_heads", "8", 8),
    "--layers": ("model", "n_layers", "9", 9),
    "--lr": ("optimizer", "lr", "0.5", 0.5),
    "--grad-clip": ("optimizer", "grad_clip", "2", 2.0),
    "--steps": ("job", "steps", "0", 0),
    "--baseline-steps": ("job", "baseline_steps", "2", 2),
    "--warmup": ("job", "warmup", "0", 0),
    "--mem-limit": ("schedule", "mem_limit", "4096", 4096),
    "--mem-ratio": ("schedule", "mem_ratio", "2.5", 2.5),
    "--seed": ("job", "seed", "11", 11),
    "--out": ("job", "out", "somewhere", "somewhere"),
    "--timeout": ("job", "timeout_s", "30", 30.0),
}


@pytest.mark.parametrize("flag", list(OLD_FLAGS))
def test_old_flags_set_their_field(flag, monkeypatch):
    section, name, text, value = OLD_FLAGS[flag]
    cfg = config_of(["-p", "3", flag, text], monkeypatch)
    assert getattr(getattr(cfg, section), name) == value
    new = "--" + f"{section}.{name}".replace("_", "-")
    assert getattr(getattr(config_of(["-p", "3", new, text], monkeypatch), section), name) == value


def test_defaults_that_scale_with_p(monkeypatch):
    cfg = config_of(["-p", "5"], monkeypatch)
    assert (cfg.schedule.microbatches, cfg.model.n_layers) == (10, 6)
    cfg = config_of(["-p", "7", "-m", "9"], monkeypatch)
    assert (cfg.schedule.microbatches, cfg.model.n_layers) == (9, 7)
    cfg = config_of([], monkeypatch, world=3)  # under torchrun: P is the world size
    assert (cfg.schedule.devices, cfg.schedule.microbatches) == (3, 8)
    assert config_of(["--config", str(EXAMPLE), "-p", "6"], monkeypatch).schedule.microbatches == 8
    assert build_config({}, devices=2, profile_only=True).job.profile_only


def test_toml_values_are_type_checked(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[schedule]\nmem_limit = "none"\nmem_ratio = 2\n[optimizer]\ngrad_clip = 3\n')
    assert load_toml(path) == {
        "schedule.mem_limit": None,
        "schedule.mem_ratio": 2.0,
        "optimizer.grad_clip": 3.0,
    }
    path.write_text("[job]\nsteps = true\n")
    with pytest.raises(ValueError, match=r"job\.steps must be an integer, got True"):
        load_toml(path)
    path.write_text("[job]\nout = 3\n")
    with pytest.raises(ValueError, match=r"job\.out must be a string, got 3"):
        load_toml(path)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['job.nope'\]"):
        build_config({"job.nope": 1}, devices=2)
