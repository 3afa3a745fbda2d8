"""One-device check of the B/W split on an accelerator: exactness, cost, memory, schedules.

Run: ``PYTHONPATH=src python bench/gpu_check.py [--device cuda] [--quick]``
(at most about 5 minutes on one GPU). ``--dry-run`` runs every part on the CPU at tiny
sizes, simulating only the schedules that need no search (seconds; the suite runs it).
Prints one JSON object; exits with status 1 if a split is not bitwise plain autograd or
a host-side collective fails.

1. **Exactness.** GPT-2 (Conv1D) and Llama blocks from ``bench_bw_split`` run
   as a middle stage through :class:`~zerobubble.runtime.stage.StageChunk`
   (F, B, W) and through plain autograd, in fp32 and under ``torch.autocast``
   (bf16, and fp16 on CUDA); reports whether the input gradient and every
   parameter gradient are bitwise equal. The same for a first stage that takes
   every split path (embedding, a Linear used twice, LayerNorm, the graph-level
   split of ``nn.MultiheadAttention``), and the HF adapter's tiny GPT-2 and Llama
   layers against the models themselves (logits, loss, every gradient), as the
   suite's ``bitwise`` tests check them on the CPU. On CUDA these run with
   deterministic algorithms (``CUBLAS_WORKSPACE_CONFIG=:4096:8``), which the
   timed parts then leave off.
2. **Cost and memory.** This library's GPT block at each ``--d-models`` width
   (head size 64, ``--seq-len`` tokens): fused backward time, B and W time
   (device-synchronised wall time, medians), ``(B + W) / fused``, and bytes
   held after B over bytes held after F.
3. **Schedules.** Every schedule kind simulated for ``--devices`` devices and
   ``2 * devices`` microbatches with one block per stage and the measured F, B,
   W and memory of each width: makespan, cost (longest device span) and
   bubble rate.
4. **Host-side collectives.** The optimizer's gradient-norm state is a CPU
   vector; it is summed through :class:`~zerobubble.runtime.p2p.comm.P2P` on a
   one-rank group of the device's default backend (NCCL on CUDA, which takes
   device tensors only) and must come back unchanged, on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bw_split import GPT2Block, LlamaBlock

from zerobubble.models import GPTConfig, build_gpt
from zerobubble.runtime.p2p.comm import P2P
from zerobubble.runtime.stage import StageChunk
from zerobubble.schedule.costs import CostSpec
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.simulate import simulate

SKIPPED_KINDS = {"optimal"}  # a MILP: minutes, not a check


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _amp(device: torch.device, dtype: torch.dtype | None):
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def exactness(
    name: str, module: nn.Module, x: Tensor, gy: Tensor, dtype: torch.dtype | None
) -> dict[str, object]:
    """Bitwise comparison of the split stage with plain autograd (``dtype``: autocast's).

    A floating ``x`` makes the module a middle stage (its input gradient is compared too);
    token ids make it a first stage."""
    ref = copy.deepcopy(module)
    middle = x.is_floating_point()
    xr = x.detach().requires_grad_(True) if middle else x
    with _amp(x.device, dtype):
        yr = ref(xr)
    yr.backward(gy.to(yr.dtype))
    chunk = StageChunk(copy.deepcopy(module), int(middle), 3, track_memory=False)
    with _amp(x.device, dtype):
        y = chunk.forward(0, x)
    gx = chunk.backward_input(0, gy.to(y.dtype))
    chunk.backward_weight(0)
    want = dict(ref.named_parameters())
    bad = [n for n, p in chunk.module.named_parameters() if not torch.equal(p.grad, want[n].grad)]
    return {
        "block": name,
        "autocast": str(dtype).removeprefix("torch.") if dtype else "off",
        "output_equal": bool(torch.equal(y, yr.detach())),
        "input_grad_equal": bool(not middle or (gx is not None and torch.equal(gx, xr.grad))),
        "param_grads_equal": not bad,
        "unequal_params": bad[:8],
    }


class MixedStage(nn.Module):
    """A first stage of every split path: an embedding, a Linear used twice, a LayerNorm,
    ``nn.MultiheadAttention`` (the graph-level split, with ``q is k is v``) and a head."""

    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.shared = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mha = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Sequential(nn.GELU(), nn.Linear(d, d, bias=False))

    def forward(self, idx: Tensor) -> Tensor:
        h = self.shared(self.emb(idx))
        h = self.norm(self.shared(h) + h)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.head(h)


def hf_exactness(name: str, device: torch.device) -> dict[str, object]:
    """The HF adapter's layers against the model itself, on a padded batch with dropout on:
    logits, loss and every gradient bitwise (``skipped`` without transformers, or with a
    release whose modules the adapter cannot call, which it refuses with a ValueError)."""
    try:
        from zerobubble.interop import hf
    except ImportError as e:
        return {"model": name, "skipped": str(e)}
    model = hf.tiny_model(name).to(device).train()
    twin = copy.deepcopy(model)
    try:
        layers = hf.causal_lm_layers(twin)
    except ValueError as e:
        return {"model": name, "skipped": str(e)}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (4, 5), generator=gen).to(device)
    mask = torch.ones_like(ids)
    mask[2, 3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    torch.manual_seed(7)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    torch.manual_seed(7)
    x = layers[0](ids, attention_mask=mask)
    for layer in layers[1:]:
        x = layer(x)
    loss = hf.CausalLMLoss(twin)(x, labels)
    loss.backward()
    bad = [
        layer.source_name(n)
        for layer in layers
        for n, p in layer.named_parameters()
        if not torch.equal(p.grad, model.get_parameter(layer.source_name(n)).grad)
    ]
    return {
        "model": name,
        "logits_equal": bool(torch.equal(x, out.logits)),
        "loss_equal": bool(torch.equal(loss, out.loss)),
        "param_grads_equal": not bad,
        "unequal_params": bad[:8],
    }


def cost(d: int, seq: int, repeats: int, device: torch.device) -> dict[str, object]:
    """Times (ms) and held bytes of this library's GPT block at width ``d``."""
    cfg = GPTConfig(vocab_size=512, max_seq_len=seq, d_model=d, n_heads=d // 64, n_layers=1)
    block = build_gpt(cfg)[1].to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, seq, d, device=device, generator=gen)
    gy = torch.randn(1, seq, d, device=device, generator=gen)
    plain = copy.deepcopy(block)
    chunk = StageChunk(copy.deepcopy(block), 1, 3, track_memory=False)
    tracked = StageChunk(copy.deepcopy(block), 1, 3, track_memory=True)
    tracked.forward(0, x)
    held_f = tracked.held_bytes()
    tracked.backward_input(0, gy)
    held_b = tracked.held_bytes()
    tracked.backward_weight(0)
    runs: dict[str, list[float]] = {"F": [], "fused": [], "B": [], "W": []}
    for i in range(repeats + 1):
        xi = x.detach().requires_grad_(True)
        out = plain(xi)
        t_fused = _timed(device, lambda: out.backward(gy))  # noqa: B023
        t_f = _timed(device, lambda: chunk.forward(i, x))  # noqa: B023
        t_b = _timed(device, lambda: chunk.backward_input(i, gy))  # noqa: B023
        t_w = _timed(device, lambda: chunk.backward_weight(i))  # noqa: B023
        for p in (*plain.parameters(), *chunk.module.parameters()):
            p.grad = None
        if i:  # the first run warms up
            for key, t in zip(("F", "fused", "B", "W"), (t_f, t_fused, t_b, t_w), strict=True):
                runs[key].append(1e3 * t)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "d_model": d,
        "seq_len": seq,
        "t_F_ms": round(med["F"], 3),
        "t_fused_backward_ms": round(med["fused"], 3),
        "t_B_ms": round(med["B"], 3),
        "t_W_ms": round(med["W"], 3),
        "time_ratio": round((med["B"] + med["W"]) / med["fused"], 3),
        "held_after_F_bytes": held_f,
        "held_after_B_bytes": held_b,
        "memory_ratio": round(held_b / held_f, 3),
    }


