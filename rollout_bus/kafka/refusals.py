"""Kafka's refusals in words a person can act on: what the broker's error code means here, and what to check.

Why: a refused record reaches the person as the client's class name and the protocol's description
(``InvalidTimestampError: [Error 32] ... out of acceptable range``), which never says "clock". The broker's
reasons that an operator can fix are spelled out once here and used wherever a stage reports a refusal.

Contract: ``explain(exc)`` is one line: ``retry.describe(exc)`` followed, for the refusals listed in
``_HINTS`` (matched by class name, so a client library's own class works too), by what to check. Never raises.
"""

from __future__ import annotations

import time

from rollout_bus.kafka.retry import describe


def _clock() -> str:
    now = time.time()
    return (f"check this host's clock (it says {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))}) against the "
            f"broker's: the broker refuses a record whose timestamp is more than log.message.timestamp.after.max.ms "
            f"(1 h by default in Kafka 4) ahead of its own time, or log.message.timestamp.before.max.ms behind")


_HINTS = {
    "InvalidTimestampError": _clock,
    "InvalidTopicError": lambda: ("the topic name is not one Kafka accepts (ASCII letters, digits, '.', '_', '-', "
                                  "at most 249 characters): check --topic-prefix"),
    "TopicAuthorizationFailedError": lambda: ("this principal may not use the topic: check its ACLs, or the "
                                              "--topic-prefix it is allowed"),
    "UnknownTopicOrPartitionError": lambda: ("the topic does not exist (or not yet): check --topic-prefix, or "
                                             "create it with rollout-bus topics create"),
}


def explain(exc: BaseException) -> str:
    """``describe(exc)``, then what to check for the refusals a person can fix."""
    text = describe(exc)
    for cls in type(exc).__mro__:
        hint = _HINTS.get(cls.__name__)
        if hint is not None:
            return f"{text}: {hint()}"
    return text
