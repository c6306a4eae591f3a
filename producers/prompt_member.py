"""One member of the generators' group on rollout.prompts: take prompt groups, make their episodes, say so.

Why a classic consumer group: it is what kafka-python speaks (share groups, KIP-932, have no Python client in
the locked set), and its two guarantees are the ones needed: a partition has one member at a time, and a member
that stops heartbeating (kill -9, SIGSTOP) loses its partitions after the session timeout, so another member
resumes them from the committed offset. What a share group would add, the per-record delivery count, is kept in
the log instead: rollout.prompt_ledger (``rollout_bus.kafka.prompt_ledger``). A slow member holds its
partitions, not the others': with more partitions than members the work spreads.

Contract:

* ``run_member(conn, topics, options, make_turns, publisher, stop=..., progress=None, gate=None)`` subscribes to
  rollout.prompts in group ``Topics.group(GENERATORS_GROUP)`` and runs up to ``options.concurrency`` prompt groups
  at once, each on a worker thread: ``make_turns(prompt, logged)`` yields ``(sample, publish_turn kwargs)`` and every
  turn is sent with the prompt group's delivery in its ``delivery`` header. Each turn acknowledged is noted on the
  ledger (a ``progress`` event: which episode, attempt and turn, and where the record is; sent without waiting),
  with the environment's answer after it when the engine's kwargs carry one (``observation``: not a header).
* A delivery above 1 resumes: the episodes the ledger says the log holds (``PromptLedger.progress``) are read back
  from rollout.turns by offset (``producers.resume_plan``); ``logged`` hands the engine each episode's logged turns
  to continue from, and a turn it yields that the log holds byte for byte is not sent again. A finished
  episode sends nothing; a partial one continues with the ``resumed`` header on its first new turn. A turn the log
  no longer holds (retention) is said in a WARNING with where, and made again.
* Before a prompt group starts, the ledger is caught up: a group already ``done`` or ``failed`` is passed over;
  one whose deliveries reached ``options.max_deliveries`` is ``failed`` (and dead-lettered, ``failed_prompt``,
  with the prompt record and why); else a ``claimed`` event with the next delivery is acknowledged first. An
  engine that raises makes the next delivery at once, until the limit; one that raises ``EngineRefused`` (the
  request is wrong) or ``SampleFailed`` (one sample failed on every try) fails the prompt group at once.
* A prompt group is over when every one of its turns is acknowledged: the member checks it still belongs to the
  group (a commit of the offsets below it must succeed: a zombie back from SIGSTOP fails here and writes
  nothing), writes ``done``, then commits past it. Offsets are committed per partition up to the first prompt
  group still in flight, so whatever a dead member held is delivered again.
* Partitions are assigned cooperatively (KIP-429: a member joining or leaving moves only the partitions that
  change hands). A partition revoked or lost stops the groups in flight on it at their next turn: handed back,
  never written done (a member that was out of the group, a zombie, finds out so, or by a refused commit).
  ``stop()`` true (SIGTERM) gives what is in flight ``options.drain_s`` to finish, hands back the rest, and
  leaves the group, so the others take its partitions at once.
* With a staleness bound (``gate``, a ``producers.staleness_gate.StalenessGate``), a prompt group whose batch may
  not start yet under the live weights is held, not started: it takes no worker slot, nothing is claimed, and its
  partition is read no further (group indices grow with the offset in a partition: what follows it would wait
  too), so lower groups on other partitions go on and the trainer always gets the groups it waits for. A held
  group starts once ``gate.held`` lets it (a worker slot free); its offset is the partition's commit limit
  meanwhile. ``MemberSummary.gate_held_s`` is the time a worker slot was free while a group was held.
* Once the ledger says every loaded prompt group is done or failed (``PromptLedger.all_ended``) and nothing is
  in flight here, the member closes the run (``publisher.publish_end_of_run(options.run_id)``: every member that
  sees it sends the same run's markers, which the stages count once) and returns its ``MemberSummary``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.errors import BrokerError, ContractError, EngineRefused, SampleFailed
from rollout_bus.kafka.acls import GENERATORS_GROUP
from rollout_bus.kafka.clients import (ConsumerRebalanceListener, CooperativeStickyAssignor, KafkaError,
                                       KafkaTimeoutError, OffsetAndMetadata, RebalanceInProgressError, TopicPartition,
                                       new_consumer, wait_for_partitions)
from rollout_bus.kafka.prompt_ledger import LedgerLog
from rollout_bus.kafka.reader import fetch_records
from rollout_bus.model.sample import Sample
from rollout_bus.producers.resume_plan import Logged, ResumePlan, TurnFate
from rollout_bus.wire.codec import encode_samples
from rollout_bus.wire.dead_letter import DeadLetter, DlqKind, DlqStage, source_of
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.flow_metrics import ResumeCounts
from rollout_bus.wire.prompt_record import EpisodeProgress, LedgerEvent, PromptGroup, TurnMark
from rollout_bus.wire.rollout_key import rollout_key_of
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)

# (prompt group, per episode the turns the log holds, decoded) -> its turns in order, as (sample, publish_turn kwargs)
MakeTurns = Callable[[PromptGroup, Mapping[int, Logged]], Iterator[tuple[Sample, dict]]]
POLL_MS = 200
IDLE_CHECK_S = 1.0  # how often an idle member looks whether the run is over
COMMIT_TIMEOUT_MS = 30_000  # kafka-python 3 was seen to block in a commit without one (its IO thread idle)
REJOIN_AFTER_S = 20.0  # a rebalance unfinished this long (commits deferred all along): leave and join again


class HandedBack(Exception):
    """A prompt group stopped at a turn boundary: its partition was revoked, or the member stops."""


@dataclass(frozen=True)
class MemberOptions:
    generator_id: str
    run_id: str
    concurrency: int = 4
    max_deliveries: int = 3
    resume: bool = True  # a delivery above 1 continues from the log (False: every turn made and sent again)
    drain_s: float = 30.0
    session_timeout_ms: int = 6000
    max_poll_interval_ms: int = 300_000
    heartbeat_interval_ms: int = 1000


@dataclass
class MemberSummary:
    """What this member did: prompt groups done, failed, handed back, passed over (ended elsewhere); episodes and
    turns sent; whether it closed the run."""

    done: int = 0
    failed: int = 0
    handed_back: int = 0
    passed_over: int = 0
    redelivered: int = 0  # prompt groups it took at a delivery above 1
    gate_waits: int = 0  # prompt groups held back by the staleness bound before they started
    gate_held_s: float = 0.0  # seconds a worker slot was free while a prompt group was held back
    episodes: list[tuple[str, int]] = field(default_factory=list)
    turns_sent: int = 0
    closed_run: bool = False
    turns_reused: int = 0  # turns a taken-over delivery found on the log and did not make again
    tokens_reused: int = 0  # their response tokens
    episodes_resumed: int = 0  # episodes continued past turn 0 from the log
    episodes_reused: int = 0  # episodes found finished on the log

    def resume_counts(self) -> ResumeCounts:
        return ResumeCounts(self.episodes_resumed, self.episodes_reused, self.turns_reused, self.tokens_reused)

    def to_json(self) -> dict:
        return {"done": self.done, "failed": self.failed, "handed_back": self.handed_back,
                "passed_over": self.passed_over, "redelivered": self.redelivered, "gate_waits": self.gate_waits,
                "gate_held_s": round(self.gate_held_s, 3),
                "episodes_finished": len(self.episodes), "turns_sent": self.turns_sent, "closed_run": self.closed_run,
                "turns_reused": self.turns_reused, "tokens_reused": self.tokens_reused,
                "episodes_resumed": self.episodes_resumed, "episodes_reused": self.episodes_reused,
                "episodes": [[key, attempt] for key, attempt in self.episodes]}  # (rollout key, attempt) of each


@dataclass
class _Task:
    prompt: PromptGroup
    record: Any
    delivery: int
    cancel: threading.Event
    epoch: int  # its partition's epoch when it was claimed: moved on, it is not this member's to finish
    future: Future | None = None
    progress: dict[int, EpisodeProgress] = field(default_factory=dict)  # what the log holds (a delivery above 1)


@dataclass
class _Held:
    """A prompt group the staleness bound keeps from starting: its partition is read no further meanwhile."""

    prompt: PromptGroup
    record: Any
    epoch: int
    since: float
    said: bool = False


class _Member:
    def __init__(self, conn: Mapping[str, Any], topics: Topics, options: MemberOptions, make_turns: MakeTurns,
                 publisher: Any, stop: Callable[[], bool], progress: Callable[[MemberSummary], None] | None,
                 gate: Any = None) -> None:
        self.topics, self.options, self.make_turns, self.publisher = topics, options, make_turns, publisher
        self.stop, self.progress, self.gate = stop, progress, gate
        self.held: dict[int, _Held] = {}  # partition -> the prompt group the staleness bound holds back there
        self.summary = MemberSummary()
        self.tasks: dict[tuple[int, int], _Task] = {}  # (partition, offset) -> prompt group in flight
        self.next_offset: dict[int, tuple[int, int]] = {}  # partition -> (its epoch, the offset after the last taken)
        self.epochs: dict[int, int] = {}  # partition -> how many times it was revoked or lost (IO thread writes)
        self.lock = threading.Lock()  # the tasks and epochs, shared with the consumer's IO thread: held briefly
        self.send_lock = threading.Lock()  # the publisher, shared by the worker threads
        self.ledger = LedgerLog(conn, topics, client_id=f"{options.generator_id}-ledger")
        self.pool = ThreadPoolExecutor(options.concurrency, thread_name_prefix="prompt-group")
        self.conn = conn
        self.deferred_since: float | None = None  # when commits began to be deferred (a rebalance under way)
        self.consumer = self._new_consumer()

    def _new_consumer(self) -> Any:
        o = self.options
        return new_consumer(
            self.conn, group_id=self.topics.group(GENERATORS_GROUP), client_id=o.generator_id,
            auto_offset_reset="earliest", session_timeout_ms=o.session_timeout_ms,
            heartbeat_interval_ms=o.heartbeat_interval_ms, max_poll_records=o.concurrency,
            partition_assignment_strategy=(CooperativeStickyAssignor,), max_poll_interval_ms=o.max_poll_interval_ms)

    def _subscribe(self) -> None:
        member = self

        class Listener(ConsumerRebalanceListener):  # runs on the consumer's IO thread: it must not block
            def on_partitions_revoked(self, revoked: Any) -> None:
                member.moved({tp.partition for tp in revoked}, "revoked")

            def on_partitions_lost(self, lost: Any) -> None:
                member.moved({tp.partition for tp in lost}, "lost")

            def on_partitions_assigned(self, assigned: Any) -> None:
                logger.info("generator=%s took prompts partitions %s", member.options.generator_id,
                            sorted(tp.partition for tp in assigned))

        # the partitions known before the first join: an assignor without them assigns nothing, and the cooperative
        # one was seen not to rejoin when they arrived
        wait_for_partitions(self.consumer, self.topics.prompts)
        self.consumer.subscribe([self.topics.prompts], listener=Listener())

    def _rejoin_if_stuck(self) -> None:
        """kafka-python 3 was seen to leave a rebalance unfinished for good (its leader's SyncGroup never sent after
        a metadata update dropped the coordinator): every commit deferred, nothing moving. Past ``REJOIN_AFTER_S``
        of that, the member leaves (its consumer closed: a LeaveGroup) and joins again as a new consumer; what it
        held is handed back, as on any lost partition, and taken again at the next delivery."""
        if self.deferred_since is None or time.monotonic() - self.deferred_since < REJOIN_AFTER_S:
            return
        logger.warning("generator=%s: a rebalance of the generators' group has not finished in %.0fs: leaving the "
                       "group and joining it again (%d prompt group(s) in flight handed back)",
                       self.options.generator_id, time.monotonic() - self.deferred_since, len(self.tasks))
        self.moved({tp.partition for tp in self.consumer.assignment()} | set(self.next_offset), "left")
        self.held.clear()
        self.consumer.close(autocommit=False)
        self.consumer = self._new_consumer()
        self.deferred_since = None
        self._subscribe()

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self) -> MemberSummary:
        self._subscribe()
        last_check, last_loop = 0.0, time.monotonic()
        while not self.stop():
            now = time.monotonic()
            if self.held and len(self.tasks) < self.options.concurrency:
                self.summary.gate_held_s += now - last_loop
            last_loop = now
            self._rejoin_if_stuck()
            self._start_held()
            free = self.options.concurrency - len(self.tasks)
            # Poll even when every slot is busy: a rebalance (a member joined, or died) completes only once every
            # member polls. Busy, it polls without moving its positions (what comes back is fetched again later),
            # not with pause(): kafka-python parks a paused partition's fetched records past a rebalance.
            polled_at = time.monotonic()
            batch = self.consumer.poll(timeout_ms=POLL_MS, max_records=max(1, free), update_offsets=free > 0)
            records = [r for rs in batch.values() for r in rs] if free > 0 else []
            taken = 0
            if records:
                self.ledger.catch_up()
                skipped: dict[int, int] = {}  # partition held back -> the first offset read past its held group
                for record in sorted(records, key=lambda r: (r.partition, r.offset)):
                    if record.partition in self.held:
                        skipped.setdefault(record.partition, record.offset)
                        continue
                    self._take(record)
                    taken += 1
                for partition, offset in skipped.items():
                    self._rewind(partition, offset)
            if not taken and time.monotonic() - polled_at < POLL_MS / 2000:  # it gave back only what it had (busy,
                self._pause_loop()  # held back) or nothing at once (a rebalance under way): it waited for nothing
            self._reap()
            if not self.tasks and time.monotonic() - last_check >= IDLE_CHECK_S:
                last_check = time.monotonic()
                if self.ledger.catch_up().all_ended():
                    self._close_run()
                    break
        self._hand_back(self.options.drain_s)
        return self.summary

    def _take(self, record: Any) -> None:
        self.next_offset[record.partition] = (self._epoch(record.partition), record.offset + 1)
        try:
            prompt = PromptGroup.from_value(record.value)
        except ContractError as exc:
            self._dead_letter(record, DlqKind.DECODE, f"prompt record does not parse: {exc}")
            self._commit_or_fence()
            return
        ledger = self.ledger.ledger
        if prompt.id in ledger.ended:
            self.summary.passed_over += 1
            self._commit_or_fence()
            return
        if self.gate is not None and self.gate.held(prompt.group_index) is not None:
            self.held[record.partition] = _Held(prompt, record, self._epoch(record.partition), time.monotonic())
            self.summary.gate_waits += 1
            self._rewind(record.partition, record.offset + 1)
            self._start_held()  # says why it waits
            return
        self._start(prompt, record, ledger.deliveries.get(prompt.id, 0) + 1)

    def _start_held(self) -> None:
        """Start the held prompt groups the live weights now let start (lowest group first, while a slot is free);
        forget those whose partition moved on (another member reads it from the commit limit)."""
        for partition, held in sorted(self.held.items(), key=lambda item: item[1].prompt.group_index):
            if held.epoch != self._epoch(partition):
                del self.held[partition]
                continue
            why = self.gate.held(held.prompt.group_index)
            if why is not None:
                if not held.said:
                    held.said = True
                    logger.info("generator=%s: prompt group %s held: %s", self.options.generator_id, held.prompt.id,
                                why.describe())
                    if self.gate.on_wait is not None:
                        self.gate.on_wait(why)
                continue
            if len(self.tasks) >= self.options.concurrency:
                return
            del self.held[partition]
            self.gate.admitted(held.prompt.group_index, time.monotonic() - held.since)
            ledger = self.ledger.catch_up()
            if held.prompt.id in ledger.ended:
                self.summary.passed_over += 1
                continue
            self._start(held.prompt, held.record, ledger.deliveries.get(held.prompt.id, 0) + 1)

    def _rewind(self, partition: int, offset: int) -> None:
        """A held partition is read no further: its position goes back to ``offset`` (what was fetched past the held
        group is fetched again once it starts). Not ``pause()``: kafka-python was seen to keep a paused partition's
        position and records in ways a rebalance does not undo; a seek is plain."""
        tp = TopicPartition(self.topics.prompts, partition)
        if tp in self.consumer.assignment():
            self.consumer.seek(tp, offset)

    def _pause_loop(self) -> None:
        """Wait up to a poll's time for a prompt group in flight to end (or just the time, with none running), so a
        loop that polls only what it already had (busy, or held back) does not spin."""
        running = [t.future for t in list(self.tasks.values()) if t.future is not None and not t.future.done()]
        if running:
            wait(running, timeout=POLL_MS / 1000, return_when=FIRST_COMPLETED)
        else:
            time.sleep(POLL_MS / 1000)

    def _start(self, prompt: PromptGroup, record: Any, delivery: int, why: str = "") -> None:
        if delivery > self.options.max_deliveries:
            reason = (f"prompt group {prompt.id} (group_index {prompt.group_index}) was delivered "
                      f"{delivery - 1} times without finishing (max_deliveries {self.options.max_deliveries})"
                      + (f"; last: {why}" if why else ": its generators died or were stopped"))
            self._fail(prompt, record, delivery - 1, reason)
            return
        self.ledger.write(LedgerEvent("claimed", prompt.id, delivery, self.options.generator_id))
        if delivery > 1:
            self.summary.redelivered += 1
            logger.info("generator=%s takes prompt group %s (group_index %d) at delivery %d", self.options.generator_id,
                        prompt.id, prompt.group_index, delivery)
        task = _Task(prompt, record, delivery, threading.Event(), self._epoch(record.partition),
                     progress=dict(self.ledger.ledger.progress.get(prompt.id, {}))
                     if delivery > 1 and self.options.resume else {})
        task.future = self.pool.submit(self._generate, task)
        with self.lock:
            self.tasks[(record.partition, record.offset)] = task

    def _generate(self, task: _Task) -> list[tuple[str, int]]:
        """Worker thread: every turn of the prompt group, sent (or found on the log); returns once each sent one is
        acknowledged."""
        futures, episodes = [], []
        prompt = task.prompt
        plan = self._resume_plan(task)
        for sample, made in self.make_turns(prompt, plan.logged):
            if task.cancel.is_set():
                raise HandedBack(prompt.id)
            args = {k: v for k, v in made.items() if k != "observation"}  # the environment's answer: the mark's
            j = sample.index - prompt.group_index * prompt.n_samples
            fate = plan.take(j, sample, args, encode_samples([sample], TURN_FIELDS)) if plan.episodes else TurnFate.SEND
            if fate is not TurnFate.REUSE:
                resumed = fate is TurnFate.RESUME
                with self.send_lock:  # one sender at a time (never the state lock: the IO thread's listener takes it)
                    future = self.publisher.publish_turn(sample, delivery=task.delivery, resumed=resumed, **args)
                    self.summary.turns_sent += 1
                future.add_callback(self._noter(task, j, args, resumed, made.get("observation")))
                futures.append(future)
            if args["final"]:
                episodes.append((rollout_key_of(sample), args["attempt"]))
        for future in futures:
            future.get(timeout=self.publisher.delivery_timeout_s)
        if plan.episodes:
            with self.lock:
                s = self.summary
                s.turns_reused += plan.reused_turns
                s.tokens_reused += plan.reused_tokens
                s.episodes_resumed += plan.resumed_episodes
                s.episodes_reused += plan.reused_episodes
            logger.info("generator=%s: prompt group %s delivery %d resumed from the log: %d episode(s) found finished, "
                        "%d continued, %d turn(s) (%d response tokens) not made again", self.options.generator_id,
                        prompt.id, task.delivery, plan.reused_episodes, plan.resumed_episodes, plan.reused_turns,
                        plan.reused_tokens)
        return episodes

    def _resume_plan(self, task: _Task) -> ResumePlan:
        """What the log holds of the prompt group's episodes (a delivery above 1; nothing for the first)."""
        if not task.progress:
            return ResumePlan()
        wanted: dict[int, set[int]] = {}
        for held in task.progress.values():
            for mark in held.marks:
                wanted.setdefault(mark.partition, set()).add(mark.offset)
        began = time.monotonic()
        records = fetch_records(self.conn, self.topics.turns, wanted)
        plan = ResumePlan.of(task.prompt, task.progress, records)
        logger.info("generator=%s: prompt group %s delivery %d: %d logged turn(s) of %d episode(s) read back from %s "
                    "in %.3fs", self.options.generator_id, task.prompt.id, task.delivery, len(records),
                    len(task.progress), self.topics.turns, time.monotonic() - began)
        if plan.missing:
            logger.warning("generator=%s: prompt group %s: %d logged turn(s) are no longer on %s (retention or a "
                           "deleted topic), so they and what follows are made again: %s", self.options.generator_id,
                           task.prompt.id, len(plan.missing), self.topics.turns, "; ".join(plan.missing))
        return plan

    def _noter(self, task: _Task, j: int, args: Mapping[str, Any], resumed: bool,
               observation: Any = None) -> Callable[[Any], None]:
        """The producer callback that notes an acknowledged turn on the ledger (its ``progress`` event), with the
        environment's answer after it when the engine gave one (its tool call then never runs again)."""
        def note(metadata: Any) -> None:
            mark = TurnMark(j, args.get("attempt", 0), args["turn"], bool(args["final"]), resumed,
                            metadata.partition, metadata.offset,
                            None if observation is None else tuple(int(t) for t in observation))
            self.ledger.note(LedgerEvent("progress", task.prompt.id, task.delivery, self.options.generator_id,
                                         mark=mark))
        return note

    def _reap(self) -> None:
        """The prompt groups whose worker is over: done, failed, delivered again or handed back; then commit."""
        for where, task in list(self.tasks.items()):
            if not task.future.done():
                continue
            with self.lock:
                del self.tasks[where]
            exc = task.future.exception()
            if isinstance(exc, HandedBack) or task.epoch != self._epoch(where[0]):
                self.summary.handed_back += 1
                continue
            if isinstance(exc, (BrokerError, KafkaError)):
                raise exc
            if isinstance(exc, (EngineRefused, SampleFailed)):  # another delivery would fail the same way
                self._fail(task.prompt, task.record, task.delivery, f"prompt group {task.prompt.id} (group_index "
                           f"{task.prompt.group_index}) failed at delivery {task.delivery}: {type(exc).__name__}: {exc}")
                continue
            if exc is not None:
                why = f"{type(exc).__name__}: {exc}"
                logger.warning("generator=%s: prompt group %s delivery %d failed: %s", self.options.generator_id,
                               task.prompt.id, task.delivery, why)
                self._start(task.prompt, task.record, task.delivery + 1, why)
                continue
            committed = self._commit_or_fence(before=where)
            if committed is None:  # a rebalance is under way: decide once it is over (the partition may stay)
                with self.lock:
                    self.tasks[where] = task
                continue
            if not committed:
                self.summary.handed_back += 1
                continue
            self.ledger.write(LedgerEvent("done", task.prompt.id, task.delivery, self.options.generator_id))
            self.summary.done += 1
            self.summary.episodes.extend(task.future.result())
            if self.progress is not None:
                self.progress(self.summary)
        self._commit_or_fence()

    def _fail(self, prompt: PromptGroup, record: Any, deliveries: int, reason: str) -> None:
        logger.error("generator=%s: %s", self.options.generator_id, reason)
        self._dead_letter(record, DlqKind.FAILED_PROMPT, reason)
        self.ledger.write(LedgerEvent("failed", prompt.id, deliveries, self.options.generator_id, reason))
        self.summary.failed += 1

    def _dead_letter(self, record: Any, kind: DlqKind, reason: str) -> None:
        letter = DeadLetter(record.key, record.value, list(record.headers or []), reason, DlqStage.GENERATOR, kind,
                            source_of(record.topic, record.partition, record.offset))
        self.ledger.send(self.topics.dlq, letter.key, letter.value, letter.record_headers())

    # -- offsets, membership ----------------------------------------------------------------------------------

    def _safe_offsets(self) -> dict[int, int]:
        """Per partition this member holds: the first prompt group still in flight, else the offset after the last
        one taken (from this holding of the partition: an older one's offsets are not this member's to commit)."""
        held = {tp.partition for tp in self.consumer.assignment()}
        safe = {p: offset for p, (epoch, offset) in self.next_offset.items() if p in held and epoch == self._epoch(p)}
        for (partition, offset), task in list(self.tasks.items()):
            if partition in safe and task.epoch == self._epoch(partition):
                safe[partition] = min(safe[partition], offset)
        for partition, waiting in list(self.held.items()):
            if partition in safe and waiting.epoch == self._epoch(partition):
                safe[partition] = min(safe[partition], waiting.record.offset)
        return safe

    def _commit_or_fence(self, before: tuple[int, int] | None = None) -> bool | None:
        """Commit the safe offsets (up to ``before`` on its partition): True; None while a rebalance is under way
        or past its timeout (nothing committed, nothing lost: asked again after the next poll); False when the cluster
        refuses: this member is out of the group (a zombie back from SIGSTOP, or its session expired), so it writes nothing more
        of what it holds: the groups in flight are stopped and handed back (the listener is told as it rejoins)."""
        offsets = self._safe_offsets()
        if before is not None:
            if before[0] not in offsets:
                return False
            offsets[before[0]] = min(offsets[before[0]], before[1])
        if not offsets:
            return True
        try:
            self.consumer.commit({TopicPartition(self.topics.prompts, p): OffsetAndMetadata(o, "", -1)
                                  for p, o in offsets.items()}, timeout_ms=COMMIT_TIMEOUT_MS)
            self.deferred_since = None
            return True
        except (RebalanceInProgressError, KafkaTimeoutError) as exc:  # nothing committed, nothing lost: again later
            if self.deferred_since is None:
                self.deferred_since = time.monotonic()
                logger.info("generator=%s: commit deferred (%s)", self.options.generator_id, type(exc).__name__)
            return None
        except KafkaError as exc:
            logger.warning("generator=%s no longer holds its prompts partitions (%s): its %d prompt group(s) in "
                           "flight are handed back, their turns fenced by the next delivery", self.options.generator_id,
                           exc, len(self.tasks))
            self.moved(set(offsets), "refused")
            for tp in self.consumer.assignment():  # still held (a refusal, not an expired member): read them again
                if tp.partition in offsets:
                    self.consumer.seek(tp, offsets[tp.partition])
            return False

    def moved(self, partitions: set[int], how: str) -> None:
        """Partitions revoked (a member joined or left) or lost (this member was out of the group: a zombie): the
        prompt groups in flight on them stop at their next turn and are handed back, and nothing they did is
        written as done (their partition's epoch moved on). Called on the consumer's IO thread: never blocks."""
        with self.lock:
            for partition in partitions:
                self.epochs[partition] = self.epochs.get(partition, 0) + 1
            stopped = [task for (partition, _), task in self.tasks.items() if partition in partitions]
            for task in stopped:
                task.cancel.set()
        if stopped:
            logger.warning("generator=%s: prompts partitions %s %s: %d prompt group(s) in flight handed back",
                           self.options.generator_id, sorted(partitions), how, len(stopped))

    def _epoch(self, partition: int) -> int:
        with self.lock:
            return self.epochs.get(partition, 0)

    def _hand_back(self, drain_s: float) -> None:
        """Stopping: the prompt groups in flight get ``drain_s`` to finish (and be done), the rest are stopped at
        their next turn and handed back uncommitted."""
        deadline = time.monotonic() + drain_s
        while self.tasks and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        for task in self.tasks.values():
            task.cancel.set()
        for task in list(self.tasks.values()):
            task.future.exception()  # the worker stops at its next turn
        self._reap()

    def _close_run(self) -> None:
        counts = self.ledger.ledger.counts()
        logger.info("generator=%s: every loaded prompt group is over (%s): closing run=%s", self.options.generator_id,
                    counts, self.options.run_id)
        self.publisher.publish_end_of_run(self.options.run_id)
        self.summary.closed_run = True

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        try:
            self.consumer.close(autocommit=False)
        finally:
            self.ledger.close()


def run_member(conn: Mapping[str, Any], topics: Topics, options: MemberOptions, make_turns: MakeTurns,
               publisher: Any, *, stop: Callable[[], bool] = lambda: False,
               progress: Callable[[MemberSummary], None] | None = None, gate: Any = None) -> MemberSummary:
    """Take prompt groups until the run is over or ``stop()`` (see the module docstring)."""
    member = _Member(conn, topics, options, make_turns, publisher, stop, progress, gate)
    try:
        return member.run()
    finally:
        member.close()
