"""The one list of topics: what each carries and how it is keyed (docs/pipeline.md section 1, WIRE.md section 2).

Stages meet only through these names. A prefix lets several runs share one cluster:
``Topics(prefix="run42.")`` names ``run42.rollout.turns`` and so on, and scopes the consumer groups
and the stream's changelog the same way (``Topics.group``: ``run42.rollout-bus-stream``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollout_bus.errors import ContractError, must_be

# The largest record value on any topic (``KafkaSettings.max_record_bytes``; ``rollout_bus.kafka.limits``
# turns it into topic, producer and consumer settings). The broker refuses requests over 100 MiB.
DEFAULT_MAX_RECORD_BYTES = 64 << 20
MAX_RECORD_BYTES_CEILING = 96 << 20


# Kafka's rule for topic names (and so for a prefix of them): ASCII letters, digits, '.', '_', '-', at most 249
# characters. The prefix leaves room for the longest name derived from it (a stream app's changelog topic).
_LEGAL = re.compile(r"[A-Za-z0-9._-]*")
MAX_PREFIX_CHARS = 180


def check_prefix(prefix: str) -> str:
    """``prefix`` unchanged, or ``ContractError`` naming what Kafka would refuse in the names it makes (the broker's
    own refusal came back as a request dump, after connecting)."""
    if not _LEGAL.fullmatch(prefix):
        bad = sorted({c for c in prefix if not _LEGAL.fullmatch(c)})
        raise ContractError(must_be("topic prefix", f"only ASCII letters, digits, '.', '_' and '-' (Kafka's topic "
                                                    f"names; found {''.join(bad)!r})", prefix))
    if len(prefix) > MAX_PREFIX_CHARS:
        raise ContractError(must_be("topic prefix", f"at most {MAX_PREFIX_CHARS} characters (Kafka's topic names "
                                                    f"are at most 249)", f"{len(prefix)} characters"))
    return prefix


@dataclass(frozen=True)
class TopicSpec:
    """A topic's name, what its records hold, and how they are keyed."""

    name: str
    carries: str
    key: str
    partitions: int = 1
    compacted: bool = False  # else every record is kept (retention.ms=-1): nothing expires under a stalled stage


# The base topic names, before a prefix (``Topics`` adds it): the one place each is spelled.
RUN_TOPIC = "rollout.run"
TURNS_TOPIC = "rollout.turns"
EPISODES_TOPIC = "rollout.episodes"
METRICS_TOPIC = "rollout.metrics"
SHARDS_TOPIC = "rollout.shards"
DLQ_TOPIC = "rollout.dlq"
WEIGHTS_TOPIC = "rollout.weights"
PROMPTS_TOPIC = "rollout.prompts"
PROMPT_LEDGER_TOPIC = "rollout.prompt_ledger"


@dataclass(frozen=True)
class Topics:
    """The pipeline's topic names, optionally prefixed."""

    prefix: str = ""
    turns_partitions: int = 4
    episodes_partitions: int = 4
    prompts_partitions: int = 4

    def __post_init__(self) -> None:
        check_prefix(self.prefix)

    @property
    def run(self) -> str:
        return self.prefix + RUN_TOPIC

    @property
    def turns(self) -> str:
        return self.prefix + TURNS_TOPIC

    @property
    def episodes(self) -> str:
        return self.prefix + EPISODES_TOPIC

    @property
    def metrics(self) -> str:
        return self.prefix + METRICS_TOPIC

    @property
    def shards(self) -> str:
        return self.prefix + SHARDS_TOPIC

    @property
    def dlq(self) -> str:
        return self.prefix + DLQ_TOPIC

    @property
    def weights(self) -> str:
        return self.prefix + WEIGHTS_TOPIC

    @property
    def prompts(self) -> str:
        return self.prefix + PROMPTS_TOPIC

    @property
    def prompt_ledger(self) -> str:
        return self.prefix + PROMPT_LEDGER_TOPIC

    def group(self, name: str) -> str:
        """A consumer group (or Faust app id, which also names the stream's changelog topic) scoped by
        the prefix like the topics, so runs with different prefixes share a cluster without sharing state."""
        return f"{self.prefix}{name}"

    def specs(self) -> list[TopicSpec]:
        """Every pipeline topic with its meaning, in data-flow order."""
        return [
            TopicSpec(self.prompts, "JSON: one prompt group to generate (prompt_record.PromptGroup: id, group_index, "
                      "input_ids, n_samples, label, metadata, sampling, adapter), loaded by `rollout-bus prompts load`",
                      "the prompt group's id", self.prompts_partitions),
            TopicSpec(self.prompt_ledger, "JSON: what became of each prompt group (prompt_record.LedgerEvent: "
                      "claimed, done, failed) and each finished load (loaded)", "the prompt group's id (b'loaded')",
                      self.prompts_partitions),
            TopicSpec(self.run, "JSON: the run's batching (groups_per_batch, batching, max_staleness, declared_by), "
                      "declared by the first stage to start; the first record is the run's (run_record.RunBatching)",
                      "b'batching'"),
            TopicSpec(self.turns, "one turn sample per record: encode_samples([turn], COMPUTED_FIELDS + "
                      "SAMPLING_MASK_FIELDS); headers turn, attempt, final, group_size, schema, sent_at",
                      "rollout key (adapter, kind, group_index, id) as a stable string", self.turns_partitions),
            TopicSpec(self.episodes, "one finished episode per record: its merged sibling segments, with masks",
                      "rollout key", self.episodes_partitions),
            TopicSpec(self.metrics, "JSON: kind window|batch|flow, the window, batch or flow source id, adapter, rollout/* metrics",
                      "window or batch id"),
            TopicSpec(self.shards, "JSON manifest of every batch of trainer shards written", "batch sequence"),
            TopicSpec(self.dlq, "a rejected record: original key, value, headers plus reason, stage, source "
                      "topic-partition-offset", "the original key"),
            TopicSpec(self.weights, "JSON: the trainer's live weight version, step and publication time "
                      "(weight_version.WeightVersion); compacted: the latest per key", "the policy (b'policy')",
                      compacted=True),
        ]

    def names(self) -> list[str]:
        return [spec.name for spec in self.specs()]
