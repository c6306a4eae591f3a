"""Topic administration with kafka-python: create the pipeline's topics idempotently, sized for its records.

Contract of ``ensure_topics``:

* Every pipeline topic (and each of ``extra``) that does not exist is created with its partition
  count, ``replication_factor``, and ``limits.topic_config(max_record_bytes)`` (``max.message.bytes``
  large enough for the largest record), so no stage creates a topic with broker defaults; a
  compacted spec (rollout.weights) also gets ``cleanup.policy=compact``.
* A topic that exists keeps its partitions; if its ``max.message.bytes`` is below what
  ``max_record_bytes`` needs, it is raised (an incremental config change: its other settings stay), and
  ``ensure_topics`` returns once the cluster describes the new limit and lists the topics it created (at most
  10 s each, then a WARNING). Topics are created one by one: one the listing missed (another process made it,
  or a broker that just started lists it late) is treated as existing, its limit raised, not said created.
  A topic that already allows more is left alone. When the cluster refuses to describe or change
  it (authorization, an old broker), a WARNING names the topic, its size and the size needed, and
  the run goes on: records up to the old size still flow, larger ones are dead-lettered by
  reference.
* Returns the names created. Two processes racing to create the same topics is fine.
* A cluster that does not answer (or refuses to create a topic) is a ``BrokerError`` naming the
  bootstrap servers and kafka-python's reason, never a raw client traceback.

``wait_for_cluster(client_kwargs, timeout_s)`` polls until the cluster answers, with a WARNING at the
first failed probe and every 10 s after, saying why (refused, unresolved, dropped: ``reachability``), while it
does not (a stage started during a broker outage waits it out instead of failing),
and raises ``BrokerError`` after ``timeout_s``. ``require_cluster(client_kwargs)`` is the one-shot of it: a
``BrokerError`` within seconds (at once for a closed port). Both probe with kafka-python's own log lines muted
and say a port no address of which accepts TCP without building a client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import AuthorizationError, KafkaError, TopicAlreadyExistsError

from rollout_bus.errors import BrokerError
from rollout_bus.kafka.clients import KafkaAdminClient, new_admin
from rollout_bus.kafka.limits import topic_config
from rollout_bus.kafka.client_logs import muted_client_logs
from rollout_bus.kafka.reachability import diagnose, unreachable
from rollout_bus.kafka.retry import describe
from rollout_bus.wire.topics import DEFAULT_MAX_RECORD_BYTES, TopicSpec, Topics

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = "max.message.bytes"
LIMIT_VISIBLE_S = 10.0  # the longest ensure_topics waits for a raised record limit to be described


def ensure_topics(client_kwargs: dict[str, Any], topics: Topics, *, replication_factor: int = 1,
                  extra: dict[str, int] | None = None,
                  max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, only: Iterable[str] | None = None) -> list[str]:
    """Create every pipeline topic that does not exist yet, and raise the record size limit of those
    that do where it is too small; return the names created.

    ``extra`` maps further topic names to partition counts (tests use it for private topics);
    ``only`` limits the work to those pipeline topics (a stage that needs one topic of its own).
    """
    wanted = {spec.name: spec.partitions for spec in topics.specs() if only is None or spec.name in set(only)}
    wanted.update(extra or {})
    configs = topic_config(max_record_bytes)
    admin = new_admin(client_kwargs)
    try:
        existing = set(admin.list_topics())
        own = {spec.name: _own_config(spec) for spec in topics.specs()}
        missing = {name: {"num_partitions": partitions, "replication_factor": replication_factor,
                          "configs": {**configs, **own.get(name, {})}}
                   for name, partitions in wanted.items() if name not in existing}
        created = []
        for name, spec in missing.items():  # one by one: a topic the listing missed (another process made it,
            try:                            # or a broker that just started lists it late) is an existing one
                admin.create_topics({name: spec})
            except TopicAlreadyExistsError:
                existing.add(name)
                continue
            created.append(name)
            logger.info("created topic=%s partitions=%d replication=%d %s=%s", name, spec["num_partitions"],
                        replication_factor, MAX_MESSAGE_BYTES, configs[MAX_MESSAGE_BYTES])
        if created:
            _until_listed(admin, created)
        present = sorted(name for name in wanted if name in existing)
        if present:
            raise_record_limits(admin, present, int(configs[MAX_MESSAGE_BYTES]))
        return created
    except AuthorizationError as exc:  # a secured cluster: the stages' principals create no topics
        raise BrokerError(f"{type(exc).__name__} at {client_kwargs.get('bootstrap_servers')!r}: the principal "
                          f"{client_kwargs.get('sasl_plain_username')!r} may not create or configure the topics "
                          f"{', '.join(sorted(wanted))}: on a cluster with ACLs an administrator creates them first "
                          f"(`rollout-bus topics create` as admin), and each role gets its ACLs "
                          f"(`rollout-bus acl apply`)") from exc
    except KafkaError as exc:
        raise BrokerError(f"creating topics at {client_kwargs.get('bootstrap_servers')!r} failed: {exc!r}") from exc
    finally:
        admin.close()


def _until_listed(admin: KafkaAdminClient, names: list[str]) -> None:
    """Wait (at most ``LIMIT_VISIBLE_S``) until the cluster lists the topics just created, so the caller's next
    request (a describe, a produce) finds them; a WARNING names any still missing after that."""
    deadline = time.monotonic() + LIMIT_VISIBLE_S
    while True:
        missing = set(names) - set(admin.list_topics())
        if not missing:
            return
        if time.monotonic() >= deadline:
            logger.warning("created topics=%s but the cluster does not list them after %.0fs",
                           ",".join(sorted(missing)), LIMIT_VISIBLE_S)
            return
        time.sleep(0.2)


def _own_config(spec: TopicSpec) -> dict[str, str]:
    """What a topic sets beyond the record limits: compaction (the latest per key), or keeping every record.
    A run's records must outlive any stall of the stage that reads them: time or size retention would
    delete them unread (a stream worker stopped for longer than the broker's log.retention.* lost a whole
    run before); a finished run's topics are deleted by the operator."""
    if spec.compacted:
        return {"cleanup.policy": "compact"}
    return {"retention.ms": "-1", "retention.bytes": "-1"}


