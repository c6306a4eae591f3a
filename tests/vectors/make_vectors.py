"""Golden wire vectors for rollout.turns, rollout.prompts and rollout.prompt_ledger: built from code here, checked
against the files beside this one.

A client in another language tests itself against the files, not against this script: each vector
is one record (exact key bytes, headers, value bytes) plus its decoded form in plain JSON, and
``partitions.json`` gives the partition of every key (README.md in this folder says how to use them).

The samples are written out literally below, and encoded the way ``rollout_bus.producers.publisher.TurnPublisher``
does (key ``rollout_key_of(sample)``, value ``encode_samples([sample],
TURN_FIELDS)``, ``TurnHeaders(...).to_kafka()`` headers with a fixed ``sent_at``), so the files
change only when the wire format does. The prompt group and the ledger event are built with
``rollout_bus.wire.prompt_record`` (``PromptGroup``, ``LedgerEvent``: key, headers, value) from literal fields.

    .venv/bin/python -m tests.vectors.make_vectors            # check: exit 1 with a diff summary if stale
    .venv/bin/python -m tests.vectors.make_vectors --write    # (re)write the files

(``.venv/bin/python tests/vectors/make_vectors.py`` works too.) Without ``--write`` nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from rollout_bus.wire.codec import decode_samples, encode_samples
from rollout_bus.model.sample import get_rollout_key
from rollout_bus.wire.partitioning import murmur2, partition_for
from rollout_bus.wire.control_records import END_OF_RUN_KEY, EndOfRun
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.headers import HEADER_SCHEMA, SCHEMA_VERSION, TurnHeaders
from rollout_bus.wire.prompt_record import LedgerEvent, PromptGroup, TurnMark
from rollout_bus.wire.topics import PROMPT_LEDGER_TOPIC, PROMPTS_TOPIC
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.wire.rollout_key import rollout_key_string

HERE = Path(__file__).resolve().parent
TOPIC = "rollout.turns"
SENT_AT_MS = 1767225600000  # 2026-01-01T00:00:00Z: a fixed producer clock, so the headers never change
PARTITION_COUNTS = (1, 4, 6, 12)
SUFFIXES = (".key", ".headers.json", ".value.bin", ".decoded.json")
PARTITIONS_FILE = "partitions.json"


@dataclass(frozen=True)
class Vector:
    """One record as it lies on the topic, and its decoded form."""

    name: str
    key: bytes
    headers: list[tuple[str, bytes]]
    value: bytes
    decoded: dict[str, Any]
    routing: str  # "key": placed by partition_for; "every-partition": sent once to each partition


# ----------------------------------------------------------------------------- the samples

def _mask(rows: list[list[int]]) -> RolloutSamplingMask:
    return RolloutSamplingMask.from_mask_list(rows)


def _samples() -> list[tuple[str, str, Sample, dict[str, Any]]]:
    """(name, what it covers, the turn sample, TurnHeaders keywords but sent_at) for every turn vector."""
    first = Sample(
        group_index=3, index=17, rollout_id=17, prompt="What is 12*7? Use the calculator.",
        tokens=[151644, 872, 198, 3838, 374, 220, 27, 14172, 29, 23, 19, 785, 4226],
        response="<calc>12*7</calc>84 So", response_length=7, label="84",
        loss_mask=[1, 1, 1, 0, 0, 1, 1], weight_versions=["3", "3"],
        rollout_log_probs=[-0.2876820724517809, -1.9073468138230965e-06, -0.6931471805599453, 0.0, 0.0,
                           -1.3862943611198906, -0.05129329438755058],
        # rows 3 and 4 are the calculator's output (forced: the token itself); row 1 and row 6 are
        # sampled tokens whose top-p support was one token; supports keep the sampler's order
        rollout_sampling_mask=_mask([[27, 40, 1001], [14172], [29, 30], [23], [19], [576, 785, 12, 4226], [4226]]),
        status=Status.COMPLETED, metadata={"env": "calculator"},
    )
    final = Sample(
        group_index=2, index=5, rollout_id=5,
        prompt=[{"role": "system", "content": "You are a careful solver."},
                {"role": "user", "content": "What is 12*7?"}],
        tokens=[151644, 8948, 198, 3838, 374, 27, 14172, 29, 23, 19, 576, 4226, 374, 151645],
        response="The answer is 84.", response_length=4, label="84", reward=1.0,
        loss_mask=[1, 1, 1, 1], weight_versions=["8"],
        rollout_log_probs=[-0.6931471805599453, -0.10536051565782628, -2.302585092994046, -0.01005033585350145],
        rollout_sampling_mask=_mask([[576, 12], [4226], [374, 9, 1], [151645]]),
        status=Status.COMPLETED, metadata={"env": "calculator", "turns": 3}, adapter=AdapterRef("math", 1),
    )
    versions = Sample(
        group_index=10, index=40, rollout_id=None, prompt="def add(a, b):",
        tokens=[755, 912, 2948, 11, 293, 1680, 471, 264, 489, 293, 198, 2],
        response="return a + b\n", response_length=6, reward={"passed": False, "score": 0.25, "tests": [1, 0, 1, 1]},
        loss_mask=[1, 1, 1, 0, 0, 1], weight_versions=["6", "7", "7"],
        # floats whose shortest spelling needs an exponent, one that is not exact in decimal, exact ones
        rollout_log_probs=[-1e-05, -0.1, -12.75, 0.0, 0.0, -2.220446049250313e-16],
        rollout_sampling_mask=_mask([[471, 470], [264], [489, 12, 7], [293], [198], [2, 0]]),
        remove_sample=True, status=Status.TRUNCATED,
        metadata={"sampler": {"stop": None, "temperature": 0.7, "top_k": 20, "top_p": 0.95}},
        adapter=AdapterRef("code", 0), rollout_token_versions=[6, 6, 7, -1, -1, 7],
    )
    minimal = Sample(group_index=0, index=0, status=Status.ABORTED)
    unicode = Sample(
        group_index=1, index=0, rollout_id=0, prompt="Combien font 12×7 ? Réponds « en toutes lettres ».",
        tokens=[9, 8, 7, 40, 41, 42], response="quatre-vingt-quatre ✓ 🙂\n\t\"84\" \\ \x01",
        response_length=3, label="quatre-vingt-quatre", reward=0, loss_mask=[1, 1, 1], weight_versions=["12"],
        rollout_log_probs=[-0.5, -0.25, -0.125], rollout_sampling_mask=_mask([[40, 43], [41], [42, 44, 45]]),
        status=Status.COMPLETED, metadata={"langue": "français", "ü": "ß"},
        adapter=AdapterRef("maths-français-数学-🙂", 3),
    )
    return [
        ("01-first-turn-mask", "turn 0 of an adapter-less episode: sampling mask with singleton supports "
         "(forced tool output and one-token top-p), loss mask 0 on the forced tokens, log-probs 0.0 there",
         first, dict(turn=0, attempt=0, final=False, group_size=4)),
        ("02-final-turn-adapter", "the final turn (turn 2, attempt 1) of a multi-turn episode with adapter "
         "[\"math\", 1]: tokens hold the whole history, per-token fields this turn's response; chat prompt, "
         "float reward", final, dict(turn=2, attempt=1, final=True, group_size=4)),
        ("03-logprobs-token-versions", "log-probs spelled with exponents, per-token weight versions "
         "(-1 on forced tokens), a dict reward, remove_sample, truncated; keyed by index (no rollout_id), "
         "adapter slot 0, mask id 0", versions, dict(turn=1, attempt=0, final=True, group_size=8)),
        ("04-nulls-minimal", "every optional field absent: no loss mask, log-probs, mask or token versions, "
         "no rollout_id, reward, label or adapter; zero tokens (an empty tensor); an aborted attempt's turn",
         minimal, dict(turn=0, attempt=0, final=False, group_size=1)),
        ("05-unicode-adapter", "a non-ASCII adapter name (escaped in the key, raw UTF-8 in the value) and "
         "texts with escapes (newline, tab, quote, backslash, U+0001, a non-BMP emoji); an int reward",
         unicode, dict(turn=0, attempt=0, final=True, group_size=2)),
    ]


# ----------------------------------------------------------------------------- the records

def _array(value: Any) -> list | None:
    return None if value is None else np.asarray(value).tolist()


def sample_json(sample: Sample) -> dict[str, Any]:
    """Every Sample field, in declaration order, as plain JSON values."""
    out: dict[str, Any] = {}
    for f in fields(Sample):
        value = getattr(sample, f.name)
        if f.name in ("tokens", "loss_mask", "rollout_log_probs", "rollout_token_versions"):
            value = _array(value)
        elif f.name == "rollout_sampling_mask" and value is not None:
            ids, offsets = value.as_arrays()
            value = {"flat_ids": ids.tolist(), "offsets": offsets.tolist()}
        elif f.name == "adapter" and value is not None:
            value = [value.name, value.slot]
        elif f.name == "status":
            value = value.value
        out[f.name] = value
    return out


def turn_vector(name: str, description: str, sample: Sample, header_args: dict[str, Any]) -> Vector:
    """The record TurnPublisher.publish_turn sends for ``sample``; decoded from its own bytes."""
    sample.validate()
    rollout_key = get_rollout_key(sample, 0)
    key = rollout_key_string(rollout_key).encode()
    value = encode_samples([sample], TURN_FIELDS)
    headers = TurnHeaders(sent_at_ms=SENT_AT_MS, **header_args)
    decoded, metadata = decode_samples(value, TURN_FIELDS)
    if decoded != [sample] or metadata != {}:
        raise RuntimeError(f"vector {name}: the codec does not round-trip its sample")
    adapter, kind, group_index, ident = rollout_key
    return Vector(name, key, headers.to_kafka(), value, {
        "vector": name, "description": description, "topic": TOPIC, "record": "turn",
        "key": {"adapter": None if adapter is None else [adapter.name, adapter.slot], "kind": kind,
                "group_index": group_index, "id": ident},
        "headers": {"turn": headers.turn, "attempt": headers.attempt, "final": headers.final,
                    "group_size": headers.group_size, "schema": headers.schema, "sent_at_ms": headers.sent_at_ms},
        "value": {"fields": list(TURN_FIELDS), "metadata": metadata, "samples": [sample_json(s) for s in decoded]},
    }, routing="key")


def end_of_run_vector() -> Vector:
    """The generator's end-of-run control record, as it sends one to every turns partition."""
    marker = EndOfRun("golden-run-0001")
    return Vector("06-end-of-run", END_OF_RUN_KEY, marker.headers(), marker.value(), {
        "vector": "06-end-of-run", "topic": TOPIC, "record": "end-of-run",
        "description": "the control record that closes a run: sent once to every partition (not placed by "
                       "its key), told apart from turns by the control header; JSON value",
        "key": END_OF_RUN_KEY.decode(),
        "headers": {name: raw.decode() for name, raw in marker.headers()},
        "value": json.loads(marker.value()),
    }, routing="every-partition")


