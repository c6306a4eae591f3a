"""The rollout-bus error tree: every error class callers may catch, defined here.

Every error the project raises on purpose derives from ``RolloutBusError``; errors about bad
data also derive from ``ValueError`` so callers that only know the contract (docs/data-model.md
says "raises ValueError") catch them unchanged::

    RolloutBusError
    ├── ContractError (ValueError)      a value breaks a data contract (sample, mask, merge, batch)
    │   ├── CodecError                  a wire payload cannot be encoded or decoded
    │   └── MaskCheckError              the whole-batch sampling-mask check failed
    ├── ConfigError (ValueError)        a setting or command-line value is unusable
    │   └── MissingTopicError           (also an Unavailable, below) a topic has no partitions
    ├── BrokerError                     the local Kafka broker cannot be fetched, started or reached
    │   ├── Unavailable                 something waited for is not there yet (transient)
    │   │   └── MissingTopicError       (also a ConfigError) not created yet, or a wrong name
    │   ├── Stopped                     asked to stop while waiting for the broker
    │   ├── RecordTooLargeError         a record is over the size limit of a producer or topic
    │   └── AccessDenied                the cluster refused this principal (ACLs, login): never retried
    ├── FeedTimeoutError (TimeoutError) waited too long for the bus (a trainer's next batch, a weight version)
    │   └── NoUsableWeights             no verified checkpoint to generate from within the generator's wait
    ├── EngineError                     an inference engine refused a request, or died answering it
    │   ├── EngineRefused               it answered 4xx: the request itself is wrong, never retried elsewhere
    │   └── SampleFailed                one sample's engine calls failed on every try: its prompt group fails
    └── DiskFullError (OSError)         no space left for a file (path, bytes needed, bytes free): waited out

Two classes live beside their one user instead: ``WriterLockedError`` (a ``ConfigError``: another
shard writer holds the output directory) in ``rollout_bus.consumers.shard_writer.writer_lock``, and
``rollout_bus.streams.turn_record.Rejected``, the stream stage's internal signal that carries a
record's dead-letter kind (a plain ``Exception``, caught inside the stage).

Messages follow one template, ``'{name}' must be {expected} (got {value!r})``, and say where
(sample position, tensor name, topic-partition-offset) whenever that is known.
"""

from __future__ import annotations

from typing import Any


class RolloutBusError(Exception):
    """Root of every error rollout-bus raises on purpose."""


class ContractError(RolloutBusError, ValueError):
    """A value breaks one of the data contracts in docs/data-model.md."""


class CodecError(ContractError):
    """A payload cannot be encoded or decoded; the message says what and where."""


class MaskCheckError(ContractError):
    """A batch mixes samples with and without sampling masks."""


class ConfigError(RolloutBusError, ValueError):
    """A setting or command-line value is unusable."""


class BrokerError(RolloutBusError):
    """The local Kafka broker cannot be fetched, started, stopped or reached."""


class Unavailable(BrokerError):
    """Something a caller waits for is not there yet (a topic without partitions): transient."""


class MissingTopicError(Unavailable, ConfigError):
    """A topic shows no partitions in the cluster's metadata: not created yet (a stage waits and
    retries, as for ``Unavailable``) or a wrong name (a command-line value: ``ConfigError``)."""


class PartitionsChangedError(RolloutBusError):
    """A topic a stage reads gained partitions under it: the stage exits to be restarted with the new count
    (exit status ``EXIT_PARTITIONS_CHANGED``)."""


EXIT_PARTITIONS_CHANGED = 75  # EX_TEMPFAIL: restart me


class FeedTimeoutError(RolloutBusError, TimeoutError):
    """Waited longer than its timeout for the bus: a trainer's feed for its next batch, a generator for
    a weight version."""


class NoUsableWeights(FeedTimeoutError):
    """A generator following the trainer has no verified weights to generate from: every version published
    was refused (its checkpoint missing, or failing its sha256) and none came to replace it within its wait
    (exit status ``EXIT_NO_USABLE_WEIGHTS``)."""


EXIT_NO_USABLE_WEIGHTS = 66  # EX_NOINPUT: the input it needs (a verified checkpoint) is not there


class Stopped(BrokerError):
    """The process was asked to stop while waiting for the broker."""


class RecordTooLargeError(BrokerError):
    """A record is over the producer's or the topic's size limit (``rollout_bus.kafka.limits``):
    it is dead-lettered by reference, never fatal."""


class AccessDenied(BrokerError):
    """A secured cluster refused this client: an ACL its principal lacks, or a failed login. Not transient:
    the message names what was refused, as whom, and what to check (``rollout_bus.kafka.refusals``)."""


def must_be(name: str, expected: str, value: Any, *, where: str | None = None) -> str:
    """Format the house error message: ``'{name}' must be {expected} (got {value!r})``."""
    message = f"{name!r} must be {expected} (got {value!r})"
    return f"{message} at {where}" if where else message


class EngineError(RolloutBusError):
    """An inference engine answered a request with an error (its status and message), or never answered
    (connection refused or cut, timeout): nothing was published for that call."""


class EngineRefused(EngineError):
    """The engine answered 4xx: the request is wrong (sampling params, context length, an unknown adapter), so
    another engine would refuse it too: ``status`` and the engine's message."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class SampleFailed(EngineError):
    """One sample of a prompt group could not be made: its engine calls failed on each of its tries (the
    siblings were made). The prompt group fails at once, named, rather than be delivered again whole."""


class DiskFullError(RolloutBusError, OSError):
    """No space left on the device (or quota) for a file: ``path``, ``needed`` bytes, ``free`` bytes (None if
    unknown). Transient: writers wait it out (``rollout_bus.model.files.wait_for_disk``)."""

    def __init__(self, path: Any, needed: int, free: int | None, code: int = 28) -> None:
        self.path, self.needed, self.free = str(path), int(needed), free
        free_text = "unknown" if free is None else f"{free:,}"
        super().__init__(code, f"no space left writing {self.path}: needs {self.needed:,} bytes, {free_text} free")

    def __str__(self) -> str:
        return self.strerror
