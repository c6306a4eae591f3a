"""What every trainer on the feed shares: resumable train state, one step's batches, and the run's reconciliation.

A trainer's exactly-once promise is one checkpoint that holds its model, its optimizer and every
rank's feed position together; ``trained.jsonl`` beside it is what it trained, for people and for
the run's reconciliation. ``rollout_bus.sim.trainer`` (the stand-in) and ``rollout_bus.learn.trainer``
(the real policy) both build on this.

Contract:

* ``TrainState(policy, optimizer, trained, history)``: ``save(checkpoint_dir, feeds, shape)`` writes
  ``checkpoint.pt`` (``torch.save`` of model, optimizer, feed states by rank, trained seqs, history,
  the torch RNG state, the shape and ``extra``) then ``trained.jsonl``, each atomically; ``load``
  resumes from it (a checkpoint of another ``shape`` is a ``ConfigError``) and rewrites
  ``trained.jsonl`` from it. ``read_trained(checkpoint_dir)`` reads the rows.
* ``next_batches(feeds)``: the next batch of every rank (one seq; ranks that disagree are a
  ``ContractError``), or None at the run's end. ``TrainerFlow(feeds, conn, topics)`` does the same
  (``next_batches``) and times it: ``stepped()`` after each step and ``finish()`` at the run's end report
  the time waited for batches on rollout.metrics (``wire.flow_metrics.trainer_flow``; source
  ``trainer_source(feeds)``: ``trainer``, or ``trainer-ranks-0-1`` for a process that trains only some ranks).
* ``reconcile_training(written_seqs, rows, ranks)``: every written seq trained exactly once per
  rank, in seq order, nothing else. ``staleness_problems(manifests, max_staleness)``: the closed
  loop's check of a run's batch metrics.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout_bus.errors import ConfigError, ContractError, must_be
from rollout_bus.consumers.feed.trainer_feed import ShardFeed, TrainBatch
from rollout_bus.kafka.flow_reporter import FlowReporter
from rollout_bus.model.files import write_atomic
from rollout_bus.wire.flow_metrics import STAGE_TRAINER, trainer_flow
from rollout_bus.wire.topics import Topics

CHECKPOINT_NAME = "checkpoint.pt"
TRAINED_NAME = "trained.jsonl"


def atomic_torch_save(obj: Any, path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomic(path, buffer.getvalue())


def trained_jsonl(history: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row, sort_keys=True) + "\n" for row in history).encode()


def read_trained(checkpoint_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``trained.jsonl`` (empty when there is none yet)."""
    path = Path(checkpoint_dir) / TRAINED_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class TrainState:
    """Everything a checkpoint holds besides the feeds."""

    policy: nn.Module
    optimizer: torch.optim.Optimizer
    trained: list[int] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # whatever else a trainer must resume with

    def save(self, checkpoint_dir: Path, feeds: Mapping[int, ShardFeed], shape: dict[str, Any]) -> None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        atomic_torch_save({"model": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                           "feeds": {rank: feed.state_dict() for rank, feed in feeds.items()},
                           "trained": list(self.trained), "history": list(self.history),
                           "rng": torch.get_rng_state(), "shape": shape, "extra": dict(self.extra)},
                          checkpoint_dir / CHECKPOINT_NAME)
        write_atomic(checkpoint_dir / TRAINED_NAME, trained_jsonl(self.history))

    def load(self, checkpoint_dir: Path, feeds: Mapping[int, ShardFeed], shape: dict[str, Any]) -> bool:
        """Resume from ``checkpoint_dir`` when it holds a checkpoint; True when it did."""
        path = checkpoint_dir / CHECKPOINT_NAME
        if not path.exists():
            return False
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("shape") != shape:
            raise ConfigError(must_be("checkpoint", f"of a training shaped {shape}", saved.get("shape"),
                                      where=str(path)))
        self.policy.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        for rank, feed in feeds.items():
            feed.load_state_dict(saved["feeds"][rank])
        self.trained, self.history = list(saved["trained"]), list(saved["history"])
        torch.set_rng_state(saved["rng"])
        self.extra = dict(saved.get("extra") or {})
        write_atomic(checkpoint_dir / TRAINED_NAME, trained_jsonl(self.history))  # it may lag a checkpoint
        return True


def next_batches(feeds: Mapping[int, ShardFeed],
                 on_wait: Callable[[float], None] | None = None) -> list[TrainBatch] | None:
    """The next batch of every rank (one seq), or None when every feed reached the run's end; ``on_wait`` as
    ``ShardFeed.next_batch`` takes it."""
    batches = {rank: feed.next_batch(on_wait=on_wait) for rank, feed in feeds.items()}
    if all(b is None for b in batches.values()):
        return None
    seqs = {rank: (b.seq if b is not None else "end of run") for rank, b in batches.items()}
    if len(set(seqs.values())) != 1:
        raise ContractError(f"the ranks' feeds disagree on the next batch: {seqs} (rank: seq); every rank must "
                            "train the same seq in a step")
    return [b for b in batches.values() if b is not None]


def trainer_source(feeds: Mapping[int, ShardFeed]) -> str:
    """``trainer`` for a process that trains every rank; ``trainer-ranks-0-1`` for one that trains some."""
    ranks = sorted(feeds)
    whole = bool(ranks) and len(ranks) == next(iter(feeds.values())).dp_size
    return "trainer" if whole else "trainer-ranks-" + "-".join(map(str, ranks))


