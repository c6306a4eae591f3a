"""Consumer-group lag per partition: end offsets minus the group's committed offsets.

Contract: ``LagProbe.measure([(group, topic), ...])`` returns one ``LagRow`` per partition of each
topic. ``committed`` is None where the group has committed nothing for that partition (a stage not
started yet, or a group name that is wrong); its lag then counts every record still on the partition
(end - log start), since the stages start from the earliest offset. Each row also says what retention
(or DeleteRecords) did to the group: ``lost``, records between its position (0 when it committed nothing)
and the log start, deleted before it read them; ``near_log_start``, its position lies in the oldest tenth of
what a partition that has deleted records still holds, so the next deletion may take records it has not read.
The probe only reads: it joins no group and commits nothing.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from collections.abc import Mapping

from rollout_bus.kafka.clients import KafkaConsumer, KafkaError, new_admin
from rollout_bus.kafka.reader import partition_offsets

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LagRow:
    group: str
    topic: str
    partition: int
    committed: int | None
    end: int
    lag: int
    log_start: int = 0
    lost: int = 0  # records between the group's position and the log start: deleted before the group read them
    near_log_start: bool = False  # the group reads in the oldest tenth of what a deleting partition still holds

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


NEAR_FRACTION = 10  # a position in the oldest 1/10 of a partition that is deleting records is at risk


def lag_rows(group: str, topic: str, ends: dict[int, int], begins: dict[int, int],
             committed: dict[int, int]) -> list[LagRow]:
    """Pure arithmetic of lag, one row per partition (never negative)."""
    rows = []
    for partition in sorted(ends):
        done = committed.get(partition)
        first = begins.get(partition, 0)
        start = done if done is not None else first
        position = done if done is not None else 0
        lost = max(first - position, 0)
        held = ends[partition] - first
        near = (not lost and first > 0 and ends[partition] > position
                and position - first < max(1, held // NEAR_FRACTION))
        rows.append(LagRow(group, topic, partition, done, ends[partition], max(ends[partition] - start, 0), first,
                           lost, near))
    return rows


class LagProbe:
    """Measures lag with an admin client (committed offsets) and a group-less consumer (end offsets)."""

    def __init__(self, conn: Mapping[str, Any], consumer: KafkaConsumer) -> None:
        self.admin = new_admin(conn, client_id="rollout-bus-ops-lag")
        self.consumer = consumer

    def committed(self, group: str, topic: str) -> dict[int, int]:
        """The group's committed offsets on ``topic`` by partition ({} for an unknown group)."""
        try:
            found = self.admin.list_group_offsets({group: None}).get(group, {})
        except KafkaError as exc:
            logger.debug("committed offsets unavailable group=%s: %s", group, exc)
            return {}
        return {tp.partition: meta.offset for tp, meta in found.items() if tp.topic == topic and meta.offset >= 0}

    def measure(self, groups: list[tuple[str, str]]) -> list[LagRow]:
        """Lag of each ``group`` on its ``topic``; topics not (yet) in the metadata give no rows."""
        rows: list[LagRow] = []
        for group, topic in groups:
            if not self.consumer.partitions_for_topic(topic):
                self.consumer.topics()  # refresh metadata for the next round
                continue
            ends = partition_offsets(self.consumer, topic)
            begins = partition_offsets(self.consumer, topic, beginning=True)
            if ends is None or begins is None:
                continue
            rows.extend(lag_rows(group, topic, ends, begins, self.committed(group, topic)))
        return rows

    def close(self) -> None:
        self.admin.close()
