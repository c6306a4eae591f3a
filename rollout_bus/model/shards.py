"""Batch shards on disk: one safetensors file per DP rank plus a manifest (docs/data-model.md section 5).

Contract:

* ``write_batch_shards(out_dir, seq, rank_datas, *, metrics, sources, extra=None)`` writes
  ``out_dir/batch-{seq:08d}/dp-{rank:03d}.safetensors`` for every rank dict (as produced by
  ``split_train_data_by_dp``), then ``manifest.json``, and returns the manifest dict. Every file
  goes to a temporary name in the same directory, is fsync'd and ``os.replace``'d, so no reader
  sees a partial file; the manifest is written last (and removed first on a rewrite), so a
  manifest on disk means the batch is complete. Leftover temporary files are removed.
* A shard stores ragged fields flat, with zero padding: the tensors of
  ``rollout_bus.model.shard_tensors`` (``SHARD_FIELDS``): ``tokens`` int32 + ``tokens_offsets``
  int64 [S+1]; ``loss_masks`` uint8, ``rollout_log_probs`` float32 and ``rollout_token_versions``
  int64 (the weight version of each token, -1 where not generated) over all response tokens in
  sample order; the sampling masks as one CSR over the shard's response tokens; per-sample
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
from rollout_bus.model.shard_tensors import MASK_IDS, MASK_OFFSETS, TOKENS_OFFSETS, check_shard_tensors, shard_tensors

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_META_KEY = "rollout_bus"


def batch_path(out_dir: str | os.PathLike[str], seq: int) -> Path:
    """The directory of batch ``seq`` under ``out_dir``."""
    if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or seq < 0:
        raise ContractError(must_be("seq", "an integer >= 0", seq))
    return Path(out_dir) / f"batch-{int(seq):08d}"


def _shard_name(rank: int) -> str:
    return f"dp-{rank:03d}.safetensors"


# ---------------------------------------------------------------------------- writing


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
        "has_sampling_masks": all(MASK_IDS in r for r in rank_datas),
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


class ShardView:
    """One loaded shard: ``tensors`` (torch, as ``safetensors.torch.load_file`` gives them),
    ``metadata`` (seq, rank, format_version) and per-sample records via ``samples()``."""

    def __init__(self, path: Path, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.path = path
        self.tensors = tensors
        self.metadata = metadata
        self._arrays = {name: t.numpy() for name, t in tensors.items()}
        check_shard_tensors(path, self._arrays)

    def __len__(self) -> int:
        return int(self._arrays["response_lengths"].size)

    def __iter__(self) -> Iterator[ShardSample]:
        return self.samples()

    @property
    def has_sampling_masks(self) -> bool:
        return MASK_IDS in self._arrays

    def samples(self) -> Iterator[ShardSample]:
        """Yield every sample in shard order; masks are rebased copies (a mask owns its storage)."""
        t, a = self.tensors, self._arrays
        token_offsets = a[TOKENS_OFFSETS].tolist()
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
        if MASK_IDS not in self._arrays:
            return None
        offsets = self._arrays[MASK_OFFSETS][start:end + 1]
        first, last = int(offsets[0]), int(offsets[-1])
        ids = np.array(self._arrays[MASK_IDS][first:last], dtype=np.int32, copy=True)
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
