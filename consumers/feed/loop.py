"""One trainer loop on the feed; the step, what one batch does to the model, is the part a trainer brings.

Why: the stand-in (``rollout_bus.sim.trainer``) and the real policy (``rollout_bus.learn.trainer``) follow the
same per-rank feeds, report the same flow, resume from and save the same exactly-once checkpoint
(``rollout_bus.consumers.feed.training``) and end the same way. What differs is the model and its update, the
weight version each step ships on rollout.weights, when a step is checkpointed and what its log line says:
a ``TrainStep``. The loop lives at the trainer's end of the bus so that both trainers, which must not import
each other, can run it.

Contract:

* ``FeedOptions``: what every trainer on the feed is given (the brokers, its ranks of ``dp_size``, where it
  checkpoints, the feed timeout, ``max_batches`` counted over the whole training, resumed batches included,
  ``torch_threads``, ``step_delay_s``, a pause after each step for drills and demos, and ``start_seq``, a fresh
  feed's first batch: 0 for a trainer started with its run, whose batches may be written out of seq order); ``check()`` refuses
  unusable ranks and ``max_batches`` with ``ConfigError``. A trainer's options extend it.
* ``run_training(options, make_step, *, log=None, on_progress=None) -> TrainResult``: checks the options, sets
  torch's threads, builds the step (``make_step(options)``: its model is built after the threads are set),
  opens one ``ShardFeed`` per rank and a ``TrainerFlow`` and resumes from ``checkpoint_dir`` when it holds a
  checkpoint of the step's shape and the feeds' topic (``resumed from checkpoint=... batches=N`` and where
  the step stands, ``step.start``). Then, per batch: the next batch of every rank (``TrainerFlow``), the
  step's update (``step.train``: a history row per rank), the new weights shipped (``step.ship``, through
  the first rank's feed), the batch recorded as trained, the flow reported, the step committed
  (``step.commit``: its log line and, when it is due, a checkpoint through ``Checkpoint``), ``on_progress``
  (``TrainProgress``) and the pause. At the end the step finishes (``step.finish``: a last checkpoint when it
  keeps one), the flow's final report goes out and the feeds close, also on an error.
* ``TrainResult.summary()``: the line a command prints at the end, ``<name>: trained batches=...``.
* ``step_over_ranks(state, batches, rank_loss, stamp=None)``: the update both steps make, one optimizer step on
  the mean of the ranks' losses (a simulated all-reduce); a history row per rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from rollout_bus.consumers.feed.trainer_feed import ShardFeed, TrainBatch
from rollout_bus.consumers.feed.training import CHECKPOINT_NAME, TrainerFlow, TrainState, mean_loss
from rollout_bus.errors import ConfigError, must_be
from rollout_bus.model.files import wait_for_disk
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)


@dataclass
class FeedOptions:
    """What every trainer on the feed is given."""

    bootstrap_servers: str
    checkpoint_dir: Path
    ranks: list[int] = field(default_factory=lambda: [0])
    dp_size: int = 1
    kafka: dict[str, Any] = field(default_factory=dict)  # further connection settings (SASL/SSL)
    topic_prefix: str = ""
    shards_root: Path | None = None
    timeout_s: float = 600.0
    max_batches: int | None = None
    torch_threads: int = 1  # 0: torch's default
    step_delay_s: float = 0.0  # a pause after each step: slows the trainer down for drills and demos
    start_seq: int | None = None  # a fresh feed's first seq (None: the lowest the topic holds); a checkpoint wins

    def check(self) -> None:
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(must_be("ranks", "a non-empty list of distinct ranks", self.ranks))
        if any(not 0 <= r < self.dp_size for r in self.ranks):
            raise ConfigError(must_be("ranks", f"ranks in [0, dp_size = {self.dp_size})", self.ranks))
        if self.max_batches is not None and self.max_batches < 0:
            raise ConfigError(must_be("max_batches", ">= 0 or None", self.max_batches))


class Publish(Protocol):
    """``ShardFeed.publish_version`` of the rank that says which weights are live."""

    def __call__(self, version: int, step: int, **ref: Any) -> None: ...


class Checkpoint:
    """The train state saved with every rank's feed position, and how many trained batches the last save holds."""

    def __init__(self, state: TrainState, directory: Path, feeds: Mapping[int, ShardFeed],
                 shape: dict[str, Any]) -> None:
        self.state, self.directory, self.feeds, self.shape = state, directory, feeds, shape
        self.held: int | None = None  # trained batches in the checkpoint on disk; None: none written by this run

    @property
    def path(self) -> Path:
        return self.directory / CHECKPOINT_NAME

    def load(self) -> bool:
        """Resume from the checkpoint when there is one (``TrainState.load``); True when it did."""
        resumed = self.state.load(self.directory, self.feeds, self.shape)
        self.held = len(self.state.trained) if resumed else None
        return resumed

    def save(self, what: str) -> None:
        """Save now, waiting out a full disk (``what`` names it in the waiting line)."""
        wait_for_disk(lambda: self.state.save(self.directory, self.feeds, self.shape), what)
        self.held = len(self.state.trained)


