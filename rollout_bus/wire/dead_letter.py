"""The dead-letter record: what any stage sends to rollout.dlq instead of dropping a record.

A dead letter keeps the original key and value byte for byte, keeps the original headers, and
adds ``dlq.reason`` (human-readable), ``dlq.stage``, ``dlq.source`` (``topic:partition:offset``)
and ``dlq.kind`` (a short, stable reason class for counting, e.g. ``decode``, ``merge``,
``finished``, ``mask-check``). Original headers keep their names, so a replay can strip the
``dlq.`` ones and republish the record unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

REASON = "dlq.reason"
STAGE = "dlq.stage"
SOURCE = "dlq.source"
KIND = "dlq.kind"
MAX_REASON_CHARS = 4000


@dataclass(frozen=True)
class DeadLetter:
    """A rejected record and why."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    reason: str
    stage: str
    kind: str
    source: str  # "topic:partition:offset", or "" when the record was never on a topic

    def record_headers(self) -> list[tuple[str, bytes]]:
        """Original headers followed by the dlq.* ones (kafka-python's header format)."""
        kept = [(k, v) for k, v in self.headers if not k.startswith("dlq.")]
        return kept + [
            (REASON, self.reason[:MAX_REASON_CHARS].encode()),
            (STAGE, self.stage.encode()),
            (KIND, self.kind.encode()),
            (SOURCE, self.source.encode()),
        ]

    @classmethod
    def from_record(cls, key: bytes | None, value: bytes | None, headers) -> "DeadLetter":
        """Rebuild a dead letter read back from rollout.dlq."""
        pairs = [(k, bytes(v) if v is not None else b"") for k, v in (headers or [])]
        found = {k: v.decode(errors="replace") for k, v in pairs if k.startswith("dlq.")}
        return cls(key, value, [(k, v) for k, v in pairs if not k.startswith("dlq.")],
                   found.get(REASON, ""), found.get(STAGE, ""), found.get(KIND, ""), found.get(SOURCE, ""))


def source_of(topic: str, partition: int, offset: int) -> str:
    return f"{topic}:{partition}:{offset}"
