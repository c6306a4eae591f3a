"""The wire codec: round trips, byte identity, determinism, and every malformed payload refused."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.wire import codec, sample_fields, samples_json
from rollout_bus.wire.codec import (
    COMPUTED_FIELDS,
    SAMPLING_MASK_FIELDS,
    CodecError,
    decode_samples,
    encode_samples,
)
from rollout_bus.errors import CodecError as ErrorsCodecError
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask

ALL = COMPUTED_FIELDS + SAMPLING_MASK_FIELDS


def make_sample(**overrides) -> Sample:
    fields = dict(
        group_index=3, index=7, rollout_id=11, prompt=[{"role": "user", "content": "2+2?"}],
        tokens=[101, 102, 103, 4, 5, 6], response="4", response_length=3, label="4",
        reward=1.0, loss_mask=[1, 0, 1], weight_versions=["5", "6"], rollout_log_probs=[-0.5, 0.0, -1.25],
        rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[4, 9], [5], [6, 7, 8]]),
        remove_sample=False, status=Status.COMPLETED, metadata={"turn": 1, "tools": ["calc"]},
        adapter=AdapterRef("math", 2), rollout_token_versions=[5, -1, 6],
    )
    fields.update(overrides)
    return Sample(**fields)


# ---------------------------------------------------------------- round trips

def test_a_sample_with_every_field_round_trips_with_the_mask_fields():
    sample = make_sample()
    (out,), meta = decode_samples(encode_samples([sample], ALL, {"batch": 9}), ALL)
    assert out == sample
    assert meta == {"batch": 9}
    assert out.rollout_sampling_mask == sample.rollout_sampling_mask
    assert out.status is Status.COMPLETED and out.adapter == AdapterRef("math", 2)


def test_decoded_token_fields_are_read_only_numpy_arrays_of_the_wire_dtypes():
    (out,), _ = decode_samples(encode_samples([make_sample()], ALL), ALL)
    for name, dtype in (("tokens", np.int64), ("loss_mask", np.uint8), ("rollout_log_probs", np.float64)):
        arr = getattr(out, name)
        assert isinstance(arr, np.ndarray) and arr.dtype == dtype and arr.ndim == 1
        assert not arr.flags.writeable
    ids, offsets = out.rollout_sampling_mask.as_arrays()
    assert ids.dtype == np.int32 and offsets.dtype == np.int64


def test_the_default_fields_leave_the_mask_out():
    (out,), _ = decode_samples(encode_samples([make_sample()]))
    assert out.rollout_sampling_mask is None
    assert list(out.tokens) == [101, 102, 103, 4, 5, 6]


def test_none_fields_travel_as_null_markers():
    sample = make_sample(loss_mask=None, rollout_log_probs=None, rollout_sampling_mask=None, reward=None,
                         adapter=None, label=None, group_index=None)
    (out,), _ = decode_samples(encode_samples([sample], ALL), ALL)
    assert out == sample and out.loss_mask is None and out.rollout_sampling_mask is None


def test_an_empty_batch_round_trips_its_metadata():
    assert decode_samples(encode_samples([], ALL, {"reason": "none"}), ALL) == ([], {"reason": "none"})
    assert decode_samples(encode_samples([])) == ([], {})


def test_several_samples_keep_their_own_tensors_in_order():
    a = make_sample(index=1)
    b = make_sample(index=2, tokens=[9, 8, 7, 6, 5, 4, 3], response_length=4, loss_mask=[0, 0, 1, 1],
                    rollout_log_probs=[-1.0, -2.0, -3.0, -4.0], rollout_token_versions=[2, 2, 3, 3],
                    rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[1], [2], [3], [4, 5]]))
    out, _ = decode_samples(encode_samples([a, b], ALL), ALL)
    assert out == [a, b]


def test_nan_and_infinite_log_probs_and_a_dict_reward_round_trip():
    sample = make_sample(rollout_log_probs=[float("nan"), float("-inf"), -0.0], reward={"acc": 1, "fmt": 0.5})
    (out,), _ = decode_samples(encode_samples([sample]))
    assert math.isnan(out.rollout_log_probs[0]) and out.rollout_log_probs[1] == float("-inf")
    assert out.reward == {"acc": 1, "fmt": 0.5}


def test_numpy_and_torch_inputs_encode_like_lists():
    torch = pytest.importorskip("torch")
    as_lists = make_sample()
    as_arrays = make_sample(tokens=np.array([101, 102, 103, 4, 5, 6], dtype=np.int32),
                            loss_mask=torch.tensor([1, 0, 1]), rollout_log_probs=np.array([-0.5, 0.0, -1.25]))
    assert encode_samples([as_arrays], ALL) == encode_samples([as_lists], ALL)


def test_the_payload_is_plain_safetensors_with_the_contract_names():
    tensors = safetensors.numpy.load(encode_samples([make_sample()], ALL))
    assert {name: str(arr.dtype) for name, arr in tensors.items()} == {
        "tokens.0": "int64", "loss_mask.0": "uint8", "rollout_log_probs.0": "float64",
        "rollout_token_versions.0": "int64",
        "rollout_sampling_mask.ids.0": "int32", "rollout_sampling_mask.offsets.0": "int64",
        "_samples_meta": "uint8",
    }
    meta = json.loads(tensors["_samples_meta"].tobytes())
    assert meta["samples"][0]["status"] == "completed" and meta["samples"][0]["nulls"] == []


def test_decoding_a_bytearray_copies_it_so_later_writes_change_nothing():
    buffer = bytearray(encode_samples([make_sample()]))
    (out,), _ = decode_samples(buffer)
    buffer[:] = bytes(len(buffer))
    assert list(out.tokens) == [101, 102, 103, 4, 5, 6]


def test_codec_error_is_the_errors_module_class_and_a_value_error():
    assert CodecError is ErrorsCodecError and issubclass(CodecError, ValueError)


# ---------------------------------------------------------------- bytes

def test_the_default_payload_of_a_sample_with_a_mask_is_byte_identical_to_one_without():
    with_mask, without = make_sample(), make_sample(rollout_sampling_mask=None)
    assert encode_samples([with_mask]) == encode_samples([without])
    assert encode_samples([with_mask], ALL) != encode_samples([without], ALL)


def test_the_same_samples_always_give_the_same_bytes():
    first = encode_samples([make_sample(metadata={"b": 1, "a": {"y": 2, "x": 3}})], ALL, {"k": 1, "j": 2})
    again = encode_samples([make_sample(metadata={"a": {"x": 3, "y": 2}, "b": 1})], ALL, {"j": 2, "k": 1})
    assert first == again


def test_the_order_of_fields_does_not_change_the_bytes():
    sample = make_sample()
    assert encode_samples([sample], tuple(reversed(ALL))) == encode_samples([sample], ALL)


def test_tensor_data_is_aligned_to_its_dtype():
    payload = encode_samples([make_sample()], ALL)
    start = 8 + int.from_bytes(payload[:8], "little")
    assert start % 8 == 0
    header = json.loads(payload[8:start])
    for info in header.values():
        itemsize = {"I64": 8, "F64": 8, "I32": 4, "U8": 1}[info["dtype"]]
        assert info["data_offsets"][0] % itemsize == 0


# ---------------------------------------------------------------- encode refuses

@pytest.mark.parametrize(("overrides", "fragment"), [
    pytest.param({"loss_mask": [1, 2, 0]}, "'loss_mask[1]' must be <= 1", id="loss-mask-2"),
    pytest.param({"loss_mask": [1, -1, 0]}, "'loss_mask[1]' must be a value that fits uint8", id="loss-mask-neg"),
    pytest.param({"tokens": [1, 2, 3, 2**63, 5, 6]}, "tokens", id="token-beyond-int64"),
    pytest.param({"tokens": [1, 2, 3, 4.5, 5, 6]}, "'tokens[3]' must be a value that fits int64", id="float-token"),
    pytest.param({"tokens": np.zeros((6, 1), dtype=np.int64)}, "one-dimensional", id="2d-tokens"),
    pytest.param({"rollout_log_probs": ["a", "b", "c"]}, "rollout_log_probs", id="str-log-probs"),
    pytest.param({"loss_mask": [1, 1]}, "'len(loss_mask)' must be response_length=3 (got 2)", id="length-mismatch"),
    pytest.param({"tokens": None, "response_length": 0, "loss_mask": None, "rollout_log_probs": None,
                  "rollout_sampling_mask": None}, "'tokens' must be present", id="tokens-none"),
    pytest.param({"reward": "high"}, "'reward' must be a float", id="str-reward"),
    pytest.param({"reward": True}, "'reward' must be a float", id="bool-reward"),
    pytest.param({"group_index": "3"}, "'group_index' must be an integer", id="str-group-index"),
    pytest.param({"metadata": {1: "x"}}, "'metadata keys' must be str", id="int-metadata-key"),
    pytest.param({"metadata": {"x": (1, 2)}}, "JSON-native", id="tuple-in-metadata"),
    pytest.param({"metadata": {"x": np.int64(3)}}, "JSON-native", id="numpy-in-metadata"),
    pytest.param({"metadata": {"x": {1, 2}}}, "JSON-native", id="set-in-metadata"),
    pytest.param({"prompt": [{"role": "user"}, "loose text"]}, "'prompt' must be a str or a list of dicts",
                 id="prompt-mixed"),
    pytest.param({"weight_versions": [1, 2]}, "weight_versions", id="int-versions"),
    pytest.param({"adapter": ("math", 2)}, "AdapterRef", id="tuple-adapter"),
    pytest.param({"remove_sample": 1}, "remove_sample", id="int-remove-sample"),
])
def test_encode_refuses_values_that_do_not_fit_naming_the_position_and_field(overrides, fragment):
    bad = make_sample(**overrides)
    with pytest.raises(CodecError, match="sample 1|position 1") as info:
        encode_samples([make_sample(), bad], ALL)
    assert fragment in str(info.value)


def test_encode_refuses_circular_metadata():
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(CodecError, match="circular"):
        encode_samples([make_sample(metadata=loop)])


@pytest.mark.parametrize(("call", "fragment"), [
    pytest.param(lambda: encode_samples([object()]), "a Sample", id="not-a-sample"),
    pytest.param(lambda: encode_samples([make_sample()], ("tokens", "bogus")), "fields", id="unknown-field"),
    pytest.param(lambda: encode_samples([make_sample()], ("tokens", "tokens")), "fields", id="duplicate-field"),
    pytest.param(lambda: encode_samples([make_sample()], "tokens"), "fields", id="fields-as-str"),
    pytest.param(lambda: encode_samples([make_sample()], metadata=[1]), "'metadata' must be a dict", id="metadata"),
    pytest.param(lambda: decode_samples("text"), "'payload' must be bytes", id="str-payload"),
])
def test_bad_arguments_raise_codec_error(call, fragment):
    with pytest.raises(CodecError, match=fragment):
        call()


def test_encode_refuses_a_payload_over_the_cap(monkeypatch):
    monkeypatch.setattr(codec, "MAX_PAYLOAD_BYTES", 100)
    with pytest.raises(CodecError, match="<= 100 bytes"):
        encode_samples([make_sample()])


# ---------------------------------------------------------------- decode refuses

def _repack(mutate):
    """A valid mask-carrying payload re-packed after ``mutate(meta, tensors)``."""
    tensors = safetensors.numpy.load(encode_samples([make_sample()], ALL, {"m": 1}))
    meta = json.loads(tensors.pop("_samples_meta").tobytes())
    replaced = mutate(meta, tensors)
    meta = replaced if isinstance(replaced, (dict, list, bytes)) else meta
    raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    tensors["_samples_meta"] = np.frombuffer(raw, dtype=np.uint8)
    return safetensors.numpy.save(tensors)


def _entry(mutate):
    """Mutate the first sample's metadata entry."""
    return _repack(lambda meta, tensors: mutate(meta["samples"][0]))


