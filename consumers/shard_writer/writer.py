"""The shard writer's Kafka loop: rollout.episodes in; shards, manifests, batch metrics and dead letters out.

Contract (docs/pipeline.md sections 4, 5 and 8):

* Reads every partition of rollout.episodes with a kafka-python ``KafkaConsumer`` (manually
  assigned, ``enable_auto_commit=False``; the group id only stores offsets, so run one writer per
  group id: groups span partitions). Each record is parsed (``rollout_bus.consumers.shard_writer.episodes.parse_record``)
  into an episode, an abandoned episode or an end-of-run marker; episodes and abandoned episodes
  go through ``rollout_bus.consumers.shard_writer.batcher``.
* Batch boundaries depend only on the log, never on a clock. A step batch is written when every
  group of its range is complete, where an ``abandoned`` record counts its episode as present:
  the batch is written without the abandoned episodes and its manifest lists them, so a replay or
  a restart reaches the same decision, byte for byte. A batch whose groups are all abandoned is
  not written (logged, offsets released); its seq is absent from the output.
* The final partial batch closes on the end-of-run markers (``rollout_bus.consumers.shard_writer.end_of_run``): once every
  rollout.episodes partition has carried the marker of every turns partition of a run, everything
  pending is flushed as partial batches (``Batcher.flush``; episode-less ones skipped). Markers
  are held uncommitted until that flush is written, so a crash before it re-reads them; a
  duplicate marker is harmless.
* A record that does not decode, or that the batcher rejects, goes to rollout.dlq and the loop
  goes on (``rollout_bus.consumers.shard_writer.dead_letters``: by reference when too large; never fatal).
  Duplicates are dropped and counted.
* A due batch is decided by ``rollout_bus.consumers.shard_writer.decide``, as replay decides it: the staleness
  net (``max_staleness``, step batching; its stale episodes to the DLQ, counted in
  ``WriterStats.stale``), skipped as empty when no episode is left, dead-lettered (every episode, with
  its batch positions) when the conversion or the whole-batch mask check refuses it, else split across
  ``dp_size`` ranks. Arrival batching has no net (``rollout_bus.consumers.shard_writer.staleness``); the bound is then
  ignored, with a warning. The loop goes on with the next batch.
* A batch to write is written with ``write_batch_shards`` (shards, then ``manifest.json``, each
  atomic; its metrics carry ``staleness/{mean,max,oldest}`` with step = the batch seq in both
  modes: ``out_dir.batch_metrics``). Then the batch metrics record (those metrics plus the batch's
  flow metrics, ``rollout_bus.consumers.shard_writer.flow``) goes to rollout.metrics and is confirmed, then the
  manifest (``out_dir.announcement``) to rollout.shards,
  key the batch seq, confirmed (acks=all). Only then are offsets committed: per partition, the
  first offset of a record not yet in a written, dead-lettered or skipped batch (or flush). The
  batches due at one turn of the loop are said together (``_write_all``, then
  ``rollout_bus.consumers.shard_writer.announce``): their files first, then every metrics record in
  one confirmed round trip, every announcement or skip in seq order in a second, one commit: three
  round trips per turn of the loop, not three per batch.
* A seq that will never be written (an empty or a dead-lettered batch) is said so on
  rollout.shards (``control_records.BatchSkipped``, key the seq), and once a run's last batch is written a
  ``control_records.BatchesEnded`` (every seq below its ``next_seq`` announced or skipped) follows, so a
  trainer following the batches in order never waits for one that cannot come.
* Every send is confirmed before offsets are committed past it (``rollout_bus.consumers.shard_writer.delivery``): a send
  that failed is sent again, so a manifest may appear twice on rollout.shards (readers dedupe by
  the batch seq key), a batch-metrics record or a dead letter twice on theirs; nothing is lost.
* A full disk is waited out like an outage (``rollout_bus.model.files.wait_for_disk``): a batch whose
  files do not fit is written again until they do, a WARNING line (batch, path, bytes needed and free)
  every 10 s, counted in ``WriterStats.disk_waits``; nothing of it is announced or committed before.
* Records deleted before the writer read them (a retention shorter than its delay, or deleted by hand)
  are never skipped in silence: at start-up the group's committed offset (0 if none) is compared with
  where the consumer lands, and while reading each record's offset with the one expected next; offsets
  below the partition's log start in between go to the DLQ as one ``lost`` letter per range, with an
  ERROR line, counted in ``WriterStats.records_lost`` (``rollout_bus.consumers.shard_writer.episodes_reader``).
  With ``exit_on_end_of_run``, markers that can only have been among them are not awaited: every partition read
  to its end offset, the run ends and ``run()`` raises ``RecordsLostError`` (``shard_writer.lost_markers``).
* Broker outages of any length are ridden out: every Kafka operation (connecting, poll,
  end_offsets (read every ``LAG_INTERVAL_S`` for the progress line's lag), positions, sends and
  flushes, commits, reading announcements at start-up, waiting for a topic's partitions) retries
  with backoff (``rollout_bus.kafka.retry``), one WARNING line per retry; a timeout never ends the
  process. The producer keeps a record for up to an hour inside kafka-python before its future
  fails (and the writer sends it again).
* One writer per output directory: ``run()`` holds ``rollout_bus.consumers.shard_writer.writer_lock`` for its whole life,
  and a second writer on the same directory is refused (``WriterLockedError``, naming the holder).
* Effectively once. At start-up, before the loop, ``rollout_bus.consumers.shard_writer.recovery`` finds the complete
  batches in ``--out`` (partial files removed), reads rollout.shards back (``kafka.reader.TopicReader``)
  and announces each batch on disk that was never announced (a kill between manifest and
  announcement). Rollout keys of a batch on disk count as written, so a batch is never written
  twice; anything not in one is re-read from the committed offsets, and in step mode forms the
  same batch, byte for byte. Only the keys of the ``written_memory`` newest batches stay
  in memory; older ones are looked up in their manifest on disk (``out_dir.written_keys``).
* Stopping: ``exit_on_end_of_run`` returns once an end-of-run flush is written and committed;
  ``exit_when_idle`` returns once no record arrived for ``idle_s`` and the writer is caught up
  with the topic (a stop condition only: it never forms a batch; pending episodes stay
  uncommitted for the next run); ``max_batches`` after that many batches written by this process.
  SIGTERM stops the loop at the next iteration, also while waiting for the broker.
"""

