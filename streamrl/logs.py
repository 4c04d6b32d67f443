"""Role logs rotated by size, by the supervisor that starts the roles (no logrotate).

A role writes its log itself: its stdout and stderr are the file, opened in append mode (O_APPEND), so a role's
output never depends on the supervisor being alive (a supervisor killed outright leaves its roles draining into
their logs). Rotation is therefore copy-and-truncate: :func:`rotate_log` reads the file, truncates it to zero at
once (the role's next write lands at the new end, offset 0: O_APPEND), and files what it read as ``NAME.1``
(newest) ... ``NAME.<keep>``, each at most ``max_bytes`` (cut at line ends), the older ones shifted up and those
past ``keep`` deleted. A line the role writes in the instant between the read and the truncation is lost: the
window of logrotate's ``copytruncate``, microseconds once in every ``max_bytes`` of output.
"""

from __future__ import annotations

import os
from pathlib import Path


def rotated_path(path: Path, index: int) -> Path:
    """``NAME.<index>``: the rotated file ``index`` (1 is the newest)."""
    return path.with_name(f"{path.name}.{index}")


def _chunks(data: bytes, size: int) -> list[bytes]:
    """``data`` in pieces of at most ``size`` bytes, cut after a newline where there is one, oldest first."""
    out, start = [], 0
    while start < len(data):
        end = min(start + size, len(data))
        if end < len(data):
            newline = data.rfind(b"\n", start, end)
            end = newline + 1 if newline >= start else end
        out.append(data[start:end])
        start = end
    return out


def _shift(path: Path, by: int, keep: int) -> None:
    """Move ``NAME.i`` to ``NAME.<i + by>``, deleting those that would pass ``keep`` (highest first, so no
    rename overwrites a file not yet moved)."""
    found = sorted(
        (int(p.name.rsplit(".", 1)[1]), p)
        for p in path.parent.glob(f"{path.name}.*")
        if p.name.rsplit(".", 1)[1].isdigit()
    )
    for index, old in reversed(found):
        if index + by > keep:
            old.unlink(missing_ok=True)
        else:
            os.replace(old, rotated_path(path, index + by))


def rotate_log(path: Path, max_bytes: int, keep: int) -> bool:
    """Rotate ``path`` when it holds more than ``max_bytes``: its content moves to ``NAME.1``... (at most ``keep``
    files of at most ``max_bytes``, newest lines kept) and the file, still open in the role, starts empty.
    Returns whether it rotated."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
        with open(path, "r+b") as fh:
            data = fh.read()
            fh.truncate(0)  # right after the read: what the role writes next goes to offset 0 (O_APPEND)
    except FileNotFoundError:  # a log on another node (the Ray launcher), or not written yet
        return False
    chunks = _chunks(data, max_bytes)[-keep:] if keep else []
    _shift(path, len(chunks), keep)
    for index, chunk in enumerate(reversed(chunks), start=1):
        rotated_path(path, index).write_bytes(chunk)
    return True


def rotate_logs(log_dir: Path, max_bytes: int, keep: int) -> list[Path]:
    """Rotate every ``*.log`` in ``log_dir`` that passed ``max_bytes`` (the roles' logs, a learner's rank logs);
    returns those rotated."""
    return [p for p in sorted(Path(log_dir).glob("*.log")) if rotate_log(p, max_bytes, keep)]
