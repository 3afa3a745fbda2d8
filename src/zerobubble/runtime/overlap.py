"""How an overlapped F&B pair runs: both halves at once, so one's communication hides.

A pair (:class:`~zerobubble.program.instructions.Overlap`) is the F of one microbatch and
the backward of another on the same rank. Neither needs the other, so they may run
concurrently. The default, :func:`run_together`, runs the F on a helper thread while
the backward runs on the executor's thread: PyTorch kernels and a collective's wait
release the GIL, so while one half waits for its all-to-all the other computes.

A user hook (:attr:`~zerobubble.runtime.options.ExecutorOptions.overlap_fn`)
replaces it, as DualPipe's ``overlapped_forward_backward`` or PyTorch's custom
``OVERLAP_F_B`` function do: it gets an :class:`OverlapPair` and must run each half
exactly once (in any order, on any thread).

What a half may do: the two halves share nothing but the rank's collectives. A layer
whose forward and backward both run collectives on one process group would let the
two threads issue them in a different order on different ranks; such a layer must
give its forward and its backward a group each (:class:`LaneGroups`), so that each
group sees one thread's sequence, the same on every rank. The two halves are always of
two stages, so tensor parallelism gives each stage of a rank its own tp group (a tp lane,
:meth:`~zerobubble.parallel.mesh.PipelineMesh.with_tp_lanes`); FSDP's collectives run
outside the pairs, and each stage is its own FSDP root. The process's default random
generators go to one half at a time: a forward holds the rank's lock
(:class:`~zerobubble.runtime.rng.StageRng`), and a backward's replay of a forward that drew
(activation recompute, the graph-level split's W) takes it too; a thread waiting at an ep
all-to-all gives it up meanwhile (:func:`~zerobubble.runtime.rng.yield_generators`). A
recomputation's all-to-alls go on the backwards' ep group
(:func:`~zerobubble.runtime.recompute.replaying`). The executor refuses a pair whose
stages' DTensor parameters share a group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerobubble.runtime.p2p.comm import SETTLE_S
from zerobubble.schedule.ir import Action

__all__ = ["LaneGroups", "OverlapFn", "OverlapPair", "in_sequence", "run_pair", "run_together"]


@dataclass(frozen=True)
class LaneGroups:
    """A collective layer's two process groups: one for the calls its forwards make, one
    for those its backwards make. Under an overlapped schedule a forward and a backward
    run at once; on separate groups each group's calls come in one order on every rank."""

    forward: Any
    """The group of the forward's collectives (a ``ProcessGroup``; None: the default)."""
    backward: Any
    """The group of the backward's collectives."""


@dataclass
class OverlapPair:
    """One overlapped pair as a hook sees it: the two actions and their runners."""

    forward: Action
    """The F."""
    backward: Action
    """The B or BW (of another microbatch, or another stage of this rank)."""
    run_forward: Callable[[], None]
    """Runs the F (its input is in hand; its output is kept for the sends after the pair)."""
    run_backward: Callable[[], None]
    """Runs the backward."""


OverlapFn = Callable[[OverlapPair], None]
"""A hook that runs an :class:`OverlapPair`, each half exactly once."""


def run_together(pair: OverlapPair, timeout_s: float | None = None) -> None:
    """The default: the F on a helper thread, the backward on this one; then join.

    An exception of either half is raised here (the backward's first, as it ran on the
    caller's thread, without waiting for the F: the rank fails now). ``timeout_s`` bounds
    the wait for the F after the backward ended (its own collectives are bounded by the
    comm timeout too, so that a peer's failure shows as theirs, not as this timeout).
    """
    failed: list[BaseException] = []

    def forward() -> None:
        try:
            pair.run_forward()
        except BaseException as e:  # handed to the caller's thread below
            failed.append(e)

    helper = threading.Thread(target=forward, name=f"zerobubble {pair.forward}", daemon=True)
    helper.start()
    pair.run_backward()  # a failure here is this rank's: the F is not waited for
    helper.join(timeout_s)
    if helper.is_alive():
        raise TimeoutError(
            f"the overlapped {pair.forward} did not finish within {timeout_s} s after "
            f"{pair.backward} did; a collective of its forward may be waiting for a peer"
        )
    if failed:
        raise failed[0]


def in_sequence(pair: OverlapPair) -> None:
    """The F, then the backward, on this thread: the pair's arithmetic without overlap.

    The executor runs pairs so under tensor parallelism with recompute: a backward that
    replays a forward that drew holds the rank's generators while DTensor's collectives
    (which cannot hand the generators on while they wait, as the ep all-to-alls do) wait
    for a tp peer, whose paired forward may hold its own: run at once, the two ranks could
    wait on each other."""
    pair.run_forward()
    pair.run_backward()


def run_pair(pair: OverlapPair, hook: OverlapFn | None, timeout_s: float) -> None:
    """Run ``pair`` by ``hook`` (None: :func:`run_together`) and check both halves ran once."""
    ran: list[str] = []
    forward, backward = pair.run_forward, pair.run_backward

    def once(name: str, run: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            if name in ran:
                raise ValueError(f"the overlap hook ran {name} twice; run each half once")
            ran.append(name)
            run()

        return call

    counted = OverlapPair(
        pair.forward,
        pair.backward,
        once(str(pair.forward), forward),
        once(str(pair.backward), backward),
    )
    if hook is None:
        # The F's own waits end within the comm timeout and the time it takes to name who
        # never arrived (comm.SETTLE_S); an F past twice that is stuck in its own code.
        run_together(counted, 2 * timeout_s + SETTLE_S)
    else:
        hook(counted)
    missing = [str(a) for a in (pair.forward, pair.backward) if str(a) not in ran]
    if missing:
        raise ValueError(
            f"the overlap hook returned without running {' and '.join(missing)}; it must "
            "call run_forward and run_backward once each"
        )
