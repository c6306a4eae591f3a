"""``make demo``'s run on the real broker: the packaged prompt file loaded, two members of the generators' group
making it, the run closed by them (no end-run), every episode in exactly one batch, and the prompt ledger
printed beside the batch table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest

from rollout_bus.demo.run import written_batches

pytestmark = pytest.mark.kafka

LEDGER = re.compile(r"prompt ledger: loaded (\d+), done (\d+), redelivered (\d+), failed (\d+), in flight (\d+)")


def test_demo_from_prompts_runs_two_generators_to_the_end_and_prints_the_ledger(kafka_bootstrap, tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "rollout_bus.cli.main", "demo", "--from-prompts",
                           "--bootstrap-servers", kafka_bootstrap, "--topic-prefix", f"t{uuid.uuid4().hex[:10]}.",
                           "--out", str(out), "--timeout", "150"],
                          capture_output=True, text=True, timeout=200, env={**os.environ, "COLUMNS": "200"})
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    [ledger] = LEDGER.findall(said)
    loaded, finished, _redelivered, failed, in_flight = map(int, ledger)
    assert (loaded, finished, failed, in_flight) == (16, 16, 0, 0), ledger
    assert "episodes sent 64: 64 in shards, 0 only in the DLQ (0 of them valid episodes lost); 4 batches" in said
    assert said.index("batch metrics") < said.index("prompt ledger:")  # beside the batch table
    summaries = [json.loads((out / f"generator-summary-{m}.json").read_text()) for m in ("g0", "g1")]
    assert sum(s["done"] for s in summaries) == 16 and any(s["closed_run"] for s in summaries)
    sent = {key for s in summaries for key, _ in s["episodes"]}
    written = {e["key"] for m in written_batches(out / "shards").values() for e in m["extra"]["episodes"]}
    assert sent == written and len(sent) == 64
