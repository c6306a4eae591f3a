"""A consumer group as the broker describes it, for tests that wait for members to settle."""

from __future__ import annotations

from kafka import KafkaAdminClient
from kafka.errors import CoordinatorNotAvailableError, NotCoordinatorError


def stable_group(client_kwargs: dict, group: str) -> dict | None:
    """The group's description once it is Stable; None while it is not, or while its coordinator is still
    being elected (a group just joined, ``__consumer_offsets`` still loading): the caller asks again."""
    admin = KafkaAdminClient(**client_kwargs)
    try:
        info = admin.describe_groups([group]).get(group, {})
    except (CoordinatorNotAvailableError, NotCoordinatorError):
        return None
    finally:
        admin.close()
    return info if info.get("group_state") == "Stable" else None
