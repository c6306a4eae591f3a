"""Files written whole or not at all, and a full disk waited out instead of crashing on it.

Every file the project writes for a reader (shards, manifests, trainer checkpoints, policy weights)
goes to a temporary name in the same directory, is fsync'd and renamed, so no reader sees half of
it. A disk that fills up is an outage like a broker that goes away: the data is not wrong, there is
just nowhere to put it yet. ``write_atomic`` then raises ``DiskFullError`` (the path, the bytes it
needed, the bytes free), and ``wait_for_disk`` retries the whole operation, one line every
``interval_s``, until it fits or the caller is told to stop. A caller announces or commits nothing
of what it was writing until the write succeeded.

Contract:

* ``write_atomic(path, data, *, sync_dir=True)``: temporary file, fsync, ``os.replace``; the
  temporary file is removed when anything fails. ENOSPC or EDQUOT raises ``DiskFullError`` (an
  ``OSError`` and a ``RolloutBusError``) whose one-line message names the path and the sizes.
* ``fsync_dir(directory)``: make the names in ``directory`` durable.
* ``wait_for_disk(operation, what, *, should_stop=None, interval_s=10, sleep=time.sleep)`` returns
  ``operation()``; while it raises ``DiskFullError`` it logs a WARNING (what, path, bytes needed
  and free) when the wait begins and every ``interval_s``, checking ``should_stop()`` about every
  second (True: ``Stopped``), and logs when the write went through. Other errors propagate.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rollout_bus.errors import DiskFullError, Stopped

logger = logging.getLogger(__name__)

T = TypeVar("T")
TMP_SUFFIX = ".tmp"
DISK_RETRY_S = 10.0
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path.parent).free
    except OSError:
        return None


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write ``data`` to ``path`` via a fsync'd temporary file in the same directory and a rename
    (``sync_dir=False``: the caller fsyncs the directory once after several files)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in _FULL:
            raise DiskFullError(path, len(data), _free_bytes(path), exc.errno) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def wait_for_disk(operation: Callable[[], T], what: str, *, should_stop: Callable[[], bool] | None = None,
                  interval_s: float = DISK_RETRY_S, sleep: Callable[[float], None] = time.sleep) -> T:
    """``operation()``, retried while the disk is full (see the module docstring)."""
    began = said = None
    while True:
        try:
            result = operation()
        except DiskFullError as exc:
            now = time.monotonic()
            if began is None or now - said >= interval_s:
                waited = 0.0 if began is None else now - began
                began = began if began is not None else now
                said = now
                logger.warning("waiting for disk space (%.0fs): %s: %s; nothing of it is announced or committed "
                               "until it is written; retrying", waited, what, exc)
            slept = 0.0
            while slept < interval_s:
                if should_stop is not None and should_stop():
                    raise Stopped(f"stopped while waiting for disk space for {what}") from None
                step = min(1.0, interval_s - slept)
                sleep(step)
                slept += step
            continue
        if began is not None:
            logger.info("disk space back after %.0fs: %s written", time.monotonic() - began, what)
        return result
