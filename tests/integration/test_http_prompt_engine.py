"""`rollout-bus generate --from-prompts --engine http` on the real broker, against a local server in SGLang's
shapes: multi-turn episodes through an environment plug-in, scored by a reward plug-in; a prompt whose reward
raises is failed after its deliveries and dead-lettered with the plug-in named; a sample whose engine dies on
every try fails its prompt group at once (named, no delivery again) while the other groups are done; a member
killed mid-episode is resumed from the log by the next, and no tool call whose result is on the log runs again."""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import pytest

from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.kafka.prompt_ledger import read_ledger
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.wire.codec import decode_samples
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.headers import TurnHeaders
from rollout_bus.wire.prompt_record import EpisodeProgress, PromptGroup
from rollout_bus.wire.topics import Topics
from tests.engine_server import DIE, FixtureEngine, stopping_answer
from tests.integration.pipeline_harness import wait_until
from tests.integration.prompt_group_harness import Member, ledger_counts, put_prompts, synthetic_prompts

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 2


@pytest.fixture
def run_topics(client_kwargs, monkeypatch) -> Topics:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the members import the plug-ins from tests.prompt_plugins
    topics = Topics(prefix=f"h{uuid.uuid4().hex[:10]}.")
    ensure_topics(client_kwargs, topics)
    return topics


def read(client_kwargs, topic: str) -> list:
    reader = TopicReader(client_kwargs, [topic])
    try:
        return reader.read_to_end().get(topic, [])
    finally:
        reader.close()


def http_member(kafka_bootstrap, topics, tmp_path, engine: FixtureEngine, *extra: str) -> Member:
    return Member(kafka_bootstrap, topics, tmp_path, "--engine", "http", "--engine-url", engine.url, *extra)


def test_multi_turn_episodes_are_made_scored_and_a_prompt_whose_reward_raises_is_failed_with_the_plugin_named(
        kafka_bootstrap, client_kwargs, run_topics, tmp_path):
    good = synthetic_prompts(3, SAMPLES)
    poisoned = PromptGroup("q-poison", 3, [7, 8, 9], SAMPLES)
    put_prompts(client_kwargs, run_topics, good + [poisoned])
    with FixtureEngine() as engine:
        engine.answer("/generate", stopping_answer())  # turns that complete: the environment goes on
        member = http_member(kafka_bootstrap, run_topics, tmp_path, engine, "--env", "tests.prompt_plugins:two_turns",
                             "--reward-fn", "tests.prompt_plugins:unless_poisoned", "--max-deliveries", "2")
        assert member.wait(180) == 0, member.log()[-3000:]
    assert ledger_counts(client_kwargs, run_topics) == {"loaded": 4, "done": 3, "failed": 1, "in_flight": 0,
                                                       "redelivered": 1}
    [letter] = [d for d in (DeadLetter.from_record(r.key, r.value, r.headers) for r in read(client_kwargs,
                                                                                           run_topics.dlq))
                if d.kind == "failed_prompt"]
    assert letter.key == b"q-poison" and "delivered 2 times" in letter.reason
    assert ("PluginFailed: reward function tests.prompt_plugins:unless_poisoned raised on episode 0 of prompt group "
            "q-poison (group_index 3, index 6): ValueError: cannot score q-poison") in letter.reason
    turns = []
    for record in read(client_kwargs, run_topics.turns):
        if record.key is None or not record.key.startswith(b"["):
            continue  # the run's end-of-run markers
        (sample,), _ = decode_samples(record.value, TURN_FIELDS)
        turns.append((sample, TurnHeaders.from_kafka(record.headers)))
    done = [(s, h) for s, h in turns if s.metadata["prompt_id"] != "q-poison"]
    assert sorted((s.group_index, s.index, h.turn, h.final) for s, h in done) == sorted(
        (g, g * SAMPLES + j, t, t == 1) for g in range(3) for j in range(SAMPLES) for t in range(2))
    assert {s.reward for s, h in done if h.final} == {1.0} and {s.reward for s, h in done if not h.final} == {None}
    assert all(h.delivery == 1 for _, h in done)
    assert [(h.turn, h.final, h.delivery) for s, h in turns if s.metadata["prompt_id"] == "q-poison"] == \
        [(0, False, 1), (0, False, 2)]  # its first turn went out each delivery; no final turn, no reward


