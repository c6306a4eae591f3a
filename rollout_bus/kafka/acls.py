"""Least privilege on the bus: the Kafka ACLs each role's principal needs, scoped to one run's topic prefix.

Why: a client that can write rollout.weights tells every generator which weights to load, and one that
writes rollout.turns writes training data; on a cluster that denies what no ACL allows
(``allow.everyone.if.no.acl.found=false``), each role gets exactly its reads and writes, on the topics and
groups of one prefix, so two runs sharing a cluster cannot touch each other's data.

What each role may do (``Topics(prefix)`` names every topic; the groups are ``Topics.group`` names):

============  ========================================================================================
role          allowed
============  ========================================================================================
every role    DESCRIBE and DESCRIBE_CONFIGS on every topic of the prefix (finding the run's topics and
              their record limits); READ and WRITE on rollout.run (the first stage declares the batching)
generator     WRITE rollout.turns (turns, end-of-run markers), rollout.dlq, rollout.metrics (its flow);
              READ rollout.turns (a resumed prompt group's logged turns, by offset);
              READ rollout.weights; READ rollout.prompts, READ and WRITE rollout.prompt_ledger (claimed,
              done, failed, progress), READ and DESCRIBE its group (``rollout-bus-generators``: the generators that
              share the prompt groups); WRITE rollout.prompts (an operator's load, below)
stream        READ rollout.turns, WRITE rollout.turns (a misplaced turn re-routed), rollout.episodes,
              rollout.metrics, rollout.dlq; its group (the Faust app id) and the Faust app's own topics
              (``{app_id}-...``: state changelog, leader topic): READ, WRITE, CREATE, ALTER (the
              changelog grows with rollout.turns)
shards        READ rollout.episodes, rollout.shards (its own announcements, on recovery), rollout.weights
              (staleness); WRITE rollout.shards, rollout.metrics, rollout.dlq; its group
trainer       READ rollout.shards, rollout.weights; WRITE rollout.weights, rollout.metrics (its flow)
observer      READ every topic of the prefix, DESCRIBE its groups (``{prefix}rollout-bus-...``: lag); no write
============  ========================================================================================

Topics are created by an administrator (``rollout-bus topics create`` as ``admin``), not by the stages.
Loading prompts (``rollout-bus prompts load``: prompt groups to rollout.prompts, then a ``loaded`` event to
rollout.prompt_ledger) is an operator act, not a stage's; it runs as the generator role, which therefore also
WRITEs rollout.prompts (no other role does).

Contract: ``role_bindings(role, principal, topics, ...)`` is pure: the ``Binding``s (resource, name, pattern,
operation; always ALLOW, any host) of one role, sorted; ``apply_bindings(conn, bindings)`` creates them
(creating an existing ACL is a no-op in Kafka) and raises ``BrokerError`` naming any the broker refused;
``grant_roles(conn, topics, ...)`` gives every role's principal, named as the role (the local and compose
setups), its bindings;
``list_bindings(conn)`` reads back every ACL the cluster holds, as ``(principal, Binding)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rollout_bus.errors import BrokerError, ConfigError, must_be
from rollout_bus.wire.topics import Topics

ROLES = ("generator", "stream", "shards", "trainer", "observer")
STREAM_APP_ID = "rollout-bus-stream"
SHARDS_GROUP = "rollout-bus-shards"
GENERATORS_GROUP = "rollout-bus-generators"  # the generators sharing rollout.prompts (``Topics.group`` adds the prefix)
GROUPS_PREFIX = "rollout-bus-"  # the stages' own groups begin so (after the topic prefix)


@dataclass(frozen=True, order=True)
class Binding:
    """One ALLOW ACL: ``operation`` on the ``resource`` (TOPIC, GROUP) ``name``, LITERAL or PREFIXED."""

    resource: str
    pattern: str
    name: str
    operation: str

    def __str__(self) -> str:
        return f"{self.operation} {self.resource} {self.pattern.lower()} {self.name!r}"


def _topic(name: str, *operations: str, prefixed: bool = False) -> list[Binding]:
    return [Binding("TOPIC", "PREFIXED" if prefixed else "LITERAL", name, op) for op in operations]


def _group(name: str, *operations: str, prefixed: bool = False) -> list[Binding]:
    return [Binding("GROUP", "PREFIXED" if prefixed else "LITERAL", name, op) for op in operations]


def role_bindings(role: str, principal: str, topics: Topics, *, stream_app_id: str = STREAM_APP_ID,
                  shards_group: str = SHARDS_GROUP, generators_group: str = GENERATORS_GROUP) -> list[Binding]:
    """The ACLs of ``role`` on the run of ``topics`` (the group names before the prefix, as the stages take them)."""
    if role not in ROLES:
        raise ConfigError(must_be("role", f"one of {', '.join(ROLES)}", role))
    if not principal:
        raise ConfigError(must_be("principal", "a user name", principal))
    t = topics
    run_topics = f"{t.prefix}rollout."
    if role == "observer":
        return sorted(_topic(run_topics, "READ", "DESCRIBE", "DESCRIBE_CONFIGS", prefixed=True)
                      + _group(t.group(GROUPS_PREFIX), "DESCRIBE", prefixed=True))
    found = _topic(run_topics, "DESCRIBE", "DESCRIBE_CONFIGS", prefixed=True) + _topic(t.run, "READ", "WRITE")
    if role == "generator":
        found += (_topic(t.turns, "READ", "WRITE") + _topic(t.dlq, "WRITE") + _topic(t.weights, "READ")
                  + _topic(t.metrics, "WRITE") + _topic(t.prompts, "READ", "WRITE")
                  + _topic(t.prompt_ledger, "READ", "WRITE") + _group(t.group(generators_group), "READ", "DESCRIBE"))
    elif role == "stream":
        app = t.group(stream_app_id)
        found += (_topic(t.turns, "READ", "WRITE") + _topic(t.episodes, "WRITE") + _topic(t.metrics, "WRITE")
                  + _topic(t.dlq, "WRITE") + _group(app, "READ", "DESCRIBE")
                  + _topic(app + "-", "READ", "WRITE", "CREATE", "ALTER", "DESCRIBE", "DESCRIBE_CONFIGS",
                           prefixed=True))
    elif role == "shards":
        found += (_topic(t.episodes, "READ") + _topic(t.shards, "READ", "WRITE") + _topic(t.weights, "READ")
                  + _topic(t.metrics, "WRITE") + _topic(t.dlq, "WRITE") + _group(t.group(shards_group), "READ", "DESCRIBE"))
    else:  # trainer
        found += _topic(t.shards, "READ") + _topic(t.weights, "READ", "WRITE") + _topic(t.metrics, "WRITE")
    return sorted(set(found))


def grant_roles(conn: Mapping[str, Any], topics: Topics, *, stream_app_id: str = STREAM_APP_ID,
                shards_group: str = SHARDS_GROUP, generators_group: str = GENERATORS_GROUP) -> int:
    """Every role's principal, named as the role, gets its ACLs on the run of ``topics``; return how many."""
    return apply_bindings(conn, [(role, b) for role in ROLES for b in role_bindings(
        role, role, topics, stream_app_id=stream_app_id, shards_group=shards_group,
        generators_group=generators_group)])


