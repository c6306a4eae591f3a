"""The policy generator: calculator episodes sampled by a real ``PolicyEngine``, turn by turn, with every
token's log-prob, support, version and full-vocabulary log-prob, and turns cut where the weights changed.

Proven here, on the CPU, with real checkpoints on disk and no broker (``live`` is a plain callable
returning the ``WeightVersion`` records rollout.weights would carry):

* the same settings give the same turns (tokens, log-probs, masks, versions, metadata, publish
  arguments) on two fresh engines, and another seed gives other turns;
* per episode the turn numbers are 0, 1, ... with no gap, exactly its last turn is final, and every
  turn carries its group's size (the last, smaller group included);
* every episode merges (``merge_samples``) into one segment equal to the engine's own outputs put
  together (prompt, first turn, the forced ``=d`` observation, second turn): tokens, rollout log-probs
  (0.0 at the observation), loss mask (0 at the observation), supports (singletons at the
  observation), token versions (-1 at the observation); its reward is 1.0 exactly when it called the
  tool and answered right (recomputed with ``CalculatorTask``); ``metadata["full_vocab_log_probs"]``
  has one entry per response token, None exactly at the observation, each at most the token's
  support log-prob (and below it where top-p cut mass);
* new weights that go live between the two decode steps of a round cut every two-token turn of that
  round into an ABORTED piece (version 0, ``weight_versions`` ['0'], not final, its full-vocabulary
  log-probs cut where it ends) and its continuation (version 1); the turn counter moves on by one per
  piece; per token the versions are exactly the ones the engine reported; and merging an episode's
  pieces still gives the engine's outputs exactly;
* ``publish_policy_turns`` refuses ``inject_faults`` before it touches the publisher or the watcher;
* ``wait_for_first_weights`` returns the version once a verified checkpoint is live (not before,
  and not for one that fails verification), logs what it waits for, and raises ``Stopped`` when
  asked to stop.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict

import numpy as np
import pytest
import torch

import rollout_bus.learn.generator as generator_module
from rollout_bus.config import GenerateSettings
from rollout_bus.errors import ConfigError, Stopped
from rollout_bus.learn.engine import PolicyEngine, TurnOutput
from rollout_bus.learn.generator import (FULL_LOG_PROBS, iter_policy_turns, publish_policy_turns,
                                         wait_for_first_weights)
from rollout_bus.learn.task import TURN_TOKENS, CalculatorTask, Problem
from rollout_bus.model.sample import Sample, Status
from rollout_bus.model.turns import merge_samples
from rollout_bus.policy.checkpoint import CheckpointRef, save_checkpoint
from rollout_bus.policy.model import build_policy
from rollout_bus.policy.sampler import Sampler
from rollout_bus.producers.groups import plan_groups
from rollout_bus.wire.weight_version import WeightVersion

# seed 28, 30 episodes in groups of 4 (the last one of 2): five episodes call the tool, two of them
# answer right, and six first turns stop after one token; the coverage checks below say so if not
SEED, EPISODES, PER_PROMPT = 28, 30, 4
TASK = CalculatorTask(SEED)


def _settings(**more) -> GenerateSettings:
    return GenerateSettings(**{"episodes": EPISODES, "n_samples_per_prompt": PER_PROMPT, "top_p": 0.9, "top_k": 20,
                               "seed": SEED, **more})


class RecordingEngine(PolicyEngine):
    """A ``PolicyEngine`` that counts its ``refresh`` calls and keeps every ``generate`` call:
    ``(refresh calls before it, contexts, outputs)``."""

    def __init__(self, settings: GenerateSettings, live=None) -> None:
        super().__init__(settings.seed, Sampler(settings.temperature, settings.top_p, settings.top_k), live=live,
                         version=settings.policy_version, device="cpu")
        self.refreshes = 0
        self.calls: list[tuple[int, list[np.ndarray], list[TurnOutput]]] = []

    def refresh(self) -> int:
        self.refreshes += 1
        return super().refresh()

    def generate(self, contexts, generator, max_tokens=TURN_TOKENS):
        before = self.refreshes
        outs = super().generate(contexts, generator, max_tokens)
        self.calls.append((before, [np.array(c) for c in contexts], outs))
        return outs


class Live:
    """A stand-in for rollout.weights: the ``n``-th call returns ``schedule(n)``."""

    def __init__(self, schedule) -> None:
        self.schedule, self.calls = schedule, 0

    def __call__(self) -> WeightVersion | None:
        found = self.schedule(self.calls)
        self.calls += 1
        return found


def _record(ref: CheckpointRef, sha256: str | None = None) -> WeightVersion:
    return WeightVersion(ref.version, ref.step, 1_700_000_000_000 + ref.version, f"file://{ref.path}",
                         sha256 or ref.sha256, ref.bytes)


def _perturbed(seed: int = SEED, scale: float = 0.7):
    model = build_policy(seed)
    noise = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=noise) * scale)
    return model


def _run(settings: GenerateSettings, live=None) -> tuple[RecordingEngine, list[tuple[Sample, dict]]]:
    engine = RecordingEngine(settings, live)
    return engine, list(iter_policy_turns(settings, engine))


def _by_episode(turns) -> dict[int, list[tuple[Sample, dict]]]:
    episodes: dict[int, list[tuple[Sample, dict]]] = defaultdict(list)
    for sample, args in turns:
        episodes[sample.index].append((sample, args))
    return dict(episodes)


def _engine_outputs(engine: RecordingEngine, settings: GenerateSettings) -> dict[int, list[TurnOutput]]:
    """Each episode's engine outputs, its first turn then (when it called the tool) its second: a group's
    round 0 is one ``generate`` over its episodes from the prompt, its round 1 one over those that called."""
    calls = iter(engine.calls)
    found: dict[int, list[TurnOutput]] = {}
    for group in plan_groups(**settings.group_plan()):
        prompt = TASK.prompt_tokens(TASK.problem(group.group_index))
        _, contexts, outs = next(calls)
        assert len(contexts) == group.size and all(np.array_equal(c, prompt) for c in contexts)
        episodes = [group.first_index + j for j in range(group.size)]
        for episode, out in zip(episodes, outs):
            found[episode] = [out]
        called = [e for e, out in zip(episodes, outs) if TASK.calls_tool(out.tokens)]
        if called:
            _, contexts, outs = next(calls)
            assert len(contexts) == len(called)
            for episode, out in zip(called, outs):
                found[episode].append(out)
    assert next(calls, None) is None, "the engine was asked for more than the episodes' turns"
    return found


def _assert_merges_to_the_engine_outputs(turns, outputs: dict[int, list[TurnOutput]], settings) -> None:
    """Every episode is one segment equal to its engine outputs put together (see the module docstring)."""
    groups = {g.group_index: g for g in plan_groups(**settings.group_plan())}
    episodes = _by_episode(turns)
    assert sorted(episodes) == list(range(settings.episodes))
    for index, pieces in episodes.items():
        segments = merge_samples([sample for sample, _ in pieces])
        assert len(segments) == 1, f"episode {index} merged into {len(segments)} segments"
        merged, outs = segments[0], outputs[index]
        problem = TASK.problem(merged.group_index)
        assert index - groups[merged.group_index].first_index in range(groups[merged.group_index].size)
        observation = TASK.observation_tokens(problem)
        called = TASK.calls_tool(outs[0].tokens)
        assert len(outs) == (2 if called else 1)
        first = np.asarray(outs[0].tokens, np.int64)
        second = np.asarray(outs[1].tokens, np.int64) if called else np.zeros(0, np.int64)
        gap = observation.size if called else 0
        tokens = np.concatenate([TASK.prompt_tokens(problem), first, observation[:gap], second])
        np.testing.assert_array_equal(np.asarray(merged.tokens), tokens)
        assert merged.response_length == first.size + gap + second.size
        log_probs = [*outs[0].log_probs, *[0.0] * gap, *(outs[1].log_probs if called else [])]
        np.testing.assert_array_equal(np.asarray(merged.rollout_log_probs), np.asarray(log_probs, np.float64))
        mask = [1] * first.size + [0] * gap + [1] * second.size
        assert np.asarray(merged.loss_mask).tolist() == mask
        versions = [*outs[0].versions, *[-1] * gap, *(outs[1].versions if called else [])]
        assert np.asarray(merged.rollout_token_versions).tolist() == versions
        supports = [*outs[0].supports, *[[t] for t in observation[:gap]], *(outs[1].supports if called else [])]
        merged_mask = merged.rollout_sampling_mask
        assert len(merged_mask) == merged.response_length
        for t, support in enumerate(supports):
            assert merged_mask.row(t).tolist() == np.asarray(support).tolist(), (index, t)
        for t in range(first.size, first.size + gap):  # the forced observation: a singleton holding the token
            assert merged_mask.row(t).tolist() == [int(tokens[-merged.response_length + t])]
        full = merged.metadata[FULL_LOG_PROBS]
        assert len(full) == merged.response_length
        assert [t for t, value in enumerate(full) if value is None] == list(range(first.size, first.size + gap))
        assert [v for v in full if v is not None] == [*outs[0].full_log_probs,
                                                      *(outs[1].full_log_probs if called else [])]
        for value, rollout in zip(full, log_probs):
            if value is not None:  # a support's normaliser is at most the whole vocabulary's
                assert value <= rollout + 1e-6
        right = TASK.reward(problem, called, outs[-1].tokens)
        assert merged.reward == right == (1.0 if called and int(outs[-1].tokens[0]) == int(observation[1]) else 0.0)
        assert merged.status is Status.COMPLETED and merged.label == str(problem.answer)


@pytest.fixture(scope="module")
def plain():
    settings = _settings()
    engine, turns = _run(settings)
    return settings, engine, turns


# ---------------------------------------------------------------------------- without new weights


def test_the_same_settings_give_the_same_turns_and_another_seed_other_turns(plain):
    settings, _, turns = plain
    _, again = _run(settings)
    assert len(turns) == len(again) > settings.episodes  # some episode had a second turn
    for (sample, args), (other, other_args) in zip(turns, again):
        assert sample == other and args == other_args  # tokens, log-probs, masks, versions, metadata
        assert np.asarray(sample.rollout_log_probs).tolist() == np.asarray(other.rollout_log_probs).tolist()
        assert sample.rollout_sampling_mask == other.rollout_sampling_mask
    _, elsewhere = _run(_settings(seed=SEED + 1))
    assert [s.tokens.tolist() for s, _ in turns] != [s.tokens.tolist() for s, _ in elsewhere]


def test_turn_numbers_are_contiguous_the_last_turn_alone_is_final_and_the_group_size_is_the_groups(plain):
    settings, _, turns = plain
    sizes = {g.group_index: g.size for g in plan_groups(**settings.group_plan())}
    assert sorted(set(sizes.values())) == [2, 4]  # the last group is smaller
    for index, pieces in _by_episode(turns).items():
        args = [a for _, a in pieces]
        assert [a["turn"] for a in args] == list(range(len(args)))
        assert [a["final"] for a in args] == [False] * (len(args) - 1) + [True]
        assert all(a["attempt"] == 0 for a in args)
        assert {a["group_size"] for a in args} == {sizes[pieces[0][0].group_index]}
        assert len(args) <= 2  # without new weights no turn is cut
    assert all(sample.status is Status.COMPLETED for sample, _ in turns)
    assert all(set(np.asarray(s.rollout_token_versions).tolist()) == {0} and s.weight_versions == ["0"]
               for s, _ in turns)


def test_every_episode_merges_into_the_engines_outputs_with_a_verified_reward(plain):
    settings, engine, turns = plain
    outputs = _engine_outputs(engine, settings)
    _assert_merges_to_the_engine_outputs(turns, outputs, settings)
    called = [i for i, outs in outputs.items() if len(outs) == 2]
    rewarded = [i for i, outs in outputs.items() if TASK.reward(TASK.problem(i // PER_PROMPT), len(outs) == 2,
                                                                outs[-1].tokens) == 1.0]
    assert len(called) >= 3 and 1 <= len(rewarded) < len(called), "the seed no longer covers right and wrong answers"
    assert any(len(outs[0].tokens) == 1 for outs in outputs.values()), "no first turn stopped after '$'"
    # the top-p cut mattered somewhere: a support log-prob above its full-vocabulary one
    assert any(lp > full + 1e-4 for outs in outputs.values() for out in outs
               for lp, full in zip(out.log_probs, out.full_log_probs))
    # a final turn's reward is the episode's; an episode that did not call the tool scores 0.0 on its only turn
    for index, pieces in _by_episode(turns).items():
        assert all(sample.reward is None for sample, _ in pieces[:-1])
        assert pieces[-1][0].reward in (0.0, 1.0)


# ---------------------------------------------------------------------------- new weights mid-turn


@pytest.fixture()
def checkpoints(tmp_path) -> dict[int, CheckpointRef]:
    """Version 0: the seed's own weights (what the trainer publishes first); version 1: other weights."""
    return {0: save_checkpoint(build_policy(SEED), tmp_path, version=0, step=0),
            1: save_checkpoint(_perturbed(), tmp_path, version=1, step=1)}


