"""The shard writer's Kafka loop: rollout.episodes in; shards, manifests, batch metrics and dead letters out.

Contract (PIPELINE.md, consumers/):

* Reads every partition of rollout.episodes with a kafka-python ``KafkaConsumer`` (manually
  assigned, ``enable_auto_commit=False``; the group id only stores offsets, so run one writer per
  group id: groups span partitions). Each record goes through ``consumers.batcher``.
* A record that does not decode, or that the batcher rejects, goes to rollout.dlq
  (``DeadLetter``, stage ``shards``) and the loop goes on. Duplicates are dropped and counted.
* A due batch is converted with ``convert_samples_to_train_data``. If that fails (the whole-batch
  sampling-mask check, or any other contract check), every episode of the batch goes to the DLQ,
  one dead letter each, with the original record, the error (position, sample_index, status) and
  that episode's batch positions; the loop goes on with the next batch.
* A batch that passes is split across ``dp_size`` ranks and written with ``write_batch_shards``
  (shards, then ``manifest.json``, each atomic). Then the batch metrics record goes to
  rollout.metrics and is flushed, then the manifest (``out_dir.announcement``) to rollout.shards,
  key the batch seq, flushed (acks=all). Only then are offsets committed: per partition, the first
  offset of an episode not yet in a written or dead-lettered batch.
* Effectively once. At start-up the writer scans ``--out`` (``out_dir.scan_out_dir``: temporary
  files and manifest-less batches removed), reads rollout.shards back, and announces each
  complete batch on disk that was never announced (a kill between manifest and announcement).
  Episodes of a batch on disk count as written, so a batch is never written twice; anything not
  in one is re-read from the committed offsets, and in step mode forms the same batch, byte for
  byte. A kill between the two announcements can leave a second batch-metrics record (the
  manifest on rollout.shards is never doubled).
* Stopping: ``idle_flush_s`` (no new record for that long and caught up with the topic) flushes
  pending episodes as partial batches; ``exit_when_idle`` returns once idle (after that flush,
  when one is configured; else after ``DEFAULT_IDLE_S``) and ``max_batches`` after that many
  batches written by this process. SIGTERM stops the loop at the next iteration.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.structs import OffsetAndMetadata

from consumers.batcher import Batch, Batcher, Outcome, parse_episode
from consumers.out_dir import (WrittenBatch, announced_ids, announcement, convert_batch, scan_out_dir,
                               write_batch)
from rollout_bus.dead_letter import DeadLetter, source_of
from rollout_bus.errors import BrokerError, ContractError, MaskCheckError
from rollout_bus.records import batch_metrics_record
from rollout_bus.topics import Topics
from rollout_bus.train_data import MANIFEST_NAME, batch_path

logger = logging.getLogger(__name__)

STAGE = "shards"
DEFAULT_IDLE_S = 10.0
POLL_TIMEOUT_MS = 200
PARTITION_WAIT_S = 30.0


@dataclass
class WriterStats:
    """What the writer did, for progress lines and the exit summary."""

    records: int = 0
    episodes: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    batches_written: int = 0
    batches_dead_lettered: int = 0
    batches_found: int = 0
    batches_reannounced: int = 0
    pending: int = 0
    last_batch: int | None = None
    written_dirs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class WriterOptions:
    """Plain values the CLI hands the writer."""

    out_dir: Path
    dp_size: int
    groups_per_batch: int
    batching: str = "step"
    group_id: str = "rollout-bus-shards"
    normalization: str = "grpo"
    idle_flush_s: float | None = None
    exit_when_idle: bool = False
    max_batches: int | None = None


class ShardWriter:
    """One writer process; ``run()`` until told to stop (see the module docstring)."""

    def __init__(self, client_kwargs: dict[str, Any], topics: Topics, options: WriterOptions,
                 on_progress: Callable[[WriterStats], None] | None = None) -> None:
        self.client_kwargs = dict(client_kwargs)
        self.topics = topics
        self.options = options
        self.stats = WriterStats()
        self._on_progress = on_progress or (lambda stats: None)
        self._batcher = Batcher(options.groups_per_batch, options.batching)
        self._committed: dict[int, int] = {}
        self._stop = False
        self._producer: KafkaProducer | None = None
        self._consumer: KafkaConsumer | None = None

    # ------------------------------------------------------------------ lifecycle

    def stop(self, *_: Any) -> None:
        self._stop = True

    def run(self) -> WriterStats:
        try:
            signal.signal(signal.SIGTERM, self.stop)
        except ValueError:  # not the main thread: the caller stops us
            pass
        self._producer = KafkaProducer(acks="all", enable_idempotence=True, linger_ms=5, **self.client_kwargs)
        try:
            self._resume_from_disk()
            self._consumer = self._open_consumer()
            self._loop()
        finally:
            if self._consumer is not None:
                self._consumer.close(autocommit=False)
            self._producer.close()
        return self.stats

    def _resume_from_disk(self) -> None:
        """Mark batches on disk written; announce the ones rollout.shards never saw."""
        written = scan_out_dir(self.options.out_dir)
        announced = announced_ids(self._read_announcements()) if written else set()
        for batch in written:
            self._batcher.mark_written(batch.seq, batch.episodes(), batch.groups())
            self.stats.batches_found += 1
            if (str(batch.directory.resolve()), batch.manifest_sha256) not in announced:
                self._announce(batch.seq, batch.manifest, batch.directory)
                self.stats.batches_reannounced += 1
                logger.info("announced batch=%d found on disk but never announced", batch.seq)
        logger.info("resumed out=%s batches_on_disk=%d", self.options.out_dir, len(written))

    def _read_announcements(self) -> list[bytes | None]:
        consumer = KafkaConsumer(enable_auto_commit=False, **self.client_kwargs)
        try:
            partitions = self._partitions(consumer, self.topics.shards)
            consumer.assign(partitions)
            consumer.seek_to_beginning(*partitions)
            ends = consumer.end_offsets(partitions)
            values: list[bytes | None] = []
            while any(consumer.position(tp) < end for tp, end in ends.items()):
                for records in consumer.poll(timeout_ms=500).values():
                    values.extend(r.value for r in records)
            return values
        finally:
            consumer.close()

    @staticmethod
    def _partitions(consumer: KafkaConsumer, topic: str) -> list[TopicPartition]:
        deadline = time.monotonic() + PARTITION_WAIT_S
        while True:
            found = consumer.partitions_for_topic(topic)
            if found:
                return [TopicPartition(topic, p) for p in sorted(found)]
            if time.monotonic() > deadline:
                raise BrokerError(f"topic {topic!r} has no partitions after {PARTITION_WAIT_S:.0f}s: create it first")
            time.sleep(0.5)

    def _open_consumer(self) -> KafkaConsumer:
        consumer = KafkaConsumer(group_id=self.options.group_id, enable_auto_commit=False,
                                 auto_offset_reset="earliest", max_poll_records=500, **self.client_kwargs)
        partitions = self._partitions(consumer, self.topics.episodes)
        consumer.assign(partitions)
        for tp in partitions:  # resolves committed offsets (or earliest) before the idle clock starts
            logger.info("reading topic=%s partition=%d offset=%d", tp.topic, tp.partition, consumer.position(tp))
        return consumer

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        opts = self.options
        idle_s = opts.idle_flush_s if opts.idle_flush_s is not None else DEFAULT_IDLE_S
        last_record = time.monotonic()
        while not self._stop:
            polled = self._consumer.poll(timeout_ms=POLL_TIMEOUT_MS)
            for records in polled.values():
                for record in records:
                    self._take(record)
            now = time.monotonic()
            if polled:
                last_record = now
            self._write_all(self._batcher.ready())
            idle = now - last_record >= idle_s and self._caught_up()
            if idle and opts.idle_flush_s is not None and self._batcher.pending_episodes:
                logger.info("idle for %.1fs: flushing pending=%d", now - last_record, self._batcher.pending_episodes)
                self._write_all(self._batcher.flush())
            self._checkpoint()
            self.stats.pending = self._batcher.pending_episodes
            self._on_progress(self.stats)
            if self._reached_max():
                logger.info("wrote max_batches=%d: stopping", opts.max_batches)
                return
            if idle and opts.exit_when_idle:
                if self._batcher.pending_episodes:
                    logger.warning("exiting idle with pending=%d episodes left uncommitted",
                                   self._batcher.pending_episodes)
                return

    def _caught_up(self) -> bool:
        partitions = list(self._consumer.assignment())
        ends = self._consumer.end_offsets(partitions)
        return all(self._consumer.position(tp) >= end for tp, end in ends.items())

    def _take(self, record: Any) -> None:
        """One rollout.episodes record into the batcher, or into the DLQ."""
        self.stats.records += 1
        try:
            episode = parse_episode(record.key, record.value, record.headers,
                                    partition=record.partition, offset=record.offset)
        except ContractError as exc:
            self._batcher.skip(record.partition, record.offset)
            self._dead_letter(record.key, record.value, record.headers, record.partition, record.offset,
                              f"episode record does not decode: {exc}", "decode")
            return
        result = self._batcher.add(episode)
        if result.outcome is Outcome.ACCEPTED:
            self.stats.episodes += 1
        elif result.outcome is Outcome.REPLACED:
            pass  # the same episode, a later attempt: counted once
        elif result.outcome is Outcome.REJECTED:
            self._dead_letter(record.key, record.value, record.headers, record.partition, record.offset,
                              result.reason, result.kind)
        else:
            self.stats.duplicates += 1
            logger.debug("dropped %s key=%s attempt=%d", result.outcome.value, episode.key, episode.attempt)

    def _dead_letter(self, key: Any, value: Any, headers: Any, partition: int, offset: int, reason: str,
                     kind: str) -> None:
        letter = DeadLetter(key, value, list(headers or []), reason, STAGE, kind,
                            source_of(self.topics.episodes, partition, offset))
        self._producer.send(self.topics.dlq, key=letter.key, value=letter.value, headers=letter.record_headers())
        self.stats.dead_letters += 1
        logger.warning("dead-lettered kind=%s partition=%d offset=%d reason=%s", kind, partition, offset, reason)

    # ------------------------------------------------------------------ batches

    def _write_all(self, batches: list[Batch]) -> None:
        """Write in order; past ``max_batches`` the rest stay uncommitted for the next run."""
        for batch in batches:
            if self._reached_max():
                return
            self._write(batch)
            self._checkpoint()

    def _reached_max(self) -> bool:
        return self.options.max_batches is not None and self.stats.batches_written >= self.options.max_batches

    def _write(self, batch: Batch) -> None:
        """Check, convert, split and write one batch, then announce it; failures go to the DLQ."""
        try:
            samples, ranks = convert_batch(batch, dp_size=self.options.dp_size,
                                           normalization=self.options.normalization)
        except ContractError as exc:
            self._dead_letter_batch(batch, exc)
            return
        manifest = write_batch(self.options.out_dir, batch, samples, ranks, topic=self.topics.episodes,
                               batching=self.options.batching, normalization=self.options.normalization)
        directory = batch_path(self.options.out_dir, batch.seq)
        self._announce(batch.seq, manifest, directory)
        self._batcher.done(batch)
        self.stats.batches_written += 1
        self.stats.last_batch = batch.seq
        self.stats.written_dirs.append(str(directory))

    def _dead_letter_batch(self, batch: Batch, exc: ContractError) -> None:
        """Every episode of a rejected batch is findable in the DLQ with the batch's reason."""
        kind = "mask-check" if isinstance(exc, MaskCheckError) else "convert"
        position = 0
        for episode in batch.episodes:
            span = f"{position}..{position + len(episode.segments) - 1}"
            reason = (f"batch {batch.seq} ({len(batch.episodes)} episodes) failed the whole-batch check: {exc}; "
                      f"this episode ({episode.key}, attempt {episode.attempt}) held batch positions {span}")
            self._dead_letter(episode.key.encode(), episode.value, episode.headers, episode.partition,
                              episode.offset, reason, kind)
            position += len(episode.segments)
        self._producer.flush()
        self._batcher.done(batch)
        self.stats.batches_dead_lettered += 1

    def _announce(self, seq: int, manifest: dict[str, Any], directory: Path) -> None:
        """Batch metrics, then the manifest, each flushed: a manifest on rollout.shards implies both."""
        key = str(seq).encode()
        manifest_path = str(Path(directory).resolve() / MANIFEST_NAME)
        metrics_value = batch_metrics_record(seq, manifest["metrics"], samples=int(manifest["num_samples"]),
                                             manifest_path=manifest_path)
        self._producer.send(self.topics.metrics, key=key, value=metrics_value)
        self._producer.flush()
        self._producer.send(self.topics.shards, key=key, value=announcement(manifest, Path(directory)))
        self._producer.flush()

    def _checkpoint(self) -> None:
        """Commit what may be committed; the producer is flushed first, so no dead letter is lost."""
        positions = self._batcher.commit_offsets()
        changed = {p: o for p, o in positions.items() if self._committed.get(p) != o}
        if not changed:
            return
        self._producer.flush()
        self._consumer.commit({TopicPartition(self.topics.episodes, p): OffsetAndMetadata(o, "", -1)
                               for p, o in changed.items()})
        self._committed.update(changed)
        logger.debug("committed %s", changed)
