"""Overlapped F&B pairs against a mixture of experts' all-to-all, simulated (prints JSON lines).

DualPipe pairs one microbatch's forward with another's backward so that each one's
dispatch and combine all-to-all travels while the other computes. Here every F and every
backward of a stage also waits ``a2a`` (per device, like F: ``CostSpec(a2a=...)``) for its
all-to-all unless it is in an overlapped pair, whose block takes ``max(compute,
all-to-all)`` of the two (``Schedule.overlaps``, ``CostModel.a2a``). Compared: ``dualpipev``
with its pairs overlapped and run in sequence, ``zbv`` (same V placement) with the pairs
that pay under the costs (``passes.overlap_where_it_pays``) and without, and the planner
``auto`` (``--auto-chunks`` chunks per device at most, 2 by default: looped v = 1, 2 and the
V) with pairs where they pay (``overlap=True``: the search pairs) and without, each at the
memory limit of dualpipev's peak (P + 1/2, in M_B), at F = B = W = 1 per device and
all-to-all from none to 1.5x F; ``a2a=1`` is a DeepSeek-V3-like mix (the all-to-all about as
long as the compute it pairs with).

    PYTHONPATH=src python bench/bench_moe.py [--p 4 8] [--m-per-p 4] [--a2a 0 0.5 1 1.5]

Each row: the kind, P, M, the all-to-all per device, the step (makespan), the cost
(longest device span), its ratio to dualpipev in sequence, the exposed all-to-all summed
over devices (what no compute hid), the pairs, the peak memory and the bubble rate. Then,
per P, the planner's choice on an uneven mix with an all-to-all term (F=1, B=2, W=1,
comm=0.05, a2a=1): what ``auto --overlap`` picked (placement, pairs, cost) beside the fixed
kinds it could have chosen, with and without their pairs.

``--pair-passes``: per P, the best of the search's pairing list-scheduling passes on the
V (unpolished, as ``auto --overlap`` has them on instances too large to polish) beside
DualPipeV with its pairs, at F = B = W = 1, a2a = 1 per device and the limit P + 1/2.

    PYTHONPATH=src python bench/bench_moe.py --pair-passes --p 8 16 32 --m-per-p 8

``--measure``: 4 CPU ranks, pp = 2 x dp = 2 with the experts sharded over ep = 2, a MoE
GPT under dualpipev with its pairs, zbv with the pairs the pass forms and ``auto --overlap``
(both priced at ``a2a=1``), each with its pairs run at once and without pairs, taking
turns step by step. Per rank and step: the wall time, the time spent waiting for
all-to-alls, and the part of it that is *exposed*: a wait on one thread during which the
other thread (an overlapped pair's other half) was not computing. Without pairs every wait
is exposed. Medians over the timed steps, per rank, then the mean over ranks. On a CPU
with fewer cores than ranks x 2 the pair's second thread has no core of its own, so the
step does not shrink; the exposed share is what the measure shows.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_moe.py --measure [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import warnings
from typing import Any

from zerobubble.schedule.costs import CostSpec
from zerobubble.schedule.generators import NoPairWarning, generate
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.simulate import simulate

A2A = (0.0, 0.5, 1.0, 1.5)
KINDS = (
    ("dualpipev", True),
    ("dualpipev", False),
    ("zbv", True),
    ("zbv", False),
    ("auto", True),
    ("auto", False),
)
#: The planner's mix: uneven F, B, W, a little latency, all-to-all as long as F.
PLANNER_MIX = CostSpec(F=1, B=2, W=1, comm=0.05, a2a=1)


def _generate(kind: str, p: int, m: int, overlap: bool, spec: CostSpec, chunks: int) -> Schedule:
    """``kind`` under dualpipev's peak (P + 1/2 M_B) as the memory limit where it takes one
    (the searches, and the pass that pairs a fixed kind)."""
    limit = p + 0.5
    with warnings.catch_warnings():  # no all-to-all: overlap=True forms no pair, says so
        warnings.simplefilter("ignore", NoPairWarning)
        if kind == "auto":
            return generate(kind, p, m, chunks=chunks, overlap=overlap, costs=spec, mem_limit=limit)
        return generate(
            kind, p, m, overlap=overlap, costs=spec, mem_limit=limit if overlap else None
        )


def rows(
    p: int, m: int, a2as: tuple[float, ...] = A2A, auto_chunks: int = 2
) -> list[dict[str, object]]:
    """One row per (all-to-all, kind) at ``p`` devices and ``m`` microbatches."""
    out: list[dict[str, object]] = []
    for a2a in a2as:
        spec = CostSpec(a2a=a2a)
        steps = {}
        for kind, overlap in KINDS:
            sched = _generate(kind, p, m, overlap, spec, auto_chunks)
            steps[kind, overlap] = simulate(sched, spec.resolve(sched.placement))
        base = float(steps["dualpipev", False].makespan)
        for (kind, overlap), res in steps.items():
            out.append(
                {
                    "kind": kind,
                    "overlap": overlap,
                    "p": p,
                    "m": m,
                    "a2a": a2a,
                    "step": round(float(res.makespan), 4),
                    "cost": round(float(res.cost), 4),
                    "step_vs_dualpipev": round(float(res.makespan) / base, 4),
                    "exposed_a2a": round(float(sum(res.exposed_a2a)), 4),
                    "pairs": len(res.schedule.overlaps),
                    "peak": round(float(max(res.peak_memory)), 4),
                    "chunks": res.schedule.num_stages // p,
                    "bubble_rate": round(res.bubble_rate, 4),
                }
            )
    return out


def planner_choice(p: int, m: int, auto_chunks: int = 2) -> dict[str, object]:
    """What ``auto --overlap`` picks on :data:`PLANNER_MIX` at dualpipev's peak, beside the
    kinds it could have chosen (costs; None where a kind breaks the limit)."""
    spec, limit = PLANNER_MIX, p + 0.5
    chosen = _generate("auto", p, m, True, spec, auto_chunks)
    res = simulate(chosen, spec.resolve(chosen.placement))
    looped = chosen.placement == tuple(s % p for s in range(chosen.num_stages))
    others: dict[str, float | None] = {}
    for kind, overlap in (
        ("dualpipev", True),
        ("dualpipev", False),
        ("zbv", True),
        ("zbv", False),
        ("zbv-auto", True),
        ("zb-auto", False),
        ("auto", False),
    ):
        sched = _generate(kind, p, m, overlap, spec, auto_chunks)
        other = simulate(sched, spec.resolve(sched.placement))
        fits = float(max(other.peak_memory)) <= limit + 1e-9
        others[f"{kind}{' --overlap' if overlap else ''}"] = (
            round(float(other.cost), 4) if fits else None
        )
    return {
        "planner": "auto --overlap",
        "p": p,
        "m": m,
        "mix": "F=1,B=2,W=1,comm=0.05,a2a=1",
        "mem_limit": limit,
        "chose": {
            "placement": f"{'looped' if looped else 'zigzag'}-v{chosen.num_stages // p}",
            "pairs": len(chosen.overlaps),
            "cost": round(float(res.cost), 4),
            "exposed_a2a": round(float(sum(res.exposed_a2a)), 4),
            "peak": round(float(max(res.peak_memory)), 4),
        },
        "others": others,
    }


def pair_passes(p: int, m: int) -> dict[str, object]:
    """The best unpolished pairing pass on the V against DualPipeV's pairs (see above)."""
    from zerobubble.schedule.ir import v_placement
    from zerobubble.schedule.search.auto import resolve_costs
    from zerobubble.schedule.search.greedy import run_pass
    from zerobubble.schedule.search.paired import pair_grid

    spec = CostSpec(a2a=1)
    model, limit = resolve_costs(v_placement(p), spec, p + 0.5, default=p)
    costs = []
    for pol in pair_grid(p, looped=False, chunks=2):
        got = run_pass(v_placement(p), m, model, limit, pol)
        if got is not None:
            costs.append(got.cost)
    dual = generate("dualpipev", p, m, overlap=True)
    return {
        "pair_passes": "V",
        "p": p,
        "m": m,
        "best_pass": round(min(costs), 4),
        "dualpipev_overlap": round(float(simulate(dual, model).cost), 4),
    }


