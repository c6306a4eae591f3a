"""Runs chaos scenarios on brokers of its own and prints one row per scenario.

Contract: the runner starts its own single broker (a free port pair of ``free_ports``, below the ephemeral range, unless ``--port``)
and, only if a selected scenario needs it, its own three-node cluster; it never touches any other
broker, and stops what it started. Each workload gets one undisturbed baseline run first (shown as
``baseline-<workload>``); every scenario is then judged against it: nothing lost or duplicated, no
dead letters beyond the baseline's (and, for injected records, each exactly once with a reason),
shards byte-identical, progress again after the fault is lifted. Exit status 0 only if every row
passed.

Columns: ``lost`` episodes of the generator's summary in no batch and not in the DLQ (at the end,
or when the run failed); ``dup`` episodes in more than one batch; ``dlq`` dead letters read;
``identical`` every shard file's sha256 equals the baseline's (``-``: the run did not finish;
``n/a``: not compared); ``recover_s`` the longest time from a fault being lifted to the faulted
part's output growing again (turns for the generator, episodes for the stream worker, batches on
disk for the shard writer and for broker, cluster and record faults), one poll interval coarse.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from rollout_bus.local_kafka.local_broker import LocalBroker
from rollout_bus.observe.accounting import Reconciliation
from rollout_bus.wire.dead_letter import DeadLetter, DlqKind
from rollout_bus.local_kafka.local_cluster import LocalCluster, free_ports
from tests.chaos.faults import injected_ids
from tests.chaos.evidence import longest_episode_tokens, shard_digests
from tests.chaos.unfinished import unfinished_problems
from tests.chaos.harness import ChaosRun, Expected, FaultContext, RunFacts, Workload, recovery_times
from tests.chaos.scenarios import BY_NAME, FULL, QUICK, Scenario

logger = logging.getLogger(__name__)

COLUMNS = [("scenario", "scenario"), ("lost", "lost"), ("duplicated", "dup"), ("dead_lettered", "dlq"),
           ("identical", "identical"), ("recover_s", "recover_s"), ("result", "result"), ("elapsed_s", "time_s"),
           ("detail", "detail")]
DETAIL_CHARS = 90


@dataclass
class Row:
    scenario: str
    lost: int | None
    duplicated: int | None
    dead_lettered: int | None
    identical: str
    recover_s: float | None
    passed: bool
    elapsed_s: float
    detail: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)
    out_dir: str = ""

    @property
    def result(self) -> str:
        return "PASS" if self.passed else "FAIL"


class Brokers:
    """The runner's own brokers: a single node always, the three-node cluster on first use."""

    def __init__(self, work_dir: Path, port: int | None = None, cluster_ports: list[int] | None = None):
        self.work_dir = work_dir
        self.single = LocalBroker(port=port or free_ports(1)[0], data_dir=work_dir / "broker")
        self._cluster_ports = cluster_ports
        self.cluster: LocalCluster | None = None
        self.secured: LocalBroker | None = None  # TLS, SCRAM and ACLs (``kafka start --secure``), on first use
        self._single_started = False

    def node(self, target: str) -> LocalBroker:
        """The single-node broker a fault acts on: the plain one, or the secured one."""
        if target == "secure":
            assert self.secured is not None, "the secured broker was never started"
            return self.secured
        return self.single

    def connection(self, target: str) -> dict:
        """The harness's own client settings for ``target`` (on the secured broker: its admin)."""
        if target == "secure":
            return self.node(target).connection()
        return {"bootstrap_servers": self.bootstrap(target)}

    def bootstrap(self, target: str) -> str:
        if target == "secure":
            if self.secured is None:
                self.secured = LocalBroker(port=free_ports(1)[0], data_dir=self.work_dir / "broker-secure", secure=True)
            self.secured.start(echo=lambda _m: None)
            return self.secured.bootstrap
        if target == "cluster":
            if self.cluster is None:
                ports = self._cluster_ports or free_ports(3)
                self.cluster = LocalCluster(ports, self.work_dir / "cluster", echo=lambda _m: None)
            self.cluster.start()
            return self.cluster.bootstrap
        self.single.start(echo=lambda _m: None)
        self._single_started = True
        return self.single.bootstrap

    def restore(self) -> None:
        """Bring back whatever a fault left down (a scenario that failed midway may not have)."""
        if self._single_started:
            self.single.start(echo=lambda _m: None)
        if self.cluster is not None:
            self.cluster.start()
        if self.secured is not None:
            self.secured.start(echo=lambda _m: None)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.secured is not None:
            self.secured.stop()
        if self._single_started:
            self.single.stop()


