"""Shared and tied parameters: one parameter per rank, replicas summed in stage order.

Pipelines at P=3 over our GPT (``tie_embeddings=True``) and an MLP whose first and
last Linear share their weight, every schedule kind, 5 AdamW steps with clipping:
losses and parameters bitwise equal to :func:`tied_reference_step` (per-stage
gradients summed in stage order), and the replicas bitwise equal on every rank.

A covering design, not the full product (kind x model): the fast kinds (one of each
placement: looped, interleaved, V) run every model; every other kind runs one model,
rotating, so that every model also meets every other kind's placement family (looped and V).
The tie's code paths depend on the placement (which ranks hold the tie, one rank holding two
of its stages) and on the model (two or three holders), not on a kind's order of actions.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerobubble
from generated import RUNTIME_KINDS, generated
from ranks import launch
from zerobubble.models import GPTConfig, build_gpt, gpt_loss, mlp_loss
from zerobubble.parallel.partition import build_stage_modules, stage_bounds
from zerobubble.parallel.tied import find_shared, tie_local_replicas, tied_reference_step
from zerobubble.reference.step import reference_step
from zerobubble.runtime.p2p.comm import PeerError

TIMEOUT = 600.0
P = 3
M = 4
# auto picks its own chunk count, which can need more stages than these models have layers.
KINDS = [k for k in RUNTIME_KINDS if k not in ("optimal", "optimal-v", "auto")]
FAST = ["zbv", "interleaved-1f1b", "zb-h1"]
SLOW = [k for k in KINDS if k not in FAST]


def tied_gpt() -> nn.Sequential:
    cfg = GPTConfig(
        vocab_size=11, max_seq_len=5, d_model=8, n_heads=2, n_layers=4, tie_embeddings=True
    )
    return build_gpt(cfg)


def tied_mlp(seed: int = 0) -> nn.Sequential:
    """Seven layers; the first and the last Linear share one weight (not the bias)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(6)]
    layers.append(nn.Linear(5, 5))
    layers[-1].weight = layers[0][0].weight
    return nn.Sequential(*layers)


def tied_mlp3(seed: int = 0) -> nn.Sequential:
    """:func:`tied_mlp` whose middle layer uses the weight too: a tie of three stages."""
    model = tied_mlp(seed)
    model[3][0].weight = model[0][0].weight
    return model


