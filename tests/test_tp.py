"""Tensor (and sequence) parallelism inside pipeline stages: the mesh's tp dim, the "tp"
transform step, and pp x tp on gloo ranks bitwise against :func:`tp_reference_step`.

One 4-rank launch. On pp=2 x tp=2 it runs 1f1b, zb-h1 and zbv (two chunks per rank, the
V placement) on a small MLP stack with an explicit plan (an input Linear row-wise, blocks
of a norm and a column-wise / row-wise Linear pair, a column-wise head), with and without
sequence parallelism: losses and every gradient (local shard and placements) bitwise
against the tp-only reference run by the same ranks, and within ``RTOL``/``ATOL`` of the
single-process :func:`reference_step` on the unparallelized model (gradients gathered
with ``full_tensor()``); the payload of every activation message, which sequence
parallelism cuts to ``1/tp``; a second schedule on the same stages
(:meth:`Pipeline.with_schedule`: parallelized once); zb-h1 with every block recomputed;
the state dict (DTensors out, whole
tensors or DTensors in). On pp=1 x dp=2 x tp=2 the dp reduction of DTensor gradients.
And the refusals (the world size, ties across stages, a plan without tp; overlapped F&B
pairs with tp run: tests/test_overlap_tp.py).

Then the default plans (``tp_plan=None``) on our GPT (5 layers) and a tiny HF Llama (4
layers, a padded batch given as a tokenizer's mapping), M=4, in six runs covering every
pair of {model} x {1f1b, zb-h1, zbv} x {sequence parallelism off, on} (``MODEL_RUNS``), and
a tiny Qwen2 in two: losses and every
gradient bitwise against :func:`tp_reference_step`, and within ``MODEL_REL`` of the
single-process :func:`reference_step` on the unparallelized model. Our GPT under zbv puts
its final LayerNorm alone on a stage: its output, a boundary, is a sequence shard. These
run loss parallel (the default: the LM head hands the loss ``Shard(-1)`` logits, checked);
the Llama under zb-h1 runs once more with ``loss_parallel=False`` (gathered logits, its
padded labels normalised by the batch's token count): bitwise its own reference, and the
two runs' losses within tests/test_loss_parallel.py's ``bound`` (scaled to the count),
their gradients within its ``GRAD_REL``.

And our GPT with a vocabulary tp=2 does not divide (17: DTensor's uneven ``Shard(0)``,
:data:`ODD_RUNS`): zb-h1 with sequence parallelism off and on, the logits sharded for the
loss and gathered, and zbv with tied embeddings: losses and every gradient bitwise
``zerobubble.reference_step(tp_mesh=...)``, within ``ODD_REL`` of it at tp=1; the logits
the loss sees (9 + 8 local columns, or 17 gathered), the tables' local rows, and the state
dict (the model's own tensors, gathered). Its checkpoint (tied, zbv, AdamW) stores the
table and its AdamW state at the model's ``(17, 8)``, and a fresh pipeline that loads it
takes the next step bitwise as the uninterrupted run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

import zerobubble
from ranks import launch
from test_loss_parallel import GRAD_REL, bound
from zerobubble.executor import ExecutorOptions
from zerobubble.interop.hf import CausalLMLoss, causal_lm_layers, count_tokens, tiny_model
from zerobubble.models.gpt import GPTConfig, build_gpt, gpt_loss
from zerobubble.optim.checkpoint import load_checkpoint, save_checkpoint
from zerobubble.parallel.mesh import ParallelSpec, build_mesh, pipeline_ranks
from zerobubble.parallel.tp import ShardedLogits, default_plan
from zerobubble.pipeline import Pipeline
from zerobubble.program.instructions import Message, MsgKind
from zerobubble.reference.step import reference_step
from zerobubble.reference.tp import tp_reference_step
from zerobubble.runtime.hooks import StepHooks
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.p2p.wire import FRAME_HEADER

PP, TP = 2, 2
IN, D, H, OUT = 6, 8, 16, 5
B, T, M = 4, 4, 2
KINDS = ("1f1b", "zb-h1", "zbv")
RTOL, ATOL = 1e-5, 1e-6
"""Against the single process, where a row-wise layer's tp partial sums add otherwise."""
TIMEOUT = 300.0
GPT = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_heads=4, n_layers=2, seed=1)
LM_B, LM_T, LM_M = 4, 8, 4
MODEL_RUNS = (
    ("gpt", "1f1b", False),
    ("gpt", "zb-h1", True),
    ("gpt", "zbv", True),
    ("llama", "1f1b", True),
    ("llama", "zb-h1", False),
    ("llama", "zbv", False),
    ("qwen2", "zb-h1", True),
    ("qwen2", "zbv", False),
)
"""A covering design of {our GPT, the Llama} x {schedule} x {sequence parallelism}, not the
full product: every kind with each model and with sequence parallelism off and on, every
model off and on (our GPT under zbv with it on: its LayerNorm stage's boundary a sequence
shard); the small MLP stack above runs the full kind x sp product. And a Qwen2 (biased
q/k/v projections: sharded biases; untied, as ties across stages are refused with tp)
under a zero-bubble schedule each way."""
MODEL_REL = 1e-5
"""Against the single process: max |pipeline - single| over a model's gradients relative
to its largest gradient, and over its losses relative to the largest loss (measured
2.2e-7 for our GPT, 2.1e-7 for the Llama, the losses equal)."""


