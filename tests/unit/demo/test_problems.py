"""rollout_bus.demo.problems: what went wrong prints as data (keys survive rich), and the writer's lost verdict."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from rollout_bus.consumers.shard_writer.lost_markers import EXIT_RECORDS_LOST, LostRange, RecordsLostError
from rollout_bus.demo.problems import print_problems, records_lost_verdict

KEYS = ['[null,null,"rollout",16,67]', '[null,null,"rollout",16,68]', '["math",1,"rollout",3,9]']


def printed(problems: list[str]) -> str:
    console = Console(file=io.StringIO(), width=400, color_system=None)
    print_problems(console, problems)
    return console.file.getvalue()


def test_episode_keys_in_a_problem_print_as_keys():
    out = printed([f"3 episodes in no batch and not in the DLQ, e.g. {KEYS}", "[red]not markup either[/red]"])
    for key in KEYS:
        assert key in out, out
    assert "[red]not markup either[/red]" in out


class _Stage:
    def __init__(self, log: str) -> None:
        self.log, self.log_path = log, Path("logs/shards.log")

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(self.log.splitlines()[-lines:])


def test_the_lost_verdict_is_the_writer_s_line_naming_every_range():
    error = RecordsLostError([LostRange("t.rollout.episodes", p, 0, 52) for p in range(4)])
    log = "\n".join(["INFO reading", *(f"ERROR LOST t.rollout.episodes partition {p}: ..." for p in range(4)),
                     f"2024-01-01 ERROR rollout_bus.consumers.shard_writer: {error}", "INFO bye"])
    verdict = records_lost_verdict(_Stage(log))
    assert verdict.startswith(f"the shard writer ended the run (exit {EXIT_RECORDS_LOST}): {error}")
    assert "t.rollout.episodes partition 3: offsets 0..51 (52 records)" in printed([verdict])
    assert "see logs/shards.log" in records_lost_verdict(_Stage("killed before it said why"))
