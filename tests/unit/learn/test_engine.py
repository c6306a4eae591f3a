"""PolicyEngine: seeded generation from the live weights, new weights taken between decode steps, and a
checkpoint that cannot be verified refused for good.

Proven here, with real checkpoints on disk (no broker: ``live`` is a plain callable returning the
``WeightVersion`` records rollout.weights would carry): generation is a function of the seed and the
generator; a row stops after ``$``; every token carries the version of the weights that produced it, and
when the live record changes between decode steps the per-token versions change exactly there and the
tokens (and log-probs) after the change are the ones the new weights give; a version 0 checkpoint
replaces the seed-built weights; an older version is ignored; a checkpoint whose sha256 does not match
(a wrong digest, or bytes altered after saving) is refused: the engine keeps its version and weights, an
ERROR line names the version and file, ``refused`` holds it, and it is read only once.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest
import torch

import rollout_bus.learn.engine as engine_module
from rollout_bus.learn.engine import PolicyEngine, TurnOutput
from rollout_bus.learn.task import CalculatorTask
from rollout_bus.policy.checkpoint import CheckpointRef, save_checkpoint
from rollout_bus.policy.model import build_policy, last_logits
from rollout_bus.policy.sampler import Sampler
from rollout_bus.policy.vocab import EOS, VOCAB
from rollout_bus.wire.weight_version import WeightVersion

SEED = 3
STEPS = 6
TASK = CalculatorTask(SEED)
CONTEXTS = [TASK.prompt_tokens(TASK.problem(g)) for g in range(12)]
SAMPLER = Sampler(1.0, 1.0, -1)


def _perturbed(seed: int = SEED, scale: float = 0.7, noise_seed: int = 99):
    model = build_policy(seed)
    noise = torch.Generator().manual_seed(noise_seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=noise) * scale)
    return model


def _record(ref: CheckpointRef, sha256: str | None = None) -> WeightVersion:
    return WeightVersion(ref.version, ref.step, 1_700_000_000_000 + ref.version, f"file://{ref.path}",
                         sha256 or ref.sha256, ref.bytes)


class Live:
    """A stand-in for rollout.weights: the ``n``-th call returns ``schedule(n)``; calls are counted."""

    def __init__(self, schedule):
        self.schedule, self.calls = schedule, 0

    def __call__(self) -> WeightVersion | None:
        found = self.schedule(self.calls)
        self.calls += 1
        return found


def _engine(live=None, version: int = 0) -> PolicyEngine:
    return PolicyEngine(SEED, SAMPLER, live=live, version=version, device="cpu")


def _generate(engine: PolicyEngine, seed: int = 0, steps: int = STEPS) -> list[TurnOutput]:
    return engine.generate(CONTEXTS, torch.Generator().manual_seed(seed), max_tokens=steps)


def _reference(models_by_step, seed: int = 0, steps: int = STEPS) -> list[list[int]]:
    """The tokens by hand: step s draws from ``models_by_step[s]`` with one shared seeded generator."""
    generator, outs = torch.Generator().manual_seed(seed), [[] for _ in CONTEXTS]
    for step in range(steps):
        active = [i for i, out in enumerate(outs) if not (out and out[-1] == VOCAB.id(EOS))]
        if not active:
            break
        rows = [np.concatenate([CONTEXTS[i], np.asarray(outs[i], np.int64)]) for i in active]
        with torch.no_grad():
            draw = SAMPLER.draw(last_logits(models_by_step[step], rows), generator)
        for j, i in enumerate(active):
            outs[i].append(int(draw.tokens[j]))
    return outs


def _full_log_probs(outs: list[TurnOutput], model_of) -> list[list[float]]:
    """Each sampled token's full-vocabulary log-prob recomputed by ``model_of(version)``, one forward per model."""
    found = [[0.0] * len(o.tokens) for o in outs]
    for version in {v for o in outs for v in o.versions}:
        at = [(i, t) for i, o in enumerate(outs) for t, v in enumerate(o.versions) if v == version]
        rows = [np.concatenate([CONTEXTS[i], np.asarray(outs[i].tokens[:t], np.int64)]) for i, t in at]
        with torch.no_grad():
            log_probs = last_logits(model_of(version), rows).double().log_softmax(-1)
        for row, (i, t) in enumerate(at):
            found[i][t] = float(log_probs[row, outs[i].tokens[t]])
    return found


@pytest.fixture()
def checkpoints(tmp_path) -> dict[int, CheckpointRef]:
    """Version 0: the seed's own weights; version 1: perturbed ones; version 2: perturbed differently."""
    return {0: save_checkpoint(build_policy(SEED), tmp_path, version=0, step=0),
            1: save_checkpoint(_perturbed(), tmp_path, version=1, step=4),
            2: save_checkpoint(_perturbed(noise_seed=5), tmp_path, version=2, step=9)}


