"""Segment costs measured from the model: the spans run the real computation, the fit
gives usable cuts. (No timing is asserted: only what the measurement feeds.)"""

from __future__ import annotations

import itertools

import pytest
import torch

from zerobubble.models import GPTConfig, build_gpt
from zerobubble.profile.segments import default_spans, profile_segment_cost, run_span
from zerobubble.schedule.segments import balanced_cuts


def _gpt():
    cfg = GPTConfig(vocab_size=32, max_seq_len=64, d_model=16, n_heads=2, n_layers=2)
    x = torch.randint(0, 32, (2, 64), generator=torch.Generator().manual_seed(0))
    return list(build_gpt(cfg)), x


def test_a_span_is_the_whole_pass_slice():
    layers, x = _gpt()
    with torch.no_grad():
        whole = x
        for layer in layers:
            whole = layer(whole)
    for start, end in [(0, 16), (16, 40), (40, 64)]:
        out = run_span(layers, x, start, end)
        torch.testing.assert_close(out, whole[:, start:end], rtol=1e-5, atol=1e-6)


def test_the_fit_gives_non_negative_terms_and_valid_cuts():
    layers, x = _gpt()
    cost = profile_segment_cost(layers, x, kernel="dense", iters=1)
    assert cost.kernel == "dense" and cost.linear >= 0 and cost.attention >= 0
    cuts = balanced_cuts(64, 4, cost, 8)
    assert cuts[0] == 0 and cuts[-1] == 64 and len(cuts) == 5
    assert all(b > a and b % 8 == 0 for a, b in itertools.pairwise(cuts))


def test_bad_spans_are_refused():
    layers, x = _gpt()
    assert default_spans(64) == [(0, 16), (0, 32), (32, 64)]
    with pytest.raises(ValueError, match=r"span \[40, 80\) is not inside the sequence of 64"):
        profile_segment_cost(layers, x, kernel="dense", spans=[(0, 8), (40, 80)])
    with pytest.raises(ValueError, match="too short to profile segments"):
        default_spans(3)
