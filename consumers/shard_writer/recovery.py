"""The shard writer's start-up recovery: what a killed writer left in ``--out``, and what rollout.shards says.

Why a step of its own, before the loop reads a record: a writer may be killed anywhere (between two
shards, between a manifest and its announcement). The restarted one must produce byte-identical
output, as if it had never stopped, and never announce a batch twice; both are decided here, once,
from the disk and the log alone, so the loop (``rollout_bus.consumers.shard_writer.writer``) only writes new batches.

Contract:

* ``recover(out_dir, batcher, read_announced=, announce=, counts=, topic=None)``:

  1. finds the complete batches on disk (``out_dir.scan_out_dir``: every manifest verified); with
     ``topic`` (the writer's rollout.episodes), a batch whose manifest's sources name another topic is
     another run's: ``ConfigError`` naming the directory, the batch and both topics, before anything
     is marked or announced (adopting it would announce another run's batches on this run's topic);
     temporary files and batches without a manifest are removed, their episodes being still
     uncommitted on rollout.episodes;
  2. when there is any, asks ``read_announced()`` which (batch name, manifest_sha256) pairs
     rollout.shards holds (a moved output directory changes neither);
  3. marks each batch on disk written (``Batcher.mark_written``: the keys of its episodes, abandoned
     and stale episodes, and its groups), so a record of it read again is a duplicate and the batch
     is never written twice; what is in no batch on disk is re-read from the committed offsets and,
     in step mode, forms the same batches, byte for byte;
  4. announces each batch on disk that rollout.shards never saw (killed between its manifest and its
     announcement) with ``announce(seq, manifest, directory)``, and no other.

  ``counts.batches_found`` and ``counts.batches_reannounced`` grow as it goes; it returns the batches
  found.
* ``announced_on(conn, topic, retry)``: the pairs of every announcement on ``topic``, read to its end
  with a group-less reader (``rollout_bus.kafka.reader.read_topic``). The writer's ``retry``
  (``rollout_bus.kafka.retry.retrying``) repeats the whole read, with a fresh reader, through broker
  outages of any length: ``read_to_end(stall_s=STALL_S)`` bounds each offset request and turns
  ``STALL_S`` without a record before the end into a transient ``Unavailable``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from rollout_bus.errors import ConfigError
from rollout_bus.kafka.reader import read_topic
from rollout_bus.consumers.shard_writer.batcher import Batcher
from rollout_bus.consumers.shard_writer.out_dir import WrittenBatch, announced_ids, manifest_topics, scan_out_dir

logger = logging.getLogger(__name__)

T = TypeVar("T")
STALL_S = 10.0
Announced = set[tuple[str, str]]  # (batch directory name, manifest_sha256)
Retry = Callable[[Callable[[], T], str], T]


class RecoveryCounts(Protocol):
    batches_found: int
    batches_reannounced: int


def announced_on(conn: Mapping[str, Any], topic: str, retry: Retry) -> Announced:
    """(batch name, manifest_sha256) of every announcement on ``topic``, through broker outages."""
    records = retry(lambda: read_topic(conn, topic, stall_s=STALL_S), "read announcements from rollout.shards")
    return announced_ids(record.value for record in records)


def _foreign(written: list[WrittenBatch], topic: str) -> tuple[int, list[str]] | None:
    """The first batch on disk whose episodes came from another topic than ``topic``, and its topics."""
    for batch in written:
        topics = manifest_topics(batch.manifest)
        if topics and topics != [topic]:
            return batch.seq, topics
    return None


def recover(out_dir: Path, batcher: Batcher, *, read_announced: Callable[[], Announced],
            announce: Callable[[int, dict[str, Any], Path], None], counts: RecoveryCounts,
            topic: str | None = None) -> list[WrittenBatch]:
    """Mark the batches on disk written; announce the ones rollout.shards never saw (see the module docstring)."""
    written = scan_out_dir(out_dir)
    foreign = _foreign(written, topic) if topic is not None else None
    if foreign is not None:
        seq, topics = foreign
        raise ConfigError(f"--out {out_dir} holds batches of another run: batch {seq}'s episodes came from "
                          f"{', '.join(topics)}, this writer reads {topic}; give this run an output directory "
                          "of its own")
    announced = read_announced() if written else set()
    for batch in written:
        batcher.mark_written(batch.seq, batch.keys(), batch.groups())
        counts.batches_found += 1
        if (batch.directory.name, batch.manifest_sha256) not in announced:
            announce(batch.seq, batch.manifest, batch.directory)
            counts.batches_reannounced += 1
            logger.info("announced batch=%d found on disk but never announced", batch.seq)
    logger.info("resumed out=%s batches_on_disk=%d", out_dir, len(written))
    return written
