"""Runs the whole pipeline (three stage processes) for the end-to-end tests, optionally with a crash drill."""

from __future__ import annotations

import hashlib
import io
import time
from pathlib import Path
from typing import Callable

from rich.console import Console

from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.observe.accounting import Reconciliation
from rollout_bus.config import BatchingSettings
from rollout_bus.demo.run import DemoOptions, DemoRun, written_batches
from rollout_bus.kafka.reader import TopicWatcher

Drill = Callable[[DemoRun, TopicWatcher], None]


def run_pipeline(bootstrap: str, out: Path, *, seed: int = 7, episodes: int = 24, drill: Drill | None = None,
                 conn: dict | None = None, **options) -> tuple[DemoRun, Reconciliation]:
    """One run on fresh topics; returns the run and its reconciliation (asserting the run finished).
    ``conn``: the harness's own connection (a secured cluster's admin; the stages are then the roles of
    ``options["principals"]``, granted their ACLs on the run's topics as ``demo --secure`` does)."""
    opts = DemoOptions(episodes=episodes, seed=seed, out=out, n_samples_per_prompt=4,
                       batching=BatchingSettings(groups_per_batch=2),
                       dp_size=2, timeout_s=240.0, **options)
    run = DemoRun(conn or {"bootstrap_servers": bootstrap}, opts, Console(file=io.StringIO()))
    ensure_topics(run.kwargs, run.topics)
    run.grant_roles()
    watcher = TopicWatcher(run.kwargs, [run.topics.turns, run.topics.episodes, run.topics.dlq], [run.topics.dlq],
                           data_topics=[run.topics.turns, run.topics.episodes])
    try:
        run.start_stages()
        if drill is not None:
            drill(run, watcher)
        result, failure = run.watch(watcher)
        watcher.catch_up()
        result = run.reconcile(watcher, verify=True) if failure is None else result
    finally:
        run.stop_stages()
        watcher.close()
    logs = {name: stage.log_tail(40) for name, stage in run.stages.items()}
    assert failure is None, f"{failure}\nlogs: {logs}"
    assert result is not None and result.ok, (result.problems() if result else "no result", logs)
    return run, result


def wait_until(condition: Callable[[], bool], timeout_s: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def kill_and_restart(stage: str, when: Callable[[DemoRun, TopicWatcher], bool]) -> Drill:
    """A drill: once ``when`` holds, SIGKILL ``stage`` and start it again with the same arguments."""

    def drill(run: DemoRun, watcher: TopicWatcher) -> None:
        wait_until(lambda: when(run, watcher), what=f"the moment to kill {stage}")
        run.stages[stage].kill()
        run.restart(stage)

    return drill


def episodes_emitted_at_least(n: int) -> Callable[[DemoRun, TopicWatcher], bool]:
    """Episode records (control records not counted) read so far."""

    def enough(run: DemoRun, watcher: TopicWatcher) -> bool:
        watcher.read_new(timeout_ms=100)
        return watcher.counts()[run.topics.episodes] >= n

    return enough


def batches_written_at_least(n: int) -> Callable[[DemoRun, TopicWatcher], bool]:
    return lambda run, watcher: len(written_batches(run.out / "shards")) >= n


def shard_digests(run: DemoRun) -> dict[str, str]:
    """sha256 of every shard file, by path relative to the shards directory."""
    root = run.out / "shards"
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.glob("batch-*/dp-*.safetensors"))}