# ---------------------------------------------------------------------------- without live weights


def test_generation_is_fixed_by_the_engine_seed_and_the_generator_seed():
    first, again, other = _generate(_engine()), _generate(_engine()), _generate(_engine(), seed=1)
    assert [o.tokens for o in first] == [o.tokens for o in again]
    assert [o.log_probs for o in first] == [o.log_probs for o in again]
    assert [o.full_log_probs for o in first] == [o.full_log_probs for o in again]
    assert all([s.tolist() for s in a.supports] == [s.tolist() for s in b.supports] for a, b in zip(first, again))
    assert [o.tokens for o in first] != [o.tokens for o in other]
    assert [o.tokens for o in first] == _reference([build_policy(SEED)] * STEPS)


def test_a_row_stops_after_the_end_token_and_the_others_go_on():
    outs = _generate(_engine(), steps=10)
    stop = VOCAB.id(EOS)
    for out in outs:
        n = len(out.tokens)
        assert n == len(out.log_probs) == len(out.full_log_probs) == len(out.supports) == len(out.versions)
        assert stop not in out.tokens[:-1], "a token was sampled after the end token"
        assert out.done is (n > 0 and out.tokens[-1] == stop)
        assert out.done or n == 10
    assert any(o.done and len(o.tokens) < 10 for o in outs), "no row ended early: the check above proved nothing"
    assert any(not o.done for o in outs)


def test_every_token_carries_the_engines_version_and_the_log_prob_of_its_weights():
    engine = _engine(version=4)
    outs = _generate(engine)
    model = build_policy(SEED)
    expected = _full_log_probs(outs, lambda version: model)
    for out, recomputed in zip(outs, expected):
        assert out.versions == [4] * len(out.tokens)
        assert out.full_log_probs == pytest.approx(recomputed, abs=1e-5)
        assert out.log_probs == pytest.approx(out.full_log_probs, abs=1e-6)  # no warper: the whole vocabulary
        assert all(token in support.tolist() for token, support in zip(out.tokens, out.supports))
    assert engine.version == 4 and engine.loads == 0 and engine.refused == {}


# ---------------------------------------------------------------------------- new weights between decode steps


@pytest.mark.parametrize("switch", [1, 3])
def test_new_weights_are_taken_between_decode_steps_and_versions_change_exactly_there(checkpoints, switch):
    live = Live(lambda n: _record(checkpoints[0] if n < switch else checkpoints[1]))
    engine = _engine(live)
    outs = _generate(engine)
    steps = max(len(o.tokens) for o in outs)
    assert steps > switch, "every row ended before the new version: nothing was tested"
    assert live.calls == steps  # one look at rollout.weights per decode step
    assert engine.version == 1 and engine.loads == 2 and engine.refused == {}
    for out in outs:
        assert out.versions == [0 if t < switch else 1 for t in range(len(out.tokens))]
    old, new = build_policy(SEED), _perturbed()
    assert [o.tokens for o in outs] == _reference([old] * switch + [new] * (STEPS - switch))
    expected = _full_log_probs(outs, lambda version: new if version == 1 else old)
    for out, recomputed in zip(outs, expected):  # each log-prob is the one of the weights its version names
        assert out.full_log_probs == pytest.approx(recomputed, abs=1e-5)
    # the new weights mattered: the old ones alone draw other tokens from the same generator stream
    assert [o.tokens for o in outs] != [o.tokens for o in _generate(_engine())]


def test_a_version_zero_checkpoint_replaces_the_seed_built_weights(tmp_path):
    ref = save_checkpoint(_perturbed(), tmp_path, version=0, step=0)
    live = Live(lambda n: _record(ref))
    engine = _engine(live)
    outs = _generate(engine)
    assert engine.loads == 1 and engine.version == 0
    assert all(o.versions == [0] * len(o.tokens) for o in outs)
    assert [o.tokens for o in outs] == _reference([_perturbed()] * STEPS)
    assert [o.tokens for o in outs] != [o.tokens for o in _generate(_engine())]


def test_an_older_version_and_a_record_without_a_checkpoint_are_ignored(checkpoints, monkeypatch):
    reads = []
    monkeypatch.setattr(engine_module, "read_checkpoint",
                        lambda *a, **k: reads.append(a) or pytest.fail("nothing should be read"))
    older = _engine(Live(lambda n: _record(checkpoints[1])), version=2)
    assert [o.versions for o in _generate(older)] == [[2] * len(o.tokens) for o in _generate(_engine(version=2))]
    stamp = _engine(Live(lambda n: WeightVersion(5, 5, 0)))  # a stand-in trainer's stamp: no weights to load
    assert all(set(o.versions) == {0} for o in _generate(stamp))
    assert reads == [] and older.loads == 0 and stamp.loads == 0 and older.version == 2 and stamp.version == 0


