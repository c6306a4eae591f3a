"""The staleness bound's safety net at the shard writer: a step batch never trains on episodes too stale for it.

Why a net: the bound is enforced where it is cheap, by the generators (``rollout_bus.producers.staleness_gate``:
a group of batch ``k`` starts only once the trainer's live version is >= ``k - max_staleness``).
Versions only grow, so an episode of batch ``k`` from a generator that follows the bound has no
token older than ``k - max_staleness``. One that does (a generator run without the gate, or
with a looser bound) is caught here, before it trains.

Contract:

* ``episode_oldest_version(episode)`` is the smallest ``metrics.sample_oldest_version`` over the
  episode's segments (token versions >= 0 where a segment has them, else its
  ``oldest_weight_version``); None when no segment has a numeric version.
* ``is_stale(oldest, seq, max_staleness)``: ``oldest < seq - max_staleness``. An episode with no
  numeric version is never stale: there is nothing to judge it by.
* ``batch.split_stale(batch, max_staleness)`` (there, beside ``Batch``) returns the batch with its stale episodes moved from
  ``episodes`` to ``stale`` (``StaleEpisode``, batch order kept); ``max_staleness=None`` returns the
  batch unchanged. Pure: a function of the batch (itself a function of the log in step mode) and
  the bound, so a restart or a replay with the same bound drops the same episodes. ``groups``
  keep the members as formed (a stale episode still counts in its group's ``episodes``).
* ``StaleEpisode.reason`` names the episode, its oldest version, the batch and the bound;
  ``as_json()`` is its manifest entry (``extra.stale``): key, attempt, partition, offset,
  segments, oldest_version, reason.
* Step batching only. In arrival batching a batch's seq is not the step the generator's bound
  was checked against (the bound uses ``RunBatching.batch_of(group_index)``; an arrival batch takes
  whichever groups complete first, in read order), so there is no step identity to judge an
  episode by, and the decision would not follow from the log alone. The writer applies no net
  there (it logs that ``max_staleness`` is ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_bus.consumers.shard_writer.episodes import Episode
from rollout_bus.model.metrics import sample_oldest_version


@dataclass(frozen=True, eq=False)
class StaleEpisode:
    """An episode dropped from batch ``seq``: its oldest version is more than ``max_staleness`` behind."""

    episode: Episode
    oldest_version: int
    seq: int
    max_staleness: int

    @property
    def key(self) -> str:
        return self.episode.key

    @property
    def reason(self) -> str:
        return (f"stale: episode {self.episode.key} (attempt {self.episode.attempt}) has oldest weight version "
                f"{self.oldest_version}, more than max_staleness={self.max_staleness} steps behind batch "
                f"{self.seq} (needs >= {self.seq - self.max_staleness}); dropped from batch {self.seq} "
                f"(its generator did not hold to the staleness bound)")

    def as_json(self) -> dict[str, Any]:
        e = self.episode
        return {"key": e.key, "attempt": e.attempt, "partition": e.partition, "offset": e.offset,
                "segments": len(e.segments), "oldest_version": self.oldest_version, "reason": self.reason}


def episode_oldest_version(episode: Episode) -> int | None:
    """The oldest weight version behind any segment of the episode; None when none has a numeric version."""
    versions = [v for v in (sample_oldest_version(s) for s in episode.segments) if v is not None]
    return min(versions) if versions else None


def is_stale(oldest: int | None, seq: int, max_staleness: int) -> bool:
    """Whether an episode whose oldest version is ``oldest`` is too stale for batch ``seq``."""
    return oldest is not None and oldest < seq - max_staleness
