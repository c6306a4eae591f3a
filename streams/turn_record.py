"""A rollout.turns record as the stream stage sees it, and its strict parsing.

Contract: ``TurnRecord`` holds the parts of a record the stage uses (key, value, headers, where
it came from, the timestamp in ms); ``to_record`` builds one from a Faust/aiokafka message.
``parse_headers`` and ``parse_sample`` check a record in two steps (the headers first, so a final
turn whose payload is bad is still known to be final); both raise ``Rejected`` with the DLQ kind
(``key``, ``headers``, ``decode``, ``validation``) and a reason that says what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_bus.wire.codec import decode_samples
from rollout_bus.wire.dead_letter import DlqKind, source_of
from rollout_bus.errors import CodecError, ContractError
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.headers import TurnHeaders
from rollout_bus.model.sample import Sample
from rollout_bus.wire.rollout_key import rollout_key_of


@dataclass(frozen=True)
class TurnRecord:
    """The parts of a rollout.turns record the stage uses."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    topic: str
    partition: int
    offset: int
    timestamp_ms: int

    @property
    def source(self) -> str:
        return source_of(self.topic, self.partition, self.offset)


class Rejected(Exception):
    """A record the stage refuses: its DLQ kind and reason."""

    def __init__(self, kind: DlqKind, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def parse_headers(record: TurnRecord) -> TurnHeaders:
    """The turn headers of a record; ``Rejected`` says what is wrong."""
    if not record.key:
        raise Rejected(DlqKind.KEY, "record has no key (expected the rollout key)")
    try:
        return TurnHeaders.from_kafka(record.headers)
    except ContractError as exc:
        raise Rejected(DlqKind.HEADERS, str(exc)) from exc


def parse_sample(record: TurnRecord) -> Sample:
    """The one turn sample of a record, checked against its key; ``Rejected`` says what is wrong."""
    try:
        samples, _ = decode_samples(record.value if record.value is not None else b"", TURN_FIELDS)
    except CodecError as exc:
        raise Rejected(DlqKind.DECODE, str(exc)) from exc
    if len(samples) != 1:
        raise Rejected(DlqKind.VALIDATION, f"a turn record must hold exactly 1 sample (got {len(samples)})")
    sample = samples[0]
    try:
        sample.validate()
    except ValueError as exc:
        raise Rejected(DlqKind.VALIDATION, str(exc)) from exc
    expected = rollout_key_of(sample).encode()
    if expected != record.key:
        raise Rejected(DlqKind.KEY, f"record key {record.key[:200]!r} is not the sample's rollout key {expected!r}")
    return sample


def to_record(message: Any) -> TurnRecord:
    """A Faust/aiokafka message as a ``TurnRecord`` (timestamps in ms)."""
    headers = [(k, bytes(v) if v is not None else b"") for k, v in (message.headers or [])]
    return TurnRecord(message.key, message.value, headers, message.topic, message.partition, message.offset,
                      int(round(message.timestamp * 1000)))
