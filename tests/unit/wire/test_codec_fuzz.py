"""Fuzzing the decoder: whatever the bytes, it returns samples or raises CodecError, nothing else.

A CodecError raised by the decoder's last-resort safety net (its message carries
``INTERNAL_ERROR``) counts as a failure too: it means a check is missing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_bus.wire.codec import COMPUTED_FIELDS, INTERNAL_ERROR, SAMPLING_MASK_FIELDS, CodecError, decode_samples, \
    encode_samples
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask

ALL = COMPUTED_FIELDS + SAMPLING_MASK_FIELDS
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_payload() -> bytes:
    samples = [
        Sample(group_index=1, index=i, tokens=list(range(10, 16 + i)), response="ab", response_length=3,
               loss_mask=[1, 0, 1], rollout_log_probs=[-0.1, 0.0, -2.0],
               rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[1, 2], [3], [4, 5, 6]]),
               reward={"acc": 1.0}, status=Status.COMPLETED, metadata={"t": [i]}, adapter=AdapterRef("a", i))
        for i in range(2)
    ]
    return encode_samples(samples, ALL, {"batch": 1})


VALID = _valid_payload()
HEADER_END = 8 + int.from_bytes(VALID[:8], "little")


def decode_or_codec_error(payload: bytes, fields=ALL) -> bool:
    """True when decoded, False when refused with a CodecError; anything else fails the test."""
    try:
        decode_samples(payload, fields)
    except CodecError as exc:
        assert INTERNAL_ERROR not in str(exc), f"decoder safety net caught: {exc}"
        return False
    except Exception as exc:  # noqa: BLE001 - the property is exactly "no other exception type"
        pytest.fail(f"decode raised {type(exc).__name__} instead of CodecError: {exc}")
    return True


def test_the_fuzzed_payload_is_valid_to_start_with():
    assert decode_or_codec_error(VALID)


def test_every_truncation_of_a_valid_payload_is_refused():
    assert not any(decode_or_codec_error(VALID[:cut]) for cut in range(len(VALID)))


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_never_raise_anything_but_codec_error(data):
    decode_or_codec_error(data)


@FUZZ
@given(length=st.integers(0, 600), body=st.binary(max_size=600))
def test_random_bytes_behind_a_plausible_header_length_never_raise_anything_else(length, body):
    decode_or_codec_error(length.to_bytes(8, "little") + body)


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 7)), min_size=1, max_size=8))
def test_bit_flips_anywhere_in_a_valid_payload_never_raise_anything_else(flips):
    payload = bytearray(VALID)
    for position, bit in flips:
        payload[position] ^= 1 << bit
    decode_or_codec_error(bytes(payload))


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(8, HEADER_END - 1), st.sampled_from(b'{}[]",:0123456789-e. ')),
                      min_size=1, max_size=6))
def test_json_punctuation_written_into_the_header_never_raises_anything_else(edits):
    payload = bytearray(VALID)
    for position, byte in edits:
        payload[position] = byte
    decode_or_codec_error(bytes(payload))


def _rebuilt(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


header_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6),
    st.lists(st.integers(-5, 300), max_size=3), st.sampled_from(["I64", "I32", "U8", "F64", "F32", "BF16"]),
)


@FUZZ
@given(name=st.sampled_from(sorted(json.loads(VALID[8:HEADER_END]))), key=st.sampled_from(["dtype", "shape",
       "data_offsets", "extra"]), value=header_values)
def test_any_value_in_a_header_entry_never_raises_anything_else(name, key, value):
    header = json.loads(VALID[8:HEADER_END])
    header[name][key] = value
    decode_or_codec_error(_rebuilt(header, VALID[HEADER_END:]))


@FUZZ
@given(data=st.data())
def test_any_value_in_the_samples_metadata_never_raises_anything_else(data):
    import safetensors.numpy

    tensors = safetensors.numpy.load(VALID)
    meta = json.loads(tensors["_samples_meta"].tobytes())
    entry = meta["samples"][data.draw(st.integers(0, 1))]
    key = data.draw(st.sampled_from(sorted(entry)))
    entry[key] = data.draw(st.recursive(header_values, lambda inner: st.lists(inner, max_size=3)
                                        | st.dictionaries(st.text(max_size=3), inner, max_size=2), max_leaves=6))
    tensors["_samples_meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    decode_or_codec_error(safetensors.numpy.save(tensors))
    decode_or_codec_error(safetensors.numpy.save(tensors), COMPUTED_FIELDS)


LONG_TEXT = "words without quotes " * 40
LONG_VALID = encode_samples([Sample(index=i, tokens=[1, 2, 3], response=LONG_TEXT, response_length=2,
                                    metadata={"note": LONG_TEXT[:40]}) for i in range(2)], COMPUTED_FIELDS)
_LONG_HEADER_END = 8 + int.from_bytes(LONG_VALID[:8], "little")
LONG_META_START = _LONG_HEADER_END + json.loads(LONG_VALID[8:_LONG_HEADER_END])["_samples_meta"]["data_offsets"][0]


def test_the_long_fuzzed_payload_is_valid_to_start_with():
    assert decode_or_codec_error(LONG_VALID, COMPUTED_FIELDS)


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(LONG_META_START, len(LONG_VALID) - 1),
                                st.sampled_from(b'{}[]",:\\0123456789 \x00\x80\xff"response"')),
                      min_size=1, max_size=6))
def test_edits_in_a_document_with_long_responses_never_raise_anything_else(edits):
    payload = bytearray(LONG_VALID)
    for position, byte in edits:
        payload[position] = byte
    decode_or_codec_error(bytes(payload), COMPUTED_FIELDS)
