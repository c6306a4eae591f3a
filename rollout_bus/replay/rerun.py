"""Rebuild trainer shards from an offset range of rollout.episodes or rollout.turns, and say what differs.

Contract:

* ``replay(client_kwargs, starts, out_dir=..., ...)`` reads the ranges with its own consumer
  (``kafka.reader.open_reader``: no group, no commits, nothing published) up to the end offsets at
  start (``to``: exclusive, for every range), and rebuilds batches into ``out_dir`` with the shard
  writer's own code: ``rollout_bus.consumers.shard_writer.batcher`` forms the batches, and
  ``rollout_bus.consumers.shard_writer.decide`` is the writer's own decision (its staleness net, with the
  ``max_staleness`` its manifests record in step batching; the empty batch; the conversion with the
  whole-batch check; the DP split) and write step.
  All ranges must be of one topic, ``rollout.episodes`` or ``rollout.turns`` (prefixed or not).
* From rollout.turns, episodes are first re-merged offline by the stream stage's own per-record
  logic (``rollout_bus.streams.processor.TurnProcessor`` over an in-memory table: the same duplicate,
  attempt, gap and merge rules, ``share_final_reward``); what it would have dead-lettered is
  reported, and episodes whose final turn lies outside the range are counted as open.
* The original manifests come from ``compare_dir`` (a shards directory, only read) when given,
  else from the announcements on the run's rollout.shards (same prefix as the source topic).
  Unset settings (batching, dp_size, groups_per_batch, normalization) are read from them
  (``groups_per_batch`` inferred from a full batch's groups), else the shard writer's defaults;
  ``ReplaySettings.sources`` says where each came from, and a flag that disagrees is warned about.
* Records are parsed as the writer parses them (``rollout_bus.consumers.shard_writer.episodes.parse_record``): episodes
  and ``abandoned`` records go to the batcher (an abandoned record completes its group, as in the
  writer, and the rebuilt manifest lists it); end-of-run markers are skipped, the leftovers being
  flushed at the end of the range anyway. A batch whose groups are all abandoned is not written
  (the writer writes none either) and gets no report.
* A batch is written when it is complete (``Batcher.ready``) or, for the leftovers that
  ``Batcher.flush`` returns at the end, when its episodes are exactly a manifest's episodes (the
  original was partial too) or ``write_partial`` is set. A batch holding only part of a
  manifest's episodes, or older attempts of them, is "incomplete" (not wholly inside the range)
  and is not written unless ``write_partial``. Each
  written batch is compared shard by shard (sha256) with its manifest of the same seq:
  ``identical`` / ``differs``; ``written`` when there is no manifest; ``dead-lettered`` when the
  whole-batch check refuses it (as the writer does); manifests no replayed episode touched are
  ``not-in-range``. In step mode batch contents are a function of the episodes alone, so a
  rebuilt batch is byte-identical to the original; arrival-mode seqs depend on read order and
  are compared as they come.
* ``out_dir`` must hold no batch yet and must not be ``compare_dir``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_bus.consumers.shard_writer.batcher import Batcher, Outcome
from rollout_bus.consumers.shard_writer.batch import Batch
from rollout_bus.wire.run_record import BATCHING_MODES
from rollout_bus.consumers.shard_writer.episodes import EndOfRunMarker, Episode, Member, parse_record
from rollout_bus.consumers.shard_writer.decide import Decision, Verdict, decide, write_decided
from rollout_bus.config import ShardSettings
from rollout_bus.wire.dead_letter import DlqKind, DlqStage, source_of
from rollout_bus.errors import ConfigError, ContractError, MissingTopicError, must_be
from rollout_bus.kafka.clients import wait_for_partitions
from rollout_bus.kafka.reader import open_reader, read_ranges, resolve_ranges
from rollout_bus.wire.positions import RangeStart, topic_kind, topic_prefix
from rollout_bus.wire.records import parse_announcement
from rollout_bus.wire.topics import Topics
from rollout_bus.model.train_data import NORMALIZATIONS
from rollout_bus.model.shards import read_manifest
from rollout_bus.streams.episode_state import EpisodeIndex
from rollout_bus.streams.processor import TurnProcessor, TurnRecord
from rollout_bus.streams.state import ChangelogState

logger = logging.getLogger(__name__)

SETTING_NAMES = ("batching", "dp_size", "groups_per_batch", "normalization")
Progress = Callable[[int, int], None]  # (records read, records in the ranges)
_NEVER_MS = 2**62  # offline merge: windows never close, their metrics are not wanted here


@dataclass(frozen=True)
class ReplaySettings:
    """The batching settings of the original run, and where each value came from."""

    batching: str
    dp_size: int
    groups_per_batch: int
    normalization: str
    sources: dict[str, str]
    warnings: tuple[str, ...] = ()
    max_staleness: int | None = None  # the writer's staleness net, as its manifests record it


@dataclass(frozen=True)
class Rejection:
    """A record the replayed stage would have sent to the DLQ."""

    source: str
    stage: str
    kind: str
    reason: str


@dataclass
class BatchReport:
    seq: int
    status: str  # identical | differs | written | incomplete | dead-lettered | not-in-range
    episodes: int
    expected_episodes: int | None = None
    shards: dict[str, str] = field(default_factory=dict)  # shard path -> sha256, of what was written
    detail: str = ""


@dataclass
class ReplayReport:
    topic: str
    kind: str
    ranges: list[str]
    records: int
    episodes: int
    settings: ReplaySettings
    manifests_from: str | None
    batches: list[BatchReport] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    open_episodes: int = 0

    def by_status(self) -> Counter[str]:
        return Counter(b.status for b in self.batches)

    @property
    def differs(self) -> bool:
        return any(b.status == "differs" for b in self.batches)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- manifests and settings


def manifests_in_dir(directory: str | Path) -> dict[int, dict[str, Any]]:
    """Every readable ``batch-*/manifest.json`` under ``directory`` by seq (read only, nothing cleaned)."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(must_be("--compare", "an existing shards directory", str(root)))
    found = {}
    for batch_dir in sorted(p for p in root.glob("batch-*") if p.is_dir()):
        try:
            manifest = read_manifest(batch_dir)
        except ContractError as exc:
            logger.warning("unreadable manifest dir=%s: %s", batch_dir, exc)
            continue
        if manifest is not None:
            found[int(manifest["seq"])] = manifest
    return found