def _acl(principal: str, binding: Binding) -> Any:
    from kafka.admin import (ACL, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePattern,
                             ResourceType)

    pattern = ResourcePattern(ResourceType[binding.resource], binding.name, ACLResourcePatternType[binding.pattern])
    return ACL(f"User:{principal}", "*", ACLOperation[binding.operation], ACLPermissionType.ALLOW, pattern)


def apply_bindings(conn: Mapping[str, Any], bindings: Iterable[tuple[str, Binding]]) -> int:
    """Create every ``(principal, binding)``; return how many were asked. ``BrokerError`` names a refused one."""
    from rollout_bus.kafka.clients import KafkaError, new_admin  # kafka-python: imported where it is used

    wanted = list(bindings)
    if not wanted:
        return 0
    admin = new_admin(dict(conn), client_id="rollout-bus-acls")
    try:
        result = admin.create_acls([_acl(principal, binding) for principal, binding in wanted])
    except KafkaError as exc:
        raise BrokerError(f"creating ACLs at {conn.get('bootstrap_servers')!r} failed: {exc!r} (the principal "
                          f"{conn.get('sasl_plain_username')!r} must be a super user or hold ALTER on the cluster)") from exc
    finally:
        admin.close()
    if result["failed"]:
        raise BrokerError(f"the broker refused {len(result['failed'])} of {len(wanted)} ACLs: {result['failed'][0]!r}")
    return len(wanted)


def list_bindings(conn: Mapping[str, Any]) -> list[tuple[str, Binding]]:
    """Every ALLOW ACL of the cluster as ``(principal without 'User:', Binding)``, sorted."""
    from kafka.admin import (ACLFilter, ACLOperation, ACLPermissionType, ACLResourcePatternType,
                             ResourcePatternFilter, ResourceType)

    from rollout_bus.kafka.clients import KafkaError, new_admin

    admin = new_admin(dict(conn), client_id="rollout-bus-acls")
    try:
        acls, error = admin.describe_acls(ACLFilter(None, None, ACLOperation.ANY, ACLPermissionType.ANY,
                                                    ResourcePatternFilter(ResourceType.ANY, None,
                                                                          ACLResourcePatternType.ANY)))
    except KafkaError as exc:
        raise BrokerError(f"listing ACLs at {conn.get('bootstrap_servers')!r} failed: {exc!r}") from exc
    finally:
        admin.close()
    found = []
    for acl in acls:
        pattern = acl.resource_pattern
        found.append((acl.principal.removeprefix("User:"),
                      Binding(pattern.resource_type.name, pattern.pattern_type.name, pattern.resource_name,
                              acl.operation.name)))
    return sorted(found)
