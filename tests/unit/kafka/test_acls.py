"""Each role's ACLs are exactly its reads and writes, on its own run's topic prefix only."""

from __future__ import annotations

import pytest

from rollout_bus.errors import ConfigError
from rollout_bus.kafka.acls import GENERATORS_GROUP, ROLES, Binding, role_bindings
from rollout_bus.wire.topics import Topics

RUN = Topics("runA.")


def allowed(role: str, topics: Topics = RUN) -> set[tuple[str, str, str]]:
    """(operation, resource kind, name) of the role's LITERAL topic bindings."""
    return {(b.operation, b.resource, b.name) for b in role_bindings(role, role, topics) if b.pattern == "LITERAL"}


def test_the_generator_writes_turns_and_reads_weights_but_cannot_write_weights_or_read_shards():
    found = allowed("generator")
    assert ("WRITE", "TOPIC", "runA.rollout.turns") in found and ("READ", "TOPIC", "runA.rollout.weights") in found
    assert ("WRITE", "TOPIC", "runA.rollout.weights") not in found
    assert not {b for b in found if b[2] == "runA.rollout.shards" and b[0] in ("READ", "WRITE")}


def test_only_the_trainer_writes_weights_and_only_the_shard_writer_writes_shards():
    writers = {topic: {role for role in ROLES if ("WRITE", "TOPIC", topic) in allowed(role)}
               for topic in (RUN.weights, RUN.shards, RUN.episodes, RUN.turns, RUN.prompts, RUN.prompt_ledger)}
    assert writers == {RUN.weights: {"trainer"}, RUN.shards: {"shards"}, RUN.episodes: {"stream"},
                       RUN.turns: {"generator", "stream"}, RUN.prompts: {"generator"},
                       RUN.prompt_ledger: {"generator"}}


def test_the_generator_takes_prompt_groups_in_its_group_keeps_the_ledger_and_may_load_prompts():
    found = allowed("generator")
    assert {("READ", "TOPIC", RUN.prompts), ("WRITE", "TOPIC", RUN.prompts),  # WRITE: `prompts load`
            ("READ", "TOPIC", RUN.prompt_ledger), ("WRITE", "TOPIC", RUN.prompt_ledger),
            ("READ", "GROUP", "runA.rollout-bus-generators"),
            ("DESCRIBE", "GROUP", "runA.rollout-bus-generators")} <= found
    assert RUN.group(GENERATORS_GROUP) == "runA.rollout-bus-generators"
    named = role_bindings("generator", "g", RUN, generators_group="fleet")
    assert Binding("GROUP", "LITERAL", "runA.fleet", "READ") in named
    assert not [b for b in named if b.name == "runA.rollout-bus-generators"]


def test_no_other_stage_reads_the_prompts_or_the_ledger():
    readers = {topic: {role for role in ROLES if ("READ", "TOPIC", topic) in allowed(role)}
               for topic in (RUN.prompts, RUN.prompt_ledger)}
    assert readers == {RUN.prompts: {"generator"}, RUN.prompt_ledger: {"generator"}}  # the observer: by prefix
    observer = role_bindings("observer", "o", RUN)
    assert Binding("TOPIC", "PREFIXED", "runA.rollout.", "READ") in observer
    assert Binding("GROUP", "PREFIXED", "runA.rollout-bus-", "DESCRIBE") in observer  # the generators' lag too


def test_the_observer_writes_nothing_and_reads_only_its_prefix():
    bindings = role_bindings("observer", "watcher", RUN)
    assert {b.operation for b in bindings} == {"READ", "DESCRIBE", "DESCRIBE_CONFIGS"}
    assert all(b.pattern == "PREFIXED" and b.name.startswith("runA.") for b in bindings)


def test_every_binding_is_inside_the_runs_prefix_so_two_runs_share_none():
    for role in ROLES:
        a, b = role_bindings(role, role, Topics("runA.")), role_bindings(role, role, Topics("runB."))
        assert all(x.name.startswith("runA.") for x in a), role
        assert not {x.name for x in a} & {x.name for x in b}, role


def test_the_stream_owns_its_faust_topics_and_group_and_the_shard_writer_its_group():
    stream = role_bindings("stream", "s", RUN, stream_app_id="app")
    assert Binding("TOPIC", "PREFIXED", "runA.app-", "CREATE") in stream
    assert Binding("GROUP", "LITERAL", "runA.app", "READ") in stream
    shards = role_bindings("shards", "w", RUN, shards_group="writers")
    assert Binding("GROUP", "LITERAL", "runA.writers", "READ") in shards
    assert not [b for b in shards if b.operation == "CREATE"]


def test_bindings_are_sorted_without_duplicates_and_print_readably():
    bindings = role_bindings("stream", "s", RUN)
    assert bindings == sorted(set(bindings))
    assert str(Binding("TOPIC", "LITERAL", "t", "READ")) == "READ TOPIC literal 't'"


@pytest.mark.parametrize("role, principal, words", [("admin", "x", "role"), ("trainer", "", "principal")])
def test_an_unknown_role_or_an_empty_principal_is_refused_by_name(role, principal, words):
    with pytest.raises(ConfigError, match=words):
        role_bindings(role, principal, RUN)
