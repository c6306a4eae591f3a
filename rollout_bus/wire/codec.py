"""Wire codec: samples to one safetensors buffer and back (docs/data-model.md section 4, WIRE.md section 4.3).

Contract:

* ``encode_samples(samples, fields=COMPUTED_FIELDS, metadata=None) -> bytes`` and
  ``decode_samples(payload, fields=COMPUTED_FIELDS) -> (samples, metadata)``; both sides must be
  given the same ``fields`` (their order does not matter): a payload carrying a tensor the decoder
  does not expect, or lacking one it promises, is refused.
* The payload is plain safetensors (8-byte little-endian header length, JSON header, data).
  Per-sample tensors are ``{field}.{i}``; a CSR field travels as ``{field}.ids.{i}`` and
  ``{field}.offsets.{i}``. All the rest (identity, text, status, reward, adapter,
  weight_versions, metadata, and which tensor fields are None) plus the caller's ``metadata``
  is one compact, key-sorted JSON document in the rank-1 uint8 tensor ``_samples_meta``. The same
  samples always give the same bytes. ``rollout_token_versions`` (added after the first writers)
  travels only when set: a sample without it encodes to the bytes it always did, and a payload
  without its tensor decodes to None, so older producers and stored state still decode.
* The tables of ``rollout_bus.wire.sample_fields``, ``TENSOR_FIELDS`` (kind, wire dtype and bounds per
  part, nullable, strict) and ``JSON_FIELDS`` (plain types and converters), drive both directions;
  nothing else does.
* ``COMPUTED_FIELDS`` (sent by default) excludes ``SAMPLING_MASK_FIELDS``: a mask is not looked at
  unless asked for, so the default payload of a sample with a mask is byte-identical to that of
  the same sample without one.
* Decode is strict and total: anything wrong raises ``CodecError`` saying what and where, never
  another exception, never pickle. Sizes are capped (``MAX_PAYLOAD_BYTES``, ``MAX_HEADER_BYTES``,
  or the keyword arguments of ``decode_samples``). Duplicate JSON keys resolve last-wins, as in
  every JSON parser; in the header any data they orphan fails the tiling check.
* The safetensors framing lives in ``rollout_bus.wire.safetensors_frame``, the JSON document (the
  JSON-native check, and the fast writer and reader) in ``rollout_bus.wire.samples_json``, the field
  tables in ``rollout_bus.wire.sample_fields``: this module keeps the rules.
* Decoded tensors are read-only numpy views into the payload, an immutable ``bytes`` (a bytearray
  or memoryview is copied once first), so they never alias a buffer the caller may reuse.
  Metadata, prompts and dict rewards must be JSON-native (dicts with str keys, lists, str, int,
  float, bool, None, nested at most ``MAX_JSON_DEPTH``) so that they round-trip exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout_bus.errors import CodecError, must_be
from rollout_bus.wire.safetensors_frame import clip as _clip, loads as _loads, read_frame, write_frame
from rollout_bus.wire.sample_fields import (JSON_ITEMS, JSON_VALUES, META_PART, META_TENSOR, SAMPLE_KEYS, TENSOR_FIELDS,
                                            Field, Part, metadata_to_json, resolve_fields, typed)
from rollout_bus.wire.samples_json import MAX_JSON_DEPTH, dump_document, load_document
from rollout_bus.model.sample import Sample
from rollout_bus.model.sampling_mask import RolloutSamplingMask

__all__ = ["COMPUTED_FIELDS", "SAMPLING_MASK_FIELDS", "MAX_PAYLOAD_BYTES", "MAX_HEADER_BYTES", "MAX_JSON_DEPTH",
           "CodecError", "encode_samples", "decode_samples"]

MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
MAX_HEADER_BYTES = 16 * 1024 * 1024
INTERNAL_ERROR = "internal decoder error"  # marks the safety net, so fuzz tests can tell it apart
SAMPLING_MASK_FIELDS: tuple[str, ...] = tuple(n for n, f in TENSOR_FIELDS.items() if f.kind == "csr")
COMPUTED_FIELDS: tuple[str, ...] = tuple(n for n in TENSOR_FIELDS if n not in SAMPLING_MASK_FIELDS)


# ---------------------------------------------------------------- tensor kinds

def _to_wire_array(value: Any, part: Part, where: str) -> np.ndarray:
    """The value as a contiguous 1-D array of the wire dtype; refuse conversions that change a value."""
    if type(value) is np.ndarray and value.dtype == part.dtype and value.ndim == 1:
        return np.ascontiguousarray(value)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
        raise CodecError(must_be(part.name, "a 1-D numeric sequence", type(value).__name__, where=where)) from exc
    if arr.ndim != 1:
        raise CodecError(must_be(part.name, "one-dimensional", f"shape {arr.shape}", where=where))
    if arr.dtype != part.dtype:
        if arr.dtype.kind not in "biuf":
            raise CodecError(must_be(part.name, f"numbers that fit {part.dtype}", f"dtype {arr.dtype}",
                                     where=where))
        with np.errstate(all="ignore"):
            converted = arr.astype(part.dtype)
        same = converted == arr
        if part.dtype.kind == "f":
            same |= np.isnan(converted) & np.isnan(arr)
        if not same.all():
            bad = int(np.argmax(~same))
            raise CodecError(must_be(f"{part.name}[{bad}]", f"a value that fits {part.dtype}", arr[bad].item(),
                                     where=where))
        arr = converted
    return np.ascontiguousarray(arr)


def _csr_in(spec: Field, arrays: list[np.ndarray], where: str) -> RolloutSamplingMask:
    """Check the CSR structure vectorised (ids bounds are part bounds), then wrap the views as they are."""
    ids, offsets = arrays
    name = spec.parts[1].name
    if offsets.size == 0:
        raise CodecError(must_be(name, "non-empty (the empty mask is [0])", [], where=where))
    if offsets[0] != 0:
        raise CodecError(must_be(f"{name}[0]", "0", int(offsets[0]), where=where))
    if offsets[-1] != ids.size:
        raise CodecError(must_be(f"{name}[-1]", f"len(ids)={ids.size}", int(offsets[-1]), where=where))
    falls = offsets[1:] <= offsets[:-1]
    if np.count_nonzero(falls):  # faster than falls.any()
        t = int(np.argmax(falls))
        raise CodecError(must_be(name, "strictly increasing (no empty support)",
                                 f"{offsets[t]} then {offsets[t + 1]} at token {t}", where=where))
    return RolloutSamplingMask._from_trusted(ids, offsets)


def _check_bounds(arr: np.ndarray, part: Part, where: str) -> None:
    """Values must lie within the part's bounds (loss_mask is 0 or 1, ids are >= 0)."""
    if part.low is not None and arr.size and arr.min() < part.low:
        bad = int(np.argmax(arr < part.low))
        raise CodecError(must_be(f"{part.name}[{bad}]", f">= {part.low}", arr[bad].item(), where=where))
    if part.high is not None and arr.size and arr.max() > part.high:
        bad = int(np.argmax(arr > part.high))
        raise CodecError(must_be(f"{part.name}[{bad}]", f"<= {part.high}", arr[bad].item(), where=where))


