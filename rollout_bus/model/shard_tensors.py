"""The tensors of one shard: their table, built from a rank's train data, checked once loaded.

Why a module of its own: the layout of a shard's tensors is one table (``SHARD_FIELDS``) that both
directions follow, writing (``shard_tensors``, used by ``rollout_bus.model.shards.write_batch_shards``)
and loading (``check_shard_tensors``, used by ``ShardView``); the batch directory, its manifest and
the files stay in ``rollout_bus.model.shards`` (docs/data-model.md section 5).

Contract:

* Ragged fields are stored flat, with zero padding: ``tokens`` int32 + ``tokens_offsets`` int64
  [S+1]; ``loss_masks``, ``rollout_log_probs`` and ``rollout_token_versions`` over all response
  tokens in sample order; the sampling masks as one CSR over the shard's response tokens
  (``rollout_sampling_mask_ids`` int32, ``rollout_sampling_mask_offsets`` int64 [R+1]); per-sample
  scalars [S].
* ``shard_tensors(rank_data, where)`` returns those tensors in the table's dtypes; integers must fit
  exactly. ``check_shard_tensors(path, arrays)`` checks a loaded shard's arrays (every name known,
  1-D, of its dtype; every offsets array consistent with its data). Every defect raises
  ``ContractError`` naming ``where`` or the file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rollout_bus.errors import ContractError, must_be

# (train-data key, shard tensor, dtype, kind, required); kind: "sample" = one value per sample,
# "response" = flat over response tokens, "tokens" = flat over all tokens with tokens_offsets.
# Write and load are both driven by this table; the mask CSR pair is handled beside it.
SHARD_FIELDS: tuple[tuple[str, str, str, str, bool], ...] = (
    ("tokens", "tokens", "int32", "tokens", True),
    ("response_lengths", "response_lengths", "int64", "sample", True),
    ("loss_masks", "loss_masks", "uint8", "response", True),
    ("rollout_log_probs", "rollout_log_probs", "float32", "response", False),
    ("rollout_token_versions", "rollout_token_versions", "int64", "response", False),
    ("rewards", "rewards", "float32", "sample", True),
    ("raw_reward", "raw_rewards", "float32", "sample", True),
    ("truncated", "truncated", "uint8", "sample", True),
    ("rollout_ids", "rollout_ids", "int64", "sample", True),
    ("sample_indices", "sample_indices", "int64", "sample", True),
    ("group_indices", "group_indices", "int64", "sample", True),
    ("adapter_slots", "adapter_slots", "int64", "sample", True),
    ("partition", "partition", "int64", "sample", True),
)
MASK_IDS, MASK_OFFSETS = "rollout_sampling_mask_ids", "rollout_sampling_mask_offsets"
TOKENS_OFFSETS = "tokens_offsets"


# ---------------------------------------------------------------------------- from train data


def _cast(value: Any, dtype: str, name: str, where: str) -> np.ndarray:
    """One contiguous 1-D array of the shard dtype; integers must fit it exactly."""
    arr, target = np.asarray(value), np.dtype(dtype)
    if arr.size == 0:
        return np.zeros(0, target)
    if arr.ndim != 1:
        raise ContractError(must_be(name, "one-dimensional per sample", f"shape {arr.shape}", where=where))
    if target.kind in "iu":
        if arr.dtype.kind not in "iub":
            raise ContractError(must_be(name, "integers", f"dtype {arr.dtype}", where=where))
        info, low, high = np.iinfo(target), int(arr.min()), int(arr.max())
        if low < info.min or high > info.max:
            raise ContractError(must_be(name, f"values that fit {target}", (low, high), where=where))
    elif arr.dtype.kind not in "iubf":
        raise ContractError(must_be(name, "real numbers", f"dtype {arr.dtype}", where=where))
    return np.ascontiguousarray(arr, dtype=target)


def _joined(values: Sequence[Any], dtype: str, name: str, where: str) -> np.ndarray:
    """Concatenate per-sample arrays in sample order (empty ones are skipped: ``[]`` is float)."""
    parts = [_cast(v, dtype, name, where) for v in values]
    parts = [p for p in parts if p.size]
    return np.concatenate(parts) if parts else np.zeros(0, np.dtype(dtype))


def _mask_csr(rank_data: Mapping[str, Any], lengths: list[int], where: str) -> dict[str, np.ndarray]:
    """Join the per-sample CSR masks into one CSR over the shard's response tokens."""
    ids_list, offsets_list = rank_data[MASK_IDS], rank_data[MASK_OFFSETS]
    parts, base = [np.zeros(1, np.int64)], 0
    for i, (ids, offsets) in enumerate(zip(ids_list, offsets_list, strict=True)):
        offsets = _cast(offsets, "int64", MASK_OFFSETS, where)
        if offsets.size != lengths[i] + 1 or offsets[0] != 0 or offsets[-1] != len(ids):
            raise ContractError(
                must_be(f"{MASK_OFFSETS}[{i}]", f"a CSR of {lengths[i]} rows over {len(ids)} ids",
                        f"{offsets.size} offsets ending at {int(offsets[-1]) if offsets.size else None}", where=where)
            )
        parts.append(offsets[1:] + base)
        base += len(ids)
    return {MASK_IDS: _joined(ids_list, "int32", MASK_IDS, where), MASK_OFFSETS: np.concatenate(parts)}