def _probe(client_kwargs: dict[str, Any], probe_timeout_s: float) -> str | None:
    """None when the cluster answers a metadata request, else why not. A bootstrap no address of which accepts
    a TCP connection is said by ``reachability.unreachable`` without building a client; the client's own
    log lines are muted while it asks (the caller says the failure once, in its words)."""
    servers = client_kwargs.get("bootstrap_servers") or ""
    closed = unreachable(servers, timeout_s=min(2.0, probe_timeout_s))
    if closed is not None:
        return closed
    probe_ms = int(probe_timeout_s * 1000)
    with muted_client_logs():
        try:
            admin = new_admin(client_kwargs, bootstrap_timeout_ms=probe_ms, request_timeout_ms=probe_ms)
            try:
                admin.list_topics()
                return None
            finally:
                admin.close()
        except (BrokerError, KafkaError) as exc:
            return f"{diagnose(servers, connection=client_kwargs)} ({exc})"


def require_cluster(client_kwargs: dict[str, Any], timeout_s: float = 5.0) -> None:
    """``BrokerError`` (one line: the bootstrap and why) unless the cluster answers within ``timeout_s``;
    for the commands that do not ride out an outage (``end-run``, ``demo``): they say it at once."""
    why = _probe(client_kwargs, timeout_s)
    if why is not None:
        raise BrokerError(f"no Kafka cluster answered at {client_kwargs.get('bootstrap_servers')!r}: {why}")


def wait_for_cluster(client_kwargs: dict[str, Any], timeout_s: float | None, *, log_every_s: float = 10.0,
                     probe_timeout_s: float = 5.0) -> None:
    """Return once the cluster answers a metadata request; WARNING every ``log_every_s`` while it
    does not, the first one after the first failed probe (at once for a closed port), each saying why
    (``_probe``: refused, unresolved, dropped, or past TCP); ``BrokerError`` after ``timeout_s``, with the same
    reason; ``timeout_s`` None waits as long as it takes (a stage whose job is to ride out outages).
    Uses the full client settings (SASL/SSL too)."""
    began = time.monotonic()
    last_log = None
    servers = client_kwargs.get("bootstrap_servers")
    while True:
        why = _probe(client_kwargs, probe_timeout_s)
        if why is None:
            return
        now = time.monotonic()
        if timeout_s is not None and now - began >= timeout_s:
            raise BrokerError(f"no Kafka cluster answered at {servers!r} within {timeout_s:.0f}s: {why}")
        if last_log is None or now - last_log >= log_every_s:
            last_log = now
            limit = f"gives up after {timeout_s:.0f}s" if timeout_s is not None else "until it answers"
            logger.warning("waiting for broker: no answer from bootstrap_servers=%s for %.0fs: %s (retrying %s)",
                           servers, now - began, why, limit)
        left = 1.0 if timeout_s is None else timeout_s - (time.monotonic() - began)
        time.sleep(min(1.0, max(0.0, left)))


