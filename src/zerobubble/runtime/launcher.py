"""Start P local processes, one per pipeline rank, the way torchrun does.

Each process gets ``MASTER_ADDR``/``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``OMP_NUM_THREADS=1``; code inside calls
:func:`init_distributed`, which reads that environment and so works the same under
``torchrun``. As under torchrun, the launcher hosts the job's store
(``TORCHELASTIC_USE_AGENT_STORE``) and every rank is its client: the store outlives
any rank, so a rank that times out can still read who arrived after rank 0 has died
(a store hosted by rank 0 dies with it).

Failure policy: the first rank that fails (exception or non-zero exit) is the
one reported, by time of death: a thread per process stamps the moment it
ends, because a neighbour that fails on a dead peer's closed connection often
ends within the same polling window and a poll loop would see the two in rank
order. The others get ``grace`` seconds to finish or fail on their own (their
comm timeouts name what they were waiting for), then are killed. The
whole run is bounded by ``timeout``. Children die with the launcher (a
watchdog thread in :func:`launch` workers; ``PR_SET_PDEATHSIG`` for scripts),
so no process outlives it.

A rank that stalls (alive, but making no progress) is not the first to fail: its
peers time out waiting on it. Every rank marks its progress in a file the launcher
reads (:mod:`zerobubble.runtime.progress`: each communication wait marks "waiting
on rank p" or "running"); when the rank that failed first died waiting (or the job
times out while ranks wait), the live rank it waited on, or else the live rank
running outside any wait since the earliest moment, is reported first as stalled.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import functools
import math
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, get_context, parent_process
from typing import TYPE_CHECKING, Any

from zerobubble.runtime import progress

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

    import torch


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed: its exit code (None if it had to be killed) and error text;
    ``stalled``: it was alive but made no progress while the others waited on it."""

    rank: int
    exitcode: int | None
    error: str
    stalled: bool = False


class LaunchError(RuntimeError):
    """A launched job failed; ``failures[0]`` is the rank to blame: a rank that stalled
    (``stalled``, killed by the launcher), else the rank that died first. The others follow
    in order of death, ranks the launcher had to kill last."""

    def __init__(self, failures: list[RankFailure]) -> None:
        first = failures[0]
        others = "".join(
            f"\n--- rank {f.rank} (exit {f.exitcode}):\n{f.error.strip()}" for f in failures[1:]
        )
        head = (
            f"rank {first.rank} stalled (the others failed waiting on it)"
            if first.stalled
            else f"rank {first.rank} failed first (exit {first.exitcode})"
        )
        super().__init__(
            f"{head}:\n{first.error.strip()}" + (f"\n\nother ranks:{others}" if others else "")
        )
        self.failures = failures


@dataclass(frozen=True)
class DistInfo:
    """What :func:`init_distributed` set up for this process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(
    rank: int,
    nprocs: int,
    port: int,
    progress_dir: str | None = None,
    *,
    agent_store: bool = False,
) -> dict[str, str]:
    """The torchrun-style environment of local rank ``rank`` (and the folder of the ranks'
    progress marks, :mod:`zerobubble.runtime.progress`, if given). ``agent_store``: the
    store at ``port`` is hosted by the launcher (:func:`job_store`), not by rank 0."""
    extra = {} if progress_dir is None else {progress.ENV: progress_dir}
    if agent_store:
        extra["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return {
        **extra,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "OMP_NUM_THREADS": "1",
    }


@contextlib.contextmanager
def job_store() -> Iterator[int]:
    """Host a job's TCP store in this process for as long as the block runs; yields its
    port (chosen by the store itself, so no other process can take it in between)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port  # the suspended generator holds the store; it closes with the block