from __future__ import annotations

import functools
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rollout_bus.consumers.shard_writer.batcher import Batcher, Outcome
from rollout_bus.consumers.shard_writer.batch import Batch
from rollout_bus.consumers.shard_writer.dead_letters import DeadLetters
from rollout_bus.consumers.shard_writer.announce import Said, say
from rollout_bus.consumers.shard_writer.delivery import Outbox, Outgoing
from rollout_bus.consumers.shard_writer.end_of_run import EndOfRunTracker
from rollout_bus.consumers.shard_writer.episodes_reader import EpisodesReader
from rollout_bus.consumers.shard_writer.episodes import AbandonedEpisode, EndOfRunMarker, parse_record
from rollout_bus.consumers.shard_writer.lost_markers import RecordsLostError, describe_owed, runs_ended_by_loss
from rollout_bus.consumers.shard_writer.decide import Decision, Verdict, decide, write_decided
from rollout_bus.consumers.shard_writer.options import WriterOptions, WriterStats
from rollout_bus.consumers.shard_writer.flow import batch_flow
from rollout_bus.consumers.shard_writer.out_dir import written_keys
from rollout_bus.consumers.shard_writer.recovery import announced_on, recover
from rollout_bus.consumers.shard_writer.writer_lock import hold_writer_lock
from rollout_bus.wire.dead_letter import MAX_REASON_CHARS, DlqKind
from rollout_bus.errors import ContractError, DiskFullError
from rollout_bus.kafka.clients import KafkaProducer, new_producer
from rollout_bus.kafka.limits import producer_config
from rollout_bus.kafka.retry import Stopped, retrying
from rollout_bus.wire.control_records import END_OF_RUN_KEY, BatchesEnded, BatchSkipped
from rollout_bus.wire.headers import control_kind
from rollout_bus.wire.topics import Topics
from rollout_bus.model.files import wait_for_disk
from rollout_bus.model.shards import batch_path

logger = logging.getLogger(__name__)

__all__ = ["ShardWriter"]

T = TypeVar("T")
# The producer keeps retrying a record inside kafka-python for this long before its future fails
# (then the writer sends it again); sends block at most MAX_BLOCK_MS per try, so waits are logged.
DELIVERY_TIMEOUT_MS = 3_600_000
MAX_BLOCK_MS = 10_000
CLOSE_TIMEOUT_S = 10.0
LAG_INTERVAL_S = 5.0
LOOKUP_CACHE = 16


