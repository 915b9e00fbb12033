"""Appending records to a run's JSON-lines files (metrics.jsonl, learner_ledger.jsonl, eval.jsonl,
samples.jsonl) so that a full disk says so and leaves no torn line behind.

:func:`append_lines` writes the lines with ``O_APPEND``; when a write fails (ENOSPC on a full disk,
EDQUOT over a quota, EIO) the file is cut back to its length before the call, so a reader never
meets half a record and the next append does not glue onto one. The error raised names the file,
the free space and what to do; it keeps the errno of the failure, so callers can still tell a
full disk from other errors.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Iterable


def append_lines(path: str | os.PathLike, lines: Iterable[str]) -> None:
    """Append ``lines`` (each ending in a newline) to ``path`` whole, or leave it as it was."""
    path = Path(path)
    data = "".join(lines).encode()
    if not data:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError as e:
            try:
                os.ftruncate(fd, start)  # no torn record for readers or for the next append
            except OSError:
                pass
            raise _append_error(e, path, len(data)) from e
    finally:
        os.close(fd)


def _append_error(err: OSError, path: Path, size: int) -> OSError:
    try:
        free: int | None = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    what = ("no space left on device (ENOSPC)" if err.errno == errno.ENOSPC else
            "disk quota exceeded (EDQUOT)" if err.errno == errno.EDQUOT else f"write failed ({err.strerror})")
    advice = "free space, then start the process again" if full else "check the disk, then start the process again"
    return OSError(err.errno, (
        f"{what} while appending {size} bytes to {path} ({'?' if free is None else free} bytes free); "
        f"the file was left as it was before this record: {advice}"), str(path))
