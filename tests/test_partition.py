"""Cutting layers into virtual stages and building only a rank's own stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerobubble.runtime.partition import build_stage_modules, stage_bounds
from zerobubble.schedule.generators import generate


def sizes(bounds: tuple[range, ...]) -> list[int]:
    return [len(r) for r in bounds]


def test_equal_split_and_where_the_remainder_goes():
    assert stage_bounds(8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    assert sizes(stage_bounds(10, 4)) == [2, 3, 3, 2]  # interior stages first
    assert sizes(stage_bounds(7, 4)) == [2, 2, 2, 1]  # then stage 0
    assert sizes(stage_bounds(11, 4)) == [3, 3, 3, 2]
    assert sizes(stage_bounds(5, 2)) == [3, 2]
    assert sizes(stage_bounds(3, 1)) == [3]
    assert sizes(stage_bounds(4, 4)) == [1, 1, 1, 1]


def test_explicit_boundaries():
    assert stage_bounds(6, 3, [0, 1, 5, 6]) == (range(0, 1), range(1, 5), range(5, 6))


@pytest.mark.parametrize(
    ("layers", "stages", "boundaries", "message"),
    [
        (3, 4, None, "cannot cut 3 layers into 4 stages"),
        (6, 3, [0, 3, 6], "boundaries has 3 entries but 3 stages need 4"),
        (6, 3, [0, 3, 3, 6], r"must increase strictly.*leaves stage 1 without layers"),
        (6, 3, [0, 4, 2, 6], r"must increase strictly.*leaves stage 1 without layers"),
        (6, 3, [1, 2, 4, 6], "must start at 0 and end at the layer count 6"),
        (6, 3, [0, 2, 4, 7], "must start at 0 and end at the layer count 6"),
        (6, 0, None, "num_stages must be >= 1"),
    ],
)
def test_bad_cuts_are_explained(layers, stages, boundaries, message):
    with pytest.raises(ValueError, match=message):
        stage_bounds(layers, stages, boundaries)


def _layers(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(2, 2) for _ in range(n)]


def test_v_placement_gets_its_two_stages_as_copies():
    sched = generate("zbv", 2, 4)  # device 0 holds stages 0 and 3, device 1 stages 1 and 2
    layers = _layers(8)
    mods = build_stage_modules(layers, sched, 0)
    assert sorted(mods) == [0, 3]
    assert [len(m) for m in mods.values()] == [2, 2]
    assert torch.equal(mods[3][1].weight, layers[7].weight)
    assert mods[3][1].weight is not layers[7].weight  # deep copy: the caller's model is untouched
    seq = build_stage_modules(nn.Sequential(*layers), sched, 1)
    assert sorted(seq) == [1, 2] and torch.equal(seq[2][0].bias, layers[4].bias)


def test_factory_builds_only_the_needed_layers():
    sched = generate("interleaved-1f1b", 2, 2, chunks=2)  # rank 1 holds stages 1 and 3
    built = []

    def factory(i: int) -> nn.Module:
        built.append(i)
        return nn.Identity()

    mods = build_stage_modules(factory, sched, 1, num_layers=8, boundaries=[0, 1, 3, 6, 8])
    assert built == [1, 2, 6, 7]
    assert sorted(mods) == [1, 3]


def test_build_errors():
    sched = generate("1f1b", 2, 2)
    with pytest.raises(ValueError, match="needs num_layers"):
        build_stage_modules(lambda i: nn.Identity(), sched, 0)
    with pytest.raises(ValueError, match="num_layers=3 but the model has 4 layers"):
        build_stage_modules(_layers(4), sched, 0, num_layers=3)
    with pytest.raises(ValueError, match="rank 2 is not a device"):
        build_stage_modules(_layers(4), sched, 2)