def _execute(name: str, workload: Workload, scenario: Scenario | None, brokers: Brokers, expected: Expected,
             out: Path) -> RunFacts:
    """Run one pipeline (with the scenario's fault, if any) and collect the facts."""
    target = scenario.target if scenario else "single"
    began = time.monotonic()
    run = workload.new_run(brokers.bootstrap(target), out, label=name,
                           replication_factor=3 if target == "cluster" else 1, conn=brokers.connection(target),
                           roles=brokers.node(target).secure if target == "secure" else None)
    ctx = FaultContext(run, expected, brokers)
    try:
        if scenario is not None and scenario.setup is not None:
            scenario.setup(run)
        run.start()
        run.watch(ctx, scenario.fault if scenario else None, scenario.timeout_s if scenario else 300.0,
                  scenario.condition if scenario else (lambda _r: True))
    except Exception as exc:  # a run that cannot even start is a failed row, not a dead runner
        logger.exception("run %s failed", name)
        run.failure = run.failure or f"{type(exc).__name__}: {exc}"
    finally:
        run.stop()
    reconciliation, source = run.final_reconciliation(expected) if run.watcher else (None, "not started")
    signal_ = scenario.progress if scenario else None
    notes = ctx.notes + [f"{name} exited 75 (partitions changed) and was started again" for name in run.restarts]
    facts = RunFacts(reconciliation, source, _digests(run), run.dead_letters() if run.watcher else [],
                     recovery_times(run.history, ctx.lifts, signal_, run.reconciled_at) if signal_ else [],
                     run.failure, ctx.error, notes, time.monotonic() - began, deleted=ctx.deleted,
                     deleted_keys=set(ctx.deleted_keys), logged=run.logged)
    if run.failure or ctx.error or not (reconciliation and reconciliation.ok):
        facts.logs = run.log_tails()
    if scenario is not None and scenario.teardown is not None:
        scenario.teardown(run)
    run.close()
    brokers.restore()
    return facts


def _digests(run: ChaosRun) -> dict[str, str]:
    return shard_digests(run.shards_dir) if run.shards_dir.exists() else {}


def _identical(scenario: Scenario | None, facts: RunFacts, expected: Expected, problems: list[str]) -> str:
    if scenario is None:
        return "(ref)"
    if not scenario.compare:
        return "n/a"
    if facts.failure:
        return "-"
    if expected.digests is None:
        problems.append("no baseline shards to compare with (the baseline run failed)")
        return "no base"
    if facts.digests == expected.digests:
        return "yes"
    differ = sum(1 for k, v in facts.digests.items() if k in expected.digests and expected.digests[k] != v)
    missing, extra = len(set(expected.digests) - set(facts.digests)), len(set(facts.digests) - set(expected.digests))
    problems.append(f"shards differ from the baseline: {differ} changed, {missing} missing, {extra} extra "
                    f"(of {len(expected.digests)})")
    return "NO"


def _explained(facts: RunFacts, letter: DeadLetter) -> bool:
    """A dead letter a named loss explains: a ``lost`` range, or one for an episode whose records were deleted."""
    key = letter.key.decode(errors="replace") if letter.key else ""
    return letter.kind == DlqKind.LOST or key in facts.deleted_keys


def _dead_letter_problems(scenario: Scenario | None, facts: RunFacts, expected: Expected) -> list[str]:
    problems = []
    ids = injected_ids(facts.dead_letters)
    own = [d for d in facts.dead_letters if not any(k == "chaos.id" for k, _ in d.headers)
           and not (scenario is not None and scenario.named_loss and _explained(facts, d))
           and not (scenario is not None and scenario.unfinished and d.kind == DlqKind.UNFINISHED)]
    if len(own) != expected.dead_letters:
        kinds = sorted({f"{d.stage}/{d.kind}" for d in own})
        problems.append(f"{len(own)} dead letters of generated records (undisturbed run: {expected.dead_letters}); "
                        f"kinds {kinds}")
    count = scenario.injected if scenario else 0
    if count:
        lost, twice = count - len(ids), sum(1 for c in ids.values() if c > 1)
        silent = sum(1 for d in facts.dead_letters if any(k == "chaos.id" for k, _ in d.headers) and not d.reason)
        if lost or twice or silent:
            problems.append(f"injected records: {lost} of {count} not dead-lettered, {twice} dead-lettered more "
                            f"than once, {silent} without a reason")
    return problems


