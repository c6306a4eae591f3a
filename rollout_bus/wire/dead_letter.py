"""The dead-letter record: what any stage sends to rollout.dlq instead of dropping a record.

A dead letter keeps the original key and value byte for byte, keeps the original headers, and
adds ``dlq.reason`` (human-readable), ``dlq.stage``, ``dlq.source`` (``topic:partition:offset``)
and ``dlq.kind`` (a short, stable reason class for counting). Original headers keep their names, so
a replay can strip the ``dlq.`` ones and republish the record unchanged. A ``lost`` dead letter has no
original (the records were deleted before the stage read them): an empty key, no value, the first lost offset in
``dlq.source`` and how many in ``dlq.lost`` (``lost_letter``).

``DlqStage`` and ``DlqKind`` are every value those two headers take, and ``KINDS_BY_STAGE`` which
stage writes which kind: the one list, which WIRE.md section 9 and ``schemas/dlq_headers.json`` spell
out for other languages (a test holds the three equal). A new kind starts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class DlqStage(StrEnum):
    """Which stage dead-lettered a record (``dlq.stage``)."""

    GENERATOR = "generator"
    STREAM = "stream"
    SHARDS = "shards"


class DlqKind(StrEnum):
    """Why, as a short, stable class for counting (``dlq.kind``)."""

    KEY = "key"                # no key, or not the sample's own rollout key
    HEADERS = "headers"        # a turn header missing, not decimal, out of range, or an unknown schema
    DECODE = "decode"          # the value does not decode
    VALIDATION = "validation"  # not exactly one sample in a turn
    FINISHED = "finished"      # a turn or attempt for an episode already emitted or abandoned
    GAP = "gap"                # a turn that skips one
    STATE = "state"            # a stored turn missing from the stream worker's state
    MERGE = "merge"            # the episode's turns cannot be merged
    ABANDONED = "abandoned"    # a stored turn of an episode whose final turn was dead-lettered
    PARTITION = "partition"    # a re-routed turn still on the wrong partition, or too large to re-route
    CONTROL = "control"        # a control record that does not parse, or an unknown one
    TOO_LARGE = "too_large"    # over the record limit: dead-lettered by reference
    LATE = "late"              # an episode for a batch already formed
    GROUP = "group"            # a group_size that disagrees with its group, a full group, a retry elsewhere
    STALE = "stale"            # older than the staleness bound allows for its batch
    MASK_CHECK = "mask-check"  # the whole-batch sampling-mask check failed
    CONVERT = "convert"        # any other refusal converting the batch
    LOST = "lost"              # records deleted (retention, delete-records) before the stage read them
    COLLISION = "collision"    # a turn for an episode another generator already holds (same rollout key)
    UNFINISHED = "unfinished"  # a stored turn of an episode with no final turn when the run ended on its partition
    FAILED_PROMPT = "failed_prompt"  # a prompt group given up after its deliveries (the engine or the plug-ins failed every time)


KINDS_BY_STAGE: dict[DlqStage, tuple[DlqKind, ...]] = {
    DlqStage.GENERATOR: (DlqKind.DECODE, DlqKind.FAILED_PROMPT),
    DlqStage.STREAM: (DlqKind.KEY, DlqKind.HEADERS, DlqKind.DECODE, DlqKind.VALIDATION, DlqKind.FINISHED,
                      DlqKind.GAP, DlqKind.STATE, DlqKind.MERGE, DlqKind.ABANDONED, DlqKind.PARTITION,
                      DlqKind.CONTROL, DlqKind.TOO_LARGE, DlqKind.LOST, DlqKind.COLLISION,
                      DlqKind.UNFINISHED),
    DlqStage.SHARDS: (DlqKind.DECODE, DlqKind.CONTROL, DlqKind.LATE, DlqKind.GROUP, DlqKind.STALE,
                      DlqKind.MASK_CHECK, DlqKind.CONVERT, DlqKind.TOO_LARGE, DlqKind.LOST),
}

REASON = "dlq.reason"
STAGE = "dlq.stage"
SOURCE = "dlq.source"
KIND = "dlq.kind"
LOST = "dlq.lost"  # kind ``lost`` only: how many offsets from ``dlq.source``'s were deleted unread
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
    lost: int = 0  # kind ``lost``: the offsets [source's, source's + lost) were deleted before they were read

    def record_headers(self) -> list[tuple[str, bytes]]:
        """Original headers followed by the dlq.* ones (kafka-python's header format)."""
        kept = [(k, v) for k, v in self.headers if not k.startswith("dlq.")]
        return kept + [
            (REASON, self.reason[:MAX_REASON_CHARS].encode()),
            (STAGE, self.stage.encode()),
            (KIND, self.kind.encode()),
            (SOURCE, self.source.encode()),
        ] + ([(LOST, b"%d" % self.lost)] if self.lost else [])

    @classmethod
    def from_record(cls, key: bytes | None, value: bytes | None, headers) -> "DeadLetter":
        """Rebuild a dead letter read back from rollout.dlq."""
        pairs = [(k, bytes(v) if v is not None else b"") for k, v in (headers or [])]
        found = {k: v.decode(errors="replace") for k, v in pairs if k.startswith("dlq.")}
        lost = found.get(LOST, "0")
        return cls(key, value, [(k, v) for k, v in pairs if not k.startswith("dlq.")],
                   found.get(REASON, ""), found.get(STAGE, ""), found.get(KIND, ""), found.get(SOURCE, ""),
                   int(lost) if lost.isdigit() else 0)


def lost_letter(stage: str, topic: str, partition: int, first: int, count: int, log_start: int) -> DeadLetter:
    """The dead letter that names records deleted before ``stage`` read them: an empty key (Kafka's clients
    need a key or a value), no value, the first offset in ``dlq.source`` and how many in ``dlq.lost``."""
    last = first + count - 1
    reason = (f"{topic} partition {partition}: offsets {first}..{last} ({count} records) were deleted before this "
              f"stage read them (the log now starts at {log_start}: retention, or records deleted by hand); "
              f"their episodes are incomplete")
    return DeadLetter(b"", None, [], reason, stage, DlqKind.LOST, source_of(topic, partition, first), count)


def source_of(topic: str, partition: int, offset: int) -> str:
    return f"{topic}:{partition}:{offset}"
