"""The parallelization seam: one list of model-facing steps built from the mesh (tp, then
ep), and a user's ``parallelize_fn(stage, module, mesh)`` that replaces them.

One 4-rank launch runs, at pp=2 x tp=2 (a GPT) and at pp=2 x dp=2 x ep=2 (a MoE MLP), one
step with the default steps and one with a ``parallelize_fn`` that applies the same
sharding by hand: losses and gradients bitwise equal. A ``parallelize_fn`` that leaves the
experts whole is refused on every rank; so are the misuses that need no ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import zerobubble
from ranks import launch
from zerobubble.models import GPTConfig, build_gpt, build_moe_mlp, gpt_loss, mlp_loss
from zerobubble.parallel.ep import ExpertGroup
from zerobubble.parallel.experts import shard_all_experts
from zerobubble.parallel.parallelize import Parallelize
from zerobubble.parallel.tp import parallelize_stage

GPT = GPTConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=2, n_layers=2, mlp_ratio=2)


def by_hand_tp(stage: int, module: nn.Module, mesh: zerobubble.PipelineMesh) -> nn.Module:
    """The default tp step, written as a user would: each stage's default plan, the last
    stage's (1 of 2) with loss parallel (gpt_loss takes the logits vocabulary-sharded)."""
    parallelize_stage(
        module, mesh.tp_mesh, None, stage=stage, sequence_parallel=False, loss_parallel=stage == 1
    )
    return module


def by_hand_ep(stage: int, module: nn.Module, mesh: zerobubble.PipelineMesh) -> nn.Module:
    """The default ep step, written as a user would: every sharding hook, in module order."""
    shard_all_experts(module, ExpertGroup.of(mesh))
    return module


def leave_whole(stage: int, module: nn.Module, mesh: zerobubble.PipelineMesh) -> nn.Module:
    return module


def gpt() -> nn.Sequential:
    return build_gpt(GPT)


def moe() -> nn.Sequential:
    return build_moe_mlp((6, 8, 3), hidden=16, num_experts=4, top_k=2, blocks=2)


def grads(pipe: zerobubble.Pipeline) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in pipe.named_parameters():
        g = p.grad
        out[name] = (g.to_local() if hasattr(g, "to_local") else g).clone()
    return out


def one_step(build, loss, batch, mesh, fn) -> tuple[list | None, dict]:
    torch.manual_seed(0)
    pipe = zerobubble.Pipeline(build(), loss, "zb-h1", microbatches=2, mesh=mesh, parallelize_fn=fn)
    losses = pipe.step(batch[0], target=batch[1])
    return losses, grads(pipe)


def ranks() -> dict:
    zerobubble.init_distributed(timeout_s=60)
    g = torch.Generator().manual_seed(1)
    ids, labels = (
        torch.randint(0, 32, (4, 8), generator=g),
        torch.randint(0, 32, (4, 8), generator=g),
    )
    out: dict = {}
    mesh = zerobubble.build_mesh(2, tp=2)
    out["tp"] = [one_step(gpt, gpt_loss, (ids, labels), mesh, fn) for fn in (None, by_hand_tp)]
    mesh = zerobubble.build_mesh(2, 2, ep=2)
    x, y = torch.randn(8, 3, 6, generator=g), torch.randn(8, 3, 3, generator=g)
    part = slice(mesh.dp_rank * 4, mesh.dp_rank * 4 + 4)
    batch = (x[part], y[part])
    out["ep"] = [one_step(moe, mlp_loss, batch, mesh, fn) for fn in (None, by_hand_ep)]
    try:
        one_step(moe, mlp_loss, batch, mesh, leave_whole)
    except ValueError as e:
        out["whole"] = str(e)
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(ranks, 4, timeout=240)


@pytest.mark.parametrize("dim", ["tp", "ep"])
def test_a_parallelize_fn_doing_the_default_is_the_default_bitwise(results, dim):
    for rank, out in enumerate(results):
        (default_losses, default), (fn_losses, by_fn) = out[dim]
        assert (default_losses is None) == (fn_losses is None), rank
        if default_losses is not None:
            assert all(map(torch.equal, default_losses, fn_losses)), rank
        assert default.keys() == by_fn.keys() and default, rank
        bad = [n for n in default if not torch.equal(default[n], by_fn[n])]
        assert not bad, (rank, bad)


def test_a_parallelize_fn_that_leaves_experts_whole_is_refused_on_every_rank(results):
    for out in results:
        assert "ep=2" in out["whole"] and "holds experts" in out["whole"], out["whole"]
        assert "shard_experts" in out["whole"]


def test_parallelize_misuse_needs_no_ranks():
    with pytest.raises(ValueError, match=r"pass parallelize \(the steps built already\) or"):
        zerobubble.PipelineExecutor(
            zerobubble.generate("zbv", 3, 6), {}, parallelize=Parallelize(), tp_plan={}
        )
    with pytest.raises(ValueError, match="tp_plan is given but the mesh has no tensor"):
        Parallelize.from_mesh(None, tp_plan={})
    with pytest.raises(ValueError, match="parallelize_fn is given without a mesh"):
        Parallelize.from_mesh(None, fn=leave_whole)
    returns_none = Parallelize(mesh=SimpleNamespace(), fn=lambda s, m, mesh: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="returned NoneType for stage 3: it must return"):
        returns_none.apply({3: nn.Linear(2, 2)})
    seen: list[int] = []
    counting = Parallelize(mesh=SimpleNamespace(), fn=lambda s, m, mesh: seen.append(s) or m)  # type: ignore[arg-type]
    first = counting.apply({0: nn.Linear(2, 2), 2: nn.Linear(2, 2)})
    assert counting.apply({2: nn.Linear(2, 2)})[2] is first[2] and seen == [0, 2]  # once each
