"""Record headers read back: a turn header integer is ASCII digits and nothing else."""

from __future__ import annotations

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.wire.headers import TurnHeaders


@pytest.mark.parametrize("raw", [b" 5", b"+5", b"1_0", b"", b"5\n", b"\xd9\xa5", b"0x5"])
def test_a_turn_header_integer_is_ascii_digits_and_nothing_else(raw):
    headers = [(k, raw if k == "turn" else v) for k, v in TurnHeaders(5, 0, False, 1, 7).to_kafka()]
    with pytest.raises(ContractError, match="'turn' must be a decimal integer in ASCII digits"):
        TurnHeaders.from_kafka(headers)
