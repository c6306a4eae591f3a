"""Rollout metrics, named as miles names them so its dashboards carry over (docs/data-model.md section 6).

Contract (loggers prefix every key with ``rollout/``):

* ``get_rollout_key(sample, position)`` -> ``(adapter, kind, group_index, id)``; one key is one
  episode (compaction siblings share it).
* ``compute_statistics(values)`` -> ``{"mean", "median", "max", "min"}`` as floats, with numpy's
  definitions (the median averages the two middle values of an even count). Empty input raises
  ``ContractError`` (a ``ValueError``, as numpy's reductions raise in miles).
* ``compute_episode_response_length_metrics(samples)``: per rollout key, the trainable length
  (``0 if remove_sample else effective_response_length``) and the total length
  (``response_length``) are summed over siblings; then ``episode_response_length/{mean,median,
  max,min}`` over the trainable sums and ``episode_total_response_length/mean``. With any adapter
  in the batch, only ``adapter/{name}/...`` keys, each over that adapter's samples (adapter-less
  samples feed none). Empty input -> ``{}``.
* ``compute_training_sample_metrics(samples)``: ``num_training_samples`` (rows) and
  ``episode_raw_reward``: the mean over rollouts of each rollout's mean numeric reward, read from
  ``metadata["raw_reward"]`` when the batch's first sample has that key, else from ``reward``.
  Rollouts are grouped by the full rollout key, so the same id under two adapters is two
  rollouts. With adapters, also ``adapter/{name}/episode_raw_reward`` over that adapter's
  rollouts; the unscoped key stays, over all rollouts. 0.0 where no rollout has a reward.
  Empty input -> ``{"num_training_samples": 0, "episode_raw_reward": 0.0}``.
* ``compute_metrics_from_samples(samples)``: the union of the two above, plus
  ``response_len/{mean,median,max,min}`` over effective lengths, ``truncated_ratio`` (TRUNCATED
  rows / rows), and ``weight_version/{mean,median,max,min}`` over the samples whose
  ``oldest_weight_version`` is not None (omitted when none is). For an empty batch only the
  training-sample part is returned: the per-row statistics have no value to report.
* ``compute_staleness_metrics(samples, step)``: how many trainer steps behind the policy that
  generated a batch is, for a batch that trains at trainer step ``step`` (step batching: batch
  ``k`` at step ``k``; the trainer publishes weight version ``k + 1`` after it). A token's staleness
  is ``step - version``. ``staleness/mean`` and ``staleness/max`` are token-weighted over the
  trainable response tokens (``loss_mask`` non-zero; ``None`` = all; ``remove_sample`` rows train
  on nothing and count none): a token's version is its ``rollout_token_versions`` entry when the
  sample has that array (entries < 0, tokens the model did not generate, are skipped), else the
  sample's ``oldest_weight_version`` for every token. ``staleness/oldest`` is ``step`` minus the
  oldest version in the batch, ``sample_oldest_version`` over every sample (removed ones and
  untrained tokens included): what the shard writer's safety net judges, so after it
  ``staleness/oldest <= max_staleness``. Scoped as the length metrics: with any adapter in the
  batch only ``adapter/{name}/staleness/...``. A scope with no trainable versioned token has no
  mean/max; one with no version at all has no key. Values are floats (negative when a version is
  ahead of ``step``); the mean is an exact integer sum divided once. Empty input -> ``{}``.
  Not part of ``compute_metrics_from_samples`` (it needs the step): the shard writer adds it with
  step = the batch seq.
* ``sample_oldest_version(sample)``: the smallest ``rollout_token_versions`` entry >= 0 when the
  sample has the array and any such entry, else ``oldest_weight_version`` (None: no numeric
  version). ``rollout_token_versions`` is read with ``getattr`` (None when absent), must be 1-D
  integers of ``response_length`` entries, else ``ContractError``.
* ``EpisodeStats`` (from ``rollout_bus.model.episode_stats``) accumulates the episode-length and reward
  keys over a stream window and returns exactly what these functions return for the same samples.

Rewards are averaged as exact fractions and rounded once, so the result does not depend on
summation order. Rewards that are not a bool, an int or a finite float are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from rollout_bus.model.episode_stats import (EpisodeStats, LengthHistogram, RewardMean, Scope, add_rollout_reward,
                                             adapter_scope, episode_lengths, length_metrics, reward_metrics,
                                             reward_source, rollout_reward)
from rollout_bus.model.sample import RolloutKey, get_rollout_key
from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.sample import Sample, Status

__all__ = [
    "EpisodeStats",
    "compute_episode_response_length_metrics",
    "compute_metrics_from_samples",
    "compute_staleness_metrics",
    "compute_statistics",
    "compute_training_sample_metrics",
    "sample_oldest_version",
]


def compute_statistics(values: Iterable[Any]) -> dict[str, float]:
    """Mean, median, max and min of a non-empty sequence of numbers, as Python floats."""
    try:
        array = np.asarray(list(values))
    except (TypeError, ValueError) as exc:
        raise ContractError(must_be("values", "a flat sequence of numbers", str(exc))) from exc
    if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "biuf":
        raise ContractError(
            must_be("values", "a non-empty flat sequence of numbers", f"shape {array.shape}, dtype {array.dtype}")
        )
    array = array.astype(np.float64)
    return {
        "mean": float(np.mean(array)),
        "median": float(np.median(array)),
        "max": float(np.max(array)),
        "min": float(np.min(array)),
    }


def group_rollouts(samples: Sequence[Sample]) -> dict[RolloutKey, list[Sample]]:
    """Samples grouped into episodes by rollout key, in first-seen order."""
    episodes: dict[RolloutKey, list[Sample]] = {}
    for position, sample in enumerate(samples):
        episodes.setdefault(get_rollout_key(sample, position), []).append(sample)
    return episodes


def compute_episode_response_length_metrics(samples: Iterable[Sample]) -> dict[str, float]:
    """Episode length statistics, counting compaction siblings as one episode."""
    histograms: dict[Scope, LengthHistogram] = {}
    for segments in group_rollouts(list(samples)).values():
        scope = adapter_scope(segments[0])
        histograms.setdefault(scope, LengthHistogram()).add(*episode_lengths(segments))
    return length_metrics(histograms)


def compute_training_sample_metrics(samples: Iterable[Sample]) -> dict[str, float | int]:
    """Rows trained on, and the raw reward with one vote per rollout however many rows it has."""
    samples = list(samples)
    source = reward_source(samples[0]) if samples else "reward"
    means: dict[Scope, RewardMean] = {}
    adapter_names: set[str] = set()
    for segments in group_rollouts(samples).values():
        scope = adapter_scope(segments[0])
        if scope is not None:
            adapter_names.add(scope)
        add_rollout_reward(means, scope, rollout_reward(segments, source))
    return {"num_training_samples": len(samples)} | reward_metrics(means, adapter_names)


def compute_metrics_from_samples(samples: Iterable[Sample]) -> dict[str, float | int]:
    """Everything section 6 defines for one batch (keys without the ``rollout/`` prefix)."""
    samples = list(samples)
    result: dict[str, float | int] = {}
    result |= compute_training_sample_metrics(samples)
    result |= compute_episode_response_length_metrics(samples)
    if not samples:
        return result
    result |= _prefixed(compute_statistics(s.effective_response_length for s in samples), "response_len/")
    truncated = sum(1 for s in samples if s.status == Status.TRUNCATED)
    result["truncated_ratio"] = truncated / len(samples)
    versions = [v for v in (s.oldest_weight_version for s in samples) if v is not None]
    if versions:
        result |= _prefixed(compute_statistics(versions), "weight_version/")
    return result


def token_versions(sample: Sample) -> np.ndarray | None:
    """The sample's ``rollout_token_versions`` as int64 (one per response token), or None without them."""
    versions = getattr(sample, "rollout_token_versions", None)
    if versions is None:
        return None
    array = np.asarray(versions)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ContractError(must_be("rollout_token_versions", "a flat sequence of integers",
                                    f"shape {array.shape}, dtype {array.dtype}", where=sample._where()))
    if array.size != int(sample.response_length):
        raise ContractError(must_be("len(rollout_token_versions)", f"response_length={sample.response_length}",
                                    array.size, where=sample._where()))
    return array.astype(np.int64)