def prompt_group_vector() -> Vector:
    """A prompt group as ``rollout-bus prompts load`` puts it on rollout.prompts: every field set."""
    group = PromptGroup(
        id="calc-00019", group_index=7, input_ids=[1, 8, 9, 4, 14, 6], n_samples=4, label="19",
        metadata={"source": "Übungsblatt 3", "level": 1},
        sampling={"max_new_tokens": 8, "temperature": 1.0, "top_k": 5},
        adapter="math", text="^12+7?", tokenizer="rollout_bus.policy.vocab")
    return Vector("07-prompt-group", group.key(), group.headers(), group.value(), {
        "vector": "07-prompt-group", "topic": PROMPTS_TOPIC, "record": "prompt-group",
        "description": "one prompt group to generate (n_samples episodes of group_index), every field set: the "
                       "key is its id; header schema; compact JSON with sorted keys, non-ASCII \\u-escaped, "
                       "a float (1.0) told from an int",
        "key": group.id,
        "headers": {name: raw.decode() for name, raw in group.headers()},
        "value": json.loads(group.value()),
    }, routing="key")


def _ledger_vector(name: str, event: LedgerEvent, description: str) -> Vector:
    """A ledger event with the ``schema`` header the generators write (``rollout_bus.kafka.prompt_ledger``)."""
    headers = [(HEADER_SCHEMA, SCHEMA_VERSION.encode())]
    return Vector(name, event.key(), headers, event.value(), {
        "vector": name, "topic": PROMPT_LEDGER_TOPIC, "record": "ledger-event", "description": description,
        "key": event.key().decode(),
        "headers": {header: raw.decode() for header, raw in headers},
        "value": json.loads(event.value()),
    }, routing="key")


