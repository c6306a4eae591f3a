"""train-sim without a broker: the tiny policy, the loss on a real shard layout, checkpoints and resume
through the trainer loop, and the reconciliation of trained batches (the command: ``tests/unit/cli/test_train.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import rollout_bus.consumers.feed.loop as loop
import rollout_bus.consumers.feed.training as training
from rollout_bus.errors import ConfigError, ContractError
from rollout_bus.model.shard_tensors import shard_tensors
from rollout_bus.model.shards import load_shard, write_batch_shards
from rollout_bus.model.trainer_math import response_token_index, shard_support_log_probs
from rollout_bus.consumers.feed.training import (CHECKPOINT_NAME, TRAINED_NAME, TrainState, read_trained, reconcile_training,
                                       trained_jsonl)
from rollout_bus.sim.trainer import TrainSimOptions, build_policy, previous_tokens, rank_loss, run_train_sim, train_step

VOCAB, DIM = 64, 8


def rank_data(seed: int, *, samples: int = 4, policy=None) -> dict[str, list[Any]]:
    """One rank's train data (as the shard writer splits it), with top-k supports holding each token;
    with ``policy``, rollout log-probs are that policy's own (an on-policy batch)."""
    rng = np.random.default_rng(seed)
    data: dict[str, list[Any]] = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward",
                                                   "truncated", "rollout_ids", "sample_indices", "group_indices",
                                                   "adapter_slots", "partition", "rollout_sampling_mask_ids",
                                                   "rollout_sampling_mask_offsets")}
    rewards = np.array([1.0, -1.0, 0.5, -0.5] * samples)[:samples]
    for i in range(samples):
        prompt, response = int(rng.integers(3, 8)), int(rng.integers(4, 12))
        tokens = rng.integers(0, VOCAB, size=prompt + response)
        ids, offsets = [], [0]
        for t in tokens[prompt:]:
            support = {int(t)} if rng.random() < 0.2 else {int(t), *rng.choice(VOCAB, 5, replace=False).tolist()}
            ids += sorted(support)
            offsets.append(len(ids))
        loss = (rng.random(response) > 0.2).astype(np.uint8)
        for key, value in (("tokens", tokens), ("response_lengths", response), ("loss_masks", loss),
                           ("rewards", rewards[i]), ("raw_reward", rewards[i]), ("truncated", 0),
                           ("rollout_ids", i), ("sample_indices", i), ("group_indices", i // 2),
                           ("adapter_slots", -1), ("partition", i), ("rollout_sampling_mask_ids", np.array(ids)),
                           ("rollout_sampling_mask_offsets", np.array(offsets))):
            data[key].append(value)
    if policy is not None:
        shard = _written(data, None, write=False)
        with torch.no_grad():
            index = response_token_index(shard)
            lp = shard_support_log_probs(policy(previous_tokens(shard, index)), shard).numpy()
        lengths = np.cumsum([0, *data["response_lengths"]])
        data["rollout_log_probs"] = [lp[a:b].astype(np.float32) for a, b in zip(lengths[:-1], lengths[1:])]
    return data


def _written(data: dict[str, list[Any]], out: Path | None, *, write: bool = True,
             seq: int = 0) -> dict[str, torch.Tensor]:
    """The shard's tensors as a trainer loads them (through a real shard file when ``write``)."""
    if not write:
        return {k: torch.from_numpy(v) for k, v in shard_tensors(data).items()}
    write_batch_shards(out, seq, [data], metrics={}, sources=[])
    return load_shard(out / f"batch-{seq:08d}" / "dp-000.safetensors").tensors


@dataclass
class FakeBatch:
    seq: int
    rank: int
    tensors: dict[str, torch.Tensor]
    metrics: dict[str, Any]

    def __len__(self) -> int:
        return int(self.tensors["response_lengths"].numel())


class FakeFeed:
    """A ShardFeed over in-memory batches (``batches[rank]``), with a position and an optional crash."""

    batches: dict[int, list[FakeBatch]] = {}
    crash_at: int | None = None  # raise when asked for this seq (a simulated kill)
    published: list[tuple[int, int, int]] = []  # (rank, version, step) of every publish_version

    def __init__(self, bootstrap_servers: str, *, rank: int, dp_size: int, topic_prefix: str = "", **_: Any) -> None:
        self.rank, self.dp_size, self.topic = rank, dp_size, f"{topic_prefix}rollout.shards"
        self.next_seq = 0

    def next_batch(self, on_wait=None) -> FakeBatch | None:
        if self.next_seq == FakeFeed.crash_at:
            raise KeyboardInterrupt("simulated kill")
        mine = FakeFeed.batches[self.rank]
        if self.next_seq >= len(mine):
            return None
        self.next_seq += 1
        return mine[self.next_seq - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"next_seq": self.next_seq, "rank": self.rank, "dp_size": self.dp_size, "topic": self.topic}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state["rank"] == self.rank and state["topic"] == self.topic
        self.next_seq = state["next_seq"]

    def publish_version(self, version: int, step: int) -> None:
        FakeFeed.published.append((self.rank, version, step))

    def close(self) -> None:
        pass


@pytest.fixture
def fake_feeds(monkeypatch):
    FakeFeed.batches = {rank: [FakeBatch(seq, rank, _written(rank_data(100 * seq + rank), None, write=False),
                                         {"episode_raw_reward": 0.5}) for seq in range(5)] for rank in (0, 1)}
    FakeFeed.crash_at = None
    FakeFeed.published = []
    monkeypatch.setattr(loop, "ShardFeed", FakeFeed)
    FakeReporter.reports = []
    monkeypatch.setattr(training, "FlowReporter", FakeReporter)
    return FakeFeed


class FakeReporter:
    """The trainer's FlowReporter: every report kept (``reports``: (metrics, final)), nothing sent."""

    reports: list[tuple[dict, bool]] = []

    def __init__(self, conn, topics, stage, source, **_: Any) -> None:
        assert (stage, source) == ("trainer", "trainer")  # every rank in one process
        self.elapsed_s = 1.0

    def report(self, metrics: dict, *, final: bool = False) -> bool:
        FakeReporter.reports.append((metrics, final))
        return True

    def close(self) -> None:
        pass


def options(tmp_path: Path, name: str, **more: Any) -> TrainSimOptions:
    return TrainSimOptions(bootstrap_servers="unused:9092", checkpoint_dir=tmp_path / name, ranks=[0, 1], dp_size=2,
                           vocab_size=VOCAB, dim=DIM, lr=1e-2, torch_threads=0, **more)


# ---------------------------------------------------------------------------- the policy and the loss


def test_the_policy_is_fixed_by_its_seed_and_gives_logits_over_the_vocabulary():
    prev = torch.tensor([0, 5, 63, 5])
    a, b, c = build_policy(VOCAB, DIM, 1), build_policy(VOCAB, DIM, 1), build_policy(VOCAB, DIM, 2)
    state = torch.get_rng_state()
    build_policy(VOCAB, DIM, 3)
    assert torch.equal(state, torch.get_rng_state())  # the global RNG is left alone
    assert a(prev).shape == (4, VOCAB) and a(prev).dtype == torch.float32
    assert torch.equal(a(prev), b(prev)) and not torch.equal(a(prev), c(prev))
    assert torch.equal(a(prev)[1], a(prev)[3])  # a function of the previous token only


def test_response_tokens_and_their_previous_tokens_follow_the_shard_layout(tmp_path):
    data = rank_data(0)
    tensors = _written(data, tmp_path)
    index = response_token_index(tensors)
    prev = previous_tokens(tensors, index)
    expected_targets, expected_prev = [], []
    for tokens, rl in zip(data["tokens"], data["response_lengths"]):
        start = len(tokens) - rl
        expected_targets += tokens[start:].tolist()
        expected_prev += tokens[start - 1:-1].tolist()
    assert tensors["tokens"][index].tolist() == expected_targets
    assert prev.tolist() == expected_prev


def test_the_loss_decreases_over_a_few_steps_on_an_on_policy_shard(tmp_path):
    policy = build_policy(VOCAB, DIM, 0)
    tensors = _written(rank_data(1, samples=6, policy=policy), tmp_path)
    state = TrainState(policy, torch.optim.Adam(policy.parameters(), lr=1e-2))
    batch = FakeBatch(0, 0, tensors, {})
    losses, ratios = [], []
    for _ in range(6):
        (row,) = train_step(state, [batch])
        losses.append(row["loss"])
        ratios.append(row["mean_abs_log_ratio"])
    assert ratios[0] == pytest.approx(0.0, abs=1e-5)  # on-policy at the start: ratio 1 everywhere
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert ratios[-1] > 0


def test_the_full_vocabulary_is_used_when_a_shard_has_no_masks(tmp_path):
    data = rank_data(2)
    del data["rollout_sampling_mask_ids"], data["rollout_sampling_mask_offsets"]
    tensors = _written(data, tmp_path)
    policy = build_policy(VOCAB, DIM, 0)
    loss, stats = rank_loss(policy, tensors)
    assert loss.requires_grad and stats["mean_abs_log_ratio"] == 0.0  # no rollout log-probs: the new ones


def test_a_token_outside_the_vocabulary_is_a_clear_error(tmp_path):
    tensors = _written(rank_data(3), tmp_path)
    with pytest.raises(ConfigError, match="vocab_size"):
        rank_loss(build_policy(32, DIM, 0), tensors)


# ---------------------------------------------------------------------------- checkpoints and the loop


class PositionOnly:
    def __init__(self, rank: int, seq: int | None) -> None:
        self.state = {"next_seq": seq, "rank": rank, "dp_size": 2, "topic": "t.rollout.shards"}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def test_a_checkpoint_round_trips_model_optimizer_feeds_history_and_rng(tmp_path):
    policy = build_policy(VOCAB, DIM, 0)
    state = TrainState(policy, torch.optim.Adam(policy.parameters(), lr=1e-2))
    rows = train_step(state, [FakeBatch(4, 0, _written(rank_data(4), tmp_path), {})])
    state.trained, state.history = [4], rows
    shape = {"vocab_size": VOCAB, "dim": DIM}
    state.save(tmp_path / "ck", {0: PositionOnly(0, 5), 1: PositionOnly(1, 5)}, shape)
    assert (tmp_path / "ck" / CHECKPOINT_NAME).exists()
    assert read_trained(tmp_path / "ck") == rows
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")]  # no temporaries left

    (tmp_path / "ck" / TRAINED_NAME).write_text("")  # a crash between the two renames: jsonl lags
    fresh_policy = build_policy(VOCAB, DIM, 9)
    fresh = TrainState(fresh_policy, torch.optim.Adam(fresh_policy.parameters(), lr=1e-2))
    feeds = {0: PositionOnly(0, None), 1: PositionOnly(1, None)}
    assert fresh.load(tmp_path / "ck", feeds, shape)
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), fresh_policy.state_dict().values()))
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 1
    assert fresh.trained == [4] and fresh.history == rows and feeds[1].state["next_seq"] == 5
    assert read_trained(tmp_path / "ck") == rows  # rewritten from the checkpoint
    with pytest.raises(ConfigError, match="checkpoint"):
        fresh.load(tmp_path / "ck", feeds, {**shape, "dim": DIM + 1})
    assert not fresh.load(tmp_path / "none", feeds, shape)


