"""The real trainer's loss on a shard of the policy generator's own episodes: the log-probs it recomputes
are the generator's, at the weights each token was sampled under.

Proven here, without a broker: calculator episodes from ``iter_policy_turns`` (a real ``PolicyEngine``,
top-p 0.9), merged per episode (``merge_samples``), converted and split as the shard writer does
(``convert_samples_to_train_data``, ``split_train_data_by_dp``), written and loaded as a real shard
(``write_batch_shards``, ``load_shard``), then ``rank_loss``:

* at version 0 with the generating model the recomputed support log-probs equal the rollout ones
  (``mismatch_max`` < 1e-5), the ratio is exactly 1, staleness is 0, the full-vocabulary log-prob is
  off by the mass top-p cut (> 0), the row's counts and raw reward are the batch's, and the loss is
  finite with a non-zero gradient (some group's rewards differ);
* one Adam step later (version 1), with the tokens' version 0 checkpoint registered, the old log-probs
  are recomputed at version 0 (mismatch still < 1e-5; a wrong checkpoint registered as version 0 shows
  a large one), staleness is 1 and the ratio moves off 1;
* the trainer's temperature must be the generators': the same one gives no mismatch, another a large one;
* a token version no checkpoint was registered for is a ``ContractError`` naming the version and batch;
* ``LearnOptions.check`` refuses unusable ranks, temperatures and ``max_batches`` with ``ConfigError``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rollout_bus.config import GenerateSettings
from rollout_bus.errors import ConfigError, ContractError
from rollout_bus.learn.engine import PolicyEngine
from rollout_bus.learn.generator import iter_policy_turns
from rollout_bus.learn.trainer import LearnOptions, _PublishedWeights, rank_loss
from rollout_bus.model.shards import batch_path, load_shard, write_batch_shards
from rollout_bus.model.train_data import convert_samples_to_train_data, split_train_data_by_dp
from rollout_bus.model.turns import merge_samples
from rollout_bus.policy.checkpoint import save_checkpoint
from rollout_bus.policy.model import build_policy
from rollout_bus.policy.sampler import Sampler
from rollout_bus.wire.weight_version import WeightVersion

# seed 28, 30 episodes in groups of 4: some episodes call the tool and two answer right, so some group's
# rewards differ (checked below)
SEED, EPISODES, PER_PROMPT = 28, 30, 4
CPU = torch.device("cpu")


@dataclass
class FakeBatch:
    """What ``rank_loss`` reads of a ``TrainBatch``."""

    seq: int
    rank: int
    tensors: dict[str, Any]

    def __len__(self) -> int:
        return int(self.tensors["response_lengths"].numel())


def _shard(out: Path, *, temperature: float = 1.0, version: int = 0, seq: int = 0, live=None) -> FakeBatch:
    """One rank's batch of the generator's episodes, through the project's own path to a shard file."""
    settings = GenerateSettings(episodes=EPISODES, n_samples_per_prompt=PER_PROMPT, top_p=0.9, top_k=20, seed=SEED,
                                temperature=temperature, policy_version=version)
    engine = PolicyEngine(SEED, Sampler(temperature, 0.9, 20), live=live, version=version, device="cpu")
    episodes: dict[int, list] = defaultdict(list)
    for sample, _ in iter_policy_turns(settings, engine):
        episodes[sample.index].append(sample)
    merged = []
    for index in sorted(episodes):
        segments = merge_samples(episodes[index])
        assert len(segments) == 1
        merged.append(segments[0])
    data = convert_samples_to_train_data(merged)
    write_batch_shards(out, seq, split_train_data_by_dp(data, 1), metrics={}, sources=[])
    shard = load_shard(batch_path(out, seq) / "dp-000.safetensors")
    assert len(shard) == EPISODES and shard.has_sampling_masks
    return FakeBatch(seq, 0, shard.tensors)


def _options(tmp_path: Path, **more: Any) -> LearnOptions:
    return LearnOptions(bootstrap_servers="unused", checkpoint_dir=tmp_path, **more)


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> FakeBatch:
    return _shard(tmp_path_factory.mktemp("shards"))


@pytest.fixture()
def weights(tmp_path) -> _PublishedWeights:
    """Version 0 registered: the seed's initial weights, as ``run_learn`` publishes them first."""
    published = _PublishedWeights({}, CPU)
    published.add(save_checkpoint(build_policy(SEED), tmp_path / "weights", 0, 0))
    return published


def _groups_with_differing_rewards(batch: FakeBatch) -> int:
    raw = batch.tensors["raw_rewards"].numpy()
    groups = batch.tensors["group_indices"].numpy()
    return sum(len(set(raw[groups == g].tolist())) > 1 for g in np.unique(groups))


def test_at_the_generating_weights_the_recomputed_log_probs_are_the_rollouts(batch, weights, tmp_path):
    assert _groups_with_differing_rewards(batch) >= 1, "the seed no longer gives a group with a reward signal"
    model = build_policy(SEED)
    loss, row = rank_loss(model, weights, 0, batch, _options(tmp_path))
    assert row["mismatch_max"] < 1e-5
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and row["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert row["staleness_max"] == 0 and row["staleness_mean"] == 0
    assert row["full_vocab_mismatch_mean"] > 0 and row["full_vocab_mismatch_p99"] > row["mismatch_max"]
    assert row["seq"] == 0 and row["rank"] == 0 and row["samples"] == EPISODES and row["version"] == 0
    raw = batch.tensors["raw_rewards"].numpy().astype(np.float64)
    assert row["reward_mean"] == pytest.approx(float(raw.mean())) and 0 < row["reward_mean"] < 1
    assert row["clip_fraction"] == 0 and row["mean_abs_log_ratio"] == pytest.approx(0.0, abs=1e-7)
    assert torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().max() > 0 for g in grads), "a batch with a reward signal gave no gradient"


