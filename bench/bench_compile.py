"""Compiled vs eager split stage: F, B and W times with the regions between split layers compiled.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_compile.py [--repeats N] [--quick]
[--backend inductor]``. Prints one JSON object.

Each workload (the GPT-2-like and Llama-like blocks of ``bench_bw_split``, as
a middle stage) runs in two :class:`~zerobubble.runtime.stage.StageChunk` on
identical weights: ``eager``, and ``compiled`` with
:func:`~zerobubble.runtime.compile.compile_between_splits` applied to the
chunk's module (split layers eager, everything between them compiled). For
context, ``plain_fused`` and ``plain_compiled_fused`` are the unsplit block's
forward and one fused backward, eager and compiled whole.

Times are thread CPU time (one thread), medians over ``--repeats`` runs after
three warm-up runs (the first compiles); ``speedup`` is eager over compiled.
``w_param_share`` checks that compilation left the split intact, and
``max_abs_grad_diff`` compares the compiled stage's gradients with the eager
stage's (compiled kernels round differently: not bitwise against eager; see
tests/test_compile.py for the bitwise comparison against the same compiled
regions).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bw_split import GPT2Block, LlamaBlock

from zerobubble.runtime.compile import compile_between_splits
from zerobubble.runtime.stage import StageChunk


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def _clear(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def _stage_times(chunk: StageChunk, x: Tensor, g: Tensor) -> dict[str, float]:
    _clear(chunk.module)
    t_f = _timed(lambda: chunk.forward(0, x))
    t_b = _timed(lambda: chunk.backward_input(0, g))
    t_w = _timed(lambda: chunk.backward_weight(0))
    return {"F": t_f, "B": t_b, "W": t_w}


def _plain_times(module: nn.Module, x: Tensor, g: Tensor) -> dict[str, float]:
    _clear(module)
    xi = x.detach().requires_grad_(True)
    out: list[Tensor] = []
    t_f = _timed(lambda: out.append(module(xi)))
    t_bw = _timed(lambda: torch.autograd.backward(out, [g]))
    return {"F": t_f, "BW": t_bw}


def _ms(runs: list[dict[str, float]]) -> dict[str, float]:
    return {f"t_{k}_ms": round(1e3 * statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def bench(name: str, block: nn.Module, x: Tensor, g: Tensor, repeats: int, backend: str) -> dict:
    torch._dynamo.reset()
    eager = StageChunk(copy.deepcopy(block), 1, 3)
    compiled = StageChunk(copy.deepcopy(block), 1, 3)
    regions = compile_between_splits(compiled.module, backend=backend)
    plain = copy.deepcopy(block)
    plain_compiled = copy.deepcopy(block)
    plain_compiled.compile(backend=backend)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in ("eager", "compiled", "pe", "pc")}
    t0 = time.perf_counter()
    _stage_times(compiled, x, g)
    _plain_times(plain_compiled, x, g)
    compile_s = time.perf_counter() - t0
    for i in range(repeats + 2):
        sample = {
            "eager": _stage_times(eager, x, g),
            "compiled": _stage_times(compiled, x, g),
            "pe": _plain_times(plain, x, g),
            "pc": _plain_times(plain_compiled, x, g),
        }
        if i >= 2:
            for k, v in sample.items():
                runs[k].append(v)
    diff = max(
        (a.grad - b.grad).abs().max().item()
        for a, b in zip(eager.module.parameters(), compiled.module.parameters(), strict=True)
    )
    e, c = _ms(runs["eager"]), _ms(runs["compiled"])
    total = lambda s: s["t_F_ms"] + s["t_B_ms"] + s["t_W_ms"]  # noqa: E731
    return {
        "workload": name,
        "compiled_regions": regions,
        "first_step_with_compile_s": round(compile_s, 1),
        "w_param_share": round(compiled.split_share.fraction, 4),
        "eager": e,
        "compiled": c,
        "speedup_F_B_W": round(total(e) / total(c), 3),
        "speedup": {k: round(e[k] / c[k], 3) for k in e},
        "plain_fused": _ms(runs["pe"]),
        "plain_compiled_fused": _ms(runs["pc"]),
        "max_abs_grad_diff": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement")
    parser.add_argument("--quick", action="store_true", help="small shapes, for smoke tests")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    b, t, d, heads = (1, 64, 64, 2) if args.quick else (2, 512, 128, 4)
    x = torch.randn(b, t, d, generator=gen)
    g = torch.randn(b, t, d, generator=gen)
    torch.manual_seed(0)
    blocks = {
        f"hf_gpt2_block (Conv1D) d={d} h={heads} T={t} B={b}": GPT2Block(d, heads),
        f"llama_block d={d} h={heads} T={t} B={b}": LlamaBlock(d, heads, 344 * d // 128),
    }
    results = [bench(n, m, x, g, args.repeats, args.backend) for n, m in blocks.items()]
    out = {
        "bench": "compile",
        "torch": torch.__version__,
        "backend": args.backend,
        "threads": torch.get_num_threads(),
        "timer": "thread CPU time",
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "results": results,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
