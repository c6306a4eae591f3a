"""The prompt-fed elastic generator group under the chaos table: its workload, its run and its faults.

Why: members of the generator group (``generate --from-prompts``) take prompt groups from rollout.prompts, hand
back what a stopped one held and redeliver what a killed one held, and close the run themselves; killing,
adding and stopping members must change no shard. The seeded workloads' machinery (``harness.ChaosRun``) runs it,
with these differences.

Contract:

* ``PromptWorkload``: ``episodes`` is prompt groups x ``n_samples_per_prompt``; its prompt file is the packaged
  ``rollout_bus/demo/prompts.jsonl`` repeated with distinct ids (``chaos-000``, ...), so every run of the workload
  loads the same prompt groups with the same group indices. Its writer runs with ``--exit-on-end-of-run``.
* ``PromptRun.start()`` writes that file and loads it with ``rollout-bus prompts load`` (``logs/prompts-load.log``)
  before any stage starts; then the stream worker, the shard writer and ``generators`` members ``generate``,
  ``generate-2``, ... (``generate --from-prompts --engine sim`` with ``MEMBER_FLAGS``, the run's ``--run-id``,
  its own ``--summary-out generator-summary-<member>.json``). Every launch is a new member id (``m1``, ``m2``, ...):
  a member killed and started again (``kill_stage``) joins the group as a new member. No ``end-run``: the
  members close the run once the ledger says every prompt group is over, and the writer exits 0.
* Members are done when every member stage's process has exited: 0 with its summary written, or, for one stopped
  on purpose (``ChaosRun.stop_stage``: SIGTERM), 143 (128 + SIGTERM) with its summary written.
* What was sent: the members' summaries' episodes (rollout key, attempt); with a member killed -9 (no summary) the
  episodes with a final turn in rollout.turns (``evidence.logged_episodes``), read once every member is done.
* ``prompt_run_closed``, the scenarios' condition: the writer exited 0 (the run closed itself) and the ledger
  says every loaded prompt group done, none failed (but the workload's ``failing`` ones: each is one dead
  letter of every run), none in flight. ``prompt_run_resumed``: that, and the members' summaries
  (``member_summaries``) say they reused logged turns. ``member_args`` replaces ``MEMBER_FLAGS`` (longer episodes).
* ``kill_members(times, every_s)``: kill -9 of a member holding a prompt group (claimed in the ledger, not ended)
  ``times`` times, ``every_s`` apart (sooner at i/(times + 1) of the prompt groups done, so each lands before the
  run is over), a new member started in its place each time; with ``part_way`` only a member holding a prompt
  group with turns of unfinished episodes on the log, stopped and checked again first. ``scale_members(add, stop)``:
  ``add`` members added once the first has done prompt groups, then ``stop`` members holding prompt groups stopped
  with SIGTERM (what they hold finishes or is handed back). Both fail the row (``FaultNotInjected``) when the run
  is over before their last step: a workload too small proves nothing. Each notes, last, the ledger at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_bus import demo
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.kafka.prompt_ledger import read_ledger
from rollout_bus.wire.prompt_record import PromptLedger
from tests.chaos.evidence import logged_episodes
from tests.chaos.harness import STAGE_ORDER, WRITER_ENDS, ChaosRun, FaultContext, FaultNotInjected, Workload

PACKAGED_PROMPTS = Path(demo.__file__).parent / "prompts.jsonl"
# the same for every member of every run (with the workload's --seed): the sim engine makes a prompt group's
# episodes from them and the prompt record alone
MEMBER_FLAGS = ("--engine", "sim", "--max-turns", "2", "--min-response-len", "4",
                "--max-response-len", "12", "--vocab-size", "512", "--retry-prob", "0.2")
STOPPED_EXIT = 128 + signal.SIGTERM  # a member stopped with SIGTERM: what it held finished or went back
LEDGER_POLL_S = 0.5
FREEZE_SETTLE_S = 0.5  # a member stopped before a part-way kill: its last sends reach the ledger meanwhile


@dataclass(frozen=True)
class PromptWorkload(Workload):
    """Prompt groups loaded onto rollout.prompts, made by ``generators`` members of the generator group."""

    concurrency: int = 1  # prompt groups in flight per member
    turn_latency_ms: int = 300  # the sim engine's least time per turn: a kill lands mid-group
    writer_args: tuple[str, ...] = (WRITER_ENDS,)
    member_args: tuple[str, ...] = MEMBER_FLAGS
    failing: int = 0  # prompt groups every run of the workload fails (each one ``failed_prompt`` dead letter)

    @property
    def prompt_groups(self) -> int:
        return self.episodes // self.n_samples_per_prompt

    def prompt_lines(self) -> list[str]:
        """The prompt file: the packaged prompts, repeated with distinct ids, ``n_samples_per_prompt`` each."""
        packaged = [json.loads(line) for line in PACKAGED_PROMPTS.read_text().splitlines() if line.strip()]
        return [json.dumps({**packaged[i % len(packaged)], "id": f"chaos-{i:03d}",
                            "n_samples": self.n_samples_per_prompt}) for i in range(self.prompt_groups)]

    def member_flags(self) -> list[str]:
        return ["--from-prompts", "--concurrency", str(self.concurrency), "--turn-latency-ms",
                str(self.turn_latency_ms), "--seed", str(self.seed), *self.member_args]

    @property
    def dead_letters(self) -> int:
        return self.failing

    def new_run(self, bootstrap: str, out: Path, **kwargs: Any) -> "PromptRun":
        return PromptRun(bootstrap, self, out, **kwargs)


class PromptRun(ChaosRun):
    """A ``ChaosRun`` whose generators are members of the generator group, fed from rollout.prompts."""

    workload: PromptWorkload

    def __init__(self, bootstrap: str, workload: PromptWorkload, out: Path, **kwargs: Any):
        super().__init__(bootstrap, workload, out, **kwargs)
        self.closed_run = True  # the members close it: never end-run
        self.member_stages = workload.generator_stages()  # grows as members are added
        self.member_of: dict[str, str] = {}  # stage name -> the member id its current process runs as
        self.launched: list[str] = []  # every member id, in launch order
        self.killed_members: list[str] = []
        self.kill_ledgers: list[PromptLedger] = []  # the ledger as each part-way kill found it (its victim stopped)

    def start(self) -> None:
        """Load the prompt file onto the run's rollout.prompts, then start the stages."""
        self.out.mkdir(parents=True, exist_ok=True)
        ensure_topics(self.conn, self.topics, replication_factor=self.replication_factor)
        prompts = self.out / "prompts.jsonl"
        prompts.write_text("\n".join(self.workload.prompt_lines()) + "\n")
        (self.out / "logs").mkdir(exist_ok=True)
        command = [sys.executable, "-m", "rollout_bus.cli.main", "prompts", "load", str(prompts),
                   "--bootstrap-servers", self.bootstrap, "--topic-prefix", self.topics.prefix]
        with open(self.out / "logs" / "prompts-load.log", "ab") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=120,
                                  env={**os.environ, **self.stage_env}).returncode
        if code:
            raise RuntimeError(f"rollout-bus prompts load exited {code} (logs/prompts-load.log)")
        super().start()

    def stage_order(self) -> list[str]:
        return [*STAGE_ORDER[:-1], *self.member_stages]

    def _stage_args(self, name: str) -> list[str]:
        if not name.startswith("generate"):
            return super()._stage_args(name)
        member = f"m{len(self.launched) + 1}"
        self.launched.append(member)
        self.member_of[name] = member
        return ["--bootstrap-servers", self.bootstrap, "--topic-prefix", self.topics.prefix,
                *self.workload.member_flags(), "--member-id", member, "--run-id", self.run_id,
                "--summary-out", str(self.summary_of(member))]

    def summary_of(self, member: str) -> Path:
        return self.out / f"generator-summary-{member}.json"

    def add_member(self) -> str:
        """Start one more member (stage ``generate-<n>``); its stage name."""
        with self.lock:
            name = f"generate-{len(self.member_stages) + 1}"
            self.member_stages.append(name)
            self._launch(name)
        return name

    def kill_stage(self, name: str, restart: bool = True) -> None:
        self.killed_members.append(self.member_of[name])
        super().kill_stage(name, restart)

    def members_done(self) -> bool:
        """Every member's process exited: 0, or 143 if stopped on purpose, with its summary written."""
        with self.lock:
            return all(self.stages[n].poll() == (STOPPED_EXIT if n in self.stopped else 0)
                       and self.summary_of(self.member_of[n]).exists() for n in self.member_stages)

    def generator_done(self) -> bool:
        return self.members_done()

    def sent(self) -> list[tuple[str, int]] | None:
        """The members' summaries' episodes; with a member killed -9, the episodes rollout.turns finished."""
        if self.killed_members:
            if self.logged is None and self.members_done():
                self.logged = logged_episodes(self.bootstrap, self.topics.turns)
            return sorted(self.logged.finished.items()) if self.logged else None
        paths = [self.summary_of(m) for m in self.launched]
        if not all(p.exists() for p in paths):
            return None
        return [(k, int(a)) for p in paths for k, a in json.loads(p.read_text())["episodes"]]

    def ledger(self) -> PromptLedger:
        return read_ledger(self.conn, self.topics)

    def holding(self, ledger: PromptLedger) -> list[str]:
        """The member stages whose current member holds a prompt group (claimed, not ended)."""
        holders = {g for p, g in ledger.claimant.items() if p not in ledger.ended}
        with self.lock:
            return [n for n in self.member_stages if self.member_of.get(n) in holders and self.stages[n].poll() is None]