def ledger_event_vector() -> Vector:
    """A generator's ``claimed`` event for the prompt group above, its second delivery (a redelivery)."""
    return _ledger_vector("08-ledger-claimed", LedgerEvent("claimed", "calc-00019", delivery=2,
                                                           generator="g1of2-seed7"),
                          "a prompt group's second delivery claimed by generator g1of2-seed7: keyed by the prompt "
                          "group's id (the same partition as its record on rollout.prompts); header schema; every "
                          "field present, the unused ones empty or 0")


def ledger_progress_vector() -> Vector:
    """That delivery's ``progress`` event: turn 2 of episode 1, resumed from the turns the first delivery logged
    (WIRE.md 15.2's example), acknowledged at rollout.turns partition 3 offset 812."""
    mark = TurnMark(sample=1, attempt=0, turn=2, final=False, resumed=True, partition=3, offset=812)
    return _ledger_vector("09-ledger-progress", LedgerEvent("progress", "calc-00019", delivery=2,
                                                            generator="g1of2-seed7", mark=mark),
                          "a turn of the prompt group's second delivery acknowledged on rollout.turns (episode 1, "
                          "attempt 0, turn 2, not final, resumed: the turns below it were the first delivery's), "
                          "with its place there (partition 3, offset 812): the six fields and a seventh, mark")