def manifests_from_announcements(values: Iterable[bytes | None]) -> dict[int, dict[str, Any]]:
    """The manifests announced on rollout.shards by seq (the last announcement of a seq wins)."""
    found = (parse_announcement(value) for value in values)
    return {a.seq: a.manifest for a in found if a is not None}


def _inferred_groups_per_batch(manifests: Mapping[int, dict[str, Any]], batching: str) -> tuple[int, int] | None:
    """(G, seq) from the first full batch: its distinct group indices (step) or its groups (arrival)."""
    for seq, manifest in sorted(manifests.items()):
        extra = manifest.get("extra") or {}
        groups = extra.get("groups") or []
        if extra.get("partial") or not groups:
            continue
        count = len({g.get("group_index") for g in groups}) if batching == "step" else len(groups)
        return count, seq
    return None


def _from_manifests(manifests: Mapping[int, dict[str, Any]], batching: str | None) -> dict[str, tuple[Any, str]]:
    if not manifests:
        return {}
    first_seq, first = min(manifests.items())
    extra = first.get("extra") or {}
    found: dict[str, tuple[Any, str]] = {"dp_size": (first.get("dp_size"), f"manifest of batch {first_seq}")}
    for name in ("batching", "normalization"):
        if extra.get(name) is not None:
            found[name] = (extra[name], f"manifest extra of batch {first_seq}")
    inferred = _inferred_groups_per_batch(manifests, batching or found.get("batching", ("step",))[0])
    if inferred is not None:
        found["groups_per_batch"] = (inferred[0], f"inferred from the groups of batch {inferred[1]}")
    return {k: v for k, v in found.items() if v[0] is not None}


