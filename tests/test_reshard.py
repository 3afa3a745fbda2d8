"""Resharding resume: a checkpoint saved at one mesh loads at another (gloo).

Our GPT (tied nothing, no dropout), AdamW with clipping, zb-h1 (1f1b at pp=1). A job at
pp2 x dp2 x tp2 with FSDP (8 ranks) trains 2 steps, saves, and reports the whole
parameters and AdamW state it saved (``full_tensor()`` of every shard). At each target
mesh, pp2 x dp1 x tp2, pp4 x dp1 x tp1 and pp1 x dp2 x tp2, one launch runs two pipelines:
one loads the checkpoint, the other starts from that whole state by hand
(``load_state_dict`` and the optimizer's state distributed like each parameter); both
train the same 2 steps. Against the second, the resumed run's losses, parameters and
AdamW state are bitwise equal: the checkpoint reloads at another mesh exactly as the
state it holds. A job at pp2 x dp2 killed (SIGKILL) after its save resumes at pp2 x dp1 the
same way. HF Mixtral (its experts one stacked tensor per projection, each ep rank holding
rows) saved at pp2 x dp2 x ep2 resumes at pp2 x dp1 (experts whole) and at pp1 x dp2 x ep2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

import zerobubble
from ranks import launch
from zerobubble.interop import hf
from zerobubble.interop.hf_experts import expert_shard
from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.optim.checkpoint import load_checkpoint, save_checkpoint
from zerobubble.optim.faults import Crash, FaultPlan
from zerobubble.parallel.shards import global_view
from zerobubble.runtime.launcher import LaunchError

pytestmark = pytest.mark.slow

CFG = GPTConfig(vocab_size=16, max_seq_len=4, d_model=8, n_heads=2, n_layers=4)
BATCH, M, SAVE_AT, MORE = 8, 2, 2, 2
TARGETS = [(2, 1, 2), (4, 1, 1), (1, 2, 2)]
MOE_TARGETS = [(2, 1, 1), (1, 2, 2)]  # (pp, dp, ep)


def batch(k: int, dp: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(30 + k)
    x, y = (torch.randint(0, 16, (BATCH, 4), generator=gen) for _ in range(2))
    part = slice(replica * BATCH // dp, (replica + 1) * BATCH // dp)
    return x[part], y[part]


def whole(t: torch.Tensor, mesh: zerobubble.PipelineMesh, param: torch.Tensor) -> torch.Tensor:
    """``t`` (``param`` or its optimizer entry) as the model's whole tensor."""
    ep = None if mesh.ep_mesh is None else mesh.ep_mesh["ep"]
    t = global_view(t.detach(), ep, like=param)
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def make(mesh: zerobubble.PipelineMesh, model: str, faults: FaultPlan | None = None):
    torch.manual_seed(0)
    kind = "1f1b" if mesh.pp_size == 1 else "zb-h1"
    if model == "gpt":
        layers, loss = build_gpt(CFG), gpt_loss
    else:
        hf_model = hf.tiny_model(model)
        layers, loss = hf.causal_lm_layers(hf_model), hf.CausalLMLoss(hf_model)
    pipe = zerobubble.Pipeline(layers, loss, kind, microbatches=M, mesh=mesh)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.02)
    trainer = pipe.set_optimizer(opt, zerobubble.OptimConfig(max_norm=0.5), faults=faults)
    return pipe, opt, trainer


def train(pipe, mesh, steps: range) -> list:
    losses = []
    for k in steps:
        x, y = batch(k, mesh.dp_size, mesh.dp_rank)
        out = pipe.step(x, target=y)
        losses.append(None if out is None else [v.item() for v in out])
    pipe.drain()
    return losses


def state(pipe, opt, mesh) -> dict:
    """Every parameter and AdamW entry, whole (collective over the shards' meshes)."""
    return {
        n: (whole(p, mesh, p), {f: whole(v, mesh, p) for f, v in opt.state[p].items()})
        for n, p in pipe.named_parameters()
    }


def save_job(root: str, model: str, pp: int, dp: int, tp: int, ep: int, fsdp: bool, crash: bool):
    zerobubble.init_distributed(timeout_s=60)
    mesh = zerobubble.build_mesh(pp, dp, tp=tp, ep=ep, fsdp=fsdp)
    faults = FaultPlan(crashes=(Crash(0, SAVE_AT + 1, "at_tail"),)) if crash else None
    pipe, opt, trainer = make(mesh, model, faults)
    train(pipe, mesh, range(SAVE_AT))
    save_checkpoint(trainer, root, mesh=mesh)
    saved = state(pipe, opt, mesh)
    torch.save(saved, Path(root) / f"whole_{torch.distributed.get_rank()}.pt")
    train(pipe, mesh, range(SAVE_AT, SAVE_AT + MORE))  # the crash, if any, comes here
    return saved


