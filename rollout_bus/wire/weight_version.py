"""The rollout.weights record: the trainer's live weight version, and where its checkpoint lies.

Why: generators hold their staleness bound against it, and the tail view shows it; the topic is
compacted, so a reader that starts late finds the latest version. Pure: builds and parses bytes, talks
to no broker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rollout_bus.errors import ContractError, must_be
from rollout_bus.wire.compact_json import compact_json
from rollout_bus.wire.record_fields import record_fields

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
        doc = record_fields(value, "weights", {"version": int, "step": int, "published_at": int})
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
