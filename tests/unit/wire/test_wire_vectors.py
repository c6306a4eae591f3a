"""The golden wire vectors (tests/vectors) hold both ways, so a client in another language can trust them.

Everything here reads the files, never the generator's samples: decode ``value.bin`` and compare with
``decoded.json`` field by field (floats bit for bit, 1 told from 1.0), build the sample from the JSON
alone and encode it back to the same bytes, and check keys, headers and partitions the same way.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from kafka.partitioner.default import murmur2 as kafka_python_murmur2

from rollout_bus.wire.codec import CodecError, decode_samples, encode_samples
from rollout_bus.model.sample import get_rollout_key
from rollout_bus.wire.partitioning import murmur2, partition_for
from rollout_bus.wire.control_records import END_OF_RUN_KEY, EndOfRun
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.wire.rollout_key import parse_rollout_key
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.wire.rollout_key import rollout_key_string
from tests.vectors import make_vectors

VECTORS = Path(__file__).resolve().parents[2] / "vectors"
NAMES = sorted(p.name.removesuffix(".decoded.json") for p in VECTORS.glob("*.decoded.json"))
PARTITIONS = json.loads((VECTORS / "partitions.json").read_text("utf-8"))
# The wire dtype of every token-aligned tensor field (WIRE.md section 4.3); the mask's parts below.
ARRAY_DTYPES = {"tokens": "<i8", "loss_mask": "u1", "rollout_log_probs": "<f8", "rollout_token_versions": "<i8"}
MASK_DTYPES = {"flat_ids": "<i4", "offsets": "<i8"}


def load(name: str) -> tuple[bytes, list[tuple[str, bytes]], bytes, dict[str, Any]]:
    """(key, headers, value, decoded) of one vector, from its files only."""
    key = (VECTORS / f"{name}.key").read_bytes()
    headers = [(k, v.encode("ascii")) for k, v in json.loads((VECTORS / f"{name}.headers.json").read_text("utf-8"))]
    value = (VECTORS / f"{name}.value.bin").read_bytes()
    decoded = json.loads((VECTORS / f"{name}.decoded.json").read_text("utf-8"))
    return key, headers, value, decoded


TURNS = [n for n in NAMES if load(n)[3]["record"] == "turn"]
CONTROLS = [n for n in NAMES if load(n)[3]["record"] == "end-of-run"]


# ----------------------------------------------------------------------------- comparing

def same(want: Any, got: Any, where: str, problems: list[str]) -> None:
    """JSON equality that tells 1 from 1.0 from True (each spells differently on the wire) and
    compares floats bit for bit."""
    if type(want) is not type(got):
        problems.append(f"{where}: expected {want!r} ({type(want).__name__}), got {got!r} ({type(got).__name__})")
    elif isinstance(want, float):
        if struct.pack("<d", want) != struct.pack("<d", got):
            problems.append(f"{where}: expected {want!r}, got {got!r} (float64 bits differ)")
    elif isinstance(want, dict):
        if sorted(want) != sorted(got):
            problems.append(f"{where}: expected keys {sorted(want)}, got {sorted(got)}")
        for k in want.keys() & got.keys():
            same(want[k], got[k], f"{where}.{k}", problems)
    elif isinstance(want, list):
        if len(want) != len(got):
            problems.append(f"{where}: expected {len(want)} items, got {len(got)}")
        for i, (w, g) in enumerate(zip(want, got)):
            same(w, g, f"{where}[{i}]", problems)
    elif want != got:
        problems.append(f"{where}: expected {want!r}, got {got!r}")


def same_array(want: list | None, got: Any, dtype: str, where: str, problems: list[str]) -> None:
    """A decoded tensor: None for null, else a 1-D array of exactly the wire dtype holding ``want``."""
    if want is None or got is None:
        if not (want is None and got is None):
            problems.append(f"{where}: expected {want!r}, got {got!r}")
    elif not (isinstance(got, np.ndarray) and got.ndim == 1 and got.dtype == np.dtype(dtype)):
        problems.append(f"{where}: expected a 1-D {np.dtype(dtype)} array, got {type(got).__name__} "
                        f"{getattr(got, 'dtype', '')}")
    else:
        same(want, got.tolist(), where, problems)


def sample_differences(want: dict[str, Any], sample: Sample, where: str = "sample 0") -> list[str]:
    """Every way ``sample`` differs from its decoded.json entry; empty when it is exactly that."""
    problems: list[str] = []
    names = [f.name for f in fields(Sample)]
    if list(want) != names:
        problems.append(f"{where}: decoded.json has fields {list(want)}, Sample has {names}")
    for name in (n for n in names if n in want):
        expected, got, at = want[name], getattr(sample, name), f"{where}.{name}"
        if name in ARRAY_DTYPES:
            same_array(expected, got, ARRAY_DTYPES[name], at, problems)
        elif name == "rollout_sampling_mask":
            if expected is None or got is None:
                same(expected, got, at, problems)
            else:
                same(sorted(expected), sorted(MASK_DTYPES), f"{at} keys", problems)
                for part, arr in zip(("flat_ids", "offsets"), got.as_arrays()):
                    same_array(expected.get(part), arr, MASK_DTYPES[part], f"{at}.{part}", problems)
        elif name == "adapter":
            if got is not None and not isinstance(got, AdapterRef):
                problems.append(f"{at}: expected an AdapterRef, got {type(got).__name__}")
            same(expected, None if got is None else [got.name, got.slot], at, problems)
        elif name == "status":
            same(expected, got.value if isinstance(got, Status) else got, at, problems)
        else:
            same(expected, got, at, problems)
    return problems


def sample_from_json(doc: dict[str, Any]) -> Sample:
    """A Sample from plain decoded.json values only: lists stay lists, the codec picks the wire dtypes."""
    kwargs = dict(doc)
    if kwargs["rollout_sampling_mask"] is not None:
        kwargs["rollout_sampling_mask"] = RolloutSamplingMask(kwargs["rollout_sampling_mask"]["flat_ids"],
                                                              kwargs["rollout_sampling_mask"]["offsets"])
    if kwargs["adapter"] is not None:
        kwargs["adapter"] = AdapterRef(*kwargs["adapter"])
    kwargs["status"] = Status(kwargs["status"])
    return Sample(**kwargs)


def first_difference(got: bytes, want: bytes) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"{len(got)} bytes vs {len(want)}, first difference at byte {at}: {got[at:at + 24]!r} vs " \
           f"{want[at:at + 24]!r}"


def tensor_span(value: bytes, name: str) -> tuple[int, int]:
    """Absolute byte range of one tensor's data, read from the safetensors header by hand."""
    header_len = int.from_bytes(value[:8], "little")
    begin, end = json.loads(value[8:8 + header_len])[name]["data_offsets"]
    return 8 + header_len + begin, 8 + header_len + end


