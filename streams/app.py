"""The Faust app factory of the stream stage: plain values in, an app with one agent out.

Contract: ``build_app(...)`` returns a ``StreamApp`` (the ``faust.App`` and its ``TurnProcessor``);
``run_app`` runs it in a ``faust.Worker``. The only stage module that imports Faust or aiokafka:
its clients' connection and security come from ``rollout_bus.kafka.clients``.
The app consumes rollout.turns with one agent (concurrency 1: Faust #606 skips commits above it),
in batches of up to ``TAKE_MAX_RECORDS`` taken within ``TAKE_WITHIN_S`` (``stream.take_events``
acknowledges a batch's events only once the processor returns), and keeps all state in one memory-backed table
(``state``) whose compacted changelog, ``{app_id}-state-changelog``, is the only durable state.
State writes go to that changelog through ``rollout_bus.streams.state.ChangelogState`` (straight to the
aiokafka producer, not Faust's table buffer), so the source offsets are committed only after
every changelog write and every record sent before them is flushed (at-least-once). Settings chosen around known
Faust troubles:

* ``store="memory://"`` (no RocksDB recovery to hang on), no standby replicas, no leader topic;
* ``at_least_once`` with idempotent outputs (the next stage drops a re-emitted episode by its key
  and attempt) rather than ``exactly_once``;
* session 10 s (a killed worker's partitions move on quickly), heartbeat 3 s, poll interval
  300 s, rebalance 60 s: no rebalance loops while an episode is merged;
* the web server is off (a worker run through ``rollout_bus.streams.worker`` never binds a port);
* Faust can acknowledge records it never delivers to the agent (around rebalances and restarts):
  the processor's state position notices the jump, and a timer compares idle partitions with
  their end, so such records are read back and processed (``TurnProcessor.catch_up_idle``);
* records deleted before they were read (retention, DeleteRecords) are found the same way, a live worker
  expecting every partition from offset 0: ``fetch_range`` reports the log start after its read, and the
  processor dead-letters the offsets below it as ``lost`` (``rollout_bus.streams.lost_records``);
* a batch taken before a rebalance may hold records of partitions no longer assigned: the processor
  leaves them to their new owner, which replays them from the state's recorded position;
* record sizes from one setting (``max_record_bytes``, ``rollout_bus.kafka.limits``): the
  producer's request size and lz4 compression, the consumer's fetch size, and the state
  changelog's ``max.message.bytes``; a record the producer or the broker refuses for its size
  raises ``RecordTooLargeError`` to the processor, which dead-letters it by reference;
* broker outages are waited out inside the clients: the producer's request timeout is Faust's
  (20 minutes), so a send waits for the broker rather than failing; a timer probes the broker with a
  metadata request of its own every 8 s (``rollout_bus.streams.broker_watch``), so an outage that drops
  packets is said (``waiting for broker ...`` every 10 s, with why) as the other stages say theirs;
* a rebalance pauses the processor (``TurnProcessor.pause``: the record in hand finishes, in-flight
  finals are applied, the producer is flushed) until the recovery is complete: the memory store's
  recovery replays the whole changelog into the live table, over any record processed meanwhile;
* a partition count of rollout.turns or rollout.episodes that changes under the worker (seen by the same
  probe) calls ``on_partitions_changed`` (default: an ERROR line naming both counts, then exit
  ``EXIT_PARTITIONS_CHANGED``, 75): the state table is sized at start, so a restart follows the new count;
* any error that is not a bad record calls ``on_fatal`` (default: log and exit the process with
  ``EXIT_AGENT_CRASH``), so a broken agent never idles silently; replay makes the exit safe.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import faust
from aiokafka import TopicPartition
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.errors import RecordTooLargeError as AioRecordTooLargeError

from rollout_bus.errors import EXIT_PARTITIONS_CHANGED, BrokerError, RecordTooLargeError
from rollout_bus.kafka.clients import faust_brokers, faust_credentials, new_aio_consumer
from rollout_bus.kafka.faust_consumer import ChangelogKeepingTransport
from rollout_bus.kafka.reachability import diagnose
from rollout_bus.kafka.limits import faust_config, topic_config
from rollout_bus.wire.topics import DEFAULT_MAX_RECORD_BYTES, Topics
from rollout_bus.streams.broker_watch import BrokerWatch
from rollout_bus.streams.lost_records import FetchedRange
from rollout_bus.streams.processor import TurnProcessor
from rollout_bus.streams.turn_record import TurnRecord, to_record
from rollout_bus.streams.state import ChangelogState, Publish

logger = logging.getLogger(__name__)

EXIT_AGENT_CRASH = 70
CATCH_UP_INTERVAL_S = 2.0
DRAIN_INTERVAL_S = 0.05  # acknowledged finals get their finished marker within this, with no further record
CATCH_UP_IDLE_S = 4.0
# a metadata request of its own says when the broker stops answering (dropped packets); the probe (4 s) and the
# reason (a 1.5 s TCP connect) fit inside the interval, so the timer never overlaps itself
BROKER_WATCH_INTERVAL_S = 8.0
BROKER_PROBE_TIMEOUT_S = 4.0
TAKE_MAX_RECORDS = 256  # records processed as one batch: one state flush, one drain of their finals
TAKE_WITHIN_S = 0.01  # the most a record waits for its batch to fill
# records Faust reads ahead of the agent (its default, 4096, holds ~25 MB of a default backlog: peak
# memory then grew with the backlog); two batches keep the agent fed
STREAM_BUFFER_RECORDS = 2 * TAKE_MAX_RECORDS
TABLE_NAME = "state"
_RAW = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


class _App(faust.App):
    """``faust.App`` whose consumer never loses a changelog record it fetched during a rebalance
    (``rollout_bus.kafka.faust_consumer``: without it a worker's table recovery could wait forever)."""

    def _new_transport(self) -> Any:
        return ChangelogKeepingTransport(self.conf.broker_consumer, self)


@dataclass(frozen=True)
class StreamApp:
    app: faust.App
    processor: TurnProcessor


def exit_on_fatal(exc: BaseException, summary: str) -> None:
    """Log the error and the outcome counts, then end the process with a non-zero status."""
    logger.critical("stream agent crashed, exiting with %d: %r; counts %s", EXIT_AGENT_CRASH, exc, summary,
                    exc_info=exc)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_AGENT_CRASH)


