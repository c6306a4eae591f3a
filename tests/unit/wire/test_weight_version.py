"""The rollout.weights record without a checkpoint reference: its bytes, and a bad one refused by field
(``test_weight_version_ref.py`` has the reference)."""

from __future__ import annotations

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.wire.weight_version import WeightVersion


def test_a_weight_version_round_trips_and_a_bad_one_is_refused_by_field():
    record = WeightVersion(3, 2, 1_700_000_000_000)
    assert WeightVersion.from_value(record.value()) == record
    assert record.value() == b'{"published_at":1700000000000,"step":2,"version":3}'
    for bad, field in ((b'{"version":-1,"step":0,"published_at":0}', "version"),
                       (b'{"version":1,"step":0}', "published_at"), (b"not json", "weights")):
        with pytest.raises(ContractError, match=field):
            WeightVersion.from_value(bad)
