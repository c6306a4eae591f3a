"""The codec's fast paths (orjson writing the document and reading the header, the in-place document
reader) change no byte and no decision: golden payloads, and every result against the plain paths."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_bus.wire import safetensors_frame, samples_json
from rollout_bus.wire.codec import COMPUTED_FIELDS, SAMPLING_MASK_FIELDS, CodecError, decode_samples, encode_samples
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask

ALL = COMPUTED_FIELDS + SAMPLING_MASK_FIELDS
LONG = "a tool call said: 'ok' & more " * 40


@contextlib.contextmanager
def plain_paths():
    """json writes every document and reads every header, as before orjson."""
    saved = samples_json.orjson, safetensors_frame.orjson
    samples_json.orjson = safetensors_frame.orjson = None
    try:
        yield
    finally:
        samples_json.orjson, safetensors_frame.orjson = saved


def sample(**overrides) -> Sample:
    fields = dict(
        group_index=3, index=7, rollout_id=11, prompt=[{"role": "user", "content": "2+2?"}],
        tokens=[101, 102, 103, 4, 5, 6], response="4", response_length=3, label="4",
        reward=1.0, loss_mask=[1, 0, 1], weight_versions=["5", "6"], rollout_log_probs=[-0.5, 0.0, -1.25],
        rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[4, 9], [5], [6, 7, 8]]),
        remove_sample=False, status=Status.COMPLETED, metadata={"turn": 1, "tools": ["calc"]},
        adapter=AdapterRef("math", 2), rollout_token_versions=[5, -1, 6])
    fields.update(overrides)
    return Sample(**fields)


def turn(seed: int, n: int) -> Sample:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 150_000, 40 + n, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(np.clip(rng.geometric(1 / 8, n), 1, 64))]).astype(np.int64)
    mask = RolloutSamplingMask(rng.integers(0, 150_000, int(offsets[-1]), dtype=np.int32), offsets)
    return sample(tokens=tokens, response_length=n, loss_mask=(rng.random(n) > 0.1).astype(np.uint8),
                  rollout_log_probs=np.log(rng.random(n)), rollout_sampling_mask=mask, rollout_token_versions=None,
                  response="word " * 200, prompt=[{"role": "user", "content": "solve " * 150}])


# sha256 prefixes of the payloads the encoder wrote before it had fast paths
GOLDEN = {
    "full": ("2446e8f4c79c79978a5349a3f6889ac0", lambda: ([sample()], ALL, {"batch": 9})),
    "default-fields": ("5908cbfef7a166f55416f95f2212ab39", lambda: ([sample()], COMPUTED_FIELDS, None)),
    "nulls": ("3df5172718867003ed94fb141c6f50a4", lambda: (
        [sample(loss_mask=None, rollout_log_probs=None, rollout_sampling_mask=None, reward=None, adapter=None,
                label=None, group_index=None, rollout_token_versions=None)], ALL, None)),
    "long-texts": ("3d5af448639146d3c03991019f37fbfe", lambda: (
        [sample(response=LONG, prompt=[{"role": "user", "content": LONG}, {"content": 5}])], ALL, None)),
    "long-str-prompt": ("362f65b8277a4292c2e61a46586539ec", lambda: (
        [sample(prompt=LONG + "x", response=LONG + "y")], ALL, {"note": LONG})),
    "newline-texts": ("d8133fc3de52dd11aca5f33e45fca97b", lambda: (
        [sample(response=LONG + "\nline two\ttab", prompt=[{"role": "user", "content": LONG + "\n"}])], ALL, None)),
    "unicode": ("5283be4f1350d91a971ab19c0c9dd858", lambda: (
        [sample(response=LONG + "日本語 ü 🙂 \u2028", label="ü", metadata={"ключ": "значение"})], ALL, None)),
    "floats": ("8e4c4645585ac05b0021dc9fb700fb38", lambda: (
        [sample(reward=0.1, metadata={"a": 1e-05, "b": 1e16, "c": 0.5, "d": -0.0, "e": [1.5, 2.25e-7]})], ALL,
        {"lr": 3e-4})),
    "non-finite": ("dc69dad6f2f207ea837a193d07abed71", lambda: (
        [sample(reward=float("nan"), metadata={"x": float("inf"), "y": float("-inf")})], ALL, None)),
    "big-int": ("db541f4f5215a065be19bdad08491fdf", lambda: (
        [sample(metadata={"big": 2**70, "neg": -(2**65)}, reward=2**64)], ALL, None)),
    "dict-reward": ("4e6f1f271d50059642731ba1726d56a7", lambda: (
        [sample(reward={"acc": 1, "fmt": 0.5, "nested": {"z": [None, True]}})], ALL, None)),
    "numpy-scalars": ("ce46fbb12ab2a291aef97315685eb741", lambda: (
        [sample(reward=np.float32(0.1), group_index=np.int64(5), tokens=np.arange(6, dtype=np.int32),
                loss_mask=np.array([True, False, True]))], ALL, None)),
    "batch": ("e683475192b9a683fe461d0b9f3b4f75", lambda: (
        [sample(index=1), sample(index=2, tokens=[9, 8, 7, 6, 5, 4, 3], response_length=4, loss_mask=[0, 0, 1, 1],
                                 rollout_log_probs=[-1.0, -2.0, -3.0, -4.0], rollout_token_versions=[2, 2, 3, 3],
                                 rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[1], [2], [3], [4, 5]])),
         turn(1, 64)], ALL, {"episode": {"segments": 3, "score": 0.75}})),
    "turn": ("1ca14a33cd55c9363bcd336f364ab4ff", lambda: ([turn(0, 256)], ALL, None)),
    "empty": ("158b5905c02850090acf1b867d987d27", lambda: ([], ALL, {"reason": "none"})),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_payloads_are_the_bytes_written_before_the_fast_paths(name):
    digest, build = GOLDEN[name]
    payload = encode_samples(*build())
    assert hashlib.sha256(payload).hexdigest()[:32] == digest
    with plain_paths():
        assert encode_samples(*build()) == payload
        plain = decode_samples(payload, build()[1])
    assert decode_samples(payload, build()[1])[1] == plain[1]
    assert [s.__dict__.keys() for s in decode_samples(payload, build()[1])[0]] == [s.__dict__.keys() for s in plain[0]]


class Level(enum.IntEnum):
    HIGH = 3


class Tag(str):
    pass


floats = st.floats() | st.sampled_from([0.0, -0.0, 1e-05, 9.99e-05, 1e-4, 1e15, 1e16, 1e22, 5e-324, 0.1, 2.5e-7])
ints = st.integers() | st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 2**100])
texts = st.text(max_size=6) | st.sampled_from([LONG, LONG + "\n", LONG + '"', "\x00\x01", LONG + "\x00\x01", "日本"])
scalars = st.none() | st.booleans() | ints | floats | texts | st.just(Level.HIGH) | st.builds(Tag, texts)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3)
    | st.dictionaries(st.text(max_size=3), inner, max_size=2).map(OrderedDict), max_leaves=10)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(metadata=st.dictionaries(texts, json_values, max_size=4), reward=st.none() | floats | ints
       | st.dictionaries(texts, json_values, max_size=3), response=texts,
       prompt=texts | st.lists(st.dictionaries(texts, texts | json_values, max_size=3), max_size=2))
def test_orjson_writes_every_document_as_the_json_module_does(metadata, reward, response, prompt):
    batch = [sample(metadata=metadata, reward=reward if not isinstance(reward, bool) else None, response=response,
                    prompt=prompt), sample(prompt=response, response=LONG)]
    outcome = []
    for context in (contextlib.nullcontext(), plain_paths()):
        with context:
            try:
                outcome.append(encode_samples(batch, ALL, {"m": metadata}))
            except CodecError as exc:
                outcome.append(str(exc))
    assert outcome[0] == outcome[1]


def test_the_float_check_covers_what_orjson_spells_differently():
    for value in (1e-05, 9.99e-05, float("nan"), float("inf"), 2.5e-7):
        assert json.dumps(value).encode() != samples_json.orjson.dumps(value)  # the spellings differ...
        payload = encode_samples([sample(metadata={"x": [value]})])
        with plain_paths():
            assert encode_samples([sample(metadata={"x": [value]})]) == payload  # ...yet the payloads do not


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_header_fast_path_decides_as_the_general_path(data):
    payload = encode_samples([sample(index=i) for i in range(data.draw(st.integers(0, 3)))], ALL)
    start = 8 + int.from_bytes(payload[:8], "little")
    header = bytearray(payload[8:start])
    for _ in range(data.draw(st.integers(0, 3))):  # digits, names and punctuation the pattern still accepts
        header[data.draw(st.integers(0, len(header) - 1))] = data.draw(st.sampled_from(b'0123456789.a_,'))
    edited = payload[:8] + bytes(header) + payload[start:]
    results = []
    for context in (contextlib.nullcontext(), plain_paths()):
        with context:
            try:
                results.append(safetensors_frame.read_frame(edited, 1 << 20))
            except CodecError as exc:
                results.append(str(exc))
    assert results[0] == results[1]


def test_a_header_with_a_repeated_name_or_a_huge_number_takes_the_general_path():
    payload = encode_samples([sample()])
    start = 8 + int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8:start])
    entry = '"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'
    for raw in (payload[8:start].rstrip()[:-1] + b',' + entry.encode() + b',' + entry.encode() + b'}',
                json.dumps({**header, "x": {"dtype": "U8", "shape": [10**19], "data_offsets": [0, 0]}},
                           separators=(",", ":")).encode()):
        edited = len(raw).to_bytes(8, "little") + raw + payload[start:]
        with pytest.raises(CodecError) as fast:
            decode_samples(edited)
        with plain_paths(), pytest.raises(CodecError) as plain:
            decode_samples(edited)
        assert str(fast.value) == str(plain.value)


def test_the_document_is_read_in_place_between_offsets():
    document = {"metadata": {}, "samples": [{"response": LONG, "prompt": LONG}]}
    raw = json.dumps(document, separators=(",", ":")).encode()
    assert samples_json.load_document(b"xx" + raw + b"yy", 2, 2 + len(raw)) == document
    assert samples_json.load_document(b" " + raw, 0) is None  # json.loads would skip the space: the plain parser does
