"""What the records on each topic hold: turn headers, episode records, metrics records.

Stages meet only through these shapes (and ``topics.py`` for the names), so a producer, a stream
worker and a shard writer written apart still agree byte for byte. Pure: builds and parses bytes,
talks to no broker.

- rollout.turns: key ``rollout_key_string``; value ``encode_samples([turn], TURN_FIELDS)``;
  headers ``TurnHeaders``.
- rollout.episodes: key the same; value ``encode_samples(segments, TURN_FIELDS, metadata=...)``
  where the metadata is ``EpisodeInfo`` (attempt, turns, group_size, sent_at of the final turn,
  event time); headers repeat attempt/group_size/schema for consumers that filter without decoding.
- rollout.metrics: compact JSON, ``window_metrics_record`` / ``batch_metrics_record``.
- rollout.shards: compact, sorted JSON: a batch's manifest plus where it lies (``dir`` and
  ``manifest_path`` relative to the writer's output root, ``manifest_sha256``, and ``out_root``, the
  writer's own absolute root: a hint for readers on its machine), built by ``announcement_value`` and read back by
  ``parse_announcement`` (None for a record that is not an announcement). Control records there:
  ``batch-skipped`` (``BatchSkipped``: a seq that will never be written) and ``end-of-run``
  (``BatchesEnded``: the run is over, every seq below ``next_seq`` announced or skipped), so a
  trainer following the batches in seq order never waits for a batch that cannot come.
- rollout.weights (compacted): ``WeightVersion``, the trainer's live weight version, key
  ``WEIGHTS_KEY``.
- Keys: ``parse_rollout_key`` reads a rollout key string back (``topics.rollout_key_string``);
  ``rollout_key_adapter`` is its adapter name, None for a key that names none or is no rollout key.
- Control records, told apart from data by the ``control`` header (data records never carry it),
  so batch boundaries follow from the log alone, never from a clock:

  - ``end-of-run`` (``EndOfRun``): the generator sends one to every partition of rollout.turns once
    all its turns are acknowledged; each stream worker forwards it, after every episode of that
    turns partition is acknowledged, to every partition of rollout.episodes with the turns
    partition it came from. A shard writer that has seen the marker of every turns partition on
    every episodes partition knows nothing more will come, and writes the last, partial batch.
  - ``abandoned`` (``Abandoned``): the stream stage sends one on rollout.episodes, keyed by the
    rollout key, for an episode whose final turn it dead-lettered (or whose episode record could
    not be written): the episode will never arrive, so its group completes without it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path, PurePath
from typing import Any, Iterable

from rollout_bus.wire.codec import COMPUTED_FIELDS, SAMPLING_MASK_FIELDS, decode_samples, encode_samples
from rollout_bus.errors import CodecError, ContractError, must_be
from rollout_bus.model.sample import AdapterRef, Sample
from rollout_bus.wire.topics import (HEADER_ATTEMPT, HEADER_CONTROL, HEADER_FINAL, HEADER_GROUP_SIZE, HEADER_SCHEMA,
                                HEADER_SENT_AT, HEADER_TURN, SCHEMA_VERSION)

TURN_FIELDS = COMPUTED_FIELDS + SAMPLING_MASK_FIELDS
METRIC_PREFIX = "rollout/"


@dataclass(frozen=True)
class TurnHeaders:
    """The headers of a rollout.turns record (PIPELINE.md)."""

    turn: int
    attempt: int
    final: bool
    group_size: int
    sent_at_ms: int
    schema: str = SCHEMA_VERSION

    def to_kafka(self) -> list[tuple[str, bytes]]:
        return [(HEADER_TURN, str(self.turn).encode()), (HEADER_ATTEMPT, str(self.attempt).encode()),
                (HEADER_FINAL, b"1" if self.final else b"0"), (HEADER_GROUP_SIZE, str(self.group_size).encode()),
                (HEADER_SCHEMA, self.schema.encode()), (HEADER_SENT_AT, str(self.sent_at_ms).encode())]

    @classmethod
    def from_kafka(cls, headers: Iterable[tuple[str, bytes]] | None) -> "TurnHeaders":
        """Parse and check the headers; ContractError names the header that is missing or wrong."""
        found = {k: v for k, v in (headers or [])}

        def integer(name: str, minimum: int) -> int:
            raw = found.get(name)
            if raw is None:
                raise ContractError(f"header {name!r} is missing")
            text = bytes(raw)
            if not (text.isdigit() or (text[:1] == b"-" and text[1:].isdigit())):  # ASCII digits only (WIRE.md)
                raise ContractError(f"header {name!r} must be a decimal integer in ASCII digits (got {text!r})")
            value = int(text)
            if value < minimum:
                raise ContractError(f"header {name!r} must be >= {minimum} (got {value})")
            return value

        schema = bytes(found.get(HEADER_SCHEMA, b"")).decode("ascii", "replace")
        if schema != SCHEMA_VERSION:
            raise ContractError(f"header {HEADER_SCHEMA!r} must be {SCHEMA_VERSION!r} (got {schema!r})")
        final = integer(HEADER_FINAL, 0)
        if final not in (0, 1):
            raise ContractError(f"header {HEADER_FINAL!r} must be 0 or 1 (got {final})")
        return cls(turn=integer(HEADER_TURN, 0), attempt=integer(HEADER_ATTEMPT, 0), final=bool(final),
                   group_size=integer(HEADER_GROUP_SIZE, 1), sent_at_ms=integer(HEADER_SENT_AT, 0), schema=schema)


@dataclass(frozen=True)
class EpisodeInfo:
    """Facts about a finished episode that travel with its segments on rollout.episodes."""

    attempt: int
    turns: int
    group_size: int
    final_sent_at_ms: int
    event_time_ms: int

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER_ATTEMPT, str(self.attempt).encode()), (HEADER_GROUP_SIZE, str(self.group_size).encode()),
                (HEADER_SCHEMA, SCHEMA_VERSION.encode()), (HEADER_SENT_AT, str(self.final_sent_at_ms).encode())]


def encode_episode(segments: list[Sample], info: EpisodeInfo) -> bytes:
    """One rollout.episodes value: the merged sibling segments with their masks, plus ``info``."""
    return encode_samples(segments, TURN_FIELDS, metadata={"episode": asdict(info)})


def decode_episode(payload: bytes) -> tuple[list[Sample], EpisodeInfo]:
    """Inverse of ``encode_episode``; CodecError when the payload or its episode info is malformed."""
    segments, metadata = decode_samples(payload, TURN_FIELDS)
    raw = metadata.get("episode") if isinstance(metadata, dict) else None
    try:
        info = EpisodeInfo(**raw)
    except TypeError as exc:
        raise CodecError(f"episode record: metadata 'episode' must hold {list(EpisodeInfo.__dataclass_fields__)} "
                         f"(got {raw!r})") from exc
    if not segments:
        raise CodecError("episode record holds no segments")
    return segments, info


def prefixed(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metric names as loggers publish them: everything under ``rollout/``."""
    return {f"{METRIC_PREFIX}{k}": v for k, v in sorted(metrics.items())}


