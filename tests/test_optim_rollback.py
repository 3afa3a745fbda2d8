"""Undoing a provisional optimizer step: snapshot (exact) and in-place inverse (bounded error)."""

from __future__ import annotations

import copy

import pytest
import torch

from zerobubble.optim.config import Rollback
from zerobubble.optim.rollback import (
    Inverse,
    Snapshot,
    UnsupportedRollbackError,
    check_invertible,
    make_undo,
)

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    "adam-maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, maximize=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1),
}

# Worst normwise error of the inverse, in units of eps * max|x| of each restored tensor,
# over these cases (measured: see the test below and docs/optim.md).
INVERSE_BOUND = 4.0


def setup(make, steps: int, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (257, 64)]
    opt = make(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
    return params, opt


def state_of(opt, params):
    return [
        (p.detach().clone(), copy.deepcopy(dict(opt.state[p])) if p in opt.state else None)
        for p in params
    ]


@pytest.mark.parametrize("name", [*OPTIMIZERS, "rmsprop", "adamw-amsgrad"])
@pytest.mark.parametrize("steps", [0, 3])
def test_snapshot_restores_any_optimizer_bitwise(name, steps):
    extra = {
        "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
        "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    }
    params, opt = setup({**OPTIMIZERS, **extra}[name], steps)
    before = state_of(opt, params)
    undo = Snapshot(opt)
    undo.prepare()
    opt.step()
    assert not torch.equal(params[0], before[0][0])
    undo.undo()
    for p, (value, st) in zip(params, before, strict=True):
        assert torch.equal(p, value)
        if st is None:  # the step created the state: it is gone again
            assert p not in opt.state
        else:
            assert set(opt.state[p]) == set(st)
            for k, v in st.items():
                assert torch.equal(opt.state[p][k], v), k


def normwise_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| in units of eps * max|b| (0 for equal tensors)."""
    scale = b.abs().max().item() * torch.finfo(b.dtype).eps
    diff = (a.double() - b.double()).abs().max().item()
    return diff / scale if diff else 0.0


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("steps", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverse_restores_state_structure_exactly_and_values_within_bound(name, steps, dtype):
    params, opt = setup(OPTIMIZERS[name], steps, dtype)
    before = state_of(opt, params)
    undo = Inverse(opt)
    undo.prepare()
    opt.step()
    undo.undo()
    worst = 0.0
    for p, (value, st) in zip(params, before, strict=True):
        worst = max(worst, normwise_error(p.detach(), value))
        if st is None:
            assert p not in opt.state  # first step: state dropped, as if never stepped
            continue
        assert set(opt.state[p]) == set(st)
        for k, v in st.items():
            if k == "step":
                assert torch.equal(opt.state[p][k], v)  # the step count is exact
            else:
                worst = max(worst, normwise_error(opt.state[p][k], v))
    assert worst <= INVERSE_BOUND, f"{name}: {worst:.2f} eps*max|x|"


def test_inverse_then_redo_continues_like_a_run_that_never_stepped():
    """Undo + a clipped redo lands within the bound of the clean clipped step."""
    params, opt = setup(OPTIMIZERS["adamw"], 3)
    clean_params, clean_opt = setup(OPTIMIZERS["adamw"], 3)
    undo = Inverse(opt)
    undo.prepare()
    opt.step()
    undo.undo()
    for ps, o in ((params, opt), (clean_params, clean_opt)):
        torch.nn.utils.clip_grad_norm_(ps, 0.5)
        o.step()
    for p, q in zip(params, clean_params, strict=True):
        assert normwise_error(p.detach(), q.detach()) <= INVERSE_BOUND
    assert torch.equal(opt.state[params[0]]["step"], clean_opt.state[clean_params[0]]["step"])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: torch.optim.RMSprop(ps), "RMSprop has no in-place inverse"),
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad=True"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=1.0), "dampening=1"),
    ],
)
def test_inverse_refuses_what_it_cannot_undo_and_suggests_snapshot(make, match):
    opt = make([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(UnsupportedRollbackError, match=match) as err:
        make_undo(opt, Rollback.INVERSE)
    assert "rollback='snapshot'" in str(err.value)
    assert isinstance(make_undo(opt, Rollback.SNAPSHOT), Snapshot)


def test_undo_without_prepare_is_a_protocol_error():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    check_invertible(opt)
    for undo in (Snapshot(opt), Inverse(opt)):
        with pytest.raises(RuntimeError, match="without a prepared step"):
            undo.undo()


@pytest.mark.parametrize("name", ["adamw", "adam-maximize"])
def test_inverse_brings_zero_moments_back_exactly_zero(name):
    """Rows of an embedding that no step has reached yet (moments exactly 0) and that the
    undone step reached: the inverse must give back exact zeros (issue 23, item 11). A
    residue of the step's rounding there (~1e-11 in m, ~1e-16 in v, which the old inverse
    left) makes every later Adam step move the row by m / (sqrt(v) + eps)."""
    gen = torch.Generator().manual_seed(3)
    emb = torch.nn.Parameter(torch.randn(64, 32, generator=gen))
    opt = OPTIMIZERS[name]([emb])

    def grad(rows: list[int]) -> torch.Tensor:
        g = torch.zeros(64, 32)
        g[rows] = torch.randn(len(rows), 32, generator=gen) * 1e-3
        return g

    emb.grad = grad([0, 1, 2])
    opt.step()
    undo = Inverse(opt)
    undo.prepare()
    emb.grad = grad([1, 2, *range(3, 40)])  # rows 3..39: first reached by the undone step
    opt.step()
    undo.undo()
    state = opt.state[emb]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[key][3:], torch.zeros(61, 32)), key
