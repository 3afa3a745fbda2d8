"""The placement search ``auto`` against every PyTorch schedule at equal or lower peak memory.

Peers, imported from PyTorch pipelining (``zerobubble.interop.torch_pipelining``):
1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV.
For P in {4, 8}, M in {2P, 4P}, three cost mixes and comm in {0, 0.1 F}, each
peer is simulated and ``auto`` is run with ``mem_limit`` = the peer's simulated
peak, so every comparison is at equal or lower memory. Also shown: zb-auto and
zbv-auto (the fixed placements) under the same limit.

Costs come from a model of 12P layers, so that every placement ``auto`` tries
(1 to 4 chunks per device) and every peer's is costed from the same layers: a
stage of a v-chunk placement holds 12/v consecutive layers. Memory: a layer's
F allocates 1/12 (one microbatch's activations on all of a device's 12 layers is
1, M_B, the unit of ``--mem-limit``), its W holds half of that. So the peers'
peaks (PyTorch's two-stage-per-rank schedules included) are in the same units.

Mixes (device totals per microbatch): ``equal`` F=B=W=1; ``fbw`` F=1, B=2,
W=0.6 (the issue's); ``layers``: seeded per-layer F, B, W around 1, 1.4, 0.6
with the first layer heavier (embedding) and the last heavier still (head and
loss). comm is per cross-device hop: 0 or 0.1 of a device's F.

Prints one JSON line per comparison as soon as its search ends (so a long run
shows progress), then a summary line. Filters pick a part of the grid, e.g.
``--p 8 --m-per-p 4 --mix fbw --comm 0.1``; ``--jobs N`` runs N searches at once;
``--fixed`` adds the zb-auto and zbv-auto columns (three searches per limit
instead of one). The full grid is 120 comparisons, 72 searches (peers with equal peaks share one).

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_search.py [--jobs 2] [filters]``.

``--segments``: segment rows instead (:mod:`zerobubble.schedule.search.segmented`). For P in
``--p``, k in ``--k`` (2, 4, 8), M in ``--m-per-p`` x P (default 1 and 2) and the mixes of
``--seg-mix`` (per-device totals; default ``equal``, F = B = W = 1), the three segment kinds
(seq1f1b, seq-zb, seq-zbv) at k, and ``auto --segments k`` (k' = 1..k: the whole search)
under seq-zb's peak as the limit; each with cost and peak (M_B), beside the work floor
(3M at equal costs). One JSON line per row, then a summary (``--segment-search-only``:
only the k' >= 2 part of auto, seconds instead of minutes at P = 8).

``--a2a [FRAC ...]``: issue 46's table with an all-to-all (a mixture of experts' dispatch and
combine in each F and each backward, ``CostModel.a2a``), FRAC of a device's mean F per
microbatch (default 0, 0.25, 0.5 and 1), the same for each layer. ``auto`` runs with
overlapped F&B pairs (``search_placements(..., overlap=True)``, the search behind
``zerobubble schedule auto --overlap``) under each peer's simulated peak. Peers: PyTorch's
DualPipeV (with its own ``OVERLAP_F_B`` pairs), ZBVZeroBubble and InterleavedZeroBubble (no
pairs: each F and backward waits for its all-to-all), and our ``dualpipev --overlap`` and
``zbv --overlap`` (``generate(kind, overlap=True, costs=...)``, no limit, as the CLI makes
them). One simulator prices every column: a lone F or backward takes compute + all-to-all,
a pair ``max(compute, all-to-all)`` of the two. Default mixes ``equal`` and ``fbw``, comm 0;
``--peer`` picks among these five. A loss: auto costs more than a peer, or peaks higher.
The summary counts wins, ties and losses, the worst ratio and the searches' CPU seconds.
Run: ``PYTHONPATH=src .venv/bin/python bench/bench_search.py --a2a [--p 4] [--jobs 1]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

from zerobubble.interop.torch_pipelining import torch_schedule
from zerobubble.schedule.costs import CostModel, CostSpec
from zerobubble.schedule.generators import NoPairWarning, generate
from zerobubble.schedule.search.placement import auto, search_placements
from zerobubble.schedule.search.segmented import search_segments
from zerobubble.schedule.simulate import simulate

SEGMENT_KINDS = ("seq1f1b", "seq-zb", "seq-zbv")
SEGMENT_MIXES = {
    "equal": CostSpec(),
    "fbw": CostSpec(F=1, B=2, W=0.6),
    "fbw-comm": CostSpec(F=1, B=2, W=0.6, comm=0.1),
}
PEERS = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: Our fixed kinds as peers (``--a2a``: made with overlap=True, their pairs where they pay).
OUR_PEERS = ("dualpipev", "zbv")
A2A_PEERS = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", *OUR_PEERS)
A2A_FRACTIONS = (0.0, 0.25, 0.5, 1.0)
MIXES = ("equal", "fbw", "layers")
LAYERS_PER_DEVICE = 12

Layers = tuple[list[float], list[float], list[float]]


def layer_costs(p: int, mix: str, seed: int = 0) -> Layers:
    """Per-layer F, B, W of a 12P-layer model (a device's totals are about F=1)."""
    n = LAYERS_PER_DEVICE * p
    k = 1 / LAYERS_PER_DEVICE
    if mix == "equal":
        return [k] * n, [k] * n, [k] * n
    if mix == "fbw":
        return [k] * n, [2 * k] * n, [0.6 * k] * n
    rng = random.Random(seed * 1000 + p)
    f = [k * rng.uniform(0.8, 1.2) for _ in range(n)]
    b = [k * rng.uniform(1.1, 1.7) for _ in range(n)]
    w = [k * rng.uniform(0.4, 0.8) for _ in range(n)]
    f[0] += 2 * k
    b[0] += 2 * k
    f[-1] += 4 * k
    b[-1] += 5 * k
    return f, b, w


def stage_costs(
    placement: tuple[int, ...], layers: Layers, comm: float, a2a: float = 0.0
) -> CostModel:
    """Per-stage costs of ``placement``: stage s holds layers [s*n, (s+1)*n); ``a2a`` is a
    device's all-to-all per F and per backward, the same for each of its layers."""
    f, b, w = layers
    per = len(f) // len(placement)
    group = [range(s * per, (s + 1) * per) for s in range(len(placement))]
    mem = [per / LAYERS_PER_DEVICE for _ in placement]
    return CostModel.per_stage(
        [sum(f[i] for i in g) for g in group],
        [sum(b[i] for i in g) for g in group],
        [sum(w[i] for i in g) for g in group],
        comm,
        mem_f=mem,
        mem_w=[x / 2 for x in mem],
        a2a=[a2a * per / LAYERS_PER_DEVICE for _ in placement],
    )


def ours(
    p: int, m: int, mix: str, comm: float, limit: float, fixed: bool, a2a: float | None = None
) -> dict[str, dict]:
    """``auto`` (and with ``fixed`` zb-auto and zbv-auto) under ``limit``; with ``a2a`` (a
    device's all-to-all) ``auto`` with overlapped pairs, as ``auto --overlap`` runs it."""
    layers = layer_costs(p, mix)
    out = {}
    t0 = time.process_time()
    sched = search_placements(
        p, m, lambda pl: stage_costs(pl, layers, comm, a2a or 0.0), limit, overlap=a2a is not None
    )
    secs = time.process_time() - t0
    res = simulate(sched, stage_costs(sched.placement, layers, comm, a2a or 0.0))
    out["auto"] = {
        "cost": round(float(res.cost), 4),
        "peak": round(float(max(res.peak_memory)), 6),
        "chunks": sched.num_stages // p,
        "v_shape": sched.placement[p] == p - 1 if sched.num_stages > p else False,
        "cpu_s": round(secs, 2),
    }
    if a2a is not None:
        out["auto"]["pairs"] = len(sched.overlaps)
    for kind in ("zb-auto", "zbv-auto") if fixed else ():
        placement = generate(kind, p, 1).placement
        model = stage_costs(placement, layers, comm)
        sched = generate(kind, p, m, costs=CostSpec(stage_costs=model), mem_limit=limit)
        res = simulate(sched, model)
        out[kind] = {
            "cost": round(float(res.cost), 4),
            "peak": round(float(max(res.peak_memory)), 6),
        }
    return out


def peer_rows(args: argparse.Namespace) -> list[dict]:
    """The selected comparisons with the peer's cost and peak (cheap: simulation only);
    with ``args.a2a`` issue 46's peers under each all-to-all fraction."""
    rows = []
    for p in args.p:
        for m in (k * p for k in args.m_per_p):
            for mix in args.mix:
                layers = layer_costs(p, mix)
                mean_f = sum(layers[0]) / p  # a device's mean F
                for comm_ratio in args.comm:
                    comm = comm_ratio * mean_f
                    for frac in args.a2a if args.a2a is not None else (None,):
                        a2a = None if frac is None else frac * mean_f
                        for name in args.peer:
                            cost, peak, label = peer_result(name, p, m, layers, comm, a2a)
                            row = {"P": p, "M": m, "mix": mix, "comm": round(comm, 6)}
                            if a2a is not None:
                                row["a2a"] = round(a2a, 6)
                            row |= {
                                "peer": label,
                                "peer_cost": round(cost, 4),
                                "peer_peak": round(peak, 9),
                                "_comm": comm,
                                "_a2a": a2a,
                            }
                            rows.append(row)
    return rows


def peer_result(
    name: str, p: int, m: int, layers: Layers, comm: float, a2a: float | None
) -> tuple[float, float, str]:
    """A peer's simulated cost, peak and label: PyTorch's schedule ``name`` as it lists it
    (DualPipeV with its pairs), or our fixed kind, with ``a2a`` made with overlap=True (the
    pairs where they pay under these costs, as ``zerobubble schedule KIND --overlap``)."""
    if name in OUR_PEERS:
        placement = generate(name, p, 1).placement
        model = stage_costs(placement, layers, comm, a2a or 0.0)
        with warnings.catch_warnings():  # no all-to-all: zbv forms no pair, and says so
            warnings.simplefilter("ignore", NoPairWarning)
            sched = generate(name, p, m, costs=CostSpec(stage_costs=model), overlap=a2a is not None)
        label = name + (" --overlap" if a2a is not None else "")
    else:
        sched = torch_schedule(name, p, m)
        model = stage_costs(sched.placement, layers, comm, a2a or 0.0)
        label = name if a2a is None else "torch:" + name
    res = simulate(sched, model)
    return float(res.cost), float(max(res.peak_memory)), label


def segment_row(p: int, m: int, k: int, mix: str, search_only: bool) -> dict:
    """The segment kinds at k and auto --segments k under seq-zb's peak (one row)."""
    spec = SEGMENT_MIXES[mix]
    row: dict = {"P": p, "M": m, "k": k, "mix": mix}
    for kind in SEGMENT_KINDS:
        sched = generate(kind, p, m, segments=k)
        res = simulate(sched, spec.resolve(sched.placement, k))
        peak = round(float(max(res.peak_memory)), 6)
        row[kind] = {"cost": round(float(res.cost), 4), "peak": peak}
        if kind == "seq-zb":
            limit = float(max(res.peak_memory))
            row["floor"] = round(max(float(x) for x in res.busy), 4)
    t0 = time.process_time()
    if search_only:
        got = search_segments(p, m, k, spec, limit)
        assert got is not None
        sched = got[1]
    else:
        sched = auto(p, m, costs=spec, mem_limit=limit, segments=k)
    secs = time.process_time() - t0
    res = simulate(sched, spec.resolve(sched.placement, sched.segments))
    row["limit"] = round(limit, 6)
    row["auto"] = {
        "cost": round(float(res.cost), 4),
        "peak": round(float(max(res.peak_memory)), 6),
        "segments": sched.segments,
        "chunks": sched.num_stages // p,
        "cpu_s": round(secs, 2),
    }
    best = min(row[kind]["cost"] for kind in SEGMENT_KINDS)
    row["auto_vs_best_kind"] = round(row["auto"]["cost"] / best, 4)
    row["auto_vs_seq_zb"] = round(row["auto"]["cost"] / row["seq-zb"]["cost"], 4)
    return row


def segment_main(args: argparse.Namespace) -> None:
    rows = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [
            pool.submit(segment_row, p, q * p, k, mix, args.segment_search_only)
            for p in args.p
            for q in args.m_per_p or (1, 2)
            for k in args.k
            for mix in args.seg_mix
        ]
        for fut in futures:
            row = fut.result()
            rows.append(row)
            print(json.dumps(row), flush=True)
    tol = 1e-9
    worse = [
        (r["P"], r["M"], r["k"], r["mix"], kind)
        for r in rows
        for kind in SEGMENT_KINDS
        if r[kind]["peak"] <= r["limit"] + tol
        and (r["auto"]["cost"] > r[kind]["cost"] + tol or r["auto"]["peak"] > r["limit"] + tol)
    ]
    summary = {
        "benchmark": "segments_in_search",
        "rows": len(rows),
        "never_worse_than_a_segment_kind_at_its_peak": not worse,
        "worse": worse,
        "auto_at_floor": sum(1 for r in rows if r["auto"]["cost"] <= r["floor"] + tol),
        "seq_zbv_at_floor": sum(1 for r in rows if r["seq-zbv"]["cost"] <= r["floor"] + tol),
        "seq_zb_at_floor": sum(1 for r in rows if r["seq-zb"]["cost"] <= r["floor"] + tol),
        "best_vs_seq_zb": min(r["auto_vs_seq_zb"] for r in rows),
        "cases": " ".join(sys.argv[1:]),
    }
    print(json.dumps({"summary": summary}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--p", type=int, nargs="+", default=[4, 8], help="device counts")
    ap.add_argument(
        "--m-per-p", type=int, nargs="+", help="M as multiples of P (2 4; with --segments 1 2)"
    )
    ap.add_argument("--mix", nargs="+", choices=MIXES, help="cost mixes (with --a2a equal fbw)")
    ap.add_argument("--comm", type=float, nargs="+", help="fractions of F (0 0.1; --a2a 0)")
    ap.add_argument(
        "--peer",
        nargs="+",
        choices=PEERS + OUR_PEERS,
        help=f"peers (default {' '.join(PEERS)}; with --a2a {' '.join(A2A_PEERS)})",
    )
    ap.add_argument("--fixed", action="store_true", help="also zb-auto and zbv-auto")
    ap.add_argument("--jobs", type=int, default=1, help="searches run at once")
    ap.add_argument("--segments", action="store_true", help="segment rows (see above)")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="segments per microbatch")
    ap.add_argument("--seg-mix", nargs="+", choices=list(SEGMENT_MIXES), default=["equal"])
    ap.add_argument(
        "--segment-search-only", action="store_true", help="segment rows: only auto's k >= 2 part"
    )
    ap.add_argument(
        "--a2a",
        type=float,
        nargs="*",
        metavar="FRAC",
        help="all-to-all rows (see above): fractions of F (alone: 0 0.25 0.5 1)",
    )
    args = ap.parse_args()
    if args.segments:
        segment_main(args)
        return
    pairs = args.a2a is not None
    if pairs and args.fixed:
        ap.error("--fixed is not a column of the --a2a table")
    if pairs and not args.a2a:
        args.a2a = list(A2A_FRACTIONS)
    args.m_per_p = args.m_per_p or [2, 4]
    args.mix = args.mix or (["equal", "fbw"] if pairs else list(MIXES))
    args.comm = args.comm or ([0.0] if pairs else [0.0, 0.1])
    args.peer = args.peer or list(A2A_PEERS if pairs else PEERS)
    rows = peer_rows(args)
    # One search per distinct (instance, limit): peers with the same peak share it.
    keys: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["P"], r["M"], r["mix"], r["_comm"], r["peer_peak"], r["_a2a"])
        keys.setdefault(key, []).append(r)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {
            pool.submit(ours, p, m, mix, comm, limit, args.fixed, a2a): key
            for key in keys
            for p, m, mix, comm, limit, a2a in [key]
        }
        for fut in futures:  # submission order: small instances first
            mine = fut.result()
            for r in keys[futures[fut]]:
                r.pop("_comm")
                r.pop("_a2a")
                r.update(mine)
                r["auto_vs_peer"] = round(mine["auto"]["cost"] / r["peer_cost"], 4)
                print(json.dumps(r), flush=True)
    tol = 1e-9
    worse = [
        r
        for r in rows
        if r["auto"]["cost"] > r["peer_cost"] + tol or r["auto"]["peak"] > r["peer_peak"] + tol
    ]
    where = ("P", "M", "mix", "comm", "a2a", "peer") if pairs else ("P", "M", "mix", "comm", "peer")
    summary = {
        "benchmark": "search_with_pairs_vs_peers" if pairs else "search_vs_torch",
        "comparisons": len(rows),
        "searches": len(keys),
        "never_worse_at_equal_or_lower_peak": not worse,
        "worse": [tuple(r[k] for k in where) for r in worse],
        "strictly_better": sum(
            1 for r in rows if r not in worse and r["auto"]["cost"] < r["peer_cost"] - tol
        ),
        "worst_ratio": max(r["auto_vs_peer"] for r in rows),
        "best_ratio": min(r["auto_vs_peer"] for r in rows),
        "cases": " ".join(sys.argv[1:]) or "full grid",
    }
    if pairs:
        summary["wins_ties_losses"] = [
            summary["strictly_better"],
            len(rows) - summary["strictly_better"] - len(worse),
            len(worse),
        ]
        cpu = {k: keys[k][0]["auto"]["cpu_s"] for k in keys}
        summary["search_cpu_s"] = round(sum(cpu.values()), 1)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
