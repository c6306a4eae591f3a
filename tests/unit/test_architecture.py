"""The folder tree is the data-flow diagram: the import contracts (``tests.import_contracts``) hold."""

from tests.import_contracts import client_users, config_text, contract_modules, run_lint, unlayered


def test_import_contracts_hold():
    done = run_lint()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout, done.stdout


def test_every_package_and_root_module_is_in_a_layer():
    assert unlayered() == []


def test_the_wire_the_model_and_every_loose_root_module_are_contracts():
    modules = contract_modules()
    assert {"rollout_bus.wire", "rollout_bus.model", "rollout_bus.config", "rollout_bus.errors"} <= set(modules)
    assert not any(m.startswith(("rollout_bus.kafka", "rollout_bus.cli", "rollout_bus.tools", "rollout_bus.observe"))
                   for m in modules)
    assert all(f"    {m}\n" in config_text() for m in modules)


def test_only_the_kafka_package_and_the_faust_app_may_import_client_libraries():
    users = client_users()
    assert "rollout_bus.stream.app" not in users and "rollout_bus.kafka" not in users
    assert {"rollout_bus.stream.worker", "rollout_bus.stream.processor", "rollout_bus.publish",
            "rollout_bus.shard_writer", "rollout_bus.feed", "rollout_bus.cli"} <= set(users)
