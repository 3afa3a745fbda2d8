"""Start P local processes, one per pipeline rank, the way torchrun does.

Each process gets ``MASTER_ADDR``/``MASTER_PORT`` (a free local port), ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``OMP_NUM_THREADS=1``;
code inside calls :func:`init_distributed`, which reads that environment and so
works the same under ``torchrun``.

Failure policy: the first rank that fails (exception or non-zero exit) is the
one reported; the others get ``grace`` seconds to finish or fail on their own
(their comm timeouts name what they were waiting for), then are killed. The
whole run is bounded by ``timeout``. Children die with the launcher (a
watchdog thread in :func:`launch` workers; ``PR_SET_PDEATHSIG`` for scripts),
so no process outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, get_context
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed: its exit code (None if it had to be killed) and error text."""

    rank: int
    exitcode: int | None
    error: str


class LaunchError(RuntimeError):
    """A launched job failed; ``failures[0]`` is the first failure observed."""

    def __init__(self, failures: list[RankFailure]) -> None:
        first = failures[0]
        others = "".join(
            f"\n--- rank {f.rank} (exit {f.exitcode}):\n{f.error.strip()}" for f in failures[1:]
        )
        super().__init__(
            f"rank {first.rank} failed first (exit {first.exitcode}):\n{first.error.strip()}"
            + (f"\n\nother ranks:{others}" if others else "")
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


def rank_env(rank: int, nprocs: int, port: int) -> dict[str, str]:
    """The torchrun-style environment of local rank ``rank``."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "OMP_NUM_THREADS": "1",
    }


def init_distributed(timeout_s: float = 60.0) -> DistInfo:
    """Initialise the default process group from the torchrun environment.

    Picks the device-agnostic pair: the current accelerator (indexed by
    ``LOCAL_RANK``) with its default backend (NCCL on CUDA), else CPU with gloo.
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
    return DistInfo(rank, world, local_rank, device)


# ---- Python API: launch(fn, nprocs, *args) ---------------------------------------------------


def _watch_parent(parent: int) -> None:
    """Exit as soon as the launching process is gone (no orphans)."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    nprocs: int,
    port: int,
    args: tuple,
    conn: connection.Connection,
    parent: int,
) -> None:
    os.environ.update(rank_env(rank, nprocs, port))
    if "torch" in sys.modules:  # imported while unpickling fn, before OMP_NUM_THREADS was set
        sys.modules["torch"].set_num_threads(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    code = 0
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
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
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` spawned processes; return each rank's result.

    ``fn`` must be picklable (a module-level function) and call
    :func:`init_distributed` itself. Raises :class:`LaunchError` when a rank
    fails or ``timeout`` seconds pass; remaining ranks are killed ``grace``
    seconds after the first failure.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = get_context("spawn")
    port = free_port()
    procs, conns = [], []
    for rank in range(nprocs):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_worker,
            args=(fn, rank, nprocs, port, args, send_end, os.getpid()),
            daemon=True,
        )
        p.start()
        send_end.close()
        procs.append(p)
        conns.append(recv_end)

    results: list[Any] = [None] * nprocs
    errors: dict[int, str] = {}
    failures: list[RankFailure] = []
    open_conns = dict(enumerate(conns))
    deadline = time.monotonic() + timeout
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
                    status, value = c.recv()
                except EOFError:
                    del open_conns[rank]
                    continue
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
            elif procs[rank].exitcode is not None:
                del open_conns[rank]
        for rank, p in enumerate(procs):
            failed = rank in errors or (p.exitcode not in (None, 0) and rank not in open_conns)
            if failed and all(f.rank != rank for f in failures):
                p.join(1.0)
                failures.append(
                    RankFailure(rank, p.exitcode, errors.get(rank, _exit_text(p.exitcode)))
                )
                kill_at = min(kill_at, time.monotonic() + grace)
    timed_out = time.monotonic() >= deadline
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
            failures.append(RankFailure(rank, None, errors.get(rank, why)))
    for c in conns:
        c.close()
    if failures:
        raise LaunchError(failures)
    return results


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code} without reporting an error"


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

    The code is 0 if every rank succeeded, else the first failing rank's code
    (124 on overall timeout, as ``timeout(1)`` does).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    port = free_port()
    procs = []
    for rank in range(nprocs):
        env = {**os.environ, **rank_env(rank, nprocs, port)}
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *script_args],
                env=env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        )
    deadline = time.monotonic() + timeout
    kill_at = deadline
    first: tuple[int, int] | None = None
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < kill_at:
            for rank, p in enumerate(procs):
                if first is None and p.poll() not in (None, 0):
                    first = (rank, p.returncode)
                    print(
                        f"zerobubble.launch: rank {rank} exited with code {p.returncode}; "
                        f"stopping the other ranks in {grace:g}s",
                        file=sys.stderr,
                    )
                    kill_at = min(kill_at, time.monotonic() + grace)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if first is None and time.monotonic() >= deadline:
        print(f"zerobubble.launch: timed out after {timeout:g}s", file=sys.stderr)
        return 124
    if first is None:
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        first = bad[0] if bad else None
    return 0 if first is None else (first[1] if first[1] > 0 else 128 - first[1])
