"""Resuming a taken-over prompt group: the ledger's progress folded as the stream decides, and what a taker does
with each turn its engine makes (reuse the logged one, resume after it, or send)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.model.sample import Sample
from rollout_bus.producers.resume_plan import ResumePlan, TurnFate
from rollout_bus.wire.codec import encode_samples
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.prompt_record import EpisodeProgress, LedgerEvent, PromptGroup, PromptLedger, TurnMark
from tests.wire_schemas import problems, validate

PROMPT = PromptGroup("q-1", 3, [1, 2, 3], 2)


def mark(turn: int, offset: int, *, sample: int = 0, attempt: int = 0, final: bool = False,
         resumed: bool = False) -> TurnMark:
    return TurnMark(sample, attempt, turn, final, resumed, 1, offset)


def progress(delivery: int, m: TurnMark, prompt: str = "q-1") -> LedgerEvent:
    return LedgerEvent("progress", prompt, delivery, f"gen-{delivery}", mark=m)


def fold(*events: LedgerEvent) -> PromptLedger:
    ledger = PromptLedger()
    for event in events:
        ledger.take(event)
    return ledger


def test_a_progress_event_round_trips_and_matches_the_schema_and_the_others_stay_six_fields():
    event = progress(2, mark(3, 41, sample=1, final=True, resumed=True))
    assert LedgerEvent.from_value(event.value()) == event
    assert event.value() == (b'{"count":0,"delivery":2,"event":"progress","generator":"gen-2","mark":{"attempt":0,'
                             b'"final":true,"offset":41,"partition":1,"resumed":true,"sample":1,"turn":3},'
                             b'"prompt":"q-1","reason":""}')
    import json
    validate("ledger_event", json.loads(event.value()))
    claimed = LedgerEvent("claimed", "q-1", 1, "gen-1")
    assert b"mark" not in claimed.value() and LedgerEvent.from_value(claimed.value()) == claimed
    assert problems("ledger_event", json.loads(claimed.value()) | {"mark": json.loads(event.value())["mark"]})
    assert problems("ledger_event", json.loads(event.value()) | {"mark": None})


@pytest.mark.parametrize("bad", [
    b'{"count":0,"delivery":2,"event":"progress","generator":"g","prompt":"q","reason":""}',
    b'{"count":0,"delivery":2,"event":"progress","generator":"g","prompt":"q","reason":"","mark":{"turn":1}}',
    b'{"count":0,"delivery":2,"event":"progress","generator":"g","prompt":"q","reason":"","mark":{"attempt":0,'
    b'"final":1,"offset":4,"partition":1,"resumed":false,"sample":0,"turn":1}}',
])
def test_a_malformed_progress_event_is_refused_naming_the_mark(bad):
    with pytest.raises(ContractError, match="mark"):
        LedgerEvent.from_value(bad)


def test_the_fold_follows_the_stream_takeover_resume_zombie_and_attempts():
    ledger = fold(progress(1, mark(0, 10)), progress(1, mark(1, 11)), progress(1, mark(2, 12)))
    held = ledger.progress["q-1"][0]
    assert (held.delivery, [m.offset for m in held.marks], held.finished) == (1, [10, 11, 12], False)
    # delivery 2 resumes at turn 2 (the log held 0-1 when it took over); the zombie's turn 3 is fenced
    ledger.take(progress(2, mark(2, 20, resumed=True)))
    ledger.take(progress(1, mark(3, 13)))
    ledger.take(progress(2, mark(3, 21, final=True)))
    held = ledger.progress["q-1"][0]
    assert (held.delivery, [m.offset for m in held.marks], held.finished) == (2, [10, 11, 20, 21], True)
    # a third delivery redoing a finished episode changes nothing
    ledger.take(progress(3, mark(0, 30)))
    assert ledger.progress["q-1"][0] == held
    # a takeover at turn 0 starts again; a new attempt within a delivery too; a turn that skips one is not merged
    other = fold(progress(1, mark(0, 1, sample=1)), progress(2, mark(0, 2, sample=1)),
                 progress(2, mark(0, 3, sample=1, attempt=1)), progress(2, mark(2, 4, sample=1, attempt=1)))
    assert other.progress["q-1"][1] == EpisodeProgress(2, 1, (mark(0, 3, sample=1, attempt=1),))
    # a resumed turn above what is held is not merged either (the stream holds it)
    ahead = fold(progress(1, mark(0, 1)), progress(2, mark(2, 2, resumed=True)))
    assert [m.offset for m in ahead.progress["q-1"][0].marks] == [1]


def test_the_progress_of_a_group_is_forgotten_when_it_ends_and_ignored_after():
    ledger = fold(progress(1, mark(0, 10)), LedgerEvent("done", "q-1", 1, "gen-1"), progress(1, mark(1, 11)))
    assert "q-1" not in ledger.progress


def _turns(rollout_id: int, count: int) -> list[bytes]:
    """``count`` real turn payloads (distinct bytes) of one episode."""
    from tests.unit.streams.test_episode_state import _episode

    return [encode_samples([s], TURN_FIELDS) for s in _episode(rollout_id, count)]


A, B = _turns(1, 4), _turns(2, 2)
OTHER = _turns(3, 1)[0]


def _sample(j: int, length: int = 3) -> Sample:
    return SimpleNamespace(index=PROMPT.group_index * PROMPT.n_samples + j, response_length=length)


def _records(values: dict[int, bytes]) -> dict:
    return {(1, offset): SimpleNamespace(value=value) for offset, value in values.items()}


def test_a_plan_reuses_the_logged_turns_resumes_after_them_and_counts():
    held = {0: EpisodeProgress(1, 0, (mark(0, 10), mark(1, 11))),
            1: EpisodeProgress(1, 0, (mark(0, 12, sample=1), mark(1, 13, sample=1, final=True)))}
    plan = ResumePlan.of(PROMPT, held, _records({10: A[0], 11: A[1], 12: B[0], 13: B[1]}))
    assert {j: len(logged.turns) for j, logged in plan.logged.items()} == {0: 2, 1: 2} and not plan.missing
    assert encode_samples([plan.logged[0].turns[1]], TURN_FIELDS) == A[1]  # decoded, as the engine continues from them
    fates = [plan.take(0, _sample(0), {"turn": 0, "attempt": 0, "final": False}, A[0]),
             plan.take(1, _sample(1), {"turn": 0, "attempt": 0, "final": False}, B[0]),
             plan.take(0, _sample(0), {"turn": 1, "attempt": 0, "final": False}, A[1]),
             plan.take(1, _sample(1), {"turn": 1, "attempt": 0, "final": True}, B[1]),
             plan.take(0, _sample(0), {"turn": 2, "attempt": 0, "final": False}, A[2]),
             plan.take(0, _sample(0), {"turn": 3, "attempt": 0, "final": True}, A[3])]
    assert fates == [TurnFate.REUSE] * 4 + [TurnFate.RESUME, TurnFate.SEND]
    assert (plan.reused_turns, plan.reused_tokens, plan.resumed_episodes, plan.reused_episodes) == (4, 12, 1, 1)


def test_a_turn_that_differs_from_the_log_resumes_there_and_a_first_turn_that_differs_is_a_takeover():
    held = {0: EpisodeProgress(1, 0, (mark(0, 10), mark(1, 11), mark(2, 12))),
            1: EpisodeProgress(1, 0, (mark(0, 13, sample=1),))}
    plan = ResumePlan.of(PROMPT, held, _records({10: A[0], 11: A[1], 12: A[2], 13: B[0]}))
    assert plan.take(0, _sample(0), {"turn": 0, "attempt": 0, "final": False}, A[0]) is TurnFate.REUSE
    assert plan.take(0, _sample(0), {"turn": 1, "attempt": 0, "final": False}, OTHER) is TurnFate.RESUME
    assert plan.take(0, _sample(0), {"turn": 2, "attempt": 0, "final": False}, A[2]) is TurnFate.SEND  # diverged
    assert plan.take(1, _sample(1), {"turn": 0, "attempt": 0, "final": False}, OTHER) is TurnFate.SEND
    assert plan.take(1, _sample(1), {"turn": 1, "attempt": 0, "final": True}, B[1]) is TurnFate.SEND
    assert plan.resumed_episodes == 1 and plan.reused_turns == 1


def test_a_turn_the_log_no_longer_holds_or_that_does_not_decode_is_named_and_what_comes_before_it_is_kept():
    held = {0: EpisodeProgress(1, 0, (mark(0, 10), mark(1, 11), mark(2, 12))),
            1: EpisodeProgress(1, 0, (mark(0, 13, sample=1), mark(1, 14, sample=1)))}
    plan = ResumePlan.of(PROMPT, held, _records({10: A[0], 12: A[2], 13: B[0], 14: b"not a payload"}))
    assert {j: len(logged.turns) for j, logged in plan.logged.items()} == {0: 1, 1: 1}  # offset 11 deleted (retention)
    assert plan.missing == ["episode 0 turn 1 at 1:11", "episode 1 turn 1 at 1:14"]
    assert plan.take(0, _sample(0), {"turn": 0, "attempt": 0, "final": False}, A[0]) is TurnFate.REUSE
    assert plan.take(0, _sample(0), {"turn": 1, "attempt": 0, "final": False}, A[1]) is TurnFate.RESUME


def test_an_empty_plan_sends_everything():
    plan = ResumePlan.of(PROMPT, {}, {})
    assert plan.logged == {} and plan.take(0, _sample(0), {"turn": 0, "attempt": 0, "final": True}, A[0]) is \
        TurnFate.SEND


def test_a_logged_turn_made_final_now_is_sent_again_as_the_final_one():
    held = {0: EpisodeProgress(1, 0, (mark(0, 10), mark(1, 11)))}
    plan = ResumePlan.of(PROMPT, held, _records({10: A[0], 11: A[1]}))
    assert plan.take(0, _sample(0), {"turn": 0, "attempt": 0, "final": False}, A[0]) is TurnFate.REUSE
    assert plan.take(0, _sample(0), {"turn": 1, "attempt": 0, "final": True}, A[1]) is TurnFate.RESUME


def test_what_resuming_saved_reaches_the_generators_flow_and_a_seeded_generators_flow_is_as_before():
    from rollout_bus.producers.prompt_member import MemberSummary
    from rollout_bus.wire.flow_metrics import (GATE_WAITS, RESUMED_EPISODES, REUSED_EPISODES, REUSED_TOKENS,
                                               REUSED_TURNS, generator_flow)

    summary = MemberSummary(turns_reused=7, tokens_reused=90, episodes_resumed=2, episodes_reused=1)
    flow = generator_flow(0.0, 0, 10.0, summary.resume_counts())
    assert {k: flow[k] for k in (RESUMED_EPISODES, REUSED_EPISODES, REUSED_TURNS, REUSED_TOKENS)} == \
        {RESUMED_EPISODES: 2.0, REUSED_EPISODES: 1.0, REUSED_TURNS: 7.0, REUSED_TOKENS: 90.0}
    assert set(generator_flow(0.0, 0, 10.0)) == {k for k in flow if "reuse" not in k and "resumed" not in k}
    assert GATE_WAITS in flow and summary.to_json()["turns_reused"] == 7


def test_a_mark_with_the_environments_answer_round_trips_and_a_bad_answer_is_refused():
    import json
    event = progress(1, TurnMark(0, 0, 1, False, False, 1, 11, (7, 8, 9)))
    doc = json.loads(event.value())
    assert doc["mark"]["observation"] == [7, 8, 9] and LedgerEvent.from_value(event.value()) == event
    validate("ledger_event", doc)
    assert b"observation" not in progress(1, mark(1, 11)).value()  # none: the key is left out
    assert problems("ledger_event", doc | {"mark": doc["mark"] | {"observation": [-1]}})
    for bad in ([-1], "7 8", [1.5], [True]):
        with pytest.raises(ContractError, match="observation"):
            TurnMark(0, 0, 1, False, False, 1, 11, bad)


def test_the_answer_noted_with_the_last_logged_turn_reaches_the_engine_and_only_with_every_turn_found():
    held = {0: EpisodeProgress(1, 0, (mark(0, 10), TurnMark(0, 0, 1, False, False, 1, 11, (5, 6))))}
    whole = ResumePlan.of(PROMPT, held, _records({10: A[0], 11: A[1]})).logged[0]
    assert whole.observation == (5, 6) and whole.observation_after(1) == [5, 6]
    assert whole.observation_after(0) is not None and whole.observation_after(2) is None
    cut = ResumePlan.of(PROMPT, held, _records({10: A[0]})).logged[0]  # turn 1 gone: its answer is no use
    assert len(cut.turns) == 1 and cut.observation is None and cut.observation_after(0) is None


def test_the_environment_is_given_back_what_the_log_holds_and_asked_only_for_the_rest():
    from rollout_bus.producers.resume_plan import Logged, env_answer

    class Env:
        def __init__(self):
            self.calls = []

        def step(self, so_far):
            self.calls.append("step")
            return [1]

        def record(self, so_far, observation):
            self.calls.append(("record", tuple(observation)))

    held = {0: EpisodeProgress(1, 0, (mark(0, 10), TurnMark(0, 0, 1, False, False, 1, 11, (5, 6))))}
    logged = ResumePlan.of(PROMPT, held, _records({10: A[0], 11: A[1]})).logged[0]
    env = Env()
    assert env_answer(env, None, logged, 1) == [5, 6] and env.calls == [("record", (5, 6))]
    assert env_answer(env, None, logged, 2) == [1] and env.calls[-1] == "step"  # past the log: run
    assert env_answer(env, None, None, 0) == [1]  # nothing logged: run
    other = Logged(0, logged.turns, False, (5, 6))
    made = SimpleNamespace(tokens=[0])  # an engine that made turn 1 otherwise: its answer is not the logged one
    assert env_answer(env, None, other, 1, made) == [1] and env.calls[-1] == "step"