def test_a_sample_whose_engine_always_dies_fails_its_prompt_group_at_once_and_the_others_are_done(
        kafka_bootstrap, client_kwargs, run_topics, tmp_path):
    dying = PromptGroup("q-dies", 3, DIE, SAMPLES)  # the engine dies on this context, every time
    put_prompts(client_kwargs, run_topics, synthetic_prompts(3, SAMPLES) + [dying])
    with FixtureEngine() as engine:
        member = http_member(kafka_bootstrap, run_topics, tmp_path, engine, "--concurrency", "1")
        assert member.wait(180) == 0, member.log()[-3000:]
        assert sum(body.get("input_ids") == DIE for _, body in engine.requests) == 3  # a try and two retries
    ledger = read_ledger(client_kwargs, run_topics)
    counts = ledger.counts()
    assert (counts["loaded"], counts["done"], counts["failed"], counts["in_flight"]) == (4, 3, 1, 0), counts
    # failed at once: no delivery again. (Another group may be delivered twice: on a starved machine the member's
    # group was seen to rebalance, and kafka-python to leave that rebalance unfinished until the member rejoined,
    # handing back what it held; that group is then resumed from the log, still exactly once.)
    assert ledger.deliveries["q-dies"] == 1 and ledger.ended["q-dies"] == "failed", ledger
    [letter] = [d for d in (DeadLetter.from_record(r.key, r.value, r.headers) for r in read(client_kwargs,
                                                                                           run_topics.dlq))
                if d.kind == "failed_prompt"]
    assert letter.key == b"q-dies" and "failed at delivery 1: SampleFailed: episode 0 of prompt group q-dies" in \
        " ".join(letter.reason.split()) and "each of its 3 tries" in letter.reason
    log = " ".join(member.log().split())
    assert "re-sampled alone as attempt 1, its siblings kept" in log
    assert "no --reward-fn: episodes carry no reward" in log
    assert not [r for r in read(client_kwargs, run_topics.turns) if r.key and b"q-dies" in bytes(r.value or b"")]


def _tool_calls(log: str) -> list[tuple[str, int, int]]:
    """(prompt group, episode, step) of every tool call the built-in tool environment ran, as its member logged."""
    return [(p, int(j), int(k)) for p, j, k in
            re.findall(r"tool call executed: prompt group (\S+) episode (\d+) step (\d+)", log)]


def test_a_member_killed_mid_episode_is_resumed_and_no_tool_call_whose_result_is_on_the_log_runs_again(
        kafka_bootstrap, client_kwargs, run_topics, tmp_path):
    """The issue's side-effect check: the built-in tool environment logs every call it runs. A member is killed -9
    while its episodes are part-way through (an engine call takes 0.7 s); the one that takes the prompt groups over
    continues each episode from its logged turns and the answers noted with them, so the tool calls it runs are
    only those whose answers never reached the log (the ledger read after the kill says which), and the calls of
    both together are every call of an undisturbed run once, plus at most the one per episode that the victim ran
    and died before noting."""
    prompts = [PromptGroup(f"q-tools-{i}", i, [5, 6, 7 + i], SAMPLES) for i in range(3)]
    put_prompts(client_kwargs, run_topics, prompts)
    tools = ("--env", "rollout_bus.sim.environment:tool_env", "--reward-fn", "tests.prompt_plugins:response_length",
             "--max-turns", "6", "--concurrency", "3")
    with FixtureEngine() as engine:
        engine.answer("/generate", stopping_answer())  # turns that complete: the environment goes on
        engine.delay(0.7)
        victim = http_member(kafka_bootstrap, run_topics, tmp_path, engine, *tools)

        def in_flight() -> dict[tuple[str, int], EpisodeProgress]:
            ledger = read_ledger(client_kwargs, run_topics)
            return {(p, j): e for p, episodes in ledger.progress.items() for j, e in episodes.items()
                    if not e.finished}

        wait_until(lambda: any(len(e.marks) >= 2 for e in in_flight().values()), 120,
                   "an episode of the victim with two turns on the log and more to come")
        victim.kill()
        time.sleep(0.5)  # what the victim's socket held reaches the ledger
        at_kill = {key: e.answers_logged for key, e in in_flight().items()}  # its tool calls' answers on the log
        engine.delay(0.0)
        taker = http_member(kafka_bootstrap, run_topics, tmp_path, engine, *tools)
        assert taker.wait(180) == 0, taker.log()[-3000:]
        undisturbed_topics = Topics(prefix=f"h{uuid.uuid4().hex[:10]}.")
        ensure_topics(client_kwargs, undisturbed_topics)
        put_prompts(client_kwargs, undisturbed_topics, prompts)
        alone = http_member(kafka_bootstrap, undisturbed_topics, tmp_path, engine, *tools)
        assert alone.wait(180) == 0, alone.log()[-3000:]
    counts = ledger_counts(client_kwargs, run_topics)
    assert (counts["done"], counts["failed"], counts["in_flight"]) == (3, 0, 0) and counts["redelivered"] >= 1, counts
    ran_victim, ran_taker, ran_alone = (_tool_calls(m.log()) for m in (victim, taker, alone))
    assert len(set(ran_alone)) == len(ran_alone) and set(ran_victim) | set(ran_taker) == set(ran_alone)
    for prompt, j, step in ran_taker:  # a step whose answer is on the log (noted with its turn) never runs again
        assert step > at_kill.get((prompt, j), 0), (prompt, j, step, at_kill)
    again = [call for call in ran_taker if call in set(ran_victim)]  # the victim ran them, their answers unnoted
    assert len(again) <= sum(1 for (p, j), answered in at_kill.items() if (p, j, answered + 1) in set(ran_victim))
    summary = taker.summary()
    assert summary["turns_reused"] >= 2 and summary["episodes_resumed"] >= 1, summary