def settle_settings(flags: Mapping[str, Any], manifests: Mapping[int, dict[str, Any]]) -> ReplaySettings:
    """Flags first, then the manifests, then the shard writer's defaults; warn where a flag disagrees."""
    found = _from_manifests(manifests, flags.get("batching"))
    defaults = ShardSettings.model_fields
    values, sources, warnings = {}, {}, []
    for name in SETTING_NAMES:
        flag = flags.get(name)
        if flag is not None:
            values[name], sources[name] = flag, "flag"
            if name in found and found[name][0] != flag:
                warnings.append(f"--{name.replace('_', '-')} {flag} differs from {found[name][0]} "
                                f"({found[name][1]}): rebuilt shards will not match the originals")
        elif name in found:
            values[name], sources[name] = found[name]
        else:
            values[name], sources[name] = defaults[name].default, "default"
    if values["batching"] not in BATCHING_MODES:
        raise ConfigError(must_be("batching", f"one of {', '.join(BATCHING_MODES)}", values["batching"]))
    if values["normalization"] not in NORMALIZATIONS:
        raise ConfigError(must_be("normalization", f"one of {', '.join(NORMALIZATIONS)}", values["normalization"]))
    for name in ("dp_size", "groups_per_batch"):
        if isinstance(values[name], bool) or not isinstance(values[name], int) or values[name] < 1:
            raise ConfigError(must_be(name, "an integer >= 1", values[name]))
    max_staleness = next(((m.get("extra") or {}).get("max_staleness") for _, m in sorted(manifests.items())), None)
    return ReplaySettings(values["batching"], values["dp_size"], values["groups_per_batch"], values["normalization"],
                          sources, tuple(warnings), max_staleness if values["batching"] == "step" else None)


# ---------------------------------------------------------------------------- episodes from records


def _members(topic: str, key: Any, value: Any, headers: Any, partition: int, offset: int,
             rejections: list[Rejection]) -> Iterator[Member]:
    """One rollout.episodes record as the writer parses it: a member, nothing (a marker), or a rejection."""
    try:
        item = parse_record(key, value, headers, partition=partition, offset=offset)
    except ContractError as exc:
        rejections.append(Rejection(source_of(topic, partition, offset), DlqStage.SHARDS, DlqKind.DECODE,
                                    f"episode record does not decode: {exc}"))
        return
    if not isinstance(item, EndOfRunMarker):
        yield item


def episodes_from_episode_records(records: Iterable[Any], rejections: list[Rejection]) -> Iterator[Member]:
    """rollout.episodes records as the writer parses them (episodes and abandoned episodes); undecodable ones
    are reported, end-of-run markers skipped."""
    for record in records:
        yield from _members(record.topic, record.key, record.value, record.headers, record.partition, record.offset,
                            rejections)


class TurnMerger:
    """The stream stage's per-record logic, offline: turns in, the episode records it would emit out."""

    def __init__(self, turns_topic: str) -> None:
        self.topics = Topics(prefix=topic_prefix(turns_topic))
        self.table = ChangelogState({})  # the stream stage's state mapping, with no changelog to write
        self._sent: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]] = []
        self.processor = TurnProcessor(self.table, self._send, self.topics, window_ms=_NEVER_MS, grace_ms=_NEVER_MS,
                                       reroute=False)  # one table for every partition: nothing is misplaced

    async def _send(self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]],
                    *, wait: bool, partition: int | None = None) -> None:
        self._sent.append((topic, key, value, headers))

    def episodes(self, records: Iterable[Any], rejections: list[Rejection]) -> Iterator[Member]:
        loop = asyncio.new_event_loop()
        try:
            for record in records:
                headers = [(k, bytes(v) if v is not None else b"") for k, v in (record.headers or [])]
                turn = TurnRecord(record.key, record.value, headers, record.topic, record.partition, record.offset,
                                  int(record.timestamp))
                loop.run_until_complete(self.processor.handle(turn))
                yield from self._drain(record, rejections)
            loop.run_until_complete(self.processor.drain())  # the deferred effects of the last finals
        finally:
            loop.close()

    def _drain(self, record: Any, rejections: list[Rejection]) -> Iterator[Member]:
        sent, self._sent = self._sent, []
        for topic, key, value, headers in sent:
            if topic == self.topics.episodes:
                yield from _members(topic, key, value, headers, record.partition, record.offset, rejections)
            elif topic == self.topics.dlq:
                found = {k: bytes(v).decode(errors="replace") for k, v in headers if k.startswith("dlq.")}
                rejections.append(Rejection(found.get("dlq.source", ""), DlqStage.STREAM, found.get("dlq.kind", ""),
                                            found.get("dlq.reason", "")))

    def open_episodes(self) -> int:
        """Episodes whose final turn was not in the range."""
        return sum(1 for k, v in self.table.items() if k.startswith(b"e|") and not EpisodeIndex.from_bytes(v).finished)


