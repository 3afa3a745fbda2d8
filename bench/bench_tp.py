"""Tensor and sequence parallelism inside pipeline stages: bytes per rank (prints JSON lines).

Our GPT at pp=2 under 1f1b, with tp=1 (2 CPU ranks), tp=2 without sequence parallelism and
tp=2 with it (4 ranks each, the default plans), each tp=2 run with loss parallel (the
default: the LM head's logits stay sharded over the vocabulary, the loss never gathers
them) and without it (``loss_parallel=False``: gathered): per pipeline rank,

* ``act_frame`` / ``grad_frame``: the bytes of one activation (gradient) message's frame
  on the wire, measured with the step hooks' ``encode`` (the largest frame a rank sends of
  that kind; its layout stub, a bare header, left out) and ``act_payload`` /
  ``grad_payload``, the frame less its header: the hidden states (their gradient) of one
  microbatch, whole at tp=1 and tp=2 without sequence parallelism, ``1/tp`` of the
  sequence with it (0: the rank sends none of that kind);
* ``param_bytes``: the parameters this rank holds (a DTensor's local shard);
* ``peak_act_bytes``: the peak over a step of the activation bytes the rank's chunks hold
  (the trace's ``mem_after``: ``StageChunk.held_bytes``, distinct storages);

each also as a ratio to tp=1 at the same pipeline rank (``*_vs_tp1``). A tp rank holds
``1/tp`` of each sharded layer; the norms (and our GPT's position embedding) stay whole,
and without sequence parallelism every tp rank keeps the whole residual stream and norm
inputs, so its activations shrink less than its parameters. The last line is the summary:
``peak_act_bytes_vs_tp1`` of the first and the last stage, per sequence parallelism, with
loss parallel and gathered (the vocabulary, 4096 by default, makes the logits the last
stage's largest activation).

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_tp.py [--seq-len 32] [--d-model 64]
        [--vocab 4096]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.program.instructions import Message, MsgKind
from zerobubble.runtime.hooks import StepHooks
from zerobubble.runtime.launcher import init_distributed, launch
from zerobubble.runtime.p2p.wire import FRAME_HEADER

PP, BATCH, M, STEPS = 2, 8, 4, 2
CONFIGS = (
    (1, False, False),
    (2, False, False),
    (2, False, True),
    (2, True, False),
    (2, True, True),
)
"""(tp, sequence parallelism, loss parallel)."""


class Frames(StepHooks):
    """The size of every frame this rank sends, by message kind."""

    def __init__(self) -> None:
        self.sent: dict[MsgKind, list[int]] = {}

    def encode(self, msg: Message, t: torch.Tensor) -> torch.Tensor:
        self.sent.setdefault(msg.kind, []).append(t.numel() * t.element_size())
        return t


def _local_bytes(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


def _rank(cfg: GPTConfig, seq_len: int, tp: int, sp: bool, lp: bool) -> dict[str, Any]:
    from zerobubble.parallel.mesh import build_mesh
    from zerobubble.pipeline import Pipeline

    init_distributed()
    mesh = build_mesh(PP, tp=tp, sequence_parallel=sp)
    lp_option = None if tp == 1 else lp  # True: required (refused where it cannot run)
    pipe = Pipeline(
        list(build_gpt(cfg)), gpt_loss, "1f1b", microbatches=M, mesh=mesh, loss_parallel=lp_option
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, seq_len), generator=gen)
    target = torch.randint(0, cfg.vocab_size, (BATCH, seq_len), generator=gen)
    frames = Frames()
    for _ in range(STEPS):  # the last step is measured (the first sends layout stubs)
        pipe.executor.trace.clear()
        frames.sent.clear()
        pipe.executor.step(ids, target=target, hooks=frames)
    events = pipe.executor.trace.events
    largest = {k.value: max(v) for k, v in frames.sent.items()}
    return {
        "pp_rank": mesh.pp_rank,
        "tp_rank": mesh.tp_rank,
        "act_frame": largest.get("act", 0),
        "grad_frame": largest.get("grad", 0),
        "param_bytes": sum(_local_bytes(p) for p in pipe.parameters()),
        "peak_act_bytes": max(e.mem_after for e in events),
    }


def measure(cfg: GPTConfig, seq_len: int) -> list[dict[str, Any]]:
    """One row per (configuration, pipeline rank); tp rank 0's figures (the tp ranks hold
    the same shapes)."""
    rows: list[dict[str, Any]] = []
    base: dict[int, dict[str, Any]] = {}
    for tp, sp, lp in CONFIGS:
        ranks = launch(_rank, PP * tp, cfg, seq_len, tp, sp, lp, timeout=1200)
        for r in sorted(ranks, key=lambda r: r["pp_rank"]):
            if r["tp_rank"]:
                continue
            d = r["pp_rank"]
            row = {"tp": tp, "sequence_parallel": sp, "loss_parallel": lp, **r}
            row["act_payload"] = max(row["act_frame"] - FRAME_HEADER, 0)
            row["grad_payload"] = max(row["grad_frame"] - FRAME_HEADER, 0)
            base.setdefault(d, row)
            for key in ("act_payload", "grad_payload", "param_bytes", "peak_act_bytes"):
                row[f"{key}_vs_tp1"] = round(row[key] / base[d][key], 4) if base[d][key] else None
            rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first and the last stage's peak activations against tp=1, at tp=2 per sequence
    parallelism, with loss parallel and gathered."""
    out: dict[str, Any] = {}
    for row in rows:
        if row["tp"] == 1:
            continue
        where = "first_stage" if row["pp_rank"] == 0 else "last_stage"
        key = f"{'sp' if row['sequence_parallel'] else 'no_sp'}"
        how = "loss_parallel" if row["loss_parallel"] else "gathered"
        out.setdefault(key, {}).setdefault(where, {})[how] = row["peak_act_bytes_vs_tp1"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    cfg = GPTConfig(
        vocab_size=args.vocab, max_seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers
    )
    rows = measure(cfg, args.seq_len)
    for row in rows:
        print(json.dumps(row))
    print(json.dumps({**summary(rows), "vocab": args.vocab}))


if __name__ == "__main__":
    main()