# ---------------------------------------------------------------- encode

def encode_samples(samples: Sequence[Sample], fields: Sequence[str] = COMPUTED_FIELDS,
                   metadata: dict | None = None) -> bytes:
    """Pack ``samples`` (and a JSON-native ``metadata`` dict) into one deterministic safetensors buffer.

    Raises:
        CodecError: a sample is invalid, a value does not fit its wire dtype or JSON, or the
            payload would exceed the size caps; the message names the sample position and field.
    """
    specs = resolve_fields(fields)
    floats: list = []  # every float in the document (see samples_json.json_native)
    metadata = metadata_to_json({} if metadata is None else metadata, "metadata", "encode_samples", floats)
    try:
        samples = list(samples)
    except TypeError as exc:
        raise CodecError(must_be("samples", "a sequence of Sample", type(samples).__name__)) from exc
    tensors: list[tuple[str, str, np.ndarray]] = []
    entries = [_encode_sample(i, sample, specs, tensors, floats) for i, sample in enumerate(samples)]
    tensors.append((META_TENSOR, META_PART.wire, np.frombuffer(dump_document(metadata, entries, floats), dtype=META_PART.dtype)))
    return write_frame(tensors, MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES)


def _encode_sample(i: int, sample: Any, specs: tuple[Field, ...], tensors: list, floats: list) -> dict:
    where = f"sample {i}"
    if not isinstance(sample, Sample):
        raise CodecError(must_be("samples[i]", "a Sample", type(sample).__name__, where=where))
    for spec in specs:
        if not spec.nullable and getattr(sample, spec.name) is None:
            raise CodecError(must_be(spec.name, "present (not None)", None, where=where))
    try:
        sample.validate()
    except (ValueError, TypeError) as exc:
        raise CodecError(f"invalid sample at position {i}: {exc}") from exc
    entry, nulls = {}, []
    for (name, plain, to_json, _), value in zip(JSON_ITEMS, JSON_VALUES(sample)):
        entry[name] = value if type(value) in plain else to_json(value, name, where, floats)
    if type(entry["reward"]) is float:  # the one top-level field that may hold a float
        floats.append(entry["reward"])
    for spec in specs:
        value = getattr(sample, spec.name)
        if value is None:
            if not spec.absent_is_none:
                nulls.append(spec.name)
            continue
        if spec.kind == "tensor":
            arrays = (_to_wire_array(value, spec.parts[0], where),)
        elif not isinstance(value, RolloutSamplingMask):
            raise CodecError(must_be(spec.name, "a RolloutSamplingMask", type(value).__name__, where=where))
        else:
            arrays = value.as_arrays()
        for part, arr in zip(spec.parts, arrays):
            if arr.dtype != part.dtype:
                raise CodecError(must_be(part.name, f"dtype {part.dtype}", f"dtype {arr.dtype}", where=where))
            if not spec.strict and (part.low is not None or part.high is not None):
                _check_bounds(arr, part, where)
            tensors.append((f"{part.name}.{i}", part.wire, arr))
    entry["nulls"] = nulls
    return entry


