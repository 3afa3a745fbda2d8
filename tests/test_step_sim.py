"""Back-to-back iterations under the three optimizer-step modes: closed forms."""

from __future__ import annotations

from fractions import Fraction

import pytest

from zerobubble.schedule.generators import generate
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.step_sim import StepCosts, StepMode, simulate_steps


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb-h2"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_sync_step_is_makespan_plus_reduction_plus_step(kind, p, m, exact):
    sched = generate(kind, p, m)
    costs = exact(sched, comm=Fraction(1, 4))
    sc = StepCosts(opt_step=2, allreduce=Fraction(1, 2), hop=Fraction(1, 3))
    sim = simulate_steps(sched, costs, sc, mode="sync", iterations=4)
    assert sim.step_time == simulate(sched, costs).makespan + Fraction(5, 2)
    assert sim.first_start[0][0] == 0 and len(sim.first_start[0]) == p


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8)])
def test_speculative_zb_h2_has_no_bubble_across_iterations(p, m, exact):
    """With free optimizer messages and steps, ZB-H2's parallelogram tiles: M(F+B+W) per step."""
    sched = generate("zb-h2", p, m)
    sim = simulate_steps(sched, exact(sched), StepCosts(), mode="speculative", iterations=5)
    assert sim.step_time == 3 * m
    assert simulate(sched, exact(sched)).makespan > 3 * m  # one iteration alone has a ramp


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb-h2"])
def test_conservative_with_free_protocol_equals_the_barrier(kind, exact):
    sched = generate(kind, 4, 8)
    costs = exact(sched)
    sync = simulate_steps(sched, costs, StepCosts(), mode="sync", iterations=3)
    cons = simulate_steps(sched, costs, StepCosts(), mode="conservative", iterations=3)
    assert cons.step_time == sync.step_time == simulate(sched, costs).makespan


def test_conservative_hides_the_optimizer_step_but_pays_the_round_trip(exact):
    """ZB-H1, P=2: device 0 starts k+1 once the state went 0 -> 1 -> 0 (two hops); the
    steps run while it waits, so the step time is makespan + 2 hops, not + opt_step."""
    sched = generate("zb-h1", 2, 4)
    costs = exact(sched)
    span = simulate(sched, costs).makespan
    sc = StepCosts(opt_step=1, allreduce=1, hop=Fraction(1, 2))
    cons = simulate_steps(sched, costs, sc, mode="conservative", iterations=4)
    sync = simulate_steps(sched, costs, sc, mode="sync", iterations=4)
    assert sync.step_time == span + 2
    assert cons.step_time == span + 1  # device 0 waited for 2 hops; its step overlapped
    # ZB-H1 ends on every device at once: starting k+1 early on device 0 gains nothing.
    spec = simulate_steps(sched, costs, sc, mode="speculative", iterations=4)
    assert spec.step_time == cons.step_time
    # ZB-H2's tail is a parallelogram: speculation gains the round trip and more.
    h2 = generate("zb-h2", 2, 4)
    times = [simulate_steps(h2, exact(h2), sc, mode=m, iterations=4).step_time for m in StepMode]
    assert times == [15, 13.5, 13]


def test_one_iteration_has_no_step_time(exact):
    sched = generate("1f1b", 2, 2)
    sim = simulate_steps(sched, exact(sched), StepCosts(), mode=StepMode.SYNC, iterations=1)
    with pytest.raises(ValueError, match="at least two iterations"):
        _ = sim.step_time
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        simulate_steps(sched, exact(sched), StepCosts(), mode="sync", iterations=0)
