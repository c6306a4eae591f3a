"""The generator group driving HTTP engines under the chaos table: engines that die, tools that must run once.

Why: members of the generator group (``generate --from-prompts --engine http``) call a pool of inference engines
and run the built-in tool environment between turns. An engine killed mid-request must cost nothing but the
request (it goes to another engine of the pool), a member killed mid-episode must cost at most the turn it was
in (its taker resumes from the log and runs no tool call whose result the log holds), and a prompt group one of
whose samples every engine fails on is failed and dead-lettered, once, with its siblings' groups all done.

Contract:

* ``HttpPromptWorkload``: a ``PromptWorkload`` whose members run ``--engine http`` against ``engines`` fixture
  engines (``tests/engine_server.py``, each ``python -m tests.engine_server`` on a port of its own, answering
  after ``engine_delay_s`` with SGLang's fixture, every turn complete), ``--env
  rollout_bus.sim.environment:tool_env`` (which logs every tool call it runs) and ``--max-turns``. Its last prompt
  group (``chaos-poison``) has the context every engine dies on (``tests.engine_server.DIE``): every run of the
  workload fails it, with one ``failed_prompt`` dead letter (``failing`` 1). The engines answer every request
  alike, so shards depend on the prompt file alone: every run writes the same bytes.
* ``HttpPromptRun.start()`` starts the engines (each answering before any member starts), then the run;
  ``stop()`` stops the run, then the engines. ``kill_engine(i)`` kill -9s engine ``i``; ``start_engine(i)``
  starts it again on the same port.
* ``kill_engine_mid_run(index, down_s)``: once 2 prompt groups are done, engine ``index`` killed (requests are in
  flight on it: every answer takes ``engine_delay_s``), started again ``down_s`` later.
* ``tool_calls(log_dir)``: (prompt group, episode, step) of every call the tool environment ran, from the member
  logs under ``log_dir`` (a killed member's included: its replacement appends to the same log).
* ``tools_ran_once(run)``: the run closed (``prompt_run_closed``), and the tool calls its members ran are the
  undisturbed run's (``baseline-<workload>`` beside the run's directory), each once, but those whose answer was
  not on the log when a kill cut them (``EpisodeProgress.answers_logged`` in the ledger each part-way kill found,
  its victim stopped: a call the victim ran and had not yet noted with its turn).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_bus.local_kafka.local_cluster import free_ports
from tests.chaos.harness import FaultContext
from tests.chaos.prompt_workload import PromptRun, PromptWorkload, prompt_run_closed, wait_ledger
from tests.engine_server import DIE

POISON = "chaos-poison"
ENGINE_START_S = 30.0
TOOL_CALL = re.compile(r"tool call executed: prompt group (\S+) episode (\d+) step (\d+)")


@dataclass(frozen=True)
class HttpPromptWorkload(PromptWorkload):
    """Prompt groups made by members calling a pool of fixture HTTP engines, with the tool environment."""

    engines: int = 2
    engine_delay_s: float = 0.3
    max_turns: int = 4
    failing: int = 1  # the poison group

    def prompt_lines(self) -> list[str]:
        lines = super().prompt_lines()[:-1]
        return [*lines, f'{{"id": "{POISON}", "input_ids": {DIE}, "n_samples": {self.n_samples_per_prompt}}}']

    def member_flags(self) -> list[str]:
        return ["--from-prompts", "--concurrency", str(self.concurrency), "--seed", str(self.seed),
                "--engine", "http", "--env", "rollout_bus.sim.environment:tool_env", "--max-turns",
                str(self.max_turns)]

    def new_run(self, bootstrap: str, out: Path, **kwargs: Any) -> "HttpPromptRun":
        return HttpPromptRun(bootstrap, self, out, **kwargs)


class HttpPromptRun(PromptRun):
    """A ``PromptRun`` whose members call the run's own fixture engines."""

    workload: HttpPromptWorkload

    def __init__(self, bootstrap: str, workload: HttpPromptWorkload, out: Path, **kwargs: Any):
        super().__init__(bootstrap, workload, out, **kwargs)
        self.engine_ports = free_ports(workload.engines)
        self.engines: dict[int, subprocess.Popen] = {}
        self.engine_kills: list[int] = []

    def engine_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.engine_ports[index]}"

    def start_engine(self, index: int) -> None:
        """Engine ``index`` on its port, answering before this returns."""
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        with open(self.out / "logs" / f"engine-{index}.log", "ab") as log:
            self.engines[index] = subprocess.Popen(
                [sys.executable, "-m", "tests.engine_server", "--port", str(self.engine_ports[index]),
                 "--delay-s", str(self.workload.engine_delay_s), "--stop"], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + ENGINE_START_S
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.engine_ports[index]), timeout=1).close()
                return
            except OSError:
                if self.engines[index].poll() is not None:
                    break
                time.sleep(0.1)
        raise RuntimeError(f"fixture engine {index} did not answer on port {self.engine_ports[index]} "
                           f"(logs/engine-{index}.log)")

    def kill_engine(self, index: int) -> None:
        self.engines[index].kill()
        self.engines[index].wait(timeout=10)
        self.engine_kills.append(index)

    def start(self) -> None:
        for index in range(self.workload.engines):
            self.start_engine(index)
        super().start()

    def _stage_args(self, name: str) -> list[str]:
        args = super()._stage_args(name)
        if name.startswith("generate"):
            args += [flag for i in range(self.workload.engines) for flag in ("--engine-url", self.engine_url(i))]
        return args

    def stop(self, settle_s: float = 2.0) -> None:
        super().stop(settle_s)
        for engine in self.engines.values():
            if engine.poll() is None:
                engine.kill()
                engine.wait(timeout=10)


