"""Batch shards on disk: one safetensors file per DP rank plus a manifest (docs/data-model.md section 5).

Contract:

* ``write_batch_shards(out_dir, seq, rank_datas, *, metrics, sources, extra=None)`` writes
  ``out_dir/batch-{seq:08d}/dp-{rank:03d}.safetensors`` for every rank dict (as produced by
  ``split_train_data_by_dp``), then ``manifest.json``, and returns the manifest dict. Every file
  goes to a temporary name in the same directory, is fsync'd and ``os.replace``'d, so no reader
  sees a partial file; the manifest is written last (and removed first on a rewrite), so a
  manifest on disk means the batch is complete. Leftover temporary files are removed.
* A shard stores ragged fields flat, with zero padding (``SHARD_FIELDS``): ``tokens`` int32 +
  ``tokens_offsets`` int64 [S+1]; ``loss_masks`` uint8, ``rollout_log_probs`` float32 and
  ``rollout_token_versions`` int64 (the weight version of each token, -1 where not generated) over all
  response tokens in sample order; the sampling masks as one CSR over the shard's response tokens
  (``rollout_sampling_mask_ids`` int32, ``rollout_sampling_mask_offsets`` int64 [R+1]); per-sample
  scalars [S]. The safetensors metadata is one key, ``rollout_bus``, so headers are deterministic.
* Output is a pure function of the input: writing the same batch twice gives byte-identical
  files. The manifest (JSON, sorted keys, no timestamps) lists each shard's path (relative to the
  batch directory), sha256, byte size and sample / token / response-token counts, the batch
  ``seq``, the ``sources`` offset ranges and the ``metrics`` as given (numpy scalars become plain
  numbers, tuples lists, non-finite floats null). ``extra`` is stored under ``extra`` when given.
* ``read_manifest(batch_dir)`` returns the manifest or None; ``verify_batch(batch_dir)`` also
  checks every shard's size and sha256. ``load_shard(path)`` checks a shard's internal
  consistency and returns a ``ShardView``. Every defect raises ``ContractError`` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError, safe_open

from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.files import TMP_SUFFIX, fsync_dir, write_atomic
from rollout_bus.model.sampling_mask import RolloutSamplingMask

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_META_KEY = "rollout_bus"

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
_MASK_IDS, _MASK_OFFSETS = "rollout_sampling_mask_ids", "rollout_sampling_mask_offsets"
_TOKENS_OFFSETS = "tokens_offsets"


def batch_path(out_dir: str | os.PathLike[str], seq: int) -> Path:
    """The directory of batch ``seq`` under ``out_dir``."""
    if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or seq < 0:
        raise ContractError(must_be("seq", "an integer >= 0", seq))
    return Path(out_dir) / f"batch-{int(seq):08d}"


def _shard_name(rank: int) -> str:
    return f"dp-{rank:03d}.safetensors"


# ---------------------------------------------------------------------------- writing


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
    ids_list, offsets_list = rank_data[_MASK_IDS], rank_data[_MASK_OFFSETS]
    parts, base = [np.zeros(1, np.int64)], 0
    for i, (ids, offsets) in enumerate(zip(ids_list, offsets_list, strict=True)):
        offsets = _cast(offsets, "int64", _MASK_OFFSETS, where)
        if offsets.size != lengths[i] + 1 or offsets[0] != 0 or offsets[-1] != len(ids):
            raise ContractError(
                must_be(f"{_MASK_OFFSETS}[{i}]", f"a CSR of {lengths[i]} rows over {len(ids)} ids",
                        f"{offsets.size} offsets ending at {int(offsets[-1]) if offsets.size else None}", where=where)
            )
        parts.append(offsets[1:] + base)
        base += len(ids)
    return {_MASK_IDS: _joined(ids_list, "int32", _MASK_IDS, where), _MASK_OFFSETS: np.concatenate(parts)}


def _check_rank_data(rank_data: Mapping[str, Any], where: str) -> list[int]:
    """Required keys present, per-sample keys of one length, token-aligned fields sized right."""
    present = [f[0] for f in SHARD_FIELDS if f[0] in rank_data]
    missing = [f[0] for f in SHARD_FIELDS if f[4] and f[0] not in rank_data]
    if missing:
        raise ContractError(must_be("rank data", f"a dict with keys {missing}", sorted(rank_data), where=where))
    if (_MASK_IDS in rank_data) != (_MASK_OFFSETS in rank_data):
        raise ContractError(must_be("rank data", f"both or neither of {_MASK_IDS}, {_MASK_OFFSETS}",
                                    sorted(rank_data), where=where))
    n = len(rank_data["tokens"])
    for key in present + [k for k in (_MASK_IDS, _MASK_OFFSETS) if k in rank_data]:
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
            tensors[_TOKENS_OFFSETS] = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
    if _MASK_IDS in rank_data:
        tensors.update(_mask_csr(rank_data, lengths, where))
    return tensors


def _remove_temporaries(directory: Path) -> None:
    """Temporary files of an interrupted writer are never valid data; drop them."""
    for path in directory.iterdir():
        if path.name.startswith(".") and path.name.endswith(TMP_SUFFIX):
            path.unlink(missing_ok=True)
            logger.info("removed leftover temporary file path=%s", path)


def _jsonable(value: Any, where: str) -> Any:
    """Plain JSON data with a deterministic rendering; non-finite floats become null."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise ContractError(must_be(f"{where} key", "a string", key))
        return {k: _jsonable(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ContractError(must_be(where, "JSON data (dict, list, str, number, bool, None)", type(value).__name__))


def _dumps(document: Any) -> bytes:
    return (json.dumps(document, sort_keys=True, indent=2, allow_nan=False) + "\n").encode()


def _shard_entry(rank: int, data: bytes, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    return {
        "rank": rank,
        "path": _shard_name(rank),
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "num_samples": int(tensors["response_lengths"].size),
        "num_tokens": int(tensors["tokens"].size),
        "num_response_tokens": int(tensors["loss_masks"].size),
    }


def write_batch_shards(
    out_dir: str | os.PathLike[str],
    seq: int,
    rank_datas: Sequence[Mapping[str, Any]],
    *,
    metrics: Mapping[str, Any],
    sources: Any,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write one batch's shards and manifest atomically; return the manifest.

    Args:
        out_dir: root directory; the batch goes to ``batch-{seq:08d}/`` under it.
        seq: batch sequence number (>= 0).
        rank_datas: one train-data dict per DP rank (``split_train_data_by_dp``), rank order.
        metrics: the batch metrics, stored in the manifest as given.
        sources: the source topic-partition offset ranges (JSON data, e.g. a list of
            ``{"topic", "partition", "first_offset", "last_offset"}`` dicts).
        extra: optional JSON data stored under ``extra``.
    """
    if not rank_datas:
        raise ContractError(must_be("rank_datas", "at least one rank", list(rank_datas)))
    head = {"metrics": _jsonable(dict(metrics), "metrics"), "sources": _jsonable(sources, "sources")}
    if extra is not None:
        head["extra"] = _jsonable(dict(extra), "extra")
    directory = batch_path(out_dir, seq)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_temporaries(directory)
    (directory / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete until the new manifest lands
    entries = []
    for rank, rank_data in enumerate(rank_datas):
        where = f"batch={int(seq)} rank={rank}"
        tensors = shard_tensors(rank_data, where)
        meta = json.dumps({"format_version": FORMAT_VERSION, "seq": int(seq), "rank": rank}, sort_keys=True)
        data = safetensors.numpy.save(tensors, metadata={_META_KEY: meta})
        write_atomic(directory / _shard_name(rank), data, sync_dir=False)
        entries.append(_shard_entry(rank, data, tensors))
    names = {e["path"] for e in entries}
    for stale in directory.glob("dp-*.safetensors"):
        if stale.name not in names:
            stale.unlink()
    fsync_dir(directory)  # every shard's name is durable before the manifest that lists it
    manifest = {
        "format_version": FORMAT_VERSION,
        "seq": int(seq),
        "batch": directory.name,
        "dp_size": len(entries),
        "has_rollout_log_probs": all("rollout_log_probs" in r for r in rank_datas),
        "has_rollout_token_versions": all("rollout_token_versions" in r for r in rank_datas),
        "has_sampling_masks": all(_MASK_IDS in r for r in rank_datas),
        "num_samples": sum(e["num_samples"] for e in entries),
        "num_tokens": sum(e["num_tokens"] for e in entries),
        "num_response_tokens": sum(e["num_response_tokens"] for e in entries),
        "shards": entries,
        **head,
    }
    write_atomic(directory / MANIFEST_NAME, _dumps(manifest))
    logger.info("wrote batch=%d dir=%s shards=%d samples=%d", int(seq), directory, len(entries),
                manifest["num_samples"])
    return manifest


# ---------------------------------------------------------------------------- reading


def read_manifest(batch_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The batch's manifest, or None when there is none yet (the batch is incomplete)."""
    path = Path(batch_dir) / MANIFEST_NAME
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ContractError(must_be("manifest", "valid JSON", str(exc), where=str(path))) from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list) or "seq" not in manifest:
        raise ContractError(must_be("manifest", "a JSON object with 'seq' and a 'shards' list", type(manifest).__name__,
                                    where=str(path)))
    return manifest


def verify_batch(batch_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest when the batch is complete and every shard matches its size and sha256;
    None when there is no manifest; ContractError naming the file when a shard is wrong."""
    manifest = read_manifest(batch_dir)
    if manifest is None:
        return None
    for entry in manifest["shards"]:
        path = Path(batch_dir) / str(entry.get("path"))
        verify_shard(path, entry, str(path))
    return manifest


def verify_shard(path: Path, entry: Mapping[str, Any], where: str) -> bytes:
    """The shard's bytes, once their size and sha256 match its manifest ``entry``; ContractError
    naming ``where`` when the shard is missing or differs."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ContractError(f"shard missing: {where}: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != entry.get("bytes") or digest != entry.get("sha256"):
        raise ContractError(f"shard does not match its manifest: {where}: {len(data)} bytes, sha256 {digest}; "
                            f"the manifest says {entry.get('bytes')} bytes, sha256 {entry.get('sha256')}")
    return data


@dataclass(frozen=True, slots=True)
class ShardSample:
    """One sample read back from a shard; tensors are views into the shard's tensors."""

    position: int  # batch position (the partition entry)
    tokens: Any
    response_length: int
    loss_mask: Any
    rollout_log_probs: Any | None
    reward: float
    raw_reward: float
    truncated: bool
    rollout_id: int
    sample_index: int
    group_index: int
    adapter_slot: int
    rollout_sampling_mask: RolloutSamplingMask | None
    rollout_token_versions: Any | None = None  # per response token, -1 where not generated


def _shard_problem(path: Path, name: str, expected: str, got: Any) -> ContractError:
    return ContractError(must_be(name, expected, got, where=f"shard {path}"))


def _check_offsets(path: Path, name: str, offsets: np.ndarray, rows: int, end: int, strict: bool) -> None:
    steps = np.diff(offsets)
    if offsets.size != rows + 1 or offsets[0] != 0 or offsets[-1] != end:
        raise _shard_problem(path, name, f"{rows + 1} offsets from 0 to {end}",
                             f"{offsets.size} offsets {offsets[:1].tolist()}..{offsets[-1:].tolist()}")
    if steps.size and int(steps.min()) < (1 if strict else 0):
        raise _shard_problem(path, name, "strictly increasing" if strict else "non-decreasing", int(steps.min()))


def _check_shard(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Every tensor known, 1-D, of its dtype, and every offsets array consistent with its data."""
    expected = {name: (dtype, required) for _, name, dtype, _, required in SHARD_FIELDS}
    expected[_TOKENS_OFFSETS] = ("int64", True)
    expected[_MASK_IDS], expected[_MASK_OFFSETS] = ("int32", False), ("int64", False)
    for name, arr in arrays.items():
        if name not in expected:
            raise _shard_problem(path, "tensor name", f"one of {sorted(expected)}", name)
        if arr.ndim != 1 or arr.dtype != np.dtype(expected[name][0]):
            raise _shard_problem(path, name, f"1-D {expected[name][0]}", f"{arr.dtype} {list(arr.shape)}")
    missing = sorted(n for n, (_, req) in expected.items() if req and n not in arrays)
    if missing or ((_MASK_IDS in arrays) != (_MASK_OFFSETS in arrays)):
        raise _shard_problem(path, "tensors", "complete (mask ids and offsets together)", missing or sorted(arrays))
    lengths = arrays["response_lengths"]
    samples = lengths.size
    for _, name, _, kind, _ in SHARD_FIELDS:
        if kind == "sample" and arrays[name].size != samples:
            raise _shard_problem(path, f"len({name})", f"num samples={samples}", arrays[name].size)
    _check_offsets(path, _TOKENS_OFFSETS, arrays[_TOKENS_OFFSETS], samples, arrays["tokens"].size, strict=False)
    if samples and (int(lengths.min()) < 0 or np.any(lengths > np.diff(arrays[_TOKENS_OFFSETS]))):
        raise _shard_problem(path, "response_lengths", "in [0, sample token count]", lengths.tolist())
    total = int(lengths.sum())
    for _, name, _, kind, _ in SHARD_FIELDS:
        if kind == "response" and name in arrays and arrays[name].size != total:
            raise _shard_problem(path, f"len({name})", f"total response tokens={total}", arrays[name].size)
    if _MASK_IDS in arrays:
        ids = arrays[_MASK_IDS]
        _check_offsets(path, _MASK_OFFSETS, arrays[_MASK_OFFSETS], total, ids.size, strict=True)
        if ids.size and int(ids.min()) < 0:
            raise _shard_problem(path, _MASK_IDS, "non-negative", int(ids.min()))


class ShardView:
    """One loaded shard: ``tensors`` (torch, as ``safetensors.torch.load_file`` gives them),
    ``metadata`` (seq, rank, format_version) and per-sample records via ``samples()``."""

    def __init__(self, path: Path, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.path = path
        self.tensors = tensors
        self.metadata = metadata
        self._arrays = {name: t.numpy() for name, t in tensors.items()}
        _check_shard(path, self._arrays)

    def __len__(self) -> int:
        return int(self._arrays["response_lengths"].size)

    def __iter__(self) -> Iterator[ShardSample]:
        return self.samples()

    @property
    def has_sampling_masks(self) -> bool:
        return _MASK_IDS in self._arrays

    def samples(self) -> Iterator[ShardSample]:
        """Yield every sample in shard order; masks are rebased copies (a mask owns its storage)."""
        t, a = self.tensors, self._arrays
        token_offsets = a[_TOKENS_OFFSETS].tolist()
        lengths = a["response_lengths"].tolist()
        scalars = {name: a[name].tolist() for name in ("rewards", "raw_rewards", "truncated", "rollout_ids",
                                                         "sample_indices", "group_indices", "adapter_slots",
                                                         "partition")}
        log_probs = t.get("rollout_log_probs")
        versions = t.get("rollout_token_versions")
        response_start = 0
        for i, length in enumerate(lengths):
            response_end = response_start + length
            yield ShardSample(
                position=scalars["partition"][i],
                tokens=t["tokens"][token_offsets[i]:token_offsets[i + 1]],
                response_length=length,
                loss_mask=t["loss_masks"][response_start:response_end],
                rollout_log_probs=None if log_probs is None else log_probs[response_start:response_end],
                reward=scalars["rewards"][i],
                raw_reward=scalars["raw_rewards"][i],
                truncated=bool(scalars["truncated"][i]),
                rollout_id=scalars["rollout_ids"][i],
                sample_index=scalars["sample_indices"][i],
                group_index=scalars["group_indices"][i],
                adapter_slot=scalars["adapter_slots"][i],
                rollout_sampling_mask=self._mask(response_start, response_end),
                rollout_token_versions=None if versions is None else versions[response_start:response_end],
            )
            response_start = response_end

    def _mask(self, start: int, end: int) -> RolloutSamplingMask | None:
        if _MASK_IDS not in self._arrays:
            return None
        offsets = self._arrays[_MASK_OFFSETS][start:end + 1]
        first, last = int(offsets[0]), int(offsets[-1])
        ids = np.array(self._arrays[_MASK_IDS][first:last], dtype=np.int32, copy=True)
        return RolloutSamplingMask._from_trusted(ids, offsets - first)


def load_shard(path: str | os.PathLike[str]) -> ShardView:
    """Load one shard file with safetensors and check its internal consistency."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata_raw = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError) as exc:
        raise ContractError(must_be("shard", "a readable safetensors file", str(exc), where=str(path))) from exc
    try:
        metadata = json.loads(metadata_raw.get(_META_KEY, "{}"))
    except json.JSONDecodeError as exc:
        raise ContractError(must_be(f"metadata {_META_KEY}", "JSON", metadata_raw, where=str(path))) from exc
    return ShardView(path, tensors, metadata)