def changelog_topic(app_id: str) -> str:
    """The state table's changelog topic (Faust names it ``{app id}-{table}-changelog``)."""
    return f"{app_id}-{TABLE_NAME}-changelog"


def exit_on_partition_change(topic: str, started_with: int, now: int) -> None:
    """Say that a topic's partition count changed under the worker, then exit for a restart that reads it."""
    logger.error("topic=%s now has %d partitions, this worker started with %d: records on the new partitions would "
                 "never be read; exiting with %d so the worker restarts with the new count (its state changelog is "
                 "raised to match at start)", topic, now, started_with, EXIT_PARTITIONS_CHANGED)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_PARTITIONS_CHANGED)


def _is_too_large(exc: BaseException | None) -> bool:
    """Whether a send failed for the record's size (Faust wraps aiokafka's error in ProducerSendError)."""
    while exc is not None:
        if isinstance(exc, (MessageSizeTooLargeError, AioRecordTooLargeError)):
            return True
        exc = exc.__cause__
    return False


async def _delivered(future: Any) -> Any:
    try:
        return await future
    except Exception as exc:
        if _is_too_large(exc):
            raise RecordTooLargeError(f"the broker refused the record for its size: {exc!r}") from exc
        raise


async def fetch_range(client_kwargs: dict[str, Any], topic: str, partition: int, start: int, end: int,
                      timeout_s: float = 60.0, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> FetchedRange:
    """Records ``[start, end)`` of one partition, read with a group-less aiokafka consumer, and the log
    start measured after the read (offsets below it that were not read are gone: ``lost_records``).
    A start below the log start is reset to it (``earliest``), so a read of deleted records ends."""
    consumer = new_aio_consumer(client_kwargs, max_record_bytes=max_record_bytes, group_id=None,
                                auto_offset_reset="earliest")
    tp = TopicPartition(topic, partition)
    records: list[TurnRecord] = []
    await consumer.start()
    try:
        consumer.assign([tp])
        consumer.seek(tp, start)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while await consumer.position(tp) < end:
            if asyncio.get_running_loop().time() > deadline:
                raise BrokerError(f"reading {topic}:{partition} offsets {start}..{end - 1} timed out")
            for batch in (await consumer.getmany(tp, timeout_ms=500)).values():
                records += [_as_record(m) for m in batch if m.offset < end]
        log_start = (await consumer.beginning_offsets([tp]))[tp]
    finally:
        await consumer.stop()
    return FetchedRange(records, log_start)


def _as_record(message: Any) -> TurnRecord:
    headers = [(k, bytes(v) if v is not None else b"") for k, v in (message.headers or [])]
    return TurnRecord(message.key, message.value, headers, message.topic, message.partition, message.offset,
                      int(message.timestamp))


def build_app(*, app_id: str, client_kwargs: dict[str, Any], topics: Topics, turns_partitions: int,
              window_seconds: float = 60.0, grace_seconds: float = 10.0, data_dir: str | None = None,
              stats_interval_s: float = 30.0, commit_interval_s: float = 1.0, replication_factor: int = 1,
              episodes_partitions: int = 1, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
              on_fatal: Callable[[BaseException, str], None] = exit_on_fatal,
              on_partitions_changed: Callable[[str, int, int], None] = exit_on_partition_change) -> StreamApp:
    """The stream worker's app; ``turns_partitions`` and ``episodes_partitions`` must be the partition
    counts of rollout.turns and rollout.episodes."""
    app = _new_app(app_id, client_kwargs, turns_partitions=turns_partitions, data_dir=data_dir,
                   commit_interval_s=commit_interval_s, replication_factor=replication_factor,
                   max_record_bytes=max_record_bytes)
    source = app.topic(topics.turns, schema=faust.Schema(**_RAW))
    table = _state_table(app, turns_partitions, max_record_bytes)
    send = _sender(app)
    publish_changelog = _changelog_publisher(app, table.changelog_topic.get_topic_name())
    fetch = partial(fetch_range, client_kwargs, max_record_bytes=max_record_bytes)
    state = ChangelogState(table.data, publish_changelog)
    processor = TurnProcessor(state, send, topics, window_ms=max(1, int(round(window_seconds * 1000))),
                              grace_ms=int(round(grace_seconds * 1000)), fetch=fetch,
                              turns_partitions=turns_partitions, episodes_partitions=episodes_partitions,
                              reads_from_start=True)
    _add_agent(app, source, processor, partial(_owned_partitions, app, topics.turns), on_fatal)
    _pause_for_rebalances(app, processor, on_fatal)
    _add_recovery_timers(app, processor, topics.turns, on_fatal)
    started_with = ((topics.turns, turns_partitions), (topics.episodes, episodes_partitions))
    _add_broker_watch(app, client_kwargs, max_record_bytes, started_with, on_partitions_changed)

    @app.timer(interval=stats_interval_s)
    async def _log_counts() -> None:
        logger.info("stream counts %s", processor.outcomes.summary())

    return StreamApp(app, processor)


def _new_app(app_id: str, client_kwargs: dict[str, Any], *, turns_partitions: int, data_dir: str | None,
             commit_interval_s: float, replication_factor: int, max_record_bytes: int) -> faust.App:
    """The Faust app with the settings the module docstring gives the reasons for."""
    return _App(
        app_id, broker=faust_brokers(client_kwargs), broker_credentials=faust_credentials(client_kwargs),
        store="memory://", datadir=data_dir or None, processing_guarantee="at_least_once",
        topic_partitions=turns_partitions, topic_replication_factor=replication_factor,
        topic_disable_leader=True, table_standby_replicas=0, consumer_auto_offset_reset="earliest",
        broker_commit_interval=commit_interval_s, broker_session_timeout=10.0, broker_heartbeat_interval=3.0,
        broker_max_poll_interval=300.0, broker_rebalance_timeout=60.0, broker_request_timeout=90.0,
        producer_acks=-1, producer_max_batch_size=1 << 20, **faust_config(max_record_bytes),
        stream_wait_empty=False, stream_buffer_maxsize=STREAM_BUFFER_RECORDS, web_enabled=False, web_bind="127.0.0.1", web_port=6066,
        worker_redirect_stdouts=False,
    )


def _state_table(app: faust.App, turns_partitions: int, max_record_bytes: int) -> Any:
    """The one state table (``TABLE_NAME``), a partition per rollout.turns partition."""
    # bytes key/value types make Faust use the raw codec on both the write and the recovery path
    return app.Table(TABLE_NAME, partitions=turns_partitions, key_type=bytes, value_type=bytes,
                     extra_topic_configs=topic_config(max_record_bytes),
                     help="episode indexes, stored turns, window entries (rollout_bus.streams.processor)")


def _sender(app: faust.App) -> Callable[..., Awaitable[Any]]:
    """The processor's ``Sender`` over the app's producer: a size refusal raises ``RecordTooLargeError``."""

    async def send(topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]], *,
                   wait: bool, partition: int | None = None) -> Any:
        try:
            future = await app.producer.send(topic, key, value, partition, None, headers)
        except Exception as exc:
            if _is_too_large(exc):
                raise RecordTooLargeError(f"the producer refused the record for its size: {exc!r}") from exc
            raise
        delivery = asyncio.ensure_future(_delivered(future))
        if wait:
            await delivery
            return None
        return delivery

    return send


