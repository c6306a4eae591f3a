"""Flags reach the settings the stages get: stream's replication factor and record size, generate's run flags."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rollout_bus.cli.main import app

runner = CliRunner()


@pytest.fixture
def worker_calls(monkeypatch):
    import rollout_bus.streams.worker

    calls: list[dict] = []

    def fake_run_worker(**kwargs):
        calls.append(kwargs)
        return 0

    monkeypatch.setattr(rollout_bus.streams.worker, "run_worker", fake_run_worker)
    return calls


def test_stream_replication_factor_flag_and_max_record_bytes_reach_the_worker(worker_calls, monkeypatch):
    monkeypatch.setenv("ROLLOUT_BUS_MAX_RECORD_BYTES", str(8 << 20))
    done = runner.invoke(app, ["stream", "--bootstrap-servers", "127.0.0.1:1", "--replication-factor", "3"])
    assert done.exit_code == 0, done.output
    assert worker_calls[-1]["replication_factor"] == 3 and worker_calls[-1]["max_record_bytes"] == 8 << 20


def test_stream_replication_factor_falls_back_to_the_environment_then_one(worker_calls, monkeypatch):
    assert runner.invoke(app, ["stream", "--bootstrap-servers", "127.0.0.1:1"]).exit_code == 0
    monkeypatch.setenv("ROLLOUT_BUS_REPLICATION_FACTOR", "2")
    assert runner.invoke(app, ["stream", "--bootstrap-servers", "127.0.0.1:1"]).exit_code == 0
    assert [c["replication_factor"] for c in worker_calls] == [1, 2]
    assert runner.invoke(app, ["stream", "--replication-factor", "0"]).exit_code != 0


@pytest.fixture
def generate_runs(monkeypatch):
    import rollout_bus.cli.generate as generate
    from rollout_bus.producers.run import GenerateSummary

    runs: list = []

    def fake_run(settings, kafka):
        runs.append((settings, kafka))
        return GenerateSummary(run_id=settings.run_id or "fresh", end_of_run_partitions=4 * settings.end_of_run), 0.1

    monkeypatch.setattr(generate, "_run", fake_run)
    return runs


def test_generate_run_flags_reach_its_settings(generate_runs):
    done = runner.invoke(app, ["generate", "--bootstrap-servers", "127.0.0.1:1", "--run-id", "shared",
                               "--no-end-of-run", "--delivery-timeout", "300"])
    assert done.exit_code == 0, done.output
    settings, _ = generate_runs[-1]
    assert (settings.run_id, settings.end_of_run, settings.delivery_timeout_s) == ("shared", False, 300)
    assert "run shared: left open" in done.output
    assert runner.invoke(app, ["generate", "--bootstrap-servers", "127.0.0.1:1"]).exit_code == 0
    settings, _ = generate_runs[-1]
    assert (settings.run_id, settings.end_of_run, settings.delivery_timeout_s) == ("", True, 900)


def test_end_run_needs_a_run_id():
    done = runner.invoke(app, ["end-run", "--bootstrap-servers", "127.0.0.1:1"])
    assert done.exit_code != 0 and "--run-id" in done.output


def test_generate_engine_flag_reaches_its_settings_and_a_wrong_one_is_refused(generate_runs):
    done = runner.invoke(app, ["generate", "--bootstrap-servers", "127.0.0.1:1", "--engine", "policy"])
    assert done.exit_code == 0, done.output
    assert generate_runs[-1][0].engine == "policy"
    assert runner.invoke(app, ["generate", "--bootstrap-servers", "127.0.0.1:1"]).exit_code == 0
    assert generate_runs[-1][0].engine == "sim"
    refused = runner.invoke(app, ["generate", "--bootstrap-servers", "127.0.0.1:1", "--engine", "vllm"])
    assert refused.exit_code != 0 and "engine" in refused.output


def test_report_refuses_a_train_directory_without_trained_jsonl_before_reading_any_topic(tmp_path):
    done = runner.invoke(app, ["report", "--bootstrap-servers", "127.0.0.1:1", "--train", str(tmp_path),
                               "--out", str(tmp_path / "r.html")])
    assert done.exit_code == 2 and "trained.jsonl" in done.output