# ---------------------------------------------------------------------------- refusing what cannot be verified


def _counting_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    real = engine_module.read_checkpoint

    def read(path, *args, **kwargs):
        reads.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(engine_module, "read_checkpoint", read)
    return reads


def _assert_refused_once(engine, live, outs, reads, caplog, record: WeightVersion):
    assert engine.version == 0 and engine.loads == 0
    assert list(engine.refused) == [(1, record.sha256)]
    assert record.path in engine.refused[(1, record.sha256)]
    assert live.calls == max(len(o.tokens) for o in outs) > 1  # asked every step ...
    assert reads == [record.path]  # ... but read once: never retried
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == engine_module.__name__]
    assert len(errors) == 1
    assert f"weights version 1 at {record.uri}: sha256 mismatch (" in errors[0].getMessage()
    assert errors[0].getMessage().endswith(", refused; no published weights loaded yet: none to generate from")
    assert all(o.versions == [0] * len(o.tokens) for o in outs)
    assert [o.tokens for o in outs] == [o.tokens for o in _generate(_engine())]  # the weights it had


def test_a_checkpoint_whose_sha256_does_not_match_is_refused_and_never_retried(checkpoints, monkeypatch, caplog):
    record = _record(checkpoints[1], sha256=hashlib.sha256(b"not these weights").hexdigest())
    live = Live(lambda n: record)
    reads = _counting_reads(monkeypatch)
    engine = _engine(live)
    with caplog.at_level(logging.INFO, logger=engine_module.__name__):
        outs = _generate(engine)
    _assert_refused_once(engine, live, outs, reads, caplog, record)


def test_a_checkpoint_altered_after_saving_is_refused_and_never_retried(checkpoints, monkeypatch, caplog):
    record = _record(checkpoints[1])
    data = bytearray(checkpoints[1].path.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit of one weight, after the digest was published
    checkpoints[1].path.write_bytes(bytes(data))
    live = Live(lambda n: record)
    reads = _counting_reads(monkeypatch)
    engine = _engine(live)
    with caplog.at_level(logging.INFO, logger=engine_module.__name__):
        outs = _generate(engine)
    _assert_refused_once(engine, live, outs, reads, caplog, record)


def test_after_a_refusal_the_next_good_version_is_loaded(checkpoints, monkeypatch):
    bad = _record(checkpoints[1], sha256=hashlib.sha256(b"torn copy").hexdigest())
    live = Live(lambda n: bad if n < 2 else _record(checkpoints[2]))
    reads = _counting_reads(monkeypatch)
    engine = _engine(live)
    outs = _generate(engine)
    assert engine.version == 2 and engine.loads == 1 and list(engine.refused) == [(1, bad.sha256)]
    assert reads == [bad.path, str(checkpoints[2].path)]
    for out in outs:
        assert out.versions == [0 if t < 2 else 2 for t in range(len(out.tokens))]
    assert [o.tokens for o in outs] == _reference([build_policy(SEED)] * 2 + [_perturbed(noise_seed=5)] * (STEPS - 2))


def test_a_missing_checkpoint_is_refused_as_missing_naming_its_uri_and_never_retried(checkpoints, monkeypatch,
                                                                                     caplog):
    record = _record(checkpoints[1])
    checkpoints[1].path.unlink()  # deleted after it was published
    live = Live(lambda n: record)
    reads = _counting_reads(monkeypatch)
    engine = _engine(live)
    with caplog.at_level(logging.INFO, logger=engine_module.__name__):
        outs = _generate(engine)
    assert engine.refused == {(1, record.sha256): f"version 1 at {record.uri}: missing"}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"weights version 1 at {record.uri}: missing, refused; no published weights loaded yet: "
                      "none to generate from"]
    assert reads == [record.path] and engine.version == 0 and engine.loads == 0
    assert all(o.versions == [0] * len(o.tokens) for o in outs)


def test_a_refused_newer_version_is_said_once_naming_the_version_still_used(checkpoints, monkeypatch, caplog):
    good = _record(checkpoints[1])
    bad = _record(checkpoints[2], sha256=hashlib.sha256(b"a torn copy").hexdigest())
    live = Live(lambda n: good if n < 2 else bad)
    engine = _engine(live)
    with caplog.at_level(logging.INFO, logger=engine_module.__name__):
        outs = _generate(engine)
        outs += _generate(engine)  # asked again for every decode step of a second call: still said once
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"weights version 2 at {bad.uri}: sha256 mismatch (")
    assert errors[0].endswith(", refused; still using version 1")
    assert engine.version == 1 and engine.loads == 1 and engine.using() == "still using version 1"
    assert {v for o in outs for v in o.versions} == {1}
