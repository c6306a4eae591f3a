"""A group the end-of-run flush writes short is never short in silence: a WARNING line names it, its batch
and how many episodes it lacks, and it is counted; a group completed by an ``abandoned`` record is not short."""

from __future__ import annotations

import logging

import pytest

from rollout_bus.consumers.shard_writer.batcher import Batcher
from rollout_bus.wire.run_record import RunBatching
from tests.unit.consumers.shard_writer.test_batcher import abandoned, episode, feed


@pytest.mark.parametrize("mode", ["step", "arrival"])
def test_a_group_flushed_short_is_warned_of_by_name_and_counted(mode, caplog):
    batcher = Batcher(RunBatching(2, mode))
    caplog.set_level(logging.WARNING, logger="rollout_bus.consumers.shard_writer")
    feed(batcher, [episode(0, 0, group_size=4), episode(0, 1, group_size=4), episode(0, 2, group_size=4),
                   episode(1, 0), episode(1, 1)])
    assert batcher.incomplete_groups == 0 and caplog.records == []  # nothing is short before the run ends
    [batch] = batcher.flush()
    assert [(g.group_index, g.complete) for g in batch.groups] == [(0, False), (1, True)]
    assert batcher.incomplete_groups == 1
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "group_index=0" in line and f"batch {batch.seq}" in line and "lacks 1 of its 4 episodes" in line


def test_a_group_completed_by_an_abandoned_record_is_not_short():
    batcher = Batcher(RunBatching(1, "step"))
    feed(batcher, [episode(0, 0), abandoned(0, 1, offset=1)])
    assert batcher.flush() == [] and batcher.incomplete_groups == 0
    feed(batcher, [episode(1, 0)])
    batcher.flush()
    assert batcher.incomplete_groups == 1
