"""How generators number their prompt groups: one generator as always, several without collisions."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout_bus.config import GenerateSettings
from rollout_bus.producers.groups import plan_groups


def _keys(**plan) -> set[tuple]:
    return {(g.adapter.name if g.adapter else None, g.group_index, g.first_index + j)
            for g in plan_groups(**plan) for j in range(g.size)}


def test_one_generator_numbers_groups_from_zero_round_robin_over_its_adapters():
    groups = plan_groups(episodes=22, n_samples_per_prompt=4, adapters="math,code")
    assert [g.group_index for g in groups] == [0, 1, 2, 3, 4, 5]
    assert [g.adapter.name for g in groups] == ["math", "code"] * 3
    assert [g.first_index for g in groups] == [0, 0, 4, 4, 8, 8] and groups[-1].size == 2


def test_generators_of_one_run_split_the_group_indices_and_never_make_the_same_episode():
    a = dict(episodes=32, n_samples_per_prompt=4, adapters="math", generators=2, generator_index=0)
    b = dict(episodes=32, n_samples_per_prompt=4, adapters="code", generators=2, generator_index=1)
    ga, gb = plan_groups(**a), plan_groups(**b)
    assert [g.group_index for g in ga] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert [g.group_index for g in gb] == [1, 3, 5, 7, 9, 11, 13, 15]
    # together every index of the run once: step batch k ([k*G, (k+1)*G)) is complete from both
    assert sorted(g.group_index for g in ga + gb) == list(range(16))
    assert not _keys(**a) & _keys(**b)
    # the same adapter in both generators: the group index still tells the episodes apart
    same = [dict(episodes=32, n_samples_per_prompt=4, adapters="math", generators=2, generator_index=i)
            for i in (0, 1)]
    assert not _keys(**same[0]) & _keys(**same[1])


def test_a_generator_index_outside_the_generators_is_refused_by_name():
    with pytest.raises(ValidationError, match="generator_index must be < generators=2"):
        GenerateSettings(generators=2, generator_index=2)


def test_a_generators_id_is_the_same_across_its_restarts_and_differs_from_any_other_generators():
    from rollout_bus.config import GenerateSettings

    one = GenerateSettings(generators=2, generator_index=1, seed=5)
    assert one.generator_id() == "g1of2-seed5" == GenerateSettings(generators=2, generator_index=1, seed=5).generator_id()
    others = {GenerateSettings(generators=2, generator_index=0, seed=5).generator_id(),
              GenerateSettings(generators=2, generator_index=1, seed=6).generator_id(),
              GenerateSettings(generators=3, generator_index=1, seed=5).generator_id()}
    assert one.generator_id() not in others and len(others) == 3


def test_a_generators_settings_plan_its_groups_through_plain_arguments():
    settings = GenerateSettings(episodes=10, n_samples_per_prompt=3, adapters="math,code", generators=3,
                                generator_index=2)
    groups = plan_groups(**settings.group_plan())
    assert groups == plan_groups(10, 3, "math,code", generators=3, generator_index=2)
    assert [(g.group_index, g.size) for g in groups] == [(2, 3), (5, 3), (8, 3), (11, 1)]
