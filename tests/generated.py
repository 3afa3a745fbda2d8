"""Schedules generated once per test run, shared by the run's xdist workers.

Generators are pure and a :class:`~zerobubble.schedule.ir.Schedule` is immutable, so a test
that only reads a schedule may share it with every other test that asks for the same
arguments; the searching kinds (``optimal``, ``optimal-v``, ``auto``, ``zb-auto``,
``zbv-auto``) take seconds each, and several files sweep every kind over the same grid.
Tests of the generators themselves (determinism, errors) call ``generate`` directly.

``make test`` runs the suite on several xdist workers (processes). Each keeps its own
in-memory cache, and when :data:`SHARED_ENV` names a folder (conftest.py makes one per run)
the workers also share what they generated there: the first to ask for a schedule generates
it under a file lock, the others wait for it and read it back. Errors (infeasible arguments)
are cheap and are not shared.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

from filelock import FileLock

from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.ir import Schedule

RUNTIME_KINDS = tuple(k for k, g in GENERATORS.items() if not g.segmented)
"""The kinds the every-kind executor sweeps run: all but those that always cut sequences into
segments, which need the segment cuts and a token-counted loss (tests/test_seq_runtime.py
runs them)."""

SLOW_SOLVES = frozenset({("optimal", 4, 9), ("optimal-v", 4, 9)})
"""(kind, P, M) the every-kind sweeps skip: the MILPs at P=4, M=2P+1 with two chunks take
about 40 s (``optimal``) and 16 s (``optimal-v``) of CPU alone. The sweeps still run them at
M=2P+1 for P <= 3 and at P=4 for M <= P, so neither the size nor the device count goes
unchecked."""

SHARED_ENV = "ZEROBUBBLE_TEST_SCHEDULES"
"""The environment variable naming the run's shared folder of generated schedules."""


def _generate(kind: str, p: int, m: int, opts: tuple[tuple[str, Any], ...]) -> Any:
    try:
        return generate(kind, p, m, **dict(opts))
    except ValueError as e:  # infeasible arguments are answered the same every time
        return e


@functools.cache
def _generated(kind: str, p: int, m: int, opts: tuple[tuple[str, Any], ...]) -> Any:
    folder = os.environ.get(SHARED_ENV)
    if not folder:
        return _generate(kind, p, m, opts)
    key = hashlib.sha256(repr((kind, p, m, opts)).encode()).hexdigest()[:32]
    path = Path(folder) / f"{key}.pickle"
    with FileLock(f"{path}.lock"):
        if path.exists():
            return pickle.loads(path.read_bytes())
        got = _generate(kind, p, m, opts)
        if isinstance(got, Schedule):
            part = path.with_suffix(".part")
            part.write_bytes(pickle.dumps(got))
            part.replace(path)
        return got


def generated(kind: str, p: int, m: int, **opts: Any) -> Schedule:
    """``generate(kind, p, m, **opts)``, computed at most once per test run."""
    got = _generated(kind, p, m, tuple(sorted(opts.items())))
    if isinstance(got, ValueError):
        raise got
    return got
