"""rollout.weights records that point at a checkpoint: ``uri``, ``sha256`` and ``bytes`` travel together
or not at all, and the code and ``schemas/weight_version.json`` agree on what a record may hold.

Proven here: a record with a checkpoint reference round-trips through ``value()``/``from_value()``; a
stand-in's record (no reference) has none of the three keys and its bytes are what they were before the
reference existed; ``from_value`` refuses, naming the field, a ``uri`` that is not ``file:///``, a
``sha256`` that is not 64 lowercase hex digits, a ``bytes`` that is negative, fractional, text or a bool,
and a record holding only some of the three; ``.path`` is the uri without ``file://``; every record the
code accepts validates against the schema and every one it refuses is rejected by the schema too
(``dependentRequired`` for partial references).
"""

from __future__ import annotations

import hashlib
import json

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.wire.weight_version import WeightVersion
from tests.wire_schemas import problems, validate, validator

SHA = hashlib.sha256(b"policy weights").hexdigest()
URI = "file:///var/run/rollout-bus/checkpoints/policy-v000003.safetensors"
STAMP = {"version": 3, "step": 2, "published_at": 1_700_000_000_123}
REF = {"uri": URI, "sha256": SHA, "bytes": 337_688}


def _value(doc: dict) -> bytes:
    return json.dumps(doc).encode()


def test_a_record_with_a_checkpoint_reference_round_trips():
    record = WeightVersion(3, 2, STAMP["published_at"], URI, SHA, 337_688)
    value = record.value()
    assert json.loads(value) == STAMP | REF
    assert value == json.dumps(STAMP | REF, sort_keys=True, separators=(",", ":")).encode()
    assert WeightVersion.from_value(value) == record
    assert WeightVersion.from_value(_value(STAMP | REF)) == record
    assert WeightVersion.from_value(_value(STAMP | REF | {"bytes": 0})).bytes == 0


def test_a_stand_in_record_has_no_reference_keys_and_is_unchanged():
    record = WeightVersion(3, 2, STAMP["published_at"])
    assert record.value() == b'{"published_at":1700000000123,"step":2,"version":3}'
    parsed = WeightVersion.from_value(record.value())
    assert parsed == record
    assert (parsed.uri, parsed.sha256, parsed.bytes, parsed.path) == (None, None, None, None)


def test_null_reference_fields_read_as_no_reference():
    parsed = WeightVersion.from_value(_value(STAMP | {"uri": None, "sha256": None, "bytes": None}))
    assert parsed == WeightVersion(3, 2, STAMP["published_at"])


def test_unknown_keys_are_ignored():
    assert WeightVersion.from_value(_value(STAMP | REF | {"dtype": "float32"})) == WeightVersion(**STAMP, **REF)


def test_the_path_is_the_uri_without_its_scheme():
    assert WeightVersion(3, 2, 0, URI, SHA, 1).path == "/var/run/rollout-bus/checkpoints/policy-v000003.safetensors"
    assert WeightVersion(3, 2, 0, "file:///x.safetensors", SHA, 1).path == "/x.safetensors"


BAD_FIELDS = [
    ("uri", "http://host/policy.safetensors"),
    ("uri", "file://host/policy.safetensors"),
    ("uri", "file:/policy.safetensors"),
    ("uri", "/var/run/policy.safetensors"),
    ("uri", ""),
    ("uri", 7),
    ("sha256", SHA.upper()),
    ("sha256", SHA[:-1]),
    ("sha256", SHA + "0"),
    ("sha256", "g" * 64),
    ("sha256", 12),
    ("bytes", -1),
    ("bytes", True),
    ("bytes", False),
    ("bytes", 1.5),
    ("bytes", "337688"),
]


@pytest.mark.parametrize("field, bad", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_a_bad_reference_field_is_refused_by_the_code_and_the_schema(field, bad):
    doc = STAMP | REF | {field: bad}
    with pytest.raises(ContractError, match=f"'{field}'"):
        WeightVersion.from_value(_value(doc))
    assert problems("weight_version", doc), f"the schema accepts {field}={bad!r}, which the code refuses"


PARTIAL = [("uri",), ("sha256",), ("bytes",), ("uri", "sha256"), ("uri", "bytes"), ("sha256", "bytes")]


@pytest.mark.parametrize("present", PARTIAL, ids=["+".join(p) for p in PARTIAL])
def test_a_partial_reference_is_refused_by_the_code_and_the_schema(present):
    doc = STAMP | {k: REF[k] for k in present}
    missing = [k for k in ("uri", "sha256", "bytes") if k not in present]
    with pytest.raises(ContractError) as refused:
        WeightVersion.from_value(_value(doc))
    assert f"'{missing[0]}'" in str(refused.value)
    errors = list(validator("weight_version").iter_errors(doc))
    assert errors and {e.validator for e in errors} == {"dependentRequired"}, [e.message for e in errors]
    assert {m for m in missing if any(repr(m) in e.message for e in errors)} == set(missing)


def test_records_the_code_writes_validate_against_the_schema():
    validate("weight_version", json.loads(WeightVersion(3, 2, STAMP["published_at"]).value()))
    validate("weight_version", json.loads(WeightVersion(3, 2, STAMP["published_at"], URI, SHA, 337_688).value()))
    validate("weight_version", json.loads(WeightVersion(0, 0, 0, "file:///c.safetensors", SHA, 0).value()))


def test_the_schema_lists_the_reference_fields_as_dependent_on_each_other():
    from tests.wire_schemas import schemas

    schema = schemas()["weight_version"]
    assert {k: set(v) for k, v in schema["dependentRequired"].items()} == {
        "uri": {"sha256", "bytes"}, "sha256": {"uri", "bytes"}, "bytes": {"uri", "sha256"}}
    assert set(schema["properties"]) == set(STAMP) | set(REF)