def _tensor(name, value):
    return _repack(lambda meta, tensors: tensors.__setitem__(name, value))


def _header(mutate, pad_data=b""):
    """A valid payload with its safetensors header JSON rewritten by ``mutate(header)``."""
    payload = encode_samples([make_sample()], ALL)
    start = 8 + int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8:start])
    replaced = mutate(header)
    raw = replaced if isinstance(replaced, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + payload[start:] + pad_data


def _shift(header, name, delta):
    header[name]["data_offsets"] = [o + delta for o in header[name]["data_offsets"]]


VALID = encode_samples([make_sample()], ALL)
MALFORMED = [
    pytest.param(_tensor("rollout_sampling_mask.ids.0", np.array([4, 9, 5, 6, 7, 8], dtype=np.int64)),
                 "rollout_sampling_mask.ids.0 dtype' must be I32", id="mask-ids-int64"),
    pytest.param(_tensor("rollout_log_probs.0", np.zeros(3, dtype=np.float32)), "must be F64", id="f32-log-probs"),
    pytest.param(_tensor("tokens.0", np.zeros((2, 3), dtype=np.int64)), "rank' must be 1", id="rank-2-tokens"),
    pytest.param(_repack(lambda m, t: t.pop("loss_mask.0")), "missing tensor 'loss_mask.0'", id="missing-tensor"),
    pytest.param(_repack(lambda m, t: t.__setitem__("extra.0", np.zeros(1))), "unreferenced", id="extra-tensor"),
    pytest.param(_tensor("loss_mask.0", np.array([1, 2, 1], dtype=np.uint8)), "'loss_mask[1]' must be <= 1",
                 id="loss-mask-2"),
    pytest.param(_tensor("rollout_sampling_mask.ids.0", np.array([4, -9, 5, 6, 7, 8], dtype=np.int32)),
                 "'rollout_sampling_mask.ids[1]' must be >= 0", id="negative-mask-id"),
    pytest.param(_tensor("rollout_sampling_mask.offsets.0", np.array([1, 2, 3, 6])), "offsets[0]' must be 0",
                 id="offsets-not-at-0"),
    pytest.param(_tensor("rollout_sampling_mask.offsets.0", np.array([0, 2, 2, 6])), "strictly increasing",
                 id="empty-support"),
    pytest.param(_tensor("rollout_sampling_mask.offsets.0", np.array([0, 2, 3, 5])), "offsets[-1]' must be len",
                 id="offsets-short-of-ids"),
    pytest.param(_tensor("rollout_sampling_mask.offsets.0", np.array([0, 6])), "inconsistent", id="mask-too-short"),
    pytest.param(_tensor("loss_mask.0", np.ones(4, dtype=np.uint8)), "inconsistent", id="loss-mask-too-long"),
    pytest.param(_entry(lambda e: e.update(response_length=7)), "inconsistent", id="response-length-too-long"),
    pytest.param(_entry(lambda e: e.update(response_length=-1)), "inconsistent", id="negative-response-length"),
    pytest.param(_repack(lambda m, t: b"x"), "not valid UTF-8 JSON", id="meta-not-json"),
    pytest.param(_repack(lambda m, t: b"\xff\xfe"), "not valid UTF-8", id="meta-not-utf8"),
    pytest.param(_repack(lambda m, t: b"[]"), "keys metadata, samples", id="meta-a-list"),
    pytest.param(_repack(lambda m, t: {"samples": m["samples"]}), "keys metadata, samples", id="meta-no-metadata"),
    pytest.param(_repack(lambda m, t: {"metadata": [], "samples": m["samples"]}), "'metadata' must be a dict",
                 id="metadata-a-list"),
    pytest.param(_repack(lambda m, t: {"metadata": {}, "samples": {}}), "samples' must be a list",
                 id="samples-a-dict"),
    pytest.param(_repack(lambda m, t: {"metadata": {}, "samples": [1]}), "entry' must be an object",
                 id="sample-entry-an-int"),
    pytest.param(_entry(lambda e: e.pop("status")), "entry' must be an object with keys", id="missing-key"),
    pytest.param(_entry(lambda e: e.update(surprise=1)), "entry' must be an object with keys", id="extra-key"),
    pytest.param(_entry(lambda e: e.update(group_index="3")), "'group_index' must be an integer",
                 id="str-group-index"),
    pytest.param(_entry(lambda e: e.update(index=True)), "'index' must be an integer", id="bool-index"),
    pytest.param(_entry(lambda e: e.update(status="done")), "'status' must be one of", id="unknown-status"),
    pytest.param(_entry(lambda e: e.update(adapter=["math"])), "'adapter' must be", id="adapter-short"),
    pytest.param(_entry(lambda e: e.update(reward="high")), "'reward' must be", id="str-reward"),
    pytest.param(_entry(lambda e: e.update(weight_versions="5")), "weight_versions", id="versions-a-str"),
    pytest.param(_entry(lambda e: e.update(prompt=5)), "'prompt' must be", id="int-prompt"),
    pytest.param(_entry(lambda e: e.update(metadata=[])), "'metadata' must be a dict", id="sample-metadata-list"),
    pytest.param(_entry(lambda e: e.update(remove_sample=0)), "remove_sample", id="int-remove-sample"),
    pytest.param(_entry(lambda e: e.update(nulls=["tokens"])), "'nulls' must be distinct names", id="null-tokens"),
    pytest.param(_entry(lambda e: e.update(nulls="loss_mask")), "'nulls' must be", id="nulls-a-str"),
    pytest.param(_entry(lambda e: e.update(nulls=["loss_mask"])), "unreferenced tensors ['loss_mask.0']",
                 id="null-but-sent"),
    pytest.param(safetensors.numpy.save({"tokens.0": np.zeros(1, dtype=np.int64)}),
                 "missing tensor '_samples_meta'", id="no-meta-tensor"),
    pytest.param(safetensors.numpy.save({"_samples_meta": np.frombuffer(b'{"metadata":{},"samples":[]}',
                                                                          dtype=np.int8)}),
                 "_samples_meta dtype' must be U8", id="meta-tensor-int8"),
    pytest.param(b"", "truncated payload: 0 bytes", id="empty"),
    pytest.param(VALID[:5], "truncated payload", id="cut-in-length"),
    pytest.param(VALID[:40], "truncated payload: a header", id="cut-in-header"),
    pytest.param(VALID[:-1], "data_offsets", id="cut-in-data"),
    pytest.param((2**40).to_bytes(8, "little") + VALID[8:], "max_header_bytes", id="header-length-huge"),
    pytest.param((2**64 - 1).to_bytes(8, "little"), "max_header_bytes", id="header-length-max"),
    pytest.param(_header(lambda h: b"{not json}"), "safetensors header is not valid", id="header-not-json"),
    pytest.param(_header(lambda h: b"[1, 2]"), "a JSON object", id="header-a-list"),
    pytest.param(_header(lambda h: h["tokens.0"].update(dtype="Q9")), "a safetensors dtype", id="unknown-dtype"),
    pytest.param(_header(lambda h: h["tokens.0"].update(shape=[-6])), "shape", id="negative-shape"),
    pytest.param(_header(lambda h: h["tokens.0"].update(shape=[True])), "shape", id="bool-shape"),
    pytest.param(_header(lambda h: h["tokens.0"].update(shape=[5])), "byte length", id="shape-vs-bytes"),
    pytest.param(_header(lambda h: h["tokens.0"].pop("shape")), "an object of dtype", id="entry-no-shape"),
    pytest.param(_header(lambda h: h["tokens.0"].update(data_offsets=[0, 10**9])), "data_offsets",
                 id="offsets-out-of-range"),
    pytest.param(_header(lambda h: h["tokens.0"].update(data_offsets=[8, 0])), "data_offsets", id="offsets-reversed"),
    pytest.param(_header(lambda h: h["tokens.0"].update(data_offsets="0-48")), "data_offsets", id="offsets-a-str"),
    pytest.param(_header(lambda h: h["loss_mask.0"].update(data_offsets=[0, 3])), "overlaps", id="overlapping-data"),
    pytest.param(_header(lambda h: _shift(h, "tokens.0", 8)), "gap after byte 0", id="shifted-data"),
    pytest.param(_header(lambda h: h.pop("loss_mask.0")), "gap", id="gap-in-data"),
    pytest.param(_header(lambda h: None, pad_data=b"\0" * 8), "after the last tensor", id="trailing-bytes"),
    pytest.param(_header(lambda h: h.update(__metadata__={"a": 1})), "__metadata__", id="bad-st-metadata"),
    pytest.param(_header(lambda h: h.update(x=5)), "header entry 'x'", id="entry-an-int"),
]


@pytest.mark.parametrize(("payload", "fragment"), MALFORMED)
def test_decode_refuses_a_malformed_payload_saying_what(payload, fragment):
    with pytest.raises(CodecError) as info:
        decode_samples(payload, ALL)
    assert fragment in str(info.value)
    assert codec.INTERNAL_ERROR not in str(info.value)


def test_every_malformed_case_starts_from_a_payload_that_decodes():
    assert decode_samples(_repack(lambda meta, tensors: None), ALL)[1] == {"m": 1}
    assert decode_samples(_header(lambda header: None), ALL)[0][0] == make_sample()


def test_a_payload_with_masks_decoded_without_the_mask_fields_is_refused():
    with pytest.raises(CodecError, match="unreferenced tensors"):
        decode_samples(encode_samples([make_sample()], ALL))


def test_a_payload_without_masks_decoded_with_the_mask_fields_is_refused():
    with pytest.raises(CodecError, match="missing tensor 'rollout_sampling_mask.ids.0'"):
        decode_samples(encode_samples([make_sample()]), ALL)


def test_decode_caps_are_configurable():
    payload = encode_samples([make_sample()])
    with pytest.raises(CodecError, match="max_payload_bytes=100"):
        decode_samples(payload, max_payload_bytes=100)
    with pytest.raises(CodecError, match="max_header_bytes=16"):
        decode_samples(payload, max_header_bytes=16)
    assert decode_samples(payload, max_payload_bytes=len(payload), max_header_bytes=len(payload))[0]


# ---------------------------------------------------------------- property: against a plain model

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def samples(draw):
    n = draw(st.integers(0, 12))
    prompt_len = draw(st.integers(0, 6))
    tokens = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n + prompt_len, max_size=n + prompt_len))
    rows = draw(st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4), min_size=n, max_size=n))
    return Sample(
        group_index=draw(st.none() | st.integers()), index=draw(st.none() | st.integers(0, 10**6)),
        rollout_id=draw(st.none() | st.integers()),
        prompt=draw(st.text(max_size=10) | st.lists(st.dictionaries(st.text(max_size=4), st.text(max_size=6)),
                                                     max_size=2)),
        tokens=tokens, response=draw(st.text(max_size=10)), response_length=n,
        label=draw(st.none() | st.text(max_size=5)),
        reward=draw(st.none() | st.floats(allow_nan=False) | st.integers(-5, 5)
                    | st.dictionaries(st.text(max_size=4), json_values, max_size=3)),
        loss_mask=draw(st.none() | st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        weight_versions=draw(st.lists(st.text(max_size=3), max_size=3)),
        rollout_log_probs=draw(st.none() | st.lists(st.floats(allow_nan=False), min_size=n, max_size=n)),
        rollout_sampling_mask=draw(st.none() | st.just(RolloutSamplingMask.from_mask_list(rows))),
        remove_sample=draw(st.booleans()), status=draw(st.sampled_from(list(Status))),
        metadata=draw(st.dictionaries(st.text(max_size=4), json_values, max_size=3)),
        adapter=draw(st.none() | st.builds(AdapterRef, st.text(max_size=4), st.integers(0, 64))),
    )


def plain(sample: Sample, with_mask: bool) -> dict:
    """The model: every field as plain Python values; a mask as its rows."""
    model = {name: getattr(sample, name) for name in sample_fields.JSON_FIELDS}
    model["status"] = Status(sample.status).value
    for name in COMPUTED_FIELDS:
        value = getattr(sample, name)
        model[name] = None if value is None else [v.item() if hasattr(v, "item") else v for v in value]
    mask = sample.rollout_sampling_mask if with_mask else None
    model["rollout_sampling_mask"] = None if mask is None else [mask.row(t).tolist() for t in range(len(mask))]
    return model


@settings(max_examples=60, deadline=None)
@given(batch=st.lists(samples(), max_size=3), metadata=st.dictionaries(st.text(max_size=4), json_values, max_size=3),
       with_mask=st.booleans())
def test_random_batches_round_trip_to_the_plain_model(batch, metadata, with_mask):
    fields = ALL if with_mask else COMPUTED_FIELDS
    payload = encode_samples(batch, fields, metadata)
    out, meta = decode_samples(payload, fields)
    assert meta == metadata
    assert [plain(s, True) for s in out] == [plain(s, with_mask) for s in batch]
    assert encode_samples(out, fields, meta) == payload  # decoding loses nothing the encoder wrote


# ---------------------------------------------------------------- long texts (the fast JSON paths)

LONG = "a tool call said: 'ok' & more " * 40  # > 512 characters, written verbatim by JSON
TRICKY = ["", LONG, LONG + '"quoted"', LONG + "back\\slash", LONG + "line\nbreak\t\x00\x1f", LONG + "日本語 ü 🙂",
          LONG + "\x00\x01", "\x00\x01", LONG + '"\\u0000\\u0001"', LONG + "\x7f\u2028"]


def _meta_bytes(payload: bytes) -> bytes:
    return safetensors.numpy.load(payload)["_samples_meta"].tobytes()


@pytest.mark.parametrize("text", TRICKY)
def test_long_texts_round_trip_and_the_document_is_canonical_json(text):
    sample = make_sample(response=text, prompt=[{"role": "user", "content": text}, {"content": 5}],
                         label=text, metadata={"response": text, "note": [text]})
    payload = encode_samples([sample, make_sample(prompt=text, response=LONG)], ALL, {"response": text})
    (out, second), meta = decode_samples(payload, ALL)
    assert out == sample and second.prompt == text and meta == {"response": text}
    raw = _meta_bytes(payload)
    canonical = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert raw == canonical.encode("utf-8")


def test_a_lone_surrogate_in_a_long_text_is_refused_as_a_codec_error():
    with pytest.raises(CodecError, match="JSON"):
        encode_samples([make_sample(response=LONG + "\ud800")])


def test_long_responses_in_a_foreign_spelling_of_the_document_decode_alike():
    def respell(meta, tensors):
        meta["samples"][0].update(response=LONG, metadata={"response": LONG + "x"})
        return json.dumps(meta, indent=1).encode()  # spaces, newlines and ASCII escapes: still valid JSON

    (out,), _ = decode_samples(_repack(respell), ALL)
    assert out.response == LONG and out.metadata == {"response": LONG + "x"}


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(min_size=0, max_size=8).map(lambda t: t + LONG + t), min_size=3, max_size=3),
       spelled_plainly=st.booleans())