def prompt_run_closed(run: PromptRun) -> bool:
    """The run closed itself (the writer exited 0) with every loaded prompt group done, none failed (but the
    workload's ``failing`` ones)."""
    if run.stages["shards"].poll() != 0:
        return False
    counts = run.ledger().counts()
    groups, failing = run.workload.prompt_groups, run.workload.failing
    return (counts["loaded"], counts["done"], counts["failed"], counts["in_flight"]) == (
        groups, groups - failing, failing, 0)


def member_summaries(run: PromptRun) -> list[dict]:
    """The summaries the run's members wrote (a member killed -9 wrote none)."""
    return [json.loads(p.read_text()) for m in run.launched if (p := run.summary_of(m)).exists()]


def prompt_run_resumed(run: PromptRun) -> bool:
    """``prompt_run_closed``, and the members that took killed members' prompt groups over resumed episodes from
    their logged turns (the summaries say how many turns they reused instead of making them again)."""
    return prompt_run_closed(run) and sum(s["turns_reused"] for s in member_summaries(run)) >= 1


def _final_ledger(ctx: FaultContext) -> str:
    """Once every prompt group has ended (a run that never gets there times out): the ledger, in short."""
    run: PromptRun = ctx.run
    while not (ledger := run.ledger()).all_ended():
        ctx.sleep(LEDGER_POLL_S)
    counts = ledger.counts()
    return f"ledger: done {counts['done']}/{counts['loaded']}, failed {counts['failed']}, " \
           f"redelivered {counts['redelivered']}"


