"""The control records that close groups, batches and runs: told apart from data by their header, round trips,
and malformed values refused."""

from __future__ import annotations

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.wire.control_records import Abandoned, BatchesEnded, BatchSkipped, EndOfRun
from rollout_bus.wire.headers import TurnHeaders, control_kind


def test_control_records_are_told_apart_from_data_records_by_their_header():
    assert control_kind(TurnHeaders(0, 0, True, 1, 0).to_kafka()) is None
    assert control_kind(None) is None
    assert control_kind(EndOfRun("r").headers()) == "end-of-run"
    assert control_kind(Abandoned(0, 2, "gap", "why", "t:0:1").headers()) == "abandoned"


def test_control_records_round_trip():
    marker = EndOfRun("run-7").forwarded(2, 4)
    assert EndOfRun.from_value(marker.value()) == marker
    assert EndOfRun.from_value(EndOfRun("x").value()) == EndOfRun("x")
    abandoned = Abandoned(1, 4, "too_large", "over the limit", "turns:3:99")
    assert Abandoned.from_value(abandoned.value()) == abandoned


@pytest.mark.parametrize("cls, value", [
    (EndOfRun, None), (EndOfRun, b"[]"), (EndOfRun, b"{}"), (EndOfRun, b'{"run": 3}'),
    (EndOfRun, b'{"run": "r", "turns_partition": "1"}'),
    (Abandoned, b'{"attempt": 0}'), (Abandoned, b"garbage"),
    (Abandoned, b'{"attempt": -1, "group_size": 1, "kind": "k", "reason": "r", "source": "s"}'),
    (Abandoned, b'{"attempt": 0, "group_size": 0, "kind": "k", "reason": "r", "source": "s"}'),
    (Abandoned, b'{"attempt": true, "group_size": 1, "kind": "k", "reason": "r", "source": "s"}'),
])
def test_a_malformed_control_record_is_refused_naming_what_is_wrong(cls, value):
    with pytest.raises(ContractError):
        cls.from_value(value)


def test_skipped_batches_and_the_end_of_a_run_on_rollout_shards_round_trip():
    skipped = BatchSkipped(4, "empty", "every group abandoned")
    assert BatchSkipped.from_value(skipped.value()) == skipped and skipped.key() == b"4"
    assert control_kind(skipped.headers()) == "batch-skipped"
    ended = BatchesEnded("run-1", 7)
    assert BatchesEnded.from_value(ended.value()) == ended and control_kind(ended.headers()) == "end-of-run"
    with pytest.raises(ContractError, match="seq"):
        BatchSkipped.from_value(b'{"seq":-1,"why":"empty","reason":""}')
