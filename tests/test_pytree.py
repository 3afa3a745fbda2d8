"""Pytree stage boundaries and variable shapes.

Stages pass ``{"hidden": float, "mask": bool, "pos": int64, "meta": None/int}`` dicts
and tuples with a second gradient-carrying tensor and a float tensor without
gradient; stage 0 takes several arguments and a keyword; the loss takes a tuple and
a target dict. Stage 0 trims each microbatch to its longest row, so the shapes
differ between the microbatches of a step (a ragged last one too) and, with
another sequence length, between steps. Losses and every gradient must be bitwise
those of single-process autograd, for every schedule kind.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerobubble
from generated import RUNTIME_KINDS, generated
from ranks import launch
from zerobubble.runtime.launcher import LaunchError
from zerobubble.runtime.microbatch import batch_size, split_tree
from zerobubble.runtime.shapes import BoundaryError, Layout, describe, flatten, unflatten
from zerobubble.schedule.generators import GENERATORS

TIMEOUT = 300.0
D, V, T_MAX = 8, 11, 8


# ---- the model -----------------------------------------------------------------------------


class Embed(nn.Module):
    """Layer 0: ``(ids, mask, offset=...)`` -> dict; trims to the microbatch's longest row."""

    def __init__(self, bad: str = "") -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(T_MAX + 4, D)
        self.bad = bad

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, *, offset: int) -> dict:
        n = int(mask.sum(1).max())
        ids, mask = ids[:, :n], mask[:, :n]
        pos = (torch.arange(n) + offset).expand(ids.shape[0], n)
        out = {"hidden": self.tok(ids) + self.pos(pos), "mask": mask, "pos": pos, "meta": n}
        if self.bad == "leaf":
            out["meta"] = "length"
        elif self.bad == "layout":
            del out["pos"]
        elif self.bad == "changing" and ids.shape[0] < 3:  # the smaller microbatches
            out["meta"] = 0.5
        return out


class Block(nn.Module):
    """Takes a dict or a tuple, returns one of them; checks the int ``meta`` it gets."""

    def __init__(self, index: int, tuple_out: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.index = index
        self.tuple_out = tuple_out

    def forward(self, x):
        if isinstance(x, tuple):
            hidden, (mask, pos), meta, keep, aux = x
            hidden = hidden + keep.unsqueeze(-1) * aux
        else:
            hidden, mask, pos, meta = x["hidden"], x["mask"], x["pos"], x["meta"]
        if meta is not None and meta != hidden.shape[1]:
            raise ValueError(f"block {self.index} got meta {meta} for length {hidden.shape[1]}")
        h = hidden + torch.tanh(self.lin(self.norm(hidden))) * mask.unsqueeze(-1)
        h = h + 0.01 * pos.unsqueeze(-1)
        meta = None if meta is not None else h.shape[1]
        if self.tuple_out:
            return (h * 0.5, [mask, pos], meta, mask.float(), h)
        return {"hidden": h, "mask": mask, "pos": pos, "meta": meta}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(D, V)

    def forward(self, x):
        if isinstance(x, tuple):
            hidden, (mask, _), _, keep, aux = x
            hidden = hidden + keep.unsqueeze(-1) * aux
        else:
            hidden, mask = x["hidden"], x["mask"]
        return (self.out(hidden), mask)


def loss_fn(out, target):
    logits, mask = out
    labels = target["labels"][:, : logits.shape[1]]
    return F.cross_entropy(logits[mask], labels[mask]) * target["weight"]


def build_model(num_stages: int, bad: str = "") -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [Block(i, tuple_out=i % 2 == 0) for i in range(num_stages)]
    return nn.Sequential(Embed(bad), *blocks, Head())


def batch(n: int, t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, t), generator=gen)
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = torch.arange(t).expand(n, t) < lengths.unsqueeze(1)
    labels = torch.randint(0, V, (n, t), generator=gen)
    return (ids, mask), {"offset": seed % 3}, {"labels": labels, "weight": 0.5}


def reference(model: nn.Sequential, args, kwargs, target, m: int) -> list[torch.Tensor]:
    """Plain autograd, microbatch by microbatch, split by the documented rule."""
    n = batch_size((args, kwargs), "x")
    pieces = split_tree((args, kwargs), m, n)
    targets = split_tree(target, m, n)
    sizes = [len(t) for t in torch.tensor_split(torch.empty(n), m)]
    losses = []
    for (a, kw), tj, size in zip(pieces, targets, sizes, strict=True):
        out = model[0](*a, **kw)
        for layer in list(model)[1:]:
            out = layer(out)
        loss = loss_fn(out, tj)
        (loss * (size / n)).backward()
        losses.append(loss.detach())
    return losses


