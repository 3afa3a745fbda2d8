"""The typed views the checkers read events and gradients through: a compute event's action,
a message event's id, and the per-tensor norms in ``clip_grad_norm_``'s grouping."""

from __future__ import annotations

import pytest
import torch

from zerobubble.optim.norms import per_tensor_norms
from zerobubble.profile.bubbles import analyze_iteration
from zerobubble.profile.stages import stage_profile
from zerobubble.program.instructions import MsgKind
from zerobubble.schedule.ir import Action, Op
from zerobubble.trace.format import TraceEvent


def ev(rank, op, stage, mb, start=0, end=1, msg=None, peer=None) -> TraceEvent:
    return TraceEvent(3, rank, op, stage, mb, 0, start, end, 0, 0, peer, msg)


def test_action_of_a_compute_event_and_none_for_other_events():
    a = ev(2, "B", 4, 1).action
    assert a == Action(Op.B, 4, 1) and type(a) is Action and a.op is Op.B
    assert ev(0, "send", 0, 0, msg=("act", 0, 1, 0), peer=1).action is None
    assert ev(0, "wait_sends", None, None).action is None
    assert ev(0, "opt_step", None, None).action is None


@pytest.mark.parametrize(("stage", "mb"), [(None, 0), (0, None), (None, None)])
def test_action_of_a_compute_event_without_stage_or_mb_names_it(stage, mb):
    with pytest.raises(ValueError, match=r"rank 2, iteration 3: W event has stage=") as info:
        _ = ev(2, "W", stage, mb).action
    assert f"stage={stage!r}, mb={mb!r}" in str(info.value)
    assert "check-trace" in str(info.value)


def test_message_id_of_a_message_event_and_an_error_without_one():
    m = ev(1, "wait_recv", 1, 2, msg=("grad", 2, 1, 2), peer=2).message
    assert m == (MsgKind.GRAD, 2, 1, 2) and m[0] is MsgKind.GRAD
    with pytest.raises(ValueError, match=r"rank 1, iteration 3: send event has no msg"):
        _ = ev(1, "send", 1, 0, peer=2).message


def test_bubbles_refuses_a_compute_event_without_mb_with_a_value_error():
    trace = [ev(0, "F", 0, 0, 0, 10), ev(1, "F", 1, None, 12, 20)]
    with pytest.raises(ValueError, match=r"rank 1, iteration 3: F event has stage=1, mb=None"):
        analyze_iteration(trace, 3)


def test_stage_profile_refuses_a_compute_event_without_stage():
    with pytest.raises(ValueError, match=r"rank 0, iteration 3: BW event has stage=None"):
        stage_profile([ev(0, "F", 0, 0), ev(0, "BW", None, 0)], 1, skip_iterations=0)


def test_per_tensor_norms_keep_the_input_order_across_dtype_groups():
    grads = [
        torch.tensor([3.0, 4.0]),
        torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64),
        torch.tensor([6.0, 8.0]),
        torch.tensor([0.0, 5.0, 12.0], dtype=torch.float64),
    ]
    norms = per_tensor_norms(grads, 2.0)
    assert [n.item() for n in norms] == [5.0, 3.0, 10.0, 13.0]
    assert [n.dtype for n in norms] == [g.dtype for g in grads]
    inf = per_tensor_norms(grads, float("inf"))
    assert [n.item() for n in inf] == [4.0, 2.0, 8.0, 12.0]
