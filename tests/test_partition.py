"""Cutting layers into virtual stages and building only a rank's own stages."""

from __future__ import annotations

import re
from collections import OrderedDict

import pytest
import torch
from torch import nn

from zerobubble.parallel.partition import build_stage_modules, layer_keys, model_name, stage_bounds
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


def test_layer_keys_are_the_models_own():
    shared = nn.Linear(2, 2)
    named = nn.Sequential(OrderedDict([("embed", nn.Linear(2, 2)), ("a", shared), ("b", shared)]))
    assert layer_keys(named) == ("embed", "a", "b")  # a layer at two places keeps both keys
    assert layer_keys(nn.ModuleList(_layers(3))) == ("0", "1", "2")
    assert layer_keys(_layers(2)) == ("0", "1")
    assert layer_keys(lambda i: nn.Identity(), 3) == ("0", "1", "2")
    with pytest.raises(ValueError, match="needs num_layers"):
        layer_keys(lambda i: nn.Identity())
    with pytest.raises(ValueError, match="num_layers=3 but the model has 2 layers"):
        layer_keys(_layers(2), 3)


def test_stage_names_map_back_to_the_models_names_on_a_v_placement():
    """Every parameter of every stage, renamed, is the model's parameter of that name."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)) for _ in range(7)])
    sched = generate("zbv", 3, 3)  # 6 stages; device 0 holds stages 0 and 5
    keys = layer_keys(model)
    bounds = stage_bounds(len(keys), sched.num_stages)
    ref = dict(model.named_parameters())
    seen = []
    for rank in range(3):
        for s, mod in build_stage_modules(model, sched, rank).items():
            for name, p in mod.named_parameters():
                full = model_name(name, keys[bounds[s].start : bounds[s].stop])
                assert torch.equal(p, ref[full]) and p is not ref[full]
                seen.append(full)
    assert sorted(seen) == sorted(ref)
    assert model_name("0.1.bias", keys[bounds[5].start : bounds[5].stop]) == "6.1.bias"


@pytest.mark.parametrize("name", ["weight", "2.weight", "x.weight"])
def test_model_name_refuses_what_is_not_a_stage_name(name):
    message = "is not '<layer index>.<name>' of a stage with 2 layers"
    with pytest.raises(ValueError, match=re.escape(message)):
        model_name(name, ("4", "5"))


def test_a_whole_model_gives_its_layers_through_pipeline_layers_or_is_refused():
    from zerobubble.parallel.partition import model_layers

    class Cut(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.b(self.a(x))

        def pipeline_layers(self):
            return [self.a, self.b]

    model = Cut()
    assert model_layers(model) == [model.a, model.b]
    seq = nn.Sequential(nn.Linear(2, 2))
    assert model_layers(seq) is seq
    with pytest.raises(ValueError, match="Linear is a whole model, not its layers: pass the"):
        model_layers(nn.Linear(2, 2))
    model.pipeline_layers = lambda: nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"Cut.pipeline_layers\(\) returned Linear: return"):
        model_layers(model)