def wait_ledger(ctx: FaultContext, what: str, predicate, timeout_s: float = 300.0) -> PromptLedger:
    """Block until the ledger satisfies ``predicate``; the run over first (every prompt group ended): not injected."""
    run: PromptRun = ctx.run
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ledger = run.ledger()
        if predicate(ledger):
            return ledger
        if ledger.all_ended():
            raise FaultNotInjected(f"every prompt group ended before {what}")
        ctx.sleep(LEDGER_POLL_S)
    raise FaultNotInjected(f"{what} did not happen within {timeout_s:.0f}s")


def kill_members(times: int, every_s: float, part_way: bool = False) -> Any:
    """kill -9 of a member holding a prompt group, ``times`` times: the first once 2 prompt groups are done, each
    next one ``every_s`` after the last or, if sooner, once i/(times + 1) of the prompt groups are done (so every
    kill lands before the run is over). Each victim is replaced at once by a new member; the stages are taken in
    turn (the first holding a group, from the next one after the last hit). ``part_way``: only a member holding a
    prompt group with turns of unfinished episodes on the log (``PromptLedger.part_way``), stopped (SIGSTOP) and
    the ledger read again before the kill, so what it held part-way is what its taker finds."""

    def holders_now(run: PromptRun, led: PromptLedger) -> list[str]:
        if not part_way:
            return run.holding(led)
        members = {m for m, _, _ in led.part_way()}
        return [n for n in run.holding(led) if run.member_of[n] in members]

    def fault(ctx: FaultContext) -> None:
        run: PromptRun = ctx.run
        moments, turn, last = [], 0, 0.0
        i = 0
        while i < times:
            due = 2 if i == 0 else run.workload.prompt_groups * (i + 1) // (times + 1)
            wait_s = None if i == 0 else every_s

            def moment(led: PromptLedger, due: int = due, since: float = last, wait_s: float | None = wait_s) -> bool:
                late = wait_s is not None and time.monotonic() - since >= wait_s
                return bool(holders_now(run, led)) and (len(led.ended) >= due or late)

            ledger = wait_ledger(ctx, f"kill #{i + 1}", moment)
            holders = holders_now(run, ledger)
            order = run.member_stages[turn:] + run.member_stages[:turn]
            victim = next(n for n in order if n in holders)
            if part_way:
                run.signal_stage(victim, signal.SIGSTOP)
                ctx.sleep(FREEZE_SETTLE_S)  # what it sent before the stop reaches the ledger
                ledger = run.ledger()
                if victim not in holders_now(run, ledger):
                    run.signal_stage(victim, signal.SIGCONT)  # it finished what it held part-way: another moment
                    continue
            i += 1
            turn = (run.member_stages.index(victim) + 1) % len(run.member_stages)
            member = run.member_of[victim]
            if part_way:
                run.kill_ledgers.append(ledger)
            run.kill_stage(victim)
            ctx.lifted()
            last = ctx.lifts[-1]
            moments.append(f"{member} at {len(ledger.ended)}")
            held = [f"{p} ({n} turns logged)" for m, p, n in ledger.part_way() if m == member]
            ctx.note(f"kill -9 #{i} of {victim} (member {member}, holding a prompt group"
                     f"{': part-way ' + ', '.join(held) if part_way else ''}) at {len(ledger.ended)} "
                     f"prompt groups done; {run.member_of[victim]} started in its place")
        final = _final_ledger(ctx)
        if part_way:  # the members write their summaries as they exit, once every prompt group has ended
            while not run.members_done():
                ctx.sleep(LEDGER_POLL_S)
            final += f"; takers reused {sum(s['turns_reused'] for s in member_summaries(run))} logged turns"
        ctx.note(f"killed {', '.join(moments)} done; {final}")

    return fault