def grow_partitions(client_kwargs: dict[str, Any], name: str, count: int) -> int | None:
    """Give the existing topic ``name`` at least ``count`` partitions; returns the count it had when it had
    fewer (None: it does not exist, or already had enough). A stream worker's state changelog must have
    as many partitions as rollout.turns, which an operator may have raised mid-run."""
    admin = new_admin(client_kwargs)
    try:
        found = [t for t in admin.describe_topics([name]) if t.get("error_code", 0) == 0 and t.get("partitions")]
        if not found or len(found[0]["partitions"]) >= count:
            return None
        before = len(found[0]["partitions"])
        admin.create_partitions({name: count})
        logger.warning("topic=%s had %d partitions, raised to %d (as many as the topic it keeps state for)", name,
                       before, count)
        return before
    except KafkaError as exc:
        raise BrokerError(f"raising the partitions of {name} to {count} failed: {describe(exc)}") from exc
    finally:
        admin.close()


def raise_record_limits(admin: KafkaAdminClient, names: list[str], needed: int) -> list[str]:
    """Raise ``max.message.bytes`` to ``needed`` on each of ``names`` where it is smaller; return
    the names raised, once the cluster reports the new limits (``_until_visible``). Never raises: what the
    cluster refuses is logged as a WARNING."""
    try:
        current = _record_limits(admin, names)
    except KafkaError as exc:
        logger.warning("cannot read %s of topics=%s (%s): records over their current limit will be "
                       "dead-lettered; needed=%d", MAX_MESSAGE_BYTES, ",".join(names), exc, needed)
        return []
    small = {name: size for name, size in current.items() if size is not None and size < needed}
    raised = []
    for name, size in sorted(small.items()):
        resource = ConfigResource(ConfigResourceType.TOPIC, name, {MAX_MESSAGE_BYTES: str(needed)})
        try:
            outcome = admin.alter_configs([resource]).get("topic", {}).get(name)
        except (KafkaError, ValueError) as exc:
            outcome = exc
        if outcome == "OK":
            raised.append(name)
            logger.info("raised %s topic=%s from=%d to=%d", MAX_MESSAGE_BYTES, name, size, needed)
        else:
            logger.warning("topic=%s allows records of %s=%d but max_record_bytes needs %d, and raising it "
                           "failed (%s): records over %d bytes will be dead-lettered", name, MAX_MESSAGE_BYTES,
                           size, needed, outcome, size)
    if raised:
        _until_visible(admin, raised, needed)
    return raised


def _until_visible(admin: KafkaAdminClient, names: list[str], needed: int) -> None:
    """Wait until the cluster describes every raised limit: KRaft applies a config change to a broker's
    metadata a moment after the controller accepted it, and a record sent in that moment is still refused
    for its size. Past ``LIMIT_VISIBLE_S`` a WARNING says which topics still show the old limit."""
    timeout_s = LIMIT_VISIBLE_S
    deadline = time.monotonic() + timeout_s
    waiting = list(names)
    while True:
        try:
            shown = _record_limits(admin, waiting)
            waiting = [name for name in waiting if (shown.get(name) or 0) < needed]
        except KafkaError as exc:
            logger.debug("describing %s of %s failed (%s): asking again", MAX_MESSAGE_BYTES, waiting, exc)
        if not waiting:
            return
        if time.monotonic() >= deadline:
            logger.warning("raised %s on topics=%s but the cluster still describes the old limit after %.0fs: "
                           "records over it may be refused until it does", MAX_MESSAGE_BYTES, ",".join(waiting),
                           timeout_s)
            return
        time.sleep(0.2)


def _record_limits(admin: KafkaAdminClient, names: list[str]) -> dict[str, int | None]:
    """Each topic's effective ``max.message.bytes`` (None where the cluster did not say)."""
    resources = [ConfigResource(ConfigResourceType.TOPIC, name, [MAX_MESSAGE_BYTES]) for name in names]
    described = admin.describe_configs(resources, config_filter="all").get("topic", {})
    limits: dict[str, int | None] = {}
    for name in names:
        entry = described.get(name, {}).get(MAX_MESSAGE_BYTES) or {}
        try:
            limits[name] = int(entry["value"])
        except (KeyError, TypeError, ValueError):
            limits[name] = None
    return limits


def existing_topics(client_kwargs: dict[str, Any], names: list[str]) -> set[str]:
    """Which of ``names`` exist on the cluster; ``BrokerError`` when the cluster does not answer."""
    admin = new_admin(client_kwargs)
    try:
        return set(admin.list_topics()) & set(names)
    except KafkaError as exc:
        raise BrokerError(f"cannot list the topics at {client_kwargs.get('bootstrap_servers')!r}: {exc}") from exc
    finally:
        admin.close()
