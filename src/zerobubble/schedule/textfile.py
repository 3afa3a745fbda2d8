"""Reading the text files users hand over (costs, schedules, traces, configs).

Every such file is UTF-8, read as UTF-8 whatever the locale says; one that is not
is refused naming the file, the line and the byte, instead of a bare codec error
that names nothing.
"""

from __future__ import annotations

from pathlib import Path


def read_text(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of ``path``; ``ValueError`` naming it (and ``what`` it is) if not UTF-8."""
    return decode(Path(path).read_bytes(), path, what)


def decode(data: bytes, path: str | Path, what: str = "file", line: int = 1) -> str:
    """``data`` as UTF-8; ``line`` is the line number of its first byte (for a file read
    line by line), so the message names the line holding the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = line + data.count(b"\n", 0, exc.start)
        raise ValueError(
            f"{path}: the {what} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {at} "
            f"cannot be decoded: {exc.reason}); save it as UTF-8"
        ) from None
