"""What a batch of the shard writer holds, and the staleness split of one: plain values, no Kafka, no files.

Contract:

* ``Batch`` (formed by ``rollout_bus.consumers.shard_writer.batcher.Batcher``) holds its episodes (``episodes``) and,
  apart, its abandoned records (``abandoned``); ``groups`` summarise every group (``GroupSummary``:
  its episodes and abandoned counts, ``complete``, ``as_json()`` for the manifest), all-abandoned ones
  included. ``Batch.empty``: no episode at all (every group abandoned, or its episodes stale).
* ``Batch.stale`` is empty as formed; ``split_stale(batch, max_staleness)`` (the writer's staleness
  net, ``rollout_bus.consumers.shard_writer.staleness``) moves episodes there from ``episodes``. They stay members
  (``members()``): the batcher releases their offsets with the batch's, and their keys count as the
  batch's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rollout_bus.consumers.shard_writer.episodes import AbandonedEpisode, Episode, Member
from rollout_bus.consumers.shard_writer.staleness import StaleEpisode, episode_oldest_version, is_stale
from rollout_bus.model.sample import AdapterRef, Sample


@dataclass(frozen=True)
class GroupSummary:
    adapter: AdapterRef | None
    group_index: int
    group_size: int
    episodes: int
    abandoned: int = 0

    @property
    def complete(self) -> bool:
        return self.episodes + self.abandoned >= self.group_size

    def as_json(self) -> dict[str, Any]:
        return {"adapter": None if self.adapter is None else self.adapter.name,
                "adapter_slot": -1 if self.adapter is None else self.adapter.slot,
                "group_index": self.group_index, "group_size": self.group_size,
                "episodes": self.episodes, "abandoned": self.abandoned, "complete": self.complete}


@dataclass(frozen=True)
class Batch:
    """Episodes that become one trainer batch, in batch order, and the abandoned ones beside them."""

    seq: int
    episodes: tuple[Episode, ...]
    groups: tuple[GroupSummary, ...]
    partial: bool = False
    abandoned: tuple[AbandonedEpisode, ...] = ()
    stale: tuple[StaleEpisode, ...] = ()  # dropped by the writer's staleness net (rollout_bus.consumers.shard_writer.staleness)

    @property
    def empty(self) -> bool:
        """No episode at all: nothing to write (every group of it was abandoned, or its episodes stale)."""
        return not self.episodes

    def members(self) -> tuple[Member, ...]:
        return (*self.episodes, *self.abandoned, *(s.episode for s in self.stale))

    def samples(self) -> list[Sample]:
        return [segment for episode in self.episodes for segment in episode.segments]


def split_stale(batch: Batch, max_staleness: int | None) -> Batch:
    """The batch without its stale episodes, which it lists under ``stale`` (see the module docstring)."""
    if max_staleness is None:
        return batch
    kept: list[Episode] = []
    stale: list[StaleEpisode] = []
    for episode in batch.episodes:
        oldest = episode_oldest_version(episode)
        if is_stale(oldest, batch.seq, max_staleness):
            stale.append(StaleEpisode(episode, oldest, batch.seq, max_staleness))
        else:
            kept.append(episode)
    if not stale:
        return batch
    return dataclasses.replace(batch, episodes=tuple(kept), stale=(*batch.stale, *stale))