def init_distributed(timeout_s: float = 60.0) -> DistInfo:
    """Initialise the default process group from the torchrun environment.

    Picks the device-agnostic pair: the current accelerator (indexed by
    ``LOCAL_RANK``) with its default backend (NCCL on CUDA), else CPU with gloo.
    Under ``torchrun`` on several nodes ``RANK`` and ``WORLD_SIZE`` are global and
    ``LOCAL_RANK`` is the node's; a pipeline x data(x tensor)-parallel job then builds its
    mesh with :func:`~zerobubble.parallel.mesh.build_mesh` (world size ``pp * dp * tp``).
    """
    import torch  # here, not at module level: launcher processes do not need torch
    import torch.distributed as dist

    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"environment variables {', '.join(missing)} are not set; start this program with "
            "`python -m zerobubble.launch -n P ...`, with `torchrun`, or through "
            "zerobubble.runtime.launcher.launch"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is not None:
        device = torch.device(acc.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
        backend = dist.get_default_backend_for_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        atexit.register(_destroy_at_exit)
    return DistInfo(rank, world, local_rank, device)


def _destroy_at_exit(timeout_s: float = 30.0) -> None:
    """Destroy the process group while the interpreter is still whole, unless the script
    did: left to finalisation, gloo's worker threads can release tensors without the GIL
    and abort the process ("terminate called without an active exception", seen on a
    rank that had finished its work). Not after an unhandled exception (work may still be
    pending on dead peers), and bounded: a destroy that does not return is left behind."""
    import torch.distributed as dist

    if not dist.is_initialized() or hasattr(sys, "last_value"):
        return
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True)
    worker.start()
    worker.join(timeout_s)


# ---- Python API: launch(fn, nprocs, *args) ---------------------------------------------------