def _changelog_publisher(app: faust.App, changelog: str) -> Publish:
    """``ChangelogState``'s ``publish``: a partition's queued writes to the changelog topic, in order."""

    async def publish_changelog(partition: int, records: list[tuple[bytes, bytes | None]]) -> None:
        # record batches built here and handed over whole: one accumulator entry per batch, not per record
        # (the producer's flush, and so the offset commit, waits for them as for single sends; a batch waits
        # for the partition's previous one to be taken by the sender, which keeps the partition in order)
        producer = app.producer._ensure_producer()
        batch = producer.create_batch()
        for key, value in records:
            if batch.append(key=key, value=value, timestamp=None) is None:  # full: hand it over, start another
                await producer.send_batch(batch, changelog, partition=partition)
                batch = producer.create_batch()
                batch.append(key=key, value=value, timestamp=None)  # an empty batch takes any first record
        if batch.record_count():
            await producer.send_batch(batch, changelog, partition=partition)

    return publish_changelog


def _owned_partitions(app: faust.App, turns_topic: str) -> set[int]:
    """The rollout.turns partitions assigned to this worker now."""
    return {tp.partition for tp in app.consumer.assignment() if tp.topic == turns_topic}


def _add_agent(app: faust.App, source: Any, processor: TurnProcessor, owned: Callable[[], set[int]],
               on_fatal: Callable[[BaseException, str], None]) -> None:
    """The one agent, ``merge_turns``: batches of rollout.turns records to the processor."""

    @app.agent(source, name="merge_turns")
    async def merge_turns(stream: Any) -> None:
        # Faust acknowledges a batch's events only after the processor returns (take_events)
        async for events in stream.take_events(TAKE_MAX_RECORDS, within=TAKE_WITHIN_S):
            try:
                await processor.handle_batch([to_record(event.message) for event in events], owned)
            except Exception as exc:  # not a bad record (those go to the DLQ): the worker must not idle
                on_fatal(exc, processor.outcomes.summary())
                raise


