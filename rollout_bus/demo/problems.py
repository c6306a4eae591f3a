"""What went wrong in a demo run, said as data: problems and verdicts printed so that rich never eats them.

Why a module of its own: a problem quotes what the run produced (episode keys such as
``[null,null,"rollout",16,67]``, a stage's log lines), and rich reads square brackets as markup: printed in
an f-string, such a key vanished (``['', '', '', '', '']``). Everything printed here is escaped.

Contract:

* ``print_problems(console, problems)``: one red line per problem, its text verbatim (not wrapped).
* ``records_lost_verdict(stage)``: the shard writer exited ``EXIT_RECORDS_LOST`` (it ended the run whose
  end-of-run markers were deleted unread, ``consumers.shard_writer.lost_markers``): its verdict line from the
  stage's log, naming every lost range (topic, partition, offsets, count).
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.markup import escape

from rollout_bus.consumers.shard_writer.lost_markers import EXIT_RECORDS_LOST, LOST_VERDICT
from rollout_bus.demo.processes import StageProcess

LOG_LINES = 200


def print_problems(console: Console, problems: Iterable[str]) -> None:
    """One red line per problem, never wrapped; what it quotes is data, never rich markup."""
    for problem in problems:
        console.print(f"[red]{escape(problem)}[/red]", soft_wrap=True)


def records_lost_verdict(stage: StageProcess) -> str:
    """The shard writer's verdict (exit ``EXIT_RECORDS_LOST``), as its log says it."""
    lines = [line[line.index(LOST_VERDICT):] for line in stage.log_tail(LOG_LINES).splitlines()
             if LOST_VERDICT in line]
    return (f"the shard writer ended the run (exit {EXIT_RECORDS_LOST}): "
            + (lines[-1] if lines else f"{LOST_VERDICT}; see {stage.log_path}"))