def window_metrics_record(window_start_ms: int, window_end_ms: int, adapter: str | None,
                          metrics: dict[str, Any], *, episodes: int, closed: bool, partition: int | None = None,
                          offset: int | None = None, stats: str | None = None) -> bytes:
    """A window's metrics; the stream stage adds the source ``partition`` it covers, the highest
    final-turn ``offset`` absorbed, and the ``EpisodeStats`` JSON (``stats``) so readers can merge
    the per-partition partials of one window exactly."""
    doc = {"kind": "window", "window": {"start_ms": window_start_ms, "end_ms": window_end_ms},
           "adapter": adapter, "episodes": episodes, "closed": closed, "metrics": prefixed(metrics)}
    extra = {"partition": partition, "offset": offset, "stats": stats}
    doc.update({k: v for k, v in extra.items() if v is not None})
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def batch_metrics_record(batch_seq: int, metrics: dict[str, Any], *, samples: int, manifest_path: str) -> bytes:
    doc = {"kind": "batch", "batch": batch_seq, "samples": samples, "manifest": manifest_path,
           "metrics": prefixed(metrics)}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------- keys

RolloutKeyParts = tuple[AdapterRef | None, str, int, int]


def parse_rollout_key(key: bytes | str | None) -> RolloutKeyParts:
    """Inverse of ``topics.rollout_key_string``: ``(adapter, kind, group_index, id)``.

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
    if kind not in ("rollout", "sample") or not integral(group_index) or group_index < 0 or not integral(ident):
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


# ------------------------------------------------------------------------------ shard announcements

ANNOUNCEMENT_PLACE = ("dir", "manifest_path", "manifest_sha256")
ANNOUNCEMENT_OUT_ROOT = "out_root"  # absent from announcements written before it existed (their dir is absolute)


@dataclass(frozen=True)
class ShardAnnouncement:
    """One rollout.shards record: a written batch's manifest and where it lies.

    ``dir`` and ``manifest_path`` are relative to the writer's output root (``batch-00000003``), so
    a trainer that mounts the shards elsewhere finds them under its own root; ``out_root`` is the
    writer's absolute root, used when the reader names none. Older announcements carry absolute
    paths and no ``out_root``: ``batch_dir`` reads both."""

    manifest: dict[str, Any]
    dir: str
    manifest_path: str
    manifest_sha256: str
    out_root: str | None = None

    @property
    def seq(self) -> int:
        return int(self.manifest["seq"])

    @property
    def batch_name(self) -> str:
        """The batch directory's own name, however ``dir`` was written."""
        return PurePath(self.dir).name

    def batch_dir(self, root: str | os.PathLike[str] | None = None) -> Path:
        """Where the batch lies for this reader: under ``root`` when given, else where the writer put it."""
        if root is not None:
            return Path(root) / self.batch_name
        return Path(self.out_root or "") / self.dir  # an absolute dir (older records) ignores the prefix