def test_the_loop_trains_every_batch_once_in_order_and_checkpoints_on_cadence(tmp_path, fake_feeds):
    result = run_train_sim(options(tmp_path, "a", max_batches=3, checkpoint_every=2))
    assert (result.batches, result.last_seq) == (3, 2)
    saved = torch.load(tmp_path / "a" / CHECKPOINT_NAME, weights_only=False)
    assert saved["trained"] == [0, 1, 2] and saved["feeds"][0]["next_seq"] == 3
    result = run_train_sim(options(tmp_path, "a", checkpoint_every=2))  # resumes, runs to the end
    assert (result.resumed_from, result.batches_this_run, result.batches, result.last_seq) == (3, 2, 5, 4)
    rows = read_trained(tmp_path / "a")
    assert [(r["seq"], r["rank"]) for r in rows] == [(s, r) for s in range(5) for r in (0, 1)]
    assert reconcile_training(range(5), rows, [0, 1]).ok
    # after each step one rank says the new weights are live: version seq + 1, step seq
    assert FakeFeed.published == [(0, seq + 1, seq) for seq in range(5)]
    # its flow after each step, then a final report at the end of each run: 3 steps, then 2 more
    assert [(m["flow/trainer/steps"], final) for m, final in FakeReporter.reports] == [
        (1.0, False), (2.0, False), (3.0, False), (3.0, True), (1.0, False), (2.0, False), (2.0, True)]


