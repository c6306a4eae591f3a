"""The shard feed as a PyTorch ``IterableDataset``: ``DataLoader(dataset, batch_size=None)`` yields
one ``TrainBatch`` per step, for this process's DP rank.

Contract: ``ShardFeedDataset(bootstrap_servers, *, rank=None, dp_size=None, state=None, **feed)``
takes rank and DP size from ``torch.distributed`` when it is initialised (else both must be given),
builds a ``ShardFeed`` on each iteration, starting from ``state`` (a feed ``state_dict``) when
given; ``state_dict()`` is the live feed's position, for the trainer's checkpoint. The feed is a
single ordered stream: a ``DataLoader`` with more than one worker process is refused (each worker
would read every batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from rollout_bus.consumers.feed.trainer_feed import ShardFeed, TrainBatch
from rollout_bus.errors import ConfigError


def dp_rank_and_size(rank: int | None, dp_size: int | None) -> tuple[int, int]:
    """The given rank and size, else ``torch.distributed``'s when it is initialised."""
    if rank is not None and dp_size is not None:
        return rank, dp_size
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank), (dist.get_world_size() if dp_size is None else dp_size)
    raise ConfigError("rank and dp_size are needed: pass them, or initialise torch.distributed first")


class ShardFeedDataset(IterableDataset):
    """This rank's batches, in seq order, as an iterable dataset."""

    def __init__(self, bootstrap_servers: str, *, rank: int | None = None, dp_size: int | None = None,
                 state: dict[str, Any] | None = None, **feed: Any) -> None:
        super().__init__()
        self.bootstrap_servers = bootstrap_servers
        self.rank, self.dp_size = dp_rank_and_size(rank, dp_size)
        self.feed_options = feed
        self._state = state
        self._feed: ShardFeed | None = None

    def __iter__(self) -> Iterator[TrainBatch]:
        worker = get_worker_info()
        if worker is not None and worker.num_workers > 1:
            raise ConfigError("ShardFeedDataset is one ordered stream: use DataLoader(num_workers=0 or 1)")
        feed = ShardFeed(self.bootstrap_servers, rank=self.rank, dp_size=self.dp_size, **self.feed_options)
        if self._state is not None:
            feed.load_state_dict(self._state)
        self._feed = feed
        try:
            for batch in feed:
                self._state = feed.state_dict()
                yield batch
        finally:
            feed.close()

    def state_dict(self) -> dict[str, Any] | None:
        """The position after the last batch yielded (None before the first iteration with no state)."""
        return self._feed.state_dict() if self._feed is not None else self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = state