# ---- inside the ranks ----------------------------------------------------------------------


def check_kind(schedule: zerobubble.Schedule, steps=((9, 6, 0), (9, 4, 1), (9, 6, 0))) -> list[str]:
    """Three steps (batch 9: ragged; sequence length 6, 4, then 6 again: layouts that
    grow back to ones seen before) against the reference."""
    m = schedule.num_microbatches
    model = build_model(schedule.num_stages - 2)
    ref = copy.deepcopy(model)
    pipe = zerobubble.Pipeline(model, loss_fn, schedule)
    ref_params = dict(ref.named_parameters())
    name = f"{schedule.name} P={schedule.num_devices} S={schedule.num_stages}"
    bad = []
    for step, (n, t, seed) in enumerate(steps):
        args, kwargs, target = batch(n, t, seed=seed)
        losses = pipe.step(*args, target=target, **kwargs)
        ref_losses = reference(ref, args, kwargs, target, m)
        if pipe.executor.has_last and not (
            losses is not None and len(losses) == m and all(map(torch.equal, losses, ref_losses))
        ):
            bad.append(f"{name} step {step}: losses {losses} != {ref_losses}")
    for pname, p in pipe.named_parameters():
        want = ref_params[pname].grad
        if p.grad is None or want is None or not torch.equal(p.grad, want):
            bad.append(f"{name}: gradient of {pname} differs")
    return bad


V_AT_P4 = ("zbv", "dualpipev")
"""Run at P = 4 (M = 5) instead of P = 3: every kind runs once, the V placement at P = 4."""


def all_kinds(p: int) -> list[zerobubble.Schedule]:
    """Every kind but the MILP and :data:`V_AT_P4` at ``p``, M = 4."""
    out = []
    for kind in RUNTIME_KINDS:
        gen = GENERATORS[kind]
        if kind == "optimal" or kind in V_AT_P4:
            continue
        opts = {"chunks": 2} if "chunks" in gen.options else {}
        out.append(generated(kind, p, 4, **opts))
    return out


def matrix_job(scheds: list[zerobubble.Schedule]) -> list[str]:
    """The schedules come built (once, in the test: the search kinds take seconds)."""
    zerobubble.init_distributed(timeout_s=60)
    bad = [b for s in scheds for b in check_kind(s)]
    dist.destroy_process_group()
    return bad


def error_job(bad: str) -> None:
    zerobubble.init_distributed(timeout_s=60)
    sched = zerobubble.generate("1f1b", 2, 4)
    options = zerobubble.ExecutorOptions(comm_timeout_s=5)
    model = build_model(2, bad)  # stage 0 is the embedding alone
    pipe = zerobubble.Pipeline(model, loss_fn, sched, boundaries=[0, 1, 4], options=options)
    args, kwargs, target = batch(9, 6, seed=0)
    pipe.step(*args, target=target, **kwargs)


# ---- the tests -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.bitwise
def test_every_kind_at_p3_matches_autograd_bitwise():
    """Every kind but :data:`V_AT_P4` (run at P = 4 below) and the MILP."""
    bad = launch(matrix_job, 3, all_kinds(3), timeout=TIMEOUT)
    assert [b for rank in bad for b in rank] == []


@pytest.mark.slow
@pytest.mark.bitwise
def test_v_kinds_at_p4_match_autograd_bitwise():
    scheds = [zerobubble.generate(k, 4, 5) for k in V_AT_P4]
    bad = launch(matrix_job, 4, scheds, timeout=TIMEOUT)
    assert [b for rank in bad for b in rank] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("bad", "rank", "want"),
    [
        ("leaf", 0, "stage 0 output['meta']: a str cannot cross a stage boundary; expected a"),
        (
            "layout",
            1,
            "stage 0 -> stage 1: stage 1 (rank 1) cannot consume stage 0's output of "
            "{'hidden': [3, 6, 8] float32 (grad), 'mask': [3, 6] bool, 'meta': 6} "
            "(microbatch 0): KeyError: 'pos'",
        ),
        ("changing", 0, "stage 0 output['meta']: a float cannot cross a stage boundary"),
    ],
)
def test_boundary_errors_name_stage_side_and_leaf(bad, rank, want):
    with pytest.raises(LaunchError) as err:
        launch(error_job, 2, bad, timeout=TIMEOUT, grace=20)
    by_rank = {f.rank: f.error for f in err.value.failures}
    assert want in by_rank[rank], by_rank