# ---------------------------------------------------------------------------- batches


def _keys(manifest: Mapping[str, Any]) -> set[tuple[str, int]]:
    return {(e["key"], int(e["attempt"])) for e in (manifest.get("extra") or {}).get("episodes", [])}


def _outside(mine: set[tuple[str, int]], theirs: set[tuple[str, int]]) -> bool:
    """The manifest holds more, or later attempts, of what was replayed: the rest lies outside the range."""
    have, want = dict(mine), dict(theirs)
    return mine != theirs and all(k in want and a <= want[k] for k, a in have.items())


class _Rebuilder:
    def __init__(self, out_dir: Path, settings: ReplaySettings, manifests: Mapping[int, dict[str, Any]],
                 topic: str, write_partial: bool) -> None:
        self.out_dir, self.settings, self.manifests = out_dir, settings, manifests
        self.topic, self.write_partial = topic, write_partial
        self.reports: list[BatchReport] = []

    def batch(self, batch: Batch, *, leftover: bool) -> None:
        s = self.settings  # the writer's decision, with the staleness bound its manifests record
        decision = decide(batch, dp_size=s.dp_size, normalization=s.normalization, batching=s.batching,
                          max_staleness=s.max_staleness)
        batch = decision.batch
        if decision.verdict is Verdict.EMPTY:  # every group abandoned (or stale): the writer writes none either
            logger.info("batch=%d: every episode abandoned or stale (abandoned=%d, stale=%d): not written",
                        batch.seq, len(batch.abandoned), len(batch.stale))
            return
        expected = self.manifests.get(batch.seq)
        mine = {(e.key, e.attempt) for e in batch.episodes}
        theirs = _keys(expected) if expected is not None else None
        report = BatchReport(batch.seq, "written", len(mine), None if theirs is None else len(theirs))
        if theirs is not None and _outside(mine, theirs) and not self.write_partial:
            report.status, report.detail = "incomplete", f"{len(theirs - mine)} of its episodes are outside the range"
        elif theirs is None and leftover and not self.write_partial:
            report.status, report.detail = "incomplete", "partial batch with no manifest to compare: not written"
        else:
            self._write(decision, report, expected, mine, theirs)
        self.reports.append(report)

    def _write(self, decision: Decision, report: BatchReport, expected: Mapping[str, Any] | None,
               mine: set, theirs: set | None) -> None:
        error, manifest = decision.error, None
        if decision.verdict is Verdict.WRITE:
            try:
                manifest = write_decided(self.out_dir, decision, topic=self.topic)
            except ContractError as exc:  # a check of the write step itself: refused all the same
                error = exc
        if manifest is None:
            report.status, report.detail = "dead-lettered", f"the whole-batch check refuses it: {error}"
            return
        report.shards = {e["path"]: e["sha256"] for e in manifest["shards"]}
        if expected is None:
            return
        original = {e["path"]: e["sha256"] for e in expected.get("shards", [])}
        if mine != theirs:
            report.status = "differs"
            report.detail = f"episodes differ: {len(mine - theirs)} not in the manifest, {len(theirs - mine)} missing"
        elif original != report.shards:
            report.status = "differs"
            report.detail = "sha256 differs for " + ", ".join(sorted(p for p in set(original) | set(report.shards)
                                                                      if original.get(p) != report.shards.get(p)))
        else:
            report.status = "identical"

    def finish(self) -> list[BatchReport]:
        seen = {r.seq for r in self.reports}
        for seq, manifest in sorted(self.manifests.items()):
            if seq not in seen:
                self.reports.append(BatchReport(seq, "not-in-range", 0, len(_keys(manifest))))
        return sorted(self.reports, key=lambda r: r.seq)


