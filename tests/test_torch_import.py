"""PyTorch pipelining's own schedules, imported from their CSV form, validated and simulated.

This is how we compare against that peer: same validator, same simulator.
"""

from __future__ import annotations

import csv
import io

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from conftest import exact_costs
from zerobubble.interop.torch_pipelining import torch_schedule
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.formats import torch_csv
from zerobubble.schedule.validate import validate


def torch_csv_text(name, p, m):
    """Exactly what PyTorch's ``_dump_csv`` writes for its pipeline_order."""
    out = io.StringIO()
    writer = csv.writer(out)
    for row in get_schedule_ops(name, p, m):
        writer.writerow(row)
    return out.getvalue()


# (name, P, M) -> expected (cost, peak) at F=B=W=1, or the validator's rejection.
VALID = {
    ("GPipe", 4, 8): (33, 8),
    ("Interleaved1F1B", 4, 8): (57 / 2, 11 / 2),
    ("InterleavedZeroBubble", 4, 8): (51 / 2, 4),
    ("ZBVZeroBubble", 4, 8): (24, 4),
    ("ZBVZeroBubble", 2, 4): (12, 2),
    # Its OVERLAP_F_B pairs are kept (Schedule.overlaps); a pair starts once both its inputs
    # are in, which at these costs (no all-to-all to hide) costs each pair's F its earlier
    # start: run one after the other they give 51/2 and 25/2.
    ("DualPipeV", 4, 8): (27, 9 / 2),
    ("DualPipeV", 2, 4): (13, 5 / 2),
}


@pytest.mark.parametrize(("name", "p", "m"), list(VALID))
def test_torch_schedules_load_validate_and_simulate(name, p, m):
    sched = torch_csv.loads(torch_csv_text(name, p, m), name=name, num_microbatches=m)
    result = validate(sched, costs=exact_costs(sched))
    assert (result.cost, max(result.peak_memory)) == VALID[name, p, m]
    assert torch_schedule(name, p, m) == sched.with_actions(sched.actions, name=f"torch:{name}")


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12)])
def test_torch_1f1b_listing_is_rejected_precisely(p, m):
    """PyTorch's 1F1B table (as its visualizer produces it) names microbatch M on rank P-1."""
    sched = torch_csv.loads(torch_csv_text("1F1B", p, m), num_microbatches=m)
    with pytest.raises(ScheduleError) as err:
        validate(sched)
    e = err.value
    assert e.reason is Reason.OUT_OF_RANGE and e.device == p - 1 and e.action.mb == m
    assert f"microbatch {m} is outside [0, {m})" in str(e)


def test_our_zbv_is_no_worse_than_torchs_under_uneven_costs():
    from zerobubble.schedule.generators import generate

    ours, theirs = generate("zbv", 4, 12), torch_schedule("ZBVZeroBubble", 4, 12)
    for F, B, W in ((1, 1, 1), (1, 2, 1), (1, 1.5, 0.5)):
        a = validate(ours, costs=exact_costs(ours, F, B, W))
        b = validate(theirs, costs=exact_costs(theirs, F, B, W))
        assert a.cost <= b.cost