def kill_engine_mid_run(index: int, down_s: float) -> Any:
    """Engine ``index`` killed -9 once 2 prompt groups are done (requests in flight on it), started again
    ``down_s`` later on the same port."""

    def fault(ctx: FaultContext) -> None:
        run: HttpPromptRun = ctx.run
        done = len(wait_ledger(ctx, f"killing engine {index}", lambda led: len(led.ended) >= 2).ended)
        run.kill_engine(index)
        ctx.sleep(down_s)
        run.start_engine(index)
        ctx.lifted()
        ctx.note(f"engine {index} ({run.engine_url(index)}) killed -9 at {done} prompt groups done, started again "
                 f"{down_s:.0f}s later")

    return fault


def engine_passed_over(index: int) -> Any:
    """A condition: ``prompt_run_closed``, and a member said it sent a request on from engine ``index``, refused
    while it was down (not the poison's death, which every engine gives)."""

    def condition(run: HttpPromptRun) -> bool:
        url = run.engine_url(index)
        said = any(f"engine {url} failed" in line and "refused" in line.lower()
                   for path in (run.out / "logs").glob("generate*.log")
                   for line in path.read_text(errors="replace").splitlines())
        return said and prompt_run_closed(run)

    return condition


def counting_tool_calls(fault: Any) -> Any:
    """``fault``, then, once every member is done, a note of the tool calls run against the undisturbed run's."""

    def counted(ctx: FaultContext) -> None:
        fault(ctx)
        run: PromptRun = ctx.run
        while not run.members_done():
            ctx.sleep(0.5)
        alone, ran = tool_calls(run.out.parent / f"baseline-{run.workload.name}" / "logs"), tool_calls(run.out / "logs")
        again = _again(ran)
        unanswered = sum(_unanswered_at_a_kill(run, call) for call in again)
        ctx.note(f"{ctx.notes[-1] if ctx.notes else ''}; tool calls: {len(ran)} run ({len(set(ran))} distinct), "
                 f"{len(alone)} in the undisturbed run, {len(set(ran) ^ set(alone))} differ; {len(again)} ran again, "
                 f"{unanswered} of them unanswered on the log at their kill")

    return counted


def tool_calls(log_dir: Path) -> list[tuple[str, int, int]]:
    """(prompt group, episode, step) of every call the tool environment ran, as the member logs say."""
    return [(p, int(j), int(k)) for path in sorted(log_dir.glob("generate*.log"))
            for p, j, k in TOOL_CALL.findall(path.read_text(errors="replace"))]


def tools_ran_once(run: PromptRun) -> bool:
    """The run closed, and its members' tool calls are the undisturbed run's, each once but those whose answer was
    not on the log when a kill cut them (the ledger as each part-way kill found it, its victim stopped: a call
    the victim had run and not yet noted with its turn): no call whose answer was on the log ran again."""
    if not prompt_run_closed(run):
        return False
    alone = tool_calls(run.out.parent / f"baseline-{run.workload.name}" / "logs")
    ran = tool_calls(run.out / "logs")
    return (bool(alone) and len(set(alone)) == len(alone) and set(ran) == set(alone)
            and all(_unanswered_at_a_kill(run, call) for call in _again(ran)))


def _again(ran: list[tuple[str, int, int]]) -> set[tuple[str, int, int]]:
    return {call for call in ran if ran.count(call) > 1}


def _unanswered_at_a_kill(run: PromptRun, call: tuple[str, int, int]) -> bool:
    prompt, j, step = call
    return any((held := ledger.progress.get(prompt, {}).get(j)) is None or held.answers_logged < step
               for ledger in run.kill_ledgers)
