"""Per-op cost of bench_runtime's stages, and the step time the simulator predicts from it.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_stage_ops.py [--rounds N]
[--quantile Q] [--seq-len T]``. Prints one JSON object.

bench_runtime's question is whether our zero-bubble schedules beat our own 1F1B
on 2 ranks at M = 8. That is bubble arithmetic plus overhead, and this bench
separates the two in a single process (one thread, no communication), which
also makes it usable on a machine too busy for bench_runtime's wall times. For
every stage of bench_runtime's model and cut (2 stages for 1f1b/zb-h1/zb-h2, 4
virtual stages for zbv) it times each op three ways on identical weights:

* ``plain``: the unmodified layers, ``torch.autograd.backward`` (the floor);
* ``unsplit``: :class:`~zerobubble.runtime.stage.StageChunk` without the B/W
  split, F and BW (what our 1f1b runs);
* ``split``: StageChunk with split layers, F, B and W (what our ZB kinds run).

Chunks are built as the executor builds them with tracing off. A round runs
the M microbatches of one step through each implementation, interleaved op by
op, with gradients accumulating as in a step. Times are thread CPU time
(``time.thread_time_ns``), the ``--quantile`` over all timed microbatches
(default 0.5, the median; 0.2 is less disturbed by other processes).
``overhead`` compares against ``plain``: ``F`` = F / F_plain, ``backward`` =
(B + W) / BW_plain (or BW / BW_plain).

``predicted_step_ms`` feeds these figures to
:func:`zerobubble.schedule.simulate.simulate` as per-stage costs of the schedule
the executor runs (after its B/W fusion; 1f1b and stages left without B: F and
BW of ``unsplit``; the other stages of the ZB kinds: F, B, W of ``split``;
``--comm-ms`` added to every cross-device dependency) and reports the simulated
step time (``cost``: the longest device span). ``plain`` predicts what each schedule would take with
no runtime overhead at all, splitting BW_plain into B and W in the ratio the
split chunk measured.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable

import torch
from bench_bw_split import _keep_freed_memory
from bench_runtime import BATCH, OURS, SEQ_LEN, M, P, cut, gpt_config
from torch import Tensor, nn

from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.parallel.partition import stage_bounds
from zerobubble.runtime.stage import StageChunk
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Op
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.simulate import simulate

Clock = Callable[[], int]
_now: Clock = time.thread_time_ns


class StageBench:
    """One virtual stage, three ways; collects per-op times in nanoseconds."""

    def __init__(self, module: nn.Module, stage: int, num_stages: int) -> None:
        self.stage, self.last = stage, stage == num_stages - 1
        loss_fn = gpt_loss if self.last else None
        self.plain = copy.deepcopy(module)
        self.unsplit = StageChunk(
            copy.deepcopy(module),
            stage,
            num_stages,
            loss_fn=loss_fn,
            split=False,
            track_memory=False,
        )
        self.split = StageChunk(
            copy.deepcopy(module), stage, num_stages, loss_fn=loss_fn, track_memory=False
        )
        self.times: dict[str, dict[str, list[int]]] = {
            "plain": {"F": [], "BW": []},
            "unsplit": {"F": [], "BW": []},
            "split": {"F": [], "B": [], "W": []},
        }

    def clear(self) -> None:
        for m in (self.plain, self.unsplit.module, self.split.module):
            for p in m.parameters():
                p.grad = None

    def run(self, mb: int, x: Tensor, grad: Tensor | None, target: Tensor | None) -> None:
        t = self.times
        kw = {"target": target, "loss_scale": 1 / M} if self.last else {}
        # plain autograd
        xin = x.detach().requires_grad_(x.is_floating_point())
        t0 = _now()
        out = self.plain(xin)
        if self.last:
            out = gpt_loss(out, target) * (1 / M)
        t1 = _now()
        torch.autograd.backward([out], None if self.last else [grad])
        del out, xin  # frees the graph, as the chunks do inside their backward
        t2 = _now()
        t["plain"]["F"].append(t1 - t0)
        t["plain"]["BW"].append(t2 - t1)
        # unsplit chunk
        t0 = _now()
        self.unsplit.forward(mb, x, **kw)
        t1 = _now()
        self.unsplit.backward_full(mb, grad)
        t2 = _now()
        t["unsplit"]["F"].append(t1 - t0)
        t["unsplit"]["BW"].append(t2 - t1)
        # split chunk
        t0 = _now()
        self.split.forward(mb, x, **kw)
        t1 = _now()
        self.split.backward_input(mb, grad)
        t2 = _now()
        self.split.backward_weight(mb)
        t3 = _now()
        t["split"]["F"].append(t1 - t0)
        t["split"]["B"].append(t2 - t1)
        t["split"]["W"].append(t3 - t2)

    def quantile_ms(self, skip: int, q: float) -> dict[str, dict[str, float]]:
        return {
            impl: {op: _quantile(v[skip:], q) / 1e6 for op, v in ops.items()}
            for impl, ops in self.times.items()
        }


def _quantile(values: list[int], q: float) -> float:
    """The ``q`` quantile of ``values`` (0.5: the median; 0: the minimum)."""
    if q <= 0:
        return float(min(values))
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _stages(cfg: GPTConfig, num_stages: int) -> list[StageBench]:
    model = build_gpt(cfg)
    bounds = stage_bounds(len(model), num_stages, cut(cfg, num_stages))
    return [
        StageBench(nn.Sequential(*(model[i] for i in r)), s, num_stages)
        for s, r in enumerate(bounds)
    ]


def _measure(
    cfg: GPTConfig, num_stages: int, rounds: int, warmup: int, q: float
) -> list[dict[str, dict[str, float]]]:
    gen = torch.Generator().manual_seed(0)
    mb, t = BATCH // M, cfg.max_seq_len
    ids = torch.randint(0, cfg.vocab_size, (mb, t), generator=gen)
    target = torch.randint(0, cfg.vocab_size, (mb, t), generator=gen)
    hidden = torch.randn(mb, t, cfg.d_model, generator=gen)
    grad = torch.randn(mb, t, cfg.d_model, generator=gen)
    stages = _stages(cfg, num_stages)
    for _ in range(warmup + rounds):
        for sb in stages:
            sb.clear()
        for j in range(M):
            for sb in stages:
                x = ids if sb.stage == 0 else hidden
                sb.run(j, x, None if sb.last else grad, target if sb.last else None)
    return [sb.quantile_ms(warmup * M, q) for sb in stages]


def _costs(
    per_stage: list[dict[str, dict[str, float]]],
    impl: str,
    comm: float,
    unsplit: frozenset[int] = frozenset(),
) -> CostModel:
    """Per-stage costs of ``impl``; with ``split``, the stages in ``unsplit`` (those the
    executor's fusion leaves without any B) take the unsplit chunk's F and BW."""
    if impl == "split" and unsplit:
        whole = _costs(per_stage, "unsplit", comm)
        return _costs(per_stage, "split", comm).with_stages_from(whole, unsplit)
    if impl == "unsplit":
        f = [s["unsplit"]["F"] for s in per_stage]
        return CostModel(
            f=f, b=[s["unsplit"]["BW"] for s in per_stage], w=[0.0] * len(f), comm=comm
        )
    if impl == "split":
        return CostModel(
            f=[s["split"]["F"] for s in per_stage],
            b=[s["split"]["B"] for s in per_stage],
            w=[s["split"]["W"] for s in per_stage],
            comm=comm,
        )
    # plain: BW_plain cut into B and W as the split chunk measured
    share = [s["split"]["B"] / (s["split"]["B"] + s["split"]["W"]) for s in per_stage]
    bw = [s["plain"]["BW"] for s in per_stage]
    return CostModel(
        f=[s["plain"]["F"] for s in per_stage],
        b=[x * r for x, r in zip(bw, share, strict=True)],
        w=[x * (1 - r) for x, r in zip(bw, share, strict=True)],
        comm=comm,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed steps (M microbatches each)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--comm-ms", type=float, default=0.0, help="latency per message")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="as in bench_runtime")
    parser.add_argument(
        "--quantile",
        type=float,
        default=0.5,
        help="summary of each op's times (0.5: median; lower is less disturbed by load)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    kept = _keep_freed_memory()
    cfg = gpt_config(args.seq_len)
    measured = {n: _measure(cfg, n, args.rounds, args.warmup, args.quantile) for n in (P, 2 * P)}
    ops: dict[str, list[dict[str, object]]] = {}
    for n, per_stage in measured.items():
        ops[f"{n}_stages"] = [
            {
                **{impl: {op: round(v, 3) for op, v in times.items()} for impl, times in s.items()},
                "overhead": {
                    "unsplit_F": round(s["unsplit"]["F"] / s["plain"]["F"], 3),
                    "unsplit_backward": round(s["unsplit"]["BW"] / s["plain"]["BW"], 3),
                    "split_F": round(s["split"]["F"] / s["plain"]["F"], 3),
                    "split_backward": round(
                        (s["split"]["B"] + s["split"]["W"]) / s["plain"]["BW"], 3
                    ),
                },
            }
            for s in per_stage
        ]
    predicted: dict[str, dict[str, float]] = {}
    for kind in OURS:
        sched = fuse_local_backward(generate(kind, P, M))  # what the executor runs
        per_stage = measured[sched.num_stages]
        impl = "split" if sched.uses_split_backward else "unsplit"
        whole = frozenset(range(sched.num_stages)) - {
            a.stage for acts in sched.actions for a in acts if a.op is Op.B
        }
        ours = _costs(per_stage, impl, args.comm_ms, whole)
        predicted[kind] = {
            "ours": round(float(simulate(sched, ours).cost), 2),
            "plain": round(
                float(simulate(sched, _costs(per_stage, "plain", args.comm_ms)).cost), 2
            ),
        }
    out = {
        "bench": "stage_ops",
        "torch": torch.__version__,
        "timer": "thread CPU time",
        "allocator_keeps_freed_memory": kept,
        "config": {
            "ranks": P,
            "microbatches": M,
            "microbatch_rows": BATCH // M,
            "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "seq_len": cfg.max_seq_len},
        },
        "rounds": args.rounds,
        "quantile": args.quantile,
        "op_ms": ops,
        "comm_ms": args.comm_ms,
        "predicted_step_ms": predicted,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