def announcement_value(announcement: ShardAnnouncement) -> bytes:
    """The rollout.shards value (compact, sorted JSON: the manifest's keys and the place keys)."""
    doc = {**announcement.manifest, "dir": announcement.dir, "manifest_path": announcement.manifest_path,
           "manifest_sha256": announcement.manifest_sha256}
    if announcement.out_root is not None:
        doc[ANNOUNCEMENT_OUT_ROOT] = announcement.out_root
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def parse_announcement(value: bytes | None) -> ShardAnnouncement | None:
    """The announcement a rollout.shards value holds, or None for any other record (not ours to judge)."""
    try:
        doc = json.loads(value) if value else None
    except (UnicodeDecodeError, ValueError):
        return None
    if not (isinstance(doc, dict) and isinstance(doc.get("seq"), int) and isinstance(doc.get("shards"), list)
            and all(isinstance(doc.get(k), str) for k in ANNOUNCEMENT_PLACE)):
        return None
    out_root = doc.get(ANNOUNCEMENT_OUT_ROOT)
    manifest = {k: v for k, v in doc.items() if k not in ANNOUNCEMENT_PLACE and k != ANNOUNCEMENT_OUT_ROOT}
    return ShardAnnouncement(manifest, doc["dir"], doc["manifest_path"], doc["manifest_sha256"],
                             out_root if isinstance(out_root, str) else None)


# ------------------------------------------------------------------------------- control records

CONTROL_END_OF_RUN = "end-of-run"
CONTROL_ABANDONED = "abandoned"
END_OF_RUN_KEY = b"end-of-run"


def control_kind(headers: Iterable[tuple[str, bytes]] | None) -> str | None:
    """The ``control`` header's value (``end-of-run``, ``abandoned``), or None for a data record."""
    for name, value in headers or ():
        if name == HEADER_CONTROL:
            return bytes(value or b"").decode("ascii", "replace")
    return None