# ----------------------------------------------------------------------------- the set of vectors

def test_the_vectors_cover_the_format():
    samples = {n: load(n)[3]["value"]["samples"][0] for n in TURNS}
    assert len(NAMES) >= 5 and CONTROLS == ["06-end-of-run"]
    for name in NAMES:
        for suffix in make_vectors.SUFFIXES:
            assert (VECTORS / f"{name}{suffix}").is_file(), f"{name}{suffix}"
        assert (VECTORS / f"{name}.value.bin").stat().st_size < 4096, "keep the vectors small enough to read"
    assert sorted(PARTITIONS["vectors"]) == NAMES

    def singleton_rows(s):
        offsets = s["rollout_sampling_mask"]["offsets"]
        return sum(b - a == 1 for a, b in zip(offsets, offsets[1:]))

    assert any(s["adapter"] is None and s["rollout_sampling_mask"] and singleton_rows(s) >= 2
               for s in samples.values())
    assert any(load(n)[3]["headers"]["final"] and load(n)[3]["headers"]["turn"] > 0 and samples[n]["adapter"]
               for n in TURNS)
    assert any(s["rollout_log_probs"] and s["rollout_token_versions"] for s in samples.values())
    assert any(all(s[f] is None for f in ("loss_mask", "rollout_log_probs", "rollout_sampling_mask",
                                          "rollout_token_versions", "adapter", "reward", "rollout_id"))
               for s in samples.values())
    assert any(s["adapter"] and not s["adapter"][0].isascii() for s in samples.values())
    rewards = [s["reward"] for s in samples.values()]
    assert {type(r) for r in rewards} >= {float, int, dict, type(None)}, "each reward type spells differently"


# ----------------------------------------------------------------------------- (a) decode

@pytest.mark.parametrize("name", TURNS)
def test_decoding_a_turn_value_gives_exactly_its_decoded_json(name):
    _, _, value, decoded = load(name)
    assert decoded["value"]["fields"] == list(TURN_FIELDS)
    samples, metadata = decode_samples(value, decoded["value"]["fields"])
    problems: list[str] = []
    same(decoded["value"]["metadata"], metadata, "metadata", problems)
    same(len(decoded["value"]["samples"]), len(samples), "number of samples", problems)
    for i, (want, got) in enumerate(zip(decoded["value"]["samples"], samples)):
        problems += sample_differences(want, got, f"sample {i}")
    assert problems == []


