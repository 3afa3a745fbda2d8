"""Cost of the B/W split: time of B + W against one fused backward, and memory held after B.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_bw_split.py [--repeats N]
[--widths narrow|model|all] [--quick]``. Prints one JSON object; ``goals_met`` says, per
width, whether every row meets ``goals``, and ``missed`` names the rows that do not.

Workloads (CPU, one thread): blocks with the layers of Hugging Face GPT-2
(transformers' ``Conv1D``, as a local class with its contract) and of Llama
(bias-free Linears, SwiGLU, RMSNorm, grouped-query attention where the model has it),
each with autocast off and bf16, all as a middle stage (float input that needs a
gradient, output gradient given):

* ``width: "model"``: GPT-2 small's block (d_model 768, 12 heads) and SmolLM2-360M's
  Llama layers (d_model 960, 15 heads, 5 key/value heads, SwiGLU 2560), on one sequence
  of GPT-2's context length (T=1024). These are the rows the goals are for.
* ``width: "narrow"``: the same layers at d_model 128 and 256 (head size 32), T=512, B=2,
  this library's GPT block, and a whole small GPT as a single stage ending in the loss.
  Stress shapes: the split's fixed costs weigh most here (see docs/runtime.md, "Exactness
  and cost", for where the time goes).

Each is run three ways on identical weights:

* ``fused``: the unmodified layers, one ``torch.autograd.backward`` call.
* ``ours``: :class:`~zerobubble.runtime.stage.StageChunk` with split Linear and
  Embedding layers: ``backward_input`` (B), ``backward_weight`` (W), and
  ``backward_full`` (BW) for reference. Timed without memory tracking (as the
  executor runs untraced); the held bytes come from a tracking twin.
* ``torch_pipelining``: the unmodified layers with PyTorch pipelining's
  ``stage_backward_input`` (its B, "I") and ``stage_backward_weight`` (its W).

Times are thread CPU time (``time.thread_time``: with one thread all the work
runs on the calling thread, and the figure is not inflated when other
processes share the cores), medians over ``--repeats`` runs after two warm-up
runs, the three methods interleaved; forward is not timed.
``time_ratio_of_minima`` divides the fastest B + W by the fastest fused
backward: on a shared machine the minimum is the least disturbed run.
``time_ratio = (t_B + t_W) / t_fused`` (goal <= 1.05); ``time_ratio_wall`` is
the same ratio of wall-clock medians, next to it to show how far the machine's
load (``load_average`` in the output) moves the wall clock. ``w_time_share`` is
W's part of the weight-gradient time: ``t_W / (t_fused - t_input_only)``, where
``t_input_only`` is plain autograd asked for the input gradient only (goal >=
0.9, capped at 1; a difference of two medians, so noisy on a shared machine);
``w_param_share`` is the deferred share of parameter elements. Before measuring, glibc
is told (``mallopt``) to keep freed memory instead of returning it to the OS:
otherwise whichever op first touches fresh pages pays a few microseconds per
4 KiB page fault, which lands on one method or another depending on the heap's
history (10-15 ms per op here), not on the method. PyTorch's own caching
allocators behave the same way on GPUs. PyTorch pipelining is
compared on the block only: on a first stage (integer input) its
``stage_backward_input`` finds no input to differentiate and computes nothing,
so there is no split to measure.

Memory ("bytes held") counts the distinct storages a method keeps alive for
the microbatch, excluding parameters and buffers:

* tensors saved for backward: the forward runs under
  ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook stores a
  detached alias and keeps a weak reference to it, so a saved tensor counts
  exactly while autograd still holds it;
* tensors the method itself holds: the stage input (and, for PyTorch
  pipelining, the stage output it keeps as the backward root) after F; after B
  the store's W inputs and output gradients for ours, the ``param_groups``
  gradients for PyTorch pipelining.

``memory_ratio = held after B / held after F`` (goal <= 0.6). After B our
split keeps, per Linear, its input and its output gradient, so a block's token
terms are equal before and after B (16 * d_model floats per token each way);
what B frees is everything else, chiefly the softmax probabilities
(n_heads * T floats per token). The ratio therefore falls with T / head_dim:
for head_dim 32 and T 512 it is about 0.5. PyTorch pipelining retains the
graph between I and W, so its ratio is near or above 1.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import ctypes
import json
import math
import statistics
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining._backward import (
    stage_backward_input,
    stage_backward_weight,
)

from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.runtime.stage import StageChunk, storage_bytes

# ---- blocks with the layers of Hugging Face GPT-2 and Llama (without importing transformers) --


class Conv1D(nn.Module):
    """transformers' ``Conv1D`` contract: weight (in, out), ``addmm(bias, x.view(-1, in), w)``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: Tensor) -> Tensor:
        size_out = (*x.size()[:-1], self.nf)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


