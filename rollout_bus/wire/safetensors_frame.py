"""Raw safetensors framing for the wire codec: named rank-1 buffers to one ``bytes`` and back.

Contract:

* ``write_frame(tensors, max_header, max_payload)`` lays out ``(name, wire dtype, array)`` triples
  as plain safetensors (8-byte little-endian header length, compact JSON header padded with
  spaces to a multiple of 8, data). Widest dtypes come first (stable within a width), so every
  tensor is aligned to its itemsize. The output is assembled with one copy of the data.
* ``read_frame(payload, max_header)`` checks the whole header before any data is touched and
  returns ``name -> (wire dtype, shape, absolute start, element count)``. The data of all tensors
  must tile the data section exactly: no gap, no overlap, no trailing byte.
* Both raise only ``CodecError`` for what they refuse. Pure: no I/O, no numpy views created here.
* A header spelled exactly as ``write_frame`` spells it (one regular expression says so), with its
  tensors tiling the data in header order, is parsed by orjson with few checks left to make
  (~1.7x faster); any other header takes the general path, which alone decides what is refused
  and how.
"""

from __future__ import annotations

import json
import re
from math import prod
from typing import Any

import numpy as np

try:
    import orjson
except ImportError:  # a declared dependency; without it json reads every header
    orjson = None

from rollout_bus.errors import CodecError, must_be

ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
            "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
Entries = dict[str, tuple[str, list, int, int]]
_ENTRY = '"%s":{"dtype":"%s","shape":[%d],"data_offsets":[%d,%d]}'
# A header as write_frame spells it: _ENTRY for plain names, integers as JSON spells them and
# below 10**18 (orjson would read a larger one as a float), comma-separated, padded with spaces
_WRITTEN_ENTRY = (rb'"[A-Za-z0-9_.]+":\{"dtype":"[A-Z0-9_]+","shape":\[(?:0|[1-9][0-9]{0,17})\],'
                  rb'"data_offsets":\[(?:0|[1-9][0-9]{0,17}),(?:0|[1-9][0-9]{0,17})\]\}')
_WRITTEN_HEADER = re.compile(rb"\{" + _WRITTEN_ENTRY + rb"(?:," + _WRITTEN_ENTRY + rb")*\} *")


def write_frame(tensors: list[tuple[str, str, np.ndarray]], max_header: int, max_payload: int) -> bytes:
    """Safetensors bytes for rank-1 contiguous arrays; refuse a payload over the caps."""
    tensors = sorted(tensors, key=lambda t: -t[2].itemsize)  # stable: sample order within a width
    described, end = [], 0
    for name, wire, arr in tensors:
        begin, end = end, end + arr.nbytes
        described.append(_ENTRY % (name, wire, arr.size, begin, end))
    header = ("{" + ",".join(described) + "}").encode("ascii")
    header += b" " * (-len(header) % 8)
    size = 8 + len(header) + end
    if len(header) > max_header or size > max_payload:
        raise CodecError(must_be("payload", f"<= {max_payload} bytes with a header <= {max_header}",
                                 f"{size} bytes, header {len(header)}"))
    return b"".join([len(header).to_bytes(8, "little"), header, *(t[2] for t in tensors)])


def read_frame(payload: bytes, max_header: int) -> Entries:
    """Check the safetensors header before touching data: name -> (dtype, shape, start, count)."""
    size = len(payload)
    if size < 8:
        raise CodecError(f"truncated payload: {size} bytes, the header length alone needs 8")
    header_len = int.from_bytes(payload[:8], "little")
    if header_len > max_header:
        raise CodecError(must_be("header length", f"<= max_header_bytes={max_header}", header_len))
    data_start = 8 + header_len
    if data_start > size:
        raise CodecError(f"truncated payload: a header of {header_len} bytes needs {data_start} bytes, got {size}")
    if orjson is not None and _WRITTEN_HEADER.fullmatch(payload, 8, data_start) is not None:
        entries = _written_entries(payload, data_start, size - data_start)
        if entries is not None:
            return entries
    header = loads(payload[8:data_start], "safetensors header")
    if type(header) is not dict:
        raise CodecError(must_be("safetensors header", "a JSON object", clip(header)))
    extra = header.pop("__metadata__", {})
    if type(extra) is not dict or not all(type(v) is str for v in extra.values()):
        raise CodecError(must_be("__metadata__", "an object of strings", clip(extra)))
    data_len, entries, spans = size - data_start, {}, []
    for name, info in header.items():
        wire, shape, begin, end = _header_entry(name, info, data_len)
        entries[name] = (wire, shape, data_start + begin, (end - begin) // ITEMSIZE[wire])
        spans.append((begin, end, name))
    spans.sort()
    position = 0
    for begin, end, name in spans:
        if begin != position:
            what = "overlaps the tensor before it" if begin < position else f"leaves a gap after byte {position}"
            raise CodecError(f"tensor {name!r} data_offsets [{begin}, {end}] {what}")
        position = end
    if position != data_len:
        raise CodecError(f"payload has {data_len - position} bytes after the last tensor")
    return entries


def _written_entries(payload: bytes, data_start: int, data_len: int) -> Entries | None:
    """The entries of a header spelled as write_frame spells it (orjson parses it: the pattern leaves
    it no choice that json would make otherwise), or None unless dtypes are known, byte lengths
    match shapes and the data is tiled in header order. Then the general path returns the same."""
    header, entries, position = orjson.loads(memoryview(payload)[8:data_start]), {}, 0
    for name, info in header.items():
        wire, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if begin != position or wire not in ITEMSIZE or end - begin != shape[0] * ITEMSIZE[wire]:
            return None
        position = end
        entries[name] = (wire, shape, data_start + begin, shape[0])
    return entries if position == data_len and "__metadata__" not in entries else None


def _header_entry(name: str, info: Any, data_len: int) -> tuple[str, list, int, int]:
    """One header entry, with exact types (JSON gives int, never bool or numpy)."""
    if type(info) is not dict or len(info) != 3:
        raise CodecError(must_be(f"header entry {name!r}", "an object of dtype, shape, data_offsets", clip(info)))
    wire, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(wire) is not str or wire not in ITEMSIZE:
        raise CodecError(must_be(f"tensor {name} dtype", "a safetensors dtype", clip(wire)))
    rank_one = type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0  # the hot case
    if not rank_one and (type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape)):
        raise CodecError(must_be(f"tensor {name} shape", "a list of integers >= 0", clip(shape)))
    if not (type(offsets) is list and len(offsets) == 2 and type(offsets[0]) is int and type(offsets[1]) is int
            and 0 <= offsets[0] <= offsets[1] <= data_len):
        raise CodecError(must_be(f"tensor {name} data_offsets", f"[begin, end] within [0, {data_len}]",
                                 clip(offsets)))
    nbytes = (shape[0] if rank_one else prod(shape)) * ITEMSIZE[wire]
    if offsets[1] - offsets[0] != nbytes:
        raise CodecError(must_be(f"tensor {name} byte length", f"{nbytes} for shape {shape}", offsets[1] - offsets[0]))
    return wire, shape, offsets[0], offsets[1]


def loads(raw: bytes, what: str) -> Any:
    """Strict UTF-8 JSON, every failure as CodecError."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CodecError(f"{what} is not valid UTF-8 JSON: {exc}") from exc


class _Clipped(str):
    """Text that ``must_be`` shows as is."""

    def __repr__(self) -> str:
        return str(self)


def clip(value: Any, limit: int = 80) -> _Clipped:
    """A bounded repr for messages about hostile input."""
    text = repr(value)
    return _Clipped(text if len(text) <= limit else text[:limit] + "...")