def _one_step_ahead(batch: FakeBatch, weights: _PublishedWeights, options: LearnOptions) -> torch.nn.Module:
    model = build_policy(SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=options.lr)
    loss, _ = rank_loss(model, weights, 0, batch, options)
    loss.backward()
    optimizer.step()
    return model


def test_one_step_later_the_old_log_probs_come_from_the_tokens_version(batch, weights, tmp_path):
    options = _options(tmp_path)
    model = _one_step_ahead(batch, weights, options)
    loss, row = rank_loss(model, weights, 1, batch, options)
    assert row["version"] == 1 and row["staleness_max"] == 1 and row["staleness_mean"] == 1
    assert row["mismatch_max"] < 1e-5  # old recomputed at version 0, the weights the tokens came from
    assert abs(row["ratio_mean"] - 1.0) > 1e-4 and row["mean_abs_log_ratio"] > 1e-4  # the step moved the policy
    assert torch.isfinite(loss)
    # the registered checkpoint is what was used: other weights registered as version 0 show a large mismatch
    wrong = _PublishedWeights({}, CPU)
    wrong.add(save_checkpoint(build_policy(SEED + 1), tmp_path / "wrong", 0, 0))
    _, off = rank_loss(model, wrong, 1, batch, options)
    assert off["mismatch_max"] > 1e-2


def _record(ref) -> WeightVersion:
    return WeightVersion(ref.version, ref.step, 0, f"file://{ref.path}", ref.sha256, ref.bytes)


def test_a_batch_spanning_two_versions_is_scored_at_each_tokens_own_version(batch, weights, tmp_path):
    """Tokens of versions 0 and 1 (new weights went live mid-run, cutting turns), trained at version 2."""
    options = _options(tmp_path)
    model = _one_step_ahead(batch, weights, options)
    v0 = save_checkpoint(build_policy(SEED), tmp_path / "weights", 0, 0)
    v1 = save_checkpoint(model, tmp_path / "weights", 1, 0)
    polls: list[int] = []
    mixed = _shard(tmp_path / "mixed", seq=1, live=lambda: polls.append(1) or _record(v0 if len(polls) <= 9 else v1))
    versions = mixed.tensors["rollout_token_versions"].numpy()
    sampled = versions[versions >= 0]
    assert set(sampled.tolist()) == {0, 1}
    with pytest.raises(ContractError, match="batch 1 rank 0: tokens of weights version 1"):  # not registered yet
        rank_loss(model, weights, 2, mixed, options)
    weights.add(v1)
    optimizer = torch.optim.Adam(model.parameters(), lr=options.lr)  # version 2: one more step
    rank_loss(model, weights, 1, batch, options)[0].backward()
    optimizer.step()
    _, row = rank_loss(model, weights, 2, mixed, options)
    assert row["mismatch_max"] < 1e-5  # each token's old log-prob at its own version
    assert row["staleness_max"] == 2 and row["staleness_mean"] == pytest.approx(2 - float(sampled.mean()))
    assert abs(row["ratio_mean"] - 1.0) > 1e-4


@pytest.mark.parametrize("trainer_temperature, matches", [(0.7, True), (1.0, False)])
def test_the_trainer_must_divide_by_the_generators_temperature(tmp_path, weights, trainer_temperature, matches):
    batch = _shard(tmp_path / "shards", temperature=0.7)
    _, row = rank_loss(build_policy(SEED), weights, 0, batch, _options(tmp_path, temperature=trainer_temperature))
    if matches:
        assert row["mismatch_max"] < 1e-5
    else:
        assert row["mismatch_max"] > 1e-2


def test_a_token_version_without_a_registered_checkpoint_is_a_contract_error_naming_it(batch, weights, tmp_path):
    versions = batch.tensors["rollout_token_versions"]
    tensors = {**batch.tensors, "rollout_token_versions": torch.where(versions >= 0, torch.full_like(versions, 7),
                                                                      versions)}
    stranger = FakeBatch(4, 0, tensors)
    with pytest.raises(ContractError, match=r"batch 4 rank 0: tokens of weights version 7, which this trainer "
                                            r"never published \(published: \[0\]\)"):
        rank_loss(build_policy(SEED), weights, 0, stranger, _options(tmp_path))
    # a version the current model holds needs no checkpoint: the same tokens at version 7 are scored
    _, row = rank_loss(build_policy(SEED), weights, 7, stranger, _options(tmp_path))
    assert row["mismatch_max"] < 1e-5 and row["staleness_max"] == 0


@pytest.mark.parametrize("more, field", [
    ({"ranks": []}, "ranks"),
    ({"ranks": [0, 0], "dp_size": 2}, "ranks"),
    ({"ranks": [1], "dp_size": 1}, "ranks"),
    ({"ranks": [-1], "dp_size": 2}, "ranks"),
    ({"temperature": 0.0}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"max_batches": -1}, "max_batches"),
])
def test_unusable_learn_options_are_config_errors(tmp_path, more, field):
    with pytest.raises(ConfigError, match=field):
        _options(tmp_path, **more).check()


def test_usable_learn_options_pass_the_check(tmp_path):
    _options(tmp_path).check()
    _options(tmp_path, ranks=[1, 0], dp_size=2, temperature=0.5, max_batches=0).check()