def resume_job(root: str, model: str, meshes: list[tuple[int, int, int, int]]) -> list[dict]:
    """Each ``(pp, dp, tp, ep)`` mesh of one world size in turn, in one launch."""
    zerobubble.init_distributed(timeout_s=60)
    return [resume_on(root, model, *sizes) for sizes in meshes]


def resume_on(root: str, model: str, pp: int, dp: int, tp: int, ep: int) -> dict:
    mesh = zerobubble.build_mesh(pp, dp, tp=tp, ep=ep)
    saved: dict = {}
    for f in sorted(Path(root).glob("whole_*.pt")):
        saved.update(torch.load(f))
    steps = range(SAVE_AT, SAVE_AT + MORE)
    pipe, opt, trainer = make(mesh, model)
    load_checkpoint(trainer, root, mesh=mesh)
    resumed = (train(pipe, mesh, steps), state(pipe, opt, mesh))
    pipe, opt, _ = make(mesh, model)
    pipe.load_state_dict({n: p for n, (p, _) in saved.items()}, strict=False)
    for n, p in pipe.named_parameters():
        opt.state[p] = {f: like(v, p) for f, v in saved[n][1].items()}
    fresh = (train(pipe, mesh, steps), state(pipe, opt, mesh))
    return {"resumed": resumed, "fresh": fresh}


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """An optimizer entry placed as ``param`` is (a moment: a DTensor's shard, an expert
    tensor's rows), or as it is (the step count)."""
    if isinstance(param, DTensor) and value.shape == param.shape:
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    rows = expert_shard(param)
    if rows is not None and value.dim() == param.dim():
        return value[rows[0] : rows[1]].clone()
    return value.clone()


def same(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        (losses, got), (want_losses, want) = r["resumed"], r["fresh"]
        assert losses == want_losses, rank
        assert got.keys() == want.keys() and got, rank
        for n, (p, st) in got.items():
            assert torch.equal(p, want[n][0]), (rank, n)
            assert st.keys() == want[n][1].keys() == {"step", "exp_avg", "exp_avg_sq"}, n
            assert all(torch.equal(v, want[n][1][f]) for f, v in st.items()), (rank, n)


def saved_and_resumed(root: Path, model: str, source: tuple, world: int, targets: list) -> list:
    """Save at ``source`` (``(world, pp, dp, tp, ep, fsdp)``), then resume at every target
    mesh (``world`` ranks each) in one launch: per target, every rank's result."""
    launch(save_job, source[0], str(root), model, *source[1:], False, timeout=300)
    results = launch(resume_job, world, str(root), model, targets, timeout=300)
    return [[r[i] for r in results] for i in range(len(targets))]


@pytest.fixture(scope="module")
def gpt_resumed(tmp_path_factory) -> list:
    targets = [(pp, dp, tp, 1) for pp, dp, tp in TARGETS]  # four ranks each
    root = tmp_path_factory.mktemp("reshard")
    return saved_and_resumed(root, "gpt", (8, 2, 2, 2, 1, True), 4, targets)


@pytest.mark.parametrize("target", range(len(TARGETS)), ids=[str(t) for t in TARGETS])
def test_a_checkpoint_of_pp2_dp2_tp2_fsdp_resumes_at_another_mesh_exactly(gpt_resumed, target):
    same(gpt_resumed[target])


def test_a_job_killed_at_pp2_dp2_resumes_at_pp2_dp1(tmp_path):
    with pytest.raises(LaunchError) as err:
        launch(save_job, 4, str(tmp_path), "gpt", 2, 2, 1, 1, False, True, timeout=300, grace=20)
    assert any(f.error == "killed by signal SIGKILL" for f in err.value.failures)
    results = launch(resume_job, 2, str(tmp_path), "gpt", [(2, 1, 1, 1)], timeout=300)
    same([mine for (mine,) in results])


@pytest.fixture(scope="module")
def moe_resumed(tmp_path_factory) -> list:
    targets = [(pp, dp, 1, ep) for pp, dp, ep in MOE_TARGETS]  # two ranks each
    root = tmp_path_factory.mktemp("reshard_moe")
    return saved_and_resumed(root, "hf-mixtral", (4, 2, 2, 1, 2, False), 2, targets)


@pytest.mark.parametrize("target", range(len(MOE_TARGETS)), ids=[str(t) for t in MOE_TARGETS])
def test_hf_experts_saved_at_ep2_resume_at_another_ep_and_pp_exactly(moe_resumed, target):
    same(moe_resumed[target])
