"""Schedules generated once per test session.

Generators are pure and a :class:`~zerobubble.schedule.ir.Schedule` is immutable, so a test
that only reads a schedule may share it with every other test that asks for the same
arguments; the searching kinds (``optimal``, ``optimal-v``, ``auto``, ``zb-auto``,
``zbv-auto``) take seconds each, and several files sweep every kind over the same grid.
Tests of the generators themselves (determinism, errors) call ``generate`` directly.
"""

from __future__ import annotations

import functools
from typing import Any

from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Schedule


@functools.cache
def _generated(kind: str, p: int, m: int, opts: tuple[tuple[str, Any], ...]) -> Any:
    try:
        return generate(kind, p, m, **dict(opts))
    except ValueError as e:  # infeasible arguments are answered the same every time
        return e


def generated(kind: str, p: int, m: int, **opts: Any) -> Schedule:
    """``generate(kind, p, m, **opts)``, computed at most once per session."""
    got = _generated(kind, p, m, tuple(sorted(opts.items())))
    if isinstance(got, ValueError):
        raise got
    return got