def sample_oldest_version(sample: Sample) -> int | None:
    """The oldest policy version behind the sample's response (see the module docstring)."""
    versions = token_versions(sample)
    if versions is not None:
        generated = versions[versions >= 0]
        if generated.size:
            return int(generated.min())
    return sample.oldest_weight_version


def _trainable_versions(sample: Sample) -> np.ndarray:
    """The version of each trainable response token the sample has a version for (int64)."""
    length = int(sample.response_length)
    if sample.remove_sample:
        return np.zeros(0, np.int64)
    if sample.loss_mask is None:
        trainable = np.ones(length, bool)
    else:
        trainable = np.asarray(sample.loss_mask) != 0
        if trainable.shape != (length,):
            raise ContractError(must_be("len(loss_mask)", f"response_length={length}", trainable.size,
                                        where=sample._where()))
    versions = token_versions(sample)
    if versions is not None:
        chosen = versions[trainable]
        return chosen[chosen >= 0]
    oldest = sample.oldest_weight_version
    return np.zeros(0, np.int64) if oldest is None else np.full(int(trainable.sum()), oldest, np.int64)


class _StalenessTally:
    """One scope's token staleness (exact sum, count, max) and oldest version."""

    def __init__(self) -> None:
        self.tokens = 0
        self.total = 0
        self.max: int | None = None
        self.oldest: int | None = None

    def add(self, sample: Sample, step: int) -> None:
        oldest = sample_oldest_version(sample)
        if oldest is not None:
            self.oldest = oldest if self.oldest is None else min(self.oldest, oldest)
        staleness = step - _trainable_versions(sample)
        if staleness.size:
            self.tokens += int(staleness.size)
            self.total += int(staleness.sum())
            top = int(staleness.max())
            self.max = top if self.max is None else max(self.max, top)

    def metrics(self, prefix: str, step: int) -> dict[str, float]:
        result: dict[str, float] = {}
        if self.tokens:
            result[f"{prefix}staleness/mean"] = self.total / self.tokens
            result[f"{prefix}staleness/max"] = float(self.max)
        if self.oldest is not None:
            result[f"{prefix}staleness/oldest"] = float(step - self.oldest)
        return result


def compute_staleness_metrics(samples: Iterable[Sample], step: int) -> dict[str, float]:
    """Token-weighted staleness of a batch trained at trainer step ``step`` (see the module docstring)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ContractError(must_be("step", "an integer (the trainer step the batch trains at)", step))
    step = int(step)
    tallies: dict[Scope, _StalenessTally] = {}
    for sample in samples:
        tallies.setdefault(adapter_scope(sample), _StalenessTally()).add(sample, step)
    if any(scope is not None for scope in tallies):
        result: dict[str, float] = {}
        for name in sorted(scope for scope in tallies if scope is not None):
            result |= tallies[name].metrics(f"adapter/{name}/", step)
        return result
    tally = tallies.get(None)
    return tally.metrics("", step) if tally is not None else {}


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}{name}": value for name, value in metrics.items()}
