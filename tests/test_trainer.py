"""``zerobubble train``, the trainer (zerobubble.train.trainer), end to end on gloo ranks.

Two launches. Four ranks: a tiny Llama directory (made here with ``save_pretrained``; each rank
reads its stages' tensors) trains from a TOML recipe at pp=2 x dp=2 with checkpoints every 2
steps and an export; the same run "killed" after step 3 (the checkpoint of step 2 committed,
step 3 lost) and started again resumes at step 2 by itself, and its steps 3 and 4 have the
unbroken run's losses bitwise; pp=2 x tp=2 trains the same directory (its first loss within
1e-5 of dp's: the same batch and weights, other reductions); ``auto`` at pp=2 x dp=2 profiles,
plans and measures its candidates, then trains bitwise as ZB-H1 did; a tiny Mixtral directory
trains at pp=2 x ep=2. ``from_pretrained`` loads the export with every tensor equal to the trained
parameters. Two ranks: pp=2 x dp=1 resumes from a copy of the dp=2 run's step-2 checkpoint
(``load_step``): its steps 3 and 4 run with the same learning rates as the dp=2 run, within
1e-5 of its losses (same global batches, other reduction order), and bitwise as the trainer's
loop at dp=1 started by hand from the checkpoint's whole tensors (read by DCP's
``dcp_to_torch_save``); then ``load_step = steps = 4`` with an export writes that checkpoint
as an HF directory without training a step. The command line's refusals exit 2 naming the fix.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from ranks import launch  # noqa: E402
from zerobubble import composition  # noqa: E402
from zerobubble.cli import main  # noqa: E402
from zerobubble.interop import hf  # noqa: E402
from zerobubble.train.recipe import build_recipe, load_recipe  # noqa: E402
from zerobubble.train.trainer import prune  # noqa: E402

STEPS = 4
TIMEOUT = 600

RECIPE = """\
[job]
dump_folder = "{out}"

[model]
name = "{model}"

[optimizer]
lr = 3e-3

[lr_scheduler]
warmup_steps = 1
decay_type = "cosine"
min_lr_factor = 0.1

[training]
steps = 4
global_batch_size = 8
seq_len = 16
max_norm = 1.0
seed = 5

[parallelism]
pipeline_parallel_degree = 2
data_parallel_replicate_degree = {dp}
tensor_parallel_degree = {tp}
expert_parallel_degree = {ep}
pipeline_parallel_schedule = "ZBH1"
pipeline_parallel_microbatch_size = 2