@pytest.mark.parametrize("name", TURNS)
def test_a_plain_safetensors_reader_and_a_json_parser_find_the_decoded_json(name):
    """What another language does without our codec: the reference safetensors loader, then JSON."""
    _, _, value, decoded = load(name)
    tensors = safetensors.numpy.load(value)
    document = json.loads(tensors.pop("_samples_meta").tobytes().decode("utf-8"))
    assert document["metadata"] == decoded["value"]["metadata"]
    problems: list[str] = []
    for i, (want, entry) in enumerate(zip(decoded["value"]["samples"], document["samples"], strict=True)):
        nulls = [f for f in ("loss_mask", "rollout_log_probs", "rollout_sampling_mask") if want[f] is None]
        same(nulls, entry.pop("nulls"), f"sample {i}.nulls", problems)  # token versions: absent, never listed
        same({k: v for k, v in want.items() if k not in ARRAY_DTYPES and k != "rollout_sampling_mask"}, entry,
             f"sample {i}", problems)
        for field_name, dtype in ARRAY_DTYPES.items():
            if want[field_name] is not None:
                same_array(want[field_name], tensors.pop(f"{field_name}.{i}"), dtype, f"sample {i}.{field_name}",
                           problems)
        if want["rollout_sampling_mask"] is not None:
            for part, wire in (("flat_ids", "ids"), ("offsets", "offsets")):
                same_array(want["rollout_sampling_mask"][part], tensors.pop(f"rollout_sampling_mask.{wire}.{i}"),
                           MASK_DTYPES[part], f"sample {i}.rollout_sampling_mask.{part}", problems)
    assert problems == [] and tensors == {}


@pytest.mark.parametrize("name", TURNS)
def test_a_turn_key_parses_back_to_the_rollout_key_of_its_value(name):
    key, _, value, decoded = load(name)
    parts = decoded["key"]
    adapter = AdapterRef(*parts["adapter"]) if parts["adapter"] is not None else None
    expected = (adapter, parts["kind"], parts["group_index"], parts["id"])
    assert key.isascii()
    assert parse_rollout_key(key) == expected
    assert get_rollout_key(decode_samples(value, TURN_FIELDS)[0][0], 0) == expected


@pytest.mark.parametrize("name", TURNS)
def test_turn_headers_parse_to_their_decoded_json(name):
    _, headers, _, decoded = load(name)
    assert TurnHeaders.from_kafka(headers) == TurnHeaders(**decoded["headers"])
    assert control_kind(headers) is None


# ----------------------------------------------------------------------------- (b) encode

@pytest.mark.parametrize("name", TURNS)
def test_encoding_the_decoded_json_gives_exactly_the_value_bytes(name):
    _, _, value, decoded = load(name)
    samples = [sample_from_json(s) for s in decoded["value"]["samples"]]
    encoded = encode_samples(samples, decoded["value"]["fields"], metadata=decoded["value"]["metadata"])
    assert encoded == value, first_difference(encoded, value)


@pytest.mark.parametrize("name", TURNS)
def test_the_key_and_headers_built_from_decoded_json_are_the_files(name):
    key, headers, _, decoded = load(name)
    parts = decoded["key"]
    adapter = AdapterRef(*parts["adapter"]) if parts["adapter"] is not None else None
    assert rollout_key_string((adapter, parts["kind"], parts["group_index"], parts["id"])).encode() == key
    assert TurnHeaders(**decoded["headers"]).to_kafka() == headers


@pytest.mark.parametrize("name", CONTROLS)
def test_the_end_of_run_record_both_ways(name):
    key, headers, value, decoded = load(name)
    marker = EndOfRun(**decoded["value"])
    assert key == END_OF_RUN_KEY == decoded["key"].encode()
    assert control_kind(headers) == decoded["headers"]["control"] == "end-of-run"
    assert [(k, v.decode()) for k, v in headers] == list(decoded["headers"].items())
    assert EndOfRun.from_value(value) == marker
    assert marker.value() == value and marker.headers() == headers
    with pytest.raises(CodecError):  # a control record is no samples payload
        decode_samples(value, TURN_FIELDS)


# ----------------------------------------------------------------------------- (c) partitions

@pytest.mark.parametrize("name", NAMES)
def test_partitions_are_kafkas_default_partitioner(name):
    key = load(name)[0]
    entry = PARTITIONS["vectors"][name]
    assert entry["key"].encode("ascii") == key
    assert murmur2(key) == kafka_python_murmur2(key) == entry["murmur2_u32"]
    assert entry["murmur2_java_int"] == struct.unpack("<i", struct.pack("<I", entry["murmur2_u32"]))[0]
    assert sorted(map(int, entry["partitions"])) == sorted(PARTITIONS["counts"]) == [1, 4, 6, 12]
    for count, partition in entry["partitions"].items():
        n = int(count)
        assert partition_for(key, n) == (kafka_python_murmur2(key) & 0x7FFFFFFF) % n == partition