def schedules(measured: dict[str, object], devices: int, search: bool) -> dict[str, object]:
    """Every schedule kind simulated with one measured block per stage (``search``: also
    the kinds that search, which take seconds each on the host)."""
    f, b, w = (float(measured[k]) for k in ("t_F_ms", "t_B_ms", "t_W_ms"))  # type: ignore[arg-type]
    spec = CostSpec(F=f, B=b, W=w, mem_w=float(measured["memory_ratio"]))  # type: ignore[arg-type]
    out: dict[str, object] = {}
    for kind, gen in GENERATORS.items():
        if kind in SKIPPED_KINDS or not (search or "costs" not in gen.options):
            continue
        try:
            split = "split_backward" in gen.options
            sched = generate(kind, devices, 2 * devices, split_backward=split, costs=spec)
            sim = simulate(sched, spec.resolve(sched.placement))
        except ValueError as e:
            out[kind] = {"error": str(e)[:200]}
            continue
        out[kind] = {
            "makespan_ms": round(float(sim.makespan), 3),
            "cost_ms": round(float(sim.cost), 3),
            "bubble_rate": round(sim.bubble_rate, 4),
        }
    return out


def collectives(device: torch.device) -> dict[str, object]:
    """A CPU tensor summed over a one-rank group of ``device``'s default backend, as the
    optimizer sums its norm state (a fresh group unless one exists)."""
    fresh = not dist.is_initialized()
    if fresh:
        backend = dist.get_default_backend_for_device(device)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        vec = torch.arange(4, dtype=torch.float64)
        P2P(None, device, timeout_s=60.0).all_reduce(vec, "gpu_check: the CPU norm vector")
        ok = vec.device.type == "cpu" and vec.tolist() == [0.0, 1.0, 2.0, 3.0]
        return {"backend": str(dist.get_backend()), "cpu_tensor_all_reduce": ok}
    finally:
        if fresh:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny shapes, no schedule search (seconds)"
    )
    parser.add_argument("--d-models", default="1024,2048,4096")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", type=int, default=4, help="pipeline devices to simulate")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.quick, args.repeats = "cpu", True, 2
    device = torch.device(args.device)
    if device.type == "cuda":
        # Bitwise needs run-to-run determinism first: no atomics-ordered sums, and cuBLAS's
        # fixed workspace (read when cuBLAS starts, so before any CUDA work).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(device.type == "cuda")
    if device.type != "cpu" and not torch.get_device_module(device.type).is_available():
        parser.exit(
            2, f"gpu_check: no {device.type} device here; pass --dry-run to run it on the CPU\n"
        )
    widths = [128] if args.quick else [int(v) for v in args.d_models.split(",")]
    seq = 64 if args.quick else args.seq_len
    torch.manual_seed(0)
    d, t = (64, 32) if args.quick else (256, 128)
    x = torch.randn(2, t, d, device=device)
    gy = torch.randn(2, t, d, device=device)
    dtypes: list[torch.dtype | None] = [None, torch.bfloat16]
    if device.type == "cuda":
        dtypes.append(torch.float16)
    checks = [
        exactness(name, make().to(device), x, gy, dtype)
        for name, make in (
            ("hf_gpt2", lambda: GPT2Block(d, 4)),
            ("llama", lambda: LlamaBlock(d, 4, 8 * d // 3)),
        )
        for dtype in dtypes
    ]
    ids = torch.randint(0, 11, (2, 5), device=device)  # small shapes, where kernels differ most
    mixed = MixedStage(11, 8).to(device)
    checks.append(
        exactness("mixed_first_stage", mixed, ids, torch.randn(2, 5, 8, device=device), None)
    )
    adapter = [hf_exactness(name, device) for name in ("hf-gpt2", "hf-llama")]
    torch.use_deterministic_algorithms(False)
    comm = collectives(device)
    costs = [cost(w, seq, args.repeats, device) for w in widths]
    sims = {str(c["d_model"]): schedules(c, args.devices, not args.dry_run) for c in costs}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    exact = all(c["output_equal"] and c["input_grad_equal"] and c["param_grads_equal"]
                for c in checks) and all(
        c.get("skipped") or (c["logits_equal"] and c["loss_equal"] and c["param_grads_equal"])
        for c in adapter
    )  # fmt: skip
    out = {
        "bench": "gpu_check",
        "device": str(device),
        "device_name": name,
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "all_bitwise": exact,
        "exactness": checks,
        "hf_adapter": adapter,
        "collectives": comm,
        "cost": costs,
        "schedules": sims,
    }
    print(json.dumps(out, indent=2))
    return 0 if exact and comm["cpu_tensor_all_reduce"] else 1


if __name__ == "__main__":
    sys.exit(main())
