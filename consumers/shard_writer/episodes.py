"""What the shard writer reads from rollout.episodes: episodes, abandoned episodes, end-of-run markers.

Contract:

* ``parse_record(key, value, headers, partition=, offset=)`` turns one rollout.episodes record
  into exactly one of:

  - ``Episode``: a data record (no ``control`` header), decoded with ``episode_record.decode_episode``;
    its segments must agree on adapter and group_index.
  - ``AbandonedEpisode``: an ``abandoned`` control record (``control_records.Abandoned``): an episode
    that will never arrive. Its group (adapter, group_index) comes from the record key
    (``rollout_key.parse_rollout_key``), attempt and group_size from the value.
  - ``EndOfRunMarker``: an ``end-of-run`` control record (``control_records.EndOfRun``) as the stream
    stage forwards it, i.e. with ``turns_partition`` and ``turns_partitions`` set.

  Anything else raises ``ContractError`` (``CodecError`` included) saying what is wrong; the
  writer dead-letters it.
* ``Episode`` and ``AbandonedEpisode`` are the two kinds of group member (``Member``): both have
  ``key``, ``attempt``, ``group_size``, ``group``, ``partition``, ``offset`` and ``sort_key()``
  (adapter slot, none first; adapter name; group_index; rollout kind and id; record key).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.sample import get_rollout_key
from rollout_bus.wire.control_records import Abandoned, EndOfRun
from rollout_bus.wire.episode_record import EpisodeInfo, decode_episode
from rollout_bus.wire.headers import CONTROL_ABANDONED, CONTROL_END_OF_RUN, control_kind
from rollout_bus.wire.rollout_key import parse_rollout_key
from rollout_bus.model.sample import AdapterRef, Sample

GroupKey = tuple[AdapterRef | None, int]
Headers = tuple[tuple[str, bytes], ...]


def _adapter_order(adapter: AdapterRef | None) -> tuple[int, str]:
    return (-1, "") if adapter is None else (adapter.slot, adapter.name)


@dataclass(frozen=True, eq=False)
class Episode:
    """One finished episode read from rollout.episodes: its sibling segments and where it came from."""

    key: str
    attempt: int
    group_size: int
    segments: tuple[Sample, ...]
    partition: int
    offset: int
    value: bytes | None = None
    headers: Headers = ()

    @property
    def adapter(self) -> AdapterRef | None:
        return self.segments[0].adapter

    @property
    def group_index(self) -> int:
        return int(self.segments[0].group_index)

    @property
    def group(self) -> GroupKey:
        return (self.adapter, self.group_index)

    def sort_key(self) -> tuple[Any, ...]:
        """Batch order: adapter slot (none first), group, rollout id, then the record key."""
        _, kind, _, ident = get_rollout_key(self.segments[0], 0)
        return (*_adapter_order(self.adapter), self.group_index, kind, ident, self.key)


@dataclass(frozen=True, eq=False)
class AbandonedEpisode:
    """An ``abandoned`` control record: the episode ``key`` (this attempt) will never arrive."""

    key: str
    attempt: int
    group_size: int
    adapter: AdapterRef | None
    group_index: int
    rollout_kind: str
    rollout_id: int
    kind: str     # the dead-letter kind that ended the episode upstream
    reason: str
    source: str   # topic:partition:offset of the final turn
    partition: int
    offset: int
    value: bytes | None = None
    headers: Headers = ()

    @property
    def group(self) -> GroupKey:
        return (self.adapter, self.group_index)

    def sort_key(self) -> tuple[Any, ...]:
        return (*_adapter_order(self.adapter), self.group_index, self.rollout_kind, self.rollout_id, self.key)

    def as_json(self) -> dict[str, Any]:
        """Its manifest entry: enough for a replay or a restart to reach the same decision."""
        return {"key": self.key, "attempt": self.attempt, "kind": self.kind, "reason": self.reason,
                "source": self.source, "partition": self.partition, "offset": self.offset}


@dataclass(frozen=True)
class EndOfRunMarker:
    """An ``end-of-run`` marker of turns partition ``turns_partition`` (of ``turns_partitions``),
    read from rollout.episodes partition ``partition`` at ``offset``."""

    run: str
    turns_partition: int
    turns_partitions: int
    partition: int
    offset: int


Member = Union[Episode, AbandonedEpisode]
Record = Union[Episode, AbandonedEpisode, EndOfRunMarker]


def _key_text(key: bytes | str | None) -> str:
    if key is None:
        raise ContractError(must_be("record key", "the rollout key string", None))
    try:
        return key if isinstance(key, str) else bytes(key).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(must_be("record key", "UTF-8 text", bytes(key)[:64])) from exc


def _headers(headers: Iterable[tuple[str, bytes]] | None) -> Headers:
    return tuple((k, bytes(v) if v is not None else b"") for k, v in (headers or ()))


def parse_record(key: bytes | str | None, value: bytes | None, headers: Iterable[tuple[str, bytes]] | None = (),
                 *, partition: int, offset: int) -> Record:
    """One rollout.episodes record as an episode, an abandoned episode or an end-of-run marker."""
    kept = _headers(headers)
    control = control_kind(kept)
    if control is None:
        return parse_episode(key, value, kept, partition=partition, offset=offset)
    if control == CONTROL_ABANDONED:
        return parse_abandoned(key, value, kept, partition=partition, offset=offset)
    if control == CONTROL_END_OF_RUN:
        marker = EndOfRun.from_value(value)
        if marker.turns_partition is None or marker.turns_partitions is None or marker.turns_partitions < 1 \
                or not 0 <= marker.turns_partition < marker.turns_partitions:
            raise ContractError(must_be("end-of-run turns_partition/turns_partitions",
                                        "0 <= turns_partition < turns_partitions (set when the stream stage "
                                        "forwards the marker)", (marker.turns_partition, marker.turns_partitions)))
        return EndOfRunMarker(marker.run, marker.turns_partition, marker.turns_partitions, partition, offset)
    raise ContractError(must_be("control header", f"{CONTROL_ABANDONED!r} or {CONTROL_END_OF_RUN!r} on "
                                                  "rollout.episodes", control))


def parse_abandoned(key: bytes | str | None, value: bytes | None, headers: Iterable[tuple[str, bytes]] = (),
                    *, partition: int, offset: int) -> AbandonedEpisode:
    """Decode and check one ``abandoned`` control record; ContractError says what is wrong."""
    key_text = _key_text(key)
    adapter, rollout_kind, group_index, ident = parse_rollout_key(key_text)
    marker = Abandoned.from_value(value)
    return AbandonedEpisode(key_text, marker.attempt, marker.group_size, adapter, group_index, rollout_kind, ident,
                            marker.kind, marker.reason, marker.source, partition, offset,
                            None if value is None else bytes(value), _headers(headers))


def parse_episode(key: bytes | str | None, value: bytes | None, headers: Iterable[tuple[str, bytes]] = (),
                  *, partition: int, offset: int) -> Episode:
    """Decode and check one rollout.episodes data record; ContractError says what is wrong."""
    key_text = _key_text(key)
    if value is None:
        raise ContractError(must_be("record value", "an encoded episode", None))
    segments, info = decode_episode(bytes(value))
    _check_segments(segments, info)
    return Episode(key_text, int(info.attempt), int(info.group_size), tuple(segments), partition, offset,
                   bytes(value), _headers(headers))


def _check_segments(segments: Sequence[Sample], info: EpisodeInfo) -> None:
    first = segments[0]
    if not isinstance(first.group_index, int) or first.group_index < 0:
        raise ContractError(must_be("group_index", "an integer >= 0 (episodes gather by prompt group)",
                                    first.group_index))
    if not isinstance(info.group_size, int) or info.group_size < 1:
        raise ContractError(must_be("episode group_size", "an integer >= 1", info.group_size))
    if not isinstance(info.attempt, int) or info.attempt < 0:
        raise ContractError(must_be("episode attempt", "an integer >= 0", info.attempt))
    for i, segment in enumerate(segments[1:], start=1):
        for name in ("adapter", "group_index"):
            if getattr(segment, name) != getattr(first, name):
                raise ContractError(must_be(f"segments[{i}].{name}", f"equal to segment 0's ({getattr(first, name)!r})",
                                            getattr(segment, name)))