def test_a_kill_between_checkpoints_repeats_exactly_the_batches_after_the_checkpoint(tmp_path, fake_feeds):
    undisturbed = run_train_sim(options(tmp_path, "undisturbed"))
    fake_feeds.crash_at = 3  # killed while fetching seq 3: seq 2 is trained but not checkpointed
    with pytest.raises(KeyboardInterrupt):
        run_train_sim(options(tmp_path, "drill"))
    assert {r["seq"] for r in read_trained(tmp_path / "drill")} == {0, 1}
    fake_feeds.crash_at = None
    resumed = run_train_sim(options(tmp_path, "drill"))
    assert resumed.resumed_from == 2 and resumed.batches_this_run == 3
    assert read_trained(tmp_path / "drill") == read_trained(tmp_path / "undisturbed")  # same seqs, same losses
    assert resumed.final_loss == undisturbed.final_loss
    again = run_train_sim(options(tmp_path, "drill"))  # positioned at the run's end: nothing more
    assert again.batches_this_run == 0 and again.batches == 5


def test_feeds_that_disagree_on_the_seq_are_an_error(tmp_path, fake_feeds):
    fake_feeds.batches[1] = fake_feeds.batches[1][1:]
    with pytest.raises(ContractError, match="disagree"):
        run_train_sim(options(tmp_path, "x"))


