"""Batch formation for the shard writer: pure bookkeeping, no Kafka, no files.

Contract:

* A group ``(adapter, group_index)`` gathers members (``rollout_bus.consumers.shard_writer.episodes.Member``): episodes,
  and ``abandoned`` records for episodes that will never arrive. A group is complete when it
  holds ``group_size`` members; abandoned ones count as present, so batch boundaries follow from
  the log alone, never from a clock.
* ``Batcher.add(member)`` places one. A rollout key is one member: a second record with the same
  key and attempt is a duplicate (dropped, counted), except that an episode replaces an abandoned
  record of the same attempt while both are pending (the data wins); a higher attempt replaces a
  lower one (the lower is dropped, also when it arrives after the higher was batched). A member
  of a group or step range already formed is dropped when its key (as episode or abandoned, that
  attempt or a higher one) is in that batch, else rejected ("late", for the DLQ): a retry, or an
  abandoned record, that arrives after its range was formed is therefore late, the one way
  arrival order can matter. A member whose ``group_size`` disagrees with its group's, or that
  would overfill a complete group, is rejected too. The result says which, with a reason.
* ``Batcher(run)`` batches by ``run`` (``rollout_bus.wire.run_record.RunBatching``: the mode, G =
  ``groups_per_batch``, and the step rule ``run.batch_of(group_index)``, checked when ``run`` was built).
* ``ready()`` pops the batches that are due. ``step``: batch ``k`` holds the groups whose
  group_index lies in ``[k*G, (k+1)*G)`` (``run.batch_of``), across adapters; it is due when every index of the range
  has a group and every group of the range is complete, so its contents are a function of the
  log alone (group indices are assumed global across adapters; were the same index used by
  two adapters, a group that has not started when the range is due would be rejected as late).
  ``arrival``: the first G groups to complete, in completion order, form batch ``next_seq``.
* ``flush()`` pops everything still pending as partial batches (``Batch.partial``): in step mode
  one per open range, in arrival mode chunks of up to G groups (complete ones first); incomplete
  groups are included, so nothing read is left out. The writer flushes on the end-of-run marker. Such a
  group is never short in silence: one WARNING line names it, its batch and how many episodes it lacks, and
  ``incomplete_groups`` counts it (the manifest says ``complete: false``). Written, not quarantined: its
  episodes are whole, and a member that will never come after the run's end has no data to wait for.
* What a batch holds (``Batch``, ``GroupSummary``) and the staleness split of one (``split_stale``)
  are ``rollout_bus.consumers.shard_writer.batch``. A batch with no episode is not written: the
  caller logs it and calls ``done``; its seq is simply absent from the output (step seqs stay
  ``run.batch_of(group_index)``). Stale episodes stay members: ``done`` releases their offsets too.
* Inside a batch, members are ordered by (adapter slot, -1 for none first; adapter name;
  group_index; rollout kind and id; record key) and episodes keep their segment order.
* ``done(batch)`` marks a batch written, dead-lettered or skipped (empty): its offsets are
  released. ``mark_written`` does the same for a batch found on disk at start-up. ``hold`` /
  ``release`` keep a control record (an end-of-run marker) from being committed past until the
  decision it drives is written.
* ``commit_offsets()``: per partition, the smallest offset still held (a member added and not
  ``done``, a held control record), else one past the last offset seen.
* Bounded memory. The keys of formed batches are remembered (to tell a duplicate from a late
  record) only for the ``written_memory`` most recent batch seqs that are done; older ones are
  forgotten, and a member that arrives for a closed range or group whose keys were forgotten is
  looked up with ``lookup(seq)`` (the writer reads that batch's manifest on disk): found there it
  is a duplicate, else late. Without ``lookup`` it is late. Closed step ranges are kept as a
  watermark plus the closed seqs above it (one int per batch at worst, when a seq is never closed
  in this process). Closed arrival groups (group -> seq) are kept for the whole run: in arrival
  mode nothing about a group's index says whether its batch was formed, so this map (one small
  entry per group, never per episode) is what tells a late record from the start of a new group.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from rollout_bus.consumers.shard_writer.batch import Batch, GroupSummary
from rollout_bus.consumers.shard_writer.episodes import AbandonedEpisode, Episode, GroupKey, Member
from rollout_bus.consumers.shard_writer.offset_tracker import OffsetTracker
from rollout_bus.errors import ConfigError, must_be
from rollout_bus.wire.dead_letter import DlqKind
from rollout_bus.wire.run_record import RunBatching

__all__ = ["AddResult", "Batcher", "Outcome", "WrittenLookup"]

logger = logging.getLogger(__name__)

DEFAULT_WRITTEN_MEMORY = 64
# seq -> {rollout key: attempt} of that batch as written (episodes and abandoned), or None when absent
WrittenLookup = Callable[[int], Mapping[str, int] | None]


class Outcome(str, Enum):
    """What ``Batcher.add`` did with a member."""

    ACCEPTED = "accepted"      # pending in its group
    REPLACED = "replaced"      # accepted, superseding a lower attempt (or an abandoned record) of the key
    DUPLICATE = "duplicate"    # same key and attempt already pending or written: dropped
    SUPERSEDED = "superseded"  # a higher attempt of the key is pending or written: dropped
    REJECTED = "rejected"      # cannot be placed: goes to the DLQ with ``reason``


@dataclass(frozen=True)
class AddResult:
    outcome: Outcome
    reason: str = ""
    kind: DlqKind | str = ""


@dataclass
class _Group:
    group_size: int
    members: dict[str, Member] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.members) >= self.group_size


class _ClosedRanges:
    """Step ranges already formed: every range below ``below``, plus the closed ones above it."""

    def __init__(self) -> None:
        self.below = 0
        self.above: set[int] = set()

    def add(self, k: int) -> None:
        if k >= self.below:
            self.above.add(k)
        while self.below in self.above:
            self.above.remove(self.below)
            self.below += 1

    def __contains__(self, k: int) -> bool:
        return k < self.below or k in self.above


def _group_order(group: GroupKey) -> tuple[int, str, int]:
    adapter, group_index = group
    return (-1 if adapter is None else adapter.slot, "" if adapter is None else adapter.name, group_index)


class Batcher:
    """Gathers members into groups and groups into batches; see the module docstring."""

    def __init__(self, run: RunBatching, *, first_seq: int = 0, written_memory: int = DEFAULT_WRITTEN_MEMORY,
                 lookup: WrittenLookup | None = None) -> None:
        if isinstance(written_memory, bool) or not isinstance(written_memory, int) or written_memory < 1:
            raise ConfigError(must_be("written_memory", "an integer >= 1", written_memory))
        self.run = run  # checked when built: its groups_per_batch, its mode, its rule (``batch_of``)
        self.groups_per_batch = run.groups_per_batch
        self.batching = run.batching
        self.written_memory = written_memory
        self.offsets = OffsetTracker()
        self.counts: Counter[str] = Counter()
        self._lookup = lookup
        self._groups: dict[GroupKey, _Group] = {}
        self._pending: dict[str, Member] = {}       # rollout key -> its pending member
        self._written: dict[str, int] = {}          # rollout key -> attempt, for remembered batches
        self._remembered: dict[int, list[str]] = {}  # batch seq -> its keys (see "Bounded memory")
        self._unfinished: set[int] = set()          # formed, not yet done: never forgotten
        self._closed_ranges = _ClosedRanges()       # step: ranges already formed
        self._closed_groups: dict[GroupKey, int] = {}  # arrival: group -> its batch seq
        self._ranges: dict[int, set[GroupKey]] = {}  # step: open range -> its groups
        self._touched: set[int] = set()
        self._completed: list[GroupKey] = []        # arrival: complete groups, completion order
        self._next_seq = first_seq
        self.incomplete_groups = 0                  # groups flushed without all their members (``flush``)

    # ------------------------------------------------------------------ state

    @property
    def pending_episodes(self) -> int:
        """Members (episodes and abandoned records) waiting for their batch."""
        return len(self._pending)

    @property
    def next_seq(self) -> int:
        """One past the highest seq formed or marked written (step seqs are range indices, so gaps count)."""
        return self._next_seq

    @property
    def unfinished_batches(self) -> int:
        """Batches formed (``ready``/``flush``) and not yet ``done``."""
        return len(self._unfinished)

    @property
    def remembered_keys(self) -> int:
        """Rollout keys of formed batches still in memory (bounded by ``written_memory`` batches)."""
        return len(self._written)

    def commit_offsets(self) -> dict[int, int]:
        return self.offsets.positions()

    def hold(self, partition: int, offset: int) -> None:
        """A control record whose decision is not written yet: commits stop before it."""
        self.offsets.seen(partition, offset)
        self.offsets.hold(partition, offset)

    def release(self, partition: int, offset: int) -> None:
        self.offsets.release(partition, offset)

    def mark_written(self, seq: int, keys: Iterable[tuple[str, int]], groups: Iterable[GroupKey]) -> None:
        """A batch found complete on disk: its keys (episodes and abandoned) are done, its groups (or range) closed."""
        keys = list(keys)
        for key, attempt in keys:
            self._written[key] = int(attempt)
        self._remembered[seq] = [key for key, _ in keys]
        if self.batching == "step":
            self._closed_ranges.add(seq)
        else:
            for group in groups:
                self._closed_groups[group] = seq
        self._next_seq = max(self._next_seq, seq + 1)
        self._forget_old()

    # ------------------------------------------------------------------ adding

    def add(self, member: Member) -> AddResult:
        """Place one episode or abandoned record; the result says whether it is pending, dropped or rejected."""
        self.offsets.seen(member.partition, member.offset)
        result = self._place(member)
        self.counts[result.outcome.value] += 1
        return result

    def skip(self, partition: int, offset: int) -> None:
        """A record that never became a member (dead-lettered at once): commit may pass it."""
        self.offsets.seen(partition, offset)

    def _closed_seq(self, group: GroupKey) -> int | None:
        if self.batching == "step":
            k = self.run.batch_of(group[1])
            return k if k in self._closed_ranges else None
        return self._closed_groups.get(group)

    def _written_attempt(self, m: Member) -> int | None:
        """The attempt of ``m.key`` in a formed batch: from memory, else from the forgotten batch's manifest."""
        attempt = self._written.get(m.key)
        if attempt is not None:
            return attempt
        seq = self._closed_seq(m.group)
        if seq is None or seq in self._remembered or self._lookup is None:
            return None
        found = self._lookup(seq)
        return None if found is None else found.get(m.key)

    def _place(self, m: Member) -> AddResult:
        written = self._written_attempt(m)
        if written is not None:
            if written == m.attempt:
                return AddResult(Outcome.DUPLICATE)
            if m.attempt < written:
                return AddResult(Outcome.SUPERSEDED)
            return AddResult(Outcome.REJECTED, f"late: attempt {m.attempt} of rollout {m.key} arrived after "
                                               f"attempt {written} was batched", DlqKind.LATE)
        closed = self._closed_seq(m.group)
        if closed is not None:
            return AddResult(Outcome.REJECTED, f"late: rollout {m.key} of group {_describe(m.group)} arrived "
                                               f"after its batch {closed} was formed", DlqKind.LATE)
        current = self._pending.get(m.key)
        if current is not None:
            return self._replace(current, m)
        group = self._groups.get(m.group)
        if group is not None and group.group_size != m.group_size:
            return AddResult(Outcome.REJECTED, must_be("group_size", f"{group.group_size} as for the rest of group "
                                                       f"{_describe(m.group)}", m.group_size), DlqKind.GROUP)
        if group is not None and group.complete:
            return AddResult(Outcome.REJECTED, f"group {_describe(m.group)} already holds its {group.group_size} "
                                               f"members; rollout {m.key} is one too many", DlqKind.GROUP)
        if group is None:
            group = self._groups[m.group] = _Group(m.group_size)
            if self.batching == "step":
                self._ranges.setdefault(self.run.batch_of(m.group[1]), set()).add(m.group)
        group.members[m.key] = m
        self._pending[m.key] = m
        self.offsets.hold(m.partition, m.offset)
        if self.batching == "step":
            self._touched.add(self.run.batch_of(m.group[1]))
        elif group.complete:
            self._completed.append(m.group)
        return AddResult(Outcome.ACCEPTED)

    def _replace(self, current: Member, m: Member) -> AddResult:
        """Two records of one rollout key: the higher attempt is the member; of one attempt, the episode."""
        if m.attempt == current.attempt and not (isinstance(current, AbandonedEpisode) and isinstance(m, Episode)):
            return AddResult(Outcome.DUPLICATE)
        if m.attempt < current.attempt:
            return AddResult(Outcome.SUPERSEDED)
        if m.group != current.group or m.group_size != current.group_size:
            return AddResult(Outcome.REJECTED, must_be("group", f"{_describe(current.group)} of size "
                                                       f"{current.group_size} as attempt {current.attempt} of "
                                                       f"rollout {m.key}", _describe(m.group)), DlqKind.GROUP)
        self._groups[m.group].members[m.key] = m
        self._pending[m.key] = m
        self.offsets.release(current.partition, current.offset)
        self.offsets.hold(m.partition, m.offset)
        return AddResult(Outcome.REPLACED)

    # ------------------------------------------------------------------ batches

    def ready(self) -> list[Batch]:
        """Pop the batches that are due, in seq order (empty ones included: see ``Batch.empty``)."""
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
        completed = set(self._completed)
        rest = sorted((g for g in self._groups if g not in completed), key=_group_order)
        order, self._completed = self._completed + rest, []
        G = self.groups_per_batch
        batches = []
        for start in range(0, len(order), G):
            chosen = order[start:start + G]
            partial = len(chosen) < G or not all(self._groups[g].complete for g in chosen)
            batches.append(self._form(self._take_seq(), chosen, partial=partial))
        return batches

    def done(self, batch: Batch) -> None:
        """The batch is written, dead-lettered or skipped: its offsets may be committed."""
        for member in batch.members():
            self.offsets.release(member.partition, member.offset)
        self._unfinished.discard(batch.seq)
        self._forget_old()

    def _take_seq(self) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def _form(self, seq: int, group_keys: Sequence[GroupKey], *, partial: bool) -> Batch:
        self._next_seq = max(self._next_seq, seq + 1)  # step seqs come from the range: the next is past it
        members: list[Member] = []
        summaries = []
        for key in group_keys:
            group = self._groups.pop(key)
            abandoned = sum(isinstance(m, AbandonedEpisode) for m in group.members.values())
            summaries.append(GroupSummary(key[0], key[1], group.group_size, len(group.members) - abandoned,
                                          abandoned))
            if not summaries[-1].complete:
                self._incomplete(seq, summaries[-1])
            members.extend(group.members.values())
            if self.batching == "arrival":
                self._closed_groups[key] = seq
        for member in members:
            del self._pending[member.key]
            self._written[member.key] = member.attempt
        self._remembered[seq] = [m.key for m in members]
        self._unfinished.add(seq)
        if self.batching == "step":
            self._closed_ranges.add(seq)
        members.sort(key=lambda m: m.sort_key())
        summaries.sort(key=lambda s: _group_order((s.adapter, s.group_index)))
        return Batch(seq, tuple(m for m in members if isinstance(m, Episode)), tuple(summaries), partial,
                     tuple(m for m in members if isinstance(m, AbandonedEpisode)))

    def _incomplete(self, seq: int, group: GroupSummary) -> None:
        """A group flushed short (the run ended before all its members came): never in silence."""
        self.incomplete_groups += 1
        logger.warning("INCOMPLETE group %s in batch %d: it lacks %d of its %d episodes (%d read, %d abandoned) "
                       "and the run is over; written flagged (manifest complete: false)",
                       _describe((group.adapter, group.group_index)), seq,
                       group.group_size - group.episodes - group.abandoned, group.group_size, group.episodes,
                       group.abandoned)

    def _forget_old(self) -> None:
        """Forget the keys of done batches older than the ``written_memory`` newest seqs."""
        if len(self._remembered) <= self.written_memory:
            return
        horizon = max(self._remembered) - self.written_memory
        for seq in [s for s in self._remembered if s <= horizon and s not in self._unfinished]:
            for key in self._remembered.pop(seq):
                self._written.pop(key, None)


def _describe(group: GroupKey) -> str:
    adapter, group_index = group
    return f"(adapter={None if adapter is None else adapter.name}, group_index={group_index})"
