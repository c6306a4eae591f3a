"""One pipeline run under a fault: three stage processes, a watch loop, a fault thread, the facts to judge.

Contract:

* ``ChaosRun`` starts the stages as ``python -m rollout_bus.cli.<stage>`` processes (``StageProcess``)
  on fresh topics (its own prefix) and its own out dir. The generator runs with the workload's fixed
  seed and flags, so every run of one workload publishes the same episodes, and with the run's own
  ``--run-id`` (a restarted generator closes the same run). No ``--idle-flush-s``:
  batch boundaries come from the log alone (full step batches, then the generator's end of run).
* ``watch`` polls about every ``POLL_S``: the record counts of rollout.turns, rollout.episodes and the
  dead letters read, and the complete batches on disk (one ``Observation``). A stage that exits on
  its own (other than the generator with 0) fails the run at once. The run is done when the
  generator has exited 0, reconciliation holds (``rollout_bus.observe.accounting``: every episode of
  its summary in exactly one batch, or in the DLQ), the fault thread has finished, and the
  scenario's own condition holds; or when the deadline passes. A run whose episodes are all settled
  (each in a batch or in the DLQ) but not cleanly (a valid episode only in the DLQ, one in two
  batches) ends once its counts have not moved for ``SETTLED_QUIET_S``: waiting longer changes
  nothing, and the runner judges what is there.
* The fault runs in its own thread with a ``FaultContext``: it waits on observations, kills, pauses
  and restarts stages through the run (under the run's lock, so a stage it killed is never taken for
  a crash), and marks when each fault is lifted: recovery is measured from there.
* A workload of several generators runs one ``generate`` stage per generator (``generate``,
  ``generate-2``, ...), each with its share of the group indices and ``--no-end-of-run``; once all
  have exited 0 the run closes it with ``rollout-bus end-run``, as an operator would.
* A generator killed for good (``kill_stage(..., restart=False)``) leaves no summary: once the others are done
  the run closes it with ``rollout-bus end-run``, and the episodes sent are read from rollout.turns
  (``evidence.logged_episodes``: those with a final turn). A workload whose writer runs with
  ``--exit-on-end-of-run`` has it exit 0 at the run's end, which is no crash.
* A stage stopped on purpose (``stop_stage``: SIGTERM, not started again) exits on its own, which is no crash.
  A workload makes its own run (``Workload.new_run``): the prompt-fed generator group's is
  ``prompt_workload.PromptRun`` (members fed from rollout.prompts, the run closing itself).
* A stream worker or shard writer that exits ``EXIT_PARTITIONS_CHANGED`` (75: a topic gained partitions
  under it) is started again, as a supervisor restarts it (compose: ``restart: unless-stopped``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rollout_bus.errors import EXIT_PARTITIONS_CHANGED
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.kafka.acls import grant_roles
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.local_kafka.secure import SecureSetup
from rollout_bus.observe.accounting import Reconciliation, reconcile
from rollout_bus.demo.processes import StageProcess
from rollout_bus.kafka.reader import TopicWatcher
from rollout_bus.wire.topics import Topics
from tests.chaos.evidence import LoggedEpisodes, log_excerpt, logged_episodes

logger = logging.getLogger(__name__)

POLL_S = 0.5
SETTLED_QUIET_S = 15.0  # settled but not ok, and nothing moved for this long: the run is over
# a broker that is down must not stall the watch loop for kafka-python's default 30 s per request
WATCH_CLIENT = {"request_timeout_ms": 3000}
STAGE_ORDER = ("stream", "shards", "generate")
WRITER_ENDS = "--exit-on-end-of-run"  # a writer run with it exits 0 at the run's end: not a crash  # consumers first, so nothing waits on a late subscriber


@dataclass(frozen=True)
class Workload:
    """The generator and writer options of a run; runs of one workload must write the same shards."""

    name: str
    episodes: int
    n_samples_per_prompt: int = 4
    groups_per_batch: int = 2
    dp_size: int = 2
    seed: int = 11
    generator_args: tuple[str, ...] = ()
    generators: int = 1  # generator processes sharing the run, each its own share of the group indices
    writer_args: tuple[str, ...] = ()  # e.g. --exit-on-end-of-run: the writer's exit 0 is then its end

    def generator_flags(self, index: int = 0) -> list[str]:
        share = (["--generators", str(self.generators), "--generator-index", str(index), "--no-end-of-run"]
                 if self.generators > 1 else [])
        return ["--episodes", str(self.episodes), "--seed", str(self.seed),
                "--n-samples-per-prompt", str(self.n_samples_per_prompt), *self.generator_args, *share]

    @property
    def dead_letters(self) -> int:
        """Dead letters every run of the workload writes (a prompt group it fails on purpose): none."""
        return 0

    def generator_stages(self) -> list[str]:
        """The generator stages' names: ``generate``, then ``generate-2``, ``generate-3``, ..."""
        return ["generate", *(f"generate-{i + 1}" for i in range(1, self.generators))]

    def new_run(self, bootstrap: str, out: Path, **kwargs: Any) -> "ChaosRun":
        """A run of this workload (the prompt-fed group's: ``prompt_workload.PromptRun``)."""
        return ChaosRun(bootstrap, self, out, **kwargs)


