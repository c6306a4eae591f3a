"""The report page: self-contained (no scripts, no external resources), every section present, every value
escaped, and notes instead of charts for an empty run."""

from __future__ import annotations

import re

from rollout_bus.observe.report import RawRun, build_report
from rollout_bus.observe.report_html import render_html
from rollout_bus.wire.topics import Topics
from tests.unit.observe.test_report import episode, letter, manifest, window_doc


def test_the_page_is_self_contained_and_holds_every_section():
    run = RawRun(metrics=[window_doc(0, "math", 0, [episode("math", 1, 10, 1.0)]),
                          window_doc(5000, "code", 0, [episode("code", 2, 20, 0.0)])],
                 announcements=[manifest(1, [("math", 2)])],
                 dead_letters=[letter("stream", "decode", "bad <header> & more")],
                 counts={"r.rollout.turns": 7}, first_ms=1000, last_ms=61000)
    page = render_html(build_report(run, Topics(prefix="r."), title="Run <42>"))
    for heading in ("Episodes per window", "Batches", "Dead letters", "Episode response length per window",
                    "Mean episode reward per window", "Samples per batch", "Response tokens per batch"):
        assert heading in page
    assert "<title>Run &lt;42&gt;</title>" in page and "bad &lt;header&gt; &amp; more" in page
    assert not re.search(r"<script|<link|\bsrc=|@import|url\(", page)
    assert page.count("<svg") == 7  # overview, two per-adapter bands, reward, episodes, two batch charts
    assert "60 s" in page


def test_an_empty_run_renders_notes_instead_of_charts():
    page = render_html(build_report(RawRun(), Topics(prefix="r.")))
    assert "No window records on" in page and "No batch on" in page and "No dead letters on" in page