def _eager_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention as transformers' "eager" implementation computes it."""
    t = q.size(-2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return att.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype) @ v


class GPT2Block(nn.Module):
    """GPT-2's block: ln_1, c_attn (Conv1D d -> 3d), causal attention, c_proj, ln_2, MLP."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = Conv1D(3 * d, d), Conv1D(d, d)
        self.c_fc, self.mlp_proj = Conv1D(4 * d, d), Conv1D(d, 4 * d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        heads = [z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in (q, k, v)]
        a = _eager_attention(*heads)
        x = x + self.attn_proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class RMSNorm(nn.Module):
    """Llama's RMSNorm as a user module (a norm by name: kept in B, like nn.RMSNorm)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaBlock(nn.Module):
    """Llama's block: RMSNorm, bias-free q/k/v/o, causal attention with ``n_kv_heads``
    key/value heads (grouped-query when fewer than ``n_heads``), SwiGLU MLP."""

    def __init__(self, d: int, n_heads: int, hidden: int, n_kv_heads: int | None = None) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        kv = d // n_heads * self.n_kv_heads
        self.input_norm, self.post_norm = RMSNorm(d), RMSNorm(d)
        self.q, self.o = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k, self.v = nn.Linear(d, kv, bias=False), nn.Linear(d, kv, bias=False)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.input_norm(x)
        q = self.q(h).view(b, t, self.n_heads, -1).transpose(1, 2)
        k, v = (p(h).view(b, t, self.n_kv_heads, -1).transpose(1, 2) for p in (self.k, self.v))
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # transformers' repeat_kv: each key/value head serves `rep` query heads
            k, v = (
                z[:, :, None]
                .expand(b, self.n_kv_heads, rep, t, z.size(-1))
                .reshape(b, self.n_heads, t, z.size(-1))
                for z in (k, v)
            )
        a = _eager_attention(q, k, v)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _keep_freed_memory() -> bool:
    """No heap trimming and no mmap below 32 MiB (glibc); False where unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(
        libc.mallopt(m_trim_threshold, 2**31 - 1)
    )


class SavedTracker:
    """Weak references to every tensor autograd saves inside the context."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[Tensor]] = []

    def _pack(self, t: Tensor) -> Tensor:
        alias = t.detach()
        self.refs.append(weakref.ref(alias))
        return alias

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def alive(self) -> list[Tensor]:
        return [t for r in self.refs if (t := r()) is not None]


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(thread CPU time, wall-clock time) of ``fn()``, in seconds."""
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c0, time.perf_counter() - w0


def _clear(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


class Workload:
    """One stage: its layers, an input, and either an output gradient or a loss target."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        x: Tensor,
        *,
        grad: Tensor | None = None,
        target: Tensor | None = None,
        amp: bool = False,
        width: str = "narrow",
    ) -> None:
        self.name, self.module, self.x, self.grad, self.target = name, module, x, grad, target
        self.is_loss = target is not None
        self.amp = amp
        self.width = width
        """"narrow" (a stress shape) or "model" (a real model's width, see MODEL_WIDTHS)."""

    def autocast(self) -> torch.autocast | nullcontext:
        """The forward's context: autocast bf16 on CPU, or nothing."""
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.amp else nullcontext()

    def _plain_forward(self, module: nn.Module, x: Tensor) -> Tensor:
        with self.autocast():
            out = module(x)
            return gpt_loss(out, self.target) if self.is_loss else out

    def input_only(self, module: nn.Module) -> tuple[float, float]:
        """Plain autograd asked for the input gradient only: fused minus this is the
        weight-gradient time (for the share W defers)."""
        x = self._input()
        out = self._plain_forward(module, x)
        if not x.requires_grad:
            return 0.0, 0.0
        return _timed(lambda: torch.autograd.grad([out], [x], [self.grad]))

    def _input(self) -> Tensor:
        x = self.x.detach()
        return x if not x.is_floating_point() else x.requires_grad_(True)

    def fused(self, module: nn.Module) -> tuple[float, float]:
        _clear(module)
        out = self._plain_forward(module, self._input())
        return _timed(lambda: torch.autograd.backward([out], None if self.is_loss else [self.grad]))

    def ours(self, chunk: StageChunk, tracked: StageChunk) -> dict[str, float]:
        """Times on ``chunk`` (no memory tracking, as the executor runs untraced);
        held bytes from ``tracked``, run alike but not timed."""
        kw = {"target": self.target} if self.is_loss else {}
        _clear(tracked.module)
        with self.autocast():
            tracked.forward(0, self.x, **kw)
        held_f = tracked.held_bytes()
        tracked.backward_input(0, self.grad)
        held_b = tracked.held_bytes()
        tracked.backward_weight(0)
        _clear(chunk.module)
        with self.autocast():
            chunk.forward(0, self.x, **kw)
        t_b = _timed(lambda: chunk.backward_input(0, self.grad))
        t_w = _timed(lambda: chunk.backward_weight(0))
        with self.autocast():
            chunk.forward(1, self.x, **kw)
        t_bw = _timed(lambda: chunk.backward_full(1, self.grad))
        return {**_pair("B", t_b), **_pair("W", t_w), **_pair("BW", t_bw),
                "held_F": held_f, "held_B": held_b}  # fmt: skip

    def torch_pipelining(self, module: nn.Module) -> dict[str, float]:
        _clear(module)
        tracker = SavedTracker()
        x = self._input()
        with tracker.hooks():
            out = self._plain_forward(module, x)
        params = [*module.parameters(), *module.buffers()]
        held_f = storage_bytes([x, out, *tracker.alive()], exclude=params)
        res: dict[str, object] = {}

        def run_b() -> None:
            res["b"] = stage_backward_input(
                [out], None if self.is_loss else [self.grad], [x], module.parameters()
            )

        t_b = _timed(run_b)
        _, groups = res.pop("b")  # type: ignore[misc]
        held = tracker.alive() + [g for pg in groups for gs in pg.get("grads", []) for g in gs
                                  if g is not None]  # fmt: skip
        held_b = storage_bytes(held, exclude=params)
        t_w = _timed(lambda: stage_backward_weight(module.parameters(), groups))
        return {**_pair("B", t_b), **_pair("W", t_w), "held_F": held_f, "held_B": held_b}