def _pause_for_rebalances(app: faust.App, processor: TurnProcessor,
                          on_fatal: Callable[[BaseException, str], None]) -> None:
    """A revocation pauses the processor (its state written, the producer flushed) until the rebalance,
    and the table's recovery with it, is complete."""

    @app.on_partitions_revoked.connect
    async def _revoked(sender: Any, revoked: Any, **_: Any) -> None:
        # the record in hand is finished and its state written before Faust recovers the table
        # (stream_wait_empty is off, so Faust itself does not wait for it)
        try:
            await processor.pause()
            await app.producer.flush()
        except Exception as exc:
            on_fatal(exc, processor.outcomes.summary())
            raise

    @app.on_rebalance_complete.connect
    async def _rebalanced(sender: Any, **_: Any) -> None:
        processor.resume()


def _add_recovery_timers(app: faust.App, processor: TurnProcessor, turns_topic: str,
                         on_fatal: Callable[[BaseException, str], None]) -> None:
    """Timers outside rebalances and recoveries: idle partitions compared with their end (records Faust
    acknowledged without delivering them), and acknowledged finals applied with no further record."""

    @app.timer(interval=CATCH_UP_INTERVAL_S)
    async def _catch_up_idle_partitions() -> None:
        if app.rebalancing or app.in_recovery:
            return
        try:
            ends = {tp.partition: app.consumer.highwater(tp) for tp in app.consumer.assignment()
                    if tp.topic == turns_topic}
            await processor.catch_up_idle(turns_topic, ends, idle_s=CATCH_UP_IDLE_S)
        except Exception as exc:  # same rule as the agent: never idle with an unexplained error
            on_fatal(exc, processor.outcomes.summary())
            raise

    @app.timer(interval=DRAIN_INTERVAL_S)
    async def _drain_in_flight() -> None:
        if app.rebalancing or app.in_recovery:
            return
        try:
            await processor.drain_idle()
        except Exception as exc:  # a failed delivery: crash loudly, the replay re-emits
            on_fatal(exc, processor.outcomes.summary())
            raise