def _control_doc(value: bytes | None, what: str, fields: dict[str, type]) -> dict[str, Any]:
    try:
        doc = json.loads(value) if value is not None else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise ContractError(must_be(f"{what} record value", f"a JSON object with {sorted(fields)}",
                                    value[:200] if value else value))
    for name, kind in fields.items():
        found = doc.get(name)
        if found is None and name in _NULLABLE:
            continue
        if not isinstance(found, kind) or (kind is int and isinstance(found, bool)):
            raise ContractError(must_be(f"{what} field {name!r}", kind.__name__, found))
    return doc


_NULLABLE = {"turns_partition", "turns_partitions"}


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
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER_CONTROL, CONTROL_END_OF_RUN.encode()), (HEADER_SCHEMA, SCHEMA_VERSION.encode())]

    def forwarded(self, turns_partition: int, turns_partitions: int) -> "EndOfRun":
        return EndOfRun(self.run, turns_partition, turns_partitions)

    @classmethod
    def from_value(cls, value: bytes | None) -> "EndOfRun":
        doc = _control_doc(value, "end-of-run", {"run": str, "turns_partition": int, "turns_partitions": int})
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
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER_CONTROL, CONTROL_ABANDONED.encode()), (HEADER_ATTEMPT, str(self.attempt).encode()),
                (HEADER_GROUP_SIZE, str(self.group_size).encode()), (HEADER_SCHEMA, SCHEMA_VERSION.encode())]

    @classmethod
    def from_value(cls, value: bytes | None) -> "Abandoned":
        doc = _control_doc(value, "abandoned", {"attempt": int, "group_size": int, "kind": str, "reason": str,
                                                "source": str})
        if doc["attempt"] < 0 or doc["group_size"] < 1:
            raise ContractError(must_be("abandoned attempt/group_size", ">= 0 / >= 1",
                                        (doc["attempt"], doc["group_size"])))
        return cls(doc["attempt"], doc["group_size"], doc["kind"], doc["reason"], doc["source"])


CONTROL_BATCH_SKIPPED = "batch-skipped"


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
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER_CONTROL, CONTROL_BATCH_SKIPPED.encode()), (HEADER_SCHEMA, SCHEMA_VERSION.encode())]

    @classmethod
    def from_value(cls, value: bytes | None) -> "BatchSkipped":
        doc = _control_doc(value, "batch-skipped", {"seq": int, "why": str, "reason": str})
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
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER_CONTROL, CONTROL_END_OF_RUN.encode()), (HEADER_SCHEMA, SCHEMA_VERSION.encode())]

    @classmethod
    def from_value(cls, value: bytes | None) -> "BatchesEnded":
        doc = _control_doc(value, "end-of-run", {"run": str, "next_seq": int})
        if doc["next_seq"] < 0:
            raise ContractError(must_be("end-of-run next_seq", ">= 0", doc["next_seq"]))
        return cls(doc["run"], doc["next_seq"])


# ---------------------------------------------------------------------------------------- weights

WEIGHTS_KEY = b"policy"


@dataclass(frozen=True)
class WeightVersion:
    """rollout.weights: the trainer's weights at ``version`` are live (published after optimizer step
    ``step``; ``published_at`` in ms since the epoch). Keyed ``WEIGHTS_KEY`` on a compacted topic, so
    the latest version is what a reader that starts late finds. Versions only grow."""

    version: int
    step: int
    published_at: int

    def value(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_value(cls, value: bytes | None) -> "WeightVersion":
        doc = _control_doc(value, "weights", {"version": int, "step": int, "published_at": int})
        if doc["version"] < 0 or doc["step"] < 0:
            raise ContractError(must_be("weights version/step", ">= 0", (doc["version"], doc["step"])))
        return cls(doc["version"], doc["step"], doc["published_at"])
