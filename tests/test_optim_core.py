"""Single-process pieces of the optimizer protocol: the global norm, decisions, the version
state machine, fault plans, configuration and the offline trace checker."""

from __future__ import annotations

import math

import pytest
import torch

from zerobubble.optim.config import OptimConfig, Rollback, StepMode
from zerobubble.optim.faults import Crash, FaultPlan, GradFault
from zerobubble.optim.norms import ABSENT, PRESENT, UNSEEN, Decision, ParamLayout, decide
from zerobubble.optim.norms import may_step_early as early
from zerobubble.optim.versions import OptState, ProtocolError, RankVersions
from zerobubble.schedule.ir import Action as Act
from zerobubble.schedule.ir import Op

# ---- the global norm ------------------------------------------------------------------------


def model_stages(dtypes: list[list[torch.dtype]], seed: int = 0) -> dict[int, list[torch.Tensor]]:
    """Stages of parameters with gradients of assorted magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for s, dts in enumerate(dtypes):
        ps = []
        for i, dt in enumerate(dts):
            p = torch.nn.Parameter(torch.zeros(3 + 5 * i + s, dtype=dt))
            p.grad = (torch.randn(p.shape, generator=gen) * 10 ** (i - s)).to(dt)
            ps.append(p)
        out[s] = ps
    return out


def layout_of(stages: dict[int, list[torch.Tensor]]) -> ParamLayout:
    first, dtypes = {}, []
    for s in sorted(stages):
        first[s] = len(dtypes)
        dtypes += [p.dtype for p in stages[s]]
    return ParamLayout(tuple(dtypes), first)


F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
DTYPE_MIXES = [
    [[F32, F32], [F32, F32, F32], [F32]],
    [[BF16, BF16], [BF16]],
    [[F32, BF16], [BF16, F32, F32], [F64]],
]


@pytest.mark.parametrize("dtypes", DTYPE_MIXES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_norm_from_per_rank_vectors_is_bitwise_clip_grad_norm(dtypes, norm_type):
    stages = model_stages(dtypes)
    stages[1][0].grad = None  # a parameter without gradient is ignored, as clip_grad_norm_ does
    layout = layout_of(stages)
    total = layout.new_vector()
    for s in stages:  # each "rank" fills its own stage; summing is the all-reduce
        mine = layout.new_vector()
        layout.fill(mine, {s: stages[s]}, norm_type)
        total += mine
    status = total[layout.size : 2 * layout.size].tolist()
    assert status.count(ABSENT) == 1 and UNSEEN not in status
    ours = layout.total(total, norm_type, torch.device("cpu"))
    params = [p for s in sorted(stages) for p in stages[s]]
    expected = torch.nn.utils.get_total_norm(
        [p.grad for p in params if p.grad is not None], norm_type
    )
    assert ours.dtype == expected.dtype
    assert torch.equal(ours, expected)


def test_prefix_norm_counts_unseen_slots_as_zero_and_never_exceeds_the_total():
    stages = model_stages(DTYPE_MIXES[0], seed=3)
    layout = layout_of(stages)
    vec = layout.new_vector()
    cpu = torch.device("cpu")
    previous = torch.tensor(0.0)
    for s in sorted(stages):
        layout.fill(vec, {s: stages[s]}, 2.0)
        prefix = layout.total(vec, 2.0, cpu, prefix=True)
        alone = torch.nn.utils.get_total_norm(
            [p.grad for t in sorted(stages) if t <= s for p in stages[t]]
        )
        assert torch.allclose(prefix, alone, rtol=1e-6)
        assert previous <= prefix
        previous = prefix
    assert torch.equal(previous, layout.total(vec, 2.0, cpu))
    with pytest.raises(RuntimeError, match="never filled"):
        layout.total(layout.new_vector(), 2.0, cpu)
    assert vec[layout.size : 2 * layout.size].tolist() == [PRESENT] * layout.size


def test_decisions_follow_clip_grad_norm_coefficient_exactly():
    cfg = OptimConfig(max_norm=1.0)
    assert decide(torch.tensor(0.5), cfg) is Decision.STEP
    # max_norm / (total + 1e-6) rounds to exactly 1 just above max_norm - 1e-6 ...
    assert decide(torch.tensor(1.0 - 1e-6), cfg) is Decision.STEP
    # ... and is below 1 at total == max_norm: clip_grad_norm_ scales by 0.999999.
    assert decide(torch.tensor(1.0), cfg) is Decision.CLIP
    g = torch.ones(1)
    torch.nn.utils.clip_grads_with_norm_([torch.nn.Parameter(g.clone())], 1.0, torch.tensor(1.0))
    assert decide(torch.tensor(math.nan), cfg) is Decision.SKIP
    assert decide(torch.tensor(math.inf), OptimConfig()) is Decision.SKIP
    assert decide(torch.tensor(1e30), OptimConfig()) is Decision.STEP  # no clipping configured
    keep_nan = OptimConfig(max_norm=1.0, skip_nonfinite=False)
    assert decide(torch.tensor(math.nan), keep_nan) is Decision.CLIP  # scales by NaN, like torch
    assert early(torch.tensor(0.5), cfg)
    assert not early(torch.tensor(2.0), cfg)
    assert not early(torch.tensor(math.nan), keep_nan)  # never step early on a non-finite prefix


def test_clip_action_matches_clip_grad_norm_on_the_grads():
    """STEP leaves gradients as clip_grad_norm_ would (x * 1.0 == x); CLIP scales them alike."""
    for max_norm in (100.0, 0.1):
        a = torch.nn.Parameter(torch.zeros(7))
        a.grad = torch.linspace(-1, 2, 7)
        b = torch.nn.Parameter(torch.zeros(7))
        b.grad = a.grad.clone()
        total = torch.nn.utils.clip_grad_norm_([a], max_norm)
        action = decide(total, OptimConfig(max_norm=max_norm))
        if action is Decision.CLIP:
            torch.nn.utils.clip_grads_with_norm_([b], max_norm, total)
        assert torch.equal(a.grad, b.grad)
        assert action is (Decision.STEP if max_norm == 100.0 else Decision.CLIP)


# ---- the version state machine ----------------------------------------------------------------


def test_post_validation_life_cycle_of_two_ranks():
    first, last = RankVersions(), RankVersions()
    for k, stepped in ((0, True), (1, False)):
        for r in (first, last):
            r.begin_compute(k)
            r.end_compute(k, in_flight=0)
        first.provisional(k, stepped)
        assert first.opt is OptState.PROVISIONAL
        assert first.param_version == (k + 1 if stepped else k)
        last.commit(k)  # the last rank's decision is final at once
        assert (last.committed, last.param_version) == (k + 1, k + 1)
        if stepped:
            first.rollback(k)
            assert (first.opt, first.param_version) == (OptState.ROLLED_BACK, k)
        first.commit(k)
        assert (first.opt, first.committed, first.param_version) == (
            OptState.VALIDATED,
            k + 1,
            k + 1,
        )
    first.require_drained()


def test_conservative_forward_before_validation_is_refused():
    r = RankVersions()
    r.begin_compute(0)
    r.end_compute(0, 0)
    r.provisional(0, True)
    with pytest.raises(
        ProtocolError, match="forward of iteration 1 before iteration 0 was validated"
    ):
        r.begin_compute(1)
    spec = RankVersions(speculative=True, iteration=1, param_version=1, opt=OptState.PROVISIONAL)
    spec.begin_compute(1)  # speculative: one provisional iteration may be open
    spec.end_compute(1, 0)
    with pytest.raises(ProtocolError, match="more than one iteration unvalidated"):
        spec.begin_compute(2)


@pytest.mark.parametrize(
    ("break_it", "match"),
    [
        (lambda r: r.end_compute(0, in_flight=2), "2 microbatches whose W has not run"),
        (lambda r: r.rollback(0), "did not step provisionally"),
        (lambda r: r.require_drained(), "outside a validated drain point"),
        (lambda r: r.begin_compute(3), "out of order"),
    ],
)
def test_state_machine_invariants(break_it, match):
    r = RankVersions()
    r.begin_compute(0)
    if "W" not in match:
        r.end_compute(0, 0)
        r.provisional(0, False)
    with pytest.raises(ProtocolError, match=match):
        break_it(r)


# ---- configuration and faults -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_norm": 0.0}, "max_norm must be > 0"),
        ({"norm_type": -1.0}, "norm_type must be > 0"),
        ({"mode": "post_validation"}, "mode='conservative' or mode='speculative'"),
        ({"mode": "barrier"}, "'barrier' is not a valid StepMode"),
        ({"rollback": "undo"}, "'undo' is not a valid Rollback"),
    ],
)
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kwargs)


def test_config_accepts_strings():
    cfg = OptimConfig(mode="speculative", rollback="inverse")
    assert (cfg.mode, cfg.rollback) == (StepMode.SPECULATIVE, Rollback.INVERSE)
    assert cfg.post_validation and cfg.speculative
    cons = OptimConfig(mode="conservative")
    assert cons.post_validation and not cons.speculative
    assert not OptimConfig().post_validation


def test_one_step_mode_for_the_trainer_and_the_simulator():
    from zerobubble.schedule import step_sim

    assert StepMode is step_sim.StepMode
    assert [m.value for m in StepMode] == ["sync", "conservative", "speculative"]


def test_grad_faults_hit_the_chosen_stage_microbatch_and_iteration():
    stages = model_stages([[F32, F32], [F32]])
    before = {s: [p.grad.clone() for p in ps] for s, ps in stages.items()}
    plan = FaultPlan(
        grads=(GradFault(2, 0, mb=1), GradFault(2, 1, kind="scale", factor=4.0), GradFault(3, 1))
    )
    plan.after_compute(2, Act(Op.B, 0, 1), stages)  # not a W: nothing
    plan.after_compute(2, Act(Op.W, 0, 0), stages)  # other microbatch: nothing
    assert all(torch.equal(p.grad, g) for p, g in zip(stages[0], before[0], strict=True))
    plan.after_compute(2, Act(Op.W, 0, 1), stages)
    assert math.isnan(stages[0][0].grad[0]) and torch.equal(stages[0][1].grad, before[0][1])
    plan.at_tail(2, {1: stages[1]})
    assert torch.equal(stages[1][0].grad, before[1][0] * 4.0)
    with pytest.raises(ValueError, match="leave mb=None"):
        GradFault(0, 0, mb=1, kind="scale")
    assert (
        Crash(0, 1, "after_provisional")
        in FaultPlan(crashes=(Crash(0, 1, "after_provisional"),)).crashes
    )