def batches(model: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    if model == "gpt":
        return [
            (
                torch.randint(0, 11, (8, 5), generator=gen),
                torch.randint(0, 11, (8, 5), generator=gen),
            )
            for _ in range(steps)
        ]
    return [
        (torch.randn(8, 5, generator=gen), torch.randn(8, 5, generator=gen)) for _ in range(steps)
    ]


CASES = {
    "gpt": (tied_gpt, gpt_loss, "0.tok.weight"),
    "mlp": (tied_mlp, mlp_loss, "0.0.weight"),
    "mlp3": (tied_mlp3, mlp_loss, "0.0.weight"),
}


# ---- single process ----------------------------------------------------------------------


def test_find_shared_names_the_tie_its_stages_and_local_names():
    model = tied_gpt()
    (tp,) = find_shared(list(model), tuple(model._modules), stage_bounds(7, 6))
    assert tp.names == ("0.tok.weight", "6.weight") and tp.stages == (0, 5)
    assert tp.local == {0: ("0.tok.weight",), 5: ("0.weight",)}
    (one,) = find_shared(list(model), tuple(model._modules), stage_bounds(7, 1))
    assert one.stages == (0,) and not one.tied


class Named(nn.Module):
    """A layer cut out of a bigger model: it names its state as that model does."""

    def __init__(self, inner: nn.Module, prefix: str) -> None:
        super().__init__()
        self.inner, self.prefix = inner, prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def source_name(self, name: str) -> str:
        return f"{self.prefix}.{name.removeprefix('inner.')}"


def test_find_shared_takes_every_layer_source_and_names_the_tie_as_the_model_does():
    model = tied_mlp()
    bounds = stage_bounds(7, 3)
    (tp,) = find_shared(model, tuple(model._modules), bounds)  # the Sequential itself
    assert tp.names == tp.source_names == ("0.0.weight", "6.weight")
    assert find_shared(lambda i: model[i], tuple(map(str, range(7))), bounds) == ()
    layers = [Named(model[0], "embed"), *model[1:6], Named(model[6], "lm_head")]
    (tp,) = find_shared(layers, tuple(map(str, range(7))), bounds)
    assert tp.names == ("0.inner.0.weight", "6.inner.weight")
    assert tp.source_names == ("embed.0.weight", "lm_head.weight")
    assert tp.stages == (0, 2) and tp.local == {0: ("0.inner.0.weight",), 2: ("1.inner.weight",)}


def test_a_rank_holding_two_stages_of_a_tie_keeps_one_memory_and_two_replicas():
    model = tied_mlp()
    stages = build_stage_modules(model, zerobubble.generate("zbv", P, M), 0)
    first, last = stages[0][0][0].weight, stages[5][0].weight
    assert first is not last and first.data_ptr() == last.data_ptr()
    assert torch.equal(first, model[0][0].weight) and first is not model[0][0].weight
    shared = build_stage_modules(model, zerobubble.generate("1f1b", 1, M), 0)[0]
    assert shared[0][0].weight is shared[6].weight  # one stage: one Parameter, as in the model
    own = build_stage_modules(model, zerobubble.generate("zbv", P, M), 0, copy_layers=False)
    assert own[0][0] is model[0] and own[5][0].weight is not model[0][0].weight
    assert own[5][0].weight.data_ptr() == model[0][0].weight.data_ptr()


def test_reference_order_is_close_to_plain_autograd_and_exact_elsewhere():
    model = tied_gpt()
    ref = copy.deepcopy(model)
    x, y = batches("gpt", 1)[0]
    losses = tied_reference_step(model, gpt_loss, x, y, M, stage_bounds(7, 6))
    ref_losses, _ = reference_step(ref, gpt_loss, x, y, M)
    assert all(map(torch.equal, losses, ref_losses))
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if name == "0.tok.weight":
            assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-6)
        else:
            assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("model_name", ["gpt", "mlp3"])
def test_the_one_reference_with_num_stages_is_the_tied_order_bitwise(model_name):
    """``zerobubble.reference_step`` given the pipeline's cut holds a replica of a tie per
    stage and sums the stages' gradients in stage order, as tied_reference_step (the
    pipelines' ground truth above) does: bitwise, under the tie's first name only."""
    build = tied_gpt if model_name == "gpt" else tied_mlp3
    n, stages = (7, 6) if model_name == "gpt" else (7, 3)
    model, ref = build(), build()
    x, y = batches(model_name, 1)[0]
    loss_fn = gpt_loss if model_name == "gpt" else mlp_loss
    want_losses = tied_reference_step(ref, loss_fn, x, y, M, stage_bounds(n, stages))
    losses, grads = zerobubble.reference_step(
        model, loss_fn, x, target=y, microbatches=M, num_stages=stages
    )
    assert all(map(torch.equal, losses, want_losses))
    want = {name: p.grad for name, p in ref.named_parameters()}
    assert grads.keys() == want.keys()
    assert all(torch.equal(grads[k], want[k]) for k in want), [
        k for k in want if not torch.equal(grads[k], want[k])
    ]
    assert all(torch.equal(p.grad, want[k]) for k, p in model.named_parameters())


def test_sharing_the_runtime_cannot_honour_is_refused_naming_the_parameter():
    sched = zerobubble.generate("1f1b", P, M)
    buf = tied_mlp()
    buf[0].register_buffer("scale", torch.ones(1))
    buf[6].register_buffer("scale", buf[0].scale)
    with pytest.raises(ValueError, match=r"buffer '0.scale' is shared by layers of different"):
        build_stage_modules(buf, sched, 0)
    mem = tied_mlp()
    mem[6].weight = nn.Parameter(mem[0][0].weight.data)
    with pytest.raises(ValueError, match=r"'0.0.weight' \(stage 0\) and '6.weight' \(stage 2\)"):
        build_stage_modules(mem, sched, 0)
    layers = list(tied_mlp())
    with pytest.raises(ValueError, match=r"factory's layers share a parameter between stage 0"):
        build_stage_modules(lambda i: layers[i], zerobubble.generate("zbv", P, M), 0, num_layers=7)
    model = tied_mlp()
    (tp,) = find_shared(list(model), tuple(model._modules), stage_bounds(7, 6))
    stages = {0: nn.Sequential(model[0]), 5: copy.deepcopy(nn.Sequential(model[6])).double()}
    with pytest.raises(ValueError, match=r"tied parameter '0.0.weight': stage 0 holds it as"):
        tie_local_replicas(stages, [tp])
    same = tied_mlp()
    same[6] = same[0]  # one module in stages 0 and 5 of rank 0, uncopied
    with pytest.raises(ValueError, match=r"'0.0.weight' is used by stages 0 and 5 through one"):
        build_stage_modules(same, zerobubble.generate("zbv", P, M), 0, copy_layers=False)


