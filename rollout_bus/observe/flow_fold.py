"""The run's flow, folded from its rollout.metrics records: who waited, and how old and how wasted each batch was.

Contract: ``fold_flow(docs)`` (parsed rollout.metrics values, topic order) gives a ``Flow``: each batch
record's ``rollout/flow/...`` metrics by seq (the manifest holds none; later records of a seq replace
earlier ones), and the latest flow record of each (stage, source): the generators' time behind the
staleness gate, the trainer's waiting for batches. Metric names lose ``rollout/`` (``wire.flow_metrics``
names them). The report (``report_html``) and the demo (``flow_tables``) show it. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from rollout_bus.wire.flow_metrics import FLOW_PREFIX
from rollout_bus.wire.metrics_records import METRIC_PREFIX

_PUBLISHED_FLOW = METRIC_PREFIX + FLOW_PREFIX


@dataclass(frozen=True)
class Flow:
    """Who waited, and how old and how wasted each batch was (``fold_flow``)."""

    batches: dict[int, dict[str, float]] = field(default_factory=dict)  # seq -> its flow metrics, without rollout/
    sources: list[dict[str, Any]] = field(default_factory=list)  # the latest flow record of each (stage, source)


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def fold_flow(docs: Iterable[Mapping[str, Any]]) -> Flow:
    """The run's flow from its rollout.metrics records, in topic order (see the module contract)."""
    batches: dict[int, dict[str, float]] = {}
    sources: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in docs:
        if not isinstance(doc, Mapping) or not isinstance(doc.get("metrics"), Mapping):
            continue
        found = {k[len(METRIC_PREFIX):]: float(v) for k, v in doc["metrics"].items() if k.startswith(_PUBLISHED_FLOW)
                 and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if doc.get("kind") == "batch" and _int_or_none(doc.get("batch")) is not None and found:
            batches[int(doc["batch"])] = found
        elif doc.get("kind") == "flow" and isinstance(doc.get("stage"), str) and isinstance(doc.get("source"), str):
            sources[(doc["stage"], doc["source"])] = {
                "stage": doc["stage"], "source": doc["source"], "elapsed_s": doc.get("elapsed_s"),
                "final": bool(doc.get("final")), "metrics": found}
    return Flow(dict(sorted(batches.items())), [sources[k] for k in sorted(sources)])
