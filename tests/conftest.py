"""Shared test helpers."""

from __future__ import annotations

import os
import shutil
import tempfile
from fractions import Fraction

import pytest

# The ranks run with one intra-op thread (the launcher sets OMP_NUM_THREADS=1), and a
# single-process reference must reduce in their order: one thread here too, under bare
# pytest as under `make test` (which sets it). Before torch is imported, so that it applies.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from generated import SHARED_ENV
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.ir import Schedule


def exact_costs(schedule: Schedule, F=1, B=1, W=1, comm=0, mem_w=Fraction(1, 2)) -> CostModel:
    """Per-device totals as Fractions, so simulated figures are exact."""
    return CostModel.from_device_totals(
        schedule.placement, Fraction(F), Fraction(B), Fraction(W), Fraction(comm), Fraction(mem_w)
    )


@pytest.fixture
def exact():
    return exact_costs


def pytest_report_header(config) -> str:
    """The kernel paths this run's bitwise tests exercise (``make test`` runs them twice)."""
    import os

    import torch

    names = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    env = " ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ) or "none set"
    return f"kernels: PyTorch CPU capability {torch.backends.cpu.get_cpu_capability()} ({env})"


def pytest_configure(config) -> None:
    """The run's shared folder of generated schedules (see generated.py), made by the process
    that starts the run before it starts any xdist worker, so every worker inherits it."""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get(SHARED_ENV):
        return
    folder = tempfile.mkdtemp(prefix="zerobubble-schedules-")
    os.environ[SHARED_ENV] = folder
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    config.add_cleanup(lambda: os.environ.pop(SHARED_ENV, None))


HEAVY_FIRST = (
    "test_placement_search.py",
    "test_train.py",
    "test_fault_matrix.py",
    "test_reshard.py",
    "test_fault_scale.py",
    "test_optim_peers.py",
    "test_replay.py",
    "test_overlap_moe.py",
    "test_tp.py",
    "test_composition.py",
    "test_seq_runtime.py",
)
"""The modules that take longest (``pytest --durations``), run first: xdist hands modules to
idle workers in collection order, so a long module collected last would leave the other
worker idle at the end of the run."""


def pytest_collection_modifyitems(session, config, items) -> None:
    first = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: order kept
