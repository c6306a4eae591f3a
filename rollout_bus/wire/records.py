"""What the records on each topic hold: turn headers, episode records, metrics records.

Stages meet only through these shapes (and ``topics.py`` for the names), so a producer, a stream
worker and a shard writer written apart still agree byte for byte. Pure: builds and parses bytes,
talks to no broker.

- rollout.turns: key ``rollout_key_string``; value ``encode_samples([turn], TURN_FIELDS)``;
  headers ``TurnHeaders``.
- rollout.episodes: key the same; value ``encode_samples(segments, TURN_FIELDS, metadata=...)``
  where the metadata is ``EpisodeInfo`` (attempt, turns, group_size, sent_at of the final turn,
  event time); headers repeat attempt/group_size/schema for consumers that filter without decoding.
- rollout.metrics: compact JSON, ``window_metrics_record`` / ``batch_metrics_record`` / ``flow_metrics_record``
  (a generator's or a trainer's flow so far, key ``flow_key``); ``fold_window_records`` merges a window's
  per-partition partials back into one.
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
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path, PurePath
from typing import Any

from rollout_bus.wire.compact_json import compact_json
from rollout_bus.wire.codec import COMPUTED_FIELDS, SAMPLING_MASK_FIELDS, decode_samples, encode_samples
from rollout_bus.errors import CodecError, ContractError, must_be
from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.model.sample import Sample
from rollout_bus.wire.headers import (CONTROL_ABANDONED, CONTROL_BATCH_SKIPPED, CONTROL_END_OF_RUN, HEADER_ATTEMPT,
                                      HEADER_CONTROL, HEADER_GROUP_SIZE, HEADER_SCHEMA, HEADER_SENT_AT, SCHEMA_VERSION)

TURN_FIELDS = COMPUTED_FIELDS + SAMPLING_MASK_FIELDS
METRIC_PREFIX = "rollout/"


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
    return compact_json(doc)


@dataclass(frozen=True)
class WindowFold:
    """One window of one adapter, folded from its per-source-partition partials (``fold_window_records``)."""

    start_ms: int
    end_ms: int
    adapter: str | None
    partials: dict[int | None, Mapping[str, Any]]  # the last record of each source partition, in merge order
    latest: Mapping[str, Any]  # the partial that arrived last
    stats: EpisodeStats | None  # the partials' merged stats; None when none carries readable ones
    unmerged: int  # partials left out of ``stats``: without stats, or (``strict=False``) unreadable ones

    @property
    def closed(self) -> bool:
        """A window is closed once every source partition has closed it."""
        return all(bool(doc.get("closed")) for doc in self.partials.values())


def fold_window_records(records: Iterable[bytes | str | Mapping[str, Any]], *, order: str = "partition",
                        strict: bool = True) -> dict[tuple[int, int, str | None], WindowFold]:
    """rollout.metrics window records (values or parsed, in topic order) folded per ``(start_ms, end_ms,
    adapter)``, in the order each first appears; other records, and windows that cannot be read, are skipped.

    Each ``window_metrics_record`` of the stream stage is the full state of one ``(window, adapter, source
    partition)`` partial, so the last record of each partial replaces the earlier ones, and the partials'
    ``stats`` merge exactly (``EpisodeStats.merge``; averaging their ``metrics`` would be wrong).
    ``order``: partials merge by source partition (``"partition"``, one naming none first) or in the
    order each partition first appeared (``"arrival"``); it matters only where partials disagree on
    the reward source (the first episode picks it). ``strict``: unreadable ``stats`` raise
    ``ContractError``, else (False) their partial is left out of ``stats`` and counted in ``unmerged``.
    """
    if order not in ("partition", "arrival"):
        raise ContractError(must_be("order", "'partition' or 'arrival'", order))
    found: dict[tuple[int, int, str | None], dict[int | None, Mapping[str, Any]]] = {}
    latest: dict[tuple[int, int, str | None], Mapping[str, Any]] = {}
    for record in records:
        doc = json.loads(record) if isinstance(record, (bytes, bytearray, str)) else record
        if not isinstance(doc, Mapping) or doc.get("kind") != "window":
            continue
        try:
            wid = (int(doc["window"]["start_ms"]), int(doc["window"]["end_ms"]), doc.get("adapter"))
        except (KeyError, TypeError, ValueError):
            continue
        partition = doc.get("partition")
        found.setdefault(wid, {})[int(partition) if partition is not None else None] = doc
        latest[wid] = doc
    folds = {}
    for wid, partials in found.items():
        if order == "partition":
            partials = dict(sorted(partials.items(), key=lambda item: (item[0] is not None, item[0] or 0)))
        merged, unmerged = None, 0
        for doc in partials.values():
            try:
                stats = EpisodeStats.from_json(doc["stats"]) if "stats" in doc else None
            except ContractError:
                if strict:
                    raise
                stats = None
            if stats is None:
                unmerged += 1
            else:
                merged = stats if merged is None else merged.merge(stats)
        folds[wid] = WindowFold(*wid, partials, latest[wid], merged, unmerged)
    return folds


def batch_metrics_record(batch_seq: int, metrics: dict[str, Any], *, samples: int, manifest_path: str) -> bytes:
    doc = {"kind": "batch", "batch": batch_seq, "samples": samples, "manifest": manifest_path,
           "metrics": prefixed(metrics)}
    return compact_json(doc)


FLOW_STAGES = ("generator", "trainer")


def flow_key(stage: str, source: str) -> bytes:
    """The key of one source's flow records: ``flow:{stage}:{source}`` (ASCII)."""
    return f"flow:{stage}:{source}".encode("ascii", "replace")