def _switch_point(settings, checkpoints) -> tuple[int, int]:
    """(call index, refresh count) of the round 0 ``generate`` of the first group with an episode that calls
    the tool, counted on a run whose live weights stay at version 0."""
    engine, _ = _run(settings, Live(lambda n: _record(checkpoints[0])))
    for k, (before, contexts, outs) in enumerate(engine.calls):
        round_0 = all(c.size == len(Problem(0, 0).text) for c in contexts)  # every row is a bare prompt
        if round_0 and any(TASK.calls_tool(o.tokens) for o in outs):
            return k, before
    pytest.fail("no episode called the tool")


def test_weights_that_change_between_decode_steps_cut_the_turn_into_an_aborted_piece_and_its_continuation(
        plain, checkpoints):
    settings = plain[0]
    k, before = _switch_point(settings, checkpoints)
    n = before + 1  # version 0 for the round's first decode step, version 1 from its second on
    live = Live(lambda calls: _record(checkpoints[0] if calls < n else checkpoints[1]))
    engine, turns = _run(settings, live)
    assert engine.loads == 2 and engine.version == 1 and engine.refused == {}
    assert engine.calls[k][0] == before

    # the engine's versions: 0 before the switching call, [0, 1] in it, 1 after it
    switching = engine.calls[k][2]
    for j, (_, _, outs) in enumerate(engine.calls):
        for out in outs:
            expected = [0] * len(out.tokens) if j < k else [1] * len(out.tokens) if j > k else [0, 1][:len(out.tokens)]
            assert out.versions == expected, (j, out.versions)
    cut = [out for out in switching if len(out.tokens) == 2]
    assert cut and any(TASK.calls_tool(out.tokens) for out in cut)

    # groups before the switch are the plain run's (the version 0 checkpoint is the seed's weights)
    plain_turns = plain[2]
    first_group = next(s.group_index for s, _ in turns if s.status is Status.ABORTED)
    earlier = [(s, a) for s, a in turns if s.group_index < first_group]
    assert earlier and earlier == [(s, a) for s, a in plain_turns if s.group_index < first_group]

    outputs = _engine_outputs(engine, settings)
    episodes = _by_episode(turns)
    aborted = [s for s, _ in turns if s.status is Status.ABORTED]
    assert len(aborted) == len(cut)
    for index, pieces in episodes.items():
        outs = outputs[index]
        # per token, the versions are exactly the engine's, piece after piece
        sent = [v for sample, _ in pieces for v in np.asarray(sample.rollout_token_versions).tolist()]
        assert sent == [v for out in outs for v in out.versions]
        args = [a for _, a in pieces]
        assert [a["turn"] for a in args] == list(range(len(pieces)))
        assert [a["final"] for a in args] == [False] * (len(pieces) - 1) + [True]
        spans = sum(len(set(out.versions)) for out in outs)
        assert len(pieces) == spans  # one piece per version a turn spans: the counter moves on by one per cut
        if pieces[0][0].status is not Status.ABORTED:
            continue
        (piece, piece_args), (rest, rest_args) = pieces[0], pieces[1]
        prompt = TASK.prompt_tokens(TASK.problem(piece.group_index))
        assert piece.response_length == 1 and piece.tokens.tolist() == [*prompt.tolist(), outs[0].tokens[0]]
        assert np.asarray(piece.rollout_token_versions).tolist() == [0] and piece.weight_versions == ["0"]
        assert piece.reward is None and piece_args["final"] is False and piece_args["turn"] == 0
        assert np.asarray(piece.rollout_log_probs).tolist() == outs[0].log_probs[:1]
        assert piece.metadata[FULL_LOG_PROBS] == outs[0].full_log_probs[:1]  # cut where the piece ends
        assert rest.status is Status.COMPLETED and rest.response_length == 1 and rest_args["turn"] == 1
        assert np.asarray(rest.rollout_token_versions).tolist() == [1] and rest.weight_versions == ["1"]
        assert rest.tokens.tolist() == [*prompt.tolist(), *outs[0].tokens]
        assert rest.metadata[FULL_LOG_PROBS] == outs[0].full_log_probs
        assert rest_args["final"] is (len(outs) == 1)
        if len(outs) == 2:
            assert pieces[2][1]["turn"] == 2 and pieces[2][0].weight_versions == ["1"]
    # merged, every episode is still exactly what the engine sampled
    _assert_merges_to_the_engine_outputs(turns, outputs, settings)