def _covered(span: tuple[int, int], busy: list[tuple[int, int]]) -> int:
    """Nanoseconds of ``span`` inside the (disjoint) ``busy`` intervals."""
    a, b = span
    return sum(max(0, min(b, y) - max(a, x)) for x, y in busy)


def _minus(intervals: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list:
    """``intervals`` with ``holes`` cut out (both lists of disjoint intervals)."""
    out = []
    for a, b in intervals:
        cuts = sorted((max(a, x), min(b, y)) for x, y in holes if x < b and y > a)
        start = a
        for x, y in cuts:
            if x > start:
                out.append((start, x))
            start = max(start, y)
        if start < b:
            out.append((start, b))
    return out


#: The measured runs: (kind, with pairs). Without pairs every wait is exposed. ``auto`` with
#: pairs is ``auto --overlap`` priced at a2a = F; without, the plain search.
MEASURED = tuple((k, o) for k in ("dualpipev", "zbv", "auto") for o in (True, False))
MODE = {True: "with pairs", False: "without pairs"}


def _measure_rank(steps: int, warmup: int) -> dict[tuple[str, str], Any]:
    import torch

    import zerobubble
    from zerobubble.models import GPTConfig, gpt_loss
    from zerobubble.models.moe import build_moe_gpt
    from zerobubble.parallel import ep
    from zerobubble.parallel.mesh import build_mesh
    from zerobubble.runtime.launcher import init_distributed

    init_distributed()
    mesh = build_mesh(2, 2, ep=2)
    waits: list[tuple[bool, int, int]] = []  # (on the executor's thread, start, end)
    plain_wait = ep.ExpertGroup.wait

    def timed_wait(self: Any, work: Any, what: str, group: Any = None) -> None:
        t0 = time.perf_counter_ns()
        plain_wait(self, work, what, group)
        main = threading.current_thread() is threading.main_thread()
        waits.append((main, t0, time.perf_counter_ns()))

    ep.ExpertGroup.wait = timed_wait  # type: ignore[method-assign]  # this bench's probe
    cfg = GPTConfig(vocab_size=256, max_seq_len=64, d_model=64, n_heads=4, n_layers=4)
    pipes = {}
    for kind, overlap in MEASURED:
        model = build_moe_gpt(cfg, num_experts=4, top_k=2, balance=0.01)
        costs = CostSpec(a2a=1) if overlap else None  # zbv, auto: the pairs formed there
        opts = {"chunks": 2} if kind == "auto" else {}
        sched = generate(kind, 2, 8, overlap=overlap, costs=costs, **opts)
        cuts = [0, 2, 3, 4, 7] if sched.num_stages == 4 else None  # V: one block per stage
        pipes[kind, overlap] = zerobubble.Pipeline(
            model, gpt_loss, sched, mesh=mesh, boundaries=cuts
        )
    rows: dict[tuple[str, bool], list[tuple[float, float, float]]] = {k: [] for k in pipes}
    g = torch.Generator().manual_seed(mesh.dp_rank)
    for i in range(warmup + steps):
        ids = torch.randint(0, cfg.vocab_size, (16, cfg.max_seq_len + 1), generator=g)
        for key, pipe in pipes.items():
            trace = pipe.executor.trace
            trace.clear()
            waits.clear()
            torch.distributed.barrier()
            t0 = time.perf_counter_ns()
            pipe.step(ids[:, :-1], target=ids[:, 1:])
            wall = time.perf_counter_ns() - t0
            paired_f = {f for f, _ in pipe.schedule.overlaps}
            computes = [
                (e.action in paired_f, e.start_ns + trace.epoch_ns, e.end_ns + trace.epoch_ns)
                for e in trace.events
                if e.action is not None
            ]
            mine = {side: [(a, b) for m, a, b in waits if m == side] for side in (True, False)}
            busy = {  # computing, not waiting: the main thread runs all but the paired Fs
                side: _minus([(a, b) for helper, a, b in computes if helper != side], mine[side])
                for side in (True, False)
            }
            waited = sum(b - a for _, a, b in waits)
            exposed = sum(b - a - _covered((a, b), busy[not m]) for m, a, b in waits)
            if i >= warmup:
                rows[key].append((wall / 1e6, waited / 1e6, exposed / 1e6))
    torch.distributed.destroy_process_group()
    return {
        (kind, MODE[o]): {
            key: statistics.median(r[k] for r in rs)
            for k, key in enumerate(("step_ms", "a2a_wait_ms", "exposed_a2a_ms"))
        }
        for (kind, o), rs in rows.items()
    }


def measure(steps: int, warmup: int) -> list[dict[str, object]]:
    """The measured rows (see the module docstring)."""
    from zerobubble.runtime.launcher import launch

    per_rank = launch(_measure_rank, 4, steps, warmup, timeout=1800)
    out: list[dict[str, object]] = []
    for kind, overlap in MEASURED:
        mode = MODE[overlap]
        mean = {
            key: round(statistics.fmean(r[kind, mode][key] for r in per_rank), 2)
            for key in ("step_ms", "a2a_wait_ms", "exposed_a2a_ms")
        }
        out.append({"measured": f"pp2 x ep2 {kind}", "pairs": mode, **mean})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, nargs="+", default=[4, 8], help="device counts")
    parser.add_argument("--m-per-p", type=int, default=4, help="microbatches per device")
    parser.add_argument(
        "--a2a", type=float, nargs="+", default=list(A2A), help="all-to-all per device (F=1)"
    )
    parser.add_argument(
        "--auto-chunks", type=int, default=2, help="auto: chunks per device at most (default 2)"
    )
    parser.add_argument(
        "--measure", action="store_true", help="measure on 4 CPU ranks (see the docstring)"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps (--measure)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (--measure)")
    parser.add_argument(
        "--pair-passes", action="store_true", help="the pairing passes on the V (see above)"
    )
    args = parser.parse_args()
    if args.pair_passes:
        for p in args.p:
            print(json.dumps(pair_passes(p, args.m_per_p * p)), flush=True)
        return
    if args.measure:
        for row in measure(args.steps, args.warmup):
            print(json.dumps(row))
        return
    for p in args.p:
        m = args.m_per_p * p
        for row in rows(p, m, tuple(args.a2a), args.auto_chunks):
            print(json.dumps(row), flush=True)
        print(json.dumps(planner_choice(p, m, args.auto_chunks)), flush=True)


if __name__ == "__main__":
    main()