def build_vectors() -> list[Vector]:
    return ([turn_vector(*spec) for spec in _samples()] + [end_of_run_vector(), prompt_group_vector(),
                                                           ledger_event_vector(), ledger_progress_vector()])


# ----------------------------------------------------------------------------- the files

def json_text(value: Any, depth: int = 0) -> str:
    """Indented JSON with lists of scalars on one line; floats as Python's repr (shortest round trip)."""
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {json_text(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + json_text(v, depth + 1) for v in value) + "\n" + pad + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(", ", ": "))


def partitions_doc(vectors: list[Vector]) -> dict[str, Any]:
    entries = {}
    for v in vectors:
        h = murmur2(v.key)
        entries[v.name] = {"key": v.key.decode("ascii"), "routing": v.routing, "murmur2_u32": h,
                           "murmur2_java_int": h - (1 << 32) if h >= 1 << 31 else h,
                           "partitions": {str(n): partition_for(v.key, n) for n in PARTITION_COUNTS}}
    return {"rule": "partition = (murmur2(key bytes) & 0x7fffffff) % count; murmur2 as Kafka's "
                    "org.apache.kafka.common.utils.Utils.murmur2 (seed 0x9747b28c)",
            "routing": {"key": "the producer leaves the partition to the key (Kafka's default partitioner)",
                        "every-partition": "sent once to each partition explicitly; the key's hash is given for "
                                           "testing murmur2 only"},
            "counts": list(PARTITION_COUNTS), "vectors": entries}


def render(vectors: list[Vector]) -> dict[str, bytes]:
    """File name -> exact contents, for every file this script owns."""
    files: dict[str, bytes] = {}
    for v in vectors:
        files[v.name + ".key"] = v.key
        headers = [[k, raw.decode("ascii")] for k, raw in v.headers]
        files[v.name + ".headers.json"] = (json_text(headers) + "\n").encode()
        files[v.name + ".value.bin"] = v.value
        files[v.name + ".decoded.json"] = (json_text(v.decoded) + "\n").encode()
    files[PARTITIONS_FILE] = (json_text(partitions_doc(vectors)) + "\n").encode()
    return files


def _owned(name: str) -> bool:
    return name == PARTITIONS_FILE or name.endswith(SUFFIXES)


def _first_difference(name: str, old: bytes, new: bytes) -> str:
    at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    lines = old[:at].count(b"\n") + 1
    line = f" (line {lines})" if name.endswith(".json") else ""
    return f"on disk {len(old)} bytes, expected {len(new)}; first difference at byte {at}{line}"


def check(directory: Path, expected: dict[str, bytes]) -> list[str]:
    """What differs between ``directory`` and ``expected``: one line per file, empty when up to date."""
    problems = []
    for name, content in sorted(expected.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"missing    {name}")
        elif (old := path.read_bytes()) != content:
            problems.append(f"differs    {name}: {_first_difference(name, old, content)}")
    if directory.is_dir():
        problems += [f"unexpected {p.name} (no vector writes it)" for p in sorted(directory.iterdir())
                     if p.is_file() and _owned(p.name) and p.name not in expected]
    return problems


def write(directory: Path, expected: dict[str, bytes]) -> list[str]:
    """Write the files that differ and remove stale vector files; returns what changed (``check``'s lines)."""
    changed = check(directory, expected)
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in expected.items():
        path = directory / name
        if not path.is_file() or path.read_bytes() != content:
            path.write_bytes(content)
    for path in directory.iterdir():
        if path.is_file() and _owned(path.name) and path.name not in expected:
            path.unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="write the vector files (default: only check them)")
    parser.add_argument("--dir", type=Path, default=HERE, help="folder of the vector files (default: %(default)s)")
    args = parser.parse_args(argv)
    expected = render(build_vectors())
    if args.write:
        changed = write(args.dir, expected)
        print(f"updated {len(changed)} of {len(expected)} files in {args.dir}" if changed
              else f"nothing to write: {len(expected)} files in {args.dir} up to date")
        print("\n".join(f"  {line}" for line in changed))
        return 0
    problems = check(args.dir, expected)
    if problems:
        print(f"golden vectors in {args.dir} are NOT up to date ({len(problems)} of {len(expected)} files):")
        print("\n".join("  " + p for p in problems))
        print("if the wire format changed on purpose, rerun with --write and review the diff (WIRE.md too)")
        return 1
    print(f"golden vectors up to date: {len(expected)} files in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