# ---------------------------------------------------------------- decode

def decode_samples(payload: bytes, fields: Sequence[str] = COMPUTED_FIELDS, *, max_payload_bytes: int | None = None,
                   max_header_bytes: int | None = None) -> tuple[list[Sample], dict]:
    """Unpack a payload written by ``encode_samples`` with the same ``fields``.

    Returns:
        The samples (tensor fields as read-only numpy views of the payload) and the encoder's
        ``metadata`` dict.

    Raises:
        CodecError: for every malformed, truncated, oversized or inconsistent payload.
    """
    specs = resolve_fields(fields)
    max_payload = MAX_PAYLOAD_BYTES if max_payload_bytes is None else max_payload_bytes
    max_header = MAX_HEADER_BYTES if max_header_bytes is None else max_header_bytes
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(must_be("payload", "bytes", type(payload).__name__))
    size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if size > max_payload:
        raise CodecError(must_be("payload size", f"<= max_payload_bytes={max_payload}", size))
    payload = payload if type(payload) is bytes else bytes(payload)  # immutable, so views never change
    try:
        return _decode(payload, specs, max_header)
    except CodecError:
        raise
    except Exception as exc:  # decode is total: nothing but CodecError leaves it
        raise CodecError(f"{INTERNAL_ERROR} on a malformed payload: {type(exc).__name__}: {exc}") from exc