def _check_rank_data(rank_data: Mapping[str, Any], where: str) -> list[int]:
    """Required keys present, per-sample keys of one length, token-aligned fields sized right."""
    present = [f[0] for f in SHARD_FIELDS if f[0] in rank_data]
    missing = [f[0] for f in SHARD_FIELDS if f[4] and f[0] not in rank_data]
    if missing:
        raise ContractError(must_be("rank data", f"a dict with keys {missing}", sorted(rank_data), where=where))
    if (MASK_IDS in rank_data) != (MASK_OFFSETS in rank_data):
        raise ContractError(must_be("rank data", f"both or neither of {MASK_IDS}, {MASK_OFFSETS}",
                                    sorted(rank_data), where=where))
    n = len(rank_data["tokens"])
    for key in present + [k for k in (MASK_IDS, MASK_OFFSETS) if k in rank_data]:
        if len(rank_data[key]) != n:
            raise ContractError(must_be(f"len({key})", f"len(tokens)={n}", len(rank_data[key]), where=where))
    lengths = [int(x) for x in rank_data["response_lengths"]]
    for i, rl in enumerate(lengths):
        if rl < 0 or len(rank_data["tokens"][i]) < rl:
            raise ContractError(must_be(f"response_lengths[{i}]", f"in [0, len(tokens[{i}])]", rl, where=where))
        for key in ("loss_masks", "rollout_log_probs", "rollout_token_versions"):
            if key in rank_data and len(rank_data[key][i]) != rl:
                raise ContractError(must_be(f"len({key}[{i}])", f"response_length={rl}", len(rank_data[key][i]),
                                            where=where))
    return lengths


def shard_tensors(rank_data: Mapping[str, Any], where: str = "shard") -> dict[str, np.ndarray]:
    """The flat, unpadded tensors of one rank's shard, in the dtypes of ``SHARD_FIELDS``."""
    lengths = _check_rank_data(rank_data, where)
    tensors: dict[str, np.ndarray] = {}
    for key, name, dtype, kind, _ in SHARD_FIELDS:
        if key not in rank_data:
            continue
        values = rank_data[key]
        if kind == "sample":
            tensors[name] = _cast(list(values), dtype, name, where)
        else:
            tensors[name] = _joined(values, dtype, name, where)
        if kind == "tokens":
            counts = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
            tensors[TOKENS_OFFSETS] = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
    if MASK_IDS in rank_data:
        tensors.update(_mask_csr(rank_data, lengths, where))
    return tensors


# ---------------------------------------------------------------------------- checking a loaded shard


def _shard_problem(path: Path, name: str, expected: str, got: Any) -> ContractError:
    return ContractError(must_be(name, expected, got, where=f"shard {path}"))


def _check_offsets(path: Path, name: str, offsets: np.ndarray, rows: int, end: int, strict: bool) -> None:
    steps = np.diff(offsets)
    if offsets.size != rows + 1 or offsets[0] != 0 or offsets[-1] != end:
        raise _shard_problem(path, name, f"{rows + 1} offsets from 0 to {end}",
                             f"{offsets.size} offsets {offsets[:1].tolist()}..{offsets[-1:].tolist()}")
    if steps.size and int(steps.min()) < (1 if strict else 0):
        raise _shard_problem(path, name, "strictly increasing" if strict else "non-decreasing", int(steps.min()))


def check_shard_tensors(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Every tensor known, 1-D, of its dtype, and every offsets array consistent with its data."""
    expected = {name: (dtype, required) for _, name, dtype, _, required in SHARD_FIELDS}
    expected[TOKENS_OFFSETS] = ("int64", True)
    expected[MASK_IDS], expected[MASK_OFFSETS] = ("int32", False), ("int64", False)
    for name, arr in arrays.items():
        if name not in expected:
            raise _shard_problem(path, "tensor name", f"one of {sorted(expected)}", name)
        if arr.ndim != 1 or arr.dtype != np.dtype(expected[name][0]):
            raise _shard_problem(path, name, f"1-D {expected[name][0]}", f"{arr.dtype} {list(arr.shape)}")
    missing = sorted(n for n, (_, req) in expected.items() if req and n not in arrays)
    if missing or ((MASK_IDS in arrays) != (MASK_OFFSETS in arrays)):
        raise _shard_problem(path, "tensors", "complete (mask ids and offsets together)", missing or sorted(arrays))
    lengths = arrays["response_lengths"]
    samples = lengths.size
    for _, name, _, kind, _ in SHARD_FIELDS:
        if kind == "sample" and arrays[name].size != samples:
            raise _shard_problem(path, f"len({name})", f"num samples={samples}", arrays[name].size)
    _check_offsets(path, TOKENS_OFFSETS, arrays[TOKENS_OFFSETS], samples, arrays["tokens"].size, strict=False)
    if samples and (int(lengths.min()) < 0 or np.any(lengths > np.diff(arrays[TOKENS_OFFSETS]))):
        raise _shard_problem(path, "response_lengths", "in [0, sample token count]", lengths.tolist())
    total = int(lengths.sum())
    for _, name, _, kind, _ in SHARD_FIELDS:
        if kind == "response" and name in arrays and arrays[name].size != total:
            raise _shard_problem(path, f"len({name})", f"total response tokens={total}", arrays[name].size)
    if MASK_IDS in arrays:
        ids = arrays[MASK_IDS]
        _check_offsets(path, MASK_OFFSETS, arrays[MASK_OFFSETS], total, ids.size, strict=True)
        if ids.size and int(ids.min()) < 0:
            raise _shard_problem(path, MASK_IDS, "non-negative", int(ids.min()))
