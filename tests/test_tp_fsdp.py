"""FSDP on dp with tensor parallelism: pp=2 x dp=2 x tp=2 on gloo (8 ranks, one launch).

``build_mesh(2, 2, tp=2, fsdp=True)``: each stage is parallelized over the mesh's "tp"
dim, then FSDP2 shards it over the "dp" dim of the same mesh, so a tensor-parallel
parameter becomes a ``(Shard over dp, tp placement)`` DTensor on ``("dp", "tp")`` and a
plain one (the LayerNorms, which this plan leaves replicated) a ``Shard`` DTensor on
``("dp",)``. Four zb-h1 iterations with AdamW: a step, a NaN in one rank's gradient
shard (pp 0, dp 1, tp 1) skipped everywhere, a step, a step clipped by a scaled
gradient. References:

* ``ddp``: the same run with ``fsdp=False`` (the dp all-reduce of whole DTensor
  gradients, the norm over dp-reduced, tp-sharded gradients) is bitwise the tp
  reference of each replica's batch (:func:`tp_reference_step` on the tp ranks, the two
  replicas' gradients summed and halved: exact, a power of two), with the norm of
  ``get_total_norm`` over the gradients (the plain ones as replicated DTensors, as the
  trainer counts them), ``clip_grads_with_norm_`` and AdamW: parameters and AdamW state
  (whole tensors) after every iteration, and the norm every rank reports. The NaN goes
  into the tp rank 1 shard of both replicas here: a replica's gradient after the
  all-reduce is the whole one, as a NaN from the backward would reach it.
* ``fsdp``: against ``ddp``, bitwise after the unclipped iterations by construction
  (every gradient is the sum of the same two replica gradients, and two addends
  commute; AdamW is elementwise on the shards); the global norm differs in rounding (a
  parameter's norm combines its dp shards' norms, in float64), so the norms and the
  clipped iteration are promised within ``TOL`` relative only (measured: equal on this
  model, the float64 combination rounding back to the same float32 norms).
* a checkpoint of the FSDP run saved after 3 iterations and loaded into a fresh FSDP
  pipeline: its last iteration is bitwise the uninterrupted run's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ranks import launch
from zerobubble.executor import ExecutorOptions
from zerobubble.optim.checkpoint import load_checkpoint, save_checkpoint
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import FaultPlan, GradFault
from zerobubble.parallel.mesh import PipelineMesh, build_mesh
from zerobubble.pipeline import Pipeline
from zerobubble.reference.tp import tp_reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.schedule.generators import generate

pytestmark = pytest.mark.slow

PP, DP, TP, M, ITERS = 2, 2, 2, 2, 4
IN, D, H, OUT, B, T = 4, 8, 16, 4, 4, 2  # B samples per replica
MAX_NORM = 5.0  # above this model's norms unless the scale fault multiplies them
NAN_AT, CLIP_AT, SAVE_AT = 1, 3, 3
TOL = 1e-6
"""FSDP against the DDP-style path: the norm's rounding (and a clip coefficient from it)."""
LAST = PP - 1  # zb-h1: one stage per rank


class Block(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        with torch.no_grad():  # a LayerNorm not at its initial values
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(IN, D), Block(), Block(), nn.Linear(D, OUT)]


def plan(stage: int, module: nn.Module) -> dict:
    """The input layer row-wise, each block's pair column- then row-wise, the head
    column-wise with a replicated output; the norms stay plain parameters."""
    out: dict = {}
    for name, child in module.named_children():
        if isinstance(child, Block):
            out[f"{name}.fc1"] = ColwiseParallel()
            out[f"{name}.fc2"] = RowwiseParallel()
        elif child.in_features == IN:
            out[name] = RowwiseParallel(input_layouts=Replicate())
        else:
            out[name] = ColwiseParallel(output_layouts=Replicate())
    return out


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def batch(i: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * i + replica)
    return torch.randn(B, T, IN, generator=gen), torch.randn(B, T, OUT, generator=gen)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over a DTensor's mesh)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(named: list[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer) -> dict:
    """Every parameter and its AdamW state, whole, by name."""
    return {
        n: [full(p), *(full(v) for _, v in sorted(opt.state.get(p, {}).items()))] for n, p in named
    }