[checkpoint]
enable = {ckpt}
interval = 2
keep_latest_k = 0
"""


def recipe(tmp: Path, name: str, model: Path, *, dp=1, tp=1, ep=1, ckpt=False, **keys):
    """The recipe of ``RECIPE`` (written and read back as a file, one per rank: ranks write at
    once) with ``keys`` over it."""
    import torch.distributed as dist

    path = tmp / f"{name}.{dist.get_rank() if dist.is_initialized() else 0}.toml"
    text = RECIPE.format(out=tmp / name, model=model, dp=dp, tp=tp, ep=ep, ckpt=str(ckpt).lower())
    path.write_text(text)
    return build_recipe({**load_recipe(path), **keys})


def four_ranks(tmp: str, llama: str, mixtral: str) -> dict:
    from zerobubble.runtime.launcher import init_distributed
    from zerobubble.train.trainer import train

    init_distributed()
    t = Path(tmp)
    out = {}
    exported = str(t / "export")
    run = recipe(t, "dp", Path(llama), dp=2, ckpt=True, **{"checkpoint.export_folder": exported})
    seen: list[list[dict]] = []  # metrics.jsonl as it stands at each progress line

    def watch(line: str) -> None:
        rows = (t / "dp" / "metrics.jsonl").read_text().splitlines()
        seen.append([json.loads(r) for r in rows])

    unbroken = train(run, return_state=True, write_line=watch)
    out["unbroken"] = (unbroken.losses, unbroken.lrs, unbroken.state)
    out["seen"] = seen
    killed = recipe(t, "killed", Path(llama), dp=2, ckpt=True)
    first = train(killed, stop_after=3)
    again = train(killed)
    out["killed"] = (first.losses, again.start, again.losses)
    out["tp"] = train(recipe(t, "tp", Path(llama), tp=2, **{"training.steps": 1})).losses
    auto = {"training.steps": 2, "parallelism.pipeline_parallel_schedule": "auto"}
    lines: list[str] = []
    done = train(recipe(t, "auto", Path(llama), dp=2, **auto), write_line=lines.append)
    out["auto"] = (done.losses, done.schedule, done.choice, lines)
    moe = recipe(t, "ep", Path(mixtral), dp=2, ep=2, **{"training.steps": 2})
    out["ep"] = train(moe).losses
    return out


def two_ranks(tmp: str, llama: str, whole: str) -> dict:
    import warnings

    import torch.distributed as dist

    from zerobubble.runtime.launcher import init_distributed
    from zerobubble.train.trainer import train

    init_distributed()
    t = Path(tmp)
    run = recipe(t, "dp1", Path(llama), ckpt=True, **{"checkpoint.load_step": 2})
    done = train(run, return_state=True)
    reference = by_hand(run, torch.load(whole), range(2, 4))
    export = {"checkpoint.load_step": 4, "checkpoint.export_folder": str(t / "export4")}
    exported = train(recipe(t, "dp1", Path(llama), ckpt=True, **export))
    short = {"training.steps": 2, "parallelism.pipeline_parallel_schedule": "DualPipeV"}
    plain = train(recipe(t, "plain", Path(llama), **short)).losses
    paired = train(recipe(t, "pairs", Path(llama), **short, **{"parallelism.overlap": True}))
    if dist.get_rank() == 0:  # step 4's checkpoint damaged: the newest that verifies is 2
        victim = sorted((t / "dp1" / "checkpoint" / "step_00000004").iterdir())[0]
        victim.write_bytes(bytes(len(victim.read_bytes())))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = train(recipe(t, "dp1", Path(llama), ckpt=True))
    said = [str(w.message) for w in caught if "newest checkpoint that verifies" in str(w.message)]
    return {
        "damaged": (again.start, again.losses, said),
        "pairs": (plain, paired.losses, paired.schedule),
        "start": done.start,
        "losses": done.losses,
        "lrs": done.lrs,
        "state": done.state,
        "reference": reference,
        "exported": (exported.start, exported.end, exported.losses),
    }


def by_hand(run, whole: dict, steps: range) -> tuple[dict, dict]:
    """The trainer's loop at ``run``'s mesh, started from the ``whole`` state by hand: every
    parameter and AdamW entry set from the checkpoint's stored whole tensors (what DCP
    assembled from the saving mesh), the LR schedule stepped to ``steps.start``; then the
    trainer's batches of ``steps``. Returns (losses, the parameters after)."""
    import warnings

    from zerobubble.executor import ExecutorOptions
    from zerobubble.optim.config import OptimConfig
    from zerobubble.parallel.mesh import build_mesh
    from zerobubble.train import trainer as tr
    from zerobubble.train.sources import model_source

    mesh = build_mesh(run.parallelism.pipeline_parallel_degree, run.parallelism.dp)
    source = model_source(run)
    options = ExecutorOptions(seed=run.training.seed)
    pipe = source.build("zb-h1", run.microbatches, mesh, options)
    pipe.load_state_dict({n: whole[f"model.{n}"] for n, _ in pipe.named_parameters()}, strict=False)
    o = run.optimizer
    opt = torch.optim.AdamW(pipe.parameters(), lr=o.lr, eps=o.eps, weight_decay=o.weight_decay)
    for n, p in pipe.named_parameters():
        opt.state[p] = {
            f: whole[f"optim.{n}.{f}"].clone() for f in ("step", "exp_avg", "exp_avg_sq")
        }
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, run.lr_factor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
        for _ in range(steps.start):
            lrs.step()
    pipe.set_optimizer(opt, OptimConfig(max_norm=run.training.max_norm))
    batches, losses = tr._batches(run, source), {}
    for k in steps:
        b = batches.batch(k, mesh.dp_rank, mesh.dp_size, run.local_batch_size)
        out = pipe.step(tr._inputs(b, source), target=b.labels)
        lrs.step()
        losses[k + 1] = tr._global_loss(out, mesh, torch.device("cpu"))
    pipe.drain()
    return losses, tr._whole(pipe, mesh)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    llama = hf.tiny_model("hf-llama", seed=1, num_hidden_layers=2)
    llama.save_pretrained(tmp / "llama", max_shard_size="100KB")
    mixtral = tmp / "mixtral"
    hf.tiny_model("hf-mixtral", seed=2, num_hidden_layers=2).save_pretrained(mixtral)
    four = launch(four_ranks, 4, str(tmp), str(tmp / "llama"), str(mixtral), timeout=TIMEOUT)
    shutil.copytree(tmp / "dp" / "checkpoint", tmp / "dp1" / "checkpoint")
    whole = tmp / "dp2_step2.pt"  # the checkpoint's stored whole tensors, read by DCP itself
    dcp_to_torch_save(tmp / "dp" / "checkpoint" / "step_00000002", whole)
    two = launch(two_ranks, 2, str(tmp), str(tmp / "llama"), str(whole), timeout=TIMEOUT)
    return tmp, four, two


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_bitwise(runs):
    _, four, _ = runs
    losses, lrs, _ = four[0]["unbroken"]
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(r["unbroken"][0] == losses for r in four)  # every rank reports the global loss
    assert losses[4] < losses[1]
    assert lrs[1] == pytest.approx(1.5e-3) and lrs[2] == 3e-3 and lrs[4] == pytest.approx(3e-4)
    first, start, again = four[0]["killed"]
    assert first == {k: losses[k] for k in (1, 2, 3)}
    assert start == 2  # the newest committed checkpoint; step 3 was lost with the "kill"
    assert again == {3: losses[3], 4: losses[4]}