class TrainStep(Protocol):
    """What one batch does to the model, and what a trainer ships and keeps around it."""

    name: str  # the command's, in its summary line
    state: TrainState  # the model and optimizer the checkpoint holds
    version: int | None  # the weights version now live, when the trainer tells it in its summary

    def shape(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed with this step."""

    def start(self, resumed: bool, next_seq: int | None, publish: Publish, log: logging.Logger) -> str:
        """After the checkpoint was loaded (or not found): get ready; where it stands, for the resume line."""

    def train(self, batches: list[TrainBatch]) -> list[dict[str, Any]]:
        """One optimizer step over every rank's shard of one batch; a history row per rank."""

    def ship(self, seq: int, publish: Publish) -> None:
        """After training batch ``seq``: the weights it made go live (version ``seq + 1``), if the step ships them."""

    def commit(self, seq: int, rows: list[dict[str, Any]], metrics: Mapping[str, Any], checkpoint: Checkpoint,
               log: logging.Logger) -> None:
        """Batch ``seq`` is recorded as trained: its log line, and a checkpoint when one is due."""

    def finish(self, checkpoint: Checkpoint, log: logging.Logger) -> None:
        """The feeds reached their end (or ``max_batches``): a last checkpoint, when the step keeps one."""


@dataclass
class TrainProgress:
    batches: int  # trained in the whole training, resumed ones included
    last_seq: int | None
    loss: float | None
    reward: float | None = None  # the mean of the step's rows' reward_mean, when its rows carry one


@dataclass
class TrainResult:
    name: str
    batches: int  # trained in the whole training, resumed ones included
    batches_this_run: int
    last_seq: int | None
    final_loss: float | None
    resumed_from: int  # batches already trained by the checkpoint found at start
    checkpoint: Path
    version: int | None = None  # the live weights version, for a trainer that tells it

    def summary(self) -> str:
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.6f}"
        version = "" if self.version is None else f" weights version={self.version}"
        return (f"{self.name}: trained batches={self.batches} (this run {self.batches_this_run}, resumed after "
                f"{self.resumed_from}) last_seq={self.last_seq} final_loss={loss}{version} "
                f"checkpoint={self.checkpoint}")


def open_feeds(options: FeedOptions) -> dict[int, ShardFeed]:
    return {rank: ShardFeed(options.bootstrap_servers, rank=rank, dp_size=options.dp_size,
                            shards_root=options.shards_root, topic_prefix=options.topic_prefix,
                            start=options.start_seq, timeout_s=options.timeout_s, **options.kafka)
            for rank in options.ranks}


def step_over_ranks(state: TrainState, batches: list[TrainBatch],
                    rank_loss: Callable[[TrainBatch], tuple[torch.Tensor, dict[str, Any]]],
                    stamp: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One optimizer step on every rank's shard of one batch: each rank's loss (``rank_loss``: the loss and
    its history row) back-propagated divided by the number of ranks, so the gradient is the ranks' mean (a
    simulated all-reduce); a history row per rank, ``stamp``ed once its backward pass is done."""
    state.optimizer.zero_grad(set_to_none=True)
    rows = []
    for batch in batches:
        loss, row = rank_loss(batch)
        (loss / len(batches)).backward()  # summed over ranks: the all-reduced gradient
        rows.append(row if stamp is None else stamp(row))
    state.optimizer.step()
    return rows


def _progress(state: TrainState, seq: int, rows: list[dict[str, Any]]) -> TrainProgress:
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    reward = sum(rewards) / len(rewards) if rewards and len(rewards) == len(rows) else None
    return TrainProgress(len(state.trained), seq, mean_loss(state.history, seq), reward)


Options = TypeVar("Options", bound=FeedOptions)


def run_training(options: Options, make_step: Callable[[Options], TrainStep], *, log: logging.Logger | None = None,
                 on_progress: Callable[[TrainProgress], None] | None = None) -> TrainResult:
    """Train on the feeds until the run's end (or ``max_batches``); see the module docstring."""
    options.check()
    log = log or logger
    if options.torch_threads > 0:
        torch.set_num_threads(options.torch_threads)
    step = make_step(options)
    state = step.state
    feeds = open_feeds(options)
    flow = TrainerFlow(feeds, {"bootstrap_servers": options.bootstrap_servers, **options.kafka},
                       Topics(prefix=options.topic_prefix))
    publish = feeds[options.ranks[0]].publish_version  # one rank says which weights are live
    checkpoint = Checkpoint(state, Path(options.checkpoint_dir), feeds,
                            {**step.shape(), "topic": next(iter(feeds.values())).topic})
    try:
        resumed = checkpoint.load()
        resumed_from = len(state.trained)
        where = step.start(resumed, next(iter(feeds.values())).next_seq, publish, log)
        if resumed:
            log.info("resumed from checkpoint=%s batches=%d %s", checkpoint.path, resumed_from, where)
        while options.max_batches is None or len(state.trained) < options.max_batches:
            batches = flow.next_batches()
            if batches is None:
                break
            seq = batches[0].seq
            rows = step.train(batches)
            step.ship(seq, publish)  # the new weights are live: generators may start the next batches
            state.trained.append(seq)
            flow.stepped()
            state.history.extend(rows)
            step.commit(seq, rows, batches[0].metrics, checkpoint, log)
            if on_progress is not None:
                on_progress(_progress(state, seq, rows))
            if options.step_delay_s > 0:
                time.sleep(options.step_delay_s)
        step.finish(checkpoint, log)
        flow.finish()
    finally:
        flow.close()
        for feed in feeds.values():
            feed.close()
    last = state.trained[-1] if state.trained else None
    return TrainResult(step.name, batches=len(state.trained), batches_this_run=len(state.trained) - resumed_from,
                       last_seq=last, final_loss=None if last is None else mean_loss(state.history, last),
                       resumed_from=resumed_from, checkpoint=checkpoint.path, version=step.version)
