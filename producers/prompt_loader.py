"""Loading checked prompt lines onto rollout.prompts: each prompt group once per run, numbered in file order.

Why: a run's generators share the prompt groups on rollout.prompts, and batch k is fixed by ``group_index``. A
load must therefore give every new prompt group the next free index, never load an id twice (a file loaded
again, or after a failed load, adds only what is missing), and say on rollout.prompt_ledger when its groups
are all acknowledged, so a reader of the ledger knows how many prompt groups the run holds.

Contract of ``load_prompts(client_kwargs, topics, groups, *, progress=None)`` (``groups``: ``PromptLine``s from
``prompt_file.read_prompt_file``, already checked):

* Ensures rollout.prompts and rollout.prompt_ledger (``kafka.admin.ensure_topics``), then reads rollout.prompts
  to its end: the ids there are skipped (a WARNING counts those whose content in the file differs: the loaded
  one stays), and the new ones get ``group_index`` ``next, next+1, ...`` in file order, ``next`` being the number
  of prompt groups already there (past the greatest index if that is larger, so no index is given twice; a
  WARNING names a gap, which a load that failed halfway leaves). A record there that is not a prompt group is a
  ``ConfigError`` naming its position.
* A new prompt group whose record would be over ``max_record_bytes`` is a ``ConfigError`` naming its line,
  before anything is sent.
* Sends each as a ``PromptGroup`` record (key id, value, headers) with a durable producer (acks=all,
  idempotence: ``publisher.producer_defaults``), calling ``progress(done, total)`` after each send, then flushes.
  Any record not acknowledged is a ``BrokerError`` (``AccessDenied`` for a refusal) saying how many, and no
  ledger event is written: loading the file again sends just the missing ones.
* Then, once all are acknowledged, one ``LedgerEvent("loaded", count=C)`` (key ``LOADED_KEY``) on
  rollout.prompt_ledger, ``C`` = the prompt groups on rollout.prompts that no earlier ``loaded`` event counted
  (the ones sent now, and any a failed load left there), only when ``C > 0``: the ``loaded`` counts of the
  ledger add up to the prompt groups of the run.
* Returns a ``LoadSummary``: loaded, skipped, the group index range of the new ones, the ledger count.

One loader at a time per run: two loading at once could give the same index twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rollout_bus.errors import BrokerError, ConfigError, ContractError
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.kafka.clients import new_producer
from rollout_bus.kafka.reader import read_topic
from rollout_bus.kafka.refusals import explain, is_refusal, refusal, refusals_named
from rollout_bus.producers.prompt_file import PromptLine
from rollout_bus.producers.publisher import producer_defaults
from rollout_bus.wire.prompt_record import LOADED_KEY, LedgerEvent, PromptGroup
from rollout_bus.wire.topics import DEFAULT_MAX_RECORD_BYTES, Topics

logger = logging.getLogger(__name__)

READ_STALL_S = 30.0  # reading a topic to its end: no record for this long before the end is an error
DELIVERY_TIMEOUT_S = 120.0  # how long a prompt group may wait for the broker before the load fails
ACK_TIMEOUT_S = DELIVERY_TIMEOUT_S + 30.0

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class LoadSummary:
    """What a load did: ``loaded`` new prompt groups at ``first_index..last_index`` (None when none), ``skipped``
    lines whose id the run already had, and ``ledger_count``, the count of its ``loaded`` event (0: none)."""

    loaded: int
    skipped: int
    first_index: int | None = None
    last_index: int | None = None
    ledger_count: int = 0

    def describe(self) -> str:
        """``loaded N prompt groups (group_index A..B), skipped M already in the run``."""
        where = f" (group_index {self.first_index}..{self.last_index})" if self.loaded else ""
        return f"loaded {self.loaded} prompt groups{where}, skipped {self.skipped} already in the run"


@dataclass(frozen=True)
class _RunPrompts:
    """What rollout.prompts and the ledger hold: the prompt groups by id, the next index, the counted ones."""

    by_id: dict[str, PromptGroup]
    next_index: int
    counted: int  # prompt groups the ledger's ``loaded`` events count


def load_prompts(client_kwargs: Mapping[str, Any], topics: Topics, groups: Sequence[PromptLine], *,
                 progress: Progress | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> LoadSummary:
    """Load the prompt groups the run does not have yet (see the module docstring)."""
    conn = dict(client_kwargs)
    ensure_topics(conn, topics, only=[topics.prompts, topics.prompt_ledger], max_record_bytes=max_record_bytes)
    run = _read_run(conn, topics)
    new = [line for line in groups if line.id not in run.by_id]
    _warn_changed([line for line in groups if line.id in run.by_id], run.by_id)
    records = [line.group(run.next_index + offset) for offset, line in enumerate(new)]
    _check_sizes(new, records, max_record_bytes)
    producer = new_producer(conn, **{**producer_defaults(max_record_bytes, DELIVERY_TIMEOUT_S),
                                     "client_id": "rollout-bus-prompts"})
    try:
        _send(producer, conn, topics.prompts, records, progress)
        ledger_count = max(0, len(run.by_id) + len(records) - run.counted)
        if ledger_count:
            event = LedgerEvent("loaded", count=ledger_count)
            with refusals_named(f"writing {topics.prompt_ledger}", conn):
                producer.send(topics.prompt_ledger, key=event.key(), value=event.value(),
                              headers=event.headers()).get(timeout=ACK_TIMEOUT_S)
    finally:
        producer.close()
    logger.info("prompts loaded topic=%s loaded=%d skipped=%d next_index=%d ledger_count=%d", topics.prompts,
                len(records), len(groups) - len(new), run.next_index + len(records), ledger_count)
    return LoadSummary(loaded=len(records), skipped=len(groups) - len(new),
                       first_index=records[0].group_index if records else None,
                       last_index=records[-1].group_index if records else None, ledger_count=ledger_count)


def _read_run(conn: dict[str, Any], topics: Topics) -> _RunPrompts:
    """The prompt groups on rollout.prompts and the count of the ledger's ``loaded`` events."""
    by_id: dict[str, PromptGroup] = {}
    for record in read_topic(conn, topics.prompts, stall_s=READ_STALL_S):
        try:
            group = PromptGroup.from_value(record.value)
        except ContractError as exc:
            raise ConfigError(f"{topics.prompts}:{record.partition}:{record.offset} is not a prompt group ({exc}): "
                              "this topic prefix holds something else; use a fresh --topic-prefix") from exc
        by_id.setdefault(group.id, group)
    counted = 0
    for record in read_topic(conn, topics.prompt_ledger, stall_s=READ_STALL_S):
        if record.key == LOADED_KEY:
            try:
                counted += LedgerEvent.from_value(record.value).count
            except ContractError as exc:
                raise ConfigError(f"{topics.prompt_ledger}:{record.partition}:{record.offset} is not a ledger "
                                  f"event ({exc}); use a fresh --topic-prefix") from exc
    indices = sorted(group.group_index for group in by_id.values())
    next_index = max(len(indices), indices[-1] + 1 if indices else 0)
    if next_index != len(indices):
        missing = sorted(set(range(next_index)) - set(indices))
        logger.warning("prompt groups on %s have no group_index %s (a load that failed halfway, or two loads at "
                       "once): new ones start at %d", topics.prompts, _some(missing), next_index)
    return _RunPrompts(by_id=by_id, next_index=next_index, counted=counted)


