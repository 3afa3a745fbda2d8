"""Each rank's progress mark, so that the launcher can name a rank that stalled.

A rank that stops making progress (a hang in its compute, a sleep, a lock) is not
the one that fails first: its peers time out waiting on it and exit, and it has to
be killed. To name it, every bounded communication wait marks this rank's progress
file, ``$ZEROBUBBLE_PROGRESS_DIR/<global rank>`` (the launchers set the variable;
without it nothing is written): "waiting on rank p (or on a collective) since t"
on entering the wait, "running since t" once it returns. A wait that fails leaves
its mark, as the rank dies waiting. The launcher reads the marks (:func:`read`)
when a rank fails or the job times out: a live rank that is running, outside any
wait, while the rank that failed first died waiting, is the one that stalled.

A mark is 16 bytes in a shared memory map (two stores per wait, no system call);
times are ``time.monotonic()``, one clock for every process of the machine.
No torch here: the launcher reads the marks without importing it.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV", "GROUP", "RUNNING", "Mark", "Progress", "read"]

ENV = "ZEROBUBBLE_PROGRESS_DIR"
RUNNING = -1
"""State of a rank outside any communication wait."""
GROUP = -2
"""State of a rank waiting in a collective (no single peer)."""
_FORMAT = struct.Struct("<qd")  # state (RUNNING, GROUP or the peer's global rank), since


@dataclass(frozen=True)
class Mark:
    """A rank's last progress mark: ``state`` RUNNING, GROUP or the global rank waited on,
    since monotonic time ``since``."""

    state: int
    since: float


class Progress:
    """This process's progress mark (a no-op when ``path`` is None)."""

    def __init__(self, path: Path | None) -> None:
        self._map: mmap.mmap | None = None
        if path is not None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                new = os.fstat(fd).st_size < _FORMAT.size
                if new:
                    os.ftruncate(fd, _FORMAT.size)
                self._map = mmap.mmap(fd, _FORMAT.size)
            finally:
                os.close(fd)
            if new:
                self.running()

    @classmethod
    def from_env(cls, rank: int) -> Progress:
        """The mark of global rank ``rank`` in ``$ZEROBUBBLE_PROGRESS_DIR`` (no-op if unset)."""
        folder = os.environ.get(ENV)
        return cls(Path(folder, str(rank)) if folder else None)

    def waiting(self, peer: int | None) -> None:
        """Entering a wait on global rank ``peer`` (None: a collective)."""
        if self._map is not None:
            _FORMAT.pack_into(self._map, 0, GROUP if peer is None else peer, time.monotonic())

    def running(self) -> None:
        """A wait returned: the rank makes progress again."""
        if self._map is not None:
            _FORMAT.pack_into(self._map, 0, RUNNING, time.monotonic())


def read(folder: str | Path, nprocs: int) -> dict[int, Mark]:
    """The marks of ranks ``0 .. nprocs-1`` found in ``folder`` (ranks that never marked
    are absent)."""
    marks: dict[int, Mark] = {}
    for rank in range(nprocs):
        try:
            data = Path(folder, str(rank)).read_bytes()
        except OSError:
            continue
        if len(data) >= _FORMAT.size:
            state, since = _FORMAT.unpack_from(data)
            marks[rank] = Mark(state, since)
    return marks
