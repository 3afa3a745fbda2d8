"""Measured against predicted: the end-to-end job's step times over their simulation (JSON).

Runs ``zerobubble train``'s job (one rank per core, one thread each; P=2 on a
2-core machine): profile, plan with zb-auto, then 1F1B, ZB-H1 and the plan
train taking turns step by step. For each schedule:

* ``measured_ms``: median wall time of a pipeline step (slowest rank, warm-up
  excluded, optimizer excluded);
* ``simulated_ms``: the schedule simulated with the measured profile (per-stage
  F, B, W medians, or F and BW of the unsplit run for schedules without split,
  plus the ping-pong latency per cross-device dependency);
* ``ratio`` = measured / simulated (goal: <= 1.10).

And the planned schedule's speed-up over 1F1B, measured beside predicted.

    PYTHONPATH=src python bench/bench_e2e.py [--devices P] [--steps 12] [--baseline-steps 8]

Figures on a shared or loaded machine are noisy; compare on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from zerobubble.runtime.launcher import launch
from zerobubble.train.config import (
    JobSection,
    ModelSection,
    ScheduleSection,
    TrainConfig,
    default_devices,
)
from zerobubble.train.job import run_job

GOAL = 1.10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=default_devices())
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--baseline-steps", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--out", default="out/bench_e2e")
    args = parser.parse_args()
    cfg = TrainConfig(
        model=ModelSection(n_layers=max(args.layers, args.devices)),
        schedule=ScheduleSection(devices=args.devices, microbatches=args.microbatches),
        job=JobSection(steps=args.steps, baseline_steps=args.baseline_steps, out=args.out),
    )
    began = time.perf_counter()
    result = launch(run_job, cfg.schedule.devices, cfg, None, timeout=1800)[0]
    rows = {}
    for ph in result.phases:
        measured = ph.pipe_time * 1e3
        simulated = float(ph.predicted.makespan)
        rows[ph.name if not ph.planned else f"{ph.name} (planned)"] = {
            "measured_ms": round(measured, 2),
            "simulated_ms": round(simulated, 2),
            "ratio": round(measured / simulated, 3),
            "meets_goal": measured / simulated <= GOAL,
            "step_with_optimizer_ms": round(ph.step_time * 1e3, 2),
            "measured_bubble": round(ph.bubble_rate, 4),
            "predicted_bubble": round(ph.predicted_bubble_rate, 4),
            "peak_activation_bytes": ph.peak_memory,
            "measured_steps": len(ph.pipe_s),
        }
    base, plan = result.phases[0], result.phases[-1]
    print(
        json.dumps(
            {
                "bench": "e2e",
                "config": asdict(cfg),
                "plan_kind": result.plan_kind,
                "mem_limit_bytes": result.mem_limit,
                "goal_ratio": GOAL,
                "schedules": rows,
                "speedup_of_plan_over_1f1b": {
                    "measured": round(base.pipe_time / plan.pipe_time, 4),
                    "predicted": round(
                        float(base.predicted.makespan) / float(plan.predicted.makespan), 4
                    ),
                },
                "trace_check_ok": result.trace_report is None or result.trace_report.ok,
                "wall_s": round(time.perf_counter() - began, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
