"""``rollout-bus train`` and ``rollout-bus train-sim``, one command module: each one's flags reach its trainer's
options, its progress and summary lines are printed, the project's errors exit 1, ``--ranks`` is parsed, and
``python -m rollout_bus.cli.train_sim`` is still the stand-in's command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import rollout_bus.cli.train as cli
import rollout_bus.sim.trainer as sim
from rollout_bus.cli.main import app
from rollout_bus.cli.train import parse_ranks
from rollout_bus.consumers.feed.loop import TrainProgress, TrainResult
from rollout_bus.consumers.feed.training import CHECKPOINT_NAME
from rollout_bus.errors import FeedTimeoutError
from rollout_bus.sim.trainer import TrainSimOptions

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def no_cluster_wait(monkeypatch):
    """The commands' options and printing, not a cluster: the wait for one answers at once."""
    monkeypatch.setattr(cli, "wait_for_cluster", lambda conn, timeout_s: None)


def test_train_sim_command_flags_reach_the_options_and_errors_exit_1(monkeypatch, tmp_path):
    seen: list[TrainSimOptions] = []

    def fake_run(opts, on_progress=None):
        seen.append(opts)
        on_progress(TrainProgress(1, 0, 0.5))
        return TrainResult("train-sim", 1, 1, 0, 0.5, 0, opts.checkpoint_dir / CHECKPOINT_NAME)

    monkeypatch.setattr(sim, "run_train_sim", fake_run)
    args = ["train-sim", "--bootstrap-servers", "h:1", "--topic-prefix", "p.", "--ranks", "all", "--dp-size", "3",
            "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "5", "--seed", "4", "--lr", "0.5",
            "--timeout", "7", "--max-batches", "9", "--shards-root", str(tmp_path / "s")]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    o = seen[-1]
    assert (o.bootstrap_servers, o.topic_prefix, o.ranks, o.dp_size, o.checkpoint_every, o.seed, o.lr, o.timeout_s,
            o.max_batches, o.shards_root) == ("h:1", "p.", [0, 1, 2], 3, 5, 4, 0.5, 7.0, 9, tmp_path / "s")
    assert "final_loss=0.500000" in done.output

    def failing(opts, on_progress=None):
        raise FeedTimeoutError("rank 0: no batch 0 within 7s")

    monkeypatch.setattr(sim, "run_train_sim", failing)
    done = CliRunner().invoke(app, args[:-2])
    assert done.exit_code == 1 and "no batch 0" in done.output


def test_train_sim_defaults_are_the_stand_ins(monkeypatch):
    seen: list[TrainSimOptions] = []
    monkeypatch.setattr(sim, "run_train_sim", lambda opts, on_progress=None: seen.append(opts) or TrainResult(
        "train-sim", 0, 0, None, None, 0, opts.checkpoint_dir / CHECKPOINT_NAME))
    done = CliRunner().invoke(app, ["train-sim", "--bootstrap-servers", "h:1", "--dim", "8", "--vocab-size", "64",
                                    "--step-delay", "0.5", "--torch-threads", "0"])
    assert done.exit_code == 0, done.output
    o = seen[-1]
    assert (o.checkpoint_dir, o.checkpoint_every, o.lr, o.dim, o.vocab_size, o.step_delay_s, o.torch_threads,
            o.ranks, o.dp_size, o.timeout_s, o.max_batches) == (Path("train-sim"), 2, 1e-3, 8, 64, 0.5, 0, [0, 1], 2,
                                                                600.0, None)
    assert "train-sim: trained batches=0" in done.output and "weights version" not in done.output
    assert CliRunner().invoke(app, ["train-sim", "--temperature", "0.7"]).exit_code == 2  # the real trainer's flag


def test_train_command_flags_reach_the_learn_options_and_its_summary_tells_the_version(monkeypatch, tmp_path):
    import rollout_bus.learn.trainer as learn

    seen = []

    def fake_run(opts, on_progress=None):
        seen.append(opts)
        on_progress(TrainProgress(3, 2, 0.25, reward=0.75))
        return TrainResult("train", 3, 3, 2, 0.25, 0, opts.checkpoint_dir / CHECKPOINT_NAME, version=3)

    monkeypatch.setattr(learn, "run_learn", fake_run)
    args = ["train", "--bootstrap-servers", "h:1", "--topic-prefix", "p.", "--ranks", "1", "--dp-size", "2",
            "--checkpoint-dir", str(tmp_path), "--seed", "4", "--lr", "0.5", "--temperature", "0.7", "--timeout", "7",
            "--max-batches", "9", "--torch-threads", "2", "--device", "cpu"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    o = seen[-1]
    assert isinstance(o, learn.LearnOptions)
    assert (o.bootstrap_servers, o.topic_prefix, o.ranks, o.dp_size, o.checkpoint_dir, o.seed, o.lr, o.temperature,
            o.timeout_s, o.max_batches, o.torch_threads, o.device) == (
        "h:1", "p.", [1], 2, tmp_path, 4, 0.5, 0.7, 7.0, 9, 2, "cpu")
    assert "weights -> p.rollout.weights" in done.output
    assert "train: trained batches=3 (this run 3, resumed after 0) last_seq=2 final_loss=0.250000 weights version=3" \
        in done.output
    assert CliRunner().invoke(app, ["train", "--checkpoint-every", "2"]).exit_code == 2  # the stand-in's flag

    def failing(opts, on_progress=None):
        raise FeedTimeoutError("rank 1: no batch 0 within 7s")

    monkeypatch.setattr(learn, "run_learn", failing)
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 1 and "no batch 0" in done.output


def test_ranks_flag():
    assert parse_ranks("all", 3) == [0, 1, 2] and parse_ranks("1, 0", 2) == [1, 0]
    for bad in ("x", "2", "0,0", ""):
        with pytest.raises(Exception):
            parse_ranks(bad, 2)


def test_the_stand_in_still_runs_as_its_own_module():
    done = subprocess.run([sys.executable, "-m", "rollout_bus.cli.train_sim", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "--checkpoint-every" in done.stdout and "--step-delay" in done.stdout and "--temperature" not in done.stdout
