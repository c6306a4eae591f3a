"""The demo's own prompt file is installed with the package and is what ``demo --from-prompts`` loads by default;
the demo refuses, in one line and before any broker, a bad prompt file and the flags only the seeded generator
takes."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout_bus.cli.demo import packaged_prompts
from rollout_bus.cli.main import app
from rollout_bus.producers.prompt_file import read_prompt_file

runner = CliRunner()
CLOSED = ["--bootstrap-servers", "127.0.0.1:1"]  # nothing answers there: a refusal must come before any broker


def test_the_packaged_prompt_file_loads_16_prompt_groups_of_4():
    packaged = resources.files("rollout_bus.demo").joinpath("prompts.jsonl")
    assert packaged.is_file()
    lines = read_prompt_file(Path(str(packaged)))
    assert len(lines) == 16 and len({line.id for line in lines}) == 16
    for index, line in enumerate(lines):
        group = line.group(index)
        assert 8 <= len(group.input_ids) <= 24 and all(5 <= t <= 30000 for t in group.input_ids), line.where
        assert group.n_samples == 4 and isinstance(group.label, str) and group.label, line.where


def test_the_demo_from_prompts_loads_the_packaged_file_by_default():
    assert packaged_prompts() == Path(str(resources.files("rollout_bus.demo").joinpath("prompts.jsonl")))


def _refusal(args: list[str]) -> str:
    done = runner.invoke(app, ["demo", *CLOSED, *args])
    lines = [line for line in done.output.splitlines() if line.strip()]
    assert done.exit_code == 2 and len(lines) == 1, done.output
    return lines[0]


def test_a_bad_prompt_file_is_refused_naming_its_line(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"input_ids": [5, 6], "label": "a"}\n{"input_ids": [], "label": "b"}\n')
    assert "prompts.jsonl:2" in _refusal(["--prompts", str(bad)])


@pytest.mark.parametrize("args, named", [(["--from-prompts", "--episodes", "8"], "--episodes"),
                                         (["--from-prompts", "--learn", "--adapters", "math"], "--adapters"),
                                         (["--from-prompts", "--inject-faults"], "--inject-faults"),
                                         (["--from-prompts", "--train", "--max-staleness", "1"], "--max-staleness"),
                                         (["--generators", "3"], "--generators")])
def test_flags_the_run_from_prompts_cannot_follow_are_refused_in_one_line(args, named):
    assert named in _refusal(args)


def test_learn_from_prompts_is_runnable_its_episodes_sizing_the_calculator_prompts():
    done = runner.invoke(app, ["demo", *CLOSED, "--from-prompts", "--learn", "--episodes", "128"])
    assert done.exit_code == 1 and "no Kafka cluster answered" in done.output, done.output  # past every refusal