def mesh_names(p: torch.Tensor) -> str:
    return str(p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else "plain"


def stage_of(name: str) -> int:
    return int(name.split(".")[0]) * PP // len(layers())


def reference(tp: DeviceMesh) -> tuple[list[dict], list[float]]:
    """The tp layout without pipelining, both replicas' batches; snapshots and norms."""
    model = layers()
    tp_rank = tp.get_local_rank()
    named: list[tuple[str, torch.Tensor]] = []
    opt: torch.optim.Optimizer | None = None
    snaps, norms = [], []
    for i in range(ITERS):
        grads = []
        for r in range(DP):
            x, y = batch(i, r)
            grads.append(
                tp_reference_step(
                    model,
                    loss_fn,
                    x,
                    target=y,
                    microbatches=M,
                    tp_mesh=tp,
                    tp_plan=plan,
                    num_stages=PP,
                    copy_layers=False,
                )[1]
            )
        if opt is None:  # parallelized by the first call
            named = list(nn.Sequential(*model).named_parameters())
            opt = torch.optim.AdamW([p for _, p in named], lr=0.02, weight_decay=0.1)
        for n, p in named:
            p.grad = (grads[0][n] + grads[1][n]) * 0.5
        stages = {s: [p for n, p in named if stage_of(n) == s] for s in range(PP)}
        if i == NAN_AT and tp_rank == 1:
            GradFault(i, 0).apply(stages[0])
        if i == CLIP_AT:
            GradFault(i, LAST, kind="scale", factor=1e3).apply(stages[LAST])
        params = [p for _, p in named]
        as_dtensors = [
            p.grad if isinstance(p.grad, DTensor) else DTensor.from_local(p.grad, tp, [Replicate()])
            for p in params
        ]
        total = full(torch.nn.utils.get_total_norm(as_dtensors))
        if torch.isfinite(total):
            # clip_grads_with_norm_ per kind (foreach does not mix DTensors and tensors)
            for kind in (True, False):
                group = [p for p in params if isinstance(p, DTensor) is kind]
                torch.nn.utils.clip_grads_with_norm_(group, MAX_NORM, total)
            opt.step()
        norms.append(float(total))
        snaps.append(snapshot(named, opt))
    return snaps, norms


def faults(mesh: PipelineMesh) -> FaultPlan:
    """The NaN at the tail in rank (pp 0, dp 1, tp 1)'s shard with FSDP, in the tp rank 1
    gradients of both replicas without; the scale on every rank's last stage."""
    nan = mesh.pp_rank == 0 and mesh.tp_rank == 1 and (mesh.dp_rank == 1 or not mesh.spec.fsdp)
    scale = GradFault(CLIP_AT, LAST, kind="scale", factor=1e3)
    return FaultPlan(grads=(GradFault(NAN_AT, 0), scale) if nan else (scale,))


def pipeline(mesh: PipelineMesh, commits: list) -> tuple[Pipeline, torch.optim.Optimizer]:
    pipe = Pipeline(
        layers(),
        loss_fn,
        generate("zb-h1", PP, M),
        mesh=mesh,
        tp_plan=plan,
        options=ExecutorOptions(comm_timeout_s=60, trace=False),
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.02, weight_decay=0.1)
    pipe.set_optimizer(
        opt, OptimConfig(max_norm=MAX_NORM), faults=faults(mesh), on_commit=commits.append
    )
    return pipe, opt


def differences(got: dict, want: dict) -> tuple[list[str], float]:
    """Names whose parameter or state is not ``want``'s bitwise; the worst relative gap."""
    bad, worst = [], 0.0
    for n, ts in got.items():
        for a, b in zip(ts, want[n], strict=True):
            if not torch.equal(a, b):
                bad.append(n)
                if torch.isfinite(b).all():
                    gap = (a.double() - b.double()).abs().max() / b.double().abs().max()
                    worst = max(worst, gap.item())
    return sorted(set(bad)), worst


def job(root: str) -> dict:
    init_distributed(timeout_s=120)
    mesh = build_mesh(PP, DP, tp=TP)
    assert mesh.tp_mesh is not None
    ref, ref_norms = reference(mesh.tp_mesh)
    out: dict = {"ref norms": ref_norms}
    snaps: dict[bool, list[dict]] = {}
    for fsdp in (False, True):
        commits: list = []
        pipe, opt = pipeline(mesh.with_fsdp(fsdp), commits)
        named = list(pipe.named_parameters())
        snaps[fsdp] = []
        for i in range(ITERS):
            x, y = batch(i, mesh.dp_rank)
            pipe.step(x, target=y)
            snaps[fsdp].append(snapshot(named, opt))
            if fsdp and i + 1 == SAVE_AT:
                assert pipe.trainer is not None
                save_checkpoint(pipe.trainer, root, mesh=mesh.with_fsdp(True))
        name = "fsdp" if fsdp else "ddp"
        out[name] = {
            "commits": [(c.action.value, c.total_norm) for c in commits],
            "meshes": sorted({mesh_names(p) for _, p in named}),
            "tp mesh": pipe.trainer is not None and pipe.trainer.layout.tp_mesh == mesh.tp_mesh,
        }
        dist.barrier()
    out["ddp"]["bad"] = [differences(snaps[False][i], ref[i])[0] for i in range(ITERS)]
    out["fsdp"]["bad"], out["fsdp"]["worst"] = zip(
        *(differences(snaps[True][i], snaps[False][i]) for i in range(ITERS)), strict=True
    )
    commits = []
    pipe, opt = pipeline(mesh.with_fsdp(True), commits)
    assert pipe.trainer is not None
    load_checkpoint(pipe.trainer, root, mesh=mesh.with_fsdp(True))
    for i in range(SAVE_AT, ITERS):
        x, y = batch(i, mesh.dp_rank)
        pipe.step(x, target=y)
    resumed = snapshot(list(pipe.named_parameters()), opt)
    out["resumed"] = differences(resumed, snaps[True][ITERS - 1])[0]
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(job, PP * DP * TP, str(tmp_path_factory.mktemp("tp_fsdp")), timeout=600.0)


@pytest.mark.bitwise
@pytest.mark.kernels
def test_fsdp_with_tp_against_the_ddp_path_and_the_tp_reference(results):
    want = ["step", "skip", "step", "clip"]
    norms = results[0]["ref norms"]
    assert math.isnan(norms[NAN_AT]) and norms[CLIP_AT] > MAX_NORM > max(norms[0], norms[2])
    for r, res in enumerate(results):
        ddp, fsdp = res["ddp"], res["fsdp"]
        assert repr(res["ref norms"]) == repr(norms), r  # every tp pair's reference alike
        assert [a for a, _ in ddp["commits"]] == want, (r, ddp["commits"])
        assert [a for a, _ in fsdp["commits"]] == want, (r, fsdp["commits"])
        assert [repr(n) for _, n in ddp["commits"]] == [repr(n) for n in norms], r
        for (_, a), b in zip(fsdp["commits"], norms, strict=True):
            assert (math.isnan(b) and math.isnan(a)) or abs(a - b) <= TOL * b, (r, a, b)
        assert ddp["bad"] == [[]] * ITERS, (r, ddp["bad"])
        assert list(fsdp["bad"][:CLIP_AT]) == [[]] * CLIP_AT, (r, fsdp["bad"])
        assert fsdp["worst"][CLIP_AT] <= TOL, (r, fsdp["worst"])
        assert ddp["tp mesh"] and fsdp["tp mesh"], r
        assert fsdp["meshes"] == ["('dp', 'tp')", "('dp',)"], (r, fsdp["meshes"])
        assert ddp["meshes"] == ["('tp',)", "plain"], (r, ddp["meshes"])
        assert res["resumed"] == [], (r, res["resumed"])
