"""The feed's ordering rules on rollout.shards, with a stand-in reader: seq order whatever the log
order, skips passed over, duplicates ignored, the end of a run ends the iteration."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rollout_bus.consumers.feed.trainer_feed import ShardFeed
from rollout_bus.errors import FeedTimeoutError
from rollout_bus.wire.control_records import END_OF_RUN_KEY, BatchesEnded, BatchSkipped
from rollout_bus.wire.shard_announcement import ShardAnnouncement, announcement_value

TOPIC = "rollout.shards"


@dataclass
class _Record:
    key: bytes
    value: bytes
    headers: list = field(default_factory=list)
    offset: int = 0


def announced(seq: int) -> _Record:
    manifest = {"seq": seq, "shards": [], "dp_size": 1, "batch": f"batch-{seq:08d}"}
    return _Record(str(seq).encode(), announcement_value(ShardAnnouncement(manifest, f"/out/batch-{seq:08d}",
                                                                           "/m", "00")))


def skipped(seq: int) -> _Record:
    item = BatchSkipped(seq, "empty", "every group abandoned")
    return _Record(item.key(), item.value(), item.headers())


def ended(next_seq: int) -> _Record:
    item = BatchesEnded("run-1", next_seq)
    return _Record(END_OF_RUN_KEY, item.value(), item.headers())


class _Reader:
    """What a TopicReader would hand over: the backlog first, then one list per poll."""

    def __init__(self, backlog, *polls):
        self.backlog, self.polls = list(backlog), [list(p) for p in polls]

    def read_to_end(self, timeout_s):
        return {TOPIC: self.backlog}

    def poll(self, timeout_ms):
        return {TOPIC: self.polls.pop(0) if self.polls else []}

    def close(self):
        pass


def _seqs(backlog, *polls, start=None, timeout_s=0.5):
    feed = ShardFeed("unused:1", rank=0, dp_size=1, start=start, timeout_s=timeout_s)
    feed._reader = _Reader(backlog, *polls)
    feed._load = lambda item: item.seq  # the shard files are another test's business
    feed._fold(feed._reader.read_to_end(timeout_s)[TOPIC])
    out = []
    while (batch := feed.next_batch()) is not None:
        out.append(batch)
    return out, feed


def test_batches_come_in_seq_order_skips_passed_over_duplicates_ignored_until_the_end():
    seqs, feed = _seqs([announced(1), announced(0), skipped(2), announced(1)], [announced(4), announced(3)],
                       [ended(5)])
    assert seqs == [0, 1, 3, 4] and feed.state_dict()["next_seq"] == 5


def test_a_start_position_skips_what_is_below_it_and_a_missing_seq_before_the_end_is_passed_over():
    seqs, _ = _seqs([announced(0), announced(1), announced(3), ended(4)], start=1)
    assert seqs == [1, 3]


def test_an_older_runs_end_does_not_end_a_feed_positioned_past_it_and_iterating_again_follows_the_next_run():
    seqs, _ = _seqs([announced(0), ended(1), announced(1), announced(2), ended(3)], start=2)
    assert seqs == [2]
    seqs, feed = _seqs([announced(0), ended(1), announced(1), announced(2), ended(3)], start=1)
    assert seqs == []  # positioned exactly at run 1's end (a checkpoint of its last batch)
    assert list(feed) == [1, 2]


def test_waiting_past_the_timeout_names_the_seq_waited_for_and_the_last_seen():
    feed = ShardFeed("unused:1", rank=0, dp_size=1, timeout_s=0.2)
    feed._reader = _Reader([announced(0), announced(2)])
    feed._load = lambda item: item.seq
    feed._fold(feed._reader.read_to_end(1)[TOPIC])
    assert feed.next_batch() == 0
    with pytest.raises(FeedTimeoutError, match=r"rank 0: no batch 1 on rollout.shards within 0s \(last seq seen: 2\)"):
        feed.next_batch()


def test_a_feed_started_with_its_run_waits_for_seq_0_when_batch_1_is_written_first():
    # step batching from a prompt queue: batch 1's groups may all finish before batch 0's
    seqs, _ = _seqs([announced(1)], [announced(0)], [ended(2)], start=0)
    assert seqs == [0, 1]
    seqs, _ = _seqs([announced(1)], [announced(0)], [ended(2)])  # the lowest the topic held when it started
    assert seqs == [1]


def test_the_trainers_take_a_start_seq_for_their_feeds():
    from rollout_bus.consumers.feed.loop import FeedOptions, open_feeds

    feeds = open_feeds(FeedOptions("unused:1", checkpoint_dir=None, ranks=[0, 1], dp_size=2, start_seq=0))
    assert [feed.next_seq for feed in feeds.values()] == [0, 0]