def _pair(key: str, t: tuple[float, float]) -> dict[str, float]:
    """``{key: CPU time, key_wall: wall-clock time}``."""
    return {key: t[0], f"{key}_wall": t[1]}


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def bench(w: Workload, repeats: int) -> dict[str, object]:
    plain = copy.deepcopy(w.module)
    compare = not w.is_loss  # PyTorch pipelining's split needs a differentiable input
    pipelining = copy.deepcopy(w.module)
    stage, num_stages = (0, 1) if w.is_loss else (1, 3)
    loss_fn = gpt_loss if w.is_loss else None
    chunk, tracked = (
        StageChunk(copy.deepcopy(w.module), stage, num_stages, loss_fn=loss_fn, track_memory=t)
        for t in (False, True)
    )
    fused: list[tuple[float, float]] = []
    inputs_only: list[tuple[float, float]] = []
    ours: list[dict[str, float]] = []
    tp: list[dict[str, float]] = []
    for i in range(repeats + 2):
        f, o = w.fused(plain), w.ours(chunk, tracked)
        t = w.torch_pipelining(pipelining) if compare else None
        g = w.input_only(plain)
        if i >= 2:
            fused.append(f)
            inputs_only.append(g)
            ours.append(o)
            if t is not None:
                tp.append(t)
    t_fused = statistics.median(c for c, _ in fused)
    t_fused_wall = statistics.median(w for _, w in fused)
    t_wgrad = t_fused - statistics.median(c for c, _ in inputs_only)

    def summary(runs: list[dict[str, float]], with_bw: bool) -> dict[str, object]:
        t_b, t_w = _median(runs, "B"), _median(runs, "W")
        held_f, held_b = runs[0]["held_F"], runs[0]["held_B"]
        best = min(r["B"] + r["W"] for r in runs) / min(c for c, _ in fused)
        wall = (_median(runs, "B_wall") + _median(runs, "W_wall")) / t_fused_wall
        s: dict[str, object] = {
            "t_B_ms": round(1e3 * t_b, 3),
            "t_W_ms": round(1e3 * t_w, 3),
            "time_ratio": round((t_b + t_w) / t_fused, 3),
            "time_ratio_of_minima": round(best, 3),
            "time_ratio_wall": round(wall, 3),
            "held_after_F_bytes": int(held_f),
            "held_after_B_bytes": int(held_b),
            "memory_ratio": round(held_b / held_f, 3),
            # Undefined on a first stage: with no input gradient, all of B is weight work.
            "w_time_share": round(min(t_w / t_wgrad, 1.0), 3) if compare else None,
        }
        if with_bw:
            s["t_BW_ms"] = round(1e3 * _median(runs, "BW"), 3)
            s["bw_ratio"] = round(_median(runs, "BW") / t_fused, 3)
        return s

    share = tracked.split_share
    mine = summary(ours, True)
    result: dict[str, object] = {
        "workload": w.name,
        "width": w.width,
        "autocast": "bf16" if w.amp else "off",
        "t_fused_backward_ms": round(1e3 * t_fused, 3),
        "t_fused_backward_wall_ms": round(1e3 * t_fused_wall, 3),
        "t_weight_grad_in_fused_ms": round(1e3 * t_wgrad, 3),
        "w_param_share": None if share is None else round(share.fraction, 4),
        "ours": mine,
        "meets_goals": _meets_goals(mine),
    }
    if compare:
        result["torch_pipelining"] = summary(tp, False)
    return result