@pytest.mark.slow
def test_auto_measures_the_plan_against_fixed_kinds_and_trains_as_the_chosen_one(runs):
    """Every kind trains this model bitwise alike (one cut per layer, microbatches summed in
    order), so the auto run's losses equal the ZB-H1 run's whichever candidate won: the trial
    steps (forward and backward, no optimizer step, on dropped pipelines) changed nothing."""
    tmp, four, _ = runs
    losses, _, _ = four[0]["unbroken"]
    got, schedule, choice, lines = four[0]["auto"]
    assert got == {1: losses[1], 2: losses[2]}
    tried = [t["kind"] for t in choice["trials"]]
    assert "auto" in tried and "1f1b" in tried and {"zbv", "interleaved-1f1b"} <= set(tried)
    assert schedule.startswith(choice["chosen"]) and choice["chosen"] in tried
    assert [t["kind"] for t in choice["trials"] if t["chosen"]] == [choice["chosen"]]
    assert all(len(t["step_ms"]) == 2 for t in choice["trials"])
    assert json.loads((tmp / "auto" / "schedule.json").read_text()) == choice
    assert lines[0].startswith("auto: median step auto ")
    assert (choice["warning"] is None) == (choice["chosen"] == "auto")


def test_the_auto_warning_names_the_plan_and_the_winner_with_their_times():
    from zerobubble.train.auto import _warning
    from zerobubble.train.trials import TrialResult

    plan = TrialResult("auto", 10.0, (0.030, 0.032), (0.030, 0.032), False)
    f1b = TrialResult("1f1b", 11.0, (0.020, 0.022), (0.020, 0.022), True)
    assert _warning([plan, f1b], "auto") == (
        "the plan (auto) lost to 1f1b in the trial: median step 31.0 ms against 21.0 ms; "
        "training with 1f1b"
    )
    won = TrialResult("auto", 10.0, (0.01,), (0.01,), True)
    assert _warning([won, replace(f1b, chosen=False)], "auto") == ""


@pytest.mark.slow
def test_tp_and_ep_meshes_train_the_directories(runs):
    _, four, _ = runs
    tp, dp = four[0]["tp"], four[0]["unbroken"][0]
    assert tp[1] == pytest.approx(dp[1], rel=1e-5)
    ep = four[0]["ep"]
    assert sorted(ep) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in ep.values())


@pytest.mark.slow
def test_resume_onto_another_dp_size_equals_that_mesh_started_from_the_saved_state(runs):
    """pp=2 x dp=1 resumed from the dp=2 run's step-2 checkpoint trains steps 3 and 4 bitwise
    as the trainer's loop at dp=1 started by hand from the checkpoint's whole tensors (every
    parameter and AdamW moment; the LR schedule at step 2): the trainer's resharded resume
    restores exactly the saved state, the schedule and the data position. Against the dp=2
    run itself it is only close (same global batches and learning rates; a dp=2 gradient is
    two replicas' sums added, another rounding)."""
    _, four, two = runs
    losses, lrs, _ = four[0]["unbroken"]
    assert two[0]["start"] == 2
    assert two[0]["lrs"] == {k: lrs[k] for k in (3, 4)}
    for part in two:
        ref_losses, ref_state = part["reference"]
        assert part["losses"] == ref_losses
        assert set(part["state"]) == set(ref_state)
        for name, value in part["state"].items():
            assert torch.equal(value, ref_state[name]), name
    for k in (3, 4):
        assert two[0]["losses"][k] == pytest.approx(losses[k], rel=1e-5)