@dataclass(frozen=True)
class Observation:
    t: float  # time.monotonic()
    turns: int
    episodes: int
    dead_letters: int
    batches: int


@dataclass
class Expected:
    """What an undisturbed run of the workload produced; estimates where no such run finished."""

    turns: int
    episodes: int
    batches: int
    sent: list[tuple[str, int]] | None = None
    digests: dict[str, str] | None = None
    dead_letters: int = 0
    dlq_only: int = 0

    @classmethod
    def estimate(cls, workload: Workload) -> "Expected":
        groups = -(-workload.episodes // workload.n_samples_per_prompt)
        return cls(turns=2 * workload.episodes, episodes=workload.episodes,
                   batches=-(-groups // workload.groups_per_batch), dead_letters=workload.dead_letters)


class FaultNotInjected(Exception):
    """The fault's moment never came (the pipeline finished first, or never got there)."""


class Aborted(Exception):
    """The run ended (done, failed or timed out) while the fault was still under way."""


class ChaosRun:
    """The three stages of one run, on topics of its own, watched until accounted for."""

    def __init__(self, bootstrap: str, workload: Workload, out: Path, *, label: str,
                 replication_factor: int = 1, stage_env: dict[str, str] | None = None,
                 conn: dict[str, Any] | None = None, roles: SecureSetup | None = None):
        self.bootstrap, self.workload, self.out = bootstrap, workload, Path(out)
        # the harness's own connection (a secured cluster's admin); with ``roles`` each stage is its role's
        # principal, granted that role's ACLs on the run's topics and groups only
        self.conn = conn or {"bootstrap_servers": bootstrap}
        self.roles = roles
        self.run_id = f"{label}-{uuid.uuid4().hex[:6]}"
        self.topics = Topics(prefix=f"chaos-{self.run_id}.")
        self.summary_path = self.out / "generator-summary.json"  # the first generator's; see summary_paths
        self.shards_dir = self.out / "shards"
        self.replication_factor = replication_factor
        self.stage_env = {"PYTHONUNBUFFERED": "1", **(stage_env or {})}
        self.stages: dict[str, StageProcess] = {}
        self.lock = threading.RLock()
        self.end_run_lock = threading.Lock()  # end-run runs once, without holding ``lock`` (it takes seconds)
        self.history: list[Observation] = []
        self.reconciled_at: float | None = None
        self.settled_badly = False  # every episode placed, but not cleanly (see the module docstring)
        self.failure: str | None = None
        self.watcher: TopicWatcher | None = None
        self.closed_run = workload.generators == 1  # several generators: end-run once all exited 0
        self.restarts: list[str] = []  # stages started again after exiting 75
        self.killed_for_good: set[str] = set()  # stages killed and not restarted (a generator: end-run closes)
        self.stopped: set[str] = set()  # stages stopped on purpose with SIGTERM: their exit is no crash
        self.logged: LoggedEpisodes | None = None  # what rollout.turns held once such a run was closed

    def _stage_args(self, name: str) -> list[str]:
        w, common = self.workload, ["--bootstrap-servers", self.bootstrap, "--topic-prefix", self.topics.prefix]
        if name == "stream":
            replication = ["--replication-factor", str(self.replication_factor)] if self.replication_factor > 1 else []
            return [*common, "--app-id", f"chaos-{self.run_id}-stream", "--data-dir", str(self.out / "faust"),
                    *replication]  # its state changelog: RF 1 under min.insync.replicas 2 refuses every write
        if name == "shards":
            return [*common, "--out", str(self.shards_dir), "--dp-size", str(w.dp_size), "--groups-per-batch",
                    str(w.groups_per_batch), "--group-id", f"chaos-{self.run_id}-shards", *w.writer_args]
        # one run id for every generator process of the run: a restarted generator closes the same run,
        # completing any end-of-run markers a killed one left half sent (the writer holds those uncommitted)
        index = w.generator_stages().index(name)
        return [*common, *w.generator_flags(index), "--run-id", self.run_id, "--summary-out",
                str(self.summary_paths()[index])]

    def summary_paths(self) -> list[Path]:
        """One summary per generator stage: ``generator-summary.json``, then ``generator-summary-2.json``, ..."""
        return [self.summary_path, *(self.out / f"generator-summary-{i + 1}.json"
                                     for i in range(1, self.workload.generators))]

    def start(self) -> None:
        """Create the topics (with the cluster's replication), the watcher, then every stage."""
        self.out.mkdir(parents=True, exist_ok=True)
        ensure_topics(self.conn, self.topics, replication_factor=self.replication_factor)
        if self.roles is not None:
            grant_roles(self.conn, self.topics, stream_app_id=f"chaos-{self.run_id}-stream",
                        shards_group=f"chaos-{self.run_id}-shards")
        t = self.topics
        self.watcher = TopicWatcher({**self.conn, **WATCH_CLIENT}, [t.turns, t.episodes], [t.dlq])
        for name in self.stage_order():
            self._launch(name)

    def stage_order(self) -> list[str]:
        """Consumers first, so nothing waits on a late subscriber; then every generator."""
        return [*STAGE_ORDER[:-1], *self.workload.generator_stages()]

    def _launch(self, name: str) -> None:
        module = "generate" if name.startswith("generate") else name
        self.stages[name] = StageProcess(name, module, self._stage_args(name), self.out / "logs" / f"{name}.log",
                                         env=self._env(module))

    def _env(self, module: str) -> dict[str, str]:
        """A stage's environment: for a secured run, its role's settings (the password by file)."""
        if self.roles is None:
            return self.stage_env
        role = {"generate": "generator", "end_run": "generator"}.get(module, module)
        return {**self.stage_env, **self.roles.client_env(role, self.bootstrap)}

    # -- faults on stages (called from the fault thread) -------------------------------------------

    def kill_stage(self, name: str, restart: bool = True) -> None:
        """kill -9 a stage (its whole process group) and, unless told not to, start it again at once."""
        with self.lock:
            stage = self.stages[name]
            if not restart:
                self.killed_for_good.add(name)
                self.closed_run = self.closed_run and not name.startswith("generate")
            stage.kill()
            stage.stop()  # closes its log file
            if restart:
                self._launch(name)
        logger.info("run=%s killed stage=%s pid=%d restarted=%s", self.run_id, name, stage.pid, restart)

    def stop_stage(self, name: str) -> None:
        """SIGTERM a stage, for good (a clean stop); it exits on its own, which is no crash."""
        with self.lock:
            self.stopped.add(name)
            self.signal_stage(name, signal.SIGTERM)
        logger.info("run=%s stopped stage=%s (SIGTERM)", self.run_id, name)

    def signal_stage(self, name: str, sig: int) -> None:
        with self.lock:
            try:
                os.killpg(self.stages[name].pid, sig)
            except ProcessLookupError:
                pass

    # -- watching ----------------------------------------------------------------------------------

    def observe(self) -> Observation:
        assert self.watcher is not None
        self.watcher.read_new(timeout_ms=300)
        counts = self.watcher.counts()
        t = self.topics
        obs = Observation(time.monotonic(), counts.get(t.turns, 0), counts.get(t.episodes, 0),
                          len(self.watcher.records[t.dlq]), len(list(self.shards_dir.glob("batch-*/manifest.json"))))
        with self.lock:
            self.history.append(obs)
        return obs

    def latest(self) -> Observation | None:
        with self.lock:
            return self.history[-1] if self.history else None

    def quiet_for(self) -> float:
        """Seconds since the counts (turns, episodes, dead letters, batches) last changed."""
        with self.lock:
            if not self.history:
                return 0.0
            last = self.history[-1]
            since = last
            for obs in reversed(self.history):
                if (obs.turns, obs.episodes, obs.dead_letters, obs.batches) != (
                        last.turns, last.episodes, last.dead_letters, last.batches):
                    break
                since = obs
            return last.t - since.t

    def dead_letters(self) -> list[DeadLetter]:
        assert self.watcher is not None
        return self.watcher.dead_letters(self.topics.dlq)

    def sent(self) -> list[tuple[str, int]] | None:
        """(rollout key, attempt) of every episode the generators finished, from their summaries; with a
        generator killed for good (no summary), from rollout.turns once the run is closed."""
        if any(n.startswith("generate") for n in self.killed_for_good):
            if self.closed_run and self.logged is None:
                self.logged = logged_episodes(self.bootstrap, self.topics.turns)
            return sorted(self.logged.finished.items()) if self.logged else None
        try:
            return [(k, int(a)) for path in self.summary_paths() for k, a in json.loads(path.read_text())["episodes"]]
        except (OSError, ValueError, KeyError):
            return None

    def generator_done(self) -> bool:
        """Every generator exited 0 with its summary written, and the run is closed."""
        with self.lock:
            names = [n for n in self.workload.generator_stages() if n not in self.killed_for_good]
            done = all(self.stages[n].poll() == 0 for n in names) and all(
                p.exists() for n, p in zip(self.workload.generator_stages(), self.summary_paths()) if n in names)
        if done:
            with self.end_run_lock:
                if not self.closed_run:
                    self._end_run()
        return done and self.closed_run

    def _end_run(self) -> None:
        """Close a run of several generators (each ran with --no-end-of-run), as an operator would."""
        command = [sys.executable, "-m", "rollout_bus.cli.end_run", "--bootstrap-servers", self.bootstrap,
                   "--topic-prefix", self.topics.prefix, "--run-id", self.run_id]
        with open(self.out / "logs" / "end-run.log", "ab") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **self._env("end_run")},
                                  timeout=120).returncode
        if code:
            raise RuntimeError(f"rollout-bus end-run exited {code} (logs/end-run.log)")
        self.closed_run = True

    def failed_stage(self) -> str | None:
        """A stage that exited on its own (a generator with 0 has finished; 75 is restarted, see the docstring)."""
        with self.lock:
            let_go = self.killed_for_good | self.stopped  # their exit is no crash
            for name, stage in self.stages.items():
                code = stage.poll()
                if code == EXIT_PARTITIONS_CHANGED and name in ("stream", "shards"):
                    stage.stop()
                    self._launch(name)
                    self.restarts.append(name)
                    logger.info("run=%s stage=%s exited %d (partitions changed): started again", self.run_id, name,
                                code)
                elif code is not None and name not in let_go and not (code == 0 and (
                        name.startswith("generate") or (name == "shards" and WRITER_ENDS in self.workload.writer_args))):
                    return f"stage {name} exited with code {code}"
        return None

    def watch(self, ctx: "FaultContext", fault: Callable[["FaultContext"], None] | None, timeout_s: float,
              condition: Callable[["ChaosRun"], bool]) -> None:
        """Observe until done, failed or ``timeout_s``; the fault runs meanwhile in its own thread."""
        thread = None
        if fault is not None:
            thread = threading.Thread(target=ctx.run_fault, args=(fault,), name=f"fault-{self.run_id}", daemon=True)
            thread.start()
        deadline = time.monotonic() + timeout_s
        while True:
            obs = self.observe()
            self.failure = self.failed_stage()
            if self.failure:
                break
            if self.reconciled_at is None and self.generator_done():
                result = reconcile(self.sent() or [], self.shards_dir, self.dead_letters(), verify=False)
                if result.ok:
                    self.reconciled_at = obs.t
                # records deleted unread leave their episodes in no batch: with the loss named, nothing more comes
                self.settled_badly = (result.settled or bool(result.lost)) and not result.ok
            fault_done = thread is None or not thread.is_alive()
            if self.reconciled_at is not None and fault_done and condition(self):
                break
            if self.settled_badly and fault_done and condition(self) and self.quiet_for() >= SETTLED_QUIET_S:
                logger.info("run=%s settled, not cleanly, and quiet for %.0fs: judging it now", self.run_id,
                            SETTLED_QUIET_S)
                break
            if obs.t > deadline:
                self.failure = (f"timed out after {timeout_s:.0f}s (turns {obs.turns}, episodes {obs.episodes}, "
                                f"batches {obs.batches}, generator done {self.generator_done()}, "
                                f"fault done {fault_done})")
                break
            time.sleep(max(0.0, POLL_S - (time.monotonic() - obs.t)))
        ctx.abort.set()
        if thread is not None:
            thread.join(timeout=240)

    def stop(self, settle_s: float = 2.0) -> None:
        """Stop every stage (resumed first, in case a pause was cut short), then read the last dead letters."""
        with self.lock:
            for name in reversed(self.stage_order()):
                if name in self.stages:
                    self.signal_stage(name, signal.SIGCONT)
                    self.stages[name].stop()
        end = time.monotonic() + settle_s
        while self.watcher is not None and time.monotonic() < end:
            self.watcher.read_new(timeout_ms=200)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None

    def log_tails(self, lines: int = 15, warnings: int = 12) -> dict[str, str]:
        """Per stage: its last ``warnings`` WARNING/ERROR lines (where a failure usually shows; the
        last lines are often periodic counts), then its last ``lines`` lines."""
        return {name: log_excerpt(stage.log_path, lines, warnings) for name, stage in self.stages.items()}

    def final_reconciliation(self, expected: Expected) -> tuple[Reconciliation | None, str]:
        """Reconcile against the run's own summary, or the baseline's (same seed) when it wrote none."""
        sent, source = self.sent(), "summary"
        if sent is None and expected.sent is not None:
            sent, source = expected.sent, "baseline summary"
        if sent is None:
            return None, "no summary"
        return reconcile(sent, self.shards_dir, self.dead_letters(), verify=True), source


class FaultContext:
    """What a fault may do: wait for a moment in the run, pause, reach the brokers, mark when it is lifted."""

    def __init__(self, run: ChaosRun, expected: Expected, brokers: Any):
        self.run, self.expected, self.brokers = run, expected, brokers
        self.abort = threading.Event()
        self.lifts: list[float] = []
        self.notes: list[str] = []
        self.error: str | None = None
        self.deleted = 0  # records a fault deleted from the log (named-loss scenarios)
        self.deleted_keys: set[str] = set()  # the rollout keys those records held

    def run_fault(self, fault: Callable[["FaultContext"], None]) -> None:
        try:
            fault(self)
        except Aborted:
            self.error = self.error or "the run ended before the fault was over"
        except FaultNotInjected as exc:
            self.error = f"fault not injected: {exc}"
        except Exception as exc:  # a broken fault is a failed scenario, never a hung runner
            logger.exception("fault failed run=%s", self.run.run_id)
            self.error = f"fault raised {type(exc).__name__}: {exc}"

    def wait_for(self, what: str, predicate: Callable[[Observation], bool], timeout_s: float = 600.0, *,
                 or_when_done: bool = False) -> Observation:
        """Block until the latest observation satisfies ``predicate``; ``or_when_done``: or until the pipeline
        has done all its work (then the latest observation, which does not satisfy it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.abort.is_set():
                raise Aborted()
            obs = self.run.latest()
            if obs is not None and predicate(obs):
                return obs
            if self.run.reconciled_at is not None:
                if or_when_done and obs is not None:
                    return obs
                raise FaultNotInjected(f"the pipeline finished before {what}")
            time.sleep(0.1)
        raise FaultNotInjected(f"{what} did not happen within {timeout_s:.0f}s")

    def observation_after(self, moment: float) -> Observation:
        """The first observation the watch loop takes after ``moment`` (the watcher is the loop's alone)."""
        while not self.abort.is_set():
            obs = self.run.latest()
            if obs is not None and obs.t > moment:
                return obs
            time.sleep(0.05)
        raise Aborted()

    def sleep(self, seconds: float) -> None:
        if self.abort.wait(seconds):
            raise Aborted()

    def lifted(self) -> None:
        """The fault is over from here on (recovery is measured from this moment)."""
        self.lifts.append(time.monotonic())

    def note(self, text: str) -> None:
        self.notes.append(text)
        logger.info("run=%s %s", self.run.run_id, text)


@dataclass(frozen=True)
class Signal:
    """Which counts show progress of the faulted part (any growth of their sum)."""

    fields: tuple[str, ...] = ("episodes", "batches")

    def value(self, obs: Observation) -> int:
        return sum(getattr(obs, f) for f in self.fields)


def recovery_times(history: list[Observation], lifts: list[float], signal_: Signal,
                   done_at: float | None) -> list[float | None]:
    """Seconds from each lift to the first observation whose signal grew past the first one taken
    after the lift (or to the moment the run was accounted for, if that came first); None if neither.

    The base is the first observation *after* the lift, not the last before it: records a killed
    stage wrote just before it died would otherwise count as the restarted stage's progress. Growth
    within that first poll interval is missed, so a time may be up to one interval long.
    """
    out: list[float | None] = []
    for lifted in lifts:
        after = [o for o in history if o.t >= lifted]
        grew = None
        if after:
            base = signal_.value(after[0])
            grew = next((o.t for o in after[1:] if signal_.value(o) > base), None)
        ends = [t for t in (grew, done_at) if t is not None]
        out.append(max(0.0, min(ends) - lifted) if ends else None)
    return out


@dataclass
class RunFacts:
    """Everything the runner needs to judge one run."""

    reconciliation: Reconciliation | None
    sent_source: str
    digests: dict[str, str]
    dead_letters: list[DeadLetter]
    recoveries: list[float | None]
    failure: str | None
    fault_error: str | None
    notes: list[str]
    elapsed_s: float
    logs: dict[str, str] = field(default_factory=dict)
    deleted: int = 0  # records the fault deleted from the log, and the rollout keys they held
    deleted_keys: set[str] = field(default_factory=set)
    logged: LoggedEpisodes | None = None  # a generator killed for good: the episodes rollout.turns held
