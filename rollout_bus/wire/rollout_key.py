"""The rollout key as the bus spells it: built from a sample, encoded as a record key, parsed back.

Every turn and episode record is keyed by its episode's rollout key, ``(adapter, kind, group_index,
id)`` (``model.sample.get_rollout_key``), so every turn of an episode lands on one partition and one
stream worker. On the wire it is compact JSON: ``["math",1,"rollout",3,17]``, and an adapter-less key
``[null,null,"rollout",3,17]`` (WIRE.md section 4.1). Only a ``rollout`` or ``sample`` key travels
(``check_record_key``): a ``position`` key, a sample's place in one batch, means nothing across records.
"""

from __future__ import annotations

import json

from rollout_bus.wire.compact_json import compact_json
from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.sample import AdapterRef, Sample, get_rollout_key


KEY_KINDS = ("rollout", "sample")  # what a record key may name (never "position")


def check_record_key(key: tuple) -> None:
    """ContractError unless ``key`` (``get_rollout_key``'s tuple) may key a record: its kind is one of
    ``KEY_KINDS``. A sample with neither ``rollout_id`` nor ``index`` has a position key, and is refused."""
    if key[1] not in KEY_KINDS:
        raise ContractError("the sample has no rollout_id, index or group_index identity, and a position key means "
                            "nothing across records")


def rollout_key_string(key: tuple) -> str:
    """The record key of a rollout: ``get_rollout_key``'s tuple as stable, compact JSON.

    ``(AdapterRef("math", 1), "rollout", 3, 17)`` becomes ``["math",1,"rollout",3,17]`` and an
    adapter-less key ``[null,null,"rollout",3,17]``. JSON keeps any adapter name unambiguous.
    """
    adapter, kind, group_index, ident = key
    name, slot = (adapter.name, adapter.slot) if adapter is not None else (None, None)
    return compact_json([name, slot, kind, group_index, ident]).decode()


def rollout_key_of(sample: Sample) -> str:
    """The record key of the episode ``sample`` belongs to (a turn's own sample, position 0)."""
    return rollout_key_string(get_rollout_key(sample, 0))


RolloutKeyParts = tuple[AdapterRef | None, str, int, int]


def parse_rollout_key(key: bytes | str | None) -> RolloutKeyParts:
    """Inverse of ``rollout_key_string``: ``(adapter, kind, group_index, id)``.

    Strict: ContractError unless the key is the compact JSON array
    ``[adapter name|null, slot|null, kind, group_index, id]`` with a non-negative integer group
    index, so a group can be found from a record key alone (a dead-lettered turn included).
    """
    try:
        text = key.decode("utf-8") if isinstance(key, (bytes, bytearray)) else key
        parts = json.loads(text) if isinstance(text, str) else None
    except (UnicodeDecodeError, ValueError):
        parts = None
    shape = "the rollout key [adapter, slot, kind, group_index, id] as compact JSON"
    if not isinstance(parts, list) or len(parts) != 5:
        raise ContractError(must_be("record key", shape, key if not isinstance(key, bytes) else key[:200]))
    name, slot, kind, group_index, ident = parts
    integral = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if (name is None) != (slot is None) or (name is not None and not (isinstance(name, str) and integral(slot))):
        raise ContractError(must_be("record key adapter", "[name, slot] or [null, null]", [name, slot]))
    if kind not in KEY_KINDS or not integral(group_index) or group_index < 0 or not integral(ident):
        raise ContractError(must_be("record key", shape + " with a group_index >= 0", parts))
    adapter = AdapterRef(name, slot) if name is not None else None
    return adapter, kind, group_index, ident


def rollout_key_adapter(key: bytes | str | None) -> str | None:
    """The adapter name a record key names; None when it names none or is not a rollout key."""
    try:
        adapter = parse_rollout_key(key)[0]
    except ContractError:
        return None
    return adapter.name if adapter is not None else None