def scale_members(add: int, stop: int, exit_timeout_s: float = 120.0) -> Any:
    """One member -> 1 + ``add`` once it has done prompt groups and -> 1 + ``add`` - ``stop`` once every added
    member has claimed one: ``stop`` members holding prompt groups stopped with SIGTERM, each exiting 143."""

    def fault(ctx: FaultContext) -> None:
        run: PromptRun = ctx.run
        first = wait_ledger(ctx, "scaling up", lambda led: len(led.ended) >= 2)
        added = [run.add_member() for _ in range(add)]
        ids = {run.member_of[n] for n in added}
        ledger = wait_ledger(ctx, "every added member claiming a prompt group",
                              lambda led: ids <= set(led.claimant.values()))
        ledger = wait_ledger(ctx, f"{stop} members holding prompt groups", lambda led: len(run.holding(led)) >= stop)
        stopped = run.holding(ledger)[:stop]
        for name in stopped:
            run.stop_stage(name)
        deadline = time.monotonic() + exit_timeout_s
        codes = {}
        for name in stopped:
            while (code := run.stages[name].poll()) is None and time.monotonic() < deadline:
                ctx.sleep(0.2)
            codes[name] = code
        ctx.lifted()
        if any(code != STOPPED_EXIT for code in codes.values()):
            raise RuntimeError(f"members stopped with SIGTERM exited {codes} (expected {STOPPED_EXIT})")
        summaries = {run.member_of[n]: json.loads(run.summary_of(run.member_of[n]).read_text()) for n in stopped}
        ctx.note(f"1 -> {1 + add} members at {len(first.ended)} prompt groups done, {1 + add} -> {1 + add - stop} at "
                 f"{len(ledger.ended)}: SIGTERM of " + ", ".join(
                     f"{m} ({s['done']} done, {s['handed_back']} handed back)" for m, s in summaries.items()))
        ctx.note(f"scaled 1 -> {1 + add} at {len(first.ended)} done, -> {1 + add - stop} at {len(ledger.ended)} "
                 f"({sum(s['handed_back'] for s in summaries.values())} handed back); {_final_ledger(ctx)}")

    return fault