GOALS = {"time_ratio": 1.05, "memory_ratio": 0.6, "w_time_share": 0.9}
"""The issue's goals: (B + W)/fused at most, held after B over after F at most, W's share of
the weight-gradient time at least."""


def _meets_goals(s: dict[str, object]) -> bool:
    """Whether one method's summary meets :data:`GOALS` (a share that is undefined, on a
    first stage, does not count)."""
    share = s["w_time_share"]
    return (
        float(s["time_ratio"]) <= GOALS["time_ratio"]  # type: ignore[arg-type]
        and float(s["memory_ratio"]) <= GOALS["memory_ratio"]  # type: ignore[arg-type]
        and (share is None or float(share) >= GOALS["w_time_share"])  # type: ignore[arg-type]
    )


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return make()


def llama_hidden(d: int) -> int:
    """Llama's SwiGLU width: 8/3 of ``d``, rounded up to a multiple of 8 (344 for d=128)."""
    return 8 * math.ceil(d / 3)


MODEL_WIDTHS = (
    ("GPT-2 small", "gpt2", 768, 12, 12, 0),
    ("SmolLM2-360M", "llama", 960, 15, 5, 2560),
)
"""Blocks at real models' widths: (model, layout, d_model, heads, key/value heads, SwiGLU
width); GPT-2 small's block as transformers builds it, and the Llama layers of SmolLM2-360M
(a ``LlamaForCausalLM``, grouped-query attention with 5 key/value heads). Run on one
sequence of GPT-2's context length, T=1024 (the same 1024 tokens as the narrow rows)."""