class ShardWriter:
    """One writer process; ``run()`` until told to stop (see the module docstring)."""

    def __init__(self, client_kwargs: dict[str, Any], topics: Topics, options: WriterOptions,
                 on_progress: Callable[[WriterStats], None] | None = None) -> None:
        self.client_kwargs = dict(client_kwargs)
        self.topics = topics
        self.options = options
        self.stats = WriterStats()
        self._on_progress = on_progress or (lambda stats: None)
        lookup = functools.lru_cache(maxsize=LOOKUP_CACHE)(functools.partial(written_keys, options.out_dir))
        self._batcher = Batcher(options.run_batching, written_memory=options.written_memory, lookup=lookup)
        self._committed: dict[int, int] = {}
        self._stop = False
        self._run_over = False
        self._last_member: dict[int, int] = {}  # per partition, the offset of the last record read that is no marker
        self._tracker = EndOfRunTracker(())
        self._producer: KafkaProducer | None = None
        self._outbox: Outbox | None = None
        self._letters: DeadLetters | None = None
        self._reader: EpisodesReader | None = None
        run = options.run_batching
        self._max_staleness = run.max_staleness if run.batching == "step" else None
        if run.max_staleness is not None and run.batching != "step":
            logger.warning("max_staleness=%d ignored: arrival batching has no step identity to judge staleness by",
                           run.max_staleness)

    # ------------------------------------------------------------------ lifecycle

    def stop(self, *_: Any) -> None:
        self._stop = True

    def _retry(self, operation: Callable[[], T], what: str) -> T:
        def counted(attempt: int, exc: BaseException) -> None:
            self.stats.broker_waits += 1
        return retrying(operation, what, should_stop=lambda: self._stop, on_retry=counted)

    def run(self) -> WriterStats:
        try:
            signal.signal(signal.SIGTERM, self.stop)
        except ValueError:  # not the main thread: the caller stops us
            pass
        with hold_writer_lock(self.options.out_dir, {"group": self.options.group_id,
                                                     "episodes_topic": self.topics.episodes}):
            try:
                self._producer = self._retry(self._new_producer, "connect the producer")
                self._outbox = Outbox(self._producer, should_stop=lambda: self._stop)
                self._letters = DeadLetters(self._outbox, self.topics, self.stats)
                self._resume_from_disk()
                self._reader = self._open_reader()
                self._loop()
            except Stopped as exc:
                logger.info("stopping: %s", exc)
            finally:
                if self._reader is not None:
                    self._reader.close()
                if self._producer is not None:
                    self._producer.close(timeout=CLOSE_TIMEOUT_S)
        return self.stats

    def _new_producer(self) -> KafkaProducer:
        """acks=all, sized by ``max_record_bytes``; not idempotent: kafka-python 3 turns an idempotent
        producer's size refusal into a fatal error that fails every record in flight and every later
        send, and the writer's records tolerate a duplicate anyway (see ``rollout_bus.consumers.shard_writer.delivery``). One
        request in flight keeps each partition in order."""
        sizes = producer_config(self.options.max_record_bytes)
        return new_producer(self.client_kwargs, acks="all", enable_idempotence=False,
                            max_in_flight_requests_per_connection=1, linger_ms=5,
                            delivery_timeout_ms=DELIVERY_TIMEOUT_MS, max_block_ms=MAX_BLOCK_MS, **sizes)

    def _open_reader(self) -> EpisodesReader:
        """rollout.episodes assigned and positioned (``rollout_bus.consumers.shard_writer.episodes_reader``)."""
        reader = EpisodesReader.open(self.client_kwargs, self.topics.episodes, group_id=self.options.group_id,
                                     max_record_bytes=self.options.max_record_bytes, retry=self._retry,
                                     letters=self._letters)
        self._tracker = EndOfRunTracker(reader.partitions)
        return reader

    def _resume_from_disk(self) -> None:
        """Start-up recovery (``rollout_bus.consumers.shard_writer.recovery``), before the loop reads a record."""
        recover(self.options.out_dir, self._batcher, counts=self.stats, announce=self._announce,
                read_announced=lambda: announced_on(self.client_kwargs, self.topics.shards, self._retry),
                topic=self.topics.episodes)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        opts = self.options
        last_record = last_lag = time.monotonic()
        while not self._stop:
            polled = self._reader.poll()
            for records in polled.values():
                for record in records:
                    self._take(record)
            now = time.monotonic()
            if polled:
                last_record = now
            self._write_all(self._batcher.ready())
            self._checkpoint()
            self.stats.pending, self.stats.incomplete_groups = self._batcher.pending_episodes, self._batcher.incomplete_groups
            if now - last_lag >= LAG_INTERVAL_S:
                self.stats.lag, last_lag = self._reader.lag(), now
                self._reader.check_partitions()
            self._on_progress(self.stats)
            if not polled and opts.exit_on_end_of_run and self._reader.lost and not self._run_over:
                self._end_if_lost()
            if self._reached_max():
                logger.info("wrote max_batches=%d: stopping", opts.max_batches)
                return
            if self._run_over and opts.exit_on_end_of_run:
                logger.info("end of run written and committed: stopping")
                return
            if opts.exit_when_idle and now - last_record >= opts.idle_s and self._caught_up():
                if self._batcher.pending_episodes:
                    logger.warning("exiting idle with pending=%d records left uncommitted",
                                   self._batcher.pending_episodes)
                return

    def _caught_up(self) -> bool:
        self.stats.lag = self._reader.lag()
        return self.stats.lag == 0

    def _take(self, record: Any) -> None:
        """One rollout.episodes record into the batcher, the end-of-run tracker, or the DLQ."""
        self.stats.records += 1
        self._reader.took(record)
        try:
            item = parse_record(record.key, record.value, record.headers, partition=record.partition,
                                offset=record.offset)
        except ContractError as exc:
            self._batcher.skip(record.partition, record.offset)
            control = control_kind(record.headers)
            what = "episode" if control is None else f"control ({control})"
            kind = DlqKind.DECODE if control is None else DlqKind.CONTROL
            self._letters.send(record.key, record.value, record.headers, record.partition, record.offset,
                               f"{what} record does not decode: {exc}", kind)
            return
        if isinstance(item, EndOfRunMarker):
            self._marker(item)
            return
        self._last_member[record.partition] = record.offset
        result = self._batcher.add(item)
        abandoned = isinstance(item, AbandonedEpisode)
        if result.outcome is Outcome.ACCEPTED:
            self.stats.abandoned += abandoned
            self.stats.episodes += not abandoned
        elif result.outcome is Outcome.REPLACED:
            pass  # the same episode, a later attempt: counted once
        elif result.outcome is Outcome.REJECTED:
            self._letters.send(record.key, record.value, record.headers, record.partition, record.offset,
                               result.reason, result.kind)
        else:
            self.stats.duplicates += 1
            logger.debug("dropped %s key=%s attempt=%d", result.outcome.value, item.key, item.attempt)

    def _marker(self, marker: EndOfRunMarker) -> None:
        """Hold the marker until its run's flush is written; flush once the run is complete."""
        self.stats.control_records += 1
        if self._tracker.is_finished(marker.run):
            self._batcher.skip(marker.partition, marker.offset)
            logger.info("end-of-run run=%s partition=%d offset=%d: run already flushed, ignored", marker.run,
                        marker.partition, marker.offset)
            return
        self._batcher.hold(marker.partition, marker.offset)
        if self._tracker.add(marker):
            self._write_all(self._batcher.ready())
            self._end_run([marker.run])

    def _end_if_lost(self) -> None:
        """Markers still owed can only have been lost, and every partition is read to its end offset: end the run
        as the markers would have, then stop with the verdict (``rollout_bus.consumers.shard_writer.lost_markers``)."""
        unfinished = self._tracker.unfinished()
        runs = runs_ended_by_loss(self._reader.partitions, self._reader.lost, self._last_member, unfinished)
        if runs is None or not self._caught_up():
            return
        logger.error("%s", describe_owed(unfinished))
        if self._end_run(runs):
            self._checkpoint()
            raise RecordsLostError(self._reader.lost)

    def _end_run(self, runs: list[str]) -> bool:
        """Flush everything pending as partial batches; once all are written, say each run's end on rollout.shards
        and release its markers (False: ``max_batches`` stopped the flush, the markers stay held)."""
        batches = self._batcher.flush()
        logger.info("end of run run=%s: flushing %d partial batches", ",".join(runs) or "-", len(batches))
        self._write_all(batches)
        if self._batcher.unfinished_batches or self._batcher.pending_episodes:
            return False  # the next process flushes the rest
        for run in runs:  # released markers are committed only after the sends are confirmed (_checkpoint)
            ended = BatchesEnded(run, self._batcher.next_seq)
            self._outbox.send(Outgoing(self.topics.shards, END_OF_RUN_KEY, ended.value(), ended.headers(),
                                       f"end of run {run} on rollout.shards"))
            for marker in self._tracker.finished(run):
                self._batcher.release(marker.partition, marker.offset)
        self._outbox.confirm()
        self.stats.runs_ended += len(runs)
        self._run_over = True
        return True

    # ------------------------------------------------------------------ batches

    def _write_all(self, batches: list[Batch]) -> None:
        """Write in order, then say so for all of them in two round trips: every batch's metrics record,
        confirmed; then every announcement (or skip) in seq order, confirmed; then one commit. Past
        ``max_batches`` the rest stay uncommitted for the next run."""
        if not batches:  # the loop asks at every turn: nothing due, nothing to say (the loop commits itself)
            return
        said: list[Said] = []
        for batch in batches:
            if self._reached_max():
                break
            said.append(self._write(batch))
        say(self._outbox, self.topics, said)
        self._checkpoint()

    def _reached_max(self) -> bool:
        return self.options.max_batches is not None and self.stats.batches_written >= self.options.max_batches

    def _write(self, batch: Batch) -> Said:
        """Decide one batch (``rollout_bus.consumers.shard_writer.decide``): dead letters first, then skip it or write
        its files; what rollout.metrics and rollout.shards are to be told of it is returned (``announce.say``)."""
        decision = decide(batch, dp_size=self.options.dp_size, normalization=self.options.normalization,
                          batching=self.options.run_batching.batching, max_staleness=self._max_staleness)
        batch = decision.batch
        self._send_dead_letters(decision)
        if decision.verdict is Verdict.DEAD_LETTER:
            self._batcher.done(batch)
            self.stats.batches_dead_lettered += 1
            return Said(skipped=BatchSkipped(batch.seq, decision.verdict.value, decision.why[:MAX_REASON_CHARS]))
        if decision.verdict is Verdict.EMPTY:
            logger.info("batch=%d not written: every episode of it was %s (abandoned=%d, stale=%d, groups=%d)",
                        batch.seq, decision.emptied_by, len(batch.abandoned), len(batch.stale), len(batch.groups))
            self._batcher.done(batch)
            self.stats.batches_skipped += 1
            return Said(skipped=BatchSkipped(batch.seq, decision.verdict.value, decision.why))
        directory = batch_path(self.options.out_dir, batch.seq)
        manifest = wait_for_disk(lambda: self._write_files(decision), f"batch {batch.seq} -> {directory}",
                                 should_stop=lambda: self._stop)
        self._batcher.done(batch)  # committed only after say has confirmed what it sends of the batch
        self.stats.batches_written += 1
        self.stats.last_batch = batch.seq
        self.stats.written_dirs.append(str(directory))
        return Said(written=(batch.seq, manifest, directory), flow=batch_flow(decision, time.time_ns() // 1_000_000))

    def _write_files(self, decision: Decision) -> dict[str, Any]:
        try:
            return write_decided(self.options.out_dir, decision, topic=self.topics.episodes)
        except DiskFullError:
            self.stats.disk_waits += 1
            raise

    def _send_dead_letters(self, decision: Decision) -> None:
        """Stale episodes, and every episode of a dead-lettered batch, findable in the DLQ with their reason."""
        for letter in decision.dead_letters():
            e = letter.episode
            self._letters.send(e.key.encode(), e.value, e.headers, e.partition, e.offset, letter.reason, letter.kind)
        self.stats.stale += len(decision.batch.stale)

    def _announce(self, seq: int, manifest: dict[str, Any], directory: Path) -> None:
        """One batch found on disk but never announced (start-up recovery): said as ``_write_all`` says it."""
        say(self._outbox, self.topics, [Said(written=(seq, manifest, directory))])

    def _checkpoint(self) -> None:
        """Commit what may be committed; every send is confirmed first, so no dead letter is lost."""
        positions = self._batcher.commit_offsets()
        changed = {p: o for p, o in positions.items() if self._committed.get(p) != o}
        if not changed:
            return
        self._outbox.confirm()
        self._reader.commit(changed)
        self._committed.update(changed)
        logger.debug("committed %s", changed)
