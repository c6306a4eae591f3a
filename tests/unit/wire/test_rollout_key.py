"""Rollout keys parsed back from the wire: the tuple, the adapter, and the reason a key is not one."""

from __future__ import annotations

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.model.sample import AdapterRef
from rollout_bus.wire.rollout_key import parse_rollout_key, rollout_key_adapter, rollout_key_string


@pytest.mark.parametrize("key", [
    (AdapterRef("math", 1), "rollout", 3, 17),
    (None, "rollout", 0, 0),
    (None, "sample", 12, 5),
    (AdapterRef('we"ird, name', 0), "rollout", 1, 2),
])
def test_a_rollout_key_string_parses_back_to_its_tuple(key):
    assert parse_rollout_key(rollout_key_string(key).encode()) == key
    assert parse_rollout_key(rollout_key_string(key)) == key


@pytest.mark.parametrize("raw", [
    None, b"", b"\xff\xfe", b"not json", b"[1,2,3,4]", b'{"a":1}',
    b'[null,null,"rollout",-1,0]', b'[null,null,"position",1,0]', b'[null,null,"rollout",1.5,0]',
    b'["a",null,"rollout",1,0]', b'[null,3,"rollout",1,0]', b'[null,null,"rollout",true,0]',
    b'[null,null,"rollout",1,"x"]',
])
def test_a_key_that_is_not_a_rollout_key_is_refused_with_the_reason(raw):
    with pytest.raises(ContractError, match="record key"):
        parse_rollout_key(raw)


def test_a_rollout_key_string_names_its_adapter_and_anything_else_names_none():
    assert rollout_key_adapter('["math",0,"rollout",3,17]') == "math"
    assert rollout_key_adapter(b'["math",1,"rollout",0,3]') == "math"
    assert rollout_key_adapter(b'[null,null,"rollout",3,17]') is None
    assert rollout_key_adapter(b"\xff not json") is None and rollout_key_adapter(None) is None
    assert rollout_key_adapter(b'["math",1,"position",0,3]') is None  # not a rollout key on the wire


def test_only_a_rollout_or_sample_key_may_key_a_record_a_position_key_is_refused():
    from rollout_bus.model.sample import Sample, get_rollout_key
    from rollout_bus.wire.rollout_key import check_record_key

    check_record_key(get_rollout_key(Sample(group_index=3, rollout_id=17), 0))
    check_record_key(get_rollout_key(Sample(group_index=3, index=5), 0))
    with pytest.raises(ContractError, match="no rollout_id, index or group_index identity, and a position key"):
        check_record_key(get_rollout_key(Sample(group_index=3), 4))
