"""``rollout-bus acl apply --dry-run``: which principal gets which role, without a broker."""

from __future__ import annotations

from typer.testing import CliRunner

from rollout_bus.cli.main import app
from rollout_bus.kafka.acls import ROLES, role_bindings
from rollout_bus.wire.topics import Topics

runner = CliRunner()


def _dry(*args: str):
    return runner.invoke(app, ["acl", "apply", "--dry-run", "--bootstrap-servers", "127.0.0.1:1", *args])


def test_role_all_grants_every_role_to_the_principal_of_its_name():
    done = _dry("--role", "all", "--topic-prefix", "run7.")
    assert done.exit_code == 0, done.output
    printed = [line for line in done.stdout.splitlines() if line.startswith("User:")]
    wanted = [f"User:{role} ALLOW {b}" for role in ROLES for b in role_bindings(role, role, Topics("run7."))]
    assert printed == wanted and len({line.split()[0] for line in printed}) == len(ROLES)


def test_one_role_goes_to_the_named_principal_only():
    done = _dry("--role", "trainer", "--principal", "run7-trainer", "--topic-prefix", "run7.")
    assert done.exit_code == 0, done.output
    printed = [line for line in done.stdout.splitlines() if line.startswith("User:")]
    assert printed and all(line.startswith("User:run7-trainer ALLOW ") for line in printed)


def test_the_generator_role_prints_its_prompt_bindings_on_the_prefix():
    done = _dry("--role", "generator", "--principal", "gen", "--topic-prefix", "run7.")
    assert done.exit_code == 0, done.output
    printed = set(done.stdout.splitlines())
    assert {"User:gen ALLOW READ TOPIC literal 'run7.rollout.prompts'",
            "User:gen ALLOW WRITE TOPIC literal 'run7.rollout.prompts'",
            "User:gen ALLOW READ TOPIC literal 'run7.rollout.prompt_ledger'",
            "User:gen ALLOW WRITE TOPIC literal 'run7.rollout.prompt_ledger'",
            "User:gen ALLOW READ GROUP literal 'run7.rollout-bus-generators'",
            "User:gen ALLOW DESCRIBE GROUP literal 'run7.rollout-bus-generators'"} <= printed


def test_a_missing_or_contradicting_principal_is_one_line_naming_it():
    alone = _dry("--role", "trainer")
    assert alone.exit_code == 1 and "--role trainer needs --principal" in alone.output
    both = _dry("--role", "all", "--principal", "bob")
    assert both.exit_code == 1 and "--principal 'bob' with --role all" in both.output
    unknown = _dry("--role", "trainr", "--principal", "bob")
    assert unknown.exit_code == 1 and "trainr" in unknown.output
