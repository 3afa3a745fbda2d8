"""The optimizer side of tensor parallelism: pp=2 x tp=2 on gloo (4 ranks, one launch).

Each rank's stages are parallelized with ``parallelize_module`` over the job mesh's "tp"
dim (sequence parallel: a ``SequenceParallel`` LayerNorm, whose gradients are partial
sums, a column-wise and a row-wise Linear, sharded on dims 0 and 1) before the executor
splits them. The reference is the same tensor-parallel model without pipelining on the
tp ranks only: plain autograd per microbatch (gradients summed in microbatch order),
``clip_grad_norm_`` over the DTensor parameters, AdamW, the step skipped when the norm
is not finite. Against it, bitwise (this rank's shards of parameters and AdamW state
after every iteration, and the norm every rank reports), under one fault plan with a
NaN on one tp rank only (stage 0, a partial-sum gradient), an Inf on the other tp rank
only (the last stage, a sharded gradient) and two clipped iterations:

* the synchronous step under zb-h1 and zbv (two stages per rank);
* conservative (zb-h1) and speculative (zb-h2) post-validation with snapshot rollback;
* a checkpoint saved after 4 iterations, loaded into a fresh trainer: the remaining
  iterations equal the uninterrupted run; it also loads into pipelines without tp;
* the same through the job mesh (``build_mesh(2, tp=2, sequence_parallel=True)``,
  ``Pipeline(..., mesh=, tp_plan=)``, ``set_optimizer``, ``save_checkpoint`` and
  ``load_checkpoint`` with ``mesh=``): the trainer's tp mesh is the mesh's, the record
  notes tp_size 2 and the per-rank entries are keyed by tp rank, and the run and its
  resumption are bitwise the reference too.

Speculative post-validation with the inverse rollback is not bitwise by construction
(docs/optim.md, "Rollback numerics"): within 1e-5 relative of the synchronous run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ranks import launch
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.optim.checkpoint import load_checkpoint, save_checkpoint
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import FaultPlan, GradFault
from zerobubble.optim.trainer import PipelineTrainer, tp_mesh_of
from zerobubble.parallel.mesh import PipelineMesh, build_mesh
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.pipeline import Pipeline
from zerobubble.reference.step import reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.schedule.generators import generate

pytestmark = pytest.mark.slow

PP, TP, M, ITERS = 2, 2, 4, 7
D, T, LAYERS = 8, 4, 4  # width, sequence length (T / TP per tp rank), blocks
MAX_NORM = 5.0  # above this model's norms (<= 1.7) unless a fault scales them
INVERSE_TOL = 1e-5
SAVE_AT = 4


class Block(nn.Module):
    """x + fc2(gelu(fc1(ln(x)))); ``ln_first``: the LayerNorm's parameters come first (a
    fault then hits its partial-sum gradient, else fc1's sharded one)."""

    def __init__(self, seed: int, ln_first: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        if ln_first:
            self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        if not ln_first:
            self.ln = nn.LayerNorm(D)
        with torch.no_grad():  # a LayerNorm not at its initial values: nonzero gradients
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


PLAN = {
    "ln": SequenceParallel(),
    "fc1": ColwiseParallel(input_layouts=Shard(1)),
    "fc2": RowwiseParallel(output_layouts=Shard(1)),
}
STAGE_PLAN = {f"*.{name}": style for name, style in PLAN.items()}
"""PLAN for every block of a stage module (``Pipeline``'s ``tp_plan``)."""


def layers() -> list[nn.Module]:
    return [Block(i, ln_first=i == 0) for i in range(LAYERS)]


def parallelize(blocks: nn.Module, tp: DeviceMesh) -> None:
    for block in blocks.children():
        parallelize_module(block, tp, dict(PLAN))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This tp rank's share of the mean squared error: its sequence shard's sum over the
    global element count (the tp ranks' losses sum to the whole mean)."""
    return (out - target).pow(2).sum() / (out.numel() * TP)


def batch(i: int, tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Iteration ``i``'s batch, this tp rank's sequence shard (dim 1)."""
    gen = torch.Generator().manual_seed(1000 + i)
    x, y = (torch.randn(2 * M, T, D, generator=gen) for _ in range(2))
    return tuple(t.chunk(TP, dim=1)[tp_rank].contiguous() for t in (x, y))  # type: ignore[return-value]


def faults(tp_rank: int, last: int) -> FaultPlan:
    """This tp rank's faults: a NaN on tp rank 0 only, an Inf on tp rank 1 only, clips."""
    one = (
        (GradFault(1, 0, mb=1, kind="nan"),)  # stage 0: ln.weight, a partial sum
        if tp_rank == 0
        else (GradFault(3, last, mb=2, kind="inf"),)  # last stage: fc1.weight, sharded
    )
    return FaultPlan(
        grads=(
            *one,
            GradFault(4, last, kind="scale", factor=1e3),  # clip once the last stage adds in
            GradFault(5, 0, kind="scale", factor=1e3),  # clip known early: rank 0 defers
        )
    )


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of the parameters and their AdamW state, flattened in order."""
    out = []
    for p in params:
        out.append(local(p))
        out += [local(v) for _, v in sorted(opt.state.get(p, {}).items())]
    return out


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)


def reference(tp: DeviceMesh, num_stages: int) -> tuple[list[list], list[float]]:
    """The tp model without pipelining; per iteration each parameter's snapshot and the
    norm. Stage boundaries only place the faults (equal layer counts)."""
    blocks = nn.Sequential(*layers())
    parallelize(blocks, tp)
    per = LAYERS // num_stages
    stage_params = {
        s: [p for b in list(blocks)[s * per : (s + 1) * per] for p in b.parameters()]
        for s in range(num_stages)
    }
    params = list(blocks.parameters())
    opt = adamw(params)
    plan = faults(tp.get_local_rank(), num_stages - 1)
    snaps, norms = [], []
    for i in range(ITERS):
        for p in params:
            p.grad = None
        x, y = batch(i, tp.get_local_rank())
        reference_step(blocks, loss_fn, x, target=y, microbatches=M)
        for f in plan.grads:  # a microbatch's NaN/Inf lands in the sum as it does at the tail
            if f.iteration == i and f.mb is not None:
                f.apply(stage_params[f.stage])
        plan.at_tail(i, stage_params)
        total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        if torch.isfinite(total):
            opt.step()
        norms.append(float(total))
        snaps.append([snapshot([p], opt) for p in params])
    return snaps, norms


def run(
    kind: str,
    cfg: OptimConfig,
    pp_group: dist.ProcessGroup,
    tp: DeviceMesh,
    *,
    iters: range = range(ITERS),
    root: str | None = None,
    tensor_parallel: bool = True,
    mesh: PipelineMesh | None = None,
) -> tuple[PipelineTrainer, dict[int, list], list]:
    """Train ``iters``; loads from ``root`` first when ``iters`` does not start at 0, saves
    to it after iteration SAVE_AT - 1 otherwise. With ``mesh``: through ``Pipeline`` on
    it (which parallelizes the stages), else on stages parallelized by hand."""
    sched = generate(kind, PP, M)
    options = ExecutorOptions(comm_timeout_s=60, trace=False)
    front: Pipeline | None = None
    if mesh is not None:
        front = Pipeline(layers(), loss_fn, sched, mesh=mesh, tp_plan=STAGE_PLAN, options=options)
        params = list(front.parameters())
    else:
        stages = build_stage_modules(layers(), sched, dist.get_rank(pp_group))
        if tensor_parallel:
            for m in stages.values():
                parallelize(m, tp)
        pipe = PipelineExecutor(sched, stages, loss_fn=loss_fn, group=pp_group, options=options)
        params = [q for s in sorted(pipe.chunks) for q in pipe.chunks[s].module.parameters()]
    opt = adamw(params)
    snaps: dict[int, list] = {}
    commits = []

    def record(c) -> None:
        snaps[c.iteration] = [snapshot([p], opt) for p in params]
        commits.append(c)

    plan = faults(tp.get_local_rank(), sched.num_stages - 1)
    if front is not None:
        trainer = front.set_optimizer(opt, cfg, faults=plan, on_commit=record)
    else:
        trainer = PipelineTrainer(pipe, opt, cfg, faults=plan, on_commit=record)
    if iters.start:
        assert root is not None
        load_checkpoint(trainer, root, mesh=mesh)
    for i in iters:
        x, y = batch(i, tp.get_local_rank())
        (trainer if front is None else front).step(x, target=y)
        if root is not None and not iters.start and i + 1 == SAVE_AT:
            save_checkpoint(trainer, root, mesh=mesh)
    trainer.drain()
    return trainer, snaps, commits


def differences(name: str, trainer: PipelineTrainer, snaps: dict, ref: list, tol=None):
    """This rank's parameters against the reference's (by model slot); problems, worst."""
    bad, worst = [], 0.0
    for it, mine in sorted(snaps.items()):
        slots = [
            trainer.layout.first[s] + j
            for s in sorted(trainer.stage_params)
            for j in range(len(trainer.stage_params[s]))
        ]
        for slot, got in zip(slots, mine, strict=True):
            for a, b in zip(got, ref[it][slot], strict=True):
                if torch.equal(a, b):
                    continue
                err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
                worst = max(worst, err)
                if tol is None or not err <= tol:
                    bad.append(f"{name}: iteration {it} slot {slot}: relative difference {err:.3g}")
    return bad, worst


def job(root: str) -> dict:
    init_distributed(timeout_s=120)
    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    pp_group, tp = mesh.get_group("pp"), mesh["tp"]
    out: dict = {"bad": [], "commits": {}, "norms": {}}
    sync = OptimConfig(max_norm=MAX_NORM)
    refs = {s: reference(tp, s) for s in (2, 4)}
    cases = {
        "sync/zb-h1": ("zb-h1", sync, None),
        "sync/zbv": ("zbv", sync, None),
        "cons/zb-h1": ("zb-h1", OptimConfig(mode="conservative", max_norm=MAX_NORM), None),
        "spec/zb-h2": ("zb-h2", OptimConfig(mode="speculative", max_norm=MAX_NORM), None),
        "spec-inverse/zb-h2": (
            "zb-h2",
            OptimConfig(mode="speculative", max_norm=MAX_NORM, rollback="inverse"),
            INVERSE_TOL,
        ),
    }
    for name, (kind, cfg, tol) in cases.items():
        trainer, snaps, commits = run(
            kind, cfg, pp_group, tp, root=root if name == "sync/zb-h1" else None
        )
        ref, norms = refs[generate(kind, PP, M).num_stages]
        bad, worst = differences(name, trainer, snaps, ref, tol)
        out["bad"] += bad
        out[f"worst/{name}"] = worst
        out["commits"][name] = [(c.iteration, c.action.value, repr(c.total_norm)) for c in commits]
        out["norms"][name] = [repr(n) for n in norms]
    # Resume from the checkpoint saved after SAVE_AT iterations of sync/zb-h1.
    trainer, snaps, _ = run("zb-h1", sync, pp_group, tp, iters=range(SAVE_AT, ITERS), root=root)
    out["resumed"] = sorted(snaps)
    out["bad"] += differences("resumed", trainer, snaps, refs[2][0])[0]
    # The tp checkpoint loads into pipelines without tp (resharded: tests/test_reshard.py
    # shows such resumes bitwise the target's run from the whole state) and trains on.
    _, plain, _ = run(
        "zb-h1",
        sync,
        pp_group,
        tp,
        iters=range(SAVE_AT, ITERS),
        root=root,
        tensor_parallel=False,
    )
    out["no-tp resumed"] = sorted(plain)
    # The same through the job mesh, saved and resumed under its own root.
    mesh = build_mesh(PP, tp=TP, sequence_parallel=True)
    assert mesh.tp_mesh is not None
    at = f"{root}/mesh"
    trainer, snaps, commits = run("zb-h1", sync, mesh.pp_group, mesh.tp_mesh, root=at, mesh=mesh)
    out["tp mesh is the mesh's"] = trainer.layout.tp_mesh == mesh.tp_mesh
    out["bad"] += differences("mesh", trainer, snaps, refs[2][0])[0]
    out["commits"]["mesh"] = [(c.iteration, c.action.value, repr(c.total_norm)) for c in commits]
    out["norms"]["mesh"] = [repr(n) for n in refs[2][1]]
    record = json.loads(Path(at, "manifest.json").read_text())
    out["mesh record"] = (record["tp_size"], record["dp_size"])
    stored = FileSystemReader(Path(at, record["path"])).read_metadata().state_dict_metadata
    out["mesh own keys"] = sorted(k for k in stored if k.endswith(".meta"))
    trainer, snaps, _ = run(
        "zb-h1", sync, mesh.pp_group, mesh.tp_mesh, iters=range(SAVE_AT, ITERS), root=at, mesh=mesh
    )
    out["mesh resumed"] = sorted(snaps)
    out["bad"] += differences("mesh resumed", trainer, snaps, refs[2][0])[0]
    elsewhere = DTensor.from_local(torch.zeros(2), mesh.mesh["pp"], [Shard(0)], run_check=False)
    try:  # parameters on another mesh than the job mesh's tp dim
        tp_mesh_of(mesh.pp_rank, [elsewhere], mesh)
    except ValueError as e:
        out["other mesh"] = str(e)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(job, PP * TP, str(tmp_path_factory.mktemp("tp_ckpt")), timeout=600.0)


def summary(bad: list[str]) -> dict:
    """``case it <iteration>`` -> the slots that differ (a short failure message)."""
    out: dict = {}
    for b in bad:
        name, rest = b.split(": ", 1)
        it = rest.split()[1]
        out.setdefault(f"{name} it {it}", set()).add(int(rest.split()[3].rstrip(":")))
    return out


def test_tp_optimizer_bitwise_against_the_tp_reference(results):
    for r, res in enumerate(results):
        assert res["bad"] == [], (r, summary(res["bad"]))
        assert res["worst/spec-inverse/zb-h2"] <= INVERSE_TOL


def test_every_rank_decides_alike_and_faults_on_one_tp_rank_skip_everywhere(results):
    want = ["step", "skip", "step", "skip", "clip", "clip", "step"]
    for name in results[0]["commits"]:
        commits = [res["commits"][name] for res in results]
        assert [a for _, a, _ in commits[0]] == want, (name, commits[0])
        assert all(c == commits[0] for c in commits), name  # actions and norms, every rank
        if not name.startswith("spec-inverse"):  # the inverse is not bitwise (see above)
            assert [n for _, _, n in commits[0]] == results[0]["norms"][name], name


def test_checkpoint_resumes_bitwise_and_loads_into_another_tp_size(results):
    for res in results:
        assert res["resumed"] == res["mesh resumed"] == list(range(SAVE_AT, ITERS))
        assert res["tp mesh is the mesh's"]
        assert res["mesh record"] == (TP, 1)
        assert res["mesh own keys"] == [f"rank{d}.tp{t}.meta" for d in range(PP) for t in range(TP)]
        assert "not on the job mesh's tp dim" in res["other mesh"], res["other mesh"]
        assert res["no-tp resumed"] == list(range(SAVE_AT, ITERS))
