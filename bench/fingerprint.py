"""Hashes of what the library produces on a fixed set of runs, to show a refactor changed nothing.

A structural change (files moved, classes split, one seam instead of several) must leave
every schedule, every rank's program, every loss and every gradient identical. This script
computes each of them on a fixed set of runs and prints one JSON object of SHA-256 hashes:
run it before and after and compare (``diff`` of the two outputs, or ``--against FILE``).

The runs, all through the front door (``import zerobubble``) so that they survive a move:
- schedules: every generator at P = 4, M = 8 (and P = 3, M = 6), plus ``auto`` at P = 3,
  M = 6 under a memory limit, in our JSON format;
- programs: each schedule's programs under four plans (plain, dp reduce, FSDP shards,
  speculative protocol), as the builder formats them;
- steps: losses and gradients (every parameter's name, dtype, shape and bytes) of one
  optimizer step each of an MLP at pp = 3 (zb-h1), a V placement at pp = 2 (zbv), a GPT at
  pp = 2 x dp = 2 (1f1b, FSDP), pp = 2 x tp = 2 (zb-h1), a MoE at pp = 2 x dp = 2 x ep = 2
  (dualpipev with overlapped pairs), a GPT with segments (seq-zb, 2 per microbatch) and with
  layer recompute, launched with gloo on CPU.

Run: ``PYTHONPATH=src .venv/bin/python bench/fingerprint.py [--out F] [--against F]``
(``--only schedules,programs,steps`` for a part). Exit status 1 when ``--against`` differs.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import tempfile
from typing import Any

import zerobubble

KINDS_SKIPPED = {"optimal", "optimal-v"}  # MILP: minutes of CPU, covered by their own tests
PLANS = (
    {},
    {"grad_sync": "reduce"},
    {"grad_sync": "fsdp"},
    {"protocol": "speculative"},
)


def _digest(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()[:16]


def _module(*names: str) -> Any:
    """The first of ``names`` that imports (a module may have moved; see ``BEFORE``)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"none of {names} found")


#: Where the builder lived before the program layer had its own package.
BEFORE = "zerobubble" + ".schedule.build"


def schedules() -> dict[str, Any]:
    """Every generator's schedule at two sizes, by name: ``{name: schedule}``."""
    out: dict[str, Any] = {}
    for kind in sorted(zerobubble.GENERATORS):
        if kind in KINDS_SKIPPED:
            continue
        for p, m in ((4, 8), (3, 6)):
            try:
                out[f"{kind} p{p} m{m}"] = zerobubble.generate(kind, p, m)
            except ValueError as exc:  # a kind that needs another size: the refusal is hashed
                out[f"{kind} p{p} m{m}"] = f"refused: {exc}"
    out["auto p3 m6 limit3"] = zerobubble.generate("auto", 3, 6, mem_limit=3.0)
    return out


def schedule_hashes(found: dict[str, Any]) -> dict[str, str]:
    hashes = {}
    for name, sched in found.items():
        if isinstance(sched, str):
            hashes[name] = _digest(sched)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.json")
            zerobubble.save_schedule(sched, path)
            with open(path) as f:
                hashes[name] = _digest(f.read())
    return hashes


def program_hashes(found: dict[str, Any]) -> dict[str, str]:
    build = _module("zerobubble.program.builder", BEFORE)
    plan = _module("zerobubble.program.plan", BEFORE).ProgramPlan
    hashes = {}
    for name, sched in found.items():
        if isinstance(sched, str):
            continue
        for fields in PLANS:
            label = f"{name} {','.join(f'{k}={v}' for k, v in fields.items()) or 'plain'}"
            try:
                lowered = build.build_programs(sched, plan(**fields))
                hashes[label] = _digest(build.format_programs(lowered))
            except ValueError as exc:
                hashes[label] = _digest(f"refused: {exc}")
    return hashes


# ---- one optimizer step per run, on ranks launched with gloo --------------------------------


def _tensor_bytes(t: Any) -> bytes:
    import torch

    t = t.detach().contiguous().cpu()
    return f"{t.dtype}{tuple(t.shape)}".encode() + t.view(-1).view(torch.uint8).numpy().tobytes()


def _rank_result(pipe: Any, losses: Any) -> dict[str, str]:
    h = hashlib.sha256()
    for loss in losses or []:
        h.update(_tensor_bytes(loss))
    g = hashlib.sha256()
    for name, p in sorted(pipe.named_parameters()):
        g.update(name.encode())
        grad = p.grad
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()
        g.update(b"none" if grad is None else _tensor_bytes(grad))
    return {"losses": h.hexdigest()[:16], "grads": g.hexdigest()[:16]}


def _token_loss(logits: Any, targets: Any, num_items: Any) -> Any:
    """Summed cross-entropy over the batch's tokens: each segment adds its share."""
    import torch.nn.functional as F

    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), reduction="sum") / num_items


def _count(targets: Any) -> int:
    return targets.numel()


