"""Trainer data: samples -> per-rank training batches (docs/data-model.md section 5).

Contract:

* ``convert_samples_to_train_data(samples, *, reward_key=None, normalization="grpo")`` turns a
  batch of samples into a dict of per-sample lists (``PER_SAMPLE_KEYS``). Token data are numpy
  arrays in their shard dtypes: ``tokens`` int32, ``loss_masks`` uint8 (None -> ones,
  ``remove_sample`` -> zeros), ``rollout_log_probs`` float32 (only when every sample has them),
  ``rollout_token_versions`` int64 (per response token, -1 where not generated; only when every
  sample has them),
  ``rollout_sampling_mask_ids`` int32 / ``..._offsets`` int64 (only when every sample has a mask:
  a batch that mixes raises ``MaskCheckError`` naming the first sample without one). An element
  that is not a ``Sample`` raises ``ContractError`` naming its position and type before any other
  check. Identity fields that are None become -1 (``sample_indices``, ``group_indices``,
  ``rollout_ids``, ``adapter_slots``); ``rollout_ids`` is the rollout_id, else the sample index.
* Rewards: ``raw_reward`` is each sample's reward (a dict reward selects ``reward_key``) when it
  counts under ``sample.reward_number`` (the metrics' rule too: bools as 0/1, ints, finite
  floats), else NaN (NaN, infinities, None, strings, a missing key). ``rewards`` is normalised
  per prompt group ``(adapter, group_index)`` over rollouts, not rows: the siblings of one
  rollout (same adapter, group and rollout key, the key being rollout_id, else index, else batch
  position) must share one reward. ``"none"`` keeps it, ``"grpo"`` subtracts the group mean,
  ``"grpo_std"`` also divides by ``std + 1e-6`` when the group has more than one numeric rollout
  and ``std > 0``. The std is the sample (Bessel-corrected) one, as ``torch.std`` computes it in
  miles. A reward that does not count gives 0 and is left out of its group's statistics. Samples
  with ``group_index=None`` form one group per adapter.
* ``split_train_data_by_dp(data, dp_size)`` gives one dict per rank: the per-sample keys restricted
  to that rank, ``partition`` (its batch positions, ascending), other keys copied whole. Ranks get
  ``n // dp`` or ``n // dp + 1`` samples and are balanced by ``len(tokens)``: a deterministic
  longest-first greedy, then swaps between the heaviest and lightest rank while they help.
* Shard files (``write_batch_shards``, ``load_shard``, ``read_manifest``, ``verify_batch``) are
  ``rollout_bus.model.shards``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout_bus.errors import ConfigError, ContractError, MaskCheckError, must_be
from rollout_bus.model.sample import Sample, Status, get_rollout_key, reward_number

__all__ = [
    "NON_METRIC_KEYS",
    "NORMALIZATIONS",
    "PER_SAMPLE_KEYS",
    "convert_samples_to_train_data",
    "split_train_data_by_dp",
]

NORMALIZATIONS = ("none", "grpo", "grpo_std")
_STD_EPS = 1e-6

# Keys holding one entry per sample; the DP split restricts these and copies every other key.
PER_SAMPLE_KEYS = (
    "tokens",
    "response_lengths",
    "rewards",
    "raw_reward",
    "truncated",
    "sample_indices",
    "rollout_ids",
    "group_indices",
    "adapter_slots",
    "loss_masks",
    "rollout_log_probs",
    "rollout_token_versions",
    "rollout_sampling_mask_ids",
    "rollout_sampling_mask_offsets",
    "partition",
)

# Keys a logger must never average: miles' skip list in log_rollout_data, plus this project's
# flat-shard offsets, CSR mask arrays, group ids and the DP partition. rollout_log_probs stays
# out, as in miles: it is a meaningful (loss-mask weighted) mean.
NON_METRIC_KEYS = frozenset(
    {
        "tokens",
        "tokens_offsets",
        "multimodal_train_inputs",
        "loss_masks",
        "sample_indices",
        "rollout_ids",
        "rollout_mask_sums",
        "rollout_routed_experts",
        "rollout_indexer_topk",
        "max_seq_lens",
        "dynamic_global_batch_size",
        "witness_ids",
        "weight_versions",
        "rollout_token_versions",
        "metadata",
        "num_microbatches",
        "micro_batch_indices",
        "num_rollouts",
        "n_adapters",
        "adapter_slots",
        "step_slots",
        "step_adapter_names",
        "step_adapter_batch_sizes",
        "prompt_group_sizes",
        "rollout_sampling_mask_ids",
        "rollout_sampling_mask_offsets",
        "group_indices",
        "partition",
    }
)


def _id_or_minus_one(value: int | None) -> int:
    return -1 if value is None else int(value)


def _numeric_array(value: Any, dtype: np.dtype, name: str, position: int) -> np.ndarray:
    """A 1-D numpy copy of a token-aligned field in its train-data dtype."""
    arr = np.asarray(value)
    if arr.size == 0:
        return np.zeros(0, dtype)
    where = f"batch position={position}"
    if arr.ndim != 1:
        raise ContractError(must_be(name, "one-dimensional", f"shape {arr.shape}", where=where))
    if np.dtype(dtype).kind in "iu":
        if arr.dtype.kind not in "iub":
            raise ContractError(must_be(name, "integers", f"dtype {arr.dtype}", where=where))
        info = np.iinfo(dtype)
        low, high = int(arr.min()), int(arr.max())
        if low < info.min or high > info.max:
            raise ContractError(must_be(name, f"values that fit {np.dtype(dtype)}", (low, high), where=where))
    elif arr.dtype.kind not in "iuf":
        raise ContractError(must_be(name, "real numbers", f"dtype {arr.dtype}", where=where))
    return np.array(arr, dtype=dtype, copy=True)


def _check_masks_everywhere(samples: Sequence[Sample]) -> bool:
    """Whole-batch mask check: all or none. Returns whether the batch carries masks."""
    missing = [p for p, s in enumerate(samples) if s.rollout_sampling_mask is None]
    if not missing or len(missing) == len(samples):
        return bool(samples) and not missing
    position = missing[0]
    sample = samples[position]
    status = sample.status.value if isinstance(sample.status, Status) else sample.status
    raise MaskCheckError(
        "sampling-mask data must be present for every training sample; "
        f"missing at position={position}, sample_index={sample.index}, status={status}"
    )


def _check_log_probs_everywhere(samples: Sequence[Sample]) -> bool:
    """rollout_log_probs are all-or-none too: a trainer cannot correct half a batch."""
    missing = [p for p, s in enumerate(samples) if s.rollout_log_probs is None]
    if not missing or len(missing) == len(samples):
        return bool(samples) and not missing
    position = missing[0]
    raise ContractError(
        must_be("rollout_log_probs", "present on every sample once one has them", None,
                where=f"batch position={position}, sample_index={samples[position].index}")
    )


def _check_all_samples(samples: Sequence[Any]) -> None:
    """Refuse anything that is not a Sample, by position, before any check reads a Sample field."""
    for position, sample in enumerate(samples):
        if not isinstance(sample, Sample):
            raise ContractError(
                must_be("sample", "a Sample", type(sample).__name__, where=f"batch position={position}")
            )


def _validate_samples(samples: Sequence[Sample]) -> None:
    for position, sample in enumerate(samples):
        try:
            sample.validate()
        except ValueError as exc:
            raise ContractError(f"{exc} (batch position={position})") from exc


def _loss_mask(sample: Sample, position: int) -> np.ndarray:
    length = int(sample.response_length)
    if sample.remove_sample:
        return np.zeros(length, np.uint8)
    if sample.loss_mask is None:
        return np.ones(length, np.uint8)
    mask = _numeric_array(sample.loss_mask, np.uint8, "loss_mask", position)
    if mask.size and int(mask.max()) > 1:
        raise ContractError(must_be("loss_mask", "0 or 1", int(mask.max()), where=f"batch position={position}"))
    return mask


def convert_samples_to_train_data(
    samples: Sequence[Sample], *, reward_key: str | None = None, normalization: str = "grpo"
) -> dict[str, Any]:
    """Turn a batch of samples into per-sample training lists; see the module docstring."""
    if normalization not in NORMALIZATIONS:
        raise ConfigError(must_be("normalization", f"one of {', '.join(NORMALIZATIONS)}", normalization))
    samples = list(samples)
    _check_all_samples(samples)
    has_masks = _check_masks_everywhere(samples)
    _validate_samples(samples)
    has_log_probs = _check_log_probs_everywhere(samples)
    has_versions = bool(samples) and all(s.rollout_token_versions is not None for s in samples)
    raw = [_reward_value(s.reward, reward_key) for s in samples]
    data: dict[str, Any] = {
        "tokens": [_numeric_array(s.tokens, np.int32, "tokens", p) for p, s in enumerate(samples)],
        "response_lengths": [int(s.response_length) for s in samples],
        "rewards": _normalize_rewards(samples, raw, normalization),
        "raw_reward": raw,
        "truncated": [1 if s.status == Status.TRUNCATED else 0 for s in samples],
        "sample_indices": [_id_or_minus_one(s.index) for s in samples],
        "rollout_ids": [_id_or_minus_one(s.rollout_id if s.rollout_id is not None else s.index) for s in samples],
        "group_indices": [_id_or_minus_one(s.group_index) for s in samples],
        "adapter_slots": [-1 if s.adapter is None else int(s.adapter.slot) for s in samples],
        "loss_masks": [_loss_mask(s, p) for p, s in enumerate(samples)],
    }
    if has_log_probs:
        data["rollout_log_probs"] = [
            _numeric_array(s.rollout_log_probs, np.float32, "rollout_log_probs", p) for p, s in enumerate(samples)
        ]
    if has_versions:  # only when every sample has them (a batch mixing engines without them has none)
        data["rollout_token_versions"] = [
            _numeric_array(s.rollout_token_versions, np.int64, "rollout_token_versions", p) for p, s in enumerate(samples)
        ]
    if has_masks:
        arrays = [s.rollout_sampling_mask.as_arrays() for s in samples]
        data["rollout_sampling_mask_ids"] = [ids for ids, _ in arrays]
        data["rollout_sampling_mask_offsets"] = [offsets for _, offsets in arrays]
    return data


# ---------------------------------------------------------------------------- rewards


def _reward_value(reward: Any, reward_key: str | None) -> float:
    """The scalar reward of one sample; NaN when it does not count (``sample.reward_number``)."""
    if isinstance(reward, dict):
        reward = reward.get(reward_key) if reward_key is not None else None
    number = reward_number(reward)
    return math.nan if number is None else float(number)


def _same_reward(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _normalize_group(values: np.ndarray, normalization: str) -> np.ndarray:
    """One normalised reward per rollout; non-finite rewards become 0 and stay out of the stats."""
    finite = np.isfinite(values)
    out = np.zeros(values.shape, np.float64)
    kept = values[finite]
    if normalization != "none" and kept.size:
        kept = kept - kept.mean()
        if normalization == "grpo_std" and kept.size > 1:
            std = float(values[finite].std(ddof=1))
            if std > 0:
                kept = kept / (std + _STD_EPS)
    out[finite] = kept
    return out


def _normalize_rewards(samples: Sequence[Sample], raw: list[float], normalization: str) -> list[float]:
    """Group rows into prompt groups and rollouts, normalise per group, broadcast to siblings."""
    groups: dict[tuple[Any, Any], dict[tuple[Any, ...], list[int]]] = {}
    for position, sample in enumerate(samples):
        group = groups.setdefault((sample.adapter, sample.group_index), {})
        group.setdefault(get_rollout_key(sample, position), []).append(position)
    rewards = [0.0] * len(samples)
    for rollouts in groups.values():
        shared = []
        for key, rows in rollouts.items():
            values = [raw[p] for p in rows]
            if not all(_same_reward(values[0], v) for v in values[1:]):
                raise ContractError(
                    must_be("reward", f"shared by every sibling of rollout {key}", values, where=f"rows {rows}")
                )
            shared.append(values[0])
        normalized = _normalize_group(np.asarray(shared, np.float64), normalization)
        for rows, value in zip(rollouts.values(), normalized.tolist(), strict=True):
            for position in rows:
                rewards[position] = value
    return rewards


# ---------------------------------------------------------------------------- DP split


def _greedy_partitions(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Longest first, onto the lightest rank that still has room (ties: fewer samples, then the
    lower rank). Room: ``n // dp`` each plus one extra for ``n % dp`` ranks, so counts differ by
    at most one."""
    base, extra = divmod(len(lengths), dp_size)
    loads, counts = [0] * dp_size, [0] * dp_size
    partitions: list[list[int]] = [[] for _ in range(dp_size)]
    extras_used = 0
    for position in sorted(range(len(lengths)), key=lambda p: (-lengths[p], p)):
        open_ranks = [r for r in range(dp_size) if counts[r] < base or (counts[r] == base and extras_used < extra)]
        rank = min(open_ranks, key=lambda r: (loads[r], counts[r], r))
        extras_used += counts[rank] == base
        counts[rank] += 1
        loads[rank] += lengths[position]
        partitions[rank].append(position)
    return partitions