def test_options_are_checked():
    for bad in ({"ranks": []}, {"ranks": [0, 0]}, {"ranks": [2]}, {"checkpoint_every": 0}):
        with pytest.raises(ConfigError):
            TrainSimOptions(bootstrap_servers="x", checkpoint_dir=Path("x"), dp_size=2, **bad).check()


# ---------------------------------------------------------------------------- reconciling trained batches


def rows(*pairs: tuple[int, int]) -> list[dict[str, Any]]:
    return [{"seq": s, "rank": r, "loss": float(s)} for s, r in pairs]


def test_every_written_batch_trained_once_per_rank_in_order_is_ok():
    check = reconcile_training([0, 1, 2], rows((0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)), [0, 1])
    assert check.ok and check.problems() == [] and (check.batches, check.last_seq, check.final_loss) == (3, 2, 2.0)
    assert "every written batch trained once per rank" in check.summary()


def test_a_missing_duplicated_unexpected_or_reordered_seq_is_caught():
    missing = reconcile_training([0, 1, 2], rows((0, 0), (0, 1), (1, 0), (2, 0), (2, 1)), [0, 1])
    assert not missing.ok and missing.missing == {1: [1]}
    duplicated = reconcile_training([0, 1], rows((0, 0), (0, 1), (1, 0), (1, 1), (1, 0)), [0, 1])
    assert not duplicated.ok and duplicated.duplicated == {0: [1]}
    unexpected = reconcile_training([0], rows((0, 0), (0, 1), (1, 1), (0, 2)), [0, 1])
    assert not unexpected.ok and unexpected.unexpected == {1: [1], 2: [0]}
    reordered = reconcile_training([0, 1], rows((1, 0), (0, 0), (0, 1), (1, 1)), [0, 1])
    assert not reordered.ok and reordered.out_of_order == {0: [1, 0]}
    assert all(c.problems() for c in (missing, duplicated, unexpected, reordered))
    assert "MISMATCH" in missing.summary()
    nothing = reconcile_training([0], [], [0])
    assert not nothing.ok and nothing.missing == {0: [0]} and nothing.final_loss is None


def test_trained_jsonl_is_one_json_object_per_line():
    text = trained_jsonl(rows((0, 0), (0, 1))).decode()
    assert [json.loads(line) for line in text.splitlines()] == rows((0, 0), (0, 1))
