"""Kafka's refusals in words a person can act on: what the broker's error code means here, and what to check.

Why: a refused record reaches the person as the client's class name and the protocol's description
(``InvalidTimestampError: [Error 32] ... out of acceptable range``), which never says "clock". The broker's
reasons that an operator can fix are spelled out once here and used wherever a stage reports a refusal.

Contract: ``explain(exc)`` is one line: ``retry.describe(exc)`` followed, for the refusals listed in
``_HINTS`` (matched by class name, so a client library's own class works too, or named in the message of a
client's generic error), by what to check. Never raises. ``refusals_named(what, conn)`` is a context that
turns a secured cluster's refusal (``is_refusal``: an authorization error, a failed login) raised inside it
into ``refusal(exc, what, conn)``, an ``AccessDenied`` saying what was refused, as which principal, and
what to check, in one line.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from rollout_bus.errors import AccessDenied
from rollout_bus.kafka.retry import describe

REFUSALS = ("AuthorizationError", "SaslAuthenticationFailedError")  # kafka-python's classes, also aiokafka's


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
    "GroupAuthorizationFailedError": lambda: ("this principal may not use the consumer group: check its ACLs (the "
                                              "group names begin with its --topic-prefix)"),
    # an idempotent producer's first request needs WRITE on some topic or IDEMPOTENT_WRITE on the cluster
    "ClusterAuthorizationFailedError": lambda: ("this principal may not do this on the cluster (a producer whose "
                                                "principal may write no topic is refused so): check its role's ACLs"),
    "SaslAuthenticationFailedError": lambda: ("the broker refused the login: check ROLLOUT_BUS_SASL_PLAIN_USERNAME, "
                                              "the password (ROLLOUT_BUS_SASL_PASSWORD_FILE) and ROLLOUT_BUS_SASL_MECHANISM"),
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
    for name, hint in _HINTS.items():  # a client's generic error naming the broker's (kafka-python's
        if name in text:               # "Unexpected error in InitProducerIdResponse: [Error 31] ...")
            return f"{text}: {hint()}"
    return text


def is_refusal(exc: BaseException) -> bool:
    """Whether the cluster refused this principal (an ACL, a login), by class or by a generic error's message."""
    if isinstance(exc, AccessDenied):
        return False  # named already
    if any(cls.__name__ in REFUSALS for cls in type(exc).__mro__):
        return True
    return "AuthorizationFailed" in str(exc) or "SaslAuthenticationFailed" in str(exc)


def refusal(exc: BaseException, what: str, conn: Mapping[str, Any]) -> AccessDenied:
    """``AccessDenied`` for a refusal ``exc`` of ``what``: as which principal, where, and what to check."""
    who = conn.get("sasl_plain_username") or "an anonymous client"
    return AccessDenied(f"{what} as {who!r} at {conn.get('bootstrap_servers')} was refused: {explain(exc)}")


@contextmanager
def refusals_named(what: str, conn: Mapping[str, Any]) -> Iterator[None]:
    """Inside: a refusal of the cluster becomes ``AccessDenied`` (``refusal``)."""
    try:
        yield
    except Exception as exc:
        if not is_refusal(exc):
            raise
        raise refusal(exc, what, conn) from exc
