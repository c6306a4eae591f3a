"""Rollout metrics, named as miles names them so its dashboards carry over (CONTRACTS.md section 6).

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
* ``EpisodeStats`` (from ``rollout_bus.episode_stats``) accumulates the episode-length and reward
  keys over a stream window and returns exactly what these functions return for the same samples.

Rewards are averaged as exact fractions and rounded once, so the result does not depend on
summation order. Rewards that are not a bool, an int or a finite float are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from rollout_bus.episode_stats import (
    EpisodeStats,
    LengthHistogram,
    RewardMean,
    RolloutKey,
    Scope,
    add_rollout_reward,
    adapter_scope,
    episode_lengths,
    get_rollout_key,
    length_metrics,
    reward_metrics,
    reward_source,
    rollout_reward,
)
from rollout_bus.errors import ContractError, must_be
from rollout_bus.sample import Sample, Status

__all__ = [
    "EpisodeStats",
    "compute_episode_response_length_metrics",
    "compute_metrics_from_samples",
    "compute_statistics",
    "compute_training_sample_metrics",
    "get_rollout_key",
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


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}{name}": value for name, value in metrics.items()}
