"""One shard writer per output directory: a second is refused naming the holder; a killed holder's lock is gone."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from rollout_bus.errors import ConfigError
from rollout_bus.consumers.shard_writer.writer_lock import LOCK_NAME, WriterLockedError, hold_writer_lock, lock_holder


def test_a_second_writer_is_refused_naming_the_first_and_admitted_once_it_is_gone(tmp_path):
    with hold_writer_lock(tmp_path, {"group": "run1.rollout-bus-shards"}):
        assert lock_holder(tmp_path)["group"] == "run1.rollout-bus-shards"
        with pytest.raises(WriterLockedError, match=r"another shard writer .*group=run1.rollout-bus-shards.*pid="):
            with hold_writer_lock(tmp_path, {"group": "second"}):
                pass
    with hold_writer_lock(tmp_path, {"group": "second"}):  # released when the block ends
        assert lock_holder(tmp_path)["group"] == "second"


def test_a_writer_killed_with_sigkill_leaves_no_lock_behind(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from rollout_bus.consumers.shard_writer.writer_lock import hold_writer_lock
        with hold_writer_lock({str(tmp_path)!r}, {{"group": "killed"}}):
            print("held", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WriterLockedError, match="group=killed"):
            with hold_writer_lock(tmp_path, {}):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (tmp_path / LOCK_NAME).exists()  # the file stays; the lock went with the process
    with hold_writer_lock(tmp_path, {"group": "next"}):
        assert lock_holder(tmp_path)["group"] == "next"


def test_an_output_directory_that_cannot_be_written_is_refused_in_one_line_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    out = blocker / "shards"
    with pytest.raises(ConfigError, match=rf"cannot write to the output directory {out}: Not a directory "
                                          r"\(--out must be a directory this process can write\)"):
        with hold_writer_lock(out, {}):
            pass
