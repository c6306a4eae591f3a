"""The run's batching record: what a stage declares on rollout.run, parsed strictly, compared by name."""

import json

import pytest

from pydantic import ValidationError

from rollout_bus.config import BatchingSettings, GenerateSettings, ShardSettings
from rollout_bus.errors import ConfigError, ContractError
from rollout_bus.wire.run_record import RunBatching


def test_a_declaration_reads_back_as_written():
    declared = RunBatching(4, "step", 1, "shard writer@host:12")
    assert json.loads(declared.value()) == {"groups_per_batch": 4, "batching": "step", "max_staleness": 1,
                                            "declared_by": "shard writer@host:12"}
    assert RunBatching.parse(declared.value()) == declared
    assert RunBatching.parse(RunBatching(2, "arrival", None).value()).max_staleness is None


@pytest.mark.parametrize("doc,named", [
    ({"groups_per_batch": 0, "batching": "step", "max_staleness": None, "declared_by": ""}, "groups_per_batch"),
    ({"groups_per_batch": True, "batching": "step", "max_staleness": None, "declared_by": ""}, "groups_per_batch"),
    ({"groups_per_batch": 4, "batching": "steps", "max_staleness": None, "declared_by": ""}, "batching"),
    ({"groups_per_batch": 4, "batching": "step", "max_staleness": -1, "declared_by": ""}, "max_staleness"),
    ({"groups_per_batch": 4, "batching": "step", "max_staleness": None}, "declared_by"),
    ({"groups_per_batch": 4, "batching": "step", "max_staleness": None, "declared_by": 3}, "declared_by"),
])
def test_a_declaration_that_is_not_one_is_refused_naming_the_field(doc, named):
    with pytest.raises(ContractError, match=named):
        RunBatching.parse(json.dumps(doc).encode())


@pytest.mark.parametrize("value", [None, b"", b"not json", b"[4, \"step\"]"])
def test_a_value_that_is_no_object_is_refused(value):
    with pytest.raises(ContractError, match="rollout.run batching record"):
        RunBatching.parse(value)


def test_differences_name_every_setting_that_differs_and_ignore_who_declared():
    run = RunBatching(4, "step", 1, "generator@a:1")
    assert run.differences(RunBatching(4, "step", 1, "shard writer@b:2")) == []
    assert run.differences(RunBatching(2, "step", None, "x")) == ["groups_per_batch=4 vs 2",
                                                                  "max_staleness=1 vs None"]
    assert run.differences(RunBatching(4, "arrival", 1, "x")) == ["batching='step' vs 'arrival'"]


def test_generate_and_shards_share_one_batching_default(monkeypatch):
    for name in ("GROUPS_PER_BATCH", "BATCHING", "MAX_STALENESS"):
        monkeypatch.delenv(f"ROLLOUT_BUS_{name}", raising=False)
    declared = {cls.__name__: cls().run_batching("x") for cls in (BatchingSettings, GenerateSettings, ShardSettings)}
    assert len(set(declared.values())) == 1, declared
    assert declared["BatchingSettings"] == RunBatching(4, "step", None, "x")


def test_one_environment_variable_sets_the_batching_of_every_stage(monkeypatch):
    monkeypatch.setenv("ROLLOUT_BUS_GROUPS_PER_BATCH", "8")
    monkeypatch.setenv("ROLLOUT_BUS_MAX_STALENESS", "2")
    assert GenerateSettings().run_batching("g").differences(ShardSettings().run_batching("s")) == []
    assert ShardSettings().groups_per_batch == 8 and GenerateSettings().max_staleness == 2


@pytest.mark.parametrize("groups, mode, bound", [(0, "step", None), (2, "fifo", None), (True, "step", None),
                                                 (4, "step", -1), (4, "step", True), ("4", "step", None)])
def test_a_run_batching_is_checked_once_when_built_naming_the_setting(groups, mode, bound):
    with pytest.raises(ConfigError, match="groups_per_batch|batching|max_staleness"):
        RunBatching(groups, mode, bound)


@pytest.mark.parametrize("env, value, named", [("GROUPS_PER_BATCH", "0", "groups_per_batch"),
                                               ("BATCHING", "steps", "batching"), ("MAX_STALENESS", "-1", "max_staleness")])
def test_settings_a_run_batching_cannot_have_are_refused_by_its_check(monkeypatch, env, value, named):
    monkeypatch.setenv(f"ROLLOUT_BUS_{env}", value)
    for cls in (BatchingSettings, GenerateSettings, ShardSettings):
        with pytest.raises(ValidationError, match=f"'{named}' must be"):
            cls()


@pytest.mark.parametrize("groups_per_batch, group_index, batch", [(4, 0, 0), (4, 3, 0), (4, 4, 1), (1, 7, 7),
                                                                  (3, 11, 3), (8, 100, 12)])
def test_the_step_rule_batch_k_holds_group_indices_k_times_g_to_k_plus_one_times_g(groups_per_batch, group_index,
                                                                                   batch):
    run = RunBatching(groups_per_batch)
    assert run.batch_of(group_index) == batch
    assert batch * groups_per_batch <= group_index < (batch + 1) * groups_per_batch


def test_the_value_a_stage_is_handed_is_the_record_it_declares_byte_for_byte():
    handed = ShardSettings(groups_per_batch=2, max_staleness=1).run_batching()
    assert handed == RunBatching(2, "step", 1, "")
    assert handed.value() == b'{"batching":"step","declared_by":"","groups_per_batch":2,"max_staleness":1}'