def flow_metrics_record(stage: str, source: str, metrics: dict[str, Any], *, elapsed_s: float, final: bool) -> bytes:
    """A generator's or a trainer's flow since it started: ``metrics`` (keys without ``rollout/``) are totals
    over ``elapsed_s`` seconds, so the latest record of a (stage, source) is all a reader needs; ``final``
    on the last one, sent as it ends."""
    if stage not in FLOW_STAGES:
        raise ContractError(must_be("stage", f"one of {', '.join(FLOW_STAGES)}", stage))
    doc = {"kind": "flow", "stage": stage, "source": source, "elapsed_s": round(float(elapsed_s), 3),
           "final": bool(final), "metrics": prefixed(metrics)}
    return compact_json(doc)


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
    return compact_json(doc, allow_nan=False)


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

END_OF_RUN_KEY = b"end-of-run"


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
        return compact_json(asdict(self))

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
        return compact_json(asdict(self))

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
        return compact_json(asdict(self))

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
    the latest version is what a reader that starts late finds. Versions only grow.

    A trainer that ships its weights adds where they are: ``uri`` (``file://`` and an absolute path to
    a safetensors checkpoint), its ``sha256`` (hex) and its size in ``bytes``; the three come together
    or not at all (a stand-in trainer publishes stamps only)."""

    version: int
    step: int
    published_at: int
    uri: str | None = None
    sha256: str | None = None
    bytes: int | None = None

    def value(self) -> bytes:
        return compact_json({k: v for k, v in asdict(self).items() if v is not None})

    @property
    def path(self) -> str | None:
        """The checkpoint's local path (``uri`` without ``file://``), or None without one."""
        return self.uri[len("file://"):] if self.uri is not None else None

    @classmethod
    def from_value(cls, value: bytes | None) -> "WeightVersion":
        doc = _control_doc(value, "weights", {"version": int, "step": int, "published_at": int})
        if doc["version"] < 0 or doc["step"] < 0:
            raise ContractError(must_be("weights version/step", ">= 0", (doc["version"], doc["step"])))
        ref = {k: doc.get(k) for k in ("uri", "sha256", "bytes")}
        if any(v is not None for v in ref.values()):
            uri, sha, size = ref["uri"], ref["sha256"], ref["bytes"]
            if not (isinstance(uri, str) and uri.startswith("file:///")):
                raise ContractError(must_be("weights field 'uri'", "a file:/// URI", uri))
            if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
                raise ContractError(must_be("weights field 'sha256'", "64 lowercase hex digits", sha))
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ContractError(must_be("weights field 'bytes'", "an int >= 0", size))
        return cls(doc["version"], doc["step"], doc["published_at"], ref["uri"], ref["sha256"], ref["bytes"])
