"""``rollout-bus report`` against the real broker: records in the stages' shapes in, one HTML page out."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from kafka import KafkaProducer

from rollout_bus.wire.dead_letter import DeadLetter, source_of
from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.model.metrics import compute_metrics_from_samples
from rollout_bus.wire.flow_metrics import flow_key, flow_metrics_record, generator_flow, trainer_flow
from rollout_bus.wire.metrics_records import batch_metrics_record, window_metrics_record
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.shards import write_batch_shards
from rollout_bus.wire.rollout_key import rollout_key_string
from rollout_bus.model.train_data import convert_samples_to_train_data, split_train_data_by_dp
from tests.browser import chromium, open_page

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = {"math": AdapterRef("math", 0), "code<&>": AdapterRef("code<&>", 1)}


def sample(adapter: str, rollout_id: int, length: int) -> Sample:
    return Sample(group_index=rollout_id // 2, rollout_id=rollout_id, tokens=list(range(4 + length)),
                  response_length=length, reward=float(rollout_id % 2), status=Status.COMPLETED,
                  adapter=ADAPTERS[adapter])


def window_records() -> list[tuple[bytes, bytes]]:
    """Three 5 s windows, two adapters, two source partitions each: growing partials, then closed ones."""
    out = []
    for w, start in enumerate((1_800_000_000_000, 1_800_000_005_000, 1_800_000_010_000)):
        for adapter in ADAPTERS:
            for partition in (0, 1):
                stats = EpisodeStats()
                for i in range(3):
                    stats.add_episode([sample(adapter, 100 * w + 10 * partition + i, 10 + 20 * i + 5 * w)])
                    out.append((b"window:%d-%d" % (start, start + 5000), window_metrics_record(
                        start, start + 5000, adapter, stats.metrics(), episodes=stats.episodes, closed=i == 2,
                        partition=partition, offset=i, stats=stats.to_json())))
    return out


def announced(seq: int, samples: list[Sample], response_tokens: int) -> dict:
    episodes = [{"key": rollout_key_string((s.adapter, "rollout", s.group_index, s.rollout_id)), "attempt": 0,
                 "partition": 0, "offset": i, "segments": 1} for i, s in enumerate(samples)]
    return {"seq": seq, "batch": f"batch-{seq:08d}", "dp_size": 2, "num_samples": len(samples),
            "num_tokens": 2 * response_tokens, "num_response_tokens": response_tokens, "shards": [],
            "metrics": compute_metrics_from_samples(samples), "sources": [],
            "extra": {"partial": False, "groups": [], "episodes": episodes},
            "dir": f"/nowhere/batch-{seq:08d}", "manifest_path": f"/nowhere/batch-{seq:08d}/manifest.json",
            "manifest_sha256": "0" * 64}


def write_disk_batch(out: Path, seq: int) -> None:
    samples = [sample("math", i, 8 + i) for i in range(4)]
    ranks = split_train_data_by_dp(convert_samples_to_train_data(samples), 2)
    episodes = [{"key": rollout_key_string((s.adapter, "rollout", s.group_index, s.rollout_id)), "attempt": 0,
                 "partition": 0, "offset": i, "segments": 1} for i, s in enumerate(samples)]
    write_batch_shards(out, seq, ranks, metrics=compute_metrics_from_samples(samples), sources=[],
                       extra={"partial": True, "groups": [], "episodes": episodes})


def publish(client_kwargs, topics) -> None:
    producer = KafkaProducer(**client_kwargs, acks="all")
    for key, value in window_records():
        producer.send(topics.metrics, key=key, value=value)
    for seq in (0, 1):
        samples = [sample("math", 10 * seq + i, 12) for i in range(3)] + [sample("code<&>", 10 * seq, 30)]
        flow = {"flow/sample_age_s/p50": 1.5 + seq, "flow/sample_age_s/p99": 4.0 + seq, "flow/response_tokens": 66.0,
                "flow/discarded_tokens/removed": 6.0 * seq, "flow/discarded_tokens/stale": 12.0,
                "flow/discarded_tokens/aborted": 0.0, "flow/discarded_tokens/takeover": 4.0 * seq}
        producer.send(topics.metrics, key=b"%d" % seq, value=batch_metrics_record(
            seq, compute_metrics_from_samples(samples) | flow, samples=len(samples), manifest_path="/nowhere"))
        producer.send(topics.shards, key=b"%d" % seq, value=json.dumps(announced(seq, samples, 66 + seq)).encode())
    for stage, source, metrics in (("generator", "g0of1-seed1", generator_flow(2.0, 1, 8.0)),
                                   ("trainer", "trainer", trainer_flow(3.0, 2, 8.0))):
        producer.send(topics.metrics, key=flow_key(stage, source),
                      value=flow_metrics_record(stage, source, metrics, elapsed_s=8.0, final=True))
    for i, (kind, reason) in enumerate([("decode", "safetensors header is not <valid> JSON"),
                                        ("decode", "safetensors header is not <valid> JSON"),
                                        ("finished", "turn 1 of attempt 0 arrived for a finished episode")]):
        key = rollout_key_string((ADAPTERS["math"], "rollout", 0, i)).encode()
        letter = DeadLetter(key, b"payload", [("turn", b"1")], reason, "stream", kind,
                            source_of(topics.turns, 0, i))
        producer.send(topics.dlq, key=key, value=b"payload", headers=letter.record_headers())
    producer.flush()
    producer.close()


def run_report(client_kwargs, prefix: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_bus.cli.report", "--bootstrap-servers",
                           client_kwargs["bootstrap_servers"], "--topic-prefix", prefix, "--out", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_report_shows_windows_batches_and_dead_letters_of_a_run(client_kwargs, topics, tmp_path):
    publish(client_kwargs, topics)
    write_disk_batch(tmp_path / "shards", seq=2)
    out = tmp_path / "report.html"
    done = run_report(client_kwargs, topics.prefix, out, "--shards", str(tmp_path / "shards"), "--title", "Nightly")
    assert done.returncode == 0, done.stdout + done.stderr
    page = out.read_text()
    assert "<title>Nightly</title>" in page
    assert re.search(r'<div class="v">36</div><div class="k">episodes</div>', page)  # 3 windows x 2 x 2 x 3
    assert re.search(r'<div class="v">3</div><div class="k">windows</div>', page)
    assert re.search(r'<div class="v">3</div><div class="k">batches</div>', page)
    assert re.search(r'<div class="v">3</div><div class="k">dead letters</div>', page)
    assert "code&lt;&amp;&gt;" in page and "code<&>" not in page
    assert page.count('class="line"') == 2 + 2 + 2 + 2 + 2  # overview, adapter bands, reward, episodes, sample age
    flow = page.split("<h2>Flow</h2>")[1].split("<h2>")[0]
    assert re.findall(r"<td>(generator|trainer)</td><td><code>([^<]+)</code></td><td class=\"n\">([\d.]+)</td>"
                      r"<td class=\"n\">([\d.]+)</td>", flow) == [("generator", "g0of1-seed1", "2.0", "0.250"),
                                                                 ("trainer", "trainer", "3.0", "0.375")]
    assert "batch 1: aborted 0, removed 6, stale 12, takeover 4 of 66 response tokens" in flow
    assert page.count('class="band"') == 2
    assert "safetensors header is not &lt;valid&gt; JSON" in page and ">2</td>" in page
    rows = re.findall(r"<tr><td class=\"n\">(\d+)</td><td>([^<]*)</td><td class=\"n\">(\d+)</td>"
                      r"<td class=\"n\">([\d,]+)</td>", page)
    assert [(seq, samples, tokens) for seq, _, samples, tokens in rows] == [("0", "4", "66"), ("1", "4", "67"),
                                                                          ("2", "4", "38")]


def test_the_adapter_filter_leaves_other_adapters_out(client_kwargs, topics, tmp_path):
    publish(client_kwargs, topics)
    out = tmp_path / "math.html"
    done = run_report(client_kwargs, topics.prefix, out, "--adapter", "math")
    assert done.returncode == 0, done.stdout + done.stderr
    page = out.read_text()
    assert "code&lt;" not in page.split("<h2>Dead letters</h2>")[0]
    assert re.search(r'<div class="v">18</div><div class="k">episodes</div>', page)


def test_an_unknown_topic_prefix_fails_and_says_so(client_kwargs, tmp_path):
    done = run_report(client_kwargs, "no-such-run-here.", tmp_path / "x.html")
    assert done.returncode == 1
    assert "no-such-run-here.rollout.metrics" in done.stderr and not (tmp_path / "x.html").exists()


CHARTS_AS_LAID_OUT = """Array.from(document.querySelectorAll('svg.chart')).map(svg => {
  const box = svg.getBoundingClientRect();
  return {width: box.width, height: box.height, lines: svg.querySelectorAll('path.line').length,
          bars: svg.querySelectorAll('rect.bar').length,
          legend: Array.from(svg.querySelectorAll('.legend-entry text')).map(t => t.textContent)};
})"""


def test_the_report_in_headless_chromium_has_no_console_error_draws_every_chart_and_needs_no_network(
        client_kwargs, topics, tmp_path):
    if chromium() is None:
        pytest.skip("no chromium here: Debian's chromium package (make test installs it when root)")
    publish(client_kwargs, topics)
    write_disk_batch(tmp_path / "shards", seq=2)
    out = tmp_path / "report.html"
    done = run_report(client_kwargs, topics.prefix, out, "--shards", str(tmp_path / "shards"))
    assert done.returncode == 0, done.stdout + done.stderr
    artifacts = Path(os.environ.get("ROLLOUT_BUS_TEST_ARTIFACTS", ROOT / "test-artifacts"))
    screenshot = artifacts / "report.png"
    visit = open_page(out.as_uri(), screenshot, {"charts": CHARTS_AS_LAID_OUT})
    print(f"report screenshot: {screenshot}")
    assert visit.console == [], visit.console  # no console message at all, errors included
    assert visit.requests == [out.as_uri()], visit.requests  # offline: the page asks for nothing else
    charts = visit.values["charts"]
    page = out.read_text()
    assert len(charts) == page.count("<svg") == 9  # 5 of windows, 2 of batches, 2 of flow
    for chart in charts:  # laid out with a size, and something drawn in it
        assert chart["width"] > 100 and chart["height"] > 50 and chart["lines"] + chart["bars"] > 0, chart
    lines = [c for c in charts if c["lines"]]
    assert sum(c["lines"] for c in charts) == page.count('class="line"') == 10  # 8, then the flow's p50 and p99
    legends = sorted(sorted(c["legend"]) for c in lines if len(c["legend"]) == 2)
    assert legends == [["code<&>", "math"]] * 3 + [["p50", "p99"]]  # the adapters' charts, then the sample age
    png = screenshot.read_bytes()
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and width > 1200 and height > 900 and len(png) > 20_000
