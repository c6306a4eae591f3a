"""The trainer's end of the bus: one DP rank's shards, batch by batch in seq order, resumable.

A trainer should not poll a directory or keep its own bookkeeping of what it trained: it follows
rollout.shards, where the shard writer announces every batch it wrote (and says which seqs it
skipped, and when a run is over), and its own checkpoint holds the one number that matters.

Contract:

* ``ShardFeed(bootstrap_servers, *, rank, dp_size, shards_root=None, topic_prefix="", start=None,
  timeout_s=600, **kafka)`` reads rollout.shards with a group-less reader: it joins no consumer
  group and commits nothing, so any number of feeds (every rank, a shadow run, an evaluator) read
  the same batches independently. ``kafka`` are further connection settings (SASL/SSL).
* Iterating (or ``next_batch()``) yields ``TrainBatch``es in seq order from ``start`` (None: the
  lowest seq the topic holds). A seq the writer skipped (``control_records.BatchSkipped``: an empty or a
  dead-lettered batch) is passed over; a duplicate announcement is ignored. Iteration ends at the
  run's end (``control_records.BatchesEnded``: every seq below its ``next_seq`` is announced or skipped;
  a feed positioned exactly at a run's end, as after a checkpoint of its last batch, ends at
  once); iterating again follows the next run on the topic.
  Waiting longer than ``timeout_s`` for the next batch raises ``FeedTimeoutError`` naming the
  rank, the seq waited for and the last one seen: never a silent hang.
* The rank's shard is ``{shards_root}/{batch dir name}/{shard path}`` when ``shards_root`` is given
  (a trainer that mounts the output elsewhere), else under the writer's announced ``out_root``
  (``ShardAnnouncement.batch_dir``; announcements name batches relative to the output root).
  Its bytes must match the manifest's size and sha256, the manifest's ``dp_size`` the feed's: a
  missing, corrupted or mismatched shard raises ``ContractError`` naming batch, rank and path.
* ``TrainBatch``: ``seq``, ``rank``, ``dp_size``, ``path``, ``tensors`` (torch, as
  ``shards.load_shard`` maps them), ``samples()`` (per-sample views with their
  ``RolloutSamplingMask``), ``metrics`` (the batch metrics), ``weight_versions`` (the policy
  versions of the batch's samples) and the ``manifest``.
* Resumable: ``state_dict()`` is ``{"next_seq", "rank", "dp_size", "topic"}``; a trainer saves it
  with its checkpoint after training a batch, and ``load_state_dict`` in a new process starts the
  feed at ``next_seq``: no batch is lost and none is trained twice relative to the checkpoint.
  Loading a state of another rank, DP size or topic is a ``ConfigError``.
* ``publish_version(version, step)`` closes the loop: the trainer's new live weights go to
  rollout.weights (``feed.weights.WeightPublisher``), where generators read them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_bus.errors import ConfigError, ContractError, FeedTimeoutError, must_be
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.consumers.feed.weights import WeightPublisher
from rollout_bus.wire.control_records import BatchesEnded, BatchSkipped
from rollout_bus.wire.shard_announcement import ShardAnnouncement, parse_announcement
from rollout_bus.wire.weight_version import WeightVersion
from rollout_bus.wire.headers import CONTROL_BATCH_SKIPPED, CONTROL_END_OF_RUN, control_kind
from rollout_bus.model.shards import ShardSample, ShardView, load_shard, verify_shard
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)

POLL_MS = 500


@dataclass(frozen=True)
class TrainBatch:
    """One batch for one DP rank."""

    seq: int
    rank: int
    dp_size: int
    path: Path
    shard: ShardView = field(repr=False)
    manifest: dict[str, Any] = field(repr=False)

    @property
    def tensors(self) -> dict[str, Any]:
        return self.shard.tensors

    @property
    def metrics(self) -> dict[str, Any]:
        return dict(self.manifest.get("metrics") or {})

    @property
    def weight_versions(self) -> list[str]:
        return list((self.manifest.get("extra") or {}).get("weight_versions") or [])

    def samples(self) -> Iterator[ShardSample]:
        return self.shard.samples()

    def __len__(self) -> int:
        return len(self.shard)


class ShardFeed:
    """rollout.shards followed in seq order for one DP rank (see the module docstring)."""

    def __init__(self, bootstrap_servers: str, *, rank: int, dp_size: int, shards_root: str | Path | None = None,
                 topic_prefix: str = "", start: int | None = None, timeout_s: float = 600.0, **kafka: Any) -> None:
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ConfigError(must_be("dp_size", "an int >= 1", dp_size))
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dp_size:
            raise ConfigError(must_be("rank", f"an int in [0, {dp_size})", rank))
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
            raise ConfigError(must_be("start", "None or a batch seq >= 0", start))
        self.rank, self.dp_size, self.timeout_s = rank, dp_size, float(timeout_s)
        self.shards_root = Path(shards_root) if shards_root is not None else None
        self.topics = Topics(prefix=topic_prefix)
        self.topic = self.topics.shards
        self._publisher: WeightPublisher | None = None
        self._conn = {"bootstrap_servers": bootstrap_servers, **kafka}
        self._next: int | None = start
        self._reader: TopicReader | None = None
        self._pending: dict[int, ShardAnnouncement | BatchSkipped] = {}
        self._ends: set[int] = set()  # next_seq of every end of run read at or above the position
        self._last_seen: int | None = None

    # ------------------------------------------------------------------ position

    @property
    def next_seq(self) -> int | None:
        """The seq the feed yields next (None until the topic shows its first batch)."""
        return self._next

    def state_dict(self) -> dict[str, Any]:
        return {"next_seq": self._next, "rank": self.rank, "dp_size": self.dp_size, "topic": self.topic}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("rank", "dp_size", "topic"):
            if state.get(name) != getattr(self, name):
                raise ConfigError(must_be(f"feed state {name}", f"{getattr(self, name)!r} (this feed's)",
                                          state.get(name)))
        seq = state.get("next_seq")
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 0):
            raise ConfigError(must_be("feed state next_seq", "None or a batch seq >= 0", seq))
        self._next = seq
        self._pending = {s: item for s, item in self._pending.items() if seq is None or s >= seq}
        self._ends = {e for e in self._ends if seq is None or e >= seq}

    # ------------------------------------------------------------------ reading

    def __iter__(self) -> Iterator[TrainBatch]:
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            yield batch

    def next_batch(self, timeout_s: float | None = None,
                   on_wait: Callable[[float], None] | None = None) -> TrainBatch | None:
        """The next batch of this rank; None once the run is over; ``FeedTimeoutError`` after
        ``timeout_s`` (default: the feed's) without it. ``on_wait(waited_s)`` before each poll of the topic
        while the batch is not there yet (a trainer says it is starved even while it waits)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self._reader is None:
            self._reader = TopicReader(self._conn, [self.topic])
            self._fold(self._reader.read_to_end(timeout_s=max(timeout, 30.0))[self.topic])
        deadline = time.monotonic() + timeout
        while True:
            if self._next is None and self._pending:
                self._next = min(self._pending)
            end = min((e for e in self._ends if self._next is None or e >= self._next), default=None)
            if end is not None and (self._next is None or self._next >= end):
                self._ends = {e for e in self._ends if e > end}  # iterating again follows the next run
                return None
            if self._next is not None and self._next in self._pending:
                item = self._pending.pop(self._next)
                self._next += 1
                if isinstance(item, ShardAnnouncement):
                    return self._load(item)
                logger.info("batch=%d skipped by the writer (%s): %s", item.seq, item.why, item.reason)
                continue
            if end is not None:  # the run is over and this seq never came: nothing will
                logger.warning("batch=%d was neither announced nor skipped before the end of run: passing over it",
                               self._next)
                self._next += 1
                continue
            if time.monotonic() > deadline:
                raise FeedTimeoutError(f"rank {self.rank}: no batch {self._next if self._next is not None else '(any)'} "
                                       f"on {self.topic} within {timeout:.0f}s (last seq seen: {self._last_seen}); "
                                       "is the shard writer running?")
            if on_wait is not None:
                on_wait(time.monotonic() - (deadline - timeout))
            self._fold(self._reader.poll(timeout_ms=POLL_MS)[self.topic])

    def _fold(self, records: list[Any]) -> None:
        """Announcements and skips at or above the position into ``_pending``; ends noted."""
        for record in records:
            control = control_kind(record.headers)
            try:
                if control is None:
                    item: ShardAnnouncement | BatchSkipped | None = parse_announcement(record.value)
                elif control == CONTROL_BATCH_SKIPPED:
                    item = BatchSkipped.from_value(record.value)
                elif control == CONTROL_END_OF_RUN:
                    ended = BatchesEnded.from_value(record.value)
                    if self._next is None or ended.next_seq >= self._next:
                        self._ends.add(ended.next_seq)
                    continue
                else:
                    item = None
            except ContractError as exc:
                logger.warning("skipped a record of %s at offset %d: %s", self.topic, record.offset, exc)
                continue
            if item is None:
                continue
            seq = item.seq
            self._last_seen = seq if self._last_seen is None else max(self._last_seen, seq)
            if self._next is None or seq >= self._next:
                self._pending.setdefault(seq, item)  # a re-announcement of a seq is the same batch

    def _load(self, announced: ShardAnnouncement) -> TrainBatch:
        """This rank's shard of an announced batch, checked against the manifest."""
        manifest, seq = announced.manifest, announced.seq
        if manifest.get("dp_size") != self.dp_size:
            raise ContractError(must_be(f"batch {seq} dp_size", f"{self.dp_size} (this feed's)",
                                        manifest.get("dp_size"), where=announced.manifest_path))
        entry = next((e for e in manifest["shards"] if isinstance(e, dict) and e.get("rank") == self.rank), None)
        if entry is None:
            raise ContractError(f"batch {seq} names no shard for rank {self.rank} ({announced.manifest_path})")
        directory = announced.batch_dir(self.shards_root)
        path = directory / str(entry.get("path"))
        verify_shard(path, entry, f"batch {seq} rank {self.rank} at {path}")
        return TrainBatch(seq, self.rank, self.dp_size, path, load_shard(path), manifest)

    # ------------------------------------------------------------------ the loop back to the generators

    def publish_version(self, version: int, step: int, *, uri: str | None = None, sha256: str | None = None,
                        size: int | None = None) -> WeightVersion:
        """Say on rollout.weights that the trainer's weights at ``version`` are live, after optimizer
        step ``step`` (after training batch k: version k + 1, step k). One rank publishes."""
        if self._publisher is None:
            self._publisher = WeightPublisher(self._conn, self.topics)
        return self._publisher.publish(version, step, uri=uri, sha256=sha256, size=size)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None

    def __enter__(self) -> "ShardFeed":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()
