"""The episodes of a replayed range: rollout.episodes records parsed as the shard writer parses them, or
rollout.turns records re-merged offline by the stream stage's own per-record logic.

Why a module of its own: both sources end as the same stream of members for the batcher, with what the
replayed stage would have dead-lettered reported as a ``Rejection``; the merge runs
``rollout_bus.streams.processor.TurnProcessor`` over an in-memory table, never a copy of its rules.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from typing import Any

from rollout_bus.consumers.shard_writer.episodes import EndOfRunMarker, Member, parse_record
from rollout_bus.wire.dead_letter import DlqKind, DlqStage, source_of
from rollout_bus.errors import ContractError
from rollout_bus.wire.positions import topic_prefix
from rollout_bus.wire.topics import Topics
from rollout_bus.replay.report import Rejection
from rollout_bus.streams.episode_state import EpisodeIndex
from rollout_bus.streams.processor import TurnProcessor, TurnRecord
from rollout_bus.streams.state import ChangelogState

_NEVER_MS = 2**62  # offline merge: windows never close, their metrics are not wanted here


def _members(topic: str, key: Any, value: Any, headers: Any, partition: int, offset: int,
             rejections: list[Rejection]) -> Iterator[Member]:
    """One rollout.episodes record as the writer parses it: a member, nothing (a marker), or a rejection."""
    try:
        item = parse_record(key, value, headers, partition=partition, offset=offset)
    except ContractError as exc:
        rejections.append(Rejection(source_of(topic, partition, offset), DlqStage.SHARDS, DlqKind.DECODE,
                                    f"episode record does not decode: {exc}"))
        return
    if not isinstance(item, EndOfRunMarker):
        yield item


def episodes_from_episode_records(records: Iterable[Any], rejections: list[Rejection]) -> Iterator[Member]:
    """rollout.episodes records as the writer parses them (episodes and abandoned episodes); undecodable ones
    are reported, end-of-run markers skipped."""
    for record in records:
        yield from _members(record.topic, record.key, record.value, record.headers, record.partition, record.offset,
                            rejections)


class TurnMerger:
    """The stream stage's per-record logic, offline: turns in, the episode records it would emit out."""

    def __init__(self, turns_topic: str) -> None:
        self.topics = Topics(prefix=topic_prefix(turns_topic))
        self.table = ChangelogState({})  # the stream stage's state mapping, with no changelog to write
        self._sent: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]] = []
        self.processor = TurnProcessor(self.table, self._send, self.topics, window_ms=_NEVER_MS, grace_ms=_NEVER_MS,
                                       reroute=False)  # one table for every partition: nothing is misplaced

    async def _send(self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]],
                    *, wait: bool, partition: int | None = None) -> None:
        self._sent.append((topic, key, value, headers))

    def episodes(self, records: Iterable[Any], rejections: list[Rejection]) -> Iterator[Member]:
        loop = asyncio.new_event_loop()
        try:
            for record in records:
                headers = [(k, bytes(v) if v is not None else b"") for k, v in (record.headers or [])]
                turn = TurnRecord(record.key, record.value, headers, record.topic, record.partition, record.offset,
                                  int(record.timestamp))
                loop.run_until_complete(self.processor.handle(turn))
                yield from self._drain(record, rejections)
            loop.run_until_complete(self.processor.drain())  # the deferred effects of the last finals
        finally:
            loop.close()

    def _drain(self, record: Any, rejections: list[Rejection]) -> Iterator[Member]:
        sent, self._sent = self._sent, []
        for topic, key, value, headers in sent:
            if topic == self.topics.episodes:
                yield from _members(topic, key, value, headers, record.partition, record.offset, rejections)
            elif topic == self.topics.dlq:
                found = {k: bytes(v).decode(errors="replace") for k, v in headers if k.startswith("dlq.")}
                rejections.append(Rejection(found.get("dlq.source", ""), DlqStage.STREAM, found.get("dlq.kind", ""),
                                            found.get("dlq.reason", "")))

    def open_episodes(self) -> int:
        """Episodes whose final turn was not in the range."""
        return sum(1 for k, v in self.table.items() if k.startswith(b"e|") and not EpisodeIndex.from_bytes(v).finished)
