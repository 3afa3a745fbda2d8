"""``import zerobubble``: the public names, torch-free schedule names, and :class:`Pipeline`
on 3 gloo ranks, bitwise equal to single-process training under the model's own names."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn

import zerobubble
from ranks import launch
from zerobubble.models import GPTConfig, build_gpt, gpt_loss, mlp_loss
from zerobubble.optim.trainer import stage_kwargs

TIMEOUT = 240.0
SCHEDULE_NAMES = [
    "Action",
    "CostModel",
    "GENERATORS",
    "Op",
    "Schedule",
    "ScheduleError",
    "SegmentCost",
    "SimResult",
    "balanced_cuts",
    "equal_token_cuts",
    "generate",
    "load_schedule",
    "save_schedule",
    "simulate",
    "validate",
]


def test_import_and_schedule_names_leave_torch_out():
    names = ", ".join(f"zerobubble.{n}" for n in [*SCHEDULE_NAMES, "init_distributed"])
    code = (
        f"import sys, zerobubble; {names}; "
        "s = zerobubble.generate('zb-h1', 3, 4); zerobubble.validate(s); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_every_public_name_resolves_and_unknown_names_fail():
    assert set(zerobubble.__all__) == set(zerobubble._WHERE) and "Pipeline" in zerobubble.__all__
    assert set(SCHEDULE_NAMES) < set(zerobubble.__all__)
    for name in zerobubble.__all__:
        assert getattr(zerobubble, name) is not None, name
    from zerobubble.optim.trainer import PipelineTrainer
    from zerobubble.runtime.launcher import launch

    assert zerobubble.PipelineTrainer is PipelineTrainer and zerobubble.launch_local is launch
    assert dir(zerobubble) == sorted(zerobubble.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Pipelin'"):
        _ = zerobubble.Pipelin


def test_version_and_typing_marker_ship_with_the_package():
    from importlib.metadata import version
    from pathlib import Path

    assert zerobubble.__version__ == version("zerobubble")
    out = subprocess.run(
        [sys.executable, "-m", "zerobubble.cli", "--version"], capture_output=True, text=True
    )
    assert (out.returncode, out.stdout.strip()) == (0, f"zerobubble {zerobubble.__version__}")
    assert (Path(zerobubble.__file__).parent / "py.typed").is_file()  # PEP 561


def test_pipeline_needs_torch_distributed():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"not initialised: call zerobubble.init_distributed"):
        zerobubble.Pipeline(named_mlp(), mlp_loss, "zb-h1", microbatches=2)


# ---- run inside the ranks ------------------------------------------------------------------


def gpt_case(seed: int = 0):
    cfg = GPTConfig(vocab_size=17, max_seq_len=6, d_model=8, n_heads=2, n_layers=4, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [
        (torch.randint(0, 17, (9, 6), generator=gen), torch.randint(0, 17, (9, 6), generator=gen))
        for _ in range(2)
    ]
    return build_gpt(cfg), gpt_loss, batches


def named_mlp(seed: int = 0) -> nn.Sequential:
    """Seven layers with user-chosen names and nested parameters (6 stages of zbv at P=3)."""
    torch.manual_seed(seed)
    layers = [("embed", nn.Linear(4, 6))]
    layers += [(f"block{i}", nn.Sequential(nn.Linear(6, 6), nn.Tanh())) for i in range(5)]
    layers.append(("head", nn.Linear(6, 3)))
    return nn.Sequential(OrderedDict(layers))


def mlp_case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [
        (torch.randn(11, 4, generator=gen), torch.randn(11, 3, generator=gen)) for _ in range(2)
    ]
    return named_mlp(seed), mlp_loss, batches


def train_against_reference(
    kind: str, case, make_opt, max_norm: float | None, mode: str = "sync"
) -> dict:
    """Optimizer steps through Pipeline and through plain autograd; what differed.

    Sync steps are final when ``step`` returns: gradients and parameters are compared
    after each. Post-validation steps are final at the drain: parameters are compared there.
    """
    model, loss_fn, batches = case()
    ref = copy.deepcopy(model)
    m = 4
    pipe = zerobubble.Pipeline(model, loss_fn, zerobubble.generate(kind, 3, m))
    config = zerobubble.OptimConfig(mode=mode, max_norm=max_norm)
    pipe.set_optimizer(make_opt(pipe.parameters()), config)
    ref_opt = make_opt(ref.parameters())
    ref_params = dict(ref.named_parameters())
    bad = []
    for step, (x, y) in enumerate(batches):
        losses: list[torch.Tensor] = []
        returned = pipe.step(x, target=y, losses=losses)
        ref_losses, _ = zerobubble.reference_step(ref, loss_fn, x, y, m)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        if pipe.executor.has_last:
            if returned != losses or not all(map(torch.equal, losses, ref_losses)):
                bad.append(f"{kind} step {step}: losses {losses} != {ref_losses}")
        elif returned is not None or losses:
            bad.append(f"{kind} step {step}: rank {pipe.rank} returned losses")
        if mode != "sync":
            continue
        for name, p in pipe.named_parameters():
            ref_grad = ref_params[name].grad  # after clipping, as the trainer leaves it
            if p.grad is None or not torch.equal(p.grad, ref_grad):
                bad.append(f"{kind} step {step}: gradient of {name} differs")
            if not torch.equal(p, ref_params[name]):
                bad.append(f"{kind} step {step}: parameter {name} differs")
    pipe.drain()
    bad += [
        f"{kind} after the drain: parameter {name} differs"
        for name, p in pipe.named_parameters()
        if not torch.equal(p, ref_params[name])
    ]
    x, y = batches[0]
    for name in ("hooks", "losses"):
        try:
            pipe.trainer.step(x, target=y, **{name: None})
        except ValueError as e:
            if name not in str(e) or "PipelineTrainer.step()" not in str(e):
                bad.append(f"{kind}: trainer refusal of {name!r} says {e}")
        else:
            bad.append(f"{kind}: PipelineTrainer.step took a stage-0 keyword {name!r}")
    return {
        "names": [n for n, _ in pipe.named_parameters()],
        "keys": list(pipe.state_dict()),
        "bad": bad,
        "version": pipe.executor.param_version,
    }


def state_dict_checks(rank: int) -> dict:
    """Save/load keyed by the model's names; strict errors name keys and stages."""
    model = named_mlp(0)
    pipe = zerobubble.Pipeline(model, mlp_loss, "zbv", microbatches=3)
    other = named_mlp(1).state_dict()
    pipe.load_state_dict(other)  # the whole model's dict: each rank takes its keys
    bad = [k for k, v in pipe.state_dict().items() if not torch.equal(v, other[k])]
    own = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.load_state_dict(model.state_dict())
    pipe.load_state_dict(own)  # this rank's part alone is complete for this rank
    bad += [k for k, v in pipe.state_dict().items() if not torch.equal(v, own[k])]
    errors = {}
    first = next(iter(own))
    partial = {k: v for k, v in own.items() if k != first}
    for what, sd in {
        "missing": partial,
        "unexpected": {**own, "block9.0.weight": torch.zeros(1)},
        "shape": {**own, first: torch.zeros(2, 2, 2)},
    }.items():
        try:
            pipe.load_state_dict(sd)
        except ValueError as e:
            errors[what] = str(e)
    pipe.load_state_dict(partial, strict=False)
    stage_of_first = min(pipe.executor.chunks)
    try:
        pipe.set_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as e:
        errors["optimizer"] = str(e)
    try:
        pipe.step(torch.zeros(3, 4), target=torch.zeros(3, 3), hooks=None)
    except ValueError as e:
        errors["hooks"] = str(e)
    for what, schedule in (("kind", "zbv"), ("world", zerobubble.generate("zb-h1", 2, 4))):
        try:
            zerobubble.Pipeline(model, mlp_loss, schedule)
        except ValueError as e:
            errors[what] = str(e)
    return {
        "bad": bad,
        "errors": errors,
        "first": first,
        "stage": stage_of_first,
        "stages": sorted(pipe.executor.chunks),
    }


