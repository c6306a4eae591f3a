"""The main job: generator, stream worker and shard writer as separate processes, watched to the end.

Batch boundaries come from the log alone: full step batches, then the last, partial batch once the
generator's end-of-run records have come through the stream stage; the shard writer runs with
``--exit-on-end-of-run`` and exits 0 when that batch is written and committed, so the demo knows
nothing more will come. The run succeeds (exit 0) only when every valid episode the generator
finished is in exactly one written batch (``tools.accounting``: only the deliberate faults of
``--inject-faults``, and the batch-mates their failed mask check takes along, may end in the DLQ);
everything it started is stopped either way. With ``train`` a fourth process, ``train-sim``
(``tools.train_sim``), trains on every rank's shards as they are announced and exits at the run's
end; the demo waits for it, and succeeds only if every written batch was trained exactly once per
rank, in seq order (``feed.training.reconcile_training`` over its ``trained.jsonl``). With ``learn``
the generator samples from the real policy (``generate --engine policy``) and the fourth process is
``rollout-bus train``, which ships every version back; the demo then also succeeds only if the reward
rose (``observe.learning``: the curve, printed and written to ``learn.json``). The run directory says whose
it is (``run_dir``: ``run.json``, the run id and topic prefix), written before anything else. With ``prompts``
(``new_run``) a prompt file is loaded and a group of ``generate --from-prompts`` members makes the episodes instead
of the seeded generator (``demo.prompts_run``); the final report is ``demo.report``'s.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollout_bus.config import DEFAULT_DP_SIZE, BatchingSettings
from rollout_bus.kafka.acls import grant_roles
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.local_kafka.secure import SecureSetup
from rollout_bus.kafka.reader import TopicWatcher
from rollout_bus.observe.accounting import Reconciliation, reconcile, written_batches
from rollout_bus.observe.learning import learning_curve, reward_charts
from rollout_bus.demo.processes import StageProcess
from rollout_bus.demo.run_dir import claim_run_dir
from rollout_bus.consumers.feed.training import TrainingCheck, read_trained, reconcile_training, staleness_problems
from rollout_bus.consumers.shard_writer.lost_markers import EXIT_RECORDS_LOST
from rollout_bus.demo.problems import print_problems, records_lost_verdict
from rollout_bus.demo.report import print_report
from rollout_bus.wire.topics import DEFAULT_MAX_RECORD_BYTES, Topics


# the stages' own default names, given explicitly (no ROLLOUT_BUS_APP_ID from the environment): the
# run's topic prefix makes them the run's own
STREAM_APP_ID, SHARDS_GROUP_ID = "rollout-bus-stream", "rollout-bus-shards"
# the sampling of demo --learn: top-p 0.9 decides the support; top-k 20 is above the policy's 17 tokens, so it is
# there to show the flag reaches transformers' warper, and cuts nothing
LEARN_SAMPLING = {"temperature": 1.0, "top_p": 0.9, "top_k": 20}
LEARN_JSON = "learn.json"
LEARN_PLOTS = ("learn-reward-by-batch.svg", "learn-reward-by-time.svg")
@dataclass
class DemoOptions:
    """What the demo runs; defaults finish well under two minutes on two cores."""

    episodes: int = 64
    seed: int = 0
    adapters: str = ""
    n_samples_per_prompt: int = 4
    # the run's batching, the same object generate and shards settle theirs in (groups per batch, step or
    # arrival, the staleness bound: with a bound the loop is closed and needs ``train``)
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    dp_size: int = DEFAULT_DP_SIZE
    out: Path | None = None
    topic_prefix: str | None = None
    inject_faults: bool = False
    timeout_s: float = 300.0
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # the stages read ROLLOUT_BUS_MAX_RECORD_BYTES themselves
    generator_args: list[str] = field(default_factory=list)
    train: bool = False  # also run train-sim on the shards, and check every batch was trained once per rank
    interrupt_prob: float = 0.0  # with max_staleness: share of turns cut when the weights change under them
    stream_workers: int = 1  # stream processes sharing one Faust consumer group: stream, stream-2, ...
    # the real loop: the policy generates (generate --engine policy) and `rollout-bus train` trains it, shipping
    # each version back; needs ``train`` and a staleness bound, and succeeds only if the reward rises
    learn: bool = False
    # a secured cluster's principals (``local_kafka.secure.SecureSetup``'s directory): each stage runs as its role's
    # principal with that role's ACLs on the run's prefix; the demo itself is ``client_kwargs``' (an admin)
    principals: Path | None = None
    # from prompts instead (``demo.prompts_run``): loaded onto rollout.prompts, shared by ``generators``
    # `generate --from-prompts` members; the file ``prompts``, or with ``learn`` and none the calculator task's
    # problems (written into the run directory); False: the seeded generator plans its own episodes
    from_prompts: bool = False
    prompts: Path | None = None
    generators: int = 2
    # from prompts: a member holding a prompt group with turns on the log killed -9 this many times mid-run (at
    # i/(n + 1) of the groups done), a new member started in its place each time: what the takers resume
    kill_members: int = 0


def learn_engine_args() -> list[str]:
    """The flags of a generator of ``demo --learn``: the real policy, and its sampling."""
    return ["--engine", "policy", *(f for k, v in LEARN_SAMPLING.items() for f in (f"--{k.replace('_', '-')}", str(v)))]


def batching_args(batching: BatchingSettings) -> list[str]:
    """The flags that give a stage process this batching (every stage of a run must get the same)."""
    bound = [] if batching.max_staleness is None else ["--max-staleness", str(batching.max_staleness)]
    return ["--groups-per-batch", str(batching.groups_per_batch), "--batching", batching.batching, *bound]


def _expected_batches(options: DemoOptions) -> int:
    groups = math.ceil(options.episodes / options.n_samples_per_prompt)
    adapters = max(1, len([a for a in options.adapters.split(",") if a.strip()]))
    return math.ceil(math.ceil(groups / adapters) / options.batching.groups_per_batch)


class DemoRun:
    """One run of the pipeline against ``client_kwargs``' cluster (the seeded generator's; ``new_run`` picks)."""

    closes_itself = False  # True: done only once the shard writer, closing the run, wrote the last batch

    def __init__(self, client_kwargs: dict[str, Any], options: DemoOptions, console: Console):
        self.kwargs = client_kwargs
        self.options = options
        self.console = console
        self.run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]
        prefix = options.topic_prefix if options.topic_prefix is not None else f"demo-{self.run_id}."
        self.topics = Topics(prefix=prefix)
        self.out = Path(options.out) if options.out else Path("demo-out") / self.run_id
        self.summary_path = self.out / "generator-summary.json"
        self.train_dir = self.out / "train"
        self.stages: dict[str, StageProcess] = {}
        self.roles = SecureSetup(options.principals) if options.principals else None

    def _as(self, role: str) -> dict[str, str] | None:
        """The environment that makes a stage process ``role``'s principal (None: the demo's own settings)."""
        return self.roles.client_env(role, self.kwargs["bootstrap_servers"]) if self.roles else None

    def grant_roles(self) -> int:
        """Each role's principal gets its ACLs on this run's topics and groups; return how many."""
        if self.roles is None:
            return 0
        return grant_roles(self.kwargs, self.topics, stream_app_id=STREAM_APP_ID, shards_group=SHARDS_GROUP_ID)

    def _common(self) -> list[str]:
        return ["--bootstrap-servers", self.kwargs["bootstrap_servers"], "--topic-prefix", self.topics.prefix]

    @property
    def stream_group(self) -> str:
        """The stream workers' consumer group (the topic prefix scopes it, as it scopes the topics)."""
        return self.topics.group(STREAM_APP_ID)

    @property
    def shards_group(self) -> str:
        return self.topics.group(SHARDS_GROUP_ID)

    def start_stages(self, generator: bool = True) -> None:
        """Start the stream worker(s) and shard writer, then (unless told not to) the generator."""
        o, logs = self.options, self.out / "logs"
        for i in range(1, o.stream_workers + 1):
            name, suffix = ("stream", "") if i == 1 else (f"stream-{i}", f"-{i}")
            self.stages[name] = StageProcess(name, "stream", [
                *self._common(), "--app-id", STREAM_APP_ID,
                "--data-dir", str(self.out / f"faust{suffix}")], logs / f"{name}.log", env=self._as("stream"))
        self.stages["shards"] = StageProcess("shards", "shards", [
            *self._common(), "--out", str(self.out / "shards"), "--dp-size", str(o.dp_size),
            *batching_args(o.batching), "--group-id", SHARDS_GROUP_ID, "--exit-on-end-of-run"],
            logs / "shards.log", env=self._as("shards"))
        if o.train:
            self.stages["train"] = StageProcess("train", "train" if o.learn else "train_sim", [
                *self._common(), "--ranks", "all", "--dp-size", str(o.dp_size), "--checkpoint-dir",
                str(self.train_dir), "--timeout", str(o.timeout_s), "--start-seq", "0"], logs / "train.log",
                env=self._as("trainer"))
        if not generator:
            return
        gen_args = [*self._common(), "--episodes", str(o.episodes), "--seed", str(o.seed),
                    "--n-samples-per-prompt", str(o.n_samples_per_prompt), "--summary-out", str(self.summary_path),
                    *(["--adapters", o.adapters] if o.adapters else []),
                    *(["--inject-faults"] if o.inject_faults else []),
                    *([*batching_args(o.batching), "--interrupt-prob", str(o.interrupt_prob)]
                      if o.batching.max_staleness is not None else []),
                    *(learn_engine_args() if o.learn else []), *o.generator_args]
        self.stages["generate"] = StageProcess("generate", "generate", gen_args, logs / "generate.log",
                                               env=self._as("generator"))

    def restart(self, name: str) -> StageProcess:
        """Start a stage again with the same arguments (after a crash drill killed it)."""
        old = self.stages[name]
        self.stages[name] = StageProcess(name, old.module, old.args, old.log_path, env=old.env)
        return self.stages[name]

    def stop_stages(self) -> None:
        for stage in reversed(list(self.stages.values())):
            stage.stop()

    def _summary(self) -> dict | None:
        if not self.summary_path.exists():
            return None
        return json.loads(self.summary_path.read_text())

    def _sent(self) -> list[tuple[str, int]] | None:
        summary = self._summary()
        return None if summary is None else [(k, int(a)) for k, a in summary["episodes"]]

    def generators_done(self) -> bool:
        """The generator(s) exited 0 and said what they sent."""
        return self.stages["generate"].poll() == 0 and self._summary() is not None

    def expected(self) -> tuple[int, int]:
        """The episodes and batches the progress bars count to."""
        return self.options.episodes, _expected_batches(self.options)

    def report_lines(self) -> list[str]:
        """What the report adds beside the batch table (the prompts run: the prompt ledger)."""
        return []

    def drill(self) -> None:
        """Called on every tick of ``watch``: a fault drill's next step, if any (the prompts run's member kills)."""

    def drill_shortfall(self) -> str | None:
        """Why the drill asked for did not all happen (the run ended first), or None."""
        return None

    def _faults(self) -> list[dict]:
        return list((self._summary() or {}).get("faults", []))

    def reconcile(self, watcher: TopicWatcher, *, verify: bool) -> Reconciliation | None:
        """The run's accounting as of now (None before the generator wrote its summary)."""
        sent = self._sent()
        if sent is None:
            return None
        return reconcile(sent, self.out / "shards", watcher.dead_letters(self.topics.dlq), verify=verify,
                         faults=self._faults())

    def watch(self, watcher: TopicWatcher) -> tuple[Reconciliation | None, str | None]:
        """Show progress until every valid episode is placed, or the shard writer closed the run (then
        nothing more will come); return the last reconciliation and any failure."""
        t = self.topics
        columns = [TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=self.console, transient=False) as progress:
            episodes, batches = self.expected()
            bars = {"turns": progress.add_task("turns sent", total=None),
                    "episodes": progress.add_task("episodes merged", total=episodes),
                    "batches": progress.add_task("batches written", total=batches),
                    "dlq": progress.add_task("dead letters", total=None)}
            deadline = time.monotonic() + self.options.timeout_s
            result = None
            while time.monotonic() < deadline:
                watcher.read_new(timeout_ms=500)
                counts = watcher.counts()
                progress.update(bars["turns"], completed=counts[t.turns])
                progress.update(bars["episodes"], completed=counts[t.episodes])
                progress.update(bars["batches"], completed=len(written_batches(self.out / "shards")))
                progress.update(bars["dlq"], completed=counts[t.dlq])
                self.drill()
                failure = self._failed_stage()
                if failure:
                    return result, failure
                if self.generators_done():
                    progress.update(bars["turns"], total=counts[t.turns])
                    result = self.reconcile(watcher, verify=False)
                    if result.ok and not self.closes_itself:
                        return result, None
                    if self.stages["shards"].poll() == 0:  # the run is closed: nothing more will come
                        watcher.catch_up()
                        return self.reconcile(watcher, verify=False), None
            return result, f"timed out after {self.options.timeout_s:.0f}s"

    def wait_for_training(self) -> str | None:
        """With ``train``: show batches trained (as checkpointed) until train-sim exits at the run's end;
        return a failure, if any."""
        stage = self.stages.get("train")
        if stage is None:
            return None
        columns = [TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        deadline = time.monotonic() + self.options.timeout_s
        with Progress(*columns, console=self.console, transient=False) as progress:
            bar = progress.add_task("batches trained", total=len(written_batches(self.out / "shards")))
            while stage.poll() is None and time.monotonic() < deadline:
                progress.update(bar, completed=len({row["seq"] for row in read_trained(self.train_dir)}))
                time.sleep(0.5)
            progress.update(bar, completed=len({row["seq"] for row in read_trained(self.train_dir)}))
        if stage.poll() is None:
            return f"the trainer did not finish within {self.options.timeout_s:.0f}s; see {stage.log_path}"
        return self._failed_stage()

    def check_training(self) -> TrainingCheck | None:
        """Every written batch trained exactly once per rank, in seq order (None without ``train``)."""
        if not self.options.train:
            return None
        seqs = [int(m["seq"]) for m in written_batches(self.out / "shards").values()]
        return reconcile_training(seqs, read_trained(self.train_dir), range(self.options.dp_size))

    def _failed_stage(self) -> str | None:
        """A stage that exited when it should not have: any non-zero exit, or the stream worker at all
        (the generator and each ``generate-*`` member exit 0 when done, the shard writer once the run's last batch
        is written, train-sim at the run's end)."""
        for name, stage in self.stages.items():
            code = stage.poll()
            if name == "shards" and code == EXIT_RECORDS_LOST:
                return records_lost_verdict(stage)
            if code not in (None, 0) or (code == 0 and name.split("-")[0] not in ("generate", "shards", "train")):
                return f"stage {name} exited with code {code}; last lines of {stage.log_path}:\n{stage.log_tail()}"
        return None


def new_run(client_kwargs: dict[str, Any], options: DemoOptions, console: Console) -> DemoRun:
    """The seeded generator's run, or with ``options.from_prompts`` the generator group's (``demo.prompts_run``)."""
    if not options.from_prompts:
        return DemoRun(client_kwargs, options, console)
    from rollout_bus.demo.prompts_run import PromptsDemoRun  # it builds on DemoRun

    return PromptsDemoRun(client_kwargs, options, console)


def run_demo(client_kwargs: dict[str, Any], options: DemoOptions, console: Console) -> int:
    """Run the pipeline once; print progress, metrics and where the shards are; return the exit code."""
    run = new_run(client_kwargs, options, console)
    claim_run_dir(run.out, run.run_id, run.topics.prefix)
    created = ensure_topics(client_kwargs, run.topics, max_record_bytes=options.max_record_bytes)
    console.print(f"run {run.run_id}: topics {run.topics.prefix}rollout.* ({len(created)} created), out {run.out}")
    if run.roles is not None:
        console.print(f"secured: each stage is its role's principal; {run.grant_roles()} ACLs on "
                      f"{run.topics.prefix}rollout.* and the run's groups")
    began = time.monotonic()
    watcher = TopicWatcher(client_kwargs, [run.topics.turns, run.topics.episodes, run.topics.dlq],
                           [run.topics.dlq, run.topics.metrics], data_topics=[run.topics.turns, run.topics.episodes])
    try:
        run.start_stages()
        result, failure = run.watch(watcher)
        watcher.catch_up()
        failure = failure or run.wait_for_training()
    finally:
        run.stop_stages()
    final = run.reconcile(watcher, verify=True)
    training = run.check_training()
    watcher.catch_up()  # the trainer's and the generators' last flow records, sent as they ended
    metrics_records = watcher.json_values(run.topics.metrics)
    watcher.close()
    print_report(console, run, final, metrics_records, time.monotonic() - began)
    if training is not None:
        console.print(f"{training.summary()} (checkpoints: {run.train_dir.resolve()})", soft_wrap=True)
    if failure:
        console.print(f"[red]demo failed:[/red] {escape(failure)}", soft_wrap=True)
        return 1
    if final is None or not final.ok:
        print_problems(console, final.problems() if final else ["the generator wrote no summary"])
        return 1
    if training is not None and not training.ok:
        print_problems(console, training.problems())
        return 1
    if (shortfall := run.drill_shortfall()) is not None:
        print_problems(console, [shortfall])
        return 1
    if options.learn and not report_learning(console, run, options):
        return 1
    bound = options.batching.max_staleness
    if bound is not None:
        problems, worst = staleness_problems(written_batches(run.out / "shards").values(), bound)
        console.print(f"staleness: at most {worst} steps (bound {bound}) over "
                      f"{len(written_batches(run.out / 'shards'))} batches; generators held to it by rollout.weights "
                      "(their waits: the flow table)")
        print_problems(console, problems)
        return 1 if problems else 0
    return 0


def report_learning(console: Console, run: DemoRun, options: DemoOptions) -> bool:
    """The reward curve of the run's training, as a table and ``learn.json``; True when the policy learned."""
    from rollout_bus.learn.trainer import WEIGHTS_DIR  # transformers: only with --learn
    from rollout_bus.policy.checkpoint import sha256_of

    curve = learning_curve(read_trained(run.train_dir))
    verdict = curve.verdict()
    table = Table(title="the policy through the bus: reward per trained batch (every batch, or a sample of them)")
    for name in ("batch", "reward", "loss", "mismatch max", "full-vocab gap", "staleness", "seconds"):
        table.add_column(name, justify="right")
    step = max(1, len(curve.points) // 16)
    for point in curve.points[::step] + ([curve.points[-1]] if (len(curve.points) - 1) % step else []):
        table.add_row(str(point.seq), f"{point.reward:.3f}", f"{point.loss:.4f}", f"{point.mismatch_max:.1e}",
                      f"{point.full_vocab_mismatch_mean:.3f}", f"{point.staleness_max:.0f}", f"{point.elapsed_s:.1f}")
    console.print(table)
    console.print(verdict.describe(), soft_wrap=True)
    checkpoints = {int(p.stem.rsplit("-v", 1)[1]): {"uri": p.resolve().as_uri(), "sha256": sha256_of(p),
                                                    "bytes": p.stat().st_size}
                   for p in sorted((run.train_dir / WEIGHTS_DIR).glob("policy-v*.safetensors"))}
    doc = {"run_id": run.run_id, "topic_prefix": run.topics.prefix, "episodes": options.episodes, "seed": options.seed,
           "n_samples_per_prompt": options.n_samples_per_prompt,
           "groups_per_batch": options.batching.groups_per_batch, "max_staleness": options.batching.max_staleness,
           "interrupt_prob": options.interrupt_prob, "sampling": LEARN_SAMPLING,
           "verdict": asdict(verdict), "curve": curve.to_json(),
           "checkpoints": {str(v): ref for v, ref in sorted(checkpoints.items())}}
    (run.out / LEARN_JSON).write_text(json.dumps(doc, indent=1))
    for name, chart in zip(LEARN_PLOTS, reward_charts(curve)):
        (run.out / name).write_text(chart, encoding="utf-8")
    console.print(f"reward curve: {(run.out / LEARN_JSON).resolve()}, plots {', '.join(LEARN_PLOTS)} beside it "
                  f"({len(checkpoints)} checkpoints listed)")
    return verdict.learned