def test_the_fast_document_parser_agrees_with_json_loads_or_declines(texts, spelled_plainly):
    document = {"metadata": {"response": texts[0]},
                "samples": [{"response": texts[1], "prompt": [{"response": texts[2]}]}, {"response": texts[2]}]}
    raw = json.dumps(document, ensure_ascii=not spelled_plainly, separators=(",", ":")).encode()
    parsed = samples_json.load_document(raw)
    assert parsed is None or parsed == json.loads(raw)
    if spelled_plainly and all('"' not in t and "\\" not in t and t.isprintable() for t in texts):
        assert parsed is None  # a long response outside the samples makes it decline...
        del document["metadata"]["response"], document["samples"][0]["prompt"]
        raw = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
        assert samples_json.load_document(raw) == document  # ...and without one it takes the fast path


def test_a_plain_long_response_is_parsed_by_the_fast_path():
    payload = encode_samples([make_sample(response=LONG, prompt=[{"role": "user", "content": LONG}])], ALL)
    raw = _meta_bytes(payload)
    assert samples_json.load_document(raw) == json.loads(raw)
    assert decode_samples(payload, ALL)[0][0].response == LONG


def test_every_sample_field_has_exactly_one_place_on_the_wire():
    """A field added to ``Sample`` fails here until the codec's tables say how it travels (docs/architecture.md)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(Sample)}
    tensor, json_doc = set(sample_fields.TENSOR_FIELDS), set(sample_fields.JSON_FIELDS)
    assert not tensor & json_doc
    assert names == tensor | json_doc, (sorted(names - tensor - json_doc), sorted((tensor | json_doc) - names))
