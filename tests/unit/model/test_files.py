"""Files are written whole or not at all, and a full disk is a wait, not a crash.

Proven with the disk's refusal injected where the OS gives it (``os.fsync`` raising ENOSPC/EDQUOT):
``write_atomic`` leaves neither the target nor a temporary file behind and raises ``DiskFullError``
naming the path and the bytes it needed; ``wait_for_disk`` retries the operation until it fits,
says so on one WARNING line when the wait begins and every interval (not on every retry), says
when the write went through, and stops on request.
"""

from __future__ import annotations

import errno
import logging
import os

import pytest

from rollout_bus.errors import DiskFullError, RolloutBusError, Stopped
from rollout_bus.model import files
from rollout_bus.model.files import wait_for_disk, write_atomic


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_leaves_nothing_behind_and_names_the_path_and_the_bytes(tmp_path, monkeypatch, code):
    def full(_fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(files.os, "fsync", full)
    target = tmp_path / "batch-00000003" / "dp-000.safetensors"
    target.parent.mkdir()
    with pytest.raises(DiskFullError) as caught:
        write_atomic(target, b"x" * 1234)
    assert isinstance(caught.value, OSError) and isinstance(caught.value, RolloutBusError)
    assert caught.value.errno == code and caught.value.needed == 1234 and caught.value.path == str(target)
    message = str(caught.value)
    assert "\n" not in message and str(target) in message and "1,234 bytes" in message and "free" in message
    assert list(target.parent.iterdir()) == []  # no target, no temporary file


def test_other_os_errors_are_not_a_full_disk(tmp_path, monkeypatch):
    def denied(_fd):
        raise PermissionError(errno.EACCES, "denied")

    monkeypatch.setattr(files.os, "fsync", denied)
    with pytest.raises(PermissionError):
        write_atomic(tmp_path / "f", b"data")
    assert list(tmp_path.iterdir()) == []


def test_the_wait_retries_until_the_write_fits_and_says_so_once_per_interval(caplog):
    attempts, slept = [], []

    def operation():
        attempts.append(1)
        if len(attempts) <= 25:  # full for 25 attempts: 25 intervals of 2 s
            raise DiskFullError("/out/batch-00000007/dp-001.safetensors", 5_000_000, 1_000)
        return "written"

    with caplog.at_level(logging.INFO, logger="rollout_bus.model.files"):
        assert wait_for_disk(operation, "batch 7 -> /out/batch-00000007", interval_s=2.0,
                             sleep=slept.append) == "written"
    assert len(attempts) == 26 and sum(slept) == pytest.approx(50.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all("waiting for disk space" in w and "batch 7" in w and "5,000,000 bytes" in w
                            for w in warnings)
    # one line when the wait begins, then one per interval at most: the clock here does not move, so one
    assert len(warnings) == 1
    assert any("disk space back" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_the_wait_stops_on_request_within_a_second(tmp_path):
    slept = []

    def operation():
        raise DiskFullError(tmp_path / "f", 10, 0)

    with pytest.raises(Stopped, match="disk space"):
        wait_for_disk(operation, "the checkpoint", should_stop=lambda: len(slept) >= 3, interval_s=10.0,
                      sleep=slept.append)
    assert len(slept) == 3 and all(s <= 1.0 for s in slept)


def test_errors_other_than_a_full_disk_pass_through_at_once():
    def operation():
        raise ValueError("not a disk problem")

    with pytest.raises(ValueError):
        wait_for_disk(operation, "x", sleep=lambda s: pytest.fail("must not wait"))