def _decode(payload: bytes, specs: tuple[Field, ...], max_header: int) -> tuple[list[Sample], dict]:
    entries = read_frame(payload, max_header)
    begin, count = _claim(entries, META_TENSOR, META_PART, "the payload")
    document = load_document(payload, begin, begin + count)
    document = _loads(payload[begin:begin + count], META_TENSOR) if document is None else document
    if type(document) is not dict or document.keys() != {"metadata", "samples"}:
        raise CodecError(must_be(META_TENSOR, "an object with keys metadata, samples", _clip(document)))
    if type(document["samples"]) is not list:
        raise CodecError(must_be(f"{META_TENSOR}.samples", "a list", _clip(document["samples"])))
    metadata = typed(dict, "a dict")(document["metadata"], "metadata", META_TENSOR)
    samples = [_decode_sample(i, entry, specs, payload, entries) for i, entry in enumerate(document["samples"])]
    if entries:
        names = sorted(entries)
        raise CodecError(f"payload carries unreferenced tensors {names[:4]}{' ...' if len(names) > 4 else ''}"
                         " (encoded with other fields than it is decoded with?)")
    return samples, metadata


def _decode_sample(i: int, entry: Any, specs: tuple[Field, ...], payload: bytes, entries: dict) -> Sample:
    where = f"sample {i}"
    if type(entry) is not dict or entry.keys() != SAMPLE_KEYS:
        got = sorted(entry) if type(entry) is dict else type(entry).__name__
        raise CodecError(must_be(f"{META_TENSOR} entry", f"an object with keys {sorted(SAMPLE_KEYS)}", got,
                                 where=where))
    kwargs = {}
    for name, plain, _, from_json in JSON_ITEMS:
        value = entry[name]
        kwargs[name] = value if type(value) in plain else from_json(value, name, where)
    nulls = entry["nulls"]
    allowed = [s.name for s in specs if s.nullable] if nulls else ()
    if type(nulls) is not list or any(n not in allowed for n in nulls) or len(set(nulls)) != len(nulls):
        allowed = [s.name for s in specs if s.nullable]
        raise CodecError(must_be("nulls", f"distinct names among {allowed}", _clip(nulls), where=where))
    suffix = f".{i}"
    for spec in specs:
        if spec.name in nulls or (spec.absent_is_none and spec.parts[0].name + suffix not in entries):
            kwargs[spec.name] = None
        elif spec.kind == "tensor":
            kwargs[spec.name] = _view(payload, entries, spec.parts[0], suffix, where)
        else:
            kwargs[spec.name] = _csr_in(spec, [_view(payload, entries, part, suffix, where) for part in spec.parts],
                                        where)
    try:
        sample = Sample(**kwargs)
        sample.validate()
    except (ValueError, TypeError) as exc:
        raise CodecError(f"decoded sample at position {i} is inconsistent: {exc}") from exc
    return sample


def _view(payload: bytes, entries: dict, part: Part, suffix: str, where: str) -> np.ndarray:
    """One promised tensor as a read-only view of the payload, its values within the part's bounds."""
    begin, count = _claim(entries, part.name + suffix, part, where)
    arr = np.frombuffer(payload, part.dtype, count, begin)
    if part.low is not None or part.high is not None:
        _check_bounds(arr, part, where)
    return arr


def _claim(entries: dict, name: str, part: Part, where: str) -> tuple[int, int]:
    """Claim one promised tensor: it must exist, be rank 1 and have the part's wire dtype."""
    entry = entries.pop(name, None)
    if entry is None:
        raise CodecError(f"missing tensor {name!r} promised by the samples metadata at {where}")
    wire, shape, begin, count = entry
    if wire != part.wire:
        raise CodecError(must_be(f"tensor {name} dtype", part.wire, wire, where=where))
    if len(shape) != 1:
        raise CodecError(must_be(f"tensor {name} rank", "1", len(shape), where=where))
    return begin, count
