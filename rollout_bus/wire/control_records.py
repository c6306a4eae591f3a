"""The control records: told apart from data by the ``control`` header (data records never carry it), so
batch boundaries follow from the log alone, never from a clock.

Why: a generator, a stream worker and a shard writer written apart must agree when a run is over and
which episodes or batches will never come; these records say so, byte for byte. Pure: builds and
parses bytes, talks to no broker.

Contract:

- ``end-of-run`` (``EndOfRun``): the generator sends one to every partition of rollout.turns once
  all its turns are acknowledged; each stream worker forwards it, after every episode of that
  turns partition is acknowledged, to every partition of rollout.episodes with the turns
  partition it came from. A shard writer that has seen the marker of every turns partition on
  every episodes partition knows nothing more will come, and writes the last, partial batch.
- ``abandoned`` (``Abandoned``): the stream stage sends one on rollout.episodes, keyed by the
  rollout key, for an episode whose final turn it dead-lettered (or whose episode record could
  not be written): the episode will never arrive, so its group completes without it.
- On rollout.shards: ``batch-skipped`` (``BatchSkipped``: a seq that will never be written) and
  ``end-of-run`` (``BatchesEnded``: the run is over, every seq below ``next_seq`` announced or
  skipped), so a trainer following the batches in seq order never waits for a batch that cannot come.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rollout_bus.errors import ContractError, must_be
from rollout_bus.wire.compact_json import compact_json
from rollout_bus.wire.headers import (CONTROL_ABANDONED, CONTROL_BATCH_SKIPPED, CONTROL_END_OF_RUN, HEADER_ATTEMPT,
                                      HEADER_CONTROL, HEADER_GROUP_SIZE, HEADER_SCHEMA, SCHEMA_VERSION)
from rollout_bus.wire.record_fields import record_fields

END_OF_RUN_KEY = b"end-of-run"
_NULLABLE = ("turns_partition", "turns_partitions")  # an end-of-run marker on rollout.turns has neither


@dataclass(frozen=True)
class EndOfRun:
    """No more turns will follow on a partition: the run (``run``, the generator's id) is over.

    On rollout.turns ``turns_partition``/``turns_partitions`` are None; the stream stage fills
    them in when it forwards the marker to rollout.episodes.
    """

    run: str
    turns_partition: int | None = None
    turns_partitions: int | None = None

    def value(self) -> bytes:
        return compact_json(asdict(self))

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER_CONTROL, CONTROL_END_OF_RUN.encode()), (HEADER_SCHEMA, SCHEMA_VERSION.encode())]

    def forwarded(self, turns_partition: int, turns_partitions: int) -> "EndOfRun":
        return EndOfRun(self.run, turns_partition, turns_partitions)

    @classmethod
    def from_value(cls, value: bytes | None) -> "EndOfRun":
        doc = record_fields(value, "end-of-run", {"run": str, "turns_partition": int, "turns_partitions": int},
                            _NULLABLE)
        return cls(doc["run"], doc["turns_partition"], doc["turns_partitions"])


@dataclass(frozen=True)
class Abandoned:
    """An episode that will never reach rollout.episodes, and why (its turns are in the DLQ)."""

    attempt: int
    group_size: int
    kind: str    # the dead-letter kind that ended it (merge, gap, decode, too_large, ...)
    reason: str
    source: str  # topic:partition:offset of the final turn

    def value(self) -> bytes:
        return compact_json(asdict(self))

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER_CONTROL, CONTROL_ABANDONED.encode()), (HEADER_ATTEMPT, str(self.attempt).encode()),
                (HEADER_GROUP_SIZE, str(self.group_size).encode()), (HEADER_SCHEMA, SCHEMA_VERSION.encode())]

    @classmethod
    def from_value(cls, value: bytes | None) -> "Abandoned":
        doc = record_fields(value, "abandoned", {"attempt": int, "group_size": int, "kind": str, "reason": str,
                                                "source": str})
        if doc["attempt"] < 0 or doc["group_size"] < 1:
            raise ContractError(must_be("abandoned attempt/group_size", ">= 0 / >= 1",
                                        (doc["attempt"], doc["group_size"])))
        return cls(doc["attempt"], doc["group_size"], doc["kind"], doc["reason"], doc["source"])


@dataclass(frozen=True)
class BatchSkipped:
    """rollout.shards: batch ``seq`` will never be written, so a reader following the batches in
    seq order moves past it. ``why``: ``empty`` (every group of it abandoned) or ``dead-lettered``
    (the whole-batch check refused it: its episodes are in the DLQ with the reason). Keyed like an
    announcement, by the seq."""

    seq: int
    why: str
    reason: str

    def key(self) -> bytes:
        return str(self.seq).encode()

    def value(self) -> bytes:
        return compact_json(asdict(self))

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER_CONTROL, CONTROL_BATCH_SKIPPED.encode()), (HEADER_SCHEMA, SCHEMA_VERSION.encode())]

    @classmethod
    def from_value(cls, value: bytes | None) -> "BatchSkipped":
        doc = record_fields(value, "batch-skipped", {"seq": int, "why": str, "reason": str})
        if doc["seq"] < 0:
            raise ContractError(must_be("batch-skipped seq", ">= 0", doc["seq"]))
        return cls(doc["seq"], doc["why"], doc["reason"])


@dataclass(frozen=True)
class BatchesEnded:
    """rollout.shards: run ``run`` is over and every batch below ``next_seq`` has been announced or
    skipped, so a reader that has them all has the whole run (key ``END_OF_RUN_KEY``; the shard
    writer sends it once the run's last, partial batch is written)."""

    run: str
    next_seq: int

    def value(self) -> bytes:
        return compact_json(asdict(self))

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER_CONTROL, CONTROL_END_OF_RUN.encode()), (HEADER_SCHEMA, SCHEMA_VERSION.encode())]

    @classmethod
    def from_value(cls, value: bytes | None) -> "BatchesEnded":
        doc = record_fields(value, "end-of-run", {"run": str, "next_seq": int})
        if doc["next_seq"] < 0:
            raise ContractError(must_be("end-of-run next_seq", ">= 0", doc["next_seq"]))
        return cls(doc["run"], doc["next_seq"])
