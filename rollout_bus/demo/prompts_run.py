"""The demo from a prompt file: the prompts loaded onto rollout.prompts, then a group of generators sharing them.

Why: a user's run starts from their own prompts, made by generators that share them and close the run
themselves; ``make demo`` runs that way (the packaged ``prompts.jsonl``: 16 prompt groups of 4), with the same
stream worker, shard writer, watch and reconciliation as the seeded generator's run (``demo.run``).

Contract of ``PromptsDemoRun(client_kwargs, options, console)`` (a ``DemoRun``; ``run.new_run`` makes it when
``options.prompts`` is set):

* ``start_stages()`` reads ``options.prompts`` (``producers.prompt_file.read_prompt_file``: a bad line is a
  ``ConfigError`` naming it; with ``options.learn`` and no file, the calculator task's problems for
  ``options.episodes``, written to ``prompts.jsonl`` in the run directory first: ``make learn``) and loads it as
  ``rollout-bus prompts load`` does (``producers.prompt_loader.load_prompts``, in this process), then starts the
  stream worker(s), the shard writer (and the trainer) as the seeded run does, then ``options.generators`` members
  ``generate-g0``, ``generate-g1``, ...: ``generate --from-prompts --member-id gI --run-id <the run id>
  --summary-out generator-summary-gI.json`` (with ``learn``: ``--engine policy``, its sampling and the run's
  staleness bound; the generator role's principal on a secured cluster). No ``end-run``: the members close the
  run once the ledger says every prompt group is over.
* It is over (``generators_done``, ``closes_itself``) when every member exited 0 with its summary written and the
  shard writer wrote the run's last batch and exited 0.
* What was sent is the union of the members' summaries' ``episodes`` (rollout key, attempt), reconciled as the
  seeded generator's summary is (``observe.accounting.reconcile``); the bars count the file's episodes.
* ``options.kill_members`` (``demo --kill-members N``, a drill): ``drill()``, on the watch's ticks, kills -9 a
  member holding a prompt group one of whose unfinished episodes has a turn on the log (the ledger's progress),
  the i-th time once i/(N + 1) of the prompt groups are done, and starts a new member (the next ``gI``) in its
  place, saying so; the takers resume what it held from the log. A killed member leaves no summary: what was sent
  is then every episode with a final turn on rollout.turns (its last attempt), read once every member is done.
* ``report_lines()``: the prompt ledger as rollout.prompt_ledger has it (``kafka.prompt_ledger.read_ledger``):
  ``prompt ledger: loaded 16, done 16, redelivered 0, failed 0, in flight 0``, then what each member did.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from rollout_bus.demo.processes import StageProcess
from rollout_bus.demo.run import DemoOptions, DemoRun, batching_args, learn_engine_args
from rollout_bus.errors import ContractError, RolloutBusError
from rollout_bus.kafka.prompt_ledger import read_ledger
from rollout_bus.kafka.reader import read_topic
from rollout_bus.producers.prompt_file import PromptLine, read_prompt_file
from rollout_bus.producers.prompt_loader import load_prompts
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.wire.prompt_record import PromptLedger

LEDGER_ORDER = ("loaded", "done", "redelivered", "failed", "in_flight")
FREEZE_SETTLE_S = 0.5  # a member stopped before its kill: its last sends reach the ledger meanwhile
LOG_STALL_S = 60.0  # reading rollout.turns back after a kill: give up after this long without progress
PROMPTS_FILE = "prompts.jsonl"  # with --learn and no prompt file: the calculator's problems, in the run directory


def ledger_line(counts: dict[str, int]) -> str:
    """``prompt ledger: loaded 16, done 16, redelivered 0, failed 0, in flight 0``."""
    return "prompt ledger: " + ", ".join(f"{name.replace('_', ' ')} {counts.get(name, 0)}" for name in LEDGER_ORDER)


class PromptsDemoRun(DemoRun):
    """One run from a prompt file, made by ``options.generators`` members of the generators' group."""

    closes_itself = True

    def __init__(self, client_kwargs: dict[str, Any], options: DemoOptions, console: Console):
        super().__init__(client_kwargs, options, console)
        self.prompt_lines: list[PromptLine] = []
        self.members = [f"g{i}" for i in range(options.generators)]  # the live ones; a killed one is replaced
        self.killed: list[str] = []
        self._logged_sent: list[tuple[str, int]] | None = None

    def member_summary_path(self, member: str) -> Path:
        return self.out / f"generator-summary-{member}.json"

    def start_stages(self, generator: bool = True) -> None:
        """Load the prompt file, start the stream worker(s) and shard writer, then (unless told not to) the
        members."""
        o = self.options
        path = o.prompts if o.prompts is not None else self._learn_prompts()
        self.prompt_lines = read_prompt_file(path)
        loaded = load_prompts(self.kwargs, self.topics, self.prompt_lines, max_record_bytes=o.max_record_bytes)
        self.console.print(f"prompts {path}: {loaded.describe()} on {self.topics.prompts}", markup=False,
                           soft_wrap=True)
        super().start_stages(generator=False)
        if not generator:
            return
        for member in self.members:
            self._start_member(member)

    def _start_member(self, member: str) -> None:
        o = self.options
        learn = ([*learn_engine_args(), *batching_args(o.batching)] if o.learn else [])
        name = f"generate-{member}"
        self.stages[name] = StageProcess(name, "generate", [
            *self._common(), "--from-prompts", "--member-id", member, "--run-id", self.run_id,
            "--seed", str(o.seed), "--summary-out", str(self.member_summary_path(member)), *learn,
            *o.generator_args], self.out / "logs" / f"{name}.log", env=self._as("generator"))

    def drill(self) -> None:
        """``--kill-members``: the next kill -9, once it is due and a member holds a prompt group part-way. The
        member is stopped (SIGSTOP) and the ledger read again before the kill, so what it held part-way is what
        the ledger says, not what it finished in between."""
        if len(self.killed) >= self.options.kill_members or not self.prompt_lines:
            return
        ledger = read_ledger(self.kwargs, self.topics)
        due = len(self.prompt_lines) * (len(self.killed) + 1) // (self.options.kill_members + 1)
        found = part_way_holder(ledger, self.members) if len(ledger.ended) >= due else None
        if found is None:
            return
        stage = self.stages[f"generate-{found[0]}"]
        stage.freeze(True)
        time.sleep(FREEZE_SETTLE_S)  # what it sent before the stop reaches the ledger
        ledger = read_ledger(self.kwargs, self.topics)
        if (held := part_way_holder(ledger, [found[0]])) is None:
            stage.freeze(False)  # it finished what it held: another moment
            return
        member, prompt, turns = held
        stage.kill()
        stage.stop()  # closes its log
        del self.stages[f"generate-{member}"]
        self.killed.append(member)
        replacement = f"g{len(self.members) + len(self.killed) - 1}"
        self.members = [m for m in self.members if m != member] + [replacement]
        self._start_member(replacement)
        self.console.print(f"drill: killed -9 member {member} (holding prompt group {prompt}, {turns} turn(s) of "
                           f"unfinished episodes on the log) at {len(ledger.ended)} prompt groups done; member "
                           f"{replacement} started in its place", markup=False, soft_wrap=True)

    def _learn_prompts(self) -> Path:
        """``make learn``'s prompt file: the calculator task's problems, one prompt group per ``n`` episodes."""
        from rollout_bus.learn.task import prompt_lines  # torch-free, but the learn package: only with --learn

        o = self.options
        path = self.out / PROMPTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = prompt_lines(o.seed, math.ceil(o.episodes / o.n_samples_per_prompt), o.n_samples_per_prompt)
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return path

    def generators_done(self) -> bool:
        """Every member exited 0 and wrote its summary."""
        return all(self.stages[f"generate-{m}"].poll() == 0 and self.member_summary_path(m).exists()
                   for m in self.members)

    def expected(self) -> tuple[int, int]:
        episodes = sum(int(line.content["n_samples"]) for line in self.prompt_lines)
        return episodes, math.ceil(len(self.prompt_lines) / self.options.batching.groups_per_batch)

    def drill_shortfall(self) -> str | None:
        asked = self.options.kill_members
        if len(self.killed) >= asked:
            return None
        return (f"--kill-members {asked}: only {len(self.killed)} member(s) killed; the run ended before a member "
                "held a prompt group part-way (more prompt groups, or longer episodes, give the drill its moment)")

    def _member_summaries(self) -> dict[str, dict]:
        """The summaries the members wrote as they ended (read only once they ended: none is half-written)."""
        return {m: json.loads(self.member_summary_path(m).read_text()) for m in self.members
                if self.stages.get(f"generate-{m}") is not None and self.stages[f"generate-{m}"].poll() is not None
                and self.member_summary_path(m).exists()}

    def _sent(self) -> list[tuple[str, int]] | None:
        if self.killed:  # a killed member said nothing: what the log finished, once every member is done
            if self._logged_sent is None and self.generators_done():
                self._logged_sent = logged_finals(read_topic(self.kwargs, self.topics.turns, stall_s=LOG_STALL_S))
            return self._logged_sent
        summaries = self._member_summaries()
        if not summaries:
            return None
        return [(key, int(attempt)) for summary in summaries.values() for key, attempt in summary["episodes"]]

    def report_lines(self) -> list[str]:
        try:
            lines = [ledger_line(read_ledger(self.kwargs, self.topics).counts())]
        except RolloutBusError as exc:
            lines = [f"prompt ledger: not readable ({exc})"]
        lines += [f"generator {member}: killed -9 by the drill" for member in self.killed]
        for member, s in self._member_summaries().items():
            resumed = (f"; resumed from the log: {s['episodes_resumed']} episodes continued, {s['episodes_reused']} "
                       f"found finished, {s['turns_reused']} turns reused" if s["turns_reused"] else "")
            lines.append(f"generator {member}: {s['done']} prompt groups done, {s['failed']} failed, "
                         f"{s['redelivered']} redelivered, {s['handed_back']} handed back; {s['episodes_finished']} "
                         f"episodes, {s['turns_sent']} turns{resumed}{'; closed the run' if s['closed_run'] else ''}")
        return lines


def part_way_holder(ledger: PromptLedger, members: list[str]) -> tuple[str, str, int] | None:
    """(member, prompt id, logged turns) of the first of ``members`` holding a prompt group part-way, or None."""
    return next((held for held in ledger.part_way() if held[0] in members), None)


def logged_finals(records: list) -> list[tuple[str, int]]:
    """(rollout key, attempt) of every episode with a final turn among rollout.turns' ``records`` (its highest
    attempt): what generators that left no summary sent."""
    finals: dict[str, int] = {}
    for record in records:
        if not record.key or control_kind(record.headers) is not None:
            continue
        try:
            headers = TurnHeaders.from_kafka(record.headers)
        except ContractError:  # not a turn the members sent (the stream dead-letters it): nothing they finished
            continue
        if headers.final:
            key = record.key.decode()
            finals[key] = max(headers.attempt, finals.get(key, headers.attempt))
    return sorted(finals.items())
