"""The rollout.episodes record: one finished episode, its merged sibling segments and ``EpisodeInfo``.

Why: the stream stage writes it and the shard writer (and ``inspect``) read it apart, so both spell it
here. Pure: builds and parses bytes, talks to no broker.

Contract:

- rollout.turns: key ``rollout_key_string``; value ``encode_samples([turn], TURN_FIELDS)``;
  headers ``TurnHeaders``.
- rollout.episodes: key the same; value ``encode_samples(segments, TURN_FIELDS, metadata=...)``
  where the metadata is ``EpisodeInfo`` (attempt, turns, group_size, sent_at of the final turn,
  event time); headers repeat attempt/group_size/schema for consumers that filter without decoding, plus
  ``takeover_tokens`` where generator takeovers threw response tokens of the episode away: a header only, not in
  the value's metadata, so an episode's value is the same whether or not its making was disturbed, and the
  headers of an undisturbed episode are what they were before the header existed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rollout_bus.errors import CodecError
from rollout_bus.model.sample import Sample
from rollout_bus.wire.codec import COMPUTED_FIELDS, SAMPLING_MASK_FIELDS, decode_samples, encode_samples
from rollout_bus.wire.headers import (HEADER_ATTEMPT, HEADER_GROUP_SIZE, HEADER_SCHEMA, HEADER_SENT_AT,
                                     HEADER_TAKEOVER_TOKENS, SCHEMA_VERSION)

TURN_FIELDS = COMPUTED_FIELDS + SAMPLING_MASK_FIELDS


@dataclass(frozen=True)
class EpisodeInfo:
    """Facts about a finished episode that travel with its segments on rollout.episodes."""

    attempt: int
    turns: int
    group_size: int
    final_sent_at_ms: int
    event_time_ms: int

    def headers(self, *, takeover_tokens: int = 0) -> list[tuple[str, bytes]]:
        """The record's headers; ``takeover_tokens`` (the response tokens takeovers discarded for the episode)
        adds its header only when above 0."""
        headers = [(HEADER_ATTEMPT, str(self.attempt).encode()), (HEADER_GROUP_SIZE, str(self.group_size).encode()),
                   (HEADER_SCHEMA, SCHEMA_VERSION.encode()), (HEADER_SENT_AT, str(self.final_sent_at_ms).encode())]
        if takeover_tokens > 0:
            headers.append((HEADER_TAKEOVER_TOKENS, str(int(takeover_tokens)).encode()))
        return headers


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
