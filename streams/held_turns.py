"""Turns that arrived before their predecessor, kept in the state until it comes (or the run ends).

Why: turns of one episode can reach its partition out of order (a turn produced with another client's
partitioner is re-routed to its key's partition and arrives after the next turn, produced right). Such a
turn is valid: it waits for its predecessor instead of being dead-lettered as ``gap``. Only the log can say
that a predecessor will never come: the run's end-of-run marker on the partition.

Contract: ``held_key(key, attempt, turn)`` is the state key of a held turn (``h|attempt|turn|key``);
``hold_value(record)`` / ``held_record(key, value)`` write and read back the whole record (headers byte for
byte, value, partition, offset, timestamp) so the held turn is processed later exactly as if it arrived then.
``is_held_key`` tells those keys apart from the rest of the state. ``dead_key(key, attempt, turn)`` marks a
turn the worker dead-lettered for itself (the log's word that it will never be merged): a turn held for it,
or arriving later, is a ``gap`` at once.
"""

from __future__ import annotations

import json
import struct

from rollout_bus.streams.turn_record import TurnRecord
from rollout_bus.wire.compact_json import compact_json

PREFIX = b"h|"
_HEAD = struct.Struct(">I")  # length of the JSON part that precedes the value


def held_key(rollout_key: bytes, attempt: int, turn: int) -> bytes:
    return PREFIX + b"%d|%d|" % (attempt, turn) + rollout_key


DEAD = b"x|"


def dead_key(rollout_key: bytes, attempt: int, turn: int) -> bytes:
    """State key marking a turn this worker dead-lettered for itself: its successors can never merge."""
    return DEAD + b"%d|%d|" % (attempt, turn) + rollout_key


def is_held_key(key: bytes) -> bool:
    return key.startswith(PREFIX)


def hold_value(record: TurnRecord) -> bytes:
    """The record as a state value: its place, its headers (bytes kept as latin-1 text) and its value."""
    meta = compact_json({"topic": record.topic, "partition": record.partition, "offset": record.offset,
                         "timestamp_ms": record.timestamp_ms,
                         "headers": [[name, bytes(value or b"").decode("latin-1")] for name, value in record.headers]})
    return _HEAD.pack(len(meta)) + meta + (record.value or b"")


def held_record(key: bytes, value: bytes) -> TurnRecord:
    """The record a ``hold_value`` was made of; ``key`` is its state key."""
    (size,) = _HEAD.unpack_from(value)
    meta = json.loads(value[_HEAD.size:_HEAD.size + size])
    rollout_key = key[len(PREFIX):].split(b"|", 2)[2]
    headers = [(name, text.encode("latin-1")) for name, text in meta["headers"]]
    return TurnRecord(rollout_key, value[_HEAD.size + size:], headers, meta["topic"], meta["partition"], meta["offset"],
                      meta["timestamp_ms"])
