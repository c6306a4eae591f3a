"""One shard writer per output directory: an advisory lock that a second writer is refused by.

Two writers on one run would each write and announce the same seqs, and each trusts the output
directory to say what is done. The writer assigns rollout.episodes partitions itself (its resume
point is the directory, not a group generation), so Kafka's group protocol cannot refuse the second
one; the directory can. ``hold_writer_lock(out_dir, who)`` takes ``out_dir/.writer.lock`` with
``flock`` (released by the kernel when the process dies, kill -9 included: no stale lock to clean
up) and writes who holds it (when the disk has room for that: a full disk does not stop it from
taking the lock); a second writer gets ``WriterLockedError`` naming the holder, and a directory that cannot be
written (read-only, a file in the way) a ``ConfigError`` saying so in one line. The lock
covers writers that share the directory (one machine, or a file system with working ``flock``);
writers with different directories on one run are the operator's to avoid (README). ``unwritable`` and
``held_by_another`` say the same two refusals without taking or creating anything: the commands' early
check (``out_dir.check_out_dir``), before a topic or a record is made.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rollout_bus.errors import ConfigError

logger = logging.getLogger(__name__)

LOCK_NAME = ".writer.lock"


class WriterLockedError(ConfigError):
    """Another shard writer holds the output directory."""


def lock_holder(out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What the lock file says of its holder (None when there is no readable lock file)."""
    try:
        return json.loads((Path(out_dir) / LOCK_NAME).read_text())
    except (OSError, ValueError):
        return None


def _cannot_write(directory: Path, why: str, flag: str = "--out") -> str:
    return f"cannot write to the output directory {directory}: {why} ({flag} must be a directory this process can write)"


def unwritable(directory: str | os.PathLike[str], flag: str = "--out") -> str | None:
    """Why this process could not make ``directory`` and write in it (a file in the way, read-only, unreadable),
    found without creating or touching anything; None when it could. Every command that writes a directory
    asks this before it creates a topic or writes a record."""
    directory = Path(directory)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "it is a file" if existing == directory else f"{existing} is a file"
        return _cannot_write(directory, f"{where}, not a directory", flag)
    if existing == directory and not os.access(directory, os.R_OK | os.X_OK):
        return _cannot_write(directory, "it cannot be read (permission denied)", flag)
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it is" if existing == directory else f"{existing} is"
        return _cannot_write(directory, f"{where} read-only for this process", flag)
    return None


def held_by_another(out_dir: str | os.PathLike[str]) -> str | None:
    """Who holds ``out_dir``'s writer lock, when another process does (a probe: takes and drops the lock at
    once, creates nothing); None when nobody does."""
    try:
        fd = os.open(Path(out_dir) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None  # no lock file: nobody ever held it (or it cannot be read: the writer's own take says so)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _locked_by(Path(out_dir))
    finally:
        os.close(fd)


def _locked_by(directory: Path) -> str:
    holder = lock_holder(directory) or {}
    described = ", ".join(f"{k}={v}" for k, v in holder.items()) or "no details written"
    return (f"another shard writer is writing to {directory.resolve()} ({described}); "
            f"run one writer per output directory, or stop that one first")


@contextmanager
def hold_writer_lock(out_dir: str | os.PathLike[str], who: dict[str, Any]) -> Iterator[Path]:
    """Hold ``out_dir``'s writer lock for the block; ``who`` (group, topics) is written into it."""
    directory = Path(out_dir)
    path = directory / LOCK_NAME
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # read-only, not a directory, not permitted: the operator's to fix, said in one line
        raise ConfigError(_cannot_write(directory, str(exc.strerror or exc))) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WriterLockedError(_locked_by(directory)) from None
        os.ftruncate(fd, 0)
        try:
            os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                     "started_at_ms": int(time.time() * 1000), **who}, sort_keys=True).encode())
            os.fsync(fd)
        except OSError as exc:  # the lock is held all the same; a full disk is the writes' to wait out
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            logger.warning("holding the writer lock %s without saying who holds it: %s", path, exc.strerror)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the lock