def factory_names() -> list[str]:
    """A factory's layers are named by their index."""
    layers = list(named_mlp(0))
    pipe = zerobubble.Pipeline(
        lambda i: layers[i], mlp_loss, "1f1b", microbatches=3, num_layers=len(layers)
    )
    return [n for n, _ in pipe.named_parameters()]


def auto_within_the_layers() -> dict:
    """``"auto"`` over named_mlp's 7 layers at P=3, M=4: the search keeps within them
    (it chose 4 chunks per device, 12 stages, before Pipeline passed the layer count)."""
    model, loss_fn, batches = mlp_case()
    ref = copy.deepcopy(model)
    pipe = zerobubble.Pipeline(model, loss_fn, "auto", microbatches=4)
    x, y = batches[0]
    losses = pipe.step(x, target=y)
    ref_losses, _ = zerobubble.reference_step(ref, loss_fn, x, y, 4)
    equal = losses is None or all(map(torch.equal, losses, ref_losses))
    return {"stages": pipe.schedule.num_stages, "equal": equal}


def job() -> dict:
    info = zerobubble.init_distributed(timeout_s=60)

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)

    def sgd(ps):
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9)

    out = {
        "gpt": train_against_reference("zb-h1", gpt_case, adamw, max_norm=0.5),
        "mlp_v": train_against_reference("zbv", mlp_case, sgd, max_norm=None),
        "post": train_against_reference(
            "zb-h2", gpt_case, adamw, max_norm=0.05, mode="conservative"
        ),
        "factory": factory_names(),
        "state": state_dict_checks(info.rank),
        "auto": auto_within_the_layers(),
    }
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def p3():
    return launch(job, 3, timeout=TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gpt", "mlp_v", "post"])
def test_pipeline_matches_single_process_training_under_model_names(p3, case):
    full = named_mlp() if case == "mlp_v" else gpt_case()[0]
    results = [r[case] for r in p3]
    assert [b for r in results for b in r["bad"]] == []
    names = [n for r in results for n in r["names"]]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())  # each on one rank
    keys = [k for r in results for k in r["keys"]]
    assert sorted(keys) == sorted(full.state_dict())
    assert all(r["version"] == 2 for r in results)  # the trainer bumped it, twice