def _best_exchange(heavy: list[int], light: list[int], lengths: Sequence[int], gap: int) -> tuple[Any, Any] | None:
    """The swap (or, when ``heavy`` holds more samples, the single move) between the heaviest and
    lightest rank that shrinks their gap the most; None when nothing shrinks it. A swap of a for b
    leaves a gap of ``|gap - 2 (len a - len b)|``, so only the light samples nearest to
    ``len a - gap / 2`` are worth trying (found by bisection)."""
    light_sorted = sorted((lengths[b], b) for b in light)
    light_lengths = [length for length, _ in light_sorted]
    best, best_key = None, (gap, -1, -1)
    for a in heavy:
        i = bisect.bisect_left(light_lengths, lengths[a] - gap / 2)
        near = [i] if i < len(light_sorted) else []
        if i > 0:
            near.append(bisect.bisect_left(light_lengths, light_lengths[i - 1]))
        options = [light_sorted[j][1] for j in near] + ([None] if len(heavy) > len(light) else [])
        for b in options:
            delta = lengths[a] - (0 if b is None else lengths[b])
            key = (abs(gap - 2 * delta), a, -1 if b is None else b)
            if 0 < delta < gap and key < best_key:
                best, best_key = (a, b), key
    return best


def _balanced_partitions(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Greedy, then exchanges between the heaviest and lightest rank while they shrink its gap.
    Every exchange keeps the multiset of counts and strictly lowers the sum of squared loads."""
    partitions = _greedy_partitions(lengths, dp_size)
    for _ in range(4 * len(lengths)):
        loads = [sum(lengths[p] for p in part) for part in partitions]
        heavy = max(range(dp_size), key=lambda r: (loads[r], -r))
        light = min(range(dp_size), key=lambda r: (loads[r], r))
        exchange = _best_exchange(partitions[heavy], partitions[light], lengths, loads[heavy] - loads[light])
        if exchange is None:
            break
        a, b = exchange
        partitions[heavy].remove(a)
        partitions[light].append(a)
        if b is not None:
            partitions[light].remove(b)
            partitions[heavy].append(b)
    return [sorted(p) for p in partitions]


def _restrict(value: Any, positions: list[int]) -> Any:
    if isinstance(value, np.ndarray):
        return value[np.asarray(positions, dtype=np.int64)]
    return [value[p] for p in positions]


def split_train_data_by_dp(data: dict[str, Any], dp_size: int) -> list[dict[str, Any]]:
    """Split converted train data across ``dp_size`` data-parallel ranks, balanced by tokens.

    The output is a pure function of the input: the same data always gives the same split.
    ``partition`` holds batch positions; splitting already-split data composes them.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, (int, np.integer)) or dp_size < 1:
        raise ConfigError(must_be("dp_size", "an integer >= 1", dp_size))
    if "tokens" not in data:
        raise ContractError(must_be("data", "train data with a 'tokens' key", sorted(data)))
    n = len(data["tokens"])
    for key in PER_SAMPLE_KEYS:
        if key in data and len(data[key]) != n:
            raise ContractError(must_be(f"len(data[{key!r}])", f"len(tokens)={n}", len(data[key])))
    lengths = [len(t) for t in data["tokens"]]
    origin = list(data["partition"]) if "partition" in data else list(range(n))
    ranks = []
    for positions in _balanced_partitions(lengths, int(dp_size)):
        rank_data = {k: (_restrict(v, positions) if k in PER_SAMPLE_KEYS else v) for k, v in data.items()}
        rank_data["partition"] = [int(origin[p]) for p in positions]
        ranks.append(rank_data)
    return ranks
