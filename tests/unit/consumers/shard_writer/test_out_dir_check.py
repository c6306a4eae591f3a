"""``out_dir.check_out_dir``: what the writer would refuse, said before anything is created or written."""

from __future__ import annotations

import fcntl
import os

import pytest

from rollout_bus.consumers.shard_writer.out_dir import check_out_dir
from rollout_bus.consumers.shard_writer.writer_lock import (LOCK_NAME, WriterLockedError, held_by_another,
                                                            hold_writer_lock, unwritable)
from rollout_bus.errors import ConfigError
from tests.unit.consumers.shard_writer.test_recovery import write_batches


def _tree(root):
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*"))


def test_a_fresh_or_empty_directory_passes_and_nothing_is_created(tmp_path):
    check_out_dir(tmp_path / "new" / "out", "run7.rollout.episodes")
    check_out_dir(tmp_path, "run7.rollout.episodes")
    assert list(tmp_path.iterdir()) == []


def test_a_file_or_a_file_on_the_way_is_refused_in_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"it is a file, not a directory \(--out must be"):
        check_out_dir(tmp_path / "f")
    with pytest.raises(ConfigError, match=r"f is a file, not a directory"):
        check_out_dir(tmp_path / "f" / "sub")
    assert unwritable(tmp_path / "f", "--data-dir").endswith("(--data-dir must be a directory this process can write)")


def test_a_read_only_directory_is_refused_before_it_is_made(tmp_path, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) and mode & os.W_OK
                        else real(p, mode))  # as root, chmod does not make a directory read-only
    with pytest.raises(ConfigError, match="read-only for this process"):
        check_out_dir(tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_a_chmod_read_only_directory_is_refused(tmp_path):
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="it is read-only"):
            check_out_dir(tmp_path)
    finally:
        tmp_path.chmod(0o755)


def test_a_directory_another_writer_holds_is_refused_naming_it_and_its_lock_is_left_as_it_was(tmp_path):
    with hold_writer_lock(tmp_path, {"group": "g1"}):
        before = (tmp_path / LOCK_NAME).read_bytes()
        with pytest.raises(WriterLockedError, match="another shard writer is writing to .*group=g1"):
            check_out_dir(tmp_path, "rollout.episodes")
        assert (tmp_path / LOCK_NAME).read_bytes() == before
    assert held_by_another(tmp_path) is None  # released: a lock file alone holds nothing


def test_the_probe_takes_no_lock_a_writer_then_needs(tmp_path):
    (tmp_path / LOCK_NAME).write_text("{}")
    assert held_by_another(tmp_path) is None
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # would raise if the probe had kept it
    finally:
        os.close(fd)


def test_another_runs_batches_are_refused_without_touching_them(tmp_path):
    write_batches(tmp_path, [0, 1])  # read from rollout.episodes (no prefix)
    (tmp_path / "batch-00000001" / ".dp-0.safetensors.tmp").write_text("left by a killed writer")
    before = _tree(tmp_path)
    with pytest.raises(ConfigError, match=r"--out .* holds batches of another run: batch-00000000's episodes came "
                                          r"from rollout\.episodes, this writer reads run7\.rollout\.episodes"):
        check_out_dir(tmp_path, "run7.rollout.episodes")
    assert _tree(tmp_path) == before
    check_out_dir(tmp_path, "rollout.episodes")  # its own run's writer resumes there
    assert _tree(tmp_path) == before