def _named_loss_problems(rec: Reconciliation, facts: RunFacts) -> list[str]:
    """A fault deleted records: every episode missing from the batches held one of them, the stages named the
    loss (``lost`` dead letters, no more records than were deleted), and nothing else went wrong."""
    named = sum(d.lost for d in facts.dead_letters if d.kind == DlqKind.LOST)
    gone = [*rec.missing, *rec.valid_in_dlq_only]
    unexplained = [k for k in gone if k not in facts.deleted_keys]
    clean = Reconciliation(duplicated=rec.duplicated, wrong_attempt=rec.wrong_attempt, unexpected=rec.unexpected,
                           bad_batches=rec.bad_batches)
    problems = clean.problems()
    if not facts.deleted:
        problems.append("the fault deleted nothing")
    if not rec.lost:
        problems.append(f"{facts.deleted} records deleted and no stage named a loss (no lost dead letter)")
    if named > facts.deleted:
        problems.append(f"{named} records named lost, more than the {facts.deleted} deleted")
    if unexplained:
        problems.append(f"{len(unexplained)} episodes lost that no deleted record held, e.g. {unexplained[:5]}")
    facts.notes.append(f"{facts.deleted} records deleted; {named} named lost in {len(rec.lost)} ranges; "
                       f"{len(gone)} episodes lost, each in a deleted record")
    return problems


def judge(name: str, scenario: Scenario | None, facts: RunFacts, expected: Expected, out: Path) -> Row:
    """One row: the counts, and every reason the scenario failed."""
    problems = [p for p in (facts.failure, facts.fault_error) if p]
    rec = facts.reconciliation
    if rec is None:
        problems.append(f"nothing to reconcile ({facts.sent_source})")
    elif scenario is not None and scenario.named_loss:
        problems += _named_loss_problems(rec, facts)
    elif scenario is not None and scenario.unfinished:
        problems += rec.problems() + unfinished_problems(rec, facts)
    else:
        problems += rec.problems()
        if rec.in_dlq_only != expected.dlq_only:
            problems.append(f"{rec.in_dlq_only} episodes only in the DLQ (undisturbed run: {expected.dlq_only})")
    problems += _dead_letter_problems(scenario, facts, expected)
    if scenario is not None and scenario.longest_episode:
        longest = longest_episode_tokens(out / "shards")
        facts.notes.append(f"longest episode in the shards: {longest} response tokens")
        if longest < scenario.longest_episode:
            problems.append(f"the longest episode in the shards has {longest} response tokens "
                            f"(expected >= {scenario.longest_episode})")
    identical = _identical(scenario, facts, expected, problems)
    recover = None
    if facts.recoveries:
        if any(r is None for r in facts.recoveries):
            problems.append("no progress after the fault was lifted")
        else:
            recover = max(facts.recoveries)
    summary = "; ".join(facts.notes[-1:]) if facts.notes else ""
    detail = problems[0] if problems else summary or (f"{rec.in_shards} episodes in {rec.batches} batches" if rec
                                                       else "")
    return Row(name, len(rec.missing) if rec else None, len(rec.duplicated) if rec else None,
               len(facts.dead_letters), identical, recover, not problems, round(facts.elapsed_s, 1), detail,
               problems, facts.notes, facts.logs, str(out))


def _baseline(workload: Workload, brokers: Brokers, work_dir: Path) -> tuple[Row, Expected]:
    name = f"baseline-{workload.name}"
    out = work_dir / name
    estimate = Expected.estimate(workload)
    facts = _execute(name, workload, None, brokers, estimate, out)
    row = judge(name, None, facts, estimate, out)
    if not row.passed:
        return row, estimate
    summaries = [json.loads(path.read_text()) for path in sorted(out.glob("generator-summary*.json"))]
    rec = facts.reconciliation
    assert rec is not None
    batches = len(list((out / "shards").glob("batch-*/manifest.json")))
    return row, Expected(turns=sum(int(s.get("turns_sent", 0)) for s in summaries) or estimate.turns,
                         episodes=rec.sent, batches=batches,
                         sent=[(k, int(a)) for s in summaries for k, a in s["episodes"]], digests=facts.digests,
                         dead_letters=len(facts.dead_letters), dlq_only=rec.in_dlq_only)