def _watch_parent() -> None:
    """Exit as soon as the launching process is gone (no orphans). Its pipe to this process
    closes when it dies; ``os.getppid`` would not do, as a forkserver rank's parent is the
    server."""
    parent = parent_process()
    if parent is not None:
        connection.wait([parent.sentinel])
    os._exit(1)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    nprocs: int,
    port: int,
    args: tuple,
    conn: connection.Connection,
    progress_dir: str | None = None,
) -> None:
    os.environ.update(rank_env(rank, nprocs, port, progress_dir, agent_store=True))
    if progress_dir is not None:  # a crash in native code leaves its Python stack here
        faulthandler.enable(open(_fault_path(progress_dir, rank), "w"), all_threads=True)  # noqa: SIM115
    if "torch" in sys.modules:  # imported while unpickling fn, before OMP_NUM_THREADS was set
        sys.modules["torch"].set_num_threads(1)
    threading.Thread(target=_watch_parent, daemon=True).start()
    code = 0
    try:
        result = fn(*args)
        try:
            blob = pickle.dumps(("ok", result))
        except Exception as e:
            raise TypeError(
                f"rank {rank}: fn returned a {type(result).__name__} that cannot be pickled "
                f"({type(e).__name__}: {e}); return plain data (tensors, numbers, containers)"
            ) from e
        conn.send_bytes(blob)
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: a process group with a dead peer can hang it.
        os._exit(code)


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 300.0,
    grace: float = 10.0,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` spawned processes; return each rank's result.

    ``fn`` must be picklable (a module-level function) and call
    :func:`init_distributed` itself. Raises :class:`LaunchError` when a rank
    fails or ``timeout`` seconds pass; remaining ranks are killed ``grace``
    seconds after the first failure. ``start_method`` is multiprocessing's: ``"forkserver"``
    after ``multiprocessing.set_forkserver_preload(["torch"])`` forks each rank from a
    server that imported torch once, instead of importing it per rank (seconds each).

    Results come back by value through plain ``pickle`` (tensors copied with their
    storage), not through multiprocessing's file-descriptor sharing, which needs the
    rank alive after it has sent (each rank exits at once). A result that does not
    pickle fails its rank with a message saying so.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if start_method not in ("spawn", "forkserver"):  # a forked rank would share torch's state
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    ctx: ForkServerContext | SpawnContext = (
        get_context("forkserver") if start_method == "forkserver" else get_context("spawn")
    )
    with tempfile.TemporaryDirectory(prefix="zerobubble-progress-") as marks, job_store() as port:
        return _launch(fn, nprocs, args, timeout, grace, ctx, marks, port)


def _launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple,
    timeout: float,
    grace: float,
    ctx: ForkServerContext | SpawnContext,
    marks: str,
    port: int,
) -> list[Any]:
    procs, conns = _spawn_ranks(fn, nprocs, args, ctx, marks, port)
    deaths = _DeathWatch([functools.partial(connection.wait, [p.sentinel]) for p in procs])
    deadline = time.monotonic() + timeout
    results, errors, failed = _collect(procs, conns, deadline, grace)
    timed_out = time.monotonic() >= deadline
    deaths.settle(failed, 1.0)  # the ranks that ended by themselves get their time stamped
    failed = _blame_order(failed, {r: procs[r].exitcode for r in failed}, deaths.at)
    failures = [
        RankFailure(
            r,
            procs[r].exitcode,
            errors.get(r, _exit_text(procs[r].exitcode, _fault_path(marks, r))),
        )
        for r in failed
    ]
    alive = [r for r, p in enumerate(procs) if p.exitcode is None]
    codes = {r: procs[r].exitcode for r in failed}
    state = progress.read(marks, nprocs)
    stall = _stalled(failed[0] if failed else None, codes, alive, state)
    cause = _waited_on(failed, codes, state) if stall is None else None
    if cause is not None:  # it failed in its own code while the first one waited on it
        failures.insert(0, failures.pop(failed.index(cause)))
    _stop_the_rest(procs, failures, errors, stall, timeout, grace, timed_out)
    for c in conns:
        c.close()
    if failures:
        raise LaunchError(failures)
    return results


def _spawn_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple,
    ctx: ForkServerContext | SpawnContext,
    marks: str,
    port: int,
) -> tuple[list[Any], list[connection.Connection]]:
    """Start every rank's process; returns them and the read ends of their result pipes."""
    procs, conns = [], []
    for rank in range(nprocs):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_worker,
            args=(fn, rank, nprocs, port, args, send_end, marks),
            daemon=True,
        )
        p.start()
        send_end.close()
        procs.append(p)
        conns.append(recv_end)
    return procs, conns


def _collect(
    procs: list[Any], conns: list[connection.Connection], deadline: float, grace: float
) -> tuple[list[Any], dict[int, str], list[int]]:
    """Every rank's result or error until all have reported and exited, the ``deadline``
    passes, or ``grace`` seconds after the first failure. Returns the results, the errors
    the ranks reported and the ranks that failed, in the order they were seen to."""
    results: list[Any] = [None] * len(procs)
    errors: dict[int, str] = {}
    failed: list[int] = []
    open_conns = dict(enumerate(conns))
    kill_at = deadline
    while open_conns or any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if now >= kill_at:
            break
        waitables = list(open_conns.values()) + [p.sentinel for p in procs if p.exitcode is None]
        connection.wait(waitables, timeout=min(kill_at - now, 0.5))
        for rank, c in list(open_conns.items()):
            if c.poll():
                try:
                    data = c.recv_bytes()
                except EOFError:
                    del open_conns[rank]
                    continue
                try:
                    status, value = pickle.loads(data)
                except Exception as e:
                    status = "error"
                    value = f"its result cannot be unpickled here ({type(e).__name__}: {e})"
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
            elif procs[rank].exitcode is not None:
                del open_conns[rank]
        for rank, p in enumerate(procs):
            bad = rank in errors or (p.exitcode not in (None, 0) and rank not in open_conns)
            if bad and rank not in failed:
                p.join(1.0)
                failed.append(rank)
                kill_at = min(kill_at, time.monotonic() + grace)
    return results, errors, failed


def _stop_the_rest(
    procs: list[Any],
    failures: list[RankFailure],
    errors: dict[int, str],
    stall: tuple[int, str] | None,
    timeout: float,
    grace: float,
    timed_out: bool,
) -> None:
    """Terminate (then kill) the ranks still alive, each added to ``failures`` with why it
    was stopped; the rank that stalled goes first."""
    for rank, p in enumerate(procs):
        if p.exitcode is None:
            p.terminate()
            p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join()
            why = (
                f"killed after the overall timeout of {timeout:g}s"
                if timed_out
                else (
                    f"killed {grace:g}s after rank {failures[0].rank} failed"
                    if failures
                    else "killed"
                )
            )
            if stall is not None and stall[0] == rank:
                failures.insert(0, RankFailure(rank, None, f"{stall[1]}; {why}", stalled=True))
            else:
                failures.append(RankFailure(rank, None, errors.get(rank, why)))


def _stalled(
    first: int | None,
    codes: dict[int, int | None],
    alive: Sequence[int],
    marks: dict[int, progress.Mark],
) -> tuple[int, str] | None:
    """The live rank that stalled and why it is blamed, or None.

    Only when the rank that failed first exited on its own and died waiting (its mark is
    a wait), or, with no failure (the overall timeout), some live rank is waiting: then
    the rank it waited on, followed through ranks that were themselves waiting, if that
    one is alive and running outside any wait; else the live running rank whose mark is
    the oldest (a collective names no peer).
    """
    now = time.monotonic()
    running = [r for r in alive if r in marks and marks[r].state == progress.RUNNING]
    if not running:
        return None
    if first is not None:
        if (codes.get(first) or 0) < 0 or first not in marks:
            return None  # killed by a signal: it is the cause itself
        waiter = first
    else:
        waiting = [r for r in alive if r in marks and marks[r].state != progress.RUNNING]
        if not waiting:
            return None
        waiter = min(waiting, key=lambda r: marks[r].since)
    if marks[waiter].state == progress.RUNNING:
        return None  # it failed in its own code, not waiting on anyone
    peer, seen = marks[waiter].state, {waiter}
    while peer >= 0 and peer in marks and marks[peer].state >= 0 and peer not in seen:
        seen.add(peer)
        peer = marks[peer].state
    if peer in running:
        how = f"rank {waiter} died waiting on it" if first is not None else f"rank {waiter} waits"
    else:
        peer = min(running, key=lambda r: (marks[r].since, r))
        how = f"rank {waiter} {'died waiting' if first is not None else 'waits'} in a collective"
    idle = now - marks[peer].since
    return peer, (
        f"stalled: no progress for {idle:.1f}s (running outside any communication wait) while {how}"
    )


def _waited_on(
    failed: Sequence[int], codes: dict[int, int | None], marks: dict[int, progress.Mark]
) -> int | None:
    """The rank that the rank which failed first was waiting on and that failed later in its
    own code, outside any wait (a stall that its own watchdog ended, e.g. an overlapped
    pair's helper thread that its main thread gave up on), or None.

    The first to die died waiting (its peer, or a collective, gave nothing within the comm
    timeout). Followed through the ranks that waited on each other, the peer it ends at is
    the cause if it raised while running; a wait that ends in a collective names no peer,
    and then the one rank that raised while running, if exactly one did."""
    if len(failed) < 2 or (codes.get(failed[0]) or 0) < 0 or failed[0] not in marks:
        return None
    if marks[failed[0]].state == progress.RUNNING:
        return None  # it failed in its own code: the cause itself

    def own(r: int) -> bool:
        return r in marks and marks[r].state == progress.RUNNING and (codes.get(r) or 0) > 0

    peer, seen = marks[failed[0]].state, {failed[0]}
    while peer >= 0 and peer in marks and marks[peer].state >= 0 and peer not in seen:
        seen.add(peer)
        peer = marks[peer].state
    if peer >= 0 and peer in failed[1:] and own(peer):
        return peer
    running = [r for r in failed[1:] if own(r)]
    return running[0] if len(running) == 1 else None


def _fault_path(progress_dir: str, rank: int) -> str:
    """Where rank ``rank``'s :mod:`faulthandler` writes the Python stack of a fatal signal."""
    return os.path.join(progress_dir, f"fault-{rank}.txt")


_FAULT_CHARS = 6000
"""At most this much of a rank's faulthandler output (its start) goes into its failure text."""


def _exit_text(code: int | None, fault_path: str | None = None) -> str:
    """How a rank that reported nothing ended; for a fatal signal (an abort or a segfault
    in native code), with the Python stack :mod:`faulthandler` wrote when it arrived."""
    if code is None or code >= 0:
        return f"exited with code {code} without reporting an error"
    text = f"killed by signal {signal.Signals(-code).name}"
    stack = ""
    if fault_path is not None:
        with contextlib.suppress(OSError), open(fault_path, errors="replace") as f:
            stack = f.read().strip()
    if stack:
        cut = "\n[...]" if len(stack) > _FAULT_CHARS else ""
        text += f"; its Python stack when the signal arrived:\n{stack[:_FAULT_CHARS]}{cut}"
    return text


def _status_text(code: int) -> str:
    """How a script rank ended, as its exit status says."""
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name} (status {128 - code})"
    return f"exited with code {code}"


# ---- script API: python -m zerobubble.launch -n P script.py args ---------------------------------


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the launcher dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_script(
    script: str,
    script_args: Sequence[str],
    nprocs: int,
    *,
    timeout: float = 3600.0,
    grace: float = 10.0,
) -> int:
    """Run ``python script *script_args`` as ``nprocs`` ranks; return the job's exit code.

    The code is 0 if every rank succeeded, else that of the rank that died first
    with a non-zero status, by time of death (``128 + signal`` for a signal, as a
    shell reports it); 124 on overall timeout, as ``timeout(1)`` does. Ranks the
    launcher stops after the grace period never set the code; one that stalled while
    the others waited on it is named on a line of its own (see the module's docstring).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    with tempfile.TemporaryDirectory(prefix="zerobubble-progress-") as marks, job_store() as port:
        return _run_script(script, script_args, nprocs, timeout, grace, marks, port)


def _run_script(
    script: str,
    script_args: Sequence[str],
    nprocs: int,
    timeout: float,
    grace: float,
    marks: str,
    port: int,
) -> int:
    procs = []
    for r in range(nprocs):
        env = {**os.environ, **rank_env(r, nprocs, port, marks, agent_store=True)}
        env.setdefault("PYTHONFAULTHANDLER", "1")  # a crash in native code prints its stack
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *script_args],
                env=env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        )
    start = time.monotonic()
    deaths = _DeathWatch([p.wait for p in procs])
    stopped, stall = _wait_then_stop(procs, deaths, start, timeout, grace, marks)
    if stall is not None:
        print(f"zerobubble.launch: rank {stall[0]} {stall[1]}; it was stopped", file=sys.stderr)
    failed = [r for r in list(deaths.at) if r not in stopped and procs[r].returncode != 0]
    failed = _blame_order(failed, {r: procs[r].returncode for r in failed}, deaths.at)
    if stall is None:  # the rank waited on, if it failed later in its own code, goes first
        exits = {r: procs[r].returncode for r in failed}
        cause = _waited_on(failed, exits, progress.read(marks, nprocs))
        if cause is not None:
            failed.insert(0, failed.pop(failed.index(cause)))
    if not failed:
        if stopped:
            print(f"zerobubble.launch: timed out after {timeout:g}s", file=sys.stderr)
            return 124
        return 0
    first = failed[0]
    code = procs[first].returncode
    later = "".join(
        f", rank {r} {_status_text(procs[r].returncode)} "
        f"{abs(deaths.at[r] - deaths.at[first]):.3f}s "
        + ("later" if deaths.at[r] >= deaths.at[first] else "earlier, waiting on it")
        for r in failed[1:]
    )
    status = code if code > 0 else 128 - code
    print(
        f"zerobubble.launch: rank {first} failed first: it {_status_text(code)}{later}; "
        f"job exit status {status}",
        file=sys.stderr,
    )
    return status


def _wait_then_stop(
    procs: list[subprocess.Popen[bytes]],
    deaths: _DeathWatch,
    start: float,
    timeout: float,
    grace: float,
    marks: str,
) -> tuple[set[int], tuple[int, str] | None]:
    """Wait for the script ranks to end, until the timeout or ``grace`` seconds after the
    first failure (announced), then stop the rest (SIGTERM, then SIGKILL), also when the
    wait is interrupted. Returns the ranks stopped and the live rank that stalled, if any
    (judged before stopping them)."""
    nprocs = len(procs)
    stopped: set[int] = set()
    kill_at = start + timeout
    announced = False
    try:
        ended = 0
        while ended < nprocs and (rank := deaths.next(kill_at)) is not None:
            ended += 1
            code = procs[rank].returncode
            if code != 0 and not announced:
                announced = True
                print(
                    f"zerobubble.launch: rank {rank} {_status_text(code)} at "
                    f"{deaths.at[rank] - start:.3f}s; stopping the other ranks in {grace:g}s",
                    file=sys.stderr,
                )
                kill_at = min(kill_at, time.monotonic() + grace)
    finally:
        ended_at = dict(deaths.at)
        bad = [r for r in ended_at if procs[r].returncode != 0]
        codes = {r: procs[r].returncode for r in bad}
        order = _blame_order(bad, codes, ended_at)
        alive = [r for r in range(nprocs) if r not in ended_at]
        stall = _stalled(order[0] if order else None, codes, alive, progress.read(marks, nprocs))
        for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
            alive = [r for r in range(nprocs) if r not in deaths.at]
            stopped.update(alive)
            for r in alive:
                procs[r].send_signal(sig)
            until = time.monotonic() + wait_s
            while len(deaths.at) < nprocs and deaths.next(until) is not None:
                pass
    return stopped, stall


_SAME_MOMENT_S = 0.25
"""Deaths this close together count as one moment for blame (see :func:`_blame_order`)."""


def _blame_order(
    ranks: Iterable[int], codes: dict[int, int | None], at: dict[int, float]
) -> list[int]:
    """``ranks`` (that failed) earliest death first, except that a rank killed by a signal
    goes before ranks that exited with an error at the same moment.

    The stamps are taken when the kernel reports each exit to a waiting thread; a
    neighbour that only has to notice a closed connection and exit can be stamped a
    millisecond before the rank it reacted to. A rank killed by a signal did not fail
    because of a peer, so within ``_SAME_MOMENT_S`` of the earliest death it is the cause.
    """
    order = sorted(ranks, key=lambda r: (at.get(r, math.inf), r))
    if not order or (codes[order[0]] or 0) < 0:
        return order
    t0 = at.get(order[0], math.inf)
    killed = [
        r for r in order if (codes[r] or 0) < 0 and at.get(r, math.inf) - t0 <= _SAME_MOMENT_S
    ]
    return killed[:1] + [r for r in order if r not in killed[:1]]


class _DeathWatch:
    """Stamps the time each process ends, from one thread per process blocked in
    ``waits[rank]``, so the order of deaths is the order they happened in, not the
    order a poll loop saw them (a neighbour that fails on a dead peer's closed
    connection often ends within the same polling window)."""

    def __init__(self, waits: Sequence[Callable[[], object]]) -> None:
        self.at: dict[int, float] = {}
        self._queue: queue.Queue[int] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._watch, args=(rank, wait), daemon=True)
            for rank, wait in enumerate(waits)
        ]
        for t in self._threads:
            t.start()

    def _watch(self, rank: int, wait: Callable[[], object]) -> None:
        wait()
        self.at[rank] = time.monotonic()
        self._queue.put(rank)

    def next(self, until: float) -> int | None:
        """The rank that died next, or None if none does before monotonic time ``until``."""
        try:
            return self._queue.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            return None

    def settle(self, ranks: Iterable[int], timeout: float) -> None:
        """Wait (at most ``timeout`` each) for the stamps of ``ranks``, known to be ending."""
        for r in ranks:
            self._threads[r].join(timeout)
