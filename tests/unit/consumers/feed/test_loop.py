"""The trainer loop without a broker, with a step that records what the loop asks of it: the order of a
batch's calls, the weights published through the first given rank, the resume line, the progress and the
summary, and every feed closed also when the step fails."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import rollout_bus.consumers.feed.loop as loop
import rollout_bus.consumers.feed.training as training
from rollout_bus.consumers.feed.loop import FeedOptions, TrainProgress, run_training, step_over_ranks
from rollout_bus.consumers.feed.training import TrainState, read_trained


@dataclass
class Batch:
    seq: int
    rank: int
    metrics: dict[str, Any]


class Feed:
    """A ShardFeed over ``seqs`` batches per rank; what it published and whether it was closed."""

    seqs = 3
    opened: list[Feed] = []

    def __init__(self, bootstrap_servers: str, *, rank: int, dp_size: int, topic_prefix: str = "", **_: Any) -> None:
        self.rank, self.dp_size, self.topic, self.next_seq = rank, dp_size, f"{topic_prefix}rollout.shards", 0
        self.published: list[tuple[int, int, dict]] = []
        self.closed = False
        Feed.opened.append(self)

    def next_batch(self, on_wait=None) -> Batch | None:
        if self.next_seq >= Feed.seqs:
            return None
        self.next_seq += 1
        return Batch(self.next_seq - 1, self.rank, {"m": 1})

    def state_dict(self) -> dict[str, Any]:
        return {"next_seq": self.next_seq}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_seq = state["next_seq"]

    def publish_version(self, version: int, step: int, **ref: Any) -> None:
        self.published.append((version, step, ref))

    def close(self) -> None:
        self.closed = True


class Reporter:
    def __init__(self, *_: Any, **__: Any) -> None:
        self.elapsed_s = 1.0

    def report(self, metrics: dict, *, final: bool = False) -> bool:
        return True

    def close(self) -> None:
        pass


class Step:
    """Checkpoints with every batch, says where it stands as ``at=<next_seq>``, ships version seq + 1."""

    name = "fake"
    made: list[Step] = []  # every step built, in order
    fail_at: int | None = None  # train raises on this seq

    def __init__(self, options: FeedOptions) -> None:
        model = torch.nn.Linear(2, 1)
        self.state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        self.version: int | None = None
        self.calls: list[Any] = []
        Step.made.append(self)

    def shape(self) -> dict[str, Any]:
        return {"fake": 1}

    def start(self, resumed: bool, next_seq: int | None, publish, log: logging.Logger) -> str:
        self.calls.append(("start", resumed, next_seq))
        return f"at={next_seq}"

    def train(self, batches: list[Batch]) -> list[dict[str, Any]]:
        if batches[0].seq == Step.fail_at:
            raise RuntimeError("the step failed")
        self.calls.append(("train", [(b.seq, b.rank) for b in batches]))

        def one_rank(batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
            loss = self.state.policy(torch.ones(1, 2)).sum() * (batch.rank + 1)
            return loss, {"seq": batch.seq, "rank": batch.rank, "loss": float(loss.detach()), "reward_mean": batch.rank}

        return step_over_ranks(self.state, batches, one_rank)

    def ship(self, seq: int, publish) -> None:
        self.calls.append(("ship", seq, list(self.state.trained)))  # before the batch is recorded as trained
        self.version = seq + 1
        publish(seq + 1, seq, uri=f"v{seq + 1}")

    def commit(self, seq, rows, metrics, checkpoint, log) -> None:
        self.calls.append(("commit", seq, list(self.state.trained), metrics))
        checkpoint.save(f"after {seq}")
        log.info("step seq=%d", seq)

    def finish(self, checkpoint, log) -> None:
        self.calls.append(("finish", checkpoint.held))


@pytest.fixture(autouse=True)
def fakes(monkeypatch):
    monkeypatch.setattr(loop, "ShardFeed", Feed)
    monkeypatch.setattr(training, "FlowReporter", Reporter)
    Feed.seqs, Feed.opened, Step.made, Step.fail_at = 3, [], [], None


def options(tmp_path, **more: Any) -> FeedOptions:
    return FeedOptions(bootstrap_servers="unused", checkpoint_dir=tmp_path / "ck", ranks=[1, 0], dp_size=2,
                       torch_threads=0, **more)


def test_each_batch_is_trained_shipped_recorded_and_committed_in_that_order(tmp_path):
    progress: list[TrainProgress] = []
    result = run_training(options(tmp_path), Step, on_progress=progress.append)
    (step,) = Step.made
    assert step.calls[0] == ("start", False, 0) and step.calls[-1] == ("finish", 3)
    assert step.calls[1:4] == [("train", [(0, 1), (0, 0)]), ("ship", 0, []), ("commit", 0, [0], {"m": 1})]
    assert [c[0] for c in step.calls[4:-1]] == ["train", "ship", "commit"] * 2
    rank1, rank0 = Feed.opened
    assert rank1.published == [(1, 0, {"uri": "v1"}), (2, 1, {"uri": "v2"}), (3, 2, {"uri": "v3"})]
    assert rank0.published == [] and rank0.closed and rank1.closed  # the first given rank says it
    assert [(p.batches, p.last_seq, p.reward) for p in progress] == [(1, 0, 0.5), (2, 1, 0.5), (3, 2, 0.5)]
    assert [(r["seq"], r["rank"]) for r in read_trained(tmp_path / "ck")] == [(s, r) for s in range(3) for r in (1, 0)]
    assert result.summary() == (f"fake: trained batches=3 (this run 3, resumed after 0) last_seq=2 "
                                f"final_loss={result.final_loss:.6f} weights version=3 "
                                f"checkpoint={tmp_path / 'ck' / 'checkpoint.pt'}")


def test_a_restart_resumes_from_the_checkpoint_and_says_where_the_step_stands(tmp_path, caplog):
    Feed.seqs = 2
    run_training(options(tmp_path, max_batches=1), Step)
    caplog.set_level(logging.INFO)
    result = run_training(options(tmp_path), Step, log=logging.getLogger("fake.trainer"))
    assert Step.made[-1].calls[0] == ("start", True, 1)
    assert (result.resumed_from, result.batches_this_run, result.batches, result.last_seq) == (1, 1, 2, 1)
    assert f"resumed from checkpoint={tmp_path / 'ck' / 'checkpoint.pt'} batches=1 at=1" in caplog.messages
    assert all(r.name == "fake.trainer" for r in caplog.records if r.message.startswith(("resumed", "step")))


def test_a_failing_step_still_closes_every_feed_and_skips_the_finish(tmp_path):
    Step.fail_at = 1
    with pytest.raises(RuntimeError, match="the step failed"):
        run_training(options(tmp_path), Step)
    assert all(feed.closed for feed in Feed.opened) and len(Feed.opened) == 2
    assert Step.made[-1].calls[-1][0] == "commit"  # batch 0 went through; no finish after the failure


def test_unusable_options_are_refused_before_any_feed_opens(tmp_path):
    from rollout_bus.errors import ConfigError

    for bad in ({"ranks": []}, {"ranks": [0, 0]}, {"ranks": [2]}, {"max_batches": -1}):
        with pytest.raises(ConfigError):
            run_training(FeedOptions(bootstrap_servers="x", checkpoint_dir=tmp_path, dp_size=2, **bad), Step)
    assert Feed.opened == [] and Step.made == []