def run_table(scenarios: list[Scenario], work_dir: Path, *, port: int | None = None,
              cluster_ports: list[int] | None = None, echo: Callable[[str], None] = print) -> list[Row]:
    """Baselines, then every scenario; returns the rows (baselines first)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    brokers = Brokers(work_dir, port, cluster_ports)
    rows: list[Row] = []
    expected: dict[str, Expected] = {}
    baselined: set[str] = set()
    try:
        for scenario in scenarios:
            w = scenario.workload
            if scenario.compare and w.name not in baselined:  # a row before it may have needed only an estimate
                baselined.add(w.name)
                echo(f"baseline {w.name}: {w.episodes} episodes, seed {w.seed} ...")
                row, expected[w.name] = _baseline(w, brokers, work_dir)
                rows.append(row)
                echo(_progress_line(row))
            elif w.name not in expected:
                expected[w.name] = Expected.estimate(w)
            echo(f"{scenario.name}: {scenario.description} ...")
            out = work_dir / scenario.name
            facts = _execute(scenario.name, w, scenario, brokers, expected[w.name], out)
            rows.append(judge(scenario.name, scenario, facts, expected[w.name], out))
            echo(_progress_line(rows[-1]))
    finally:
        brokers.close()
    return rows


def _progress_line(row: Row) -> str:
    return f"  -> {row.result} in {row.elapsed_s:.0f}s: {row.detail}"


def _cell(row: Row, key: str) -> str:
    value = row.result if key == "result" else getattr(row, key)
    if value is None:
        return "-" if key == "recover_s" else "?"
    if isinstance(value, float):
        return f"{value:.1f}"
    text = str(value)
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 3] + "..."


def format_table(rows: list[Row]) -> str:
    """The rows as aligned text: a header, a rule, one line per row."""
    cells = [[title for _, title in COLUMNS]] + [[_cell(r, key) for key, _ in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i in (0, len(COLUMNS) - 1) else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in cells]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def format_failures(rows: list[Row], line_chars: int = 240) -> str:
    """Every problem of each failed row, with the last lines of each stage's log."""
    parts = []
    for row in rows:
        if row.passed:
            continue
        parts.append(f"== {row.scenario} FAILED (out dir {row.out_dir})")
        parts += [f"  - {p}" for p in row.problems]
        for stage, tail in row.logs.items():
            parts.append(f"  -- last lines of {stage}.log:")
            parts += ["     " + line[:line_chars] for line in tail.splitlines()]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short table (make test): small workloads")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these scenarios (see --list)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--port", type=int, help="port of the runner's own broker (default: a free one)")
    parser.add_argument("--cluster-ports", type=int, nargs=3, help="ports of the three-node cluster's nodes")
    parser.add_argument("--work-dir", type=Path, help="where runs, logs and broker data go")
    args = parser.parse_args(argv)
    if args.list:
        for s in FULL + QUICK:
            print(f"{s.name:<26} {s.description}")
        return 0
    unknown = [n for n in args.only or [] if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {sorted(BY_NAME)}")
    scenarios = [BY_NAME[n] for n in args.only] if args.only else (QUICK if args.quick else FULL)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for ours in ("tests.chaos", "rollout_bus.local_kafka.local_cluster"):
        logging.getLogger(ours).setLevel(logging.INFO)  # what was injected when
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # refused connections are the point here
    work_dir = args.work_dir or Path(tempfile.gettempdir()) / f"rollout-bus-chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"chaos: {len(scenarios)} scenarios, work dir {work_dir}", flush=True)
    rows = run_table(scenarios, work_dir, port=args.port, cluster_ports=args.cluster_ports,
                     echo=lambda m: print(m, flush=True))
    print()
    print(format_table(rows))
    failures = format_failures(rows)
    if failures:
        print()
        print(failures)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "result": r.result} for r in rows], indent=1))
    return 0 if all(r.passed for r in rows) else 1
