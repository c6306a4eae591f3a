"""The golden prompt-group and ledger-event records (tests/vectors, WIRE.md section 15) hold both ways.

Read from the files only: the value parses with a plain JSON parser to exactly ``decoded.json`` (1 told from
1.0), ``PromptGroup``/``LedgerEvent`` read it back to the same fields and write it again byte for byte, with
the key and headers of the files; and a prompt group and its ledger events share a key, so a partition.
"""

from __future__ import annotations

import json

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.wire.prompt_record import LOADED_KEY, LedgerEvent, PromptGroup, PromptLedger, TurnMark
from rollout_bus.wire.topics import PROMPT_LEDGER_TOPIC, PROMPTS_TOPIC
from tests.unit.wire.test_wire_vectors import NAMES, PARTITIONS, load, same

GROUPS = [n for n in NAMES if load(n)[3]["record"] == "prompt-group"]
EVENTS = [n for n in NAMES if load(n)[3]["record"] == "ledger-event"]


def test_there_is_a_prompt_group_vector_with_every_field_set_and_a_ledger_event_for_it():
    assert GROUPS == ["07-prompt-group"] and EVENTS == ["08-ledger-claimed", "09-ledger-progress"]
    group = load(GROUPS[0])[3]
    assert group["topic"] == PROMPTS_TOPIC and load(EVENTS[0])[3]["topic"] == PROMPT_LEDGER_TOPIC
    assert all(value not in (None, {}, "") for value in group["value"].values()), "every optional field set"
    assert not all(ch.isascii() for ch in json.dumps(group["value"], ensure_ascii=False)), "a non-ASCII text"
    assert isinstance(group["value"]["sampling"]["temperature"], float)
    assert all(load(name)[3]["value"]["prompt"] == group["key"] for name in EVENTS)
    assert [load(name)[3]["value"]["event"] for name in EVENTS] == ["claimed", "progress"]


@pytest.mark.parametrize("name", GROUPS)
def test_a_prompt_group_both_ways(name):
    key, headers, value, decoded = load(name)
    problems: list[str] = []
    same(decoded["value"], json.loads(value), "value", problems)
    assert problems == []
    group = PromptGroup(**decoded["value"])
    assert PromptGroup.from_value(value) == group
    assert group.value() == value and group.key() == key == decoded["key"].encode()
    assert group.headers() == headers and [(k, v.decode()) for k, v in headers] == list(decoded["headers"].items())


@pytest.mark.parametrize("name", EVENTS)
def test_a_ledger_event_both_ways(name):
    key, headers, value, decoded = load(name)
    problems: list[str] = []
    same(decoded["value"], json.loads(value), "value", problems)
    assert problems == [] and [(k, v.decode()) for k, v in headers] == list(decoded["headers"].items())
    assert decoded["headers"] == {"schema": "1"}  # as the generators write it; readers do not look at it
    fields = decoded["value"]
    mark = TurnMark(**fields["mark"]) if "mark" in fields else None  # only progress carries a seventh field
    event = LedgerEvent(**{**fields, "mark": mark})
    assert LedgerEvent.from_value(value) == event
    assert event.value() == value and event.key() == key == decoded["key"].encode()


def test_a_prompt_group_and_its_ledger_events_share_a_partition():
    assert all(PARTITIONS["vectors"][GROUPS[0]]["partitions"] == PARTITIONS["vectors"][name]["partitions"]
               for name in EVENTS)


def test_a_prompt_group_written_with_only_the_required_fields_reads_with_the_defaults():
    group = PromptGroup.from_value(b'{"id":"mine-1","group_index":900,"input_ids":[1,2],"n_samples":2}')
    assert (group.label, group.metadata, group.sampling, group.adapter) == (None, {}, {}, None)
    with pytest.raises(ContractError, match="only the fields"):
        PromptGroup.from_value(b'{"id":"mine-1","group_index":900,"input_ids":[1,2],"n_samples":2,"prompt":"x"}')


def test_the_run_is_over_when_every_loaded_prompt_group_is_done_or_failed():
    """WIRE.md section 15: deliveries are the claimed events; ``all_ended`` counts against the loaded events."""
    ledger = PromptLedger()
    for event in (LedgerEvent("loaded", count=2), LedgerEvent("claimed", "a", 1, "g0"),
                  LedgerEvent("claimed", "a", 2, "g1"), LedgerEvent("done", "a", 2, "g1"),
                  LedgerEvent("claimed", "b", 1, "g0")):
        ledger.take(event)
    assert ledger.deliveries == {"a": 2, "b": 1} and not ledger.all_ended()
    ledger.take(LedgerEvent("failed", "b", 1, "g0", reason="the reward raised"))
    assert ledger.all_ended() and ledger.counts()["redelivered"] == 1
    assert LedgerEvent("loaded", count=2).key() == LOADED_KEY == b"loaded"