def _step(run: str) -> dict[str, str]:
    import torch

    from zerobubble.models import (
        GPTConfig,
        build_gpt,
        build_mlp,
        build_moe_mlp,
        gpt_loss,
        mlp_loss,
    )

    info = zerobubble.init_distributed(timeout_s=120)
    torch.manual_seed(0)
    gpt = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_heads=4, n_layers=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 16), generator=g)
    tokens = torch.randint(0, 64, (8, 16), generator=g)
    x, y = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)
    opts = zerobubble.ExecutorOptions
    mesh = None
    if run == "mlp pp3 zb-h1":
        pipe = zerobubble.Pipeline(
            build_mlp((8, 16, 16, 16, 16, 8)), mlp_loss, "zb-h1", microbatches=6
        )
        batch = (x, y)
    elif run == "mlp pp2 zbv":
        pipe = zerobubble.Pipeline(
            build_mlp((8, 16, 16, 16, 16, 8)), mlp_loss, "zbv", microbatches=4
        )
        batch = (x, y)
    elif run == "gpt pp2 dp2 fsdp 1f1b":
        mesh = zerobubble.build_mesh(2, 2, fsdp=True)
        pipe = zerobubble.Pipeline(build_gpt(gpt), gpt_loss, "1f1b", microbatches=2, mesh=mesh)
        batch = (
            ids[mesh.dp_rank * 4 : mesh.dp_rank * 4 + 4],
            tokens[mesh.dp_rank * 4 : mesh.dp_rank * 4 + 4],
        )
    elif run == "gpt pp2 tp2 zb-h1":
        mesh = zerobubble.build_mesh(2, tp=2)
        pipe = zerobubble.Pipeline(build_gpt(gpt), gpt_loss, "zb-h1", microbatches=4, mesh=mesh)
        batch = (ids, tokens)
    elif run == "moe pp2 dp2 ep2 dualpipev overlap":
        mesh = zerobubble.build_mesh(2, 2, ep=2)
        model = build_moe_mlp((8, 16, 8), hidden=16, num_experts=4, top_k=2, blocks=2)
        sched = zerobubble.generate("dualpipev", 2, 4, overlap=True)
        pipe = zerobubble.Pipeline(model, mlp_loss, sched, mesh=mesh)
        xe = torch.randn(16, 3, 8, generator=g)
        ye = torch.randn(16, 3, 8, generator=g)
        part = slice(mesh.dp_rank * 8, mesh.dp_rank * 8 + 8)
        batch = (xe[part], ye[part])
    elif run == "gpt pp2 seq-zb k2":
        sched = zerobubble.generate("seq-zb", 2, 4, segments=2)
        pipe = zerobubble.Pipeline(
            build_gpt(gpt), _token_loss, sched, options=opts(cuts=(0, 7, 16)), count_fn=_count
        )
        batch = (ids, tokens)
    elif run == "gpt pp2 zb-h2 recompute":
        pipe = zerobubble.Pipeline(
            build_gpt(gpt), gpt_loss, "zb-h2", microbatches=4, options=opts(recompute="layers")
        )
        batch = (ids, tokens)
    else:
        raise ValueError(f"unknown run {run!r}")
    pipe.set_optimizer(
        torch.optim.AdamW(pipe.parameters(), lr=1e-2), zerobubble.OptimConfig(max_norm=1.0)
    )
    losses = pipe.step(batch[0], target=batch[1])
    out = _rank_result(pipe, losses)
    # and the parameters after the optimizer's step
    s = hashlib.sha256()
    for name, p in sorted(pipe.named_parameters()):
        s.update(name.encode())
        s.update(_tensor_bytes(p.to_local() if hasattr(p, "to_local") else p))
    out["params"] = s.hexdigest()[:16]
    pipe.drain()
    torch.distributed.destroy_process_group()
    del info
    return out


RUNS = {
    "mlp pp3 zb-h1": 3,
    "mlp pp2 zbv": 2,
    "gpt pp2 dp2 fsdp 1f1b": 4,
    "gpt pp2 tp2 zb-h1": 4,
    "moe pp2 dp2 ep2 dualpipev overlap": 4,
    "gpt pp2 seq-zb k2": 2,
    "gpt pp2 zb-h2 recompute": 2,
}


def step_hashes() -> dict[str, str]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    hashes = {}
    for run, nprocs in RUNS.items():
        per_rank = zerobubble.launch_local(_step, nprocs, run, timeout=300)
        for rank, result in enumerate(per_rank):
            for what, value in result.items():
                hashes[f"{run} rank{rank} {what}"] = value
    return hashes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="schedules,programs,steps")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--against", help="a previous output: exit 1 and name what differs")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    found = schedules()
    result: dict[str, dict[str, str]] = {}
    if "schedules" in parts:
        result["schedules"] = schedule_hashes(found)
    if "programs" in parts:
        result["programs"] = program_hashes(found)
    if "steps" in parts:
        result["steps"] = step_hashes()
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    counts = {part: len(v) for part, v in result.items()}
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        diff = [
            f"{part}: {name}"
            for part, hashes in result.items()
            for name in sorted(set(hashes) | set(before.get(part, {})))
            if hashes.get(name) != before.get(part, {}).get(name)
        ]
        print(json.dumps({"benchmark": "fingerprint", "hashes": counts, "differ": diff}))
        sys.exit(1 if diff else 0)
    print(text)


if __name__ == "__main__":
    main()
