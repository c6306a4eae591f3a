"""The folder tree is the data-flow diagram: the import contracts (``tests.import_contracts``) hold."""

import importlib.util

from tests.import_contracts import (ROOT, STAGES, TOP_LEVEL, client_users, config_text, contract_modules, installed_tree,
                                    run_lint, unlayered)


def test_import_contracts_hold():
    done = run_lint()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 kept, 0 broken" in done.stdout, done.stdout


def test_no_stage_may_import_the_settings():
    """Settings end in the CLI (docs/architecture.md): each stage is a source of the forbidden contract."""
    text = config_text()
    contract = text[text.index("[importlinter:contract:settings-end-in-cli]"):]
    assert all(f"    rollout_bus.{stage}\n" in contract for stage in STAGES)
    assert "forbidden_modules =\n    rollout_bus.config\n" in contract


def test_every_package_and_root_module_is_in_a_layer():
    assert unlayered() == []


def test_the_wire_the_model_and_every_loose_root_module_are_contracts():
    modules = contract_modules()
    assert {"rollout_bus.wire", "rollout_bus.model", "rollout_bus.config", "rollout_bus.errors"} <= set(modules)
    assert not any(m.startswith(("rollout_bus.kafka", "rollout_bus.cli", "rollout_bus.demo", "rollout_bus.observe"))
                   for m in modules)
    assert all(f"    {m}\n" in config_text() for m in modules)


def test_only_the_kafka_package_and_the_faust_app_may_import_client_libraries():
    users = client_users()
    assert "rollout_bus.streams.app" not in users and "rollout_bus.kafka" not in users
    assert {"rollout_bus.streams.worker", "rollout_bus.streams.processor", "rollout_bus.producers",
            "rollout_bus.consumers.shard_writer", "rollout_bus.consumers.feed", "rollout_bus.cli"} <= set(users)


def test_the_root_folders_the_design_card_names_are_the_installed_stages():
    """producers/, streams/ and consumers/ beside pyproject.toml import as rollout_bus.<folder> (setup.py)."""
    assert TOP_LEVEL == ("producers", "streams", "consumers")
    for name in TOP_LEVEL:
        spec = importlib.util.find_spec(f"rollout_bus.{name}")
        assert spec is not None and list(spec.submodule_search_locations) == [str(ROOT / name)], name
        assert not (ROOT / "rollout_bus" / name).exists(), f"rollout_bus/{name} would shadow the root folder"
    assert all(stage.split(".")[0] in TOP_LEVEL for stage in STAGES)


def test_the_linted_tree_holds_every_stage_module(tmp_path):
    tree = installed_tree(tmp_path)
    for name in TOP_LEVEL:
        on_disk = sorted(p.relative_to(ROOT / name) for p in (ROOT / name).rglob("*.py") if "__pycache__" not in p.parts)
        copied = sorted(p.relative_to(tree / "rollout_bus" / name) for p in (tree / "rollout_bus" / name).rglob("*.py"))
        assert on_disk == copied and on_disk, name