def _some(values: list[int], most: int = 10) -> str:
    shown = ",".join(map(str, values[:most]))
    return shown + (f" and {len(values) - most} more" if len(values) > most else "")


def _warn_changed(known: list[PromptLine], by_id: dict[str, PromptGroup]) -> None:
    """One WARNING when lines of the file have the id of a loaded prompt group but other content."""
    changed = [line for line in known
               if line.group(0) != replace(by_id[line.id], group_index=0)]
    if changed:
        logger.warning("%d lines (first %s, id %r) have the id of a prompt group already in the run but other "
                       "content: the loaded ones stay (give changed prompts new ids, or use a fresh --topic-prefix)",
                       len(changed), changed[0].where, changed[0].id)


def _check_sizes(lines: list[PromptLine], records: list[PromptGroup], max_record_bytes: int) -> None:
    for line, record in zip(lines, records):
        size = len(record.value()) + len(record.key())
        if size > max_record_bytes:
            raise ConfigError(f"{line.where}: its prompt group is {size} bytes, over the record limit of "
                              f"{max_record_bytes} (ROLLOUT_BUS_MAX_RECORD_BYTES)")


def _send(producer: Any, conn: dict[str, Any], topic: str, records: list[PromptGroup],
          progress: Progress | None) -> None:
    """Send every record, flush, and raise when any was not acknowledged."""
    futures = []
    with refusals_named(f"writing {topic}", conn):
        for done, record in enumerate(records, start=1):
            futures.append(producer.send(topic, key=record.key(), value=record.value(), headers=record.headers()))
            if progress is not None:
                progress(done, len(records))
        producer.flush(timeout=ACK_TIMEOUT_S)
    failed = [f.exception for f in futures if not f.is_done or f.failed()]
    if not failed:
        return
    first = failed[0] if failed[0] is not None else TimeoutError(f"not acknowledged within {ACK_TIMEOUT_S:.0f}s")
    if is_refusal(first):
        raise refusal(first, f"writing {topic}", conn)
    raise BrokerError(f"{len(failed)} of {len(records)} prompt groups were not acknowledged by the cluster "
                      f"({explain(first)}); no load was recorded on the ledger: load the file again to send the "
                      "missing ones")
