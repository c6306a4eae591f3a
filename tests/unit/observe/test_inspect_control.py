"""`rollout-bus inspect` on a control record: shown as its JSON and kind, never as a broken episode or turn."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

from rollout_bus.errors import CodecError
from rollout_bus.observe.inspect import describe_record, render
from rollout_bus.wire.control_records import END_OF_RUN_KEY, Abandoned, EndOfRun


def record(topic: str, key: bytes, value: bytes, headers: list) -> SimpleNamespace:
    return SimpleNamespace(topic=topic, partition=2, offset=41, timestamp=1_700_000_000_000, key=key, value=value,
                           headers=headers)


@pytest.mark.parametrize("topic", ["run1.rollout.episodes", "run1.rollout.turns", "somewhere.else"])
def test_an_end_of_run_record_is_described_as_control_json_on_any_topic(topic):
    marker = EndOfRun("abc").forwarded(1, 4)
    d = describe_record(record(topic, END_OF_RUN_KEY, marker.value(), marker.headers()))
    assert d["decoded_as"] == "json" and d["control"] == "end-of-run"
    assert d["json"] == {"run": "abc", "turns_partition": 1, "turns_partitions": 4}
    out = io.StringIO()
    render(d, Console(file=out, width=120))
    assert "end-of-run" in out.getvalue() and "turns_partitions" in out.getvalue()


def test_an_abandoned_record_is_described_with_its_reason():
    gone = Abandoned(1, 4, "merge", "tokens compacted", "t.rollout.turns:0:9")
    d = describe_record(record("t.rollout.episodes", b'[null,null,"rollout",0,1]', gone.value(), gone.headers()))
    assert d["control"] == "abandoned" and d["json"]["reason"] == "tokens compacted"


def test_a_control_record_whose_value_is_not_json_says_so():
    with pytest.raises(CodecError, match="not JSON"):
        describe_record(record("t.rollout.episodes", END_OF_RUN_KEY, b"\x00garbage", EndOfRun("r").headers()))