def workloads(quick: bool, widths: str = "all") -> list[Workload]:
    """``widths``: "narrow" (d_model 128 and 256, head size 32, and this library's blocks),
    "model" (:data:`MODEL_WIDTHS`) or "all"; ``quick``: one small narrow shape of each."""
    gen = torch.Generator().manual_seed(0)
    b, t = (1, 128) if quick else (2, 512)
    block_cfg = GPTConfig(vocab_size=512, max_seq_len=t, d_model=128, n_heads=4, n_layers=1)
    block = build_gpt(block_cfg)[1]
    x = torch.randn(b, t, block_cfg.d_model, generator=gen)
    g = torch.randn(b, t, block_cfg.d_model, generator=gen)
    gpt_cfg = GPTConfig(vocab_size=512, max_seq_len=t, d_model=128, n_heads=4, n_layers=2)
    ids = torch.randint(0, gpt_cfg.vocab_size, (b, t + 1), generator=gen)
    out: list[Workload] = []
    if widths in ("narrow", "all"):
        for d in (128,) if quick else (128, 256):
            heads = d // 32  # head_dim 32, as the memory model above assumes
            xd = x if d == 128 else torch.randn(b, t, d, generator=gen)
            gd = g if d == 128 else torch.randn(b, t, d, generator=gen)
            gpt2 = _seeded(lambda: GPT2Block(d, heads))  # noqa: B023
            llama = _seeded(lambda: LlamaBlock(d, heads, llama_hidden(d)))  # noqa: B023
            out += [
                Workload(f"hf_gpt2_block (Conv1D) d={d} h={heads} T={t} B={b}", gpt2, xd,
                         grad=gd, amp=amp, width="narrow")
                for amp in (False, True)
            ] + [
                Workload(f"llama_block d={d} h={heads} T={t} B={b}", llama, xd, grad=gd,
                         amp=amp, width="narrow")
                for amp in (False, True)
            ]  # fmt: skip
        out += [
            Workload(f"gpt_block d=128 h=4 T={t} B={b}", block, x, grad=g, width="narrow"),
            Workload(
                f"gpt_stage L=2 d=128 h=4 V=512 T={t} B={b}",
                build_gpt(gpt_cfg),
                ids[:, :-1],
                target=ids[:, 1:],
                width="narrow",
            ),
        ]
    if widths in ("model", "all") and not quick:
        b, t = 1, 1024
        for model, layout, d, heads, kv_heads, hidden in MODEL_WIDTHS:
            xd, gd = (torch.randn(b, t, d, generator=gen) for _ in range(2))
            if layout == "gpt2":
                mod = _seeded(lambda: GPT2Block(d, heads))  # noqa: B023
                name = f"hf_gpt2_block (Conv1D) d={d} h={heads} T={t} B={b} ({model})"
            else:
                mod = _seeded(lambda: LlamaBlock(d, heads, hidden, kv_heads))  # noqa: B023
                name = (f"llama_block d={d} h={heads} kv={kv_heads} ffn={hidden} T={t} B={b} "
                        f"({model})")  # fmt: skip
            out += [
                Workload(name, mod, xd, grad=gd, amp=amp, width="model") for amp in (False, True)
            ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per measurement")
    parser.add_argument("--quick", action="store_true", help="small shapes, for smoke tests")
    parser.add_argument(
        "--widths",
        choices=("narrow", "model", "all"),
        default="all",
        help="narrow stress shapes, blocks at real models' widths, or both",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    kept = _keep_freed_memory()
    results = [bench(w, args.repeats) for w in workloads(args.quick, args.widths)]
    met: dict[str, bool | None] = {}  # per width: every row meets the goals (None: no rows)
    for width in ("model", "narrow"):
        rows = [r for r in results if r["width"] == width]
        met[width] = all(r["meets_goals"] for r in rows) if rows else None
    missed = [r for r in results if not r["meets_goals"]]
    out = {
        "bench": "bw_split",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "timer": "thread CPU time (ratios); wall clock in *_wall",
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "allocator_keeps_freed_memory": kept,
        "repeats": args.repeats,
        "goals": GOALS,
        "goals_met": met,
        "missed": [f"{r['workload']} autocast={r['autocast']}" for r in missed],
        "results": results,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