# ----------------------------------------------------------------------------- (d) the files are current

def test_the_vector_files_are_what_the_generator_writes(capsys):
    assert make_vectors.check(VECTORS, make_vectors.render(make_vectors.build_vectors())) == []
    assert make_vectors.main([]) == 0
    assert "up to date" in capsys.readouterr().out


def test_the_generator_runs_as_a_script_and_checks_by_default():
    done = subprocess.run([sys.executable, str(VECTORS / "make_vectors.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "up to date" in done.stdout


def test_the_generator_writes_only_when_told_and_names_what_is_stale(tmp_path, capsys):
    assert make_vectors.main(["--dir", str(tmp_path)]) == 1
    assert list(tmp_path.iterdir()) == [], "check mode must not write"
    assert "missing    01-first-turn-mask.value.bin" in capsys.readouterr().out
    assert make_vectors.main(["--write", "--dir", str(tmp_path)]) == 0
    assert make_vectors.main(["--dir", str(tmp_path)]) == 0
    stale = tmp_path / "02-final-turn-adapter.value.bin"
    stale.write_bytes(stale.read_bytes()[:100] + b"!" + stale.read_bytes()[101:])
    (tmp_path / "99-gone.key").write_bytes(b"x")
    capsys.readouterr()
    assert make_vectors.main(["--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "differs    02-final-turn-adapter.value.bin" in out and "first difference at byte 100" in out
    assert "unexpected 99-gone.key" in out


# ----------------------------------------------------------------------------- the checks can fail

def test_one_flipped_data_byte_is_caught_both_ways():
    _, _, value, decoded = load("03-logprobs-token-versions")
    begin, _ = tensor_span(value, "rollout_log_probs.0")
    mutated = bytearray(value)
    mutated[begin + 8 + 3] ^= 0x01  # a low mantissa bit of rollout_log_probs[1]
    samples, _ = decode_samples(bytes(mutated), TURN_FIELDS)
    problems = sample_differences(decoded["value"]["samples"][0], samples[0])
    assert len(problems) == 1 and problems[0].startswith("sample 0.rollout_log_probs[1]: expected -0.1")
    rebuilt = encode_samples([sample_from_json(s) for s in decoded["value"]["samples"]], TURN_FIELDS)
    assert rebuilt != bytes(mutated) and rebuilt == value


def test_an_int_reward_is_not_a_float_reward():
    _, _, value, decoded = load("05-unicode-adapter")
    entry = dict(decoded["value"]["samples"][0], reward=float(decoded["value"]["samples"][0]["reward"]))
    assert sample_differences(entry, decode_samples(value, TURN_FIELDS)[0][0]) == [
        "sample 0.reward: expected 0.0 (float), got 0 (int)"]
    assert encode_samples([sample_from_json(entry)], TURN_FIELDS) != value


def _retype_ids(value: bytes) -> bytes:
    name = b'"rollout_sampling_mask.ids.0":{"dtype":'
    return value.replace(name + b'"I32"', name + b'"U32"')


def _loss_mask_two(value: bytes) -> bytes:
    begin, _ = tensor_span(value, "loss_mask.0")
    return value[:begin] + b"\x02" + value[begin + 1:]


def _offsets_fall(value: bytes) -> bytes:
    begin, _ = tensor_span(value, "rollout_sampling_mask.offsets.0")
    return value[:begin + 8] + (0).to_bytes(8, "little") + value[begin + 16:]


@pytest.mark.parametrize("mutate, message", [
    pytest.param(lambda v: v[:-1], "tensor _samples_meta data_offsets' must be [begin, end] within [0, 611]",
                 id="truncated"),
    pytest.param(_retype_ids, "tensor rollout_sampling_mask.ids.0 dtype' must be I32 (got 'U32')", id="ids-dtype"),
    pytest.param(_loss_mask_two, "'loss_mask[0]' must be <= 1 (got 2)", id="loss-mask-2"),
    pytest.param(_offsets_fall, "rollout_sampling_mask.offsets' must be strictly increasing", id="empty-support"),
    pytest.param(lambda v: v.replace(b'"status":"completed"', b'"status":"COMPLETED"'), "'status' must be one of",
                 id="status"),
    pytest.param(lambda v: v.replace(b'"response_length":7', b'"response_length":8'), "response_length=8",
                 id="length"),
])
def test_a_broken_vector_is_refused_with_what_is_wrong(mutate, message):
    value = load("01-first-turn-mask")[2]
    broken = mutate(value)
    assert broken != value
    with pytest.raises(CodecError) as raised:
        decode_samples(broken, TURN_FIELDS)
    assert message in str(raised.value)