@pytest.mark.slow
def test_a_checkpoint_exports_without_training_when_steps_is_its_step(runs):
    """``--checkpoint.load_step 4 --training.steps 4 --export DIR``: resumed at step 4, no
    step run, the directory holds the checkpoint's parameters."""
    tmp, _, two = runs
    assert two[0]["exported"] == (4, 4, {})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp / "export4").state_dict()
    trained = {n: t for part in two for n, t in part["state"].items()}
    assert set(trained) == set(loaded)
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.slow
def test_the_export_loads_with_from_pretrained_equal_to_the_trained_parameters(runs):
    tmp, four, _ = runs
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "export")
    loaded = model.state_dict()
    trained = {n: t for r in four for n, t in r["unbroken"][2].items()}
    assert set(trained) == set(loaded)
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
    before = hf.tiny_model("hf-llama", seed=1, num_hidden_layers=2).state_dict()
    assert not torch.equal(loaded["model.norm.weight"], before["model.norm.weight"])


def test_prune_keeps_the_newest_committed_steps(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}.json").write_text("{}")
    assert prune(tmp_path, 2) == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000004", "step_00000004.json", "step_00000006", "step_00000006.json",
    ]  # fmt: skip
    assert prune(tmp_path, 0) == []


def test_the_recipe_refuses_what_the_composition_table_refuses_before_any_rank_starts():
    """Every feature the recipe can switch on at once: refused with the table's reason where
    the table refuses a set inside it, accepted (and its features named) otherwise."""
    on = {
        f"parallelism.{k}": v
        for k, v in {
            "pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2,
            "tensor_parallel_degree": 2, "expert_parallel_degree": 2, "segments": 2,
            "overlap": True, "pipeline_parallel_schedule": "seq-zbv",
        }.items()
    } | {"activation_checkpoint.mode": "full"}  # fmt: skip
    everything = {"dp", "fsdp", "tp", "ep", "segments", "overlap", "recompute"}
    cell = composition.refusal(everything)
    if cell is None:
        assert build_recipe(on).features == everything
    else:
        with pytest.raises(ValueError, match=re.escape(cell.why)):
            build_recipe(on)