class TrainerFlow:
    """The trainer's time waiting for its next batch, measured around ``next_batches`` and reported."""

    def __init__(self, feeds: Mapping[int, ShardFeed], conn: Mapping[str, Any], topics: Topics) -> None:
        self.feeds = feeds
        self.reporter = FlowReporter(conn, topics, STAGE_TRAINER, trainer_source(feeds))
        self.waited_s = 0.0
        self.steps = 0

    def next_batches(self) -> list[TrainBatch] | None:
        began = time.monotonic()

        def waiting(_: float) -> None:  # a starved trainer is said while it waits, not only after
            self.reporter.report(trainer_flow(self.waited_s + time.monotonic() - began, self.steps,
                                              self.reporter.elapsed_s))
        try:
            return next_batches(self.feeds, on_wait=waiting)
        finally:
            self.waited_s += time.monotonic() - began

    def _metrics(self) -> dict[str, float]:
        return trainer_flow(self.waited_s, self.steps, self.reporter.elapsed_s)

    def stepped(self) -> None:
        self.steps += 1
        self.reporter.report(self._metrics())

    def finish(self) -> None:
        """The last report (final), once the trainer reached its end."""
        self.reporter.report(self._metrics(), final=True)

    def close(self) -> None:
        self.reporter.close()


def mean_loss(history: list[dict[str, Any]], seq: int) -> float | None:
    losses = [row["loss"] for row in history if row["seq"] == seq]
    return sum(losses) / len(losses) if losses else None


@dataclass
class TrainingCheck:
    """Whether every written batch was trained exactly once per rank, in seq order."""

    written: list[int]
    ranks: list[int]
    missing: dict[int, list[int]] = field(default_factory=dict)     # rank -> written seqs never trained
    duplicated: dict[int, list[int]] = field(default_factory=dict)  # rank -> seqs trained more than once
    unexpected: dict[int, list[int]] = field(default_factory=dict)  # rank -> seqs trained but not written
    out_of_order: dict[int, list[int]] = field(default_factory=dict)  # rank -> its trained seqs, when unsorted
    batches: int = 0
    last_seq: int | None = None
    final_loss: float | None = None

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.unexpected or self.out_of_order)

    def problems(self) -> list[str]:
        out = []
        for name in ("missing", "duplicated", "unexpected", "out_of_order"):
            value = getattr(self, name)
            if value:
                out.append(f"training {name.replace('_', ' ')} (rank: seqs): {value}")
        return out

    def summary(self) -> str:
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.6f}"
        verdict = "every written batch trained once per rank, in order" if self.ok else "MISMATCH"
        return (f"training: {self.batches} batches trained on ranks {','.join(map(str, self.ranks))} "
                f"(written {len(self.written)}), last seq {self.last_seq}, final loss {loss}: {verdict}")


def reconcile_training(written_seqs: Iterable[int], rows: Iterable[Mapping[str, Any]],
                       ranks: Iterable[int]) -> TrainingCheck:
    """Match the written batch seqs against ``trained.jsonl``'s rows (see the module docstring)."""
    rows = list(rows)
    check = TrainingCheck(written=sorted(int(s) for s in written_seqs), ranks=sorted(int(r) for r in ranks))
    written = set(check.written)
    by_rank: dict[int, list[int]] = {rank: [] for rank in check.ranks}
    for row in rows:
        by_rank.setdefault(int(row["rank"]), []).append(int(row["seq"]))
    for rank, seqs in sorted(by_rank.items()):
        if rank not in check.ranks:
            check.unexpected[rank] = sorted(set(seqs))
            continue
        if missing := sorted(written - set(seqs)):
            check.missing[rank] = missing
        if duplicated := sorted({s for s in seqs if seqs.count(s) > 1}):
            check.duplicated[rank] = duplicated
        if unexpected := sorted(set(seqs) - written):
            check.unexpected[rank] = unexpected
        if seqs != sorted(seqs):
            check.out_of_order[rank] = seqs
    seqs_trained = sorted({int(row["seq"]) for row in rows})
    check.batches = len(seqs_trained)
    check.last_seq = seqs_trained[-1] if seqs_trained else None
    if check.last_seq is not None:
        check.final_loss = mean_loss([dict(r) for r in rows], check.last_seq)
    return check


def staleness_problems(manifests: Iterable[Mapping[str, Any]], max_staleness: int) -> tuple[list[str], int]:
    """The closed loop's check over written batches: no trained token more than ``max_staleness``
    steps stale (every ``staleness/max`` and ``staleness/oldest`` batch metric, adapter-scoped ones
    included), and no episode the shard writer's net dead-lettered as stale (which happens only when a
    generator ignored the bound). Returns the problems and the largest staleness seen."""
    problems, worst = [], 0
    for manifest in manifests:
        seq, metrics = manifest.get("seq"), manifest.get("metrics") or {}
        found = {k: v for k, v in metrics.items() if k.endswith(("staleness/max", "staleness/oldest"))
                 and isinstance(v, (int, float))}
        if not found:
            problems.append(f"batch {seq} has no staleness metrics (its samples carry no weight version)")
        worst = max([worst, *found.values()])
        problems += [f"batch {seq}: {k} = {v} > max staleness {max_staleness}" for k, v in sorted(found.items())
                     if v > max_staleness]
        stale = (manifest.get("extra") or {}).get("stale") or []
        if stale:
            problems.append(f"batch {seq}: {len(stale)} episodes dead-lettered as stale (a generator ignored the bound)")
    return problems, int(worst)
