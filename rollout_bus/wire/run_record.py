"""The run's batching on rollout.run: declared once, so no two stages disagree on what batch k is.

The generator's staleness gate and the shard writer's batches both count batches in prompt groups:
batch k of step batching holds group_index ``[k*G, (k+1)*G)``. Started by hand with different
``--groups-per-batch`` (or bounds, or batching modes) they would silently gate and cut different
batches. So each declares its batching on rollout.run before it starts; the first record there is
the run's, and a stage whose own batching differs is refused with the settings named (WIRE.md
section 14). Pure: builds, parses and compares; ``rollout_bus.kafka.run_record`` does the I/O.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from rollout_bus.wire.compact_json import compact_json
from rollout_bus.errors import ContractError, must_be

RUN_BATCHING_KEY = b"batching"
BATCHING_MODES = ("step", "arrival")
COMPARED = ("groups_per_batch", "batching", "max_staleness")


@dataclass(frozen=True)
class RunBatching:
    """A run's batching as one stage declared it; ``declared_by`` says who (role, host, pid)."""

    groups_per_batch: int
    batching: str
    max_staleness: int | None
    declared_by: str = ""

    def value(self) -> bytes:
        return compact_json(asdict(self))

    @classmethod
    def parse(cls, value: bytes | None) -> RunBatching:
        """Strict: ContractError naming the field unless ``value`` is what ``value()`` writes."""
        try:
            doc = json.loads(value) if value is not None else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or set(doc) != {*COMPARED, "declared_by"}:
            raise ContractError(must_be("rollout.run batching record", f"a JSON object of {', '.join(COMPARED)}, "
                                        "declared_by", value[:200] if value is not None else None))
        groups, mode, bound, by = (doc["groups_per_batch"], doc["batching"], doc["max_staleness"],
                                   doc["declared_by"])
        if not (isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1):
            raise ContractError(must_be("rollout.run groups_per_batch", "an integer >= 1", groups))
        if mode not in BATCHING_MODES:
            raise ContractError(must_be("rollout.run batching", " or ".join(BATCHING_MODES), mode))
        if bound is not None and not (isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0):
            raise ContractError(must_be("rollout.run max_staleness", "null or an integer >= 0", bound))
        if not isinstance(by, str):
            raise ContractError(must_be("rollout.run declared_by", "a string", by))
        return cls(groups, mode, bound, by)

    def differences(self, other: RunBatching) -> list[str]:
        """``name=this vs other`` for every compared setting that differs (``declared_by`` is not compared)."""
        return [f"{name}={getattr(self, name)!r} vs {getattr(other, name)!r}" for name in COMPARED
                if getattr(self, name) != getattr(other, name)]