def rebuild(episodes: Iterable[Member], settings: ReplaySettings, out_dir: Path,
            manifests: Mapping[int, dict[str, Any]], *, topic: str, rejections: list[Rejection],
            write_partial: bool = False) -> tuple[list[BatchReport], dict[str, int], int]:
    """Batch the episodes (and abandoned records) as the writer does and write what may be written;
    (reports, counts, episodes accepted)."""
    batcher = Batcher(settings.groups_per_batch, settings.batching)
    rebuilder = _Rebuilder(out_dir, settings, manifests, topic, write_partial)
    accepted = 0
    for episode in episodes:
        result = batcher.add(episode)
        accepted += result.outcome is Outcome.ACCEPTED and isinstance(episode, Episode)
        if result.outcome is Outcome.REJECTED:
            rejections.append(Rejection(source_of(topic, episode.partition, episode.offset), DlqStage.SHARDS, result.kind,
                                        result.reason))
        for batch in batcher.ready():
            rebuilder.batch(batch, leftover=False)
    for batch in batcher.flush():
        rebuilder.batch(batch, leftover=True)
    return rebuilder.finish(), dict(batcher.counts), accepted


# ---------------------------------------------------------------------------- the whole replay


def _check_out_dir(out_dir: Path, compare_dir: Path | None) -> None:
    if compare_dir is not None and out_dir.resolve() == compare_dir.resolve():
        raise ConfigError(must_be("--out", "a directory other than --compare", str(out_dir)))
    if out_dir.exists() and any(p.name.startswith("batch-") for p in out_dir.iterdir()):
        raise ConfigError(must_be("--out", "a new or empty directory (it already holds batches)", str(out_dir)))
    out_dir.mkdir(parents=True, exist_ok=True)


def _source_topic(starts: Sequence[RangeStart]) -> tuple[str, str]:
    if not starts:
        raise ConfigError(must_be("--from", "given at least once", None))
    topics = sorted({s.topic for s in starts})
    if len(topics) != 1:
        raise ConfigError(must_be("--from", "ranges of one topic", topics))
    kind = topic_kind(topics[0])
    if kind not in ("episodes", "turns"):
        raise ConfigError(must_be("--from topic", "rollout.episodes or rollout.turns (optionally prefixed)",
                                  topics[0]))
    return topics[0], kind


def _announced(consumer: Any, topic: str) -> dict[int, dict[str, Any]]:
    try:
        wait_for_partitions(consumer, topic, timeout_s=1.0)
    except MissingTopicError:
        return {}
    ranges = resolve_ranges(consumer, [RangeStart(topic)])
    return manifests_from_announcements(r.value for r in read_ranges(consumer, ranges))


def replay(client_kwargs: dict[str, Any], starts: Sequence[RangeStart], *, out_dir: str | Path,
           to: int | None = None, flags: Mapping[str, Any] | None = None, compare_dir: str | Path | None = None,
           use_announcements: bool = True, write_partial: bool = False,
           progress: Progress | None = None) -> ReplayReport:
    """Read the ranges, rebuild their batches into ``out_dir`` and compare (see the module docstring)."""
    topic, kind = _source_topic(starts)
    out = Path(out_dir)
    compare = Path(compare_dir) if compare_dir is not None else None
    _check_out_dir(out, compare)
    consumer = open_reader(client_kwargs)
    try:
        ranges = resolve_ranges(consumer, starts, to)
        if compare is not None:
            manifests, manifests_from = manifests_in_dir(compare), str(compare)
        elif use_announcements:
            shards_topic = Topics(prefix=topic_prefix(topic)).shards
            manifests, manifests_from = _announced(consumer, shards_topic), shards_topic
        else:
            manifests, manifests_from = {}, None
        settings = settle_settings(flags or {}, manifests)
        total, read = sum(r.records for r in ranges), 0

        def counted(record: Any) -> None:
            nonlocal read
            read += 1
            if progress is not None:
                progress(read, total)

        rejections: list[Rejection] = []
        records = read_ranges(consumer, ranges, on_record=counted)
        merger = TurnMerger(topic) if kind == "turns" else None
        episodes = merger.episodes(records, rejections) if merger else episodes_from_episode_records(records, rejections)
        batches, counts, accepted = rebuild(episodes, settings, out, manifests, topic=topic, rejections=rejections,
                                            write_partial=write_partial)
    finally:
        consumer.close()
    report = ReplayReport(topic, kind, [str(r) for r in ranges], read, accepted, settings,
                          manifests_from if manifests else None, batches, rejections, counts,
                          merger.open_episodes() if merger else 0)
    logger.info("replayed topic=%s records=%d episodes=%d batches=%s", topic, read, accepted,
                dict(report.by_status()))
    return report