# ---- on 3 gloo ranks ---------------------------------------------------------------------


def train(
    schedule: zerobubble.Schedule, model_name: str, mode: str = "sync", steps: int = 5
) -> dict:
    """``steps`` AdamW steps with clipping through Pipeline and through the reference."""
    kind = schedule.name
    build, loss_fn, tied_name = CASES[model_name]
    model = build()
    ref = copy.deepcopy(model)
    pipe = zerobubble.Pipeline(model, loss_fn, schedule, tied_check_every=2)
    # Post-validation: rank 0's prefix norm (about 1.03 at step 0) stays below the
    # threshold, the full norm (1.64) does not: rank 0 steps early and rolls back.
    max_norm = 0.3 if mode == "sync" else 1.2
    config = zerobubble.OptimConfig(mode=mode, max_norm=max_norm)

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1)

    bad: list[str] = []
    actions: list[str] = []
    trainer = pipe.set_optimizer(adamw(pipe.parameters()), config)
    trainer.on_commit = lambda c: actions.append(c.action.value + " rolled back" * c.rolled_back)
    ref_opt = adamw(ref.parameters())
    ref_params = dict(ref.named_parameters())
    bounds = stage_bounds(len(model), schedule.num_stages)
    for step, (x, y) in enumerate(batches(model_name, steps)):
        losses = pipe.step(x, target=y)
        ref_losses = tied_reference_step(ref, loss_fn, x, y, M, bounds)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        if pipe.executor.has_last and not all(map(torch.equal, losses or [], ref_losses)):
            bad.append(f"{kind} {model_name} step {step}: losses differ")
        if mode == "sync":
            bad += [
                f"{kind} {model_name} step {step}: {name} differs"
                for name, p in pipe.named_parameters()
                if not torch.equal(p, ref_params[name])
            ]
    pipe.drain()
    bad += [
        f"{kind} {model_name} {mode} after the drain: {name} differs"
        for name, p in pipe.named_parameters()
        if not torch.equal(p, ref_params[name])
    ]
    replicas = [
        p.detach().numpy().tobytes()
        for c in pipe.executor.chunks.values()
        for n, p in c.module.named_parameters()
        if pipe._name(c.stage, n) == tied_name
    ]
    return {
        "bad": bad,
        "replicas": replicas,
        "names": [n for n, _ in pipe.named_parameters()],
        "keys": list(pipe.state_dict()),
        "actions": actions,
    }


def state_and_check() -> dict:
    """load_state_dict fills every replica; the checksum check catches a drifted one."""
    model = tied_mlp()
    pipe = zerobubble.Pipeline(model, mlp_loss, "interleaved-1f1b", microbatches=M)
    other = tied_mlp(seed=3)
    pipe.load_state_dict(other.state_dict())  # both names of the tie are in it
    only_first = {k: v for k, v in other.state_dict().items() if k != "6.weight"}
    pipe.load_state_dict(only_first)
    bad = [k for k, v in pipe.state_dict().items() if not torch.equal(v, other.state_dict()[k])]
    replicas = [
        torch.equal(p, other[0][0].weight)
        for c in pipe.executor.chunks.values()
        for n, p in c.module.named_parameters()
        if pipe._name(c.stage, n) == "0.0.weight"
    ]
    pipe.tied.check(0)
    error = None
    if pipe.rank == 2:
        with torch.no_grad():
            pipe.executor.chunks[5].module[0].weight[0, 0] += 1
    try:
        pipe.tied.check(1)
    except RuntimeError as e:
        error = str(e)
    peer = None
    if pipe.rank == 0:  # rank 2, the other holder, never joins this reduction
        pipe.tied.timeout_s = 1.0
        try:
            pipe.tied.reduce(7)
        except PeerError as e:
            peer = (str(e), e.group)
    torch.distributed.barrier()  # rank 2 stays alive (silent) until rank 0 timed out
    return {
        "bad": bad,
        "replicas": replicas,
        "error": error,
        "peer": peer,
        "keys": list(pipe.state_dict()),
    }


