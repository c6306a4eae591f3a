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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from rollout_bus.codec import COMPUTED_FIELDS, SAMPLING_MASK_FIELDS, decode_samples, encode_samples
from rollout_bus.errors import CodecError, ContractError
from rollout_bus.sample import Sample
from rollout_bus.topics import (HEADER_ATTEMPT, HEADER_FINAL, HEADER_GROUP_SIZE, HEADER_SCHEMA, HEADER_SENT_AT,
                                HEADER_TURN, SCHEMA_VERSION)

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
            try:
                value = int(bytes(raw).decode("ascii"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise ContractError(f"header {name!r} must be a decimal integer (got {bytes(raw)!r})") from exc
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
