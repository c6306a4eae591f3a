"""Where each ``Sample`` field travels in a samples payload: the two tables the codec is driven by.

Why a module of its own: ``rollout_bus.wire.codec`` encodes and decodes by walking these tables and
nothing else, so a field added to ``Sample`` is one entry here (docs/architecture.md, "Adding a field
to a turn") and no change to either direction.

Contract:

* ``TENSOR_FIELDS``: the tensor fields by name, each a ``Field`` (kind ``tensor`` or ``csr``; per
  ``Part`` the wire dtype and inclusive value bounds; nullable; strict), in wire order.
* ``JSON_FIELDS``: the fields of the ``_samples_meta`` JSON document (``META_PART``), each with its
  plain types and its converters to and from JSON. A value whose exact type is plain passes as
  is; any other is checked by the converter, alike on both sides, so encode never ships what
  decode refuses.
* ``resolve_fields(fields)`` is the ``TENSOR_FIELDS`` entries a caller asks for, in table order
  (the order given never changes the bytes); an unknown or repeated name raises ``CodecError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

from rollout_bus.errors import CodecError, must_be
from rollout_bus.wire.samples_json import flat, json_native
from rollout_bus.model.sample import AdapterRef, Status

META_TENSOR = "_samples_meta"


@dataclass(frozen=True)
class Part:
    """One tensor of a field on the wire, named ``{name}.{i}``."""

    name: str  # "tokens", "rollout_sampling_mask.ids", ...
    wire: str  # safetensors dtype name
    dtype: np.dtype
    low: int | None = None  # inclusive value bounds: always checked on decode, on encode unless strict
    high: int | None = None


@dataclass(frozen=True)
class Field:
    """The wire contract of one tensor field."""

    name: str
    kind: str  # "tensor": one array | "csr": a RolloutSamplingMask as ids + offsets
    parts: tuple[Part, ...]
    nullable: bool  # None travels as a null marker
    strict: bool  # encode never converts, only checks dtypes (the value is a validated object)
    # a field added after the first writers: None travels as nothing at all (no null marker, no
    # tensor), so a sample without it encodes to the bytes it always did and older payloads decode
    absent_is_none: bool = False


_I64, _U8, _F64, _I32 = (np.dtype(t) for t in ("<i8", "u1", "<f8", "<i4"))
META_PART = Part(META_TENSOR, "U8", _U8)
TENSOR_FIELDS: dict[str, Field] = {f.name: f for f in (
    Field("tokens", "tensor", (Part("tokens", "I64", _I64),), nullable=False, strict=False),
    Field("loss_mask", "tensor", (Part("loss_mask", "U8", _U8, None, 1),), nullable=True, strict=False),  # U8: >= 0
    Field("rollout_log_probs", "tensor", (Part("rollout_log_probs", "F64", _F64),), nullable=True, strict=False),
    Field("rollout_token_versions", "tensor", (Part("rollout_token_versions", "I64", _I64, -1),), nullable=True,
           strict=False, absent_is_none=True),
    Field("rollout_sampling_mask", "csr", (Part("rollout_sampling_mask.ids", "I32", _I32, 0),
                                           Part("rollout_sampling_mask.offsets", "I64", _I64)),
           nullable=True, strict=True),
)}


# ---------------------------------------------------------------- JSON fields

def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _refuse(expected: str) -> Callable[..., Any]:
    """The converter of a field whose plain types are its only valid ones."""
    def refuse(value: Any, name: str, where: str, floats: list | None = None) -> Any:
        raise CodecError(must_be(name, expected, value, where=where))
    return refuse


def typed(kind: type, expected: str) -> Callable[[Any, str, str], Any]:
    """A converter that passes instances of ``kind`` unchanged."""
    def check(value: Any, name: str, where: str) -> Any:
        if not isinstance(value, kind):
            raise CodecError(must_be(name, expected, value, where=where))
        return value
    return check


def _int(value: Any, name: str, where: str, floats: list | None = None) -> int:
    if not _is_int(value):
        raise CodecError(must_be(name, "an integer or None", value, where=where))
    return int(value)


def _prompt_in(value: Any, name: str, where: str) -> list:
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return value
    raise CodecError(must_be(name, "a str or a list of dicts", value, where=where))


def _prompt_out(value: Any, name: str, where: str, floats: list) -> list:
    if type(value) is list and all(map(flat, value)):  # the hot case: messages of str fields
        return value
    return json_native(_prompt_in(value, name, where), name, where, floats)


def _reward_out(value: Any, name: str, where: str, floats: list) -> float | int | dict:
    if isinstance(value, dict):
        return json_native(value, name, where, floats)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise CodecError(must_be(name, "a float, an int, a dict or None", value, where=where))
    return int(value) if _is_int(value) else float(value)


def _versions(value: Any, name: str, where: str, floats: list | None = None) -> list[str]:
    if type(value) is list and {*map(type, value)} <= {str}:  # the hot case: a fresh copy, as below
        return value[:]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise CodecError(must_be(name, "a list of str", value, where=where))
    return list(value)


_STATUSES = {s.value: s for s in Status}


def _status_in(value: Any, name: str, where: str) -> Status:
    if type(value) is str and value in _STATUSES:  # the hot case, without Enum's call machinery
        return _STATUSES[value]
    try:
        return Status(value)
    except ValueError:
        raise CodecError(must_be(name, f"one of {[s.value for s in Status]}", value, where=where)) from None


def _status_out(value: Any, name: str, where: str, floats: list | None = None) -> str:
    return value.value if type(value) is Status else _status_in(value, name, where).value


def _adapter_in(value: Any, name: str, where: str) -> AdapterRef:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and _is_int(value[1])):
        raise CodecError(must_be(name, "[adapter name, slot] or null", value, where=where))
    return AdapterRef(value[0], int(value[1]))


def _adapter_out(value: Any, name: str, where: str, floats: list | None = None) -> list:
    if not isinstance(value, AdapterRef):
        raise CodecError(must_be(name, "an AdapterRef or None", value, where=where))
    if not (isinstance(value.name, str) and _is_int(value.slot)):
        raise CodecError(must_be(name, "[adapter name, slot] or null", [value.name, value.slot], where=where))
    return [value.name, int(value.slot)]


def metadata_to_json(value: Any, name: str, where: str, floats: list) -> dict:
    if not isinstance(value, dict):
        raise CodecError(must_be(name, "a dict", value, where=where))
    return json_native(value, name, where, floats)


_NONE = type(None)
# name -> (plain types, to JSON, from JSON). A value whose exact type is plain passes as is (the
# hot path); any other goes through the converter, which checks it (and on encode normalises it,
# adding the floats it holds to the document's list). Both sides check alike, so encode never
# ships what decode refuses. Freshly parsed JSON is native already: decode walks no dict again.
JSON_FIELDS: dict[str, tuple[tuple[type, ...], Callable, Callable]] = {
    "group_index": ((int, _NONE), _int, _int),
    "index": ((int, _NONE), _int, _int),
    "rollout_id": ((int, _NONE), _int, _int),
    "prompt": ((str,), _prompt_out, _prompt_in),
    "response": ((str,), _refuse("a str"), _refuse("a str")),
    "response_length": ((int,), _int, _refuse("an integer")),  # validate() refuses negatives
    "label": ((str, _NONE), _refuse("a str or None"), _refuse("a str or None")),
    "reward": ((float, int, _NONE), _reward_out, typed(dict, "a float, an int, a dict or None")),
    "weight_versions": ((), _versions, _versions),
    "remove_sample": ((bool,), _refuse("a bool"), _refuse("a bool")),
    "status": ((), _status_out, _status_in),
    "metadata": ((), metadata_to_json, typed(dict, "a dict")),
    "adapter": ((_NONE,), _adapter_out, _adapter_in),
}
SAMPLE_KEYS = frozenset(JSON_FIELDS) | {"nulls"}
JSON_ITEMS = tuple((name, *converters) for name, converters in JSON_FIELDS.items())
JSON_VALUES = attrgetter(*JSON_FIELDS)  # a sample's values of the JSON fields, in one call


# ---------------------------------------------------------------- a caller's fields

_RESOLVED: dict[tuple, tuple[Field, ...]] = {}


def resolve_fields(fields: Any) -> tuple[Field, ...]:
    """The table entries for ``fields`` in table order, so the order given does not change the bytes."""
    if type(fields) is tuple and fields in _RESOLVED:
        return _RESOLVED[fields]
    if isinstance(fields, str) or not isinstance(fields, Sequence):
        raise CodecError(must_be("fields", "a tuple of field names", fields))
    names = list(fields)
    if any(not isinstance(n, str) or n not in TENSOR_FIELDS for n in names) or len(set(names)) != len(names):
        raise CodecError(must_be("fields", f"distinct names among {list(TENSOR_FIELDS)}", fields))
    resolved = tuple(f for n, f in TENSOR_FIELDS.items() if n in names)
    if type(fields) is tuple:
        _RESOLVED[fields] = resolved
    return resolved
