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


@pytest.fixture
def writers(monkeypatch):
    """``shards`` up to the writer: no cluster, the run's batching accepted, the writer's options recorded."""
    import rollout_bus.cli.shards as shards
    from rollout_bus.consumers.shard_writer.options import WriterStats

    made: list = []

    class FakeWriter:
        def __init__(self, client_kwargs, topics, options, on_progress=None) -> None:
            made.append(options)
            self.stats = WriterStats()

        def run(self):
            return self.stats

    monkeypatch.setattr(shards, "ShardWriter", FakeWriter)
    monkeypatch.setattr(shards, "wait_for_cluster", lambda conn, timeout: None)
    monkeypatch.setattr(shards, "check_run_batching", lambda conn, topics, ours: ours)
    return made


def test_shards_flags_and_environment_reach_the_writers_plain_options(writers, monkeypatch, tmp_path):
    from rollout_bus.consumers.shard_writer.options import WriterOptions
    from rollout_bus.wire.run_record import RunBatching

    monkeypatch.setenv("ROLLOUT_BUS_WRITTEN_MEMORY", "7")
    monkeypatch.setenv("ROLLOUT_BUS_MAX_RECORD_BYTES", str(8 << 20))
    done = runner.invoke(app, ["shards", "--bootstrap-servers", "127.0.0.1:1", "--topic-prefix", "p.", "--out",
                               str(tmp_path), "--dp-size", "3", "--groups-per-batch", "2", "--batching", "arrival",
                               "--group-id", "g", "--normalization", "none", "--exit-when-idle",
                               "--exit-on-end-of-run", "--max-batches", "5", "--max-staleness", "1"])
    assert done.exit_code == 0, done.output
    assert writers[-1] == WriterOptions(out_dir=tmp_path, dp_size=3, run_batching=RunBatching(2, "arrival", 1),
                                        group_id="p.g", normalization="none", exit_when_idle=True,
                                        exit_on_end_of_run=True, max_batches=5, max_record_bytes=8 << 20,
                                        written_memory=7)
    said = " ".join(done.output.split())  # rich wraps the line
    assert "(dp_size=3, groups_per_batch=2, batching=arrival, max_staleness=1)" in said


def test_every_writer_option_is_a_shard_setting_of_its_name_or_worked_out_by_the_cli():
    """``plain_values`` matches by name: an option renamed on one side only would silently keep its default."""
    import dataclasses

    from rollout_bus.config import ShardSettings
    from rollout_bus.consumers.shard_writer.options import WriterOptions

    worked_out = {"out_dir", "run_batching", "max_record_bytes"}  # from --out, the batching, KafkaSettings
    stage_only = {"idle_s"}
    fields = {f.name for f in dataclasses.fields(WriterOptions)}
    assert fields - worked_out - stage_only <= set(ShardSettings.model_fields), fields - set(ShardSettings.model_fields)


def test_generate_builds_the_producers_plain_options_from_its_settings(monkeypatch):
    import rollout_bus.producers.generator_run as generator_run
    from rollout_bus.producers.generator_run import GeneratorOptions
    from rollout_bus.producers.run import GenerateSummary
    from rollout_bus.wire.run_record import RunBatching

    runs: list = []
    monkeypatch.setattr(generator_run, "prepare_run", lambda conn, topics, options: runs.append(options))
    monkeypatch.setattr(generator_run, "run_generator",
                        lambda conn, topics, options, publish, **kw: (GenerateSummary(run_id="r"), 0.1))
    monkeypatch.setenv("ROLLOUT_BUS_POLICY_VERSION", "3")
    done = runner.invoke(app, ["generate", "--bootstrap-servers", "127.0.0.1:1", "--seed", "4", "--generators", "2",
                               "--generator-index", "1", "--max-staleness", "2", "--groups-per-batch", "8",
                               "--delivery-timeout", "300"])
    assert done.exit_code == 0, done.output
    assert runs == [GeneratorOptions(generator_id="g1of2-seed4", run_batching=RunBatching(8, "step", 2),
                                     follow_weights=False, policy_version=3, delivery_timeout_s=300,
                                     max_record_bytes=runs[0].max_record_bytes)]
    assert runs[0].follows


def test_generate_weights_wait_flag_and_setting_reach_its_settings_and_no_usable_weights_exits_66(generate_runs,
                                                                                                   monkeypatch):
    import rollout_bus.cli.generate as generate
    from rollout_bus.errors import EXIT_NO_USABLE_WEIGHTS, NoUsableWeights

    base = ["generate", "--bootstrap-servers", "127.0.0.1:1", "--engine", "policy"]
    assert runner.invoke(app, base).exit_code == 0 and generate_runs[-1][0].weights_wait_s == 120
    assert runner.invoke(app, [*base, "--weights-wait-s", "0"]).exit_code == 0
    assert generate_runs[-1][0].weights_wait_s == 0  # for ever
    monkeypatch.setenv("ROLLOUT_BUS_WEIGHTS_WAIT_S", "7.5")
    assert runner.invoke(app, base).exit_code == 0 and generate_runs[-1][0].weights_wait_s == 7.5
    assert runner.invoke(app, [*base, "--weights-wait-s", "-1"]).exit_code == 2

    def no_weights(settings, kafka, stop=None):
        raise NoUsableWeights("no usable weights after waiting 120s: version 3 at file:///w/[v3].st: missing")

    monkeypatch.setattr(generate, "_run", no_weights)
    done = runner.invoke(app, [*base, "--follow-weights"])
    assert done.exit_code == EXIT_NO_USABLE_WEIGHTS == 66, done.output
    assert "version 3 at file:///w/[v3].st: missing" in done.output and "Traceback" not in done.output
