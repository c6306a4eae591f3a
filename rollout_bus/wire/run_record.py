"""The run's batching on rollout.run: declared once, so no two stages disagree on what batch k is.

The generator's staleness gate and the shard writer's batches both count batches in prompt groups:
batch k of step batching holds group_index ``[k*G, (k+1)*G)``. Started by hand with different
``--groups-per-batch`` (or bounds, or batching modes) they would silently gate and cut different
batches. So each declares its batching on rollout.run before it starts; the first record there is
the run's, and a stage whose own batching differs is refused with the settings named (WIRE.md
section 14). Pure: builds, parses and compares; ``rollout_bus.kafka.run_record`` does the I/O.

``RunBatching`` is also the value every stage that counts batches is handed (the shard writer's
``Batcher``, the generator's ``StalenessGate``): it is checked once, when it is built, and holds the
rule itself (``batch_of``), so no stage spells ``group_index // groups_per_batch`` or checks a
setting again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from rollout_bus.wire.compact_json import compact_json
from rollout_bus.errors import ConfigError, ContractError, must_be

RUN_BATCHING_KEY = b"batching"
BATCHING_MODES = ("step", "arrival")
COMPARED = ("groups_per_batch", "batching", "max_staleness")


def _integer_at_least(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _problem(groups_per_batch: object, batching: object, max_staleness: object,
             declared_by: object) -> tuple[str, str, object] | None:
    """The first setting a run's batching cannot have, as (name, what it must be, what it is); None: none."""
    if not _integer_at_least(groups_per_batch, 1):
        return "groups_per_batch", "an integer >= 1", groups_per_batch
    if batching not in BATCHING_MODES:
        return "batching", " or ".join(BATCHING_MODES), batching
    if max_staleness is not None and not _integer_at_least(max_staleness, 0):
        return "max_staleness", "null or an integer >= 0", max_staleness
    if not isinstance(declared_by, str):
        return "declared_by", "a string", declared_by
    return None


@dataclass(frozen=True)
class RunBatching:
    """A run's batching: what batch k is, its staleness bound, and who declared it (role, host, pid).

    Built only valid: ``ConfigError`` naming the setting otherwise (``parse``: ``ContractError``).
    """

    groups_per_batch: int
    batching: str = "step"
    max_staleness: int | None = None
    declared_by: str = ""

    def __post_init__(self) -> None:
        problem = _problem(self.groups_per_batch, self.batching, self.max_staleness, self.declared_by)
        if problem is not None:
            raise ConfigError(must_be(*problem))

    def batch_of(self, group_index: int) -> int:
        """The step batch of a prompt group: batch k holds group indices ``[k*G, (k+1)*G)``. Step batching
        cuts batches by it; the staleness bound counts batches by it (and needs step batching to mean a step)."""
        return group_index // self.groups_per_batch

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
        fields = (doc["groups_per_batch"], doc["batching"], doc["max_staleness"], doc["declared_by"])
        problem = _problem(*fields)
        if problem is not None:
            name, expected, got = problem
            raise ContractError(must_be(f"rollout.run {name}", expected, got))
        return cls(*fields)

    def differences(self, other: RunBatching) -> list[str]:
        """``name=this vs other`` for every compared setting that differs (``declared_by`` is not compared)."""
        return [f"{name}={getattr(self, name)!r} vs {getattr(other, name)!r}" for name in COMPARED
                if getattr(self, name) != getattr(other, name)]