# ---- without processes ----------------------------------------------------------------------


def test_layouts_round_trip_and_describe_every_leaf_kind():
    h = torch.randn(2, 3, requires_grad=True) * 2
    tree = {
        "hidden": h,
        "mask": torch.ones(2, 3, dtype=torch.bool),
        "pos": torch.arange(3),
        "meta": None,
        "n": -7,
        "rest": (True, [torch.zeros(0, 4, dtype=torch.float64)]),
    }
    codes, tensors = flatten(tree, "stage 1 output")
    assert [t.data_ptr() for t in tensors] == [
        tree[k].data_ptr() for k in ("hidden", "mask", "pos")
    ] + [tree["rest"][1][0].data_ptr()]
    assert describe(codes) == (
        "{'hidden': [2, 3] float32 (grad), 'mask': [2, 3] bool, 'pos': [3] int64, "
        "'meta': None, 'n': -7, 'rest': (True, [[0, 4] float64])}"
    )
    layout = Layout.of(codes, 64)
    assert layout.offsets == (64, 128, 192, 256) and layout.nbytes == 256
    assert layout.grads == (True, False, False, False)
    back = unflatten(codes, tensors)
    assert back.keys() == tree.keys() and back["rest"][1][0] is tree["rest"][1][0]
    assert type(back["rest"]) is tuple and type(back["rest"][1]) is list


def test_frames_carry_values_and_gradient_flags():
    from zerobubble.runtime.p2p.wire import (
        FRAME_HEADER,
        NEW_LAYOUT,
        FrameHeader,
        frame_header,
        pack_frame,
        unpack_frame,
    )

    tree = ([torch.randn(3, requires_grad=True) + 1, torch.tensor([[1, 2]])], {"k": 3})
    codes, tensors = flatten(tree, "x")
    layout = Layout.of(codes, FRAME_HEADER)
    frame = pack_frame(layout, tensors, torch.device("cpu"))
    assert frame_header(frame) == FrameHeader(0, 0, 0, False) and len(frame) == layout.nbytes
    got = unflatten(codes, unpack_frame(frame, layout))
    assert torch.equal(got[0][0], tensors[0]) and got[0][0].requires_grad
    assert torch.equal(got[0][1], tensors[1]) and not got[0][1].requires_grad
    assert got[1] == {"k": 3}
    # Inline in a larger frame (a receiver expecting a bigger layout): a prefix of it.
    head = FrameHeader(NEW_LAYOUT, len(codes), 4, True)
    big = pack_frame(layout, tensors, torch.device("cpu"), size=layout.nbytes + 100, header=head)
    assert frame_header(big) == head and len(big) == layout.nbytes + 100
    again = unflatten(codes, unpack_frame(big, layout))
    assert torch.equal(again[0][0], tensors[0]) and torch.equal(again[0][1], tensors[1])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"a": [1, "x"]}, "stage 2 input gradient['a'][1]: a str cannot cross"),
        ({"a": 0.5}, "stage 2 input gradient['a']: a float cannot cross"),
        ({1: torch.zeros(1)}, "stage 2 input gradient: dict key 1 is not a str"),
        ((torch.zeros(1, dtype=torch.complex64),), "input gradient[0]: a complex64 tensor"),
        ([2**70], "stage 2 input gradient[0]: the int 1180591620717411303424 does not fit"),
    ],
)
def test_unsupported_leaves_are_named_by_path(value, message):
    with pytest.raises(BoundaryError) as err:
        flatten(value, "stage 2 input gradient")
    assert message in str(err.value)


def test_split_tree_splits_batched_tensors_and_passes_the_rest():
    x = torch.arange(14).reshape(7, 2)
    tree = ((x, torch.tensor(5.0), torch.zeros(3)), {"k": None, "n": 4, "y": x[:, 0]})
    n = batch_size(tree, "x")
    parts = split_tree(tree, 3, n)
    assert n == 7 and [p[0][0].shape[0] for p in parts] == [3, 2, 2]
    assert all(p[0][1] is tree[0][1] and p[0][2] is tree[0][2] for p in parts)
    assert [p[1]["y"].tolist() for p in parts] == [[0, 2, 4], [6, 8], [10, 12]]
    assert all(p[1]["k"] is None and p[1]["n"] == 4 for p in parts)
    with pytest.raises(ValueError, match="holds no tensor with a batch dimension"):
        batch_size((torch.tensor(1.0), 3), "the input batch")