def test_the_example_recipe_parses():
    root = Path(__file__).resolve().parent.parent
    r = build_recipe(load_recipe(root / "examples" / "train.toml"))
    assert r.parallelism.world_size == 4 and r.checkpoint.enable


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--training.stepz", "3"], "did you mean '--training.steps'?"),
        (["--parallelism.pipeline_parallel_schedule", "ZBV2"], "is not a schedule"),
        (["--model.name", "/no/such/dir"], "is not a directory"),
        (["--model.name", "no_module:fn"], "cannot import fn from no_module"),
        (
            [
                "--training.global_batch_size",
                "6",
                "--parallelism.data_parallel_replicate_degree",
                "4",
            ],
            "the global batch must be dp x a multiple",
        ),
        (["--optimizer.name", "SGD"], "AdamW only"),
    ],
)
def test_bad_input_exits_2_naming_the_fix(argv, says, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerobubble train: error:") and says in err


def test_an_unknown_table_in_a_recipe_exits_2_from_the_command(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[trainig]\nsteps = 2\n")
    done = subprocess.run(
        [sys.executable, "-m", "zerobubble.cli", "train", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "'trainig' is not a section; did you mean 'training'?" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_the_metrics_stream_has_a_flushed_line_per_step_while_the_job_runs(runs):
    _, four, _ = runs
    seen = four[0]["seen"]
    losses = four[0]["unbroken"][0]
    # At step k's progress line the file already holds steps 1..k: written as the job runs.
    assert [[row["step"] for row in rows] for rows in seen] == [
        [1],
        [1, 2],
        [1, 2, 3],
        [1, 2, 3, 4],
    ]
    fields = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_ms", "mfu",
              "memory_gib", "time"}  # fmt: skip
    for row in seen[-1]:
        assert set(row) == fields
        assert row["loss"] == pytest.approx(losses[row["step"]], rel=1e-6)
        assert row["tokens"] == 8 * 16  # the global batch's tokens
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0 and row["memory_gib"] > 0
        assert row["mfu"] is None  # CPU: no peak FLOP/s known
    assert all(rank["seen"] == [] for rank in four[1:])  # only the lead rank writes


def test_dry_run_prices_a_directory_without_reading_it(tmp_path, capsys, monkeypatch):
    """The estimate of a directory (a meta model: no tensor read) equals the estimate of the
    same model built whole; the command exits 1 when a rank does not fit."""
    from zerobubble.train.dry_run import dry_run
    from zerobubble.train.estimate import estimate_memory

    model = hf.tiny_model("hf-llama", seed=1, num_hidden_layers=2)
    model.save_pretrained(tmp_path / "llama")
    from zerobubble.interop import hf_pretrained

    def no_read(*args, **kwargs):
        raise AssertionError("the dry run read a tensor")

    monkeypatch.setattr(hf_pretrained, "_read", no_read)
    run = recipe(tmp_path, "dry", tmp_path / "llama", dp=2)
    found = dry_run(run, device_bytes=10**9)
    ids = torch.zeros(2, 16, dtype=torch.long)
    whole = estimate_memory(
        hf.causal_lm_layers(model), hf.CausalLMLoss(model, ignore_index=-100), "zb-h1",
        {"input_ids": ids}, ids, pp=2, microbatches=2,
    )  # fmt: skip
    assert found.ranks == whole.ranks and found.fits()
    toml = tmp_path / "dry.0.toml"
    assert main(["train", "--config", str(toml), "--dry-run", "--device-memory", "1e9"]) == 0
    assert "memory estimate, zb-h1" in capsys.readouterr().out
    assert main(["train", "--config", str(toml), "--dry-run", "--device-memory", "1000"]) == 1
    assert "does not fit: rank(s) 0, 1" in capsys.readouterr().err


def test_the_bench_warns_when_its_plan_measured_slower_than_a_fixed_kind():
    from types import SimpleNamespace

    from zerobubble.train.console import plan_lost

    def phase(name, planned, *steps):
        return SimpleNamespace(name=name, planned=planned, step_time=sorted(steps)[1])

    fixed = [phase("1f1b", False, 0.030, 0.031, 0.032), phase("zb-h1", False, 0.028, 0.029, 0.05)]
    assert plan_lost([*fixed, phase("plan", True, 0.027, 0.0285, 0.04)]) == ""
    assert plan_lost([*fixed, phase("plan", True, 0.03, 0.0295, 0.02)]) == (
        "warning: the plan (plan) measured slower than zb-h1: median step 29.5 ms against "
        "29.0 ms; the profile may be off (a loaded machine): rerun, or train with the fixed kind"
    )
    assert plan_lost(fixed) == ""


def test_plan_profiles_ones_own_model_given_as_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_model.py").write_text(
        "from zerobubble.models import GPTConfig, build_gpt\n\n\n"
        "def layers():\n"
        "    return list(build_gpt(GPTConfig(vocab_size=256, d_model=32, n_heads=2, n_layers=4,"
        " max_seq_len=16)))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plan.csv"
    argv = ["plan", "--pp", "2", "--microbatches", "4", "--kind", "zb-h1", "--model",
            "my_model:layers", "--seq-len", "16", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    from zerobubble.schedule.formats import torch_csv

    sched = torch_csv.loads(out.read_text())
    assert (sched.num_devices, sched.num_microbatches) == (2, 4)


@pytest.mark.slow
def test_overlapped_pairs_train_bitwise_as_the_same_kind_without_them(runs):
    *_, two = runs
    plain, paired, name = two[0]["pairs"]
    assert name == "dualpipev" and sorted(paired) == [1, 2]
    assert paired == plain


def test_segments_and_overlap_build_their_kinds_or_are_refused_naming_those_that_take_them():
    from zerobubble.train.trainer import build_schedule

    base = {"training.global_batch_size": 8, "parallelism.pipeline_parallel_microbatch_size": 1}
    pairs = build_schedule(
        build_recipe(
            {
                **base,
                "parallelism.overlap": True,
                "parallelism.pipeline_parallel_schedule": "DualPipeV",
            }
        )
    )
    assert pairs.name == "dualpipev" and pairs.overlaps
    cut = build_schedule(
        build_recipe(
            {**base, "parallelism.segments": 2, "parallelism.pipeline_parallel_schedule": "seq-zb"}
        )
    )
    assert (cut.name, cut.segments, cut.num_microbatches) == ("seq-zb", 2, 8)
    with pytest.raises(ValueError, match="'ZBH1' takes no overlap; give a kind that does: dualp"):
        build_schedule(
            build_recipe(
                {
                    **base,
                    "parallelism.overlap": True,
                    "parallelism.pipeline_parallel_schedule": "ZBH1",
                }
            )
        )
    with pytest.raises(ValueError, match="'1F1B' takes no segments; give a kind that does: seq"):
        build_schedule(build_recipe({**base, "parallelism.segments": 2}))


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_resumes_from_the_newest_that_verifies(runs):
    *_, two = runs
    start, losses, said = two[0]["damaged"]
    assert start == 2 and losses == two[0]["losses"]  # bitwise the first resume from step 2
    assert len(said) == 1 and "resuming from step 2" in said[0]
