"""The run report: folding records into series, and the SVG charts (the page: test_report_html.py)."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.observe.report import RawRun, build_report, fold_batches, fold_dead_letters, fold_windows
from rollout_bus.observe.report_html import render_html
from rollout_bus.observe.charts import Bar, Series, bar_chart, line_chart, nice_ticks, time_ticks
from rollout_bus.wire.metrics_records import batch_metrics_record, window_metrics_record
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.wire.topics import Topics

SLOTS = {"math": 0, "code": 1}


def episode(adapter: str | None, rollout_id: int, length: int, reward: float) -> list[Sample]:
    ref = AdapterRef(adapter, SLOTS.get(adapter, 2)) if adapter is not None else None
    return [Sample(group_index=0, rollout_id=rollout_id, tokens=list(range(length + 3)), response_length=length,
                   reward=reward, status=Status.COMPLETED, adapter=ref)]


def stats_of(episodes: list[list[Sample]]) -> EpisodeStats:
    stats = EpisodeStats()
    for segments in episodes:
        stats.add_episode(segments)
    return stats


def window_doc(start: int, adapter: str | None, partition: int, episodes: list[list[Sample]], *,
               closed: bool = False, with_stats: bool = True) -> dict:
    stats = stats_of(episodes)
    raw = window_metrics_record(start, start + 5000, adapter, stats.metrics(), episodes=stats.episodes,
                                closed=closed, partition=partition, offset=len(episodes),
                                stats=stats.to_json() if with_stats else None)
    return json.loads(raw)


def manifest(seq: int, episodes: list[tuple[str, int]], response_tokens: int = 100) -> dict:
    return {"seq": seq, "num_samples": sum(n for _, n in episodes), "num_response_tokens": response_tokens,
            "num_tokens": response_tokens * 2, "dp_size": 2,
            "extra": {"partial": False, "groups": [{"adapter": "math", "group_index": 0}],
                      "episodes": [{"key": json.dumps([a, SLOTS[a], "rollout", 0, i], separators=(",", ":")),
                                    "attempt": 0, "segments": n} for i, (a, n) in enumerate(episodes)]}}


def letter(stage: str, kind: str, reason: str, adapter: str | None = "math") -> DeadLetter:
    key = json.dumps([adapter, 0, "rollout", 0, 1]).encode() if adapter else b"not-a-key"
    return DeadLetter(key, b"v", [], reason, stage, kind, f"t.rollout.turns:0:{len(reason)}")


# ---------------------------------------------------------------------------- folding


def test_partials_of_one_window_merge_exactly_across_partitions():
    a = [episode("math", 1, 10, 1.0), episode("math", 2, 30, 0.0)]
    b = [episode("math", 3, 50, 1.0)]
    points = fold_windows([window_doc(0, "math", 0, a), window_doc(0, "math", 1, b)])
    assert len(points) == 1
    point = points[0]
    assert (point.episodes, point.mean, point.median, point.low, point.high) == (3, 30.0, 30.0, 10.0, 50.0)
    assert math.isclose(point.reward, 2 / 3)


def test_the_last_record_of_a_partial_replaces_earlier_ones():
    early = window_doc(0, "math", 0, [episode("math", 1, 10, 1.0)])
    late = window_doc(0, "math", 0, [episode("math", 1, 10, 1.0), episode("math", 2, 20, 0.0)], closed=True)
    (point,) = fold_windows([early, late])
    assert point.episodes == 2 and point.closed and point.high == 20.0


def test_a_window_is_open_while_any_partial_is_open():
    docs = [window_doc(0, "math", 0, [episode("math", 1, 10, 1.0)], closed=True),
            window_doc(0, "math", 1, [episode("math", 2, 10, 1.0)], closed=False)]
    assert not fold_windows(docs)[0].closed


def test_windows_are_ordered_by_start_then_adapter_and_skip_other_records():
    docs = [window_doc(5000, "math", 0, [episode("math", 1, 10, 1.0)]),
            json.loads(batch_metrics_record(0, {"x": 1.0}, samples=4, manifest_path="/m.json")),
            window_doc(0, "math", 0, [episode("math", 2, 10, 1.0)]),
            window_doc(0, "code", 0, [episode("code", 3, 10, 1.0)]),
            {"kind": "window", "window": "garbage"}]
    assert [(p.start_ms, p.adapter) for p in fold_windows(docs)] == [(0, "code"), (0, "math"), (5000, "math")]


def test_a_lone_partial_without_stats_is_read_from_its_metrics():
    (point,) = fold_windows([window_doc(0, None, 0, [episode(None, 1, 12, 0.5)], with_stats=False)])
    assert (point.adapter, point.episodes, point.mean, point.reward) == (None, 1, 12.0, 0.5)


def test_batches_count_samples_per_adapter_and_disk_manifests_win():
    topic = [manifest(1, [("math", 2), ("code", 1)], response_tokens=50)]
    disk = [manifest(1, [("math", 2), ("code", 1)], response_tokens=70)]
    metrics_only = [json.loads(batch_metrics_record(2, {}, samples=8, manifest_path="/b2/manifest.json"))]
    rows = fold_batches(topic, disk, metrics_only)
    assert [(r.seq, r.origin) for r in rows] == [(1, "disk"), (2, "metrics")]
    assert rows[0].samples_by_adapter == {"math": 2, "code": 1} and rows[0].response_tokens == 70
    assert rows[1].samples == 8 and rows[1].response_tokens is None


def test_dead_letters_count_by_stage_and_kind_with_examples_of_distinct_patterns():
    letters = [letter("shards", "mask-check", f"batch 0 failed; episode [\"math\",0,{i}] at {i}") for i in range(5)]
    letters += [letter("stream", "decode", "bad header"), letter("stream", "decode", "truncated payload")]
    groups = fold_dead_letters(letters)
    assert [(g.stage, g.kind, g.count) for g in groups] == [("shards", "mask-check", 5), ("stream", "decode", 2)]
    assert len(groups[0].examples) == 1 and groups[1].examples == ("bad header", "truncated payload")


def test_the_adapter_filter_keeps_chosen_adapters_and_dead_letters_naming_none():
    run = RawRun(metrics=[window_doc(0, "math", 0, [episode("math", 1, 10, 1.0)]),
                          window_doc(0, "code", 0, [episode("code", 2, 10, 1.0)])],
                 announcements=[manifest(1, [("math", 2), ("code", 1)]), manifest(2, [("code", 4)])],
                 dead_letters=[letter("stream", "merge", "x", "code"), letter("stream", "key", "y", None)])
    report = build_report(run, Topics(prefix="r."), adapters=["math"])
    assert {w.adapter for w in report.windows} == {"math"}
    assert [(b.seq, dict(b.samples_by_adapter)) for b in report.batches] == [(1, {"math": 2})]
    assert [g.kind for g in report.dlq] == ["key"]
    assert report.color_order == ("code", "math")  # a filter keeps each adapter's colour


def test_an_adapter_keeps_its_colour_when_others_are_filtered_out():
    run = RawRun(metrics=[window_doc(0, "code", 0, [episode("code", 1, 10, 1.0)]),
                          window_doc(0, "math", 0, [episode("math", 2, 10, 1.0)])])

    def math_line(page: str) -> str:
        return re.search(r'<path class="line" d="[^"]*" fill="none" stroke="(#[0-9A-F]+)"', page).group(1)
    everything = render_html(build_report(run, Topics(prefix="r."), adapters=["code", "math"]))
    only_math = render_html(build_report(run, Topics(prefix="r."), adapters=["math"]))
    assert math_line(only_math) == re.findall(r'class="line" d="[^"]*" fill="none" stroke="(#[0-9A-F]+)"',
                                              everything)[1]


# ---------------------------------------------------------------------------- charts


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def tags(root: ET.Element, name: str, css: str | None = None) -> list[ET.Element]:
    found = [e for e in root.iter() if e.tag.endswith("}" + name)]
    return [e for e in found if css is None or e.get("class") == css]


def test_a_line_chart_draws_one_line_per_series_and_a_band_where_asked():
    series = [Series("math", "#111", [0, 1, 2], [1, 2, 3], low=[0, 1, 2], high=[2, 3, 4], mid=[1, 2, 2]),
              Series("code", "#222", [0, 1, 2], [3, 2, 1])]
    root = parse(line_chart(series, title="T", x_label="window start (UTC)", y_label="tokens",
                            x_ticks=[(0, "a"), (2, "b")]))
    assert len(tags(root, "path", "line")) == 2
    assert len(tags(root, "polygon", "band")) == 1 and len(tags(root, "path", "median")) == 1
    assert len(tags(root, "circle", "point")) == 6
    texts = [e.text for e in tags(root, "text")]
    assert {"window start (UTC)", "tokens", "math", "code", "a", "b"} <= set(texts)


def test_a_band_of_a_single_window_still_has_width():
    root = parse(line_chart([Series("m", "#111", [5], [2], low=[1], high=[3])], title="T", x_label="x", y_label="y"))
    (band,) = tags(root, "polygon", "band")
    xs = {float(p.split(",")[0]) for p in band.get("points").split()}
    assert len(xs) == 2


def test_chart_text_is_escaped():
    svg = line_chart([Series("<b>&", "#111", [0, 1], [1, 2], tips=["a<b", "c&d"])], title="x < y & z",
                     x_label="<x>", y_label="y")
    root = parse(svg)  # would raise on unescaped markup
    assert "<b>&" in [e.text for e in tags(root, "text")] and "<b>" not in svg
    assert "x < y & z" in [e.text for e in tags(root, "title")]


def test_a_bar_chart_draws_one_rect_per_stacked_part_with_a_legend_per_group():
    bars = [Bar("0", [("math", "#111", 2.0), ("code", "#222", 3.0)]), Bar("1", [("code", "#222", 4.0)])]
    root = parse(bar_chart(bars, title="Samples", x_label="batch", y_label="samples"))
    rects = tags(root, "rect", "bar")
    assert len(rects) == 3
    heights = [float(r.get("height")) for r in rects]
    assert math.isclose(heights[0] + heights[1], heights[2] * 5 / 4, rel_tol=0.02)
    assert len([e for e in root.iter() if e.get("class") == "legend-entry"]) == 2


def test_empty_charts_say_no_data():
    assert "no data" in line_chart([], title="T", x_label="x", y_label="y")
    assert "no data" in bar_chart([], title="T", x_label="x", y_label="y")


def test_nice_ticks_cover_the_range_in_round_steps():
    ticks = nice_ticks(3.0, 247.0)
    assert ticks[0] <= 3.0 and ticks[-1] >= 247.0 and len(set(round(b - a, 6) for a, b in zip(ticks, ticks[1:]))) == 1
    assert time_ticks([0, 5000]) == [(0.0, "00:00:00"), (5000.0, "00:00:05")]
    assert len(time_ticks(list(range(0, 100_000, 1000)), most=8)) <= 8