def _add_broker_watch(app: faust.App, client_kwargs: dict[str, Any], max_record_bytes: int,
                      started_with: tuple[tuple[str, int], ...],
                      on_partitions_changed: Callable[[str, int, int], None]) -> None:
    """The timer that says when the broker stops answering (``broker_watch``: a metadata request of its own),
    and calls ``on_partitions_changed`` when a topic of ``started_with`` (topic, partition count) has another."""
    probe_consumer: list[Any] = []  # one group-less client, started at the first probe
    seen_partitions: dict[str, int] = {}  # per topic, from the last probe's metadata

    async def probe() -> None:
        if not probe_consumer:
            consumer = new_aio_consumer(client_kwargs, max_record_bytes=max_record_bytes, group_id=None)
            try:
                await consumer.start()
            except BaseException:  # cut off by the probe's deadline too: its cleanup must not hang the watch
                stopping = asyncio.ensure_future(consumer.stop())
                stopping.add_done_callback(lambda done: done.cancelled() or done.exception())
                raise
            probe_consumer.append(consumer)
        # a metadata request of all topics: answered, or the broker is not reachable. The public topics() makes
        # the same request but returns names only; the cluster metadata it builds gives the partition counts
        cluster = await probe_consumer[0]._client.fetch_all_metadata()
        for topic, _ in started_with:
            seen_partitions[topic] = len(cluster.partitions_for_topic(topic) or ())

    watch = BrokerWatch(probe, ",".join(u.split("://", 1)[-1] for u in faust_brokers(client_kwargs)),
                        timeout_s=BROKER_PROBE_TIMEOUT_S, why=partial(diagnose, timeout_s=1.5, connection=client_kwargs))

    @app.timer(interval=BROKER_WATCH_INTERVAL_S)
    async def _watch_broker() -> None:
        if not await watch.check():
            return
        # the probe's metadata is fresh: a partition count raised mid-run is followed by a restart
        for topic, started in started_with:
            now = seen_partitions.get(topic, 0)
            if now and now != started:
                on_partitions_changed(topic, started, now)


def run_app(stream_app: StreamApp) -> int:
    """Run the app in a ``faust.Worker`` (no web server, no Faust CLI, logging as the caller set it)
    until SIGTERM/SIGINT; the exit status: 0 after a clean stop, non-zero when the worker crashed."""
    worker = faust.Worker(stream_app.app, redirect_stdouts=False, quiet=True, override_logging=False)
    worker.spinner = None  # no terminal spinner in logs
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
