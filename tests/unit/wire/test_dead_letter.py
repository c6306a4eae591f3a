"""The dead-letter kinds: one enum in the code, the same lists in the schema and in WIRE.md."""

import json
import re
from pathlib import Path

import pytest

from rollout_bus.wire.dead_letter import KINDS_BY_STAGE, DeadLetter, DlqKind, DlqStage

ROOT = Path(__file__).resolve().parents[3]


def schema_kinds() -> dict[str, set[str]]:
    schema = json.loads((ROOT / "schemas" / "dlq_headers.json").read_text())
    found = {}
    for rule in schema["allOf"]:
        if "dlq.stage" not in rule["if"]["properties"]:
            continue  # the rule that ties dlq.lost to kind lost
        stage = rule["if"]["properties"]["dlq.stage"]["const"]
        found[stage] = set(rule["then"]["properties"]["dlq.kind"]["enum"])
    assert set(schema["properties"]["dlq.stage"]["enum"]) == set(found)
    return found


def wire_md_kinds() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    stages = "|".join(str(s) for s in DlqStage)
    table = rf"^\| `({stages})` \| `([\w-]+)` \| \w+ \|"
    for stage, kind in re.findall(table, (ROOT / "WIRE.md").read_text(), re.M):
        found.setdefault(stage, set()).add(kind)
    return found


def test_every_stage_writes_the_kinds_the_schema_lists():
    code = {str(stage): {str(k) for k in kinds} for stage, kinds in KINDS_BY_STAGE.items()}
    assert code == schema_kinds()


def test_wire_md_lists_the_same_kinds_per_stage():
    code = {str(stage): {str(k) for k in kinds} for stage, kinds in KINDS_BY_STAGE.items()}
    assert code == wire_md_kinds()


def test_every_kind_is_written_by_some_stage_and_every_stage_is_known():
    assert set(DlqKind) == {k for kinds in KINDS_BY_STAGE.values() for k in kinds}
    assert set(KINDS_BY_STAGE) == set(DlqStage)


def test_a_kind_goes_on_the_wire_as_its_plain_value():
    letter = DeadLetter(b"k", b"v", [], "why", DlqStage.SHARDS, DlqKind.MASK_CHECK, "t:0:1")
    headers = dict(letter.record_headers())
    assert headers["dlq.kind"] == b"mask-check" and headers["dlq.stage"] == b"shards"
    back = DeadLetter.from_record(b"k", b"v", letter.record_headers())
    assert back.kind == DlqKind.MASK_CHECK and back.stage == DlqStage.SHARDS


def test_a_lost_letter_names_the_range_and_round_trips_and_only_lost_letters_carry_dlq_lost():
    from rollout_bus.wire.dead_letter import lost_letter
    from tests.wire_schemas import header_object, validate

    letter = lost_letter("stream", "r.rollout.turns", 2, 12, 75, 87)
    headers = letter.record_headers()
    assert headers[-1] == ("dlq.lost", b"75") and letter.key == b"" and letter.value is None
    assert "offsets 12..86 (75 records)" in letter.reason and "starts at 87" in letter.reason
    back = DeadLetter.from_record(b"", None, headers)
    assert (back.kind, back.source, back.lost) == ("lost", "r.rollout.turns:2:12", 75)
    validate("dlq_headers", header_object(headers))
    with pytest.raises(Exception, match="dlq.lost"):
        validate("dlq_headers", header_object(headers[:-1]))
    other = DeadLetter(b"k", b"v", [], "why", "stream", "gap", "t:0:1")
    with pytest.raises(Exception):
        validate("dlq_headers", header_object(other.record_headers() + [("dlq.lost", b"3")]))
