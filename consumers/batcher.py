"""Batch formation for the shard writer: pure bookkeeping, no Kafka, no files.

Contract:

* ``parse_episode(key, value, headers, partition=, offset=)`` decodes one rollout.episodes record
  (``rollout_bus.records.decode_episode``) into an ``Episode``; ``ContractError`` (``CodecError``
  included) when it does not decode or its segments disagree on adapter / group_index.
* ``Batcher.add(episode)`` gathers episodes by group ``(adapter, group_index)``. An episode is one
  rollout key: a second record with the same key and attempt is a duplicate (dropped, counted); a
  higher attempt replaces a lower one (the lower is dropped, also when it arrives after the higher
  was batched); an episode of a group or step range already formed is dropped when that episode
  (or a higher attempt of it) is in the batch, else rejected ("late", for the DLQ): a retry that
  arrives after its range was formed is therefore late, the one way arrival order can matter.
  An episode whose ``group_size`` disagrees with its group's, or that would overfill a complete
  group, is rejected too. The result says which, with a reason.
* ``ready()`` pops the batches that are due. ``step``: batch ``k`` holds the groups whose
  group_index lies in ``[k*G, (k+1)*G)``, across adapters; it is due when every index of the range
  has a group and every group of the range is complete, so its contents are a function of the
  episodes alone (group indices are assumed global across adapters; were the same index used by
  two adapters, a group that has not started when the range is due would be rejected as late).
  ``arrival``: the first G groups to complete, in completion order, form batch ``next_seq``.
* ``flush()`` pops everything still pending as partial batches (``Batch.partial``): in step mode
  one per open range, in arrival mode chunks of up to G groups (complete ones first); incomplete
  groups are included, so nothing read is left out.
* Inside a batch, episodes are ordered by (adapter slot, -1 for none first; adapter name;
  group_index; rollout kind and id; record key) and keep their segment order.
* ``done(batch)`` marks a batch written or dead-lettered: its offsets are released and later
  copies of its episodes count as duplicates. ``mark_written`` does the same for a batch found on
  disk at start-up.
* ``commit_offsets()``: per partition, the smallest offset of any episode still pending (added but
  not ``done``), else one past the last offset seen. Nothing past a pending episode is committed.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rollout_bus.errors import ConfigError, ContractError, must_be
from rollout_bus.metrics import get_rollout_key
from rollout_bus.records import EpisodeInfo, decode_episode
from rollout_bus.sample import AdapterRef, Sample

BATCHING_MODES = ("step", "arrival")
GroupKey = tuple[AdapterRef | None, int]


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
    headers: tuple[tuple[str, bytes], ...] = ()

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
        adapter = self.adapter
        _, kind, _, ident = get_rollout_key(self.segments[0], 0)
        return (-1 if adapter is None else adapter.slot, "" if adapter is None else adapter.name,
                self.group_index, kind, ident, self.key)


def parse_episode(key: bytes | str | None, value: bytes | None, headers: Iterable[tuple[str, bytes]] = (),
                  *, partition: int, offset: int) -> Episode:
    """Decode and check one rollout.episodes record; ContractError says what is wrong."""
    if key is None:
        raise ContractError(must_be("record key", "the rollout key string", None))
    try:
        key_text = key if isinstance(key, str) else bytes(key).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(must_be("record key", "UTF-8 text", bytes(key)[:64])) from exc
    if value is None:
        raise ContractError(must_be("record value", "an encoded episode", None))
    segments, info = decode_episode(bytes(value))
    _check_segments(segments, info)
    return Episode(key_text, int(info.attempt), int(info.group_size), tuple(segments), partition, offset,
                   bytes(value), tuple((k, bytes(v)) for k, v in (headers or ())))


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


class Outcome(str, Enum):
    """What ``Batcher.add`` did with an episode."""

    ACCEPTED = "accepted"      # pending in its group
    REPLACED = "replaced"      # accepted, superseding a lower attempt of the same rollout key
    DUPLICATE = "duplicate"    # same key and attempt already pending or written: dropped
    SUPERSEDED = "superseded"  # a higher attempt of the key is pending: dropped
    REJECTED = "rejected"      # cannot be placed: goes to the DLQ with ``reason``


@dataclass(frozen=True)
class AddResult:
    outcome: Outcome
    reason: str = ""
    kind: str = ""


@dataclass(frozen=True)
class GroupSummary:
    adapter: AdapterRef | None
    group_index: int
    group_size: int
    episodes: int

    @property
    def complete(self) -> bool:
        return self.episodes >= self.group_size

    def as_json(self) -> dict[str, Any]:
        return {"adapter": None if self.adapter is None else self.adapter.name,
                "adapter_slot": -1 if self.adapter is None else self.adapter.slot,
                "group_index": self.group_index, "group_size": self.group_size,
                "episodes": self.episodes, "complete": self.complete}


@dataclass(frozen=True)
class Batch:
    """Episodes that become one trainer batch, in batch order."""

    seq: int
    episodes: tuple[Episode, ...]
    groups: tuple[GroupSummary, ...]
    partial: bool = False

    def samples(self) -> list[Sample]:
        return [segment for episode in self.episodes for segment in episode.segments]


@dataclass
class _Group:
    group_size: int
    episodes: dict[str, Episode] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.episodes) >= self.group_size


class OffsetTracker:
    """Per-partition commit positions that never pass an episode still pending."""

    def __init__(self) -> None:
        self._next: dict[int, int] = {}
        self._held: dict[int, list[int]] = {}
        self._released: dict[int, Counter[int]] = {}

    def seen(self, partition: int, offset: int) -> None:
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def hold(self, partition: int, offset: int) -> None:
        heapq.heappush(self._held.setdefault(partition, []), offset)

    def release(self, partition: int, offset: int) -> None:
        self._released.setdefault(partition, Counter())[offset] += 1

    def positions(self) -> dict[int, int]:
        """The offset to commit per partition: the first pending one, else one past the last seen."""
        out = {}
        for partition, nxt in self._next.items():
            heap, released = self._held.get(partition, []), self._released.get(partition, Counter())
            while heap and released[heap[0]] > 0:  # lazy deletion keeps release O(1)
                released[heap[0]] -= 1
                heapq.heappop(heap)
            out[partition] = heap[0] if heap else nxt
        return out

    def pending(self) -> int:
        """Offsets held and not yet released."""
        released = sum(sum(c.values()) for c in self._released.values())
        return sum(len(h) for h in self._held.values()) - released


def _group_order(group: GroupKey) -> tuple[int, str, int]:
    adapter, group_index = group
    return (-1 if adapter is None else adapter.slot, "" if adapter is None else adapter.name, group_index)


class Batcher:
    """Gathers episodes into groups and groups into batches; see the module docstring."""

    def __init__(self, groups_per_batch: int, batching: str = "step", *, first_seq: int = 0) -> None:
        if isinstance(groups_per_batch, bool) or not isinstance(groups_per_batch, int) or groups_per_batch < 1:
            raise ConfigError(must_be("groups_per_batch", "an integer >= 1", groups_per_batch))
        if batching not in BATCHING_MODES:
            raise ConfigError(must_be("batching", f"one of {', '.join(BATCHING_MODES)}", batching))
        self.groups_per_batch = groups_per_batch
        self.batching = batching
        self.offsets = OffsetTracker()
        self.counts: Counter[str] = Counter()
        self._groups: dict[GroupKey, _Group] = {}
        self._pending: dict[str, Episode] = {}      # rollout key -> its pending episode
        self._written: dict[str, int] = {}          # rollout key -> attempt in a formed batch
        self._closed_ranges: set[int] = set()       # step: ranges already formed
        self._closed_groups: dict[GroupKey, int] = {}  # arrival: group -> its batch seq
        self._ranges: dict[int, set[GroupKey]] = {}  # step: open range -> its groups
        self._touched: set[int] = set()
        self._completed: list[GroupKey] = []        # arrival: complete groups, completion order
        self._next_seq = first_seq

    # ------------------------------------------------------------------ state

    @property
    def pending_episodes(self) -> int:
        return len(self._pending)

    @property
    def open_groups(self) -> int:
        return len(self._groups)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def commit_offsets(self) -> dict[int, int]:
        return self.offsets.positions()

    def mark_written(self, seq: int, episodes: Iterable[tuple[str, int]], groups: Iterable[GroupKey]) -> None:
        """A batch found complete on disk: its episodes are done, its groups (or range) closed."""
        for key, attempt in episodes:
            self._written[key] = int(attempt)
        if self.batching == "step":
            self._closed_ranges.add(seq)
        else:
            for group in groups:
                self._closed_groups[group] = seq
        self._next_seq = max(self._next_seq, seq + 1)

    # ------------------------------------------------------------------ adding

    def add(self, episode: Episode) -> AddResult:
        """Place one episode; the result says whether it is pending, dropped or rejected."""
        self.offsets.seen(episode.partition, episode.offset)
        result = self._place(episode)
        self.counts[result.outcome.value] += 1
        return result

    def skip(self, partition: int, offset: int) -> None:
        """A record that never became an episode (dead-lettered at once): commit may pass it."""
        self.offsets.seen(partition, offset)

    def _closed_seq(self, group: GroupKey) -> int | None:
        if self.batching == "step":
            k = group[1] // self.groups_per_batch
            return k if k in self._closed_ranges else None
        return self._closed_groups.get(group)

    def _place(self, ep: Episode) -> AddResult:
        written = self._written.get(ep.key)
        if written is not None:
            if written == ep.attempt:
                return AddResult(Outcome.DUPLICATE)
            if ep.attempt < written:
                return AddResult(Outcome.SUPERSEDED)
            return AddResult(Outcome.REJECTED, f"late: attempt {ep.attempt} of rollout {ep.key} arrived after "
                                               f"attempt {written} was batched", "late")
        closed = self._closed_seq(ep.group)
        if closed is not None:
            return AddResult(Outcome.REJECTED, f"late: rollout {ep.key} of group {_describe(ep.group)} arrived "
                                               f"after its batch {closed} was formed", "late")
        current = self._pending.get(ep.key)
        if current is not None:
            return self._replace(current, ep)
        group = self._groups.get(ep.group)
        if group is not None and group.group_size != ep.group_size:
            return AddResult(Outcome.REJECTED, must_be("group_size", f"{group.group_size} as for the rest of group "
                                                       f"{_describe(ep.group)}", ep.group_size), "group")
        if group is not None and group.complete:
            return AddResult(Outcome.REJECTED, f"group {_describe(ep.group)} already holds its {group.group_size} "
                                               f"episodes; rollout {ep.key} is one too many", "group")
        if group is None:
            group = self._groups[ep.group] = _Group(ep.group_size)
            if self.batching == "step":
                self._ranges.setdefault(ep.group_index // self.groups_per_batch, set()).add(ep.group)
        group.episodes[ep.key] = ep
        self._pending[ep.key] = ep
        self.offsets.hold(ep.partition, ep.offset)
        if self.batching == "step":
            self._touched.add(ep.group_index // self.groups_per_batch)
        elif group.complete:
            self._completed.append(ep.group)
        return AddResult(Outcome.ACCEPTED)

    def _replace(self, current: Episode, ep: Episode) -> AddResult:
        """Two records of one rollout key: the higher attempt is the episode."""
        if ep.attempt == current.attempt:
            return AddResult(Outcome.DUPLICATE)
        if ep.attempt < current.attempt:
            return AddResult(Outcome.SUPERSEDED)
        if ep.group != current.group or ep.group_size != current.group_size:
            return AddResult(Outcome.REJECTED, must_be("group", f"{_describe(current.group)} of size "
                                                       f"{current.group_size} as attempt {current.attempt} of "
                                                       f"rollout {ep.key}", _describe(ep.group)), "group")
        self._groups[ep.group].episodes[ep.key] = ep
        self._pending[ep.key] = ep
        self.offsets.release(current.partition, current.offset)
        self.offsets.hold(ep.partition, ep.offset)
        return AddResult(Outcome.REPLACED)

    # ------------------------------------------------------------------ batches

    def ready(self) -> list[Batch]:
        """Pop the batches that are due, in seq order."""
        G = self.groups_per_batch
        if self.batching == "arrival":
            batches = []
            while len(self._completed) >= G:
                chosen, self._completed = self._completed[:G], self._completed[G:]
                batches.append(self._form(self._take_seq(), chosen, partial=False))
            return batches
        due = []
        for k in sorted(self._touched):
            groups = self._ranges.get(k, set())
            indices = {g[1] for g in groups}
            if len(indices) == G and all(self._groups[g].complete for g in groups):
                due.append(k)
        self._touched.clear()
        return [self._form(k, sorted(self._ranges.pop(k), key=_group_order), partial=False) for k in due]

    def flush(self) -> list[Batch]:
        """Pop everything pending as partial batches (incomplete groups included)."""
        if self.batching == "step":
            self._touched.clear()
            return [self._form(k, sorted(self._ranges.pop(k), key=_group_order), partial=True)
                    for k in sorted(self._ranges)]
        rest = sorted((g for g in self._groups if g not in set(self._completed)), key=_group_order)
        order, self._completed = self._completed + rest, []
        G = self.groups_per_batch
        batches = []
        for start in range(0, len(order), G):
            chosen = order[start:start + G]
            partial = len(chosen) < G or not all(self._groups[g].complete for g in chosen)
            batches.append(self._form(self._take_seq(), chosen, partial=partial))
        return batches

    def done(self, batch: Batch) -> None:
        """The batch is written (or dead-lettered): its offsets may be committed."""
        for episode in batch.episodes:
            self.offsets.release(episode.partition, episode.offset)

    def _take_seq(self) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def _form(self, seq: int, group_keys: Sequence[GroupKey], *, partial: bool) -> Batch:
        episodes, summaries = [], []
        for key in group_keys:
            group = self._groups.pop(key)
            summaries.append(GroupSummary(key[0], key[1], group.group_size, len(group.episodes)))
            episodes.extend(group.episodes.values())
            if self.batching == "arrival":
                self._closed_groups[key] = seq
        for episode in episodes:
            del self._pending[episode.key]
            self._written[episode.key] = episode.attempt
        episodes.sort(key=Episode.sort_key)
        summaries.sort(key=lambda s: _group_order((s.adapter, s.group_index)))
        if self.batching == "step":
            self._closed_ranges.add(seq)
        return Batch(seq, tuple(episodes), tuple(summaries), partial)


def _describe(group: GroupKey) -> str:
    adapter, group_index = group
    return f"(adapter={None if adapter is None else adapter.name}, group_index={group_index})"