@pytest.mark.slow
def test_pipeline_auto_keeps_within_the_layer_count(p3):
    assert [r["auto"] for r in p3] == [{"stages": 6, "equal": True}] * 3


@pytest.mark.slow
def test_layers_keep_their_names(p3):
    # zb-h1 at P=3 over the GPT's 7 layers: [0, 1], [2, 3, 4], [5, 6] (interior stages grow
    # first); the names are the nn.Sequential's, not "<index in the stage>.<name>".
    gpt = [r["gpt"]["names"] for r in p3]
    assert gpt[0][:2] == ["0.tok.weight", "0.pos.weight"]
    assert gpt[1][0] == "2.ln1.weight" and "3.attn.q.weight" in gpt[1]
    assert gpt[2][-3:] == ["5.weight", "5.bias", "6.weight"]
    # zbv at P=3: rank 0 holds stages 0 and 5, i.e. layer "embed" and layer "head".
    assert p3[0]["mlp_v"]["names"] == ["embed.weight", "embed.bias", "head.weight", "head.bias"]
    assert p3[1]["mlp_v"]["names"][:2] == ["block0.0.weight", "block0.0.bias"]
    # 1f1b at P=3 over 7 layers from a factory: [0, 1], [2, 3, 4], [5, 6].
    assert p3[1]["factory"] == [f"{i}.0.{w}" for i in (2, 3, 4) for w in ("weight", "bias")]


@pytest.mark.slow
def test_state_dict_round_trip_and_strict_errors(p3):
    for rank, r in enumerate(p3):
        s = r["state"]
        assert s["bad"] == []
        first, errors = s["first"], s["errors"]
        assert errors["missing"] == (
            f"load_state_dict: missing keys of stage {s['stage']} (rank {rank}): {first!r} "
            "(keys are the user's model's state_dict keys, e.g. '0.weight'; pass "
            "strict=False to load a partial state dict)"
        )
        assert (
            "unexpected keys held by no stage of the model: 'block9.0.weight'"
            in (errors["unexpected"])
        )
        assert (
            f"entry {first!r} has shape (2, 2, 2) but stage {s['stage']} (rank {rank})"
            in (errors["shape"])
        )
        assert "schedule 'zbv' is a kind: pass microbatches=" in errors["kind"]
        assert errors["world"] == (
            "schedule 'zb-h1' needs 2 ranks but the process group has 3; launch with -n 2"
        )
        assert errors["optimizer"] == (
            f"the optimizer holds 14 parameters that rank {rank}'s stages do not: build it "
            "from pipe.parameters() (the stages' own copies), not from the model"
        )
        assert errors["hooks"] == (
            "Pipeline.step() keyword argument(s) hooks are reserved for the runtime "
            "(PipelineExecutor.step's own); rename the stage-0 argument or pass it positionally"
        )
    assert p3[0]["state"]["first"] == "embed.weight" and p3[0]["state"]["stages"] == [0, 5]


@pytest.mark.parametrize("names", [["hooks"], ["losses", "hooks"]])
def test_stage_kwargs_refuse_the_executors_own_names(names):
    kwargs = {"mask": 1, **dict.fromkeys(names)}
    with pytest.raises(ValueError) as e:
        stage_kwargs(kwargs, "Pipeline.step")
    assert str(e.value) == (
        f"Pipeline.step() keyword argument(s) {', '.join(sorted(names))} are reserved for the "
        "runtime (PipelineExecutor.step's own); rename the stage-0 argument or pass it positionally"
    )
    assert stage_kwargs({"mask": 1, "mb_size": 2}, "x") == {"mask": 1, "mb_size": 2}