class Block(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(IN, D), Block(), Block(), Block(), Block(), nn.Linear(D, OUT)]


def batch(n: int = B, seed: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, IN, generator=g), torch.randn(n, T, OUT, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def mlp_plan(sp: bool):
    """Per stage module: the input layer row-wise (a replicated input, its output the
    boundary's layout), each block's pair column-wise then row-wise (with ``sp`` its norm
    sequence-parallel and the activations between blocks, the boundaries included,
    sharded over the sequence), the head column-wise with a replicated output (the loss)."""
    between = Shard(1) if sp else Replicate()

    def plan(stage: int, module: nn.Module) -> dict[str, ParallelStyle]:
        out: dict[str, ParallelStyle] = {}
        for name, child in module.named_children():
            if isinstance(child, Block):
                if sp:
                    out[f"{name}.norm"] = SequenceParallel()
                out[f"{name}.fc1"] = ColwiseParallel(input_layouts=between)
                out[f"{name}.fc2"] = RowwiseParallel(output_layouts=between)
            elif child.in_features == IN:
                out[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
            else:
                out[name] = ColwiseParallel(input_layouts=between, output_layouts=Replicate())
        return out

    return plan


class Bytes(StepHooks):
    """The size of every activation frame this rank sends (layout stubs included)."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def encode(self, msg: Message, t: torch.Tensor) -> torch.Tensor:
        if msg.kind is MsgKind.ACT:
            self.sent.append(t.numel() * t.element_size())
        return t


def shard(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """A gradient's local tensor and placements (none for a plain tensor)."""
    return (t.to_local(), tuple(t.placements)) if isinstance(t, DTensor) else (t, ())


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare(pipe: Pipeline, want: dict[str, torch.Tensor]) -> list[str]:
    """Names of this rank's parameters whose gradient is not ``want``'s, bitwise (local
    shard and placements)."""
    bad = []
    for name, p in pipe.named_parameters():
        (got, where), (ref, ref_where) = shard(p.grad), shard(want[name])
        if where != ref_where or not torch.equal(got, ref):
            bad.append(name)
    return bad


def zero(pipe: Pipeline) -> None:
    for p in pipe.parameters():
        p.grad = None


def refusals(mesh) -> list[str]:
    """What a pipeline with tp refuses, each raised on every rank before any collective."""
    out = []
    with pytest.raises(ValueError) as e:
        build_mesh(PP, tp=4)
    out.append(str(e.value))
    shared = nn.Linear(D, D)  # in stage 0 and stage 1, sharded on stage 0 only
    chain = [nn.Linear(IN, D), shared, Block(), shared, nn.Linear(D, OUT)]
    with pytest.raises(ValueError) as e:
        half = {"1": ColwiseParallel()}
        Pipeline(
            chain,
            loss_fn,
            "1f1b",
            microbatches=M,
            mesh=mesh,
            tp_plan=lambda s, _: half if s == 0 else {},
        )
    out.append(str(e.value))
    flat = build_mesh(PP * TP)
    with pytest.raises(ValueError) as e:
        Pipeline(layers(), loss_fn, "1f1b", microbatches=4, mesh=flat, tp_plan=mlp_plan(False))
    out.append(str(e.value))
    return out


def lm(name: str) -> tuple[list[nn.Module], Callable[..., torch.Tensor]]:
    """Our GPT (5 layers) or a tiny HF Llama or Qwen2 (4 layers: 2 blocks, grouped-query
    attention, rotary) and its loss."""
    if name == "gpt":
        return list(build_gpt(GPT)), gpt_loss
    untie = {"tie_word_embeddings": False} if name == "qwen2" else {}  # ties are refused with tp
    model = tiny_model(f"hf-{name}", num_hidden_layers=2, seed=2, **untie)
    return causal_lm_layers(model), CausalLMLoss(model)


def lm_batch(name: str) -> tuple[object, torch.Tensor]:
    """Ids and targets; Llama's as a tokenizer's mapping with right padding (the mask and
    the labels' -100 travel whole under sequence parallelism)."""
    g = torch.Generator().manual_seed(30)
    vocab = GPT.vocab_size if name == "gpt" else 256
    ids = torch.randint(3, vocab, (LM_B, LM_T), generator=g)
    if name == "gpt":
        return ids, torch.randint(0, vocab, (LM_B, LM_T), generator=g)
    mask = (torch.arange(LM_T) < torch.tensor([[8], [5], [8], [3]])).long()
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)


def head_layouts(pipe: Pipeline) -> list[str]:
    """Filled by each forward of the loss stage's last layer (if this rank holds it): the
    placements of the logits it hands the loss, or "plain"."""
    seen: list[str] = []
    last = pipe.executor.chunks.get(pipe.schedule.num_stages - 1)
    if last is not None:
        head = list(last.module.children())[-1]
        head.register_forward_hook(
            lambda _m, _a, o: seen.append(str(o.placements) if isinstance(o, DTensor) else "plain")
        )
    return seen


ODD = GPTConfig(vocab_size=17, max_seq_len=8, d_model=8, n_heads=2, n_layers=2, seed=4)
"""Our GPT with a vocabulary tp=2 does not divide: DTensor's uneven ``Shard(0)``, rows 0-8
on tp rank 0 and 9-16 on tp rank 1 (the token table and the LM head)."""
ODD_RUNS = (
    ("zb-h1", False, None, False),
    ("zb-h1", True, None, False),
    ("zb-h1", False, False, False),
    ("zb-h1", True, False, False),
    ("zbv", True, None, True),
)
"""(kind, sequence parallelism, loss_parallel, tie_embeddings): each way of the logits
(sharded for the loss, or gathered) with sequence parallelism off and on, and the tied
table under the V placement (both replicas on pipeline rank 0, one local shard)."""
ODD_REL = 1e-6
"""Against the single process (tp=1): max |difference| over the gradients relative to the
largest, and over the losses relative to the largest loss (measured: 2.6e-7 and 8.3e-8 at most)."""


def odd(tie: bool) -> list[nn.Module]:
    return list(build_gpt(dataclasses.replace(ODD, tie_embeddings=tie)))


def odd_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and targets over the whole vocabulary (the last id, 16, on tp rank 1's short
    shard), some targets left out (-100)."""
    g = torch.Generator().manual_seed(31)
    x, y = (torch.randint(0, ODD.vocab_size, (LM_B, ODD.max_seq_len), generator=g) for _ in "xy")
    x[0, 0] = y[0, 1] = ODD.vocab_size - 1
    y[1, :3] = -100
    return x, y


def vocab_runs(out: dict) -> None:
    """:data:`ODD_RUNS` at pp=2 x tp=2 with the default plan: bitwise
    ``zerobubble.reference_step`` with the tp mesh; the logits the loss sees, the local
    rows of the vocabulary-sharded tables and the state dict (the user's shapes)."""
    x, y = odd_batch()
    odd_v = ODD.vocab_size
    for kind, sp, lp, tie in ODD_RUNS:
        mesh = build_mesh(PP, tp=TP, sequence_parallel=sp)
        model = odd(tie)
        pipe = Pipeline(
            copy.deepcopy(model), gpt_loss, kind, microbatches=LM_M, mesh=mesh, loss_parallel=lp
        )
        seen: list[tuple] = []
        last = pipe.executor.chunks.get(pipe.schedule.num_stages - 1)
        if last is not None:
            head = list(last.module.children())[-1]
            head.register_forward_hook(lambda _m, _a, o, into=seen: into.append(_logits(o)))
        losses = pipe.step(x, target=y)
        if tie:
            pipe.tied.reduce(0)  # without an optimizer each replica holds its stage's part
        want_losses, want = zerobubble.reference_step(
            model, gpt_loss, x, target=y, microbatches=LM_M, tp_mesh=mesh.tp_mesh,
            sequence_parallel=sp, loss_parallel=lp, num_stages=pipe.schedule.num_stages,
        )  # fmt: skip
        params = dict(pipe.named_parameters())
        whole_model = nn.Sequential(*model).state_dict()
        out[("vocab", kind, sp, lp, tie), mesh.pp_rank, mesh.tp_rank] = {
            "losses": None if losses is None else all(map(torch.equal, losses, want_losses)),
            "values": losses,
            "bad": compare(pipe, want),
            "full": {n: whole(p.grad) for n, p in params.items()},
            "heads": sorted(set(seen)),
            "rows": {n: shard(p)[0].shape[0] for n, p in params.items() if p.shape[0] == odd_v},
            "state": {
                k: torch.equal(whole(v), whole_model[k]) for k, v in pipe.state_dict().items()
            },
        }


def vocab_checkpoint(out: dict, root: str) -> None:
    """Our GPT with vocabulary 17 at pp=2 x tp=2 (tied: the V placement's shared shard):
    two AdamW steps, a checkpoint after the first; a fresh pipeline that loads it and takes
    the second step holds every parameter and AdamW state shard bitwise the uninterrupted
    run's."""
    mesh = build_mesh(PP, tp=TP)
    x, y = odd_batch()
    runs = []
    for _ in range(2):
        pipe = Pipeline(odd(True), gpt_loss, "zbv", microbatches=LM_M, mesh=mesh)
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        runs.append((pipe, opt, pipe.set_optimizer(opt)))
    (pipe, opt, trainer), (resumed, resumed_opt, resumed_trainer) = runs
    pipe.step(x, target=y)
    save_checkpoint(trainer, root, mesh=mesh)
    load_checkpoint(resumed_trainer, root, mesh=mesh)
    for p_ in (pipe, resumed):
        p_.step(x, target=y)
        p_.drain()
    bad = []
    for (n, a), (_, b) in zip(pipe.named_parameters(), resumed.named_parameters(), strict=True):
        state, loaded = opt.state[a], resumed_opt.state[b]
        pairs = [(a, b)] + [(v, loaded[k]) for k, v in state.items()]
        if (
            not state
            or state.keys() != loaded.keys()
            or not all(torch.equal(shard(u)[0], shard(v)[0]) for u, v in pairs)
        ):
            bad.append(n)
    out["vocab checkpoint", mesh.pp_rank, mesh.tp_rank] = bad


def _logits(o: torch.Tensor) -> tuple:
    """The logits the loss takes: placements (or "plain"), whole width, local width."""
    if isinstance(o, DTensor):
        return str(o.placements), o.shape[-1], o.to_local().shape[-1]
    return "plain", o.shape[-1], o.shape[-1]


LM_GATHERED = ("llama", "zb-h1", False)
"""The run of MODEL_RUNS made again with ``loss_parallel=False``."""


def lm_runs(out: dict) -> None:
    """Our GPT and the tiny Llama and Qwen2 at pp=2 x tp=2 with the default plans
    (``tp_plan=None``), and :data:`LM_GATHERED` with gathered logits."""
    for name, kind, sp, lp in (*((*r, None) for r in MODEL_RUNS), (*LM_GATHERED, False)):
        mesh = build_mesh(PP, tp=TP, sequence_parallel=sp)
        assert mesh.tp_mesh is not None
        x, y = lm_batch(name)
        layers_, loss = lm(name)
        pipe = Pipeline(layers_, loss, kind, microbatches=LM_M, mesh=mesh, loss_parallel=lp)
        heads = head_layouts(pipe)
        losses = pipe.executor.step(x, target=y)
        ref_layers, ref_loss = lm(name)
        ref_losses, ref = tp_reference_step(
            ref_layers,
            ref_loss,
            x,
            target=y,
            microbatches=LM_M,
            tp_mesh=mesh.tp_mesh,
            sequence_parallel=sp,
            loss_parallel=lp,
            num_stages=pipe.schedule.num_stages,
        )
        key = (name, kind, sp) if lp is None else "gathered"
        out[key, mesh.pp_rank, mesh.tp_rank] = {
            "losses": None if losses is None else all(map(torch.equal, losses, ref_losses)),
            "values": losses,
            "bad": compare(pipe, ref),
            "full": {n: whole(p.grad) for n, p in pipe.named_parameters()},
            "heads": sorted(set(heads)),
        }


def job(root: str) -> dict:
    init_distributed()
    out: dict = {}
    lm_runs(out)
    vocab_runs(out)
    vocab_checkpoint(out, root)
    x, y = batch()
    for sp in (False, True):
        mesh = build_mesh(PP, tp=TP, sequence_parallel=sp)
        assert mesh.tp_mesh is not None
        plan = mlp_plan(sp)
        first: Pipeline | None = None
        for kind in KINDS:
            pipe = Pipeline(layers(), loss_fn, kind, microbatches=M, mesh=mesh, tp_plan=plan)
            counter = Bytes()
            losses = pipe.executor.step(x, target=y, hooks=counter)
            ref_losses, ref = tp_reference_step(
                layers(),
                loss_fn,
                x,
                target=y,
                microbatches=M,
                tp_mesh=mesh.tp_mesh,
                tp_plan=plan,
                sequence_parallel=sp,
                num_stages=pipe.schedule.num_stages,
            )
            result = {
                "losses": None if losses is None else all(map(torch.equal, losses, ref_losses)),
                "bad": compare(pipe, ref),
                "dtensors": sum(isinstance(p, DTensor) for p in pipe.parameters()),
                "full": {n: whole(p.grad) for n, p in pipe.named_parameters()},
                "sent": counter.sent,
            }
            if kind == "1f1b":
                first = pipe
            elif kind == "zb-h1":  # the same stages under another schedule: parallelized once
                assert first is not None
                zero(first)
                other = first.with_schedule(pipe.schedule)
                other.executor.step(x, target=y)
                result["with_schedule"] = compare(other, ref)
                recomputed = Pipeline(
                    layers(),
                    loss_fn,
                    kind,
                    microbatches=M,
                    mesh=mesh,
                    tp_plan=plan,
                    options=ExecutorOptions(recompute="layers"),
                )
                recomputed.executor.step(x, target=y)
                result["recompute"] = compare(recomputed, ref)
            out[sp, kind, mesh.pp_rank, mesh.tp_rank] = result
        assert first is not None
        state = first.state_dict()
        new = nn.Sequential(*layers(seed=1)).state_dict()
        first.load_state_dict(new)  # whole tensors: each rank keeps its shard
        loaded = {k: torch.equal(whole(v), new[k]) for k, v in first.state_dict().items()}
        first.load_state_dict(state)  # DTensors of the same layout
        back = {
            k: torch.equal(shard(v)[0], shard(state[k])[0]) for k, v in first.state_dict().items()
        }
        out[sp, "state", mesh.pp_rank, mesh.tp_rank] = {
            "dtensors": sorted(k for k, v in state.items() if isinstance(v, DTensor)),
            "loaded": loaded,
            "back": back,
        }
    out["refusals", mesh.pp_rank, mesh.tp_rank] = refusals(mesh)
    # pp=1 x dp=2 x tp=2: each dp replica's gradient shards summed over dp
    mesh = build_mesh(1, 2, tp=TP)
    assert mesh.tp_mesh is not None
    plan = mlp_plan(False)
    xs, ys = batch(2 * B, seed=20)
    part = slice(mesh.dp_rank * B, (mesh.dp_rank + 1) * B)
    pipe = Pipeline(layers(), loss_fn, "1f1b", microbatches=M, mesh=mesh, tp_plan=plan)
    pipe.executor.step(xs[part], target=ys[part])
    refs = [
        tp_reference_step(
            layers(),
            loss_fn,
            xs[r * B : (r + 1) * B],
            target=ys[r * B : (r + 1) * B],
            microbatches=M,
            tp_mesh=mesh.tp_mesh,
            tp_plan=plan,
        )[1]
        for r in range(2)
    ]
    # Each replica's loss is weighted by B / 2B = its reference's weight / 2 (exact: a
    # power of two), and the two replicas' sum is commutative (gloo's all-reduce).
    summed = {n: (refs[0][n] + refs[1][n]) * 0.5 for n in refs[0]}
    out["dp", mesh.dp_rank, mesh.tp_rank] = {"bad": compare(pipe, summed)}
    # the one reference: dp=2 x tp in one call, each replica normalised by the global batch
    _, composed = zerobubble.reference_step(
        layers(), loss_fn, xs, target=ys, microbatches=M, dp=2, tp_mesh=mesh.tp_mesh,
        tp_plan=plan,
    )  # fmt: skip
    out["dp composed", mesh.dp_rank, mesh.tp_rank] = {"bad": compare(pipe, composed)}
    return out


def test_parallel_spec_refuses_bad_tp() -> None:
    with pytest.raises(ValueError, match=r"^mesh sizes must be >= 1, got pp=2, dp=1, ep=1, tp=0$"):
        ParallelSpec(2, tp=0)
    with pytest.raises(ValueError) as e:
        ParallelSpec(2, sequence_parallel=True)
    assert str(e.value) == (
        "sequence_parallel=True shards activations over the mesh's tp dimension: it needs "
        "tp >= 2 (got tp=1); build the mesh with tp >= 2 or leave sequence_parallel off"
    )
    # ep with tp: the experts replicated over tp, one ep group per tp rank (test_ep_tp)
    assert ParallelSpec(2, 2, ep=2, tp=2).coordinates(7) == {"pp": 1, "dp": 1, "tp": 1, "ep": 1}
    assert ParallelSpec(2, 2, tp=2, sequence_parallel=True).world_size == 8


@pytest.mark.parametrize(
    ("kwargs", "field", "shown"),
    [
        ({"pp": "2"}, "pp", "'2' (str)"),  # was a TypeError from inside the comparisons
        ({"pp": 2, "dp": 2.0}, "dp", "2.0 (float)"),
        ({"pp": 2, "ep": True}, "ep", "True (bool)"),
        ({"pp": 2, "tp": None}, "tp", "None (NoneType)"),
        ({"pp": 2, "fsdp": 1}, "fsdp", "1 (int)"),
        ({"pp": 2, "tp": 2, "sequence_parallel": "yes"}, "sequence_parallel", "'yes' (str)"),
    ],
)
def test_parallel_spec_fields_are_type_checked_naming_the_field(kwargs, field, shown) -> None:
    with pytest.raises(ValueError) as e:
        ParallelSpec(**kwargs)
    assert str(e.value).startswith(f"ParallelSpec.{field} must be "), str(e.value)
    assert f"got {shown}" in str(e.value)
    with pytest.raises(ValueError, match=r"^ParallelSpec\.pp must be an integer >= 1, got '2'"):
        build_mesh("2")  # checked before the process group is needed
    with pytest.raises(ValueError, match=r"^build_mesh: device_type must be a device type name"):
        build_mesh(2, device_type=0)  # type: ignore[arg-type]
    assert ParallelSpec(2, 2).name(3) == "rank 3 (pp 1, dp 1)"
    assert ParallelSpec(2, 2, ep=2).name(1) == "rank 1 (pp 0, dp 1, ep 1)"
    assert ParallelSpec(2, 2, tp=2).name(5) == "rank 5 (pp 1, dp 0, tp 1)"


def test_the_hf_head_shards_for_causal_lm_loss_only() -> None:
    """The adapter's head leaves the logits sharded under loss parallel; ``CausalLMLoss``
    takes them for ``ForCausalLMLoss`` only (another loss of the model: gathered)."""
    model = tiny_model("hf-llama", num_hidden_layers=2, seed=2)
    head = nn.Sequential(causal_lm_layers(model)[-1])
    for lp in (True, False):
        plan = default_plan(head, TP, stage=1, sequence_parallel=True, loss_parallel=lp)
        assert isinstance(plan["0.lm_head"], ShardedLogits) is lp
    assert CausalLMLoss(model).loss_parallel is True
    model.loss_function = lambda logits, labels, **kw: loss_fn(logits, labels)
    assert CausalLMLoss(model).loss_parallel is False


def test_pipelines_are_the_pp_ranks_of_each_dp_tp_coordinate() -> None:
    """rank = (pp_rank * dp + dp_rank) * tp + tp_rank; tp == 1 keeps the old layout."""
    assert pipeline_ranks(2, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert pipeline_ranks(2, 1, 2) == [[0, 2], [1, 3]]
    assert pipeline_ranks(2, 2) == [[0, 2], [1, 3]]
    assert pipeline_ranks(3, 1, 1) == [[0, 1, 2]]


def test_the_model_runs_cover_every_pair() -> None:
    runs = [r for r in MODEL_RUNS if r[0] != "qwen2"]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        want = {(x[a], y[b]) for x in runs for y in runs}
        assert {(r[a], r[b]) for r in runs} == want, (a, b)
    assert ("gpt", "zbv", True) in runs and LM_GATHERED in runs


@pytest.mark.bitwise
def test_pp_tp_bitwise_against_the_tp_reference(tmp_path: Path) -> None:
    results: dict = {}
    for r in launch(job, PP * TP, str(tmp_path), timeout=TIMEOUT):
        results.update(r)
    x, y = batch()
    for sp in (False, True):
        header = FRAME_HEADER  # a multiple of 64 bytes: the payload follows it directly
        payload = B // M * (T // TP if sp else T) * D * 4
        for kind in KINDS:
            _, single = reference_step(layers(), loss_fn, x, target=y, microbatches=M)
            for d in range(PP):
                for t in range(TP):
                    r = results[sp, kind, d, t]
                    holds_last = d == (0 if kind == "zbv" else PP - 1)  # V: the last on 0
                    assert r["losses"] is (True if holds_last else None), (sp, kind, d, t)
                    assert r["bad"] == [], (sp, kind, d, t)
                    assert r.get("with_schedule", []) == [], (sp, kind, d, t)
                    assert r.get("recompute", []) == [], (sp, kind, d, t)
                    assert r["dtensors"] > 0
                    for n, g in r["full"].items():
                        torch.testing.assert_close(g, single[n], rtol=RTOL, atol=ATOL)
                    # a layout stub (a bare header) then the frame, per microbatch
                    holds_output = kind == "zbv" or d == 0
                    assert r["sent"] == ([header, header + payload] * M if holds_output else [])
        for d in range(PP):
            for t in range(TP):
                st = results[sp, "state", d, t]
                assert st["dtensors"] and all(st["loaded"].values()) and all(st["back"].values())
    for t in range(TP):
        for j in range(2):
            assert results["dp", j, t]["bad"] == []
            assert results["dp composed", j, t]["bad"] == []
    want = [
        "the world has 4 ranks but the mesh pp=2 x dp=1 x tp=4 needs 8; launch pp*dp*tp = 8 "
        "processes or change --pp/--dp/--tp",
        "tied parameter '1.weight' has different shapes, dtypes or tensor-parallel layouts on "
        "its holder ranks ([dtype code, ndim, dims] layout: rank 0: [0, 2, 8, 8] (Shard(0)); "
        "rank 1: [0, 2, 8, 8] whole); build the same model on every rank, and under tensor "
        "parallelism shard the tied weight alike on every holder stage (e.g. a "
        "vocabulary-sharded embedding and a column-wise LM head)",
        "tp_plan is given but the mesh has no tensor parallelism (tp=1): build the mesh with "
        "build_mesh(..., tp=2 or more), or drop tp_plan",
    ]
    for d in range(PP):
        for t in range(TP):
            assert results["refusals", d, t] == want
    lm_checks(results)
    vocab_checks(results)
    record = json.loads((tmp_path / "manifest.json").read_text())
    stored = FileSystemReader(str(tmp_path / record["path"])).read_metadata()
    shapes = {k: tuple(v.size) for k, v in stored.state_dict_metadata.items() if "weight" in k}
    assert shapes["model.0.tok.weight"] == shapes["optim.0.tok.weight.exp_avg"] == (17, 8)
    assert "model.4.weight" not in shapes  # the tie, stored once under its first name
    for d in range(PP):
        for t in range(TP):
            assert results["vocab checkpoint", d, t] == [], (d, t)


def lm_checks(results: dict) -> None:
    """The GPT, Llama and Qwen2 runs: losses and every gradient (local shard and placements)
    bitwise against ``tp_reference_step`` on every rank; against ``reference_step`` on the
    unparallelized model within ``MODEL_REL`` of each model's largest gradient (loss)."""
    errs: dict[str, float] = {}
    singles: dict[str, tuple] = {}
    for name, kind, sp in MODEL_RUNS:
        if name not in singles:
            layers_, loss = lm(name)
            x, y = lm_batch(name)
            singles[name] = reference_step(layers_, loss, x, target=y, microbatches=LM_M)
        single_losses, single = singles[name]
        scale = max(float(g.abs().max()) for g in single.values())
        loss_scale = max(float(v.abs()) for v in single_losses)
        holder = 0 if kind == "zbv" else PP - 1  # the V placement: the last stage on rank 0
        for d in range(PP):
            for t in range(TP):
                r = results[(name, kind, sp), d, t]
                assert r["losses"] is (True if d == holder else None), (name, kind, sp, d, t)
                assert r["bad"] == [], (name, kind, sp, d, t)
                assert r["heads"] == (["(Shard(dim=2),)"] if d == holder else [])
                assert r["full"].keys() <= single.keys()
                for n, g in r["full"].items():
                    err = float((g - single[n]).abs().max()) / scale
                    errs[name] = max(errs.get(name, 0.0), err)
                for got, want in zip(r["values"] or [], single_losses, strict=False):
                    errs[name + " loss"] = max(
                        errs.get(name + " loss", 0.0), float((got - want).abs()) / loss_scale
                    )
        held = set().union(
            *(results[(name, kind, sp), d, t]["full"] for d in range(PP) for t in range(TP))
        )
        assert held == single.keys(), (name, kind, sp)
    assert len(errs) == 2 * len(singles) and max(errs.values()) < MODEL_REL, errs
    gathered_checks(results)


def gathered_checks(results: dict) -> None:
    """The Llama's gathered run: bitwise its own reference; against the loss-parallel run,
    the losses within ``bound`` (a token sum over the batch's count: the bound of the
    microbatch's token mean, times its tokens over the count), the gradients within
    ``GRAD_REL`` of the largest."""
    _, labels = lm_batch("llama")
    count = count_tokens(labels)
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    counted = [int((part != -100).sum()) for part in shifted.chunk(LM_M)]
    for d in range(PP):
        for t in range(TP):
            r, lp = results["gathered", d, t], results[LM_GATHERED, d, t]
            assert r["bad"] == [] and r["losses"] is (True if d == PP - 1 else None)
            assert r["heads"] == (["plain"] if d == PP - 1 else [])
            scale = max(float(g.abs().max()) for g in r["full"].values())
            err = max(float((lp["full"][n] - g).abs().max()) for n, g in r["full"].items())
            assert err / scale < GRAD_REL
            for got, want, n in zip(lp["values"] or [], r["values"] or [], counted, strict=False):
                mean = float(want) * count / n
                assert abs(float(got - want)) <= bound(256, LM_B // LM_M * LM_T, mean) * n / count


def vocab_checks(results: dict) -> None:
    """:data:`ODD_RUNS`: bitwise the tp reference on every rank; the loss sees sharded
    logits 9 + 8 columns wide under loss parallel, the whole 17 gathered; each table holds
    its 9 or 8 rows; the state dict is the model's; within ``ODD_REL`` of tp=1."""
    x, y = odd_batch()
    for kind, sp, lp, tie in ODD_RUNS:
        single_losses, single = reference_step(odd(tie), gpt_loss, x, target=y, microbatches=LM_M)
        scale = max(float(g.abs().max()) for g in single.values())
        loss_scale = max(float(v.abs()) for v in single_losses)
        holder = 0 if kind == "zbv" else PP - 1
        held: set[str] = set()
        for d in range(PP):
            for t in range(TP):
                r = results[("vocab", kind, sp, lp, tie), d, t]
                assert r["losses"] is (True if d == holder else None), (kind, sp, lp, d, t)
                assert r["bad"] == [], (kind, sp, lp, d, t)
                rows = 9 if t == 0 else 8
                logits = ("(Shard(dim=2),)", 17, rows) if lp is None else ("plain", 17, 17)
                assert r["heads"] == ([logits] if d == holder else [])
                middle = kind == "zbv" and d == 1  # the V: both ends on pipeline rank 0
                assert set(r["rows"].values()) == (set() if middle else {rows})
                assert r["state"] and all(r["state"].values())
                held |= r["full"].keys()
                for n, g in r["full"].items():
                    assert float((g - single[n]).abs().max()) <= ODD_REL * scale, n
                for got, want in zip(r["values"] or single_losses, single_losses, strict=True):
                    assert float((got - want).abs()) <= ODD_REL * loss_scale
        assert held == single.keys()