# ---------------------------------------------------------------------------- publishing and waiting


class DummyPublisher:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.bytes_sent = 0

    def publish_turn(self, sample, **kwargs) -> None:
        self.calls.append("publish_turn")

    def flush(self) -> None:
        self.calls.append("flush")

    def publish_end_of_run(self, run_id) -> int:
        self.calls.append("publish_end_of_run")
        return 0


class DummyWatcher:
    def __init__(self) -> None:
        self.refreshes = 0
        self.latest = None

    def refresh(self, timeout_ms: int = 0) -> None:
        self.refreshes += 1


def test_publishing_refuses_injected_faults_before_touching_the_publisher():
    publisher, watcher = DummyPublisher(), DummyWatcher()
    for follow in (None, watcher):
        with pytest.raises(ConfigError, match="inject_faults"):
            publish_policy_turns(_settings(inject_faults=True, engine="policy", episodes=2), publisher, follow)
    assert publisher.calls == [] and watcher.refreshes == 0


def _engine_following(live) -> PolicyEngine:
    return PolicyEngine(SEED, Sampler(1.0, 0.9, 20), live=live, device="cpu")


def test_waiting_for_the_first_weights_returns_their_version_once_a_checkpoint_is_live(tmp_path, caplog):
    ref = save_checkpoint(build_policy(SEED), tmp_path, version=3, step=2)
    polls: list[int] = []
    engine = _engine_following(lambda: _record(ref) if len(polls) >= 3 else None)
    with caplog.at_level(logging.INFO, logger=generator_module.__name__):
        assert wait_for_first_weights(engine, polls.append, say_every_s=0.0) == 3
    assert polls == [200, 200, 200]  # three polls of rollout.weights, then the record was there
    assert engine.loaded == (3, ref.sha256) and engine.loads == 1 and engine.version == 3
    lines = [r.getMessage() for r in caplog.records if r.name == generator_module.__name__]
    assert lines[0].startswith("waiting for the trainer's first checkpoint")
    assert sum(line.startswith("still waiting") for line in lines) == 3


def test_waiting_ends_with_stopped_and_a_checkpoint_that_fails_verification_does_not_end_it(tmp_path):
    polls: list[int] = []
    with pytest.raises(Stopped, match="first checkpoint"):
        wait_for_first_weights(_engine_following(lambda: None), polls.append, stop=lambda: len(polls) >= 2)
    assert polls == [200, 200]
    ref = save_checkpoint(build_policy(SEED), tmp_path, version=0, step=0)
    bad = _record(ref, sha256=hashlib.sha256(b"a torn copy").hexdigest())
    engine, polls = _engine_following(lambda: bad), []
    with pytest.raises(Stopped):
        wait_for_first_weights(engine, polls.append, stop=lambda: len(polls) >= 4)
    assert polls == [200] * 4 and engine.loaded is None and list(engine.refused) == [(0, bad.sha256)]
    stopped_at_once = []
    with pytest.raises(Stopped):
        wait_for_first_weights(_engine_following(lambda: None), stopped_at_once.append, stop=lambda: True)
    assert stopped_at_once == []
