"""How a generator numbers its prompt groups: the contract the shard writer's step batching relies on.

Group indices count the RL step's prompt groups across adapters (group g goes to adapter g mod A),
so a step batch's range of group indices is complete from the episodes alone; each adapter's data
source numbers its own samples (``index``/``rollout_id``) from 0. Several generators on one run
split the indices between them (generator i of N: g mod N == i), so they never make the same group.
Every generator (the simulated one, the real policy's) plans its groups here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollout_bus.errors import ConfigError, must_be
from rollout_bus.model.sample import AdapterRef


@dataclass(frozen=True)
class GroupSpec:
    """One prompt group: which adapter, its index in the step, how many episodes, its first sample index."""

    adapter: AdapterRef | None
    group_index: int
    size: int
    first_index: int


def parse_adapters(spec: str) -> list[AdapterRef | None]:
    """``"math,code"`` -> ``[AdapterRef("math", 0), AdapterRef("code", 1)]``; ``""`` -> ``[None]``."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if len(set(names)) != len(names):
        raise ConfigError(must_be("adapters", "distinct names", spec))
    return [AdapterRef(name, slot) for slot, name in enumerate(names)] or [None]


def plan_groups(episodes: int, n_samples_per_prompt: int, adapters: str = "", *, generators: int = 1,
                generator_index: int = 0) -> list[GroupSpec]:
    """Every prompt group, in publishing order: ``episodes`` in groups of ``n_samples_per_prompt`` (the
    last one may be smaller), for the comma-separated ``adapters`` round-robin.

    Group indices count the RL step's prompt groups across adapters (group g goes to adapter
    g mod A), so a step batch's range of group indices is complete from the episodes alone; each
    adapter's data source numbers its own samples (``index``/``rollout_id``) from 0. Generator i of
    N (``generator_index``, ``generators``) makes the run's groups j * N + i (its j-th group goes to
    its adapter j mod A): N generators together make every index once, and none makes another's.
    """
    n = n_samples_per_prompt
    refs = parse_adapters(adapters)
    groups = []
    for j in range(math.ceil(episodes / n)):
        local = j // len(refs)
        size = min(n, episodes - j * n)
        groups.append(GroupSpec(refs[j % len(refs)], j * generators + generator_index, size, local * n))
    return groups