def schedules_taking_turns() -> dict:
    """1F1B, ZB-H1 (split) and ZB-H1 with B/W fusion take turns on one tied GPT through
    ``with_schedule``: one AdamW, one set of tied groups, against the stage-order reference."""
    model = tied_gpt()
    ref = copy.deepcopy(model)
    root = zerobubble.Pipeline(model, gpt_loss, zerobubble.generate("1f1b", P, M))
    zb = zerobubble.generate("zb-h1", P, M)
    split = root.with_schedule(zb, options=zerobubble.ExecutorOptions(fuse_local_backward=False))
    fused = root.with_schedule(zb)
    pipes = [root, split, fused]
    opt = torch.optim.AdamW(root.parameters(), lr=0.02, weight_decay=0.1)
    for pipe in pipes:
        pipe.set_optimizer(opt, zerobubble.OptimConfig(max_norm=0.3))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02, weight_decay=0.1)
    ref_params = dict(ref.named_parameters())
    bounds = stage_bounds(len(model), P)
    bad: list[str] = []
    for step, (x, y) in enumerate(batches("gpt", 6)):
        pipe = pipes[step % 3]
        losses = pipe.step(x, target=y)
        ref_losses = tied_reference_step(ref, gpt_loss, x, y, M, bounds)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        ref_opt.step()
        if pipe.executor.has_last and not all(map(torch.equal, losses or [], ref_losses)):
            bad.append(f"step {step} ({pipe.schedule.name}): losses differ")
        bad += [
            f"step {step} ({pipe.schedule.name}): {name} differs"
            for name, p in pipe.named_parameters()
            if not torch.equal(p, ref_params[name])
        ]
    runs_split = fused.schedule.split_stages()
    errors = []
    for other, options in [
        (zerobubble.generate("zbv", P, M), None),
        (zb, zerobubble.ExecutorOptions(recompute="stage")),
    ]:
        try:
            root.with_schedule(other, options=options)
        except ValueError as e:
            errors.append(str(e))
    return {
        "bad": bad,
        "one_model": all(
            [id(p) for p in q.parameters()] == [id(p) for p in root.parameters()]
            and q.tied is root.tied
            for q in pipes
        ),
        "chunks": [
            (
                root.executor.chunks[s].split,
                split.executor.chunks[s].split,
                s in runs_split,
                fused.executor.chunks[s] is (split if s in runs_split else root).executor.chunks[s],
                split.executor.chunks[s].module is root.executor.chunks[s].module,
            )
            for s in sorted(root.executor.chunks)
        ],
        "iterations": [q.executor.iteration for q in pipes],
        "errors": errors,
    }


def covering_runs(kinds: list[str]) -> list[tuple[str, str]]:
    """(kind, model) for the kinds not in FAST: one model each, rotating with the kind."""
    models = list(CASES)
    return [(kind, models[i % len(models)]) for i, kind in enumerate(kinds)]


def schedules(kinds: list[str]) -> dict[str, zerobubble.Schedule]:
    """Built once in the test, not on every rank (the searching kinds take seconds)."""
    return {kind: generated(kind, P, M) for kind in kinds}


def job(
    runs: list[tuple[str, str]],
    post: list[str],
    shared: bool,
    scheds: dict[str, zerobubble.Schedule],
) -> dict:
    """``shared``: also the state-dict, checksum and with_schedule checks (no kind in them)."""
    zerobubble.init_distributed(timeout_s=120)
    out = {f"{kind}/{m}": train(scheds[kind], m) for kind, m in runs}
    for kind in post:
        for mode in ("conservative", "speculative"):
            out[f"{kind}/{mode}"] = train(scheds[kind], "gpt", mode)
    if shared:
        out["state"] = state_and_check()
        out["turns"] = schedules_taking_turns()
    torch.distributed.destroy_process_group()
    return out


