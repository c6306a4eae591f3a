"""What a replay says: per batch its status against the original, the records it would have dead-lettered.

Why a module of its own: the report is what ``rollout-bus replay`` prints and what tests assert on;
reading the ranges (``rollout_bus.replay.episodes``), re-running the batching
(``rollout_bus.replay.rebuild``) and settling the settings (``rollout_bus.replay.settings``) each
fill a part of it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout_bus.replay.settings import ReplaySettings


@dataclass(frozen=True)
class Rejection:
    """A record the replayed stage would have sent to the DLQ."""

    source: str
    stage: str
    kind: str
    reason: str


@dataclass
class BatchReport:
    seq: int
    status: str  # identical | differs | written | incomplete | dead-lettered | not-in-range
    episodes: int
    expected_episodes: int | None = None
    shards: dict[str, str] = field(default_factory=dict)  # shard path -> sha256, of what was written
    detail: str = ""


@dataclass
class ReplayReport:
    topic: str
    kind: str
    ranges: list[str]
    records: int
    episodes: int
    settings: ReplaySettings
    manifests_from: str | None
    batches: list[BatchReport] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    open_episodes: int = 0

    def by_status(self) -> Counter[str]:
        return Counter(b.status for b in self.batches)

    @property
    def differs(self) -> bool:
        return any(b.status == "differs" for b in self.batches)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)
