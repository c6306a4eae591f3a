"""A topic prefix Kafka would refuse is refused in one line naming it, before any client connects."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rollout_bus.cli.main import app
from rollout_bus.errors import ContractError
from rollout_bus.wire.topics import MAX_PREFIX_CHARS, Topics, check_prefix


@pytest.mark.parametrize("prefix", ["", "run42.", "a_b-c.D9."])
def test_legal_prefixes_pass(prefix):
    assert Topics(prefix=prefix).turns == f"{prefix}rollout.turns"


def test_a_prefix_with_characters_kafka_refuses_names_them():
    with pytest.raises(ContractError, match=r"'topic prefix' must be only ASCII .*found ' /'\) \(got 'run 4/2'\)"):
        Topics(prefix="run 4/2")
    with pytest.raises(ContractError, match="found 'é'"):
        check_prefix("café.")


def test_a_prefix_too_long_for_kafka_names_its_length():
    check_prefix("p" * MAX_PREFIX_CHARS)
    with pytest.raises(ContractError, match=rf"at most {MAX_PREFIX_CHARS} characters .*got '{MAX_PREFIX_CHARS + 1} "):
        check_prefix("p" * (MAX_PREFIX_CHARS + 1))


def test_the_cli_refuses_it_as_a_usage_error_without_a_traceback():
    done = CliRunner().invoke(app, ["generate", "--bootstrap-servers", "127.0.0.1:1", "--topic-prefix", "bad prefix!"])
    assert done.exit_code == 2 and "topic prefix" in done.output and "Traceback" not in done.output, done.output
