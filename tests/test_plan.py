"""``zerobubble plan``: a schedule as the CSV PyTorch's own pipelining runtime reads
(torchtitan's ``pipeline_parallel_schedule_csv``), and that runtime training with it.

One launch of 2 gloo ranks: ``torch.distributed.pipelining``'s ``_PipelineScheduleRuntime``
loads the ZB-H1 and the ZB-V CSVs the command wrote (``_load_csv``, as torchtitan does) and
trains an 8-layer Linear/GELU stack 3 SGD steps with each; the losses and the parameters
equal a single-process reference's (allclose: PyTorch's runtime, not ours, sums the
microbatches' gradients). Bad input exits 2 naming the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ranks import launch
from zerobubble.cli import main
from zerobubble.schedule.formats import torch_csv
from zerobubble.schedule.generators import generate

P, M, STEPS, LAYERS, D = 2, 4, 3, 8, 16


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # argparse's refusals
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_writes_pytorchs_csv_of_the_schedule(tmp_path, capsys):
    code, out, err = plan(capsys, "--pp", "2", "--microbatches", "4", "--kind", "zb-h1")
    assert code == 0
    assert torch_csv.loads(out, name="zb-h1") == generate("zb-h1", 2, 4)
    assert out.splitlines()[0] == "0F0,0F1,0I0,0W0,0F2,0I1,0W1,0F3,0I2,0W2,0I3,0W3"
    assert "bubble rate 7.7%" in err  # 1/13 at unit costs
    target = tmp_path / "zbv.csv"
    assert (
        plan(capsys, "--pp", "2", "--microbatches", "4", "--kind", "zbv", "-o", str(target))[0] == 0
    )
    assert torch_csv.load(target, name="zbv") == generate("zbv", 2, 4)
    # Profiled here on a tiny Llama (times vary, the schedule's shape does not).
    code, out, err = plan(
        capsys, "--pp", "2", "--microbatches", "4", "--model", "hf-llama", "--seq-len", "16"
    )
    assert code == 0 and "hf-llama profiled here" in err
    sched = torch_csv.loads(out, num_microbatches=4)
    assert sched.num_devices == 2 and sched.num_stages == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pp", "0", "--microbatches", "4"], "expected an integer >= 1"),
        (["--pp", "2", "--microbatches", "4", "--kind", "seq1f1b"], "pick a kind without"),
        (["--pp", "2", "--microbatches", "4", "--model", "nope"], "neither a shipped tiny"),
        (["--pp", "2", "--microbatches", "4", "--model", "a", "--costs-file", "b"], "not allowed"),
        (
            ["--pp", "8", "--microbatches", "8", "--kind", "zbv", "--model", "hf-llama"],
            "more than max_stages",
        ),
        (
            ["--pp", "4", "--microbatches", "8", "--kind", "zb-h1", "--mem-limit", "2"],
            "raise the limit",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_fix(capsys, argv, message):
    code, _, err = plan(capsys, *argv)
    assert code == 2 and message in err, err


def test_a_costs_file_of_another_stage_count_is_refused(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text('{"F": [1, 1, 1], "B": [1, 1, 1], "W": [1, 1, 1]}')
    code, _, err = plan(capsys, "--pp", "2", "--microbatches", "4", "--costs-file", str(costs))
    assert code == 2 and "describes 3 virtual stages, which is no placement of 2 devices" in err
    argv = ("--pp", "2", "--microbatches", "4", "--kind", "zb-h1", "--costs-file", str(costs))
    code, _, err = plan(capsys, *argv)
    assert code == 2 and "describes 3 virtual stages but the schedule has 2" in err


def stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(LAYERS)))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, D, generator=gen), torch.randn(8, D, generator=gen)) for _ in range(STEPS)
    ]


def torch_job(csvs: dict[str, str]) -> dict[str, dict]:
    """Every CSV run by PyTorch's runtime on this rank's stages (placed as the CSV says)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    import zerobubble

    zerobubble.init_distributed()
    rank = dist.get_rank()
    out = {}
    for name, path in csvs.items():
        sched = torch_csv.load(path)
        model = stack()
        bounds = [
            range(s * LAYERS // sched.num_stages, (s + 1) * LAYERS // sched.num_stages)
            for s in range(sched.num_stages)
        ]
        mine = sched.stages_of_device[rank]
        stages = [
            PipelineStage(
                nn.Sequential(*(model[i] for i in bounds[s])),
                s,
                sched.num_stages,
                torch.device("cpu"),
            )
            for s in mine
        ]
        runtime = _PipelineScheduleRuntime(stages, n_microbatches=M, loss_fn=nn.functional.mse_loss)
        runtime._load_csv(path)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for x, y in batches():
            opt.zero_grad()
            got: list[torch.Tensor] = []
            args = (x,) if 0 in mine else ()
            last = sched.num_stages - 1 in mine
            runtime.step(*args, target=y if last else None, losses=got if last else None)
            opt.step()
            if last:
                losses.append(torch.stack(got).mean().item())
        params = {
            f"{i}": [p.detach().clone() for p in model[i].parameters()]
            for s in mine
            for i in bounds[s]
        }
        out[name] = {"losses": losses, "params": params}
    return out


def reference() -> tuple[list[float], nn.Sequential]:
    model = stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.slow
def test_pytorchs_runtime_trains_with_the_planned_csv(tmp_path, capsys):
    csvs = {}
    for kind in ("zb-h1", "zbv"):
        path = tmp_path / f"{kind}.csv"
        code, _, _ = plan(
            capsys, "--pp", str(P), "--microbatches", str(M), "--kind", kind, "-o", str(path)
        )
        assert code == 0
        csvs[kind] = str(path)
    ranks = launch(torch_job, P, csvs, timeout=240)
    want, model = reference()
    for kind in csvs:
        last = torch_csv.load(csvs[kind]).placement[-1]
        assert ranks[last][kind]["losses"] == pytest.approx(want, rel=1e-5)
        assert want[-1] < want[0]  # it trained
        for r in ranks:
            for i, params in r[kind]["params"].items():
                for got, exp in zip(params, model[int(i)].parameters(), strict=True):
                    torch.testing.assert_close(got, exp.detach())