def check(results: list[dict], runs: list[tuple[str, str]], post: list[str]) -> None:
    """The training runs only; :func:`check_shared` checks the rest."""
    names = [f"{k}/{m}" for k, m in runs]
    names += [f"{k}/{mode}" for k in post for mode in ("conservative", "speculative")]
    for run in names:
        assert [b for r in results for b in r[run]["bad"]] == [], run
        replicas = [t for r in results for t in r[run]["replicas"]]
        assert len(replicas) == (3 if run.endswith("mlp3") else 2), run  # one per stage
        assert all(t == replicas[0] for t in replicas), run
        assert "clip" in results[-1][run]["actions"], run  # clipping did happen
        if run.endswith(("conservative", "speculative")):  # and undid provisional steps
            assert "clip rolled back" in [a for r in results for a in r[run]["actions"]], run
        model = CASES.get(run.split("/")[1], CASES["gpt"])[0]()
        names = [n for r in results for n in r[run]["names"]]
        held = [n for r in results for n in r[run]["names"]]
        assert sorted(set(held)) == sorted(n for n, _ in model.named_parameters()), run


def check_shared(results: list[dict]) -> None:
    state = [r["state"] for r in results]
    assert all(s["bad"] == [] and all(s["replicas"]) for s in state)
    assert "6.weight" not in [k for s in state for k in s["keys"]]
    assert state[1]["error"] is None  # rank 1 holds no replica
    message, group = state[0]["peer"]
    assert group == (0, 2) and message.startswith(
        "rank 0: reduction of tied parameter '0.0.weight''s gradient at iteration 7 in the "
        "collective over ranks [0, 2] failed: no completion within the comm timeout of 1s"
    )
    for rank in (0, 2):
        assert state[rank]["error"].startswith(
            f"rank {rank}: the replicas of tied parameter '0.0.weight' (stages [0, 5]) differ "
            "at iteration 1 (checksums rank 0: "
        )


def check_turns(results: list[dict]) -> None:
    turns = [r["turns"] for r in results]
    assert [b for t in turns for b in t["bad"]] == []
    assert all(t["one_model"] for t in turns)
    assert all(t["iterations"] == [2, 2, 2] for t in turns)
    # One stage per rank: 1F1B's chunk is unsplit, ZB-H1's split; with fusion ZB-H1 at
    # P=3, M=4 still splits stages 1 and 2, so rank 0 runs 1F1B's chunk, the others ZB-H1's.
    assert [t["chunks"] for t in turns] == [
        [(False, True, False, True, True)],
        [(False, True, True, True, True)],
        [(False, True, True, True, True)],
    ]
    placement, recompute = turns[0]["errors"]
    assert placement == (
        "schedule 'zbv' places stages on devices [0, 1, 2, 2, 1, 0] but this pipeline's "
        "'1f1b' places them on [0, 1, 2]; with_schedule reuses this rank's stages: generate "
        "the schedule for the same placement, or build a new Pipeline"
    )
    assert recompute.startswith("options recompute 'stage' but the stages were built with 'none'")


FAST_RUNS, FAST_POST = [(k, m) for k in FAST for m in CASES], ["interleaved-1f1b"]
SLOW_POST = ["zbv", "zb-h1"]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Both tests' runs in one launch (a launch's start-up dominates)."""
    runs, post = FAST_RUNS + covering_runs(SLOW), FAST_POST + SLOW_POST
    return launch(job, P, runs, post, True, schedules(KINDS), timeout=TIMEOUT)


@pytest.mark.bitwise
def test_tied_pipelines_match_the_stage_order_reference_bitwise(ranks):
    check(ranks, FAST_RUNS, FAST_POST)
    check_shared(ranks)
    check_turns(ranks)


def test_the_runs_cover_every_kind_model_and_placement_family():
    runs = FAST_RUNS + covering_runs(SLOW)
    assert {k for k, _ in runs} == set(KINDS)
    family = {k: s.placement for k, s in schedules(KINDS).items()}
    assert {(family[k], m) for k, m in runs} == {(f, m) for f in family.values() for m in CASES}


@pytest.mark.slow
def test_every_kind_with_a_tie_and_post_validation(ranks):
    check(ranks, covering_runs(SLOW), SLOW_POST)
