"""The folder tree is the data-flow diagram: the import contracts (``tests.import_contracts``) hold."""

from tests.import_contracts import client_users, config_text, contract_modules, run_lint


def test_import_contracts_hold():
    done = run_lint()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout, done.stdout


def test_every_top_level_module_of_rollout_bus_is_a_contract_module():
    modules = contract_modules()
    assert {"rollout_bus.config", "rollout_bus.safetensors_frame", "rollout_bus.sample", "rollout_bus.records",
            "rollout_bus.positions"} <= set(modules)
    assert not any(m.startswith(("rollout_bus.kafka", "rollout_bus.cli", "rollout_bus.tools", "rollout_bus.observe"))
                   for m in modules)
    assert all(f"    {m}\n" in config_text() for m in modules)


def test_only_the_kafka_package_and_the_faust_app_may_import_client_libraries():
    users = client_users()
    assert "streams.app" not in users and "rollout_bus.kafka" not in users
    assert {"streams.worker", "streams.processor", "producers", "consumers", "rollout_bus.cli"} <= set(users)
