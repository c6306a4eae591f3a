"""A demo's run directory says whose run it holds, so a later demo given it as ``--out`` refuses it.

Why: a demo given another run's directory appended to that run's logs and rewrote its shard writer's lock.
``run.json`` (the run id and its topic prefix) is written first, before anything else of the run; a directory
holding it, or anything else a run writes there (an older demo's, from before ``run.json``), holds another run.

Contract: ``out_problem(out)`` says, reading only, why the demo must not use ``out`` (a file, read-only or
unreadable: ``writer_lock.unwritable``, the shard writer's own check; or another run's), None when it may;
``claim_run_dir(out, run_id, topic_prefix)`` writes ``run.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from rollout_bus.consumers.shard_writer.writer_lock import unwritable

RUN_JSON = "run.json"
RUN_ENTRIES = (RUN_JSON, "logs", "shards", "train", "generator-summary.json", "learn.json")


def out_problem(out: Path) -> str | None:
    """Why the demo must not use ``out`` (checked before anything is created or written), or None."""
    problem = unwritable(out)
    if problem is not None:
        return problem
    found = [name for name in RUN_ENTRIES if (out / name).exists()]
    if not found:
        return None
    try:
        said = json.loads((out / RUN_JSON).read_text())
        whose = f"run {said['run_id']} (topics {said['topic_prefix']}rollout.*)"
    except (OSError, ValueError, KeyError, TypeError):
        whose = "another run"
    return (f"--out {out} holds {whose}: {', '.join(found)}; give this run a fresh or empty directory (the "
            "default is demo-out/<run id>)")


def claim_run_dir(out: Path, run_id: str, topic_prefix: str) -> None:
    """Say in ``out`` whose run it holds."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_JSON).write_text(json.dumps({"run_id": run_id, "topic_prefix": topic_prefix}))
